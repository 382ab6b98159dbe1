"""The LiteLLM hook's engine without LiteLLM: the book's counts as a table of events on a hand clock, the
settings it reads from the environment, and the hook publishing on a real nats-server, or counting on without one
(issue 28). `test_litellm.py` runs it inside a real LiteLLM proxy."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from pathlib import Path

import pytest
from nats.aio.client import Client

from integrations.demand import DemandBook
from integrations.errors import BadHookSetting
from integrations.hook import DemandHook
from integrations.settings import HookSettings, ModelMap
from tests.helpers import wait_for
from warmpool import connect, protocol
from warmpool.embedded import NatsServer
from warmpool.errors import BadInput
from warmpool.protocol import QueueSample

# (event, call id, model or outcome, now) -> (queue_depth, inflight, arrivals, completions, timeouts, failed) of "m"
BOOK = [
    ("arrive", "a", "m", 0.0, (1, 0, 1, 0, 0, 0)),
    ("arrive", "b", "m", 0.1, (2, 0, 2, 0, 0, 0)),
    ("arrive", "b", "m", 0.1, (2, 0, 2, 0, 0, 0)),  # a live id again (a client's x-litellm-call-id): not counted
    ("dispatch", "a", None, 0.2, (1, 1, 2, 0, 0, 0)),
    ("dispatch", "a", None, 0.3, (1, 1, 2, 0, 0, 0)),  # a retry: sent again, still one in flight
    ("dispatch", "zz", None, 0.3, (1, 1, 2, 0, 0, 0)),  # never arrived (LiteLLM's own health check)
    ("end", "a", "completed", 1.0, (1, 0, 2, 1, 0, 0)),
    ("end", "a", "completed", 1.0, (1, 0, 2, 1, 0, 0)),  # LiteLLM's second report of the same end
    ("end", "b", "failed", 1.1, (0, 0, 2, 1, 0, 1)),  # refused while queued (a parallel-request limit)
    ("arrive", "c", "m", 2.0, (1, 0, 3, 1, 0, 1)),
    ("dispatch", "c", None, 2.0, (0, 1, 3, 1, 0, 1)),
    ("end", "c", "timeout", 5.0, (0, 0, 3, 1, 1, 1)),
    ("arrive", "d", "m", 6.0, (1, 0, 4, 1, 1, 1)),
    ("sweep", None, None, 15.9, (1, 0, 4, 1, 1, 1)),
    ("sweep", None, None, 16.0, (0, 0, 4, 1, 2, 1)),  # open forget_after_s (10 s): given up, a timeout
    ("end", "d", "completed", 17.0, (0, 0, 4, 1, 2, 1)),  # its late end changes nothing
]


def test_the_book_counts_each_request_once_whatever_litellm_reports() -> None:
    book = DemandBook(forget_after_s=10.0, idle_after_s=300.0, max_models=8)
    for event, call_id, arg, now, want in BOOK:
        if event == "arrive":
            book.arrive(call_id, arg, now)
        elif event == "dispatch":
            book.dispatch(call_id, now)
        elif event == "end":
            book.end(call_id, arg, now)
        else:
            book.forget_stale(now)
        t = book.tallies["m"]
        got = (t.queue_depth, t.inflight, t.arrivals_total, t.completions_total, t.timeouts_total, t.failed_total)
        assert got == want, (event, call_id, now)
        assert t.arrivals_total == sum(got[:2]) + sum(got[3:])  # every request is somewhere
    assert book.open_requests() == 0


def test_the_book_reports_which_model_changed() -> None:
    book = DemandBook(forget_after_s=10.0, idle_after_s=300.0, max_models=8)
    assert book.arrive("a", "m", 0.0) == "m"
    assert book.arrive("a", "m", 0.0) is None
    assert book.dispatch("a", 0.0) == "m" and book.dispatch("a", 0.0) is None
    assert book.end("a", "completed", 0.0) == "m" and book.end("a", "completed", 0.0) is None
    assert book.forget_stale(100.0) == set()


def test_idle_models_leave_the_table_unless_named_and_the_table_is_bounded() -> None:
    book = DemandBook(forget_after_s=10.0, idle_after_s=300.0, max_models=2)
    book.pin("chat", 0.0)
    assert book.arrive("x", "typo", 0.0) == "typo"
    assert book.arrive("y", "third", 0.0) is None  # two models counted already
    assert "third" not in book.tallies and book.open_requests() == 1
    assert book.reclaim_idle(400.0) == []  # "typo" still has a request waiting
    book.end("x", "failed", 400.0)
    assert book.reclaim_idle(699.0) == []
    assert book.reclaim_idle(700.0) == ["typo"]
    assert list(book.tallies) == ["chat"]  # named in the map: published, traffic or not
    assert book.arrive("z", "third", 701.0) == "third"


@pytest.mark.parametrize(
    ("text", "names", "others"),
    [
        ("chat", {"chat": "chat"}, False),
        ("chat=llama-3-8b, embed", {"chat": "llama-3-8b", "embed": "embed"}, False),
        ("GPT-4o=gpt4o,*", {"GPT-4o": "gpt4o"}, True),
        ("*", {}, True),
    ],
)
def test_the_model_map_reads_group_equals_model(text: str, names: dict[str, str], others: bool) -> None:
    m = ModelMap.parse(text)
    assert dict(m.names) == names and m.others is others


def test_the_model_map_decides_what_is_counted_and_under_which_name() -> None:
    assert ModelMap().model_for("chat") == "chat"  # identity by default
    assert ModelMap().model_for("openai/gpt-4o") is None  # not a pulsescale name: not counted
    m = ModelMap.parse("GPT-4o=gpt4o")
    assert m.model_for("GPT-4o") == "gpt4o" and m.model_for("chat") is None
    assert ModelMap.parse("GPT-4o=gpt4o,*").model_for("chat") == "chat"


@pytest.mark.parametrize("text", ["Chat", "chat=Llama 3", ",", "=x"])
def test_a_bad_model_map_names_the_variable(text: str) -> None:
    with pytest.raises(BadHookSetting, match="PULSESCALE_LITELLM_MODELS=") as err:
        ModelMap.parse(text)
    assert isinstance(err.value, BadInput)


def test_settings_come_from_the_environment_as_every_client_takes_them(tmp_path: Path) -> None:
    secret = tmp_path / "password"
    secret.write_text("s3cret\n")
    s = HookSettings.from_env(
        {
            "PULSESCALE_NATS_URL": "nats://a:4222,nats://b:4222",
            "PULSESCALE_NATS_USER": "gateway",
            "PULSESCALE_NATS_PASSWORD_FILE": str(secret),
            "PULSESCALE_LITELLM_MODELS": "chat=llama",
            "PULSESCALE_LITELLM_FORGET_AFTER": "30m",
        }
    )
    assert s.nats.servers == ("nats://a:4222", "nats://b:4222")
    assert (s.nats.user, s.nats.password, s.nats.name) == ("gateway", "s3cret", "pulsescale-litellm")
    assert s.models.model_for("chat") == "llama" and s.forget_after_s == 1800
    assert s.gateway_id == f"{socket.gethostname()}-{os.getpid()}"
    assert HookSettings.from_env({"PULSESCALE_GATEWAY_ID": "proxy-0"}).gateway_id == "proxy-0"
    assert HookSettings.from_env({}).nats.servers == (connect.DEFAULT_URL,)


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"PULSESCALE_LITELLM_FORGET_AFTER": "soon"}, "PULSESCALE_LITELLM_FORGET_AFTER='soon'"),
        ({"PULSESCALE_NATS_URL": "http://nats:4222"}, "not a NATS URL scheme"),
        ({"PULSESCALE_GATEWAY_ID": "x" * 129}, "PULSESCALE_GATEWAY_ID"),
    ],
)
def test_a_setting_that_cannot_be_used_is_named_when_the_proxy_loads_the_hook(env: dict[str, str], match: str) -> None:
    with pytest.raises(BadInput, match=match):
        HookSettings.from_env(env)


def _settings(url: str, **over: object) -> HookSettings:
    return HookSettings(
        nats=connect.NatsOptions(servers=(url,), name="test-hook", connect_deadline_s=1.0),
        gateway_id="proxy-test-1",
        **over,  # type: ignore[arg-type]
    )


async def _listen(nc: Client, subject: str) -> list[QueueSample]:
    seen: list[QueueSample] = []

    async def heard(msg: object) -> None:
        seen.append(protocol.decode(msg.data, QueueSample))  # type: ignore[attr-defined]

    await nc.subscribe(subject, cb=heard)
    return seen


async def test_the_hook_publishes_its_counts_on_change_and_every_100ms(nats_server: NatsServer, nc: Client) -> None:
    seen = await _listen(nc, "pulse.queue.chat")
    await nc.flush()
    hook = DemandHook(_settings(nats_server.url, models=ModelMap.parse("chat")))
    assert hook.start()
    try:
        await wait_for(lambda: seen, 5, "the named model's first sample, before any request")
        assert (seen[0].queue_depth, seen[0].inflight, seen[0].arrivals_total) == (0, 0, 0)
        for i in range(5):
            hook.arrived(f"r{i}", "chat")
        hook.dispatched("r0")
        hook.arrived("x", "other")  # not in the map: not counted, not published
        await wait_for(lambda: seen[-1].arrivals_total == 5 and seen[-1].inflight == 1, 2, "the pulse's sample")
        assert seen[-1].queue_depth == 4
        hook.ended("r0", "completed")
        await wait_for(lambda: seen[-1].completions_total == 1 and seen[-1].inflight == 0, 2, "the completion")
        n = len(seen)
        await asyncio.sleep(0.55)  # nothing changes: the 100 ms tick alone
        assert 3 <= len(seen) - n <= 8
    finally:
        await hook.aclose()
    first = seen[0].seq  # the very first may have gone before the connection was up (dropped)
    assert [s.seq for s in seen] == list(range(first, first + len(seen)))
    assert {s.gateway for s in seen} == {"proxy-test-1"} and {s.model for s in seen} == {"chat"}
    assert hook.book.tallies.keys() == {"chat"}


async def test_a_hook_called_on_another_thread_still_wakes_the_publisher(nats_server: NatsServer, nc: Client) -> None:
    seen = await _listen(nc, "pulse.queue.chat")
    hook = DemandHook(_settings(nats_server.url, sample_every_s=30.0))  # no tick: only a change publishes
    assert hook.start()
    try:
        # Connected first: a change while the link is still connecting is dropped (counted), and with no tick for
        # 30 s nothing would carry it (on a loaded machine the connect took longer than the call).
        await wait_for(lambda: hook.link.connected, 10, "the hook's NATS link")
        await asyncio.to_thread(hook.arrived, "a", "chat")
        await wait_for(lambda: seen and seen[-1].arrivals_total == 1, 5, "the change's sample")
    finally:
        await hook.aclose()


async def test_without_nats_the_hook_counts_on_logs_once_and_publishes_when_it_comes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server = NatsServer(tmp_path / "nats")  # its port is chosen; nothing listens there yet
    hook = DemandHook(_settings(server.url, reconnect_max_s=0.3))
    caplog.set_level(logging.INFO, logger="pulsescale.litellm")
    try:
        assert hook.start()
        hook.arrived("a", "chat")
        hook.dispatched("a")
        hook.arrived("b", "chat")
        await asyncio.sleep(1.5)  # several tries at connecting, and ~15 samples due
        down = [r for r in caplog.records if "requests are still counted" in r.getMessage()]
        assert len(down) == 1, [r.getMessage() for r in caplog.records]
        assert hook.link.published_total == 0 and hook.link.dropped_total >= 5
        hook.ended("a", "completed")
        server.start()
        nc = await connect.connect(connect.NatsOptions(servers=(server.url,), name="pytest"))
        try:
            seen = await _listen(nc, "pulse.queue.chat")
            await wait_for(lambda: seen, 10, "a sample once NATS is there")
            s = seen[-1]
            assert (s.arrivals_total, s.completions_total, s.queue_depth, s.inflight) == (2, 1, 1, 0)
            assert s.seq > 1  # the same run: the samples dropped meanwhile took their numbers
        finally:
            await nc.close()
        assert any("is back" in r.getMessage() for r in caplog.records)
    finally:
        await hook.aclose()
        server.kill()


async def test_the_hook_never_raises_into_the_request(caplog: pytest.LogCaptureFixture) -> None:
    hook = DemandHook(_settings("nats://127.0.0.1:1"))
    hook.arrived(None, "chat")  # no call id: not a model call
    hook.arrived("a", {"not": "a name"})
    hook.dispatched(["x"])
    hook.ended(42, "completed")

    def bug(*args: object) -> None:
        raise RuntimeError("a bug of the hook's own")

    hook.book.arrive = bug  # type: ignore[method-assign]
    hook.arrived("b", "chat")
    hook.arrived("c", "chat")
    said = [r.getMessage() for r in caplog.records if "hook error" in r.getMessage()]
    assert len(said) == 1 and "a bug of the hook's own" in said[0]
    await hook.aclose()
