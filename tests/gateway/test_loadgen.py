"""The load generator: its shape and arrivals as pure tables, then a few seconds against the real gateway (in front of
real HTTP upstreams, slots in the real `pulse_slots`): every request counted once, open loop (sending never waits
for answers), 504s counted per second, the CLI and its JSON/CSV, and the Locust file headless; then trace replay
against a real loopback server that records what it got (times, models, max_tokens, prompts) and the CLI's --trace."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import os
import shutil
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from nats.aio.client import Client

from gateway.loadgen import PulseShape, arrivals, percentile, print_report, run_load
from gateway.replay import MissingModel, run_trace
from tests.gateway_helpers import MODEL, Upstream, running_gateway, set_slot, upstreams
from tests.helpers import wait_for
from warmpool.embedded import NatsServer
from warmpool.registry import KvSlotStore
from warmpool.traces import read_trace

LOCUSTFILE = Path(__file__).resolve().parents[2] / "gateway" / "locustfile.py"


# --- pure ------------------------------------------------------------------------------------------------------


def test_shape_from_capacity_is_the_articles_pulse() -> None:
    shape = PulseShape.from_capacity(20.0, base_s=5, ramp_s=1, hold_s=10, after_s=5)
    table = [(0.0, "base", 10.0), (5.0, "ramp", 10.0), (5.5, "ramp", 35.0), (6.0, "pulse", 60.0),
             (15.9, "pulse", 60.0), (16.0, "after", 10.0)]  # fmt: skip
    for t, phase, rate in table:
        assert (shape.phase(t), shape.rate(t)) == (phase, pytest.approx(rate)), t
    assert shape.duration_s == 21 and shape.pulse_start_s == 5
    with pytest.raises(ValueError, match="finite"):
        PulseShape(float("nan"), 1.0)


@pytest.mark.parametrize("kind", ["uniform", "poisson"])
def test_arrivals_follow_the_rate(kind: str) -> None:
    shape = PulseShape(base_rps=10, pulse_rps=100, base_s=4, ramp_s=1, hold_s=4, after_s=4)
    times = arrivals(shape, kind=kind, seed=7)  # type: ignore[arg-type]
    assert times == sorted(times) and times[0] >= 0 and times[-1] < shape.duration_s
    per_s = [sum(int(t) == s for t in times) for s in range(13)]
    expected = [10, 10, 10, 10, 55, 100, 100, 100, 100, 10, 10, 10, 10]
    if kind == "uniform":
        assert [abs(a - b) <= 1 for a, b in zip(per_s, expected, strict=True)] == [True] * 13, per_s
    else:  # Poisson: the total within 4 standard deviations of its mean (535)
        assert abs(len(times) - 535) < 4 * 535**0.5, len(times)
        assert sum(per_s[5:9]) > 3 * sum(per_s[0:4]), per_s


def test_percentile_nearest_rank() -> None:
    assert percentile([], 50) is None
    assert [percentile([1.0, 2.0, 3.0, 4.0], p) for p in (50, 95, 99, 100)] == [2.0, 4.0, 4.0, 4.0]


# --- against the gateway ---------------------------------------------------------------------------------------


async def test_every_request_is_counted_once_against_the_gateway(
    nats_server: NatsServer, nc: Client, store: KvSlotStore
) -> None:
    async with upstreams(Upstream("a"), Upstream("b")) as (a, b):
        await set_slot(store, "n1", "ready", a.url)
        await set_slot(store, "n2", "ready", b.url)
        async with running_gateway(nc, nats_server.url) as gw:
            await wait_for(lambda: MODEL in gw.queues and len(gw.queues[MODEL].endpoints) == 2)
            shape = PulseShape(base_rps=10, pulse_rps=30, base_s=1, ramp_s=0.5, hold_s=1, after_s=0.5)
            result = await run_load(f"http://127.0.0.1:{gw.port}", MODEL, shape, kind="uniform")
            expected = len(arrivals(shape, kind="uniform"))
            assert result.sent == expected == result.ok
            assert result.timeouts == result.errors == result.rejected == 0
            q = gw.queues[MODEL]
            assert (q.arrivals_total, q.completions_total) == (expected, expected)
            # The upstream counts a request after writing its answer: the client may have it a moment before.
            await wait_for(lambda: a.answered + b.answered == expected, 5, f"{expected} answered upstream")
            assert a.answered + b.answered == expected
            summary = result.summary()
            assert summary["p50_ms"] is not None and summary["p99_ms"] >= summary["p50_ms"]  # type: ignore[operator]
            doc = json.loads(result.to_json())
            assert [s["sent"] for s in doc["seconds"]] == [s.sent for s in result.seconds]
            assert [r["phase"] for r in doc["seconds"]] == ["base", "pulse", "after"] and doc["summary"][
                "ok"
            ] == expected
            rows = list(csv.DictReader(io.StringIO(result.to_csv())))
            assert sum(int(r["ok"]) for r in rows) == expected


async def test_open_loop_sends_on_schedule_while_nothing_answers(
    nats_server: NatsServer, nc: Client, store: KvSlotStore
) -> None:
    async with upstreams(Upstream("a", holding=True)) as (a,):
        await set_slot(store, "n1", "ready", a.url)
        async with running_gateway(nc, nats_server.url, endpoint_concurrency=2) as gw:
            await wait_for(lambda: MODEL in gw.queues and len(gw.queues[MODEL].endpoints) == 1)
            shape = PulseShape(base_rps=20, pulse_rps=20, base_s=1, ramp_s=0, hold_s=0, after_s=0)
            load = asyncio.create_task(run_load(f"http://127.0.0.1:{gw.port}", MODEL, shape, kind="uniform"))
            # Every request arrives at the gateway while the upstream answers none: sends do not wait for answers.
            await wait_for(lambda: gw.queues[MODEL].arrivals_total == 20, what="all 20 sent")
            assert a.answered == 0 and gw.queues[MODEL].inflight == 2 and gw.queues[MODEL].depth == 18
            a.hold.set()
            result = await load
            assert (result.sent, result.ok) == (20, 20)


async def test_504s_are_counted_per_second(nats_server: NatsServer, nc: Client, store: KvSlotStore) -> None:
    async with running_gateway(nc, nats_server.url, timeout_s=0.2) as gw:  # no slot ready: every request times out
        shape = PulseShape(base_rps=5, pulse_rps=15, base_s=1, ramp_s=0.5, hold_s=1, after_s=0.5)
        result = await run_load(f"http://127.0.0.1:{gw.port}", MODEL, shape, kind="uniform")
        assert result.timeouts == result.sent == gw.queues[MODEL].timeouts_total > 0
        assert [s.timeouts_504 for s in result.seconds] == [s.sent for s in result.seconds]
        assert [s.phase for s in result.seconds] == ["base", "pulse", "after"]  # each second by its midpoint
        assert result.summary()["timeouts_504_in_pulse"] == result.seconds[1].sent > result.seconds[0].sent
        assert result.ok == 0 and result.latency_ms(50) is None


async def test_pulsescale_load_command(nats_server: NatsServer, nc: Client, store: KvSlotStore, tmp_path: Path) -> None:
    async with upstreams(Upstream("a")) as (a,):
        await set_slot(store, "n1", "ready", a.url)
        async with running_gateway(nc, nats_server.url) as gw:
            await wait_for(lambda: MODEL in gw.queues and len(gw.queues[MODEL].endpoints) == 1)
            proc = await asyncio.create_subprocess_exec(
                *[sys.executable, "-m", "pulsescale", "load", f"http://127.0.0.1:{gw.port}", "--model", MODEL,
                  "--capacity-rps", "10", "--base-s", "1", "--ramp-s", "0.5", "--hold-s", "0.5", "--after-s", "0.5",
                  "--arrivals", "uniform", "--json", str(tmp_path / "t.json"), "--csv", str(tmp_path / "t.csv")],
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env={**os.environ, "PYTHONPATH": os.getcwd()},
            )  # fmt: skip
            out, err = await asyncio.wait_for(proc.communicate(), 60)
            assert proc.returncode == 0, err.decode()
            doc = json.loads((tmp_path / "t.json").read_text())
            assert doc["summary"]["sent"] == doc["summary"]["ok"] == gw.queues[MODEL].completions_total > 0
            assert "timeouts_504 0" in out.decode() and "pulse" in out.decode()
            assert (tmp_path / "t.csv").read_text().startswith("t,phase,offered_rps,sent,ok,")


async def test_locustfile_runs_headless_against_the_gateway(
    nats_server: NatsServer, nc: Client, store: KvSlotStore, tmp_path: Path
) -> None:
    locust = shutil.which("locust", path=str(Path(sys.executable).parent)) or shutil.which("locust")
    if locust is None:
        pytest.skip("locust is not installed (pip install locust, or the dev extra)")
    async with upstreams(Upstream("a")) as (a,):
        await set_slot(store, "n1", "ready", a.url)
        async with running_gateway(nc, nats_server.url) as gw:
            await wait_for(lambda: MODEL in gw.queues and len(gw.queues[MODEL].endpoints) == 1)
            proc = await asyncio.create_subprocess_exec(
                *[locust, "-f", str(LOCUSTFILE), "--headless", "-u", "5", "-r", "5", "-t", "3s",
                  "--host", f"http://127.0.0.1:{gw.port}", "--csv", str(tmp_path / "locust"), "--only-summary"],
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                env={**os.environ, "PULSESCALE_MODEL": MODEL},
                cwd=tmp_path,
            )  # fmt: skip
            out, _ = await asyncio.wait_for(proc.communicate(), 60)
            assert proc.returncode == 0, out.decode()[-3000:]
            with (tmp_path / "locust_stats.csv").open() as f:
                stats = list(csv.DictReader(f))
            row = next(r for r in stats if r["Name"] == "/v1/completions")
            assert int(row["Request Count"]) > 0 and int(row["Failure Count"]) == 0
            # Locust stops its users mid-request at the time limit: those reached the gateway but are not in its stats.
            assert a.answered == gw.queues[MODEL].completions_total >= int(row["Request Count"])


# --- trace replay (gateway.replay): against a real HTTP server on loopback that records what it got -------------


@asynccontextmanager
async def recording_server() -> AsyncIterator[tuple[str, list[tuple[float, dict[str, Any]]]]]:
    """An OpenAI-style completions server on 127.0.0.1 that answers at once and records (arrival time, body)."""
    got: list[tuple[float, dict[str, Any]]] = []
    loop = asyncio.get_running_loop()

    async def completions(request: web.Request) -> web.Response:
        got.append((loop.time(), await request.json()))
        return web.json_response({"choices": [{"text": "ok"}]})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = runner.addresses[0][1]
        yield f"http://127.0.0.1:{port}", got
    finally:
        await runner.cleanup()


PLAIN_TRACE = """# a small replay: t_s,model,tokens
t_s,model,tokens
0.0,alpha,5
1.0,beta,
2.0,alpha,0
4.0,,3
"""


async def test_trace_replay_sends_each_request_at_its_time(tmp_path: Path) -> None:
    (tmp_path / "t.csv").write_text(PLAIN_TRACE)
    trace = read_trace(tmp_path / "t.csv", speed=20)  # offsets 0, 50, 100, 200 ms
    async with recording_server() as (url, got):
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        result = await run_trace(url, trace, model="gamma", prompt="hi", default_max_tokens=16)
    bodies = [b for _, b in got]
    # Rows name their model, or get the default; max_tokens from the trace (at least 1), the default where none.
    assert [(b["model"], b["max_tokens"], b["prompt"]) for b in bodies] == [
        ("alpha", 5, "hi"), ("beta", 16, "hi"), ("alpha", 1, "hi"), ("gamma", 3, "hi")]  # fmt: skip
    arrived = [at - t0 for at, _ in got]
    assert [a >= t - 0.005 for a, t in zip(arrived, (0.0, 0.05, 0.1, 0.2), strict=True)] == [True] * 4, arrived
    assert (result.sent, result.ok, result.errors, result.model, result.arrivals_kind) == (
        4, 4, 0, "alpha,beta,gamma", "trace")  # fmt: skip
    assert [s.phase for s in result.seconds] == ["trace"] and result.seconds[0].offered_rps == 4
    late = result.late_ms(100)
    assert late is not None and late < 100, late
    doc = json.loads(result.to_json())
    assert doc["trace"] == {"file": str(tmp_path / "t.csv"), "format": "plain", "speed": 20.0, "requests": 4,
                            "of": 4, "duration_s": 0.2} and doc["shape"] is None  # fmt: skip
    assert doc["summary"]["late_max_ms"] == late
    # Bounded: the first N requests, or the first seconds of the replay; a row naming no model needs a default.
    async with recording_server() as (url, got):
        assert (await run_trace(url, trace, model="gamma", max_requests=2)).sent == 2
        assert (await run_trace(url, trace, duration_s=0.1)).sent == 2  # 0 and 50 ms; alpha and beta are named
        with pytest.raises(MissingModel, match="1 of the trace's requests name no model"):
            await run_trace(url, trace)
    assert len(got) == 4


async def test_trace_replay_prompts_are_about_the_context_length(tmp_path: Path) -> None:
    (tmp_path / "a.csv").write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,300,7\n2023-11-16 18:15:46.7,0,2\n"
    )
    async with recording_server() as (url, got):
        result = await run_trace(url, read_trace(tmp_path / "a.csv"), model="tiny")
    assert result.ok == 2 and [b["model"] for _, b in got] == ["tiny", "tiny"]
    assert [(len(b["prompt"].split()), b["max_tokens"]) for _, b in got] == [(300, 7), (1, 2)]


async def test_a_replay_that_falls_behind_says_so(tmp_path: Path) -> None:
    (tmp_path / "t.csv").write_text("0\n0.01\n0.02\n0.5\n")
    trace = read_trace(tmp_path / "t.csv")
    async with recording_server() as (url, _):
        # The client's event loop stalls for 0.3 s right as the replay starts (a stand-in for a client too slow for
        # its schedule): the first three sends go out ~0.3 s late, the last on time.
        asyncio.get_running_loop().call_soon(time.sleep, 0.3)
        result = await run_trace(url, trace, model="tiny")
    assert result.ok == 4
    late = result.late_ms(100)
    assert late is not None and late >= 250, late
    out = io.StringIO()
    print_report(result, out)
    assert "behind schedule: sends went out up to" in out.getvalue() and "lower --speed" in out.getvalue()


async def test_pulsescale_load_trace_command(tmp_path: Path) -> None:
    (tmp_path / "t.csv").write_text(PLAIN_TRACE)
    (tmp_path / "bad.csv").write_text("t_s,model,tokens\n0,a,1\n1,b,many\n")

    async def load(*args: str) -> tuple[int, str, str]:
        proc = await asyncio.create_subprocess_exec(
            *[sys.executable, "-m", "pulsescale", "load", url, *args],
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": os.getcwd()},
        )
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode is not None
        return proc.returncode, out.decode(), err.decode()

    async with recording_server() as (url, got):
        rc, out, err = await load("--trace", str(tmp_path / "t.csv"), "--speed", "50", "--model", "gamma",
                                  "--max-tokens", "9", "--json", str(tmp_path / "r.json"))  # fmt: skip
        assert rc == 0, err
        assert [(b["model"], b["max_tokens"]) for _, b in got] == [
            ("alpha", 5),
            ("beta", 9),
            ("alpha", 1),
            ("gamma", 3),
        ]
        doc = json.loads((tmp_path / "r.json").read_text())
        assert doc["summary"]["sent"] == doc["summary"]["ok"] == 4 and doc["trace"]["speed"] == 50
        assert "total: sent 4, ok 4" in out and "late_max_ms" in out and "behind schedule" not in out
        # A bad trace, a row naming no model without --model, and a pulse option with --trace: exit 2, one message.
        rc, out, err = await load("--trace", str(tmp_path / "bad.csv"))
        assert rc == 2 and f"trace {tmp_path / 'bad.csv'} line 3: tokens 'many' is not a whole number" in err
        rc, _, err2 = await load("--trace", str(tmp_path / "t.csv"))
        assert rc == 2 and "1 of the trace's requests name no model" in err2 and "(--model M)" in err2
        rc, _, err3 = await load("--trace", str(tmp_path / "t.csv"), "--capacity-rps", "10")
        assert rc == 2 and "without --capacity-rps" in err3
        assert "Traceback" not in err + err2 + err3
    assert len(got) == 4
