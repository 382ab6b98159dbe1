"""`pulsescale bench decide` runs end to end with a few models and prints the decision latency next to the bare
nats-py floor of the same run and their ratio (the numbers themselves are not asserted: a benchmark, on a shared
machine)."""

from __future__ import annotations

import re
import subprocess
import sys


def test_bench_decide_prints_the_decision_latency_next_to_the_floor() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pulsescale", "bench", "decide", "--models", "3", "--pulses", "3", "--samples", "500"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    figures = re.findall(r"p50 ([\d.]+) ms\s+p99 ([\d.]+) ms", out)
    assert "decision latency" in out and "3 models active, 3/3 pulses answered" in out, out
    assert "floor, bare nats-py in the same run" in out and "(3/3 answered)" in out, out
    assert len(figures) == 2, out  # the decision's p50/p99, then the floor's
    assert all(float(p50) > 0 and float(p99) >= float(p50) for p50, p99 in figures), out
    assert re.search(r"ratio to the floor: p50 [\d.]+x\s+p99 [\d.]+x", out), out
