"""The zygote and the local engine as real processes: fork-and-go, HTTP in the OpenAI shape, faults, deaths."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from nodeagent import readiness, staging
from nodeagent.errors import EngineFailed
from nodeagent.forked import ForkedEngine
from tests.nodeagent_helpers import alive, wait_for


def spec(staged: staging.Staged, **kw: Any) -> dict[str, Any]:
    return {
        "engine": "local",
        "loader": "host",
        "model_dir": str(staged.dir),
        "files": [str(f.path) for f in staged.weights],
        "weights": staged.engine_weights(),
        "model_name": "tiny",
        "host": "127.0.0.1",
        "private": False,
        "fault": None,
        "slot": "s0",
        **kw,
    }


@pytest.fixture
def staged(model_dir: Path, shm_dir: Path) -> Iterator[staging.Staged]:
    out = staging.stage(model_dir, shm_dir, "tiny")
    yield out
    out.close()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
        yield s


async def test_fork_and_go_serves_completions_and_stop_keeps_the_zygote(
    staged: staging.Staged, session: aiohttp.ClientSession
) -> None:
    exits: list[str] = []
    engine = ForkedEngine(spec(staged, private=True), name="s0", advertise_host="127.0.0.1", on_exit=exits.append)
    try:
        await engine.arm()
        zygote = engine.zygote_pid
        assert zygote is not None and engine.armed
        first = await engine.start(timeout_s=10)
        assert first.mode == "copied" and first.loaded_bytes > 900_000 and first.load_ms > 0
        out = await readiness.check(session, first.endpoint, "tiny", timeout_s=5)
        assert out["object"] == "text_completion" and len(out["choices"][0]["text"]) == 1
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 5}
        async with session.post(f"{first.endpoint}/v1/completions", json=body) as r:
            assert r.status == 200
            got = await r.json()
        assert got["usage"] == {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10}
        assert got["choices"][0]["finish_reason"] == "length" and got["id"].startswith("cmpl-")
        async with session.post(f"{first.endpoint}/v1/completions", json={"prompt": 3}) as r:
            assert r.status == 400 and "prompt" in (await r.json())["error"]["message"]
        async with session.get(f"{first.endpoint}/v1/models") as r:
            assert (await r.json())["data"][0]["id"] == "tiny"
        await engine.stop()
        await wait_for(lambda: not alive(first.pid), 5, "the engine process to go")
        assert engine.armed and engine.zygote_pid == zygote  # the zygote stays: the next start is a fork again
        second = await engine.start(timeout_s=10)
        assert second.pid != first.pid
        await readiness.check(session, second.endpoint, "tiny", timeout_s=5)
        await engine.stop()
        assert exits == []
    finally:
        await engine.close()
    assert engine.zygote_pid is not None and not alive(engine.zygote_pid)


@pytest.mark.parametrize(
    ("fault", "code", "needle"),
    [
        ("crash", "engine_failed", "SIGABRT"),
        ("fail", "engine_failed", "fault injected"),
        ("hang", "deadline", "not serving"),
    ],
)
async def test_engine_faults_end_in_a_named_failure_and_the_zygote_survives(
    staged: staging.Staged, fault: str, code: str, needle: str
) -> None:
    engine = ForkedEngine(spec(staged, fault=fault), name="s0", advertise_host="127.0.0.1")
    try:
        await engine.arm()
        with pytest.raises(EngineFailed) as err:
            await engine.start(timeout_s=1.0)
        assert err.value.code == code and needle in err.value.reason, err.value
        await engine.stop()
        assert engine.armed and engine.serving is None
    finally:
        await engine.close()


async def test_unhealthy_engine_misses_the_readiness_deadline(
    staged: staging.Staged, session: aiohttp.ClientSession
) -> None:
    engine = ForkedEngine(spec(staged, fault="unhealthy"), name="s0", advertise_host="127.0.0.1")
    try:
        await engine.arm()
        started = await engine.start(timeout_s=5)
        with pytest.raises(EngineFailed) as err:
            await readiness.check(session, started.endpoint, "tiny", timeout_s=0.3)
        assert err.value.code == "deadline" and "503" in err.value.reason
    finally:
        await engine.close()


async def test_deaths_are_reported_and_a_dead_zygote_rearms(staged: staging.Staged) -> None:
    exits: list[str] = []
    engine = ForkedEngine(spec(staged), name="s0", advertise_host="127.0.0.1", on_exit=exits.append)
    try:
        await engine.arm()
        started = await engine.start(timeout_s=10)
        os.kill(started.pid, signal.SIGKILL)  # an OOM kill while serving
        await wait_for(lambda: bool(exits), 5, "the engine's death to be reported")
        assert "SIGKILL while serving" in exits[0] and engine.serving is None and engine.armed
        zygote = engine.zygote_pid
        assert zygote is not None
        os.kill(zygote, signal.SIGKILL)
        await wait_for(lambda: len(exits) == 2, 5, "the zygote's death to be reported")
        assert "zygote" in exits[1] and not engine.armed
        with pytest.raises(EngineFailed, match="not armed"):
            await engine.start(timeout_s=1)
        await engine.arm()
        assert engine.armed and engine.zygote_pid != zygote and engine.arms == 2
    finally:
        await engine.close()


async def test_a_killed_zygote_takes_its_engine_with_it(staged: staging.Staged) -> None:
    engine = ForkedEngine(spec(staged), name="s0", advertise_host="127.0.0.1")
    try:
        await engine.arm()
        started = await engine.start(timeout_s=10)
        assert engine.zygote_pid is not None
        os.kill(engine.zygote_pid, signal.SIGKILL)
        await wait_for(lambda: not alive(started.pid), 5, "PR_SET_PDEATHSIG to kill the orphaned engine")
    finally:
        await engine.close()


async def test_a_model_the_engine_cannot_build_fails_arming(staged: staging.Staged) -> None:
    (staged.dir / "config.json").write_text('{"format": "something-else"}')
    engine = ForkedEngine(spec(staged), name="s0", advertise_host="127.0.0.1")
    try:
        with pytest.raises(EngineFailed, match="not a pulsescale-tiny-moe model"):
            await engine.arm()
        assert not engine.armed
    finally:
        await engine.close()
    await asyncio.sleep(0)
