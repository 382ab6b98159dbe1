"""`pulsescale bench claims` runs end to end on a small pool and prints the claim figures next to the bare
KV-update floor of the same run (the numbers themselves are not asserted: a benchmark, on a shared machine)."""

from __future__ import annotations

import subprocess
import sys


def test_bench_claims_prints_claims_next_to_the_floor() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "pulsescale", "bench", "claims", "--nodes", "20", "--claims", "100"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "160 warm slots on 20 nodes x 8" in lines[0]
    head = lines[1].split()
    for column in ("p50", "p99", "claims/s", "floor", "p99/floor"):
        assert column in head
    rows = [line.split() for line in lines[2:4]]
    assert [row[0] for row in rows] == ["1", "16"]  # 1 and 16 claimers by default
    for row in rows:
        assert len(row) == 12 and row[7] == "|" and row[-1].endswith("x")
        claim_p99, floor_p99, ratio = float(row[3]), float(row[9]), float(row[-1].rstrip("x"))
        assert claim_p99 > 0 and floor_p99 > 0 and ratio > 0
    assert "kv.update(key, value, last=rev)" in lines[4]


def test_bench_claims_without_the_slot_watch_says_so_and_still_claims() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "pulsescale", "bench", "claims", "--nodes", "20", "--claims", "100",
         "--concurrency", "4", "--without-slot-watch"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[1].startswith("slot watch: stopped")
    row = lines[3].split()
    assert row[0] == "4" and row[1] == "100" and row[6] == "0"  # every claim landed, none lost a race
