"""`pulsescale bench decide` runs end to end with a few models. With ``--json`` it prints one object whose figures
hang together: counts as asked, every model with one live owner at every check, p50 <= p99 <= max, the ratios as
computed from the figures they come from, the takeover timed when a replica was killed, no slot claimed twice, no
NaN anywhere; the numbers themselves are not asserted beyond sanity (a benchmark, on a shared machine). The text
report, the default, still prints its main lines. The parts the report is built from are checked alone below."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from typing import Any

import pytest


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pulsescale", "bench", "decide", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )


def _no_nan(name: str) -> None:
    raise AssertionError(f"{name} in the JSON: a figure that cannot be computed is null")


def _parsed(stdout: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(stdout, parse_constant=_no_nan)  # all of stdout is the one object
    return doc


def _positive(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def _assert_percentiles(side: dict[str, Any], answered: int) -> None:
    assert side["answered"] == answered, side
    assert all(_positive(side[k]) for k in ("p50_ms", "p99_ms", "max_ms")), side
    assert side["p50_ms"] <= side["p99_ms"] <= side["max_ms"], side


def test_bench_decide_json_with_two_replicas_has_every_figure_hanging_together() -> None:
    r = _run("--models", "6", "--replicas", "2", "--pulses", "4", "--samples", "300", "--json")
    doc = _parsed(r.stdout)
    assert "decision latency, sample published -> first claim written" in r.stderr  # the text, as progress
    # The run's parameters, as asked (--kill is on by default with two replicas).
    assert doc["bench"] == "decide"
    assert (doc["models"], doc["replicas"], doc["pulses"], doc["samples"]) == (6, 2, 4, 300), doc
    assert doc["kill"] is True and doc["gateways_in_step"] is False and doc["gateway_phases"] == 10, doc
    assert (doc["slots_per_model"], doc["log_level"], doc["logs"], doc["pulse_budget_s"]) == (4, "WARNING", None, 300)
    assert doc["bounds"]["pulse_budget_s"] == 300 and doc["bounds"]["ready_timeout_s"] > 0, doc
    assert doc["replicas_settled"] is True, doc
    assert all(doc[k] >= 0 for k in ("setup_s", "replicas_ready_s", "ownership_settled_s")), doc
    assert _positive(doc["ingest_in_process_samples_per_s"]), doc
    # Every pulse answered, next to the floor from the same run; the ratios are the figures over the floor's.
    assert (doc["pulses_timed"], doc["pulses_sent"], doc["pulse_budget_spent"]) == (4, 4, False), doc
    decision, floor = doc["decision"], doc["floor"]
    _assert_percentiles(decision, 4)
    _assert_percentiles(floor, 4)
    assert doc["ratio_to_floor_p50"] == pytest.approx(decision["p50_ms"] / floor["p50_ms"])
    assert doc["ratio_to_floor_p99"] == pytest.approx(decision["p99_ms"] / floor["p99_ms"])
    # The autoscalers' own histogram: cumulative, and at least the 4 answered pulses counted.
    own = doc["own_decision_time"]
    within = [own[f"within_{ms}_ms"] for ms in (2, 5, 10, 20, 50)]
    assert own["decisions"] >= 4 and within == sorted(within) and within[-1] <= own["decisions"], own
    # Ownership: each named check found every model with one live owner; before the kill both replicas share the
    # 6 models, after it the survivor owns them all.
    ownership = doc["ownership"]
    checks = ownership["checks"]
    whens = ["before the pulses", "mid-pulses", "after the pulses", "after the takeover"]
    assert [c["when"] for c in checks] == whens, checks
    assert all(c["passed"] and c["models_without_live_owner"] == 0 and c["leases"] == "shard" for c in checks)
    for c in checks[:-1]:
        assert set(c["models_per_replica"]) == {"bench-r0", "bench-r1"}, c
        assert sum(c["models_per_replica"].values()) == 6, c
    assert ownership["named_checks_passed"] == len(checks) and ownership["one_owner_per_model"] is True, ownership
    assert ownership["sampled_every_ms"] == 250 and ownership["samples"] > 0, ownership
    # Orphans, if any were sampled, were all in the warm-up (replicas joining, shards handed over): none after.
    by_phase = ownership["samples_with_orphans_by_phase"]
    assert ownership["samples_with_orphans"] == by_phase.get("warm-up", 0), ownership
    assert ownership["samples_with_orphans_after_settled"] == 0, ownership
    # The kill: the busiest replica, its models claimed again, timed against lease_s + 1 s.
    takeover = doc["takeover"]
    killed = takeover["killed"]
    [survivor] = {"bench-r0", "bench-r1"} - {killed}
    assert takeover["killed_owned_models"] == checks[2]["models_per_replica"][killed] >= 1, takeover
    assert takeover["models_pulsed"] == takeover["models_claimed_again"] == takeover["killed_owned_models"]
    assert checks[-1]["models_per_replica"] == {survivor: 6}, checks[-1]
    assert takeover["bar_ms"] == pytest.approx((takeover["lease_s"] + 1) * 1e3), takeover
    assert 0 < takeover["p50_ms"] <= takeover["max_ms"], takeover
    assert takeover["met"] == (takeover["max_ms"] <= takeover["bar_ms"]), takeover
    # The same claims by the claimers' stamps: after the kill, and no later than this process saw them (+ slack: the
    # two processes' wall clocks are one clock here, but the stamp is taken before the write is sent).
    assert takeover["stamped"] == takeover["models_claimed_again"], takeover
    assert 0 < takeover["stamped_p50_ms"] <= takeover["stamped_max_ms"] <= takeover["max_ms"] + 50, takeover
    # Ingest through NATS, counted by the survivor alone; the rate is its count over its seconds.
    ingest = doc["ingest_through_nats"]
    assert ingest["published"] == 300 and set(ingest["counted"]) == {survivor}, ingest
    assert ingest["busiest"] == max(n for n in ingest["counted"].values() if n is not None) > 0, ingest
    assert ingest["samples_per_s"] == pytest.approx(ingest["busiest"] / ingest["busiest_s"]), ingest
    assert 0 < ingest["publish_s"] <= ingest["busiest_s"], ingest
    # Per replica: CPU, leases lost (summed at the top), the histograms, the killed one marked.
    per = doc["per_replica"]
    assert [p["identity"] for p in per] == ["bench-r0", "bench-r1"], per
    assert [p["identity"] for p in per if p["killed"]] == [killed], per
    assert all(_positive(p["cpu_s"]) and p["warnings"] >= 0 for p in per), per
    assert doc["leases_lost"] == sum(p["leases_lost"] for p in per), per
    for p in per:
        for name, over_s in (("loop_stalls", 0.5), ("slow_lease_renewals", 1.0)):
            assert p[name]["over_s"] == over_s and p[name]["count"] >= 0, p
    assert doc["double_claims"] == 0 and doc["slot_writes"] > 0, doc
    assert 0 < doc["run_s"] < 120, doc


def test_bench_decide_text_report_prints_its_main_lines() -> None:
    out = _run("--models", "3", "--pulses", "2", "--samples", "300", "--gateways-in-step").stdout
    assert out.startswith("setup: 3 models x 4 warm slots seeded in "), out
    decision = "decision latency, sample published -> first claim written (3 models active over 1 replica(s), "
    assert decision + "gateways in step, pulses after the windows settled, 2/2 pulses answered):\n  p50 " in out, out
    assert "floor, bare nats-py in the same run" in out and "(2/2 answered):\n  p50 " in out, out
    assert re.search(r"^ratio to the floor: p50 [\d.]+x   p99 [\d.]+x$", out, re.M), out
    assert re.search(r"^ingest through NATS .* = [\d,]+ samples/s \([\d.]+ us CPU each\)$", out, re.M), out
    assert re.search(r"^  the floor, a bare nats-py subscriber .* = [\d,]+ samples/s \(", out, re.M), out
    slack = r"^shard lease renewals heard with under 0.5 s of their term left .*: bench-r0 0 of \d+"
    assert re.search(slack, out, re.M), out
    assert re.search(r"^CPU seconds per replica .*: bench-r0 [\d.]+$", out, re.M), out
    assert re.search(r"^every model has exactly one owner: yes ", out, re.M), out
    assert out.splitlines()[-1].startswith("run length: "), out
    assert "SIGKILL" not in out, out  # one replica: nothing to kill


def test_the_report_has_nulls_not_nan_for_what_cannot_be_computed() -> None:
    from pulsescale.bench import report
    from warmpool import output

    assert report.percentiles([]) == report.Percentiles(answered=0, p50_ms=None, p99_ms=None, max_ms=None)
    got = report.percentiles([0.001, 0.002, 0.004])
    assert got.answered == 3 and got.p50_ms == pytest.approx(2.0) and got.max_ms == pytest.approx(4.0)
    assert got.p99_ms is not None and 2.0 < got.p99_ms < 4.0
    assert output.finite(float("nan")) is None and output.finite(float("inf")) is None and output.finite(2) == 2.0
    assert output.finite(None) is None
    assert report.ratio(3.0, 2.0) == 1.5 and report.ratio(1.0, 0.0) is None and report.ratio(None, 1.0) is None
    # watch._over's (count, bound) pairs: a bound in s, past the last bucket, nothing read, not exported.
    assert report.over((3, "2.5 s"), 0.5) == report.Over(over_s=0.5, count=3, longest_within_s=2.5)
    assert report.over((1, "+Inf"), 0.5) == report.Over(over_s=0.5, count=1, longest_within_s=None)
    assert report.over((0, "none read"), 1.0) == report.Over(over_s=1.0, count=0, longest_within_s=None)
    assert report.over(None, 0.5) is None
    # A run that timed nothing prints nulls, in JSON and YAML alike.
    empty = report.DecideReport(
        models=1, replicas=1, pulses=1, samples=1, kill=False, gateways_in_step=False, gateway_phases=10,
        pulse_budget_s=1.0, log_level="WARNING", logs=None,
    )  # fmt: skip
    doc = _parsed(output.dump(empty, "json"))
    assert doc["decision"] == {"answered": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}, doc
    assert doc["ratio_to_floor_p99"] is None and doc["takeover"] is None and doc["run_s"] is None, doc
    assert "ratio_to_floor_p50: null" in output.dump(empty, "yaml")


def test_the_double_claim_check_counts_a_new_claim_over_a_held_one_and_not_after_a_release() -> None:
    from pulsescale.bench.watch import _SlotWatch
    from warmpool.protocol import SlotRecord
    from warmpool.registry import Changed, Snapshot

    def rec(state: str, claim_id: str | None) -> SlotRecord:
        return SlotRecord(model="m", node="n", slot="s0", state=state, claim_id=claim_id)  # type: ignore[arg-type]

    watch = _SlotWatch()
    watch.on(Snapshot({"m.n.s0": rec("ready", "a")}))  # held before the run: not a write, not a double claim
    watch.on(Changed("m.n.s0", rec("ready", "a"), 2))  # the same claim moving on
    assert watch.double_claims == 0 and watch.held == {("n", "s0", "a"): "m.n.s0"}
    watch.on(Changed("m.n.s0", rec("claimed", "b"), 3))  # a new claim while "a" still holds it
    assert watch.double_claims == 1 and watch.held == {("n", "s0", "b"): "m.n.s0"}
    watch.on(Changed("m.n.s0", rec("warm", None), 4))  # released
    watch.on(Changed("m.n.s0", rec("claimed", "c"), 5))  # a claim after a release is fine
    assert watch.double_claims == 1 and watch.writes == 4 and "m" in watch.first_claim


def test_the_stall_count_reads_a_histogram_scrape() -> None:
    from pulsescale.bench.watch import _over

    name = "pulsescale_event_loop_lag_seconds"
    scrape = [
        f"# TYPE {name} histogram",
        f'{name}_bucket{{le="0.1"}} 50.0',
        f'{name}_bucket{{le="0.5"}} 57.0',
        f'{name}_bucket{{le="1.0"}} 59.0',
        f'{name}_bucket{{le="2.5"}} 60.0',
        f'{name}_bucket{{le="+Inf"}} 60.0',
        f"{name}_count 60.0",
    ]
    assert _over(scrape, name, 0.5) == (3, "2.5 s")
    assert _over([*scrape[:3], f'{name}_bucket{{le="+Inf"}} 58.0'], name, 0.5) == (1, "+Inf")
    assert _over(["other_metric 1.0"], name, 0.5) is None
    assert _over([f'{name}_bucket{{le="0.5"}} 0.0', f'{name}_bucket{{le="+Inf"}} 0.0'], name, 0.5) == (0, "none read")


def test_a_lease_read_is_judged_at_the_time_it_was_read() -> None:
    """The bench's ownership samples read 33 leases, retrying failed reads: a lease read early in a slow refresh
    is judged when it was read, not seconds later when the last read came back (it would look expired)."""
    import time

    from pulsescale.bench.watch import _Leases
    from warmpool import protocol

    now = time.time()
    lease = protocol.encode(protocol.LeaderLease(holder="r1", renewed_at=now - 1.5, lease_s=2.0))
    leases = _Leases()
    leases.apply(protocol.shard_key(0), lease, read_at=now - 1.0)  # fresh when read (0.5 s left)
    leases.apply(protocol.shard_key(1), lease)  # from the watch: judged now
    owners = leases.owner_of_shard(now + 1.0)
    assert owners[0] == "r1"
    assert owners[1] is None
    leases.apply(protocol.shard_key(0), lease, read_at=now + 0.6)  # read after it lapsed: expired
    assert leases.owner_of_shard(now + 1.0)[0] is None
