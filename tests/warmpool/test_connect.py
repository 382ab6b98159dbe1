"""NATS connections: flags over environment, clear errors when the server is away or refuses us, and a refused
permission named instead of waited out."""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client

from tests.helpers import wait_for
from warmpool import connect
from warmpool.embedded import NatsServer, free_port
from warmpool.errors import NatsUnavailable

USERS = """
authorization {
  users = [
    {user: ops, password: s3cret, permissions: {publish: {deny: ["forbidden.>"]}}}
  ]
}
"""
SLOW_DEADLINE_S = 20.0
"""A connect deadline no refusal may wait for."""


def parse(argv: list[str], env: dict[str, str]) -> connect.NatsOptions:
    p = argparse.ArgumentParser()
    connect.add_nats_arguments(p)
    return connect.options_from_args(p.parse_args(argv), name="t", env=env)


def test_flags_override_environment() -> None:
    env = {
        "PULSESCALE_NATS_URL": "nats://env:4222,nats://env2:4222",
        "PULSESCALE_NATS_TOKEN": "envtoken",
        "PULSESCALE_NATS_USER": "envuser",
        "PULSESCALE_NATS_CREDS": "/env.creds",
        "PULSESCALE_NATS_TLS_CA": "/ca",
    }
    o = parse([], env)
    assert o.servers == ("nats://env:4222", "nats://env2:4222")
    assert (o.token, o.user, o.creds_file, o.tls_ca_file) == ("envtoken", "envuser", "/env.creds", "/ca")
    o = parse(["--nats", "nats://flag:1", "--nats-token", "t2"], env)
    assert o.servers == ("nats://flag:1",) and o.token == "t2" and o.user == "envuser"
    assert parse([], {}).servers == (connect.DEFAULT_URL,)


def test_connect_timeout_from_flag_or_environment(capsys: pytest.CaptureFixture[str]) -> None:
    env = {"PULSESCALE_NATS_CONNECT_TIMEOUT": "0.5"}
    assert parse([], {}).connect_deadline_s == connect.DEFAULT_CONNECT_DEADLINE_S == 5.0
    assert parse([], env).connect_deadline_s == 0.5
    assert parse(["--nats-connect-timeout", "12"], env).connect_deadline_s == 12.0
    assert parse(["--nats-connect-timeout", "5s"], env).connect_deadline_s == 5.0  # a duration, as everywhere
    assert parse([], {"PULSESCALE_NATS_CONNECT_TIMEOUT": "1500ms"}).connect_deadline_s == 1.5
    with pytest.raises(NatsUnavailable, match="PULSESCALE_NATS_CONNECT_TIMEOUT: 'soon' is not a duration"):
        parse([], {"PULSESCALE_NATS_CONNECT_TIMEOUT": "soon"})
    for bad in ("0", "-1", "nan", "inf", "5 parsecs"):
        with pytest.raises(SystemExit):
            parse(["--nats-connect-timeout", bad], {})
        err = capsys.readouterr().err
        assert f"argument --nats-connect-timeout: '{bad}' is" in err and "500ms, 90s" in err, err


async def test_unreachable_server_is_reported_quickly() -> None:
    opts = connect.NatsOptions(servers=(f"nats://127.0.0.1:{free_port()}",), connect_deadline_s=1.0)
    t0 = time.monotonic()
    with pytest.raises(NatsUnavailable, match="nothing listens there"):
        await connect.connect(opts)
    assert time.monotonic() - t0 < 5


async def test_a_connect_cancelled_mid_handshake_closes_its_socket() -> None:
    # A stopping daemon cancels its connect; nats-py leaves the half-open transport to the garbage collector (CI
    # saw its ResourceWarning fail an unrelated test). The listener accepts and never says INFO.
    accepted = asyncio.Event()
    hung_up: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.set()
        hung_up.set_result(await reader.read())  # what the client sent, once it closes its end
        writer.close()

    listener = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    try:
        opts = connect.NatsOptions(servers=(f"nats://127.0.0.1:{port}",), connect_deadline_s=SLOW_DEADLINE_S)
        attempt = asyncio.ensure_future(connect.connect(opts))
        await asyncio.wait_for(accepted.wait(), 5)
        await asyncio.sleep(0.1)  # well into the wait for INFO
        attempt.cancel()
        with pytest.raises(asyncio.CancelledError):
            await attempt
        # The client's socket is closed: the server sees its end of file, not silence until the bound.
        assert await asyncio.wait_for(hung_up, 5) == b""
    finally:
        listener.close()
        await listener.wait_closed()


@pytest.mark.parametrize(
    ("auth", "bad", "good"),
    [
        ('authorization { user: "ops", password: "s3cret" }', {"user": "ops", "password": "wrong"},
         {"user": "ops", "password": "s3cret"}),
        ('authorization { token: "tok" }', {"token": "wrong"}, {"token": "tok"}),
    ],
    ids=["password", "token"],
)  # fmt: skip
async def test_refused_credentials_fail_at_the_first_refusal(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, auth: str, bad: dict[str, Any], good: dict[str, Any]
) -> None:
    with NatsServer(tmp_path, extra_config=auth) as server:
        refused = replace(connect.NatsOptions(servers=(server.url,), connect_deadline_s=SLOW_DEADLINE_S), **bad)
        t0 = time.monotonic()
        with pytest.raises(NatsUnavailable, match="Authorization Violation'; the server refused our credentials"):
            await connect.connect(refused)
        assert time.monotonic() - t0 < SLOW_DEADLINE_S / 4  # generous; retrying the same password waits it out
        # Said once, by the error: nothing logged while connecting (a CLI would print it as more lines).
        assert [r for r in caplog.records if r.name == "pulsescale.nats"] == []
        nc = await connect.connect(replace(connect.NatsOptions(servers=(server.url,)), **good))
        assert nc.is_connected
        await nc.close()


async def test_missing_creds_file_is_named() -> None:
    with pytest.raises(NatsUnavailable, match="credentials file"):
        await connect.connect(connect.NatsOptions(creds_file="/nonexistent.creds"))


async def test_bad_tls_ca_is_named(tmp_path) -> None:  # type: ignore[no-untyped-def]
    ca = tmp_path / "ca.pem"
    ca.write_text("not a certificate")
    with pytest.raises(NatsUnavailable, match="TLS CA"):
        await connect.connect(connect.NatsOptions(tls_ca_file=str(ca)))


# --- permissions ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "operation", "subject"),
    [
        ('nats: permissions violation for publish to "pulse.cmd.scale"', "publish", "pulse.cmd.scale"),
        ('nats: permissions violation for subscription to "_inbox.abc.*"', "subscribe", "_INBOX.abc.*"),
        (
            'nats: permissions violation for publish to "$js.api.stream.info.kv_pulse_slots"',
            "publish",
            "$JS.API.STREAM.INFO.KV_pulse_slots",
        ),
        ('nats: permissions violation for publish to "$js.api.stream.info.pulse_audit"', "publish",
         "$JS.API.STREAM.INFO.PULSE_AUDIT"),
        ('nats: permissions violation for publish to "$kv.pulse_slots.qwen.n1.s0"', "publish",
         "$KV.pulse_slots.qwen.n1.s0"),
    ],
)  # fmt: skip
def test_a_permission_violation_names_its_subject_in_the_case_it_is_granted(
    error: str, operation: str, subject: str
) -> None:
    denied = connect.permission_denied(Exception(error))
    assert denied is not None and (denied.operation, denied.subject) == (operation, subject)
    assert str(denied).startswith(f"refused: permission denied on {subject} (this NATS user may not {operation}")
    assert isinstance(denied, NatsUnavailable)  # the dispatcher prints it as one line, exit 1
    assert connect.permission_denied(Exception("nats: 'Authorization Violation'")) is None


@pytest.fixture
def users_server(tmp_path: Path) -> Iterator[NatsServer]:
    with NatsServer(tmp_path, extra_config=USERS) as server:
        yield server


def ops(server: NatsServer) -> connect.NatsOptions:
    return connect.NatsOptions(servers=(server.url,), user="ops", password="s3cret")


async def test_a_denied_request_is_refused_at_once_not_timed_out(users_server: NatsServer) -> None:
    async def ask(nc: Client) -> bytes:
        return (await nc.request("forbidden.thing", b"?", timeout=SLOW_DEADLINE_S)).data

    t0 = time.monotonic()
    with pytest.raises(connect.PermissionDenied) as err:
        await connect.run_client(ops(users_server), ask)
    assert time.monotonic() - t0 < SLOW_DEADLINE_S / 4
    assert (err.value.operation, err.value.subject) == ("publish", "forbidden.thing")


async def test_a_denied_publish_is_not_reported_as_sent(users_server: NatsServer) -> None:
    async def publish(nc: Client) -> str:
        await nc.publish("forbidden.thing", b"!")
        await nc.flush()  # the server's refusal arrives before the flush's answer
        return "sent"

    with pytest.raises(connect.PermissionDenied, match=r"forbidden\.thing"):
        await connect.run_client(ops(users_server), publish)

    async def allowed(nc: Client) -> str:
        await nc.publish("allowed.thing", b"!")
        await nc.flush()
        return "sent"

    assert await connect.run_client(ops(users_server), allowed) == "sent"


async def test_a_daemon_is_stopped_by_a_refusal_only_until_it_serves(
    users_server: NatsServer, caplog: pytest.LogCaptureFixture
) -> None:
    async def daemon(opts: connect.NatsOptions, ready: asyncio.Event, serve_first: bool) -> str:
        nc = await connect.connect(opts)
        try:
            if serve_first:
                ready.set()
            await nc.publish("forbidden.thing", b"!")
            await nc.flush()
            await asyncio.sleep(0.2)  # a refusal would end it here
            return "carried on"
        finally:
            await nc.close()

    starting = asyncio.Event()
    with pytest.raises(connect.PermissionDenied, match=r"forbidden\.thing"):
        await connect.run_daemon(ops(users_server), lambda o: daemon(o, starting, False), starting)
    serving = asyncio.Event()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pulsescale.nats"):
        result = await connect.run_daemon(ops(users_server), lambda o: daemon(o, serving, True), serving)
    assert result == "carried on"
    assert [r.getMessage() for r in caplog.records if r.name == "pulsescale.nats"] == [
        str(connect.PermissionDenied("publish", "forbidden.thing"))
    ]


async def test_slow_consumer_drops_are_counted_and_logged_a_few_times(
    nats_server: NatsServer, nc: Client, caplog: pytest.LogCaptureFixture
) -> None:
    # nats-py reports every message it drops for a full pending queue as an error naming the subject: without
    # a bound, a flood is one log line per dropped sample (~92,000 per replica were seen).
    published, delivered = 3_000, 0
    with caplog.at_level(logging.WARNING, logger="pulsescale.nats"):
        consumer = await connect.connect(connect.NatsOptions(servers=(nats_server.url,), name="slow"))
        try:

            async def slow(msg: Any) -> None:
                nonlocal delivered
                delivered += 1
                await asyncio.sleep(0.001)

            sub = await consumer.subscribe("flood.*", cb=slow, pending_msgs_limit=10)
            await consumer.flush()
            for i in range(published):
                await nc.publish(f"flood.{i % 7}", b"x")
            await nc.flush()
            # Every message taken in by the consumer (queued, delivered or dropped): after its flush alone, its
            # close came before nats-py had read them in 3 of 40 runs (in_msgs 0, nothing dropped, nothing logged).
            await wait_for(lambda: consumer.stats["in_msgs"] >= published, 10, "every message read")
            await wait_for(lambda: sub.pending_msgs == 0, 10, "the queued messages delivered")
        finally:
            await consumer.close()  # reports the drops since the last line
    lines = [r.getMessage() for r in caplog.records if r.name == "pulsescale.nats"]
    assert 2 <= len(lines) <= 3, lines  # the first drop at once, the rest at close (one more if 10 s passed)
    counts = [int(line.split("dropped ")[1].split(" ")[0]) for line in lines]
    assert sum(counts) == published - delivered > 0, (lines, delivered)
    assert all("slow consumer" in line and "flood." in line for line in lines)


def test_slow_consumer_log_at_most_once_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    slow = connect.SlowConsumerLog(10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="pulsescale.nats"):
        for step in range(301):  # 30 s of drops, ten a second
            now[0] = step / 10
            slow.dropped("pulse.queue.m")
        slow.report()  # at close: what is left
        slow.report()  # nothing left: no line
    counts = [int(r.getMessage().split("dropped ")[1].split(" ")[0]) for r in caplog.records]
    assert counts == [1, 100, 100, 100]  # at 0 s (the first drop at once), 10 s, 20 s and 30 s
    now[0] = 31.0
    with caplog.at_level(logging.WARNING, logger="pulsescale.nats"):
        slow.dropped("pulse.queue.m")
        slow.report()
    assert slow.total == 302
    assert "dropped 1 message(s) since the last report (302 in all; e.g. on pulse.queue.m)" in caplog.messages[-1]
