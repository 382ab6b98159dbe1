"""The load generator: its shape and arrivals as pure tables, then a few seconds against the real gateway (in front of
real HTTP upstreams, slots in the real `pulse_slots`): every request counted once, open loop (sending never waits
for answers), 504s counted per second, the CLI and its JSON/CSV, and the Locust file headless."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
from nats.aio.client import Client

from gateway.loadgen import PulseShape, arrivals, percentile, run_load
from tests.gateway_helpers import MODEL, Upstream, running_gateway, set_slot, upstreams
from tests.helpers import wait_for
from warmpool.embedded import NatsServer
from warmpool.registry import KvSlotStore

LOCUSTFILE = Path(__file__).resolve().parent.parent / "gateway" / "locustfile.py"


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
