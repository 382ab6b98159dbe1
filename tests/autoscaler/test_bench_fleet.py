"""The fleet-scale bench options (issue 27): ``--cpu-hog`` (a busy child process, always gone when the bench is),
``bench decide --pulses-after`` (pulses in the first seconds after the shards were taken, the floor's between
them) and ``bench ingest`` (ours next to a bare subscriber). Figures are not asserted beyond their hanging
together: a benchmark, on a shared machine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pulsescale.bench.hog import CpuHog
from pulsescale.bench.ingest import WANDER_MAX, _Gateways
from warmpool import protocol


def _bench(*args: str) -> dict[str, Any]:
    r = subprocess.run(
        [sys.executable, "-m", "pulsescale", "bench", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
    )
    doc: dict[str, Any] = json.loads(r.stdout)
    return doc


def _hogs() -> set[int]:
    """Processes running the hog's loop."""
    found = set()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            if b"while True:\n    pass" in cmdline:
                found.add(int(proc.name))
    return found


def _gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True  # dead, not yet reaped by its parent
        except OSError:
            return True
        time.sleep(0.05)
    return False


def test_the_hog_busies_one_cpu_and_is_gone_when_stopped() -> None:
    hog = CpuHog().start()
    try:
        assert hog.running and hog.proc is not None
        assert os.sched_getaffinity(hog.proc.pid) == {hog.cpu}
    finally:
        hog.stop()
    assert not hog.running


def test_the_hog_dies_with_a_bench_that_was_killed() -> None:
    code = (
        "from pulsescale.bench.hog import CpuHog; import time; "
        "print(CpuHog().start().proc.pid, flush=True); time.sleep(60)"
    )
    with subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) as parent:
        try:
            assert parent.stdout is not None
            hog = int(parent.stdout.readline())
            parent.send_signal(signal.SIGKILL)
            parent.wait(5)
            assert _gone(hog, 5.0), "the hog outlived its SIGKILLed bench"
        finally:
            if parent.poll() is None:
                parent.kill()


def test_bench_decide_times_pulses_in_the_first_seconds_beside_a_hog() -> None:
    before = _hogs()
    doc = _bench("decide", "--models", "4", "--pulses", "2", "--samples", "200", "--pulses-after", "0.5", "--cpu-hog")
    assert _hogs() <= before, "the hog outlived the bench"
    assert doc["cpu_hog"] is True and doc["pulses_after_s"] == 0.5, doc
    pulses = doc["each_pulse"]
    assert [p["model"] for p in pulses] == ["m0", "m2"], pulses
    assert all(p["at_s"] >= 0.5 for p in pulses), pulses
    window = doc["pulses_window_s"]
    assert 0.5 <= window["began_s"] <= window["ended_s"], window
    answered = [p["ms"] for p in pulses if p["ms"] is not None]
    assert doc["decision"]["answered"] == len(answered), doc
    assert doc["floor"]["answered"] == len([p for p in pulses if p["floor_ms"] is not None]), doc
    slack = doc["per_replica"][0]["slack"]
    assert slack["renewals"] > 0 and slack["under_s"] == 0.5 and 0 <= slack["under"] <= slack["renewals"], slack
    ingest = doc["ingest_through_nats"]
    # (CPU seconds come in clock ticks: 200 samples may take none.)
    assert ingest["floor_samples_per_s"] > 0 and ingest["floor_cpu_us_per_sample"] >= 0, ingest
    assert ingest["ratio_to_floor"] == ingest["samples_per_s"] / ingest["floor_samples_per_s"], ingest


def test_bench_ingest_prints_ours_and_the_floor_from_the_same_run() -> None:
    doc = _bench("ingest", "--models", "20", "--samples", "400", "--rounds", "1")
    assert doc["bench"] == "ingest" and (doc["models"], doc["samples"], doc["rounds"]) == (20, 400, 1), doc
    assert [s["who"] for s in doc["slices"]] == ["floor", "ours"], doc
    for s in doc["slices"]:
        assert s["published"] == 400 and s["counted"] >= 400 and s["seconds"] > 0, s
        assert s["samples_per_s"] == s["counted"] / s["seconds"], s
    ours, floor = doc["ours_samples_per_s"], doc["floor_samples_per_s"]
    assert doc["ratio_to_floor"] == ours / floor, doc
    ours_cpu, floor_cpu = doc["ours_cpu_us_per_sample"], doc["floor_cpu_us_per_sample"]
    # (CPU seconds come in clock ticks: 400 samples may take none, and a ratio of nothing is null.)
    per_cpu = floor_cpu / ours_cpu if ours_cpu and floor_cpu else None
    assert doc["ratio_to_floor_per_cpu_s"] == per_cpu, doc
    assert doc["met"] == (doc["ratio_to_floor"] >= 0.5 and per_cpu is not None and per_cpu >= 0.5), doc
    assert doc["demand"] == "steady", doc


def test_bench_ingest_with_wandering_demand_counts_every_sample_and_says_so() -> None:
    """`--demand wandering`: queue depths of 0-8, which ask the autoscaler for decisions; every sample still
    counted, and the report says which demand it ran."""
    doc = _bench("ingest", "--models", "20", "--samples", "400", "--rounds", "1", "--demand", "wandering")
    assert doc["demand"] == "wandering", doc
    assert [s["who"] for s in doc["slices"]] == ["floor", "ours"], doc
    assert all(s["published"] == 400 and s["counted"] >= 400 for s in doc["slices"]), doc


def test_wandering_gateways_draw_queue_depths_from_the_whole_range_and_steady_ones_stay_at_zero() -> None:
    def depths(g: _Gateways) -> list[int]:
        return [protocol.decode(g.sample("m"), protocol.QueueSample).queue_depth for _ in range(500)]

    wandering = depths(_Gateways(["m"], wandering=True))
    assert set(wandering) == set(range(WANDER_MAX + 1)), sorted(set(wandering))
    assert set(depths(_Gateways(["m"]))) == {0}
