"""The local engine's ``GET /metrics``: vLLM's three scheduler series in vLLM's format, counting its own requests.

A real `EngineServer` on real tiny weights, over real HTTP. The engine runs one request at a time (its model lock),
so with requests paced by ``token_ms`` the page must show exactly one running and the rest waiting, and each finished
request once under its finish reason. The page is read with the client library's own parser and with the bridge's
(`bridge.parse.engine_page`), which is what ``pulsescale bridge --slots`` does with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families
from safetensors.numpy import load_file

from bridge import parse
from bridge.readings import EngineReading
from nodeagent import tinymodel
from nodeagent.engine import local

MODEL = "tiny"


@contextlib.contextmanager
def engine(token_ms: float) -> Iterator[str]:
    """A local engine server on real weights, `token_ms` of emulated accelerator time per token."""
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp) / MODEL
        tinymodel.make_tiny(d, 200_000)
        cfg = {**local.read_config(d), "token_ms": token_ms}
        tensors = {}
        for f in d.glob("*.safetensors"):
            tensors.update(load_file(f))
        srv = local.EngineServer(local.TinyMoE(cfg, tensors), MODEL, "127.0.0.1", 0)
        th = threading.Thread(target=srv.serve_forever, daemon=True)
        th.start()
        try:
            yield f"http://127.0.0.1:{srv.port}"
        finally:
            srv.shutdown()
            srv.server_close()
            th.join(5)


async def page(session: aiohttp.ClientSession, url: str) -> tuple[bytes, dict[str, float]]:
    """The page's body and its samples, by ``name{finished_reason}``, read by prometheus_client's parser."""
    async with session.get(f"{url}/metrics") as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        body = await r.read()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            assert s.labels["model_name"] == MODEL and s.labels["engine"] == "0"
            reason = s.labels.get("finished_reason")
            values[s.name + (f"{{{reason}}}" if reason else "")] = s.value
    return body, values


def successes(values: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in values.items() if k.startswith(parse.FINISHED)}


async def test_an_idle_engine_shows_vllms_series_at_zero_with_every_finish_reason() -> None:
    with engine(0.0) as url:
        async with aiohttp.ClientSession() as session:
            body, values = await page(session, url)
    assert values[parse.WAITING] == 0 and values[parse.RUNNING] == 0
    assert set(successes(values)) == {f"{parse.FINISHED}{{{r}}}" for r in local.FINISH_REASONS}
    assert sum(successes(values).values()) == 0
    # The bridge reads it as vLLM's: by model_name (an unbound target), and bound to a model (a slot's engine).
    assert parse.engine_page(body, model=None, names={}).readings == {MODEL: EngineReading(0, 0, 0)}
    assert parse.engine_page(body, model="other", names={}).readings == {"other": EngineReading(0, 0, 0)}


async def test_requests_in_hand_are_one_running_and_the_rest_waiting_and_each_finish_counts_once() -> None:
    """Four requests of 20 tokens x 25 ms (0.5 s each) sent at once: one holds the model, three wait; the page
    never shows two running, and ends with four successes and nothing in hand."""
    sent = 4
    with engine(25.0) as url:
        async with aiohttp.ClientSession() as session:
            body = {"model": MODEL, "prompt": "The warm pool says", "max_tokens": 20}
            calls = [asyncio.create_task(session.post(f"{url}/v1/completions", json=body)) for _ in range(sent)]
            seen: list[tuple[float, float]] = []
            try:
                async with asyncio.timeout(10):
                    while True:
                        raw, values = await page(session, url)
                        seen.append((values[parse.WAITING], values[parse.RUNNING]))
                        if seen[-1] == (sent - 1, 1):
                            break
                        await asyncio.sleep(0.01)
                # The bridge's reading of that same page.
                assert parse.engine_page(raw, model=MODEL, names={}).readings[MODEL] == EngineReading(sent - 1, 1, 0)
                answers = await asyncio.gather(*calls)
                for a in answers:
                    assert a.status == 200
                    a.release()
                _, after = await page(session, url)
            finally:
                for c in calls:
                    c.cancel()
                await asyncio.gather(*calls, return_exceptions=True)
    assert all(running <= 1 for _, running in seen), seen
    assert after[parse.WAITING] == 0 and after[parse.RUNNING] == 0
    done = successes(after)
    assert sum(done.values()) == sent
    assert done[f"{parse.FINISHED}{{length}}"] + done[f"{parse.FINISHED}{{stop}}"] == sent


@pytest.mark.parametrize("body", [b"{", b'{"prompt": 3}', b'{"max_tokens": -1}'])
async def test_a_refused_request_is_neither_waiting_nor_counted(body: bytes) -> None:
    with engine(0.0) as url:
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{url}/v1/completions", data=body) as r:
                assert r.status == 400
            _, values = await page(session, url)
    assert values[parse.WAITING] == 0 and values[parse.RUNNING] == 0
    assert sum(successes(values).values()) == 0


# --- max_connections: an engine that holds its own queue, as vLLM does --------------------------------------------


@pytest.mark.parametrize("bad", [0, -1, local.MAX_CONNECTIONS_LIMIT + 1, 1.5, "many", True])
def test_a_bad_max_connections_is_refused_with_its_bounds(tmp_path: Path, bad: object) -> None:
    tinymodel.make_tiny(tmp_path, 100_000, extra_config={"max_connections": bad})
    with pytest.raises(ValueError, match=r"`max_connections` must be an integer in \[1, 4096\]"):
        local.read_config(tmp_path)


@contextlib.contextmanager
def booted(model_dir: Path, **config: object) -> Iterator[local.EngineServer]:
    """An engine as the zygote boots it (`local.prepare`, then `LocalBoot.boot`) from a model with `config`."""
    tinymodel.make_tiny(model_dir, 100_000, extra_config=config)
    boot = local.prepare({"model_dir": str(model_dir), "model_name": MODEL})
    tensors: dict[str, object] = {}
    for f in model_dir.glob("*.safetensors"):
        tensors.update(load_file(f))
    srv = boot.boot(type("Weights", (), {"tensors": tensors})(), "127.0.0.1", 0, None)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()
        th.join(5)


async def test_an_engine_booted_with_max_connections_holds_that_many_requests_waiting(tmp_path: Path) -> None:
    """The config's ``max_connections`` (the demo's ``--source vllm-metrics`` sets it) reaches the server: 40
    requests at once all wait in the engine (the default 32 would close or refuse some), and its page says so."""
    sent = 40
    with booted(tmp_path, token_ms=5, max_connections=48) as srv:
        assert srv.max_connections == 48
        url = f"http://127.0.0.1:{srv.port}"
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 10}
            calls = [asyncio.create_task(session.post(f"{url}/v1/completions", json=body)) for _ in range(sent)]
            try:
                peak = 0
                async with asyncio.timeout(20):
                    while peak < sent:
                        _, values = await page(session, url)
                        peak = max(peak, round(values[parse.WAITING] + values[parse.RUNNING]))
                        await asyncio.sleep(0.005)
                answers = await asyncio.gather(*calls)
                assert [a.status for a in answers] == [200] * sent
                for a in answers:
                    a.release()
            finally:
                for c in calls:
                    c.cancel()
                await asyncio.gather(*calls, return_exceptions=True)
        assert srv.refused == 0
