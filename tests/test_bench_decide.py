"""`pulsescale bench decide` runs end to end with a few models and prints the decision latency next to the bare
nats-py floor of the same run and their ratio; with `--replicas 2` it also prints the ownership (every model one
owner, checked during the run), the SIGKILL takeover section, the leases lost, CPU per replica and the
double-claim count (the numbers themselves are not asserted beyond sanity: a benchmark, on a shared machine)."""

from __future__ import annotations

import re
import subprocess
import sys


def _run(*args: str) -> str:
    return subprocess.run(
        [sys.executable, "-m", "pulsescale", "bench", "decide", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout


def test_bench_decide_with_two_replicas_prints_ownership_takeover_and_the_floor() -> None:
    out = _run("--models", "6", "--replicas", "2", "--pulses", "4", "--samples", "300")
    figures = re.findall(r"p50 ([\d.]+) ms\s+p99 ([\d.]+) ms", out)
    assert "decision latency" in out, out
    assert "6 models active over 2 replica(s), gateways at 10 phases, 4/4 pulses answered" in out, out
    assert "floor, bare nats-py in the same run" in out and "(4/4 answered)" in out, out
    assert len(figures) == 2, out  # the decision's p50/p99, then the floor's
    assert all(float(p50) > 0 and float(p99) >= float(p50) for p50, p99 in figures), out
    assert re.search(r"ratio to the floor: p50 [\d.]+x\s+p99 [\d.]+x", out), out
    own = re.search(
        r"own decision time .*: of (\d+), (\d+) within 2 ms, (\d+) within 5 ms, (\d+) within 10 ms, "
        r"(\d+) within 20 ms, (\d+) within 50 ms",
        out,
    )
    assert own, out  # the autoscalers' histogram: cumulative, and at least the 4 answered pulses counted
    total, *within = map(int, own.groups())
    assert total >= 4 and within == sorted(within) and within[-1] <= total, out
    # Ownership, checked several times during the run, each time every model with a live owner.
    checks = re.findall(r"models per replica: (.*?); models without a live owner: (\d+)", out)
    assert len(checks) >= 3 and all(orphans == "0" for _, orphans in checks), out
    for spread, _ in checks[:-1]:  # before the kill: both replicas listed, 6 models between them
        counts = dict(re.findall(r"(bench-r\d) (\d+)", spread))
        assert set(counts) == {"bench-r0", "bench-r1"} and sum(map(int, counts.values())) == 6, out
    assert re.search(r"every model has exactly one owner: yes \((\d+)/\1 named checks passed, 0 samples", out), out
    # Every orphan sample, if any, was in the warm-up (replicas joining, shards handed over): none after.
    sampled = re.search(r"ownership sampled every 250 ms outside the takeover: [1-9]\d* samples, (\d+) found [^(]*"
                        r"\(at most \d+(?:; (\d+) in the warm-up)?\)", out)  # fmt: skip
    assert sampled and int(sampled[1]) == int(sampled[2] or 0), out
    # The kill section: a replica killed, its models claimed again, timed against the bar.
    assert re.search(r"takeover: SIGKILL bench-r\d \(owned [1-6] models\)", out), out
    took = re.search(r"takeover time, SIGKILL -> first claim \((\d+)/(\d+) models claimed again\): p50 (\d+) ms\s+"
                     r"max (\d+) ms\s+bar lease_s \+ 1 s = (\d+) ms", out)  # fmt: skip
    assert took and took[1] == took[2] and int(took[2]) >= 1, out
    assert int(took[3]) <= int(took[4]), out
    # The same claims by the claimers' stamps: after the kill, and no later than this process saw them (+ slack:
    # two processes' wall clocks are one clock here, but the stamp is taken before the write is sent).
    stamped = re.search(r"the same, by each claim's own stamp \(updated_at, the claimer's clock\): p50 (-?\d+) ms\s+"
                        r"max (-?\d+) ms", out)  # fmt: skip
    assert stamped and 0 < int(stamped[1]) <= int(stamped[2]) <= int(took[4]) + 50, out
    survivors = dict(re.findall(r"(bench-r\d) (\d+)", checks[-1][0]))
    assert len(survivors) == 1 and int(next(iter(survivors.values()))) == 6, out  # the survivor owns all
    assert re.search(r"slots claimed twice without a release between .*: 0$", out, re.M), out
    assert re.search(r"leases lost during the run: \d+", out), out
    assert re.search(r"CPU seconds per replica .*bench-r0 [\d.]+.*bench-r1 [\d.]+", out), out
    assert "(killed)" in out, out
    assert re.search(r"event-loop stalls over 0.5 s per replica .*bench-r0 \d+ \(longest <= ([\d.]+ s|\+Inf)\)"
                     r".*bench-r1 \d+ \(longest", out), out  # fmt: skip
    assert re.search(r"shard lease renewals over 1 s per replica .*bench-r1 \d+ \(longest <= ", out), out
    length = re.search(r"run length: ([\d.]+) s", out)
    assert length and float(length[1]) < 120, out


def test_bench_decide_with_the_gateways_in_step_says_so() -> None:
    out = _run("--models", "3", "--pulses", "2", "--samples", "300", "--gateways-in-step")
    assert "3 models active over 1 replica(s), gateways in step, 2/2 pulses answered" in out, out
    assert "SIGKILL" not in out, out  # one replica: nothing to kill


def test_the_double_claim_check_counts_a_new_claim_over_a_held_one_and_not_after_a_release() -> None:
    from autoscaler.bench import _SlotWatch
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
    from autoscaler.bench import _over

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

    from autoscaler.bench import _Leases
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
