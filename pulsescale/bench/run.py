"""One end-to-end run of `pulsescale bench decide`: one method per phase, and the report.

`_Run` holds the broker, the seeded pool, the replicas and what is watched (`pulsescale.bench.watch`), and sends
what `pulsescale.bench.traffic` makes: the seeding, the replicas' start, the background samples, the timed pulses,
the takeover, the ingest through NATS and the report. Each phase is bounded (the constants below).
`pulsescale.bench.decide` runs the phases in order and says what is measured and how.

Each phase prints its lines of the text report as it ends (`_Run.say`: on stdout, or on stderr as progress with
``-o json|yaml``) and files the same figures in `_Run.result` (`pulsescale.bench.report.DecideReport`), which
`-o json|yaml` prints at the end, alone on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import IO, Any

import nats.js.errors
import numpy as np

from pulsescale.bench import report as rpt
from pulsescale.bench.gateways import QUIET_SUBJECT, cycle
from pulsescale.bench.ingest import ingest_through_nats
from pulsescale.bench.traffic import INGEST_IN_PROCESS_MAX_S, _Floor, _sample, _spec
from pulsescale.bench.watch import (
    LAG_METRIC,
    LOST_LINE,
    LOST_METRIC,
    RENEWAL_METRIC,
    SLACK_METRIC,
    SLACK_UNDER_S,
    SLOW_RENEWAL_S,
    STALL_S,
    _Leases,
    _metric_or,
    _Replica,
    _scrape,
    _SlotWatch,
    _summed,
)
from warmpool import output as out
from warmpool import protocol
from warmpool.embedded import NatsServer, free_port
from warmpool.errors import PulsescaleError
from warmpool.protocol import ScalerRecord
from warmpool.registry import KvSlotStore
from warmpool.seed import seed_pool


def _pct(xs: list[float]) -> str:
    ms = np.array(xs) * 1e3
    return f"p50 {np.percentile(ms, 50):.2f} ms   p99 {np.percentile(ms, 99):.2f} ms   max {ms.max():.2f} ms"


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else out.finite(seconds * 1e3)


SEED_BATCH = 100
"""Models seeded at once (their slots, agent leases and ScaledObjects written concurrently)."""
PULSE_TIMEOUT_S = 2.0
"""A timed pulse with no claim after this long counts as unanswered."""
READY_TIMEOUT_S = 60.0
"""The replicas must own every model (and the ownership settle) within this long of starting."""
TAKEOVER_GRACE_S = 10.0
"""After a SIGKILL, the killed replica's models are pulsed until claimed, at most lease_s + this long."""
GATEWAY_PHASES = 10
"""The background gateways speak at this many phases of each 100 ms (`pulsescale.bench.gateways`), as independent
gateways do; `--gateways-in-step` puts them all at one (a pulse then waits behind every model's sample)."""
WARM_UP_S = 3.5
"""Steady traffic before the pulses, past the windows' settling (`PolicySpec.trend_settle_s` of the bench's spec):
a model is skipped from the turn after its first decision on settled windows, one or two turns of
`redecide_every_s` (1 s) later."""
OWNERSHIP_EVERY_S = 0.25
"""How often the ownership is sampled between the named checks."""
TAKEOVER_SAMPLE = 100
"""Models of the killed replica pulsed (a sample, so the phase stays short at 1,000s of models)."""
INGEST_SETTLE_MAX_S = 30.0
"""The ingest through NATS reads the replicas' counts at most this long after publishing."""
DECISION_BOUNDS = ("0.002", "0.005", "0.01", "0.02", "0.05")
"""The ``pulsescale_decision_seconds`` buckets (``le``, s) the report counts decisions within."""


class _Run:
    """One end-to-end run: the broker, the seeded pool, the replicas and what is watched; one method per phase."""

    def __init__(self, args: argparse.Namespace, server: NatsServer, nc: Any, store: KvSlotStore) -> None:
        self.args = args
        self.server = server
        self.nc = nc
        self.store = store
        self.models = [f"m{i}" for i in range(args.models)]
        self.shard_of_model = {m: protocol.shard_of(m) for m in self.models}
        self.replicas: list[_Replica] = []
        self.leases = _Leases()
        self.slots = _SlotWatch()
        self.quiet: set[str] = set()  # models the background leaves alone (pulsed ones: their last word stands)
        self.t0 = time.time()  # the background gateways number their samples by the 100 ms period since this
        self.seq = 1  # the pulses' sequence number: past the background's (`gateways.cycle`)
        self.gateways_up = False  # the background gateways' process is running (`background`)
        self.checks: list[bool] = []
        self.in_takeover = False  # from the SIGKILL until the survivors hold every lease: orphans are expected
        self.ownership_samples = 0
        self.orphaned_samples = 0  # samples that found a model without a live owner
        self.phase = "warm-up"  # the run's phase now, to say where the orphans were found
        self.orphans_by_phase: collections.Counter[str] = collections.Counter()
        self.most_orphans = 0
        self.leases_kv: Any = None  # KV pulse_leases, for the named checks' fresh reads
        self.floor: _Floor | None = None  # the decide floor, set up before the replicas start
        self.owned_at: float | None = None  # perf_counter() when every model first had a live owner
        self.pulses_began: float | None = None
        self.pulses_ended: float | None = None
        self.last_owned: dict[str, list[str]] = {}  # the last ownership sampled with an owner (picks the victim)
        self.fmt = out.machine(args)  # json/yaml: `result` printed at the end, the text report goes to stderr
        self.result = rpt.DecideReport(
            models=args.models, replicas=args.replicas, pulses=args.pulses, samples=args.samples,
            kill=bool(args.kill), gateways_in_step=bool(args.gateways_in_step),
            gateway_phases=1 if args.gateways_in_step else GATEWAY_PHASES, pulse_budget_s=args.pulse_budget_s,
            log_level=args.log_level, logs=args.logs, pulses_after_s=args.pulses_after, cpu_hog=args.cpu_hog,
            replicas_from=getattr(args, "replicas_from", None),
            bounds=rpt.Bounds(
                ingest_in_process_max_s=INGEST_IN_PROCESS_MAX_S, ready_timeout_s=READY_TIMEOUT_S,
                pulse_budget_s=args.pulse_budget_s, pulse_timeout_s=PULSE_TIMEOUT_S,
                takeover_grace_s=TAKEOVER_GRACE_S, ingest_settle_max_s=INGEST_SETTLE_MAX_S,
            ),
        )  # fmt: skip

    def say(self, line: str) -> None:
        """A line of the text report: on stdout, or, with -o json|yaml, on stderr as progress (stdout carries the
        object only)."""
        print(line, file=out.progress(self.fmt), flush=True)

    def live(self) -> set[str]:
        return {r.identity for r in self.replicas if not r.killed and r.proc.poll() is None}

    async def refresh_leases(self, attempts: int = 3) -> None:
        """Read the leases afresh: the named checks must not judge a lease by our watch, which lags when this
        process is busy publishing the background samples (a lease would look expired when it is not). A read
        that failed (a timeout, this process saturated) is asked again, up to `attempts` rounds."""
        keys = [protocol.LEADER_LEASE_KEY, *(protocol.shard_key(s) for s in range(protocol.SHARDS))]

        async def one(key: str) -> None:
            try:
                entry = await self.leases_kv.get(key)
            except nats.js.errors.KeyNotFoundError:
                self.leases.apply(key, None, read_at=time.time())
            else:
                self.leases.apply(key, entry.value, read_at=time.time())
            keys.remove(key)

        for _ in range(attempts):
            if not keys:
                return
            await asyncio.gather(*(one(k) for k in list(keys)), return_exceptions=True)

    async def settle(self, timeout_s: float) -> float:
        """Wait until every model has a live owner and every live replica holds a share (the shards split over
        them); returns how long it took."""
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout_s:
            await self.refresh_leases()
            per, orphans = self.leases.ownership(self.shard_of_model, self.live())
            if orphans == 0 and (len(per) == len(self.live()) or not self.leases.sharded):
                break
            await asyncio.sleep(0.1)
        return time.perf_counter() - t0

    def print_own_decision_times(self) -> None:
        """The autoscalers' own view of the same path, from their ``pulsescale_decision_seconds`` histograms: a
        sample taken in -> its first claim written, with no NATS hop or bench process on either end."""
        live = [r for r in self.replicas if not r.killed and r.proc.poll() is None]
        scrapes = []
        for r in live:
            with contextlib.suppress(OSError):
                scrapes.append(_scrape(r.port))
        total = sum(_summed(lines, "pulsescale_decision_seconds_count") or 0.0 for lines in scrapes)
        under = {
            le: sum(_summed(lines, f'pulsescale_decision_seconds_bucket{{le="{le}"}}') or 0.0 for lines in scrapes)
            for le in DECISION_BOUNDS
        }
        within = ", ".join(f"{n:.0f} within {float(le) * 1e3:.0f} ms" for le, n in under.items())
        self.say(f"the autoscalers' own decision time (pulsescale_decision_seconds since start): of {total:.0f}, "
                 f"{within}")  # fmt: skip
        w2, w5, w10, w20, w50 = (round(under[le]) for le in DECISION_BOUNDS)
        self.result.own_decision_time = rpt.OwnDecisionTime(
            decisions=round(total), within_2_ms=w2, within_5_ms=w5, within_10_ms=w10, within_20_ms=w20, within_50_ms=w50
        )

    async def check_owners(self, when: str) -> dict[str, list[str]]:
        await self.refresh_leases()
        per, orphans = self.leases.ownership(self.shard_of_model, self.live())
        self.checks.append(orphans == 0)
        counts = {r.identity: len(per.get(r.identity, [])) for r in self.replicas if not r.killed}
        spread = "  ".join(f"{who} {n}" for who, n in counts.items())
        mode = "shard leases" if self.leases.sharded else f"the {protocol.LEADER_LEASE_KEY!r} leader lease"
        self.say(f"ownership {when} (from {mode}): models per replica: {spread};"
                 f" models without a live owner: {orphans}")  # fmt: skip
        self.result.ownership.checks.append(
            rpt.OwnershipCheck(
                when=when, leases="shard" if self.leases.sharded else "leader", models_per_replica=counts,
                models_without_live_owner=orphans, passed=orphans == 0,
            )
        )  # fmt: skip
        return per

    async def seed(self, scalers: Any) -> None:
        async def one(i: int, m: str) -> None:
            await seed_pool(self.store, m, nodes=2, slots_per_node=2, node_prefix=f"n{i}")
            rec = ScalerRecord(namespace="bench", name=m, spec=_spec(m))
            await scalers.put(rec.key, protocol.encode(rec))

        for lo in range(0, len(self.models), SEED_BATCH):
            await asyncio.gather(*(one(i, self.models[i]) for i in range(lo, min(lo + SEED_BATCH, len(self.models)))))

    def start_replicas(self) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if self.args.replicas_from:  # another checkout's autoscaler under this bench: before/after in one bench
            env["PYTHONPATH"] = os.path.abspath(self.args.replicas_from)
        for idx in range(self.args.replicas):
            identity = f"bench-r{idx}"
            err: IO[str]
            if self.args.logs:
                os.makedirs(self.args.logs, exist_ok=True)
                err = open(os.path.join(self.args.logs, f"{identity}.log"), "w+")  # noqa: SIM115 - closed at the end
            else:
                err = tempfile.NamedTemporaryFile("w+", prefix=f"bench-decide-{identity}-", suffix=".log")  # noqa: SIM115
            port = free_port()
            proc = subprocess.Popen(
                [sys.executable, "-m", "pulsescale", "autoscaler", "--nats", self.server.url,
                 "--metrics-port", str(port), "--identity", identity, "--log-level", self.args.log_level],
                env=env, stderr=err, cwd=self.args.replicas_from or None,  # `-m` puts the cwd first on the path
            )  # fmt: skip
            self.replicas.append(_Replica(identity=identity, port=port, proc=proc, stderr=err))

    async def wait_ready(self) -> None:
        """Every model has a live owner and the spread has not changed for a second (replicas that join later
        rebalance the shards); under the leader lease, the leader also says so on its metrics."""
        deadline = time.perf_counter() + READY_TIMEOUT_S
        last, stable_since = None, time.perf_counter()
        while time.perf_counter() < deadline:
            per, orphans = self.leases.ownership(self.shard_of_model, self.live())
            if orphans == 0 and self.owned_at is None and self.leases.sharded:
                self.owned_at = time.perf_counter()  # what --pulses-after counts from
            spread = sorted((w, len(ms)) for w, ms in per.items())
            if spread != last:
                last, stable_since = spread, time.perf_counter()
            leading = self.leases.sharded or any(_metric_or(r.port, "pulsescale_leader") == 1 for r in self.replicas)
            if orphans == 0 and leading and time.perf_counter() - stable_since >= 1.0:
                self.result.replicas_settled = True
                return
            if any(r.proc.poll() is not None for r in self.replicas):
                raise PulsescaleError("an autoscaler exited during start-up; run with --logs DIR to keep its stderr")
            await asyncio.sleep(0.1)
        self.say(f"replicas not settled after {READY_TIMEOUT_S:.0f} s; going on")

    async def watch_ownership(self, stop: asyncio.Event) -> None:
        """Between the named checks, sample the ownership every `OWNERSHIP_EVERY_S` (outside the takeover), so a
        lease lost and not yet retaken shows even when no named check falls on it."""
        while not stop.is_set():
            if not self.in_takeover:
                await self.refresh_leases()
            if not self.in_takeover:  # again: the kill may have come while the leases were read
                per, orphans = self.leases.ownership(self.shard_of_model, self.live())
                self.last_owned = per or self.last_owned
                self.ownership_samples += 1
                self.orphaned_samples += orphans > 0
                if orphans:
                    self.orphans_by_phase[self.phase] += 1
                self.most_orphans = max(self.most_orphans, orphans)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), OWNERSHIP_EVERY_S)

    async def background(self, stop: asyncio.Event) -> None:
        """Every model's gateway speaks every 100 ms (the contract's pace): 10 samples/s x models, from a process of
        their own (`pulsescale.bench.gateways`): gateways are other processes, and 30,000 samples a second published
        from this one held up its loop, which times the claims and answers the activations."""
        proc = self._spawn_gateways()
        try:
            assert proc.stdout is not None
            line = await asyncio.to_thread(proc.stdout.readline)
            if line.strip() != "ready":
                raise PulsescaleError(f"the background gateways did not start (said {line!r})")
            self.gateways_up = True
            if self.quiet:
                await self.hush(self.quiet)
            await stop.wait()
        finally:
            self.gateways_up = False
            with contextlib.suppress(OSError):
                assert proc.stdin is not None
                proc.stdin.close()
            try:
                await asyncio.to_thread(proc.wait, 5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def _spawn_gateways(self) -> subprocess.Popen[str]:
        phases = 1 if self.args.gateways_in_step else GATEWAY_PHASES
        return subprocess.Popen(
            [sys.executable, "-m", "pulsescale.bench.gateways", self.server.url, str(len(self.models)), str(phases),
             repr(self.t0)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip

    async def hush(self, models: set[str] | list[str]) -> None:
        """The background leaves `models` alone from now on (their last word is ours): told, and answered, before
        a pulse is sent."""
        self.quiet.update(models)
        if self.gateways_up:
            await self.nc.request(QUIET_SUBJECT, " ".join(models).encode(), timeout=5)

    async def pulse(self, m: str, depth: int) -> None:
        self.seq = max(self.seq + 1, cycle(self.t0) + 1)  # past the background's number for it now
        await self.nc.publish(protocol.queue_subject(m), _sample(m, self.seq, depth))

    async def timed_pulses(self) -> dict[str, list[str]]:
        """The pulsed models are spread over all models, so every replica's share is exercised. Each of our pulses
        is followed by one of the floor's (`_Floor`), so both meet the same moments of the machine."""
        args, models = self.args, self.models
        n_pulses = min(args.pulses, len(models))
        pulse_models = [models[i * len(models) // n_pulses] for i in range(n_pulses)]
        floor_models = self.floor.models if self.floor is not None else []
        latencies, floor = [], []
        pulse_deadline = time.perf_counter() + args.pulse_budget_s
        self.result.pulses_timed = self.result.pulses_sent = n_pulses
        self.pulses_began = time.perf_counter()
        for k, m in enumerate(pulse_models):
            if time.perf_counter() > pulse_deadline:
                self.say(f"pulse budget of {args.pulse_budget_s:.0f} s spent after {k} pulses")
                self.result.pulses_sent, self.result.pulse_budget_spent = k, True
                break
            if k == n_pulses // 2:
                await self.check_owners("mid-pulses")
            await self.hush([m])
            t0 = time.perf_counter()
            # Demand 4 (= targetQueueDepth): one replica wanted, so the model's other slots stay free for the
            # takeover pulses.
            await self.pulse(m, 4)
            while m not in self.slots.first_claim and time.perf_counter() - t0 < PULSE_TIMEOUT_S:
                await asyncio.sleep(0.0005)
            ours = self.slots.first_claim[m] - t0 if m in self.slots.first_claim else None
            if ours is not None:
                latencies.append(ours)
            await asyncio.sleep(0.02)
            took = None
            if self.floor is not None and k < len(floor_models):
                took = await self.floor.pulse(floor_models[k])
                if took is not None:
                    floor.append(took)
                await asyncio.sleep(0.02)
            self.result.each_pulse.append(
                rpt.Pulse(model=m, at_s=self.since_owned(t0), ms=_ms(ours), floor_ms=_ms(took))
            )
        self.pulses_ended = time.perf_counter()
        # The scrapes in threads: read on this loop, 3,000 models' /metrics from busy replicas held it for seconds,
        # and the lease reads of the check after timed out behind it (every model looked orphaned).
        await asyncio.gather(*(asyncio.to_thread(r.sample) for r in self.replicas))
        await asyncio.to_thread(self.print_own_decision_times)
        per = await self.check_owners("after the pulses")
        gateways = "in step" if args.gateways_in_step else f"at {GATEWAY_PHASES} phases"
        when = (
            f"from {args.pulses_after:g} s after every model had an owner"
            if args.pulses_after is not None
            else "after the windows settled"
        )
        self.say(f"decision latency, sample published -> first claim written ({args.models} models active over "
                 f"{args.replicas} replica(s), gateways {gateways}, pulses {when}"
                 f"{', beside --cpu-hog' if args.cpu_hog else ''}, {len(latencies)}/{n_pulses} pulses "
                 "answered):")  # fmt: skip
        if latencies:
            self.say(f"  {_pct(latencies)}")
        self.say(f"floor, bare nats-py in the same run, its pulses between ours: sample published -> one kv.update "
                 f"-> watcher sees it ({len(floor)}/{n_pulses} answered):")  # fmt: skip
        if floor:
            self.say(f"  {_pct(floor)}")
        res = self.result
        res.decision, res.floor = rpt.percentiles(latencies), rpt.percentiles(floor)
        res.pulses_window_s = rpt.Window(
            began_s=self.since_owned(self.pulses_began), ended_s=self.since_owned(self.pulses_ended)
        )
        if latencies and floor:
            r50 = np.percentile(latencies, 50) / np.percentile(floor, 50)
            r99 = np.percentile(latencies, 99) / np.percentile(floor, 99)
            self.say(f"ratio to the floor: p50 {r50:.2f}x   p99 {r99:.2f}x")
            res.ratio_to_floor_p50, res.ratio_to_floor_p99 = out.finite(float(r50)), out.finite(float(r99))
        return per

    def since_owned(self, t: float | None) -> float | None:
        """Seconds from the moment every model first had a live owner (`wait_ready`) to `t`."""
        return None if t is None or self.owned_at is None else out.finite(t - self.owned_at)

    async def takeover(self, per: dict[str, list[str]]) -> None:
        """SIGKILL the replica owning the most models; pulse a sample of its models with rising demand every
        100 ms until each is claimed again (by whoever owns it now); the takeover time is kill -> first claim."""
        per = per or self.last_owned  # nobody owns anything this instant (a lease lost): the last one that did
        victim = max(
            (r for r in self.replicas if r.identity in per and r.proc.poll() is None),
            key=lambda r: len(per[r.identity]),
            default=None,
        )
        if victim is None:
            self.say("takeover: no replica owns a model; nothing to kill")
            return
        owned = per[victim.identity]
        sample = ([m for m in owned if m not in self.quiet] + [m for m in owned if m in self.quiet])[:TAKEOVER_SAMPLE]
        lease_s = self.leases.lease_s() or 2.0
        bar = lease_s + 1.0
        victim.sample()
        await self.hush(sample)
        self.in_takeover = True
        self.slots.since = t_kill = time.perf_counter()
        wall_kill = time.time()
        os.kill(victim.proc.pid, signal.SIGKILL)
        victim.killed = True
        self.say(f"takeover: SIGKILL {victim.identity} (owned {len(owned)} models); pulsing {len(sample)} of them "
                 f"(demand 16) every 100 ms until claimed")  # fmt: skip
        waiting = set(sample)
        deadline = t_kill + lease_s + TAKEOVER_GRACE_S
        while waiting and time.perf_counter() < deadline:
            waiting -= self.slots.claims_after.keys()
            for m in waiting:
                await self.pulse(m, 16)
            await asyncio.sleep(0.1)
        took = [self.slots.claims_after[m] - t_kill for m in sample if m in self.slots.claims_after]
        line = f"takeover time, SIGKILL -> first claim ({len(took)}/{len(sample)} models claimed again)"
        p50: float | None = None
        worst: float | None = None
        met = False
        if took:
            p50, worst = float(np.percentile(took, 50)), max(took)
            met = worst <= bar and len(took) == len(sample)
            self.say(f"{line}: p50 {p50 * 1e3:.0f} ms   max {worst * 1e3:.0f} ms   bar lease_s + 1 s = "
                     f"{bar * 1e3:.0f} ms ({'met' if met else 'NOT met'})")  # fmt: skip
        else:
            self.say(f"{line}: bar lease_s + 1 s = {bar * 1e3:.0f} ms (NOT met)")
        # The same claims by their writers' own stamps: what of the time is the autoscaler's, and what this process
        # took to see the claims (its watch shares a core with the background samples it publishes).
        stamped = [self.slots.stamped_after[m] - wall_kill for m in sample if m in self.slots.stamped_after]
        stamped_p50 = float(np.percentile(stamped, 50)) if stamped else None
        if stamped:
            self.say(f"  the same, by each claim's own stamp (updated_at, the claimer's clock): p50 "
                     f"{float(np.percentile(stamped, 50)) * 1e3:.0f} ms   max {max(stamped) * 1e3:.0f} ms")  # fmt: skip
        self.result.takeover = rpt.Takeover(
            killed=victim.identity, killed_owned_models=len(owned), models_pulsed=len(sample),
            models_claimed_again=len(took), lease_s=lease_s, bar_ms=bar * 1e3,
            p50_ms=_ms(p50), max_ms=_ms(worst), met=met,
            stamped=len(stamped), stamped_p50_ms=_ms(stamped_p50), stamped_max_ms=_ms(max(stamped, default=None)),
        )  # fmt: skip
        # The survivors take the killed replica's leases as each expires: look once none is left without a live
        # owner (or the phase's bound has passed, and the check says so).
        while time.perf_counter() < deadline:
            await self.refresh_leases()
            if self.leases.ownership(self.shard_of_model, self.live())[1] == 0:
                break
            await asyncio.sleep(0.1)
        self.in_takeover = False
        await self.check_owners("after the takeover")

    async def ingest(self) -> None:
        """Samples published as fast as one publisher can, counted by each live replica, then as many to the floor's
        bare subscriber (`pulsescale.bench.ingest`)."""
        alive = [r for r in self.replicas if not r.killed]
        self.result.ingest_through_nats = await ingest_through_nats(
            self.nc, self.server.url, [(r.identity, r.port, r.proc.pid) for r in alive], self.models,
            self.args.samples, self.say,
        )  # fmt: skip

    def report(self, t_start: float) -> None:
        for r in self.replicas:
            r.sample()
        lost = {r.identity: r.lost() for r in self.replicas}
        self.say(f"leases lost during the run: {sum(lost.values())}"
                 f" (from {LOST_METRIC} where exported, else {LOST_LINE!r} lines in stderr)")  # fmt: skip
        for what, over, attr, name in (
            ("event-loop stalls", STALL_S, "stalls", f"{LAG_METRIC}, read every 100 ms"),
            ("shard lease renewals", SLOW_RENEWAL_S, "slow_renewals", RENEWAL_METRIC),
        ):
            self.say(
                f"{what} over {over:g} s per replica ({name}; the longest within the bucket bound given): "
                + "  ".join(
                    f"{r.identity} "
                    + (f"{got[0]} (longest <= {got[1]})" if (got := getattr(r, attr)) else "not exported")
                    + (" (until killed)" if r.killed else "")
                    for r in self.replicas
                )
            )
        self.say(
            f"shard lease renewals heard with under {SLACK_UNDER_S:g} s of their term left per replica "
            f"({SLACK_METRIC}): "
            + "  ".join(
                f"{r.identity} "
                + (
                    f"{r.slack[1]} of {r.slack[0]} (least <= {r.slack[2]:g} s)"
                    if r.slack is not None and r.slack[2] is not None
                    else f"{r.slack[1]} of {r.slack[0]}"
                    if r.slack is not None
                    else "not exported"
                )
                for r in self.replicas
            )
        )
        self.say(
            "CPU seconds per replica (/proc/<pid>/stat utime+stime): "
            + "  ".join(f"{r.identity} {r.cpu_s:.1f}{' (killed)' if r.killed else ''}" for r in self.replicas)
        )
        relists = {r.identity: r.relists() for r in self.replicas}
        self.say(
            "watches re-listed per replica (pulsescale_watch_relists_total, else re-listing warnings in stderr; "
            "probes spared: pulsescale_watch_probes_spared_total): "
            + "  ".join(
                f"{r.identity} {relists[r.identity]}"
                + (
                    f" (spared {int(r.spared)}: "
                    + ", ".join(f"{why} {int(n)}" for why, n in sorted(r.spared_by.items()))
                    + ")"
                    if r.spared is not None
                    else ""
                )
                + ("" if r.relists_metric is not None else " (stderr)")
                for r in self.replicas
            )
            + f"; the bench's own slot watch {self.store.slots.relists}"
        )
        warnings = {r.identity: r.warnings() for r in self.replicas}
        self.say(
            "stderr lines per replica (WARNING or worse): "
            + "  ".join(f"{r.identity} {warnings[r.identity]}" for r in self.replicas)
            + (f" (kept in {self.args.logs})" if self.args.logs else " (--logs DIR keeps them)")
        )
        self.say(
            f"slot writes watched: {self.slots.writes}; slots claimed twice without a release between (a held "
            f"record's claim_id replaced by another while the first was still held): {self.slots.double_claims}"
        )
        self.say(f"ownership sampled every {OWNERSHIP_EVERY_S * 1e3:.0f} ms outside the takeover: "
                 f"{self.ownership_samples} samples, {self.orphaned_samples} found models without a live owner "
                 f"(at most {self.most_orphans}"
                 + "".join(f"; {n} in the {phase}" for phase, n in sorted(self.orphans_by_phase.items()))
                 + ")")  # fmt: skip
        # The warm-up's samples fall on the replicas joining one after another: a shard handed over has no lease
        # between the giver's delete and the taker's next round (at most one owner, never two). The bar is for the
        # run after the shards have settled; the warm-up's are printed above, not counted.
        counted = self.orphaned_samples - self.orphans_by_phase["warm-up"]
        one = all(self.checks) and counted == 0
        self.say(f"every model has exactly one owner: {'yes' if one else 'no'} "
                 f"({sum(self.checks)}/{len(self.checks)} named checks passed, {counted} samples with orphans after "
                 f"the shards settled)")  # fmt: skip
        run_s = time.perf_counter() - t_start
        self.say(f"run length: {run_s:.1f} s (bounded: in-process ingest <= "
                 f"{INGEST_IN_PROCESS_MAX_S:.0f} s, start-up <= {READY_TIMEOUT_S:.0f} s,"
                 f" pulses <= {self.args.pulse_budget_s:.0f} s + {PULSE_TIMEOUT_S:.0f} s, takeover <= lease_s + "
                 f"{TAKEOVER_GRACE_S:.0f} s, ingest <= {INGEST_SETTLE_MAX_S:.0f} s after publishing)")  # fmt: skip
        res = self.result
        res.leases_lost = sum(lost.values())
        res.per_replica = [
            rpt.ReplicaFigures(
                identity=r.identity, killed=r.killed, cpu_s=r.cpu_s, leases_lost=lost[r.identity],
                leases_lost_from=LOST_METRIC if r.lost_metric is not None else "stderr",
                loop_stalls=rpt.over(r.stalls, STALL_S), slow_lease_renewals=rpt.over(r.slow_renewals, SLOW_RENEWAL_S),
                slack=None if r.slack is None else rpt.Slack(
                    renewals=r.slack[0], under_s=SLACK_UNDER_S, under=r.slack[1], least_within_s=r.slack[2]
                ),
                warnings=warnings[r.identity], relists=relists[r.identity],
                relists_from="metric" if r.relists_metric is not None else "stderr",
                probes_spared=None if r.spared is None else int(r.spared),
            )
            for r in self.replicas
        ]  # fmt: skip
        res.slot_writes, res.double_claims = self.slots.writes, self.slots.double_claims
        res.bench_relists = self.store.slots.relists
        own = res.ownership
        own.named_checks_passed = sum(self.checks)
        own.sampled_every_ms = OWNERSHIP_EVERY_S * 1e3
        own.samples, own.samples_with_orphans = self.ownership_samples, self.orphaned_samples
        own.most_orphans = self.most_orphans
        own.samples_with_orphans_by_phase = dict(sorted(self.orphans_by_phase.items()))
        own.samples_with_orphans_after_settled, own.one_owner_per_model = counted, one
        res.run_s = run_s

    def stop_replicas(self) -> None:
        for r in self.replicas:
            if r.proc.poll() is None:
                r.proc.terminate()
        for r in self.replicas:
            with contextlib.suppress(subprocess.TimeoutExpired):
                r.proc.wait(10)
            if r.proc.poll() is None:
                r.proc.kill()
                r.proc.wait()
            if not r.stderr.closed:
                r.stderr.close()
