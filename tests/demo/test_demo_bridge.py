"""`pulsescale demo --source vllm-metrics|both`: the demand scraped from the engines by ``pulsescale bridge`` instead
of pushed by the gateway.

End to end, all real (nats-server, autoscaler, agents with local engines and their vLLM-format /metrics, the gateway
with ``--no-samples``, the bridge, the load): the run serves the pulse with no 504, every demand sample the
autoscaler got came from the bridge (none from the gateway), the engines held the queue the bridge saw, and the
report's figures are what this test saw on the run's own subjects. ``--source both`` runs the pulse once per source
and writes the two side by side (compare.json and the table), each figure the one its own report.json holds. The
pure parts (the comparison, the demand section, the bridge's counters read back from its real registry, the
settings) are checked alone first.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client
from prometheus_client import CollectorRegistry, generate_latest

from bridge.metrics import BridgeMetrics
from demo import report as rep
from demo import table
from demo.procs import MARKER_ENV
from demo.recorder import parse_bridge_metrics
from demo.run import run_demo
from demo.settings import MODEL, DemoSettings
from demo.view import HeadlessView
from tests.demo.test_demo import _leftovers, _mounts_and_loops
from warmpool import connect, protocol
from warmpool.protocol import Event, QueueSample

# --- the pure parts -------------------------------------------------------------------------------------------------


def sample(ts: float, gateway: str, depth: int = 0) -> QueueSample:
    return QueueSample(
        gateway=gateway, model=MODEL, seq=int(ts * 10), ts=ts, queue_depth=depth, inflight=0, arrivals_total=0,
        completions_total=0, timeouts_total=0,
    )  # fmt: skip


def test_the_demand_section_counts_the_bridges_samples_and_its_longest_silence() -> None:
    """Samples every 0.1 s from 100 to 106 with a hole from 102 to 103.5, and one sample of another publisher
    (a gateway, had it published): only the bridge's are counted, and the hole is the longest gap."""
    ts = [100 + i / 10 for i in range(61) if not 102 < 100 + i / 10 < 103.5]
    samples = [sample(t, "demo-bridge-x") for t in ts] + [sample(101.0, "gw-other")]
    rec = rep.RunRecord(
        load_start=100.0, pulse_start=102.0, pulse_end=104.0, load_end=110.0, offered_end=106.0,
        samples=samples, bridge_id="demo-bridge-x", bridge_metrics={"samples_published": 7},
        events=[Event(type="slot.claimed", model=MODEL, ts=t, node="n1", slot="s0") for t in (101.0, 102.4, 102.9)],
    )  # fmt: skip
    d = rep.demand_section(rec, "vllm-metrics", 0.25)
    assert d == {
        "source": "vllm-metrics", "publisher": "demo-bridge-x", "samples": len(ts), "longest_gap_s": 1.5,
        "scrape_every_s": 0.25, "bridge": {"samples_published": 7},
    }  # fmt: skip
    assert rep.first_claim_after(rec.events, rec.pulse_start) == pytest.approx(0.4)  # not the claim before it
    assert rep.first_claim_after(rec.events, 200.0) is None


def test_the_bridges_counters_read_back_from_its_own_registry() -> None:
    m = BridgeMetrics(CollectorRegistry())
    m.source_added("slot-a")
    m.source_added("slot-b")
    for _ in range(3):
        m.reads.labels("slot-a").inc()
    m.reads.labels("slot-b").inc()
    m.errors.labels("slot-a", "timeout").inc()
    m.errors.labels("slot-b", "timeout").inc()
    m.errors.labels("slot-b", "unreachable").inc()
    m.samples.labels(MODEL).inc(5)
    m.samples.labels("other").inc(9)
    m.stopped.labels(MODEL).inc()
    got = parse_bridge_metrics(generate_latest(m.registry).decode(), MODEL)
    assert got == {
        "samples_published": 5,
        "samples_stopped": 1,
        "reads": 4,
        "errors_by_reason": {"timeout": 2, "unreachable": 1},
    }


def _report(ttc: float | None, first: float | None, timeouts: int) -> dict[str, Any]:
    lat = {"requests": 10, "p50": 60.0, "p99": 150.0, "max": 200.0}
    return {
        "time_to_capacity_s": ttc, "first_claim_after_pulse_s": first, "needed_replicas": 7, "requests": 1550,
        "timeouts": timeouts, "timeouts_during_pulse": timeouts, "non_200": timeouts, "latency_ms": {"pulse": lat},
        "peak_queue_depth": 9, "demand": {"samples": 600},
    }  # fmt: skip


def test_the_comparison_puts_each_runs_figures_side_by_side_with_their_differences() -> None:
    c = table.comparison({"gateway": _report(0.83, 0.47, 0), "vllm-metrics": _report(1.95, 0.68, 2)})
    assert c["how"] == table.COMPARED_HOW
    assert c["reports"] == {"gateway": "gateway/report.json", "vllm-metrics": "vllm-metrics/report.json"}
    assert c["difference"] == {"time_to_capacity_s": 1.12, "first_claim_after_pulse_s": 0.21}
    assert c["runs"]["vllm-metrics"]["timeouts"] == 2 and c["runs"]["gateway"]["demand_samples"] == 600
    text = " ".join(table.compare_table(c).split())
    assert "time to capacity 0.83 s (7 replicas) 1.95 s (7 replicas)" in text, text
    assert "504s (during the pulse) 0 (0) 2 (2)" in text, text
    assert "vllm-metrics against gateway: time to capacity +1.12 s, first claim after pulse +0.21 s" in text
    # A run that never reached capacity: "never", and no difference made up.
    c = table.comparison({"gateway": _report(0.83, 0.47, 0), "vllm-metrics": _report(None, 0.68, 0)})
    assert c["difference"]["time_to_capacity_s"] is None
    assert "never" in table.compare_table(c)


def test_the_source_is_checked_and_the_gateway_stays_the_default() -> None:
    assert DemoSettings().source == "gateway"
    with pytest.raises(ValueError, match="--source 'prometheus': gateway or vllm-metrics"):
        DemoSettings(source="prometheus")
    s = DemoSettings(source="vllm-metrics")
    assert s.engine_connections == s.engine_queue + 32  # the engine takes what the gateway sends, and its probes


# --- the demo end to end -------------------------------------------------------------------------------------------


@pytest.fixture(name="own_subjects")
async def own_subjects_fixture() -> AsyncIterator[tuple[list[Event], list[QueueSample], list[Client]]]:
    events: list[Event] = []
    samples: list[QueueSample] = []
    clients: list[Client] = []
    yield events, samples, clients
    for c in clients:
        with contextlib.suppress(Exception):
            await c.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_the_demo_scales_on_the_engines_metrics_through_the_bridge_with_no_504(
    tmp_path: Path, own_subjects: tuple[list[Event], list[QueueSample], list[Client]]
) -> None:
    events, samples, clients = own_subjects

    async def subscribe(url: str) -> None:
        nc = await connect.connect(connect.NatsOptions(servers=(url,), name="test-demo-bridge"))
        clients.append(nc)

        async def on_event(msg) -> None:  # type: ignore[no-untyped-def]
            events.append(protocol.decode(msg.data, Event))

        async def on_sample(msg) -> None:  # type: ignore[no-untyped-def]
            samples.append(protocol.decode(msg.data, QueueSample))

        await nc.subscribe(protocol.events_subject(MODEL), cb=on_event)
        await nc.subscribe(protocol.queue_subject(MODEL), cb=on_sample)

    settings = DemoSettings(
        source="vllm-metrics", nodes=3, slots_per_node=2, base_rps=10, duration_s=30, out_dir=tmp_path / "out",
        headless=True, image="none",
    )  # fmt: skip
    mounted_before = _mounts_and_loops()
    result = await run_demo(settings, HeadlessView(), on_nats=subscribe)
    r = json.loads((tmp_path / "out" / "report.json").read_text())
    assert r == json.loads(json.dumps(result.report))
    assert _leftovers(f"{os.getpid()}-") == []
    assert _mounts_and_loops() <= mounted_before

    # The same pulse served: no 504, nothing else but 200s, and capacity reached in the pulse.
    assert r["timeouts"] == 0 and r["non_200"] == 0, (r["responses_by_status"], r["after_pulse"])
    assert r["config"]["source"] == "vllm-metrics"
    assert r["time_to_capacity_s"] is not None, r["ticks"]
    assert [a for a in r["activations"] if a["claimed_at_s"] >= 0], "nothing was claimed for the pulse"

    # Every demand sample came from the bridge: the gateway published none (--no-samples).
    publishers = {s.gateway for s in samples}
    assert publishers == {r["demand"]["publisher"]} and r["demand"]["publisher"].startswith("demo-bridge-"), publishers
    assert 0 < r["demand"]["samples"] <= len(samples)
    assert r["demand"]["longest_gap_s"] < 1.0  # never stale to the autoscaler while the load ran
    assert r["demand"]["bridge"]["samples_stopped"] == 0 and r["demand"]["bridge"]["errors_by_reason"] == {}
    assert r["gateway"]["samples"] == 0 and r["gateway"]["metrics"]["responses_by_status"] == {"200": r["requests"]}
    # The demand was the engines', as the bridge read it: requests in them while the load ran, none before it (the
    # calibration's requests, sent straight to an engine, came before the bridge started), and what the report says.
    load_start = r["load_started_at"]
    assert all(s.queue_depth + s.inflight == 0 for s in samples if s.ts < load_start - 0.3), "demand before the load"
    assert max(s.queue_depth + s.inflight for s in samples if s.ts >= load_start) > 0
    assert r["peak_queue_depth"] == max(s.queue_depth for s in samples)
    # The report's claim timing against the run's own events.
    pulse_start = r["load_started_at"] + r["pulse"]["start_s"]
    first = rep.first_claim_after(events, pulse_start)
    assert first is not None and r["first_claim_after_pulse_s"] == pytest.approx(first, abs=0.002)
    assert "demand from vllm-metrics: pulsescale bridge read every ready engine's /metrics" in result.table


def _demo_argv(out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "pulsescale", "demo", "--headless", "--out", str(out), "--image", "none", *extra]


@pytest.mark.slow
@pytest.mark.timeout(400)
async def test_source_both_runs_the_pulse_once_per_source_and_writes_them_side_by_side(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = await asyncio.create_subprocess_exec(
        *_demo_argv(out, "--source", "both", "--duration", "15", "--nodes", "3", "--base-rps", "8"),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        stdout, _ = await asyncio.wait_for(proc.communicate(), 300)
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGINT)
            await proc.wait()
    text = stdout.decode()
    assert proc.returncode == 0, text[-3000:]
    reports = {s: json.loads((out / s / "report.json").read_text()) for s in ("gateway", "vllm-metrics")}
    assert {s: r["config"]["source"] for s, r in reports.items()} == {
        "gateway": "gateway",
        "vllm-metrics": "vllm-metrics",
    }
    assert reports["gateway"]["demand"]["publisher"].startswith("gw-")  # the push path: the gateway's own samples
    assert reports["vllm-metrics"]["demand"]["publisher"].startswith("demo-bridge-")
    compared = json.loads((out / "compare.json").read_text())
    assert compared == table.comparison(reports)  # every figure the one its run's report.json holds
    assert list(compared["runs"]) == ["gateway", "vllm-metrics"]
    for source, r in reports.items():
        assert compared["runs"][source]["time_to_capacity_s"] == r["time_to_capacity_s"]
        assert compared["runs"][source]["timeouts"] == r["timeouts"]
    assert table.compare_table(compared) in text
    assert "--source both: run 2 of 2, the demand from vllm-metrics" in text
    assert _leftovers(f"{proc.pid}-") == []


@pytest.mark.slow
@pytest.mark.timeout(200)
async def test_ctrl_c_mid_pulse_stops_the_bridge_with_the_rest(tmp_path: Path) -> None:
    """SIGINT while the bridge feeds the autoscaler: exit 130, and nothing of the run is left in /proc or /dev/shm
    (the bridge is one of the run's processes, stopped in its turn)."""
    args = ("--source", "vllm-metrics", "--duration", "20", "--nodes", "2", "--base-rps", "5")
    proc = await asyncio.create_subprocess_exec(
        *_demo_argv(tmp_path / "out", *args),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    seen: list[str] = []
    try:
        assert proc.stdout is not None
        while True:
            line = (await asyncio.wait_for(proc.stdout.readline(), 90)).decode()
            assert line, f"the demo ended before its pulse: {''.join(seen)[-2000:]}"
            seen.append(line)
            if "s pulse " in line:
                break
        assert any("-m pulsescale bridge" in c for c in _cmdlines(proc.pid)), "no bridge running: nothing to stop"
        proc.send_signal(signal.SIGINT)
        rest, _ = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGINT)
            try:
                await asyncio.wait_for(proc.communicate(), 60)
            except TimeoutError:
                proc.kill()
                await proc.wait()
    assert proc.returncode == 130, "".join(seen) + rest.decode()
    assert _leftovers(f"{proc.pid}-") == []


def _cmdlines(run_pid: int) -> list[str]:
    """The command lines of the processes of the demo run `run_pid` (its marker in their environment)."""
    found = []
    for pid in (int(e) for e in os.listdir("/proc") if e.isdigit()):
        with contextlib.suppress(OSError):
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            if any(v.startswith(f"{MARKER_ENV}={run_pid}-".encode()) for v in env):
                found.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
    return found
