"""`pulsescale bench claims` runs end to end on a small pool: with ``--json`` it prints one object whose figures
hang together (counts as asked, every latency positive and finite, p50 <= p99 <= max, rates and the ratio as
computed from the figures they come from); the numbers themselves are not asserted (a benchmark, on a shared
machine). The text report still prints its table."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from typing import Any

import pytest


def bench_claims(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pulsescale", "bench", "claims", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def bench_claims_json(*args: str) -> dict[str, Any]:
    r = bench_claims(*args, "--json")
    assert r.returncode == 0, r.stderr
    doc: dict[str, Any] = json.loads(r.stdout)  # stdout is the one object, nothing else
    return doc


def positive(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def assert_level_hangs_together(level: dict[str, Any], claims: int) -> None:
    assert level["claims"] == claims and level["floor_updates"] == claims  # every claim landed, as many writes
    for side in ("", "floor_"):
        p50, p99, top = level[f"{side}p50_ms"], level[f"{side}p99_ms"], level[f"{side}max_ms"]
        assert all(positive(x) for x in (p50, p99, top)), level
        assert p50 <= p99 <= top, level
    assert positive(level["wall_s"]) and positive(level["floor_wall_s"])
    assert level["claims_per_s"] == pytest.approx(level["claims"] / level["wall_s"])
    assert level["floor_updates_per_s"] == pytest.approx(level["floor_updates"] / level["floor_wall_s"])
    assert level["ratio_p99"] == pytest.approx(level["p99_ms"] / level["floor_p99_ms"])
    assert isinstance(level["conflicts"], int) and level["conflicts"] >= 0


def test_bench_claims_json_has_the_parameters_and_each_level_next_to_the_floor() -> None:
    doc = bench_claims_json("--nodes", "20", "--claims", "100")
    assert doc["bench"] == "claims" and doc["embedded"] is True and doc["nats"].startswith("nats://127.0.0.1:")
    assert (doc["nodes"], doc["slots_per_node"], doc["slots"]) == (20, 8, 160)
    assert (doc["claims_per_level"], doc["concurrency"], doc["slices"]) == (100, [1, 16], 10)  # defaults
    assert doc["slot_watch"] is True and doc["sync_always"] is False
    assert "kv.update(key, value, last=rev)" in doc["floor"]
    assert [level["claimers"] for level in doc["levels"]] == [1, 16]
    for level in doc["levels"]:
        assert_level_hangs_together(level, 100)


def test_bench_claims_without_the_slot_watch_says_so_and_still_claims() -> None:
    doc = bench_claims_json("--nodes", "20", "--claims", "100", "--concurrency", "4", "--without-slot-watch")
    assert doc["slot_watch"] is False
    [level] = doc["levels"]
    assert level["claimers"] == 4
    assert_level_hangs_together(level, 100)
    assert level["conflicts"] == 0  # concurrent claimers sharing a registry reserve their candidates


def test_bench_claims_text_report_prints_its_table() -> None:
    r = bench_claims("--nodes", "4", "--slots-per-node", "5", "--claims", "40", "--concurrency", "2")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 4, r.stdout
    assert lines[0].startswith("claims bench: 20 warm slots on 4 nodes x 5, embedded nats-server nats://")
    assert lines[1].split() == [
        "claimers", "claims", "p50", "ms", "p99", "ms", "max", "ms", "claims/s", "conflicts", "|",
        "floor", "p50", "floor", "p99", "updates/s", "p99/floor",
    ]  # fmt: skip
    row = lines[2].split()
    assert row[:2] == ["2", "40"] and row[7] == "|" and row[-1].endswith("x") and len(row) == 12
    assert lines[3].startswith("floor: bare nats-py kv.update(key, value, last=rev)")
