"""`pulsescale bench bridge` runs end to end (a real nats-server, autoscaler and bridge). With ``--json`` it prints
one object whose figures hang together: every pulse of both paths answered, p50 <= p99 <= max, the added delays the
differences of the figures they come from, the parameters as asked, no NaN. The figures themselves are not asserted
(a benchmark, on a shared machine); the text report, the default, prints its lines."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from typing import Any

import pytest


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(
        [sys.executable, "-m", "pulsescale", "bench", "bridge", *args],
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )
    assert r.returncode == 0, f"exit {r.returncode}\nstdout: {r.stdout[-2000:]}\nstderr: {r.stderr[-3000:]}"
    return r


def _no_nan(name: str) -> None:
    raise AssertionError(f"{name} in the JSON: a figure that cannot be computed is null")


def _assert_percentiles(side: dict[str, Any], answered: int) -> None:
    assert side["answered"] == answered, side
    for k in ("p50_ms", "p99_ms", "max_ms"):
        assert isinstance(side[k], float) and math.isfinite(side[k]) and side[k] > 0, side
    assert side["p50_ms"] <= side["p99_ms"] <= side["max_ms"], side


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_bench_bridge_json_has_both_paths_timed_and_the_difference_of_their_figures() -> None:
    r = _run("--pulses", "3", "--scrape-every", "100ms", "--json")
    doc: dict[str, Any] = json.loads(r.stdout, parse_constant=_no_nan)  # all of stdout is the one object
    assert "t0 -> first claim written, 3 pulses per path" in r.stderr  # the text report, as progress
    assert (doc["bench"], doc["pulses"], doc["scrape_every_s"], doc["depth"]) == ("bridge", 3, 0.1, 4), doc
    _assert_percentiles(doc["push"], 3)
    _assert_percentiles(doc["bridge"], 3)
    assert doc["added_p50_ms"] == pytest.approx(doc["bridge"]["p50_ms"] - doc["push"]["p50_ms"])
    assert doc["added_p99_ms"] == pytest.approx(doc["bridge"]["p99_ms"] - doc["push"]["p99_ms"])
    assert doc["run_s"] > 0


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_bench_bridge_prints_its_text_report_by_default() -> None:
    r = _run("--pulses", "2")
    assert "push   (a sample published at t0)" in r.stdout and "(2/2 answered)" in r.stdout, r.stdout
    assert "bridge (the engine page jumps at t0)" in r.stdout and "added by the bridge" in r.stdout, r.stdout
    assert "a scrape every 250 ms" in r.stdout


def test_bench_bridge_refuses_a_scrape_period_past_a_second() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "pulsescale", "bench", "bridge", "--scrape-every", "2s"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert r.returncode == 2 and "--scrape-every must be in (0, 1s]" in r.stderr
