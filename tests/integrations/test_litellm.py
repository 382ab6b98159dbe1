"""The LiteLLM hook inside a real LiteLLM proxy (issue 28): the proxy runs as LiteLLM's own CLI runs it, with the
hook in its ``callbacks``, in front of a slow OpenAI-compatible backend that holds every request until the test lets
it go, so a pulse piles up in flight. Its samples, decoded as the autoscaler decodes them, count what was sent, and a
real autoscaler claims warm slots for the pulse; with NATS killed the proxy answers as before, and the samples after
NATS is back carry the requests of the outage.

LiteLLM's proxy extra pins rich below what import-linter needs, so it lives in its own venv, ``.venv-litellm``
(`.ci/run` makes it: ``pip install -e '.[litellm]'``); the test skips, naming litellm, without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from nats.aio.client import Client

from tests.agent_double import AgentDouble
from tests.autoscaler.test_autoscaler import autoscaler_in_process, held, put_scaler
from tests.helpers import wait_for
from warmpool import protocol
from warmpool.embedded import NatsServer, free_port
from warmpool.errors import BadMessage
from warmpool.protocol import QueueSample
from warmpool.registry import KvSlotStore

ROOT = Path(__file__).resolve().parents[2]
MASTER_KEY = "sk-pulsescale-test-" + "0" * 32
PULSE = 12
"""Requests of the pulse, all held by the backend at once (in flight)."""
DURING_OUTAGE = 4
START_BOUND_S = 120.0
"""LiteLLM's proxy takes ~20 s to start on two cores (its imports); a bound that only catches a hang."""

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def litellm_command() -> str:
    """LiteLLM's CLI: ``$PULSESCALE_LITELLM``, ``.venv-litellm/bin/litellm``, or one beside this Python (when
    litellm is installed in the test's own venv); else the test skips, naming litellm."""
    for candidate in (os.environ.get("PULSESCALE_LITELLM"), str(ROOT / ".venv-litellm" / "bin" / "litellm")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    pytest.importorskip(
        "litellm",
        reason="litellm[proxy] is not installed: .ci/run makes .venv-litellm with pip install -e '.[litellm]'",
    )
    found = shutil.which("litellm", path=str(Path(sys.executable).parent))
    if found is None:
        pytest.skip("litellm is importable but its `litellm` CLI is not beside this Python")
    return found


class Backend:
    """An OpenAI-compatible engine (chat and text completions, streamed or not) that holds each request until
    `release` is set; a prompt of ``HOLD`` it never answers (LiteLLM times it out)."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.holding = 0

    async def answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        chat = request.path.endswith("/chat/completions")
        prompt = body["messages"][-1]["content"] if chat else body.get("prompt")
        self.holding += 1
        try:
            await (asyncio.Event().wait() if prompt == "HOLD" else self.release.wait())
        finally:
            self.holding -= 1
        head = {"id": f"x-{time.time_ns()}", "created": int(time.time()), "model": body.get("model")}
        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for word in ("o", "k"):
                delta = {"index": 0, "delta": {"content": word}, "finish_reason": None}
                chunk = {**head, "object": "chat.completion.chunk", "choices": [delta]}
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        choice = {"index": 0, "message": {"role": "assistant", "content": "ok"}} if chat else {"index": 0, "text": "ok"}
        return web.json_response(
            {
                **head,
                "object": "chat.completion" if chat else "text_completion",
                "choices": [{**choice, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        )


@contextlib.asynccontextmanager
async def backend_on(port: int) -> AsyncIterator[Backend]:
    b = Backend()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", b.answer)
    app.router.add_post("/v1/completions", b.answer)
    runner = web.AppRunner(app, shutdown_timeout=1.0)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield b
    finally:
        b.release.set()
        await runner.cleanup()


@contextlib.contextmanager
def litellm_proxy(command: str, tmp: Path, *, backend_port: int, nats_url: str) -> Iterator[tuple[int, int, Path]]:
    """LiteLLM's proxy with the hook in its callbacks: (its port, its pid, its log). Both model groups (no pulsescale
    names: upper case) are counted as pulsescale's ``chat``; ``LLM-Slow`` gives up on its backend after 1 s."""
    port = free_port()
    config = tmp / "config.yaml"
    config.write_text(
        f"""model_list:
  - model_name: LLM-Chat
    litellm_params:
      model: openai/tiny
      api_base: http://127.0.0.1:{backend_port}/v1
      api_key: none
  - model_name: LLM-Slow
    litellm_params:
      model: openai/tiny
      api_base: http://127.0.0.1:{backend_port}/v1
      api_key: none
      timeout: 1
litellm_settings:
  callbacks: integrations.litellm.handler
  num_retries: 0
general_settings:
  master_key: {MASTER_KEY}
"""
    )
    env = {
        **os.environ,
        "PULSESCALE_NATS_URL": nats_url,
        "PULSESCALE_LITELLM_MODELS": "LLM-Chat=chat,LLM-Slow=chat",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # else it fetches the cost map from the internet at import
        "PYTHONPATH": str(ROOT),  # this working tree's hook, whatever .venv-litellm was installed from
    }
    log = tmp / "litellm.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [command, "--config", str(config), "--host", "127.0.0.1", "--port", str(port)],
            cwd=tmp, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        yield port, proc.pid, log
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


async def wait_until_serving(session: aiohttp.ClientSession, port: int, log: Path) -> None:
    deadline = time.monotonic() + START_BOUND_S
    while time.monotonic() < deadline:
        with contextlib.suppress(aiohttp.ClientError):
            async with session.get(f"http://127.0.0.1:{port}/health/liveliness") as r:
                if r.status == 200:
                    return
        await asyncio.sleep(0.25)
    tail = log.read_text()[-4000:]  # noqa: ASYNC240 - the test is failing: one read of its evidence
    raise AssertionError(f"LiteLLM's proxy did not serve within {START_BOUND_S:g} s:\n{tail}")


async def ask(
    session: aiohttp.ClientSession, port: int, kind: str = "chat", model: str = "LLM-Chat", text: str = "hi"
) -> int:
    """One request through the proxy, read to its end: `kind` ``chat``, ``stream`` (chat, streamed) or ``text``."""
    if kind == "text":
        path, body = "completions", {"model": model, "prompt": text}
    else:
        path, body = "chat/completions", {"model": model, "messages": [{"role": "user", "content": text}]}
        body["stream"] = kind == "stream"
    async with session.post(
        f"http://127.0.0.1:{port}/v1/{path}", json=body, headers={"Authorization": f"Bearer {MASTER_KEY}"}
    ) as r:
        await r.read()
        return r.status


async def test_a_pulse_through_litellm_is_published_counted_and_claimed(
    nats_server: NatsServer, nc: Client, store: KvSlotStore, tmp_path: Path
) -> None:
    command = litellm_command()
    seen: list[QueueSample] = []
    bad: list[BadMessage] = []

    async def heard(msg: object) -> None:
        try:
            seen.append(protocol.decode(msg.data, QueueSample))  # type: ignore[attr-defined]
        except BadMessage as err:
            bad.append(err)

    def last() -> QueueSample:
        return seen[-1]

    await nc.subscribe("pulse.queue.chat", cb=heard)
    agents = [await AgentDouble(nc, store, f"node-{i}", "chat", slots=4, rack=f"r{i}").start() for i in range(2)]
    await put_scaler(nc, "chat")
    backend_port = free_port()
    try:
        async with backend_on(backend_port) as backend, aiohttp.ClientSession() as session:
            with litellm_proxy(command, tmp_path, backend_port=backend_port, nats_url=nats_server.url) as proxy:
                port, pid, log = proxy
                await wait_until_serving(session, port, log)
                # Named in the map, "chat" is published from the start: zeros, before any request.
                await wait_for(lambda: seen, 10, "the proxy's first sample")
                assert (last().arrivals_total, last().inflight, last().queue_depth) == (0, 0, 0)
                async with autoscaler_in_process(nats_server.url):
                    kinds = ("chat", "stream", "text") * (PULSE // 3)  # a stream ends by a logging event alone
                    pulse = [asyncio.create_task(ask(session, port, kind)) for kind in kinds]
                    await wait_for(lambda: backend.holding == PULSE, 30, "the pulse to reach the backend")
                    await wait_for(lambda: last().inflight == PULSE, 5, "a sample with the pulse in flight")
                    assert (last().arrivals_total, last().queue_depth, last().completions_total) == (PULSE, 0, 0)
                    await wait_for(lambda: held(store, "chat", ("claimed", "activating", "ready")), 10, "a claim")
                    backend.release.set()
                    assert await asyncio.gather(*pulse) == [200] * PULSE
                    await wait_for(lambda: last().completions_total == PULSE, 10, "the pulse's completions")
                    assert (last().inflight, last().queue_depth, last().timeouts_total) == (0, 0, 0)
                # LiteLLM gives up on a backend that does not answer: a timeout, from its own 408.
                assert await ask(session, port, model="LLM-Slow", text="HOLD") == 408
                await wait_for(lambda: last().timeouts_total == 1, 5, "the timeout's sample")
                assert (last().arrivals_total, last().completions_total, last().inflight) == (PULSE + 1, PULSE, 0)
                before_outage = last()

                nats_server.kill()
                for _ in range(DURING_OUTAGE):  # NATS is gone: the proxy answers as before, the hook counts
                    t0 = time.monotonic()
                    assert await ask(session, port) == 200
                    assert time.monotonic() - t0 < 5, "a request waited on the hook's NATS"
                nats_server.restart()
                await wait_for(lambda: last().arrivals_total == PULSE + 1 + DURING_OUTAGE, 20, "samples after NATS")
                await wait_for(lambda: last().completions_total == PULSE + DURING_OUTAGE, 5, "the outage's answers")
                assert last().seq > before_outage.seq and last().gateway == before_outage.gateway
                out = log.read_text()
    finally:
        for a in agents:
            await a.stop()
    assert not bad, bad
    assert {s.model for s in seen} == {"chat"}
    assert {s.gateway for s in seen} == {f"{socket.gethostname()}-{pid}"}  # hostname-pid of the proxy process
    assert all(a.seq < b.seq for a, b in itertools.pairwise(seen))
    for field in ("arrivals_total", "completions_total", "timeouts_total"):
        values = [getattr(s, field) for s in seen]
        assert values == sorted(values), f"{field} went down"
    assert out.count("requests are still counted") == 1, out[-4000:]  # the outage, said once
    assert "is back" in out
