"""What `pulsescale bench decide` watches: the replicas' metrics and CPU, the leases, every slot write.

`_Replica` is one autoscaler process (its /metrics scraped, its /proc CPU seconds, its stderr counted), `_Leases`
our view of KV ``pulse_leases`` (who owns which model, judged when each lease was read), `_SlotWatch` every write
to ``pulse_slots`` (first claims for the latencies, and the double-claim check). `pulsescale.bench.decide` says what
the run does with them.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from typing import IO, Any

from warmpool import protocol
from warmpool.protocol import SlotRecord
from warmpool.registry import Changed, Snapshot
from warmpool.slots import HELD_STATES


def _scrape(port: int) -> list[str]:
    """One autoscaler's /metrics, as lines. A blocking read: one per replica per figure, not one per series."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
        body: bytes = r.read()
    return body.decode().splitlines()


def _summed(lines: list[str], name: str) -> float | None:
    """Sum of a metric's series in a scrape; None when it holds no such metric."""
    total, seen = 0.0, False
    for line in lines:
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
            seen = True
    return total if seen else None


def _labelled(lines: list[str], name: str, label: str, value: str) -> float | None:
    """Sum of a metric's series whose `label` is `value`; None when there is none."""
    total, seen, want = 0.0, False, f'{label}="{value}"'
    for line in lines:
        if line.startswith(name + "{") and want in line.split("}", 1)[0]:
            total += float(line.rsplit(" ", 1)[1])
            seen = True
    return total if seen else None


def _over(lines: list[str], name: str, over_s: float) -> tuple[int, str] | None:
    """From a histogram in a scrape: how many observations exceeded `over_s` (a bucket bound), and the smallest
    bucket bound holding them all ("+Inf" past the last); None when the scrape holds no such histogram."""
    buckets: list[tuple[float, float]] = []
    for line in lines:
        if line.startswith(name + "_bucket{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((float(le), float(line.rsplit(" ", 1)[1])))
    if not buckets:
        return None
    buckets.sort()
    total = buckets[-1][1]
    if total == 0:
        return 0, "none read"
    under = next((n for le, n in buckets if le >= over_s), total)
    longest = next(le for le, n in buckets if n >= total)
    return int(total - under), ("+Inf" if longest == float("inf") else f"{longest:g} s")


def _metric(port: int, name: str) -> float | None:
    """Sum of a metric's series on one autoscaler's /metrics; None when it exports no such metric."""
    return _summed(_scrape(port), name)


def _metric_or(port: int, name: str, default: float = 0.0) -> float:
    with contextlib.suppress(OSError):
        got = _metric(port, name)
        if got is not None:
            return got
    return default


_CLK_TCK = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a process, from /proc/<pid>/stat (fields 14 and 15); None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


LOST_LINE = "no longer the leader"
"""What an autoscaler logs (WARNING) when it loses a lease; counted while it exports no lease-lost metric."""
LOST_METRIC = "pulsescale_lease_lost_total"
LAG_METRIC = "pulsescale_event_loop_lag_seconds"
STALL_S = 0.5
"""A loop stall this long is counted in the report (the daemon warns over the same; `warmpool.looplag`)."""
RENEWAL_METRIC = "pulsescale_lease_renewal_seconds"
SLOW_RENEWAL_S = 1.0
"""A shard renewal this slow is counted in the report: two in a row and the 1.6 s fence has passed."""
SAMPLES = "pulsescale_samples_total"
RELISTS_METRIC = "pulsescale_watch_relists_total"
SPARED_METRIC = "pulsescale_watch_probes_spared_total"
RELIST_LINE = "re-listing"
"""What an autoscaler logs (WARNING) when a watch's consumer is lost; counted while it exports no re-list metric."""
SLACK_METRIC = "pulsescale_lease_renewal_slack_seconds"
SLACK_UNDER_S = 0.5
"""Renewals heard with less than this of their term left are counted in the report (~1.1 s is normal)."""


def _slack(lines: list[str]) -> tuple[int, int, float | None] | None:
    """From the slack histogram in a scrape: renewals heard, how many with under `SLACK_UNDER_S` left, and the
    lowest bucket bound holding any (None: none heard, or past the last finite bound); None when not exported."""
    buckets: list[tuple[float, float]] = []
    for line in lines:
        if line.startswith(SLACK_METRIC + "_bucket{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((float(le), float(line.rsplit(" ", 1)[1])))
    if not buckets:
        return None
    buckets.sort()
    total = int(buckets[-1][1])
    under = int(next((n for le, n in buckets if le >= SLACK_UNDER_S), 0))
    least = next((le for le, n in buckets if n > 0), None)
    return total, under, (least if least is not None and least != float("inf") else None)


@dataclass
class _Replica:
    identity: str
    port: int
    proc: subprocess.Popen[bytes]
    stderr: IO[str]  # the file its stderr goes to
    cpu_s: float = 0.0
    lost_metric: float | None = None  # the last scrape of LOST_METRIC; None while it exports none
    stalls: tuple[int, str] | None = None  # the last scrape's loop stalls over STALL_S, and the longest's bucket
    slow_renewals: tuple[int, str] | None = None  # the same for shard renewals over SLOW_RENEWAL_S
    slack: tuple[int, int, float | None] | None = None  # the last scrape's `_slack`
    relists_metric: float | None = None  # the last scrape of RELISTS_METRIC; None while it exports none
    spared: float | None = None  # the last scrape of SPARED_METRIC
    spared_by: dict[str, float] = field(default_factory=dict)  # the same by its `why` label
    killed: bool = False

    def sample(self) -> None:
        """Refresh the CPU seconds, the lease-lost count and the loop stalls while the process lives."""
        if self.killed or self.proc.poll() is not None:
            return
        if (cpu := _cpu_s(self.proc.pid)) is not None:
            self.cpu_s = cpu
        with contextlib.suppress(OSError):
            lines = _scrape(self.port)
            self.lost_metric = _summed(lines, LOST_METRIC)
            self.stalls = _over(lines, LAG_METRIC, STALL_S) or self.stalls
            self.slow_renewals = _over(lines, RENEWAL_METRIC, SLOW_RENEWAL_S) or self.slow_renewals
            self.slack = _slack(lines) or self.slack
            self.relists_metric = _summed(lines, RELISTS_METRIC)
            self.spared = _summed(lines, SPARED_METRIC)
            by = {why: _labelled(lines, SPARED_METRIC, "why", why) for why in ("late", "in_flight")}
            self.spared_by = {why: n for why, n in by.items() if n is not None}

    def warnings(self) -> int:
        self.stderr.flush()
        with open(self.stderr.name, errors="replace") as f:
            return sum(" WARNING " in line or " ERROR " in line or " CRITICAL " in line for line in f)

    def relists(self) -> int:
        if self.relists_metric is not None:
            return int(self.relists_metric)
        self.stderr.flush()
        with open(self.stderr.name, errors="replace") as f:
            return sum(" WARNING " in line and RELIST_LINE in line for line in f)

    def lost(self) -> int:
        if self.lost_metric is not None:
            return int(self.lost_metric)
        self.stderr.flush()
        with open(self.stderr.name, errors="replace") as f:
            return sum(LOST_LINE in line for line in f)


class _Leases:
    """Our view of KV `pulse_leases`: the shard leases (revision 6) when there are any, else the one leader lease.
    A model's owner is the holder of its shard's lease (or of the leader lease) while ``renewed_at + lease_s`` has
    not passed by our clock when the lease was read (a read answered late in a busy moment of this process is not
    judged seconds later, after the other reads); an expired or unreadable lease owns nothing."""

    def __init__(self) -> None:
        self.leases: dict[str, protocol.LeaderLease] = {}
        self.read_at: dict[str, float] = {}  # key -> time.time() of the read that gave its lease (none: the watch)

    def apply(self, key: str, value: bytes | None, read_at: float | None = None) -> None:
        self.leases.pop(key, None)
        self.read_at.pop(key, None)
        if read_at is not None:
            self.read_at[key] = read_at
        if not value:
            return
        with contextlib.suppress(Exception):  # something else in the bucket (overrides, replicas) or a broken one
            if key == protocol.LEADER_LEASE_KEY or key.startswith(protocol.SHARD_KEY_PREFIX):
                self.leases[key] = protocol.decode(value, protocol.LeaderLease)

    @property
    def sharded(self) -> bool:
        return any(k.startswith(protocol.SHARD_KEY_PREFIX) for k in self.leases)

    def lease_s(self) -> float | None:
        return max((lease.lease_s for lease in self.leases.values()), default=None)

    def owner_of_shard(self, now: float) -> dict[int, str | None]:
        def holder(key: str) -> str | None:
            lease = self.leases.get(key)
            at = min(now, self.read_at.get(key, now))
            return lease.holder if lease is not None and at <= lease.renewed_at + lease.lease_s else None

        if self.sharded:
            return {s: holder(protocol.shard_key(s)) for s in range(protocol.SHARDS)}
        leader = holder(protocol.LEADER_LEASE_KEY)
        return dict.fromkeys(range(protocol.SHARDS), leader)

    def ownership(self, shard_of_model: dict[str, int], live: set[str]) -> tuple[dict[str, list[str]], int]:
        """(models per live owner, models with no live owner)."""
        owners = self.owner_of_shard(time.time())
        per: dict[str, list[str]] = {}
        orphans = 0
        for m, s in shard_of_model.items():
            who = owners[s]
            if who is None or who not in live:
                orphans += 1
            else:
                per.setdefault(who, []).append(m)
        return per, orphans


async def _follow_leases(kv, leases: _Leases) -> None:  # type: ignore[no-untyped-def]
    watcher = await kv.watchall()
    try:
        async for entry in watcher:
            if entry is not None:
                leases.apply(entry.key, None if entry.operation in ("DEL", "PURGE") else entry.value)
    finally:
        with contextlib.suppress(Exception):
            await watcher.stop()


class _SlotWatch:
    """Every write to `pulse_slots` through the run, as the store's watch delivers them (each revision once).

    The double-claim check: a key whose record is written in a held state (claimed, activating, ready,
    releasing) with a claim_id different from the claim_id of its previous record while that previous record
    was itself held: a second claim while the first was still held, with no release (a record in a free state,
    claim_id cleared) between them. Each such write is counted."""

    def __init__(self) -> None:
        self.holder: dict[str, str] = {}  # key -> claim_id of the claim holding it now
        self.held: dict[tuple[str, str, str], str] = {}  # (node, slot, claim_id) -> key, for the stand-in agent
        self.first_claim: dict[str, float] = {}  # model -> perf_counter of its first claim seen
        self.claims_after: dict[str, float] = {}  # model -> first claim seen after `since`
        self.stamped_after: dict[str, float] = {}  # model -> that claim's `updated_at`, the claimer's wall clock
        self.since = float("inf")
        self.double_claims = 0
        self.writes = 0
        self.listed = False  # the first listing is in: a later one is a re-list

    def on(self, event: Any) -> None:
        if isinstance(event, Snapshot):
            for key, rec in event.records.items():
                self._seen(key, rec, snapshot=True)
            self.listed = True
        elif isinstance(event, Changed):
            self._seen(event.key, event.record, snapshot=False)

    def _seen(self, key: str, rec: SlotRecord, *, snapshot: bool) -> None:
        self.writes += not snapshot
        prev = self.holder.get(key)
        if rec.state in HELD_STATES and rec.claim_id is not None:
            if prev is not None and prev != rec.claim_id and not snapshot:
                self.double_claims += 1
            if prev is not None and prev != rec.claim_id:
                self.held.pop((rec.node, rec.slot, prev), None)
            self.holder[key] = rec.claim_id
            self.held[(rec.node, rec.slot, rec.claim_id)] = key
            # A claim first seen in a re-listing (this process's watch made anew) is timed when the listing came:
            # late, but seen; the first listing holds none of the run's claims.
            if rec.state == "claimed" and prev != rec.claim_id and (not snapshot or self.listed):
                now = time.perf_counter()
                self.first_claim.setdefault(rec.model, now)
                if now >= self.since and rec.model not in self.claims_after:
                    self.claims_after[rec.model] = now
                    self.stamped_after[rec.model] = rec.updated_at
        elif prev is not None:
            del self.holder[key]
            self.held.pop((rec.node, rec.slot, prev), None)
