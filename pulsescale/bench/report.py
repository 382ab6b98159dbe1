"""`pulsescale bench decide --json` (``-o json|yaml``): the one object printed, and the helpers that fill it.

Every figure the text report prints, as a named field with its unit in the name (``p50_ms``, ``cpu_s``,
``samples_per_s``); a figure that cannot be computed (no pulse answered, a replica never scraped) is None (JSON
null), never NaN. The run fills a `DecideReport` phase by phase (`pulsescale.bench.run._Run`); it is printed at
the end, alone on stdout. Pure: structs and arithmetic, no I/O.
"""

from __future__ import annotations

import msgspec
import numpy as np

from warmpool.output import finite

__all__ = [
    "Bounds",
    "DecideReport",
    "IngestThroughNats",
    "OwnDecisionTime",
    "OwnershipCheck",
    "Ownership",
    "Over",
    "Percentiles",
    "Pulse",
    "ReplicaFigures",
    "Slack",
    "Takeover",
    "Window",
    "over",
    "percentiles",
    "ratio",
]


def ratio(num: float | None, den: float | None) -> float | None:
    """num / den, or None when either is missing or den is 0."""
    return finite(num / den) if num is not None and den else None


class Percentiles(msgspec.Struct, kw_only=True):
    """Latencies of the pulses answered; the figures are None when none was."""

    answered: int
    p50_ms: float | None
    p99_ms: float | None
    max_ms: float | None


def percentiles(latencies_s: list[float]) -> Percentiles:
    """The figures the text report prints for `latencies_s` (seconds), in ms, computed as it computes them."""
    if not latencies_s:
        return Percentiles(answered=0, p50_ms=None, p99_ms=None, max_ms=None)
    ms = np.array(latencies_s) * 1e3
    return Percentiles(
        answered=len(latencies_s),
        p50_ms=finite(float(np.percentile(ms, 50))),
        p99_ms=finite(float(np.percentile(ms, 99))),
        max_ms=finite(float(ms.max())),
    )


class Over(msgspec.Struct, kw_only=True):
    """From one replica's histogram: observations over `over_s`, and the smallest bucket bound holding them all."""

    over_s: float
    count: int
    longest_within_s: float | None
    """None when the longest is past the last finite bucket (the text's ``+Inf``) or nothing was read yet."""


def over(got: tuple[int, str] | None, over_s: float) -> Over | None:
    """`pulsescale.bench.watch._over`'s (count, bound) as an `Over`; None when the histogram is not exported."""
    if got is None:
        return None
    count, bound = got
    within = float(bound.removesuffix(" s")) if bound.endswith(" s") else None  # "+Inf", "none read": None
    return Over(over_s=over_s, count=count, longest_within_s=finite(within))


class OwnDecisionTime(msgspec.Struct, kw_only=True):
    """The live autoscalers' own ``pulsescale_decision_seconds`` since their start: decisions counted, and how many
    took at most each bound (cumulative)."""

    decisions: int
    within_2_ms: int
    within_5_ms: int
    within_10_ms: int
    within_20_ms: int
    within_50_ms: int


class OwnershipCheck(msgspec.Struct, kw_only=True):
    """One named check (``before the pulses``, ``mid-pulses``, ``after the pulses``, ``after the takeover``)."""

    when: str
    leases: str
    """``shard`` (the shard leases) or ``leader`` (the one leader lease, while no shard lease exists)."""
    models_per_replica: dict[str, int]
    """Every replica not killed, with the models it owns (0 included)."""
    models_without_live_owner: int
    passed: bool


class Ownership(msgspec.Struct, kw_only=True):
    checks: list[OwnershipCheck] = msgspec.field(default_factory=list)
    named_checks_passed: int = 0
    sampled_every_ms: float = 0.0
    samples: int = 0
    """Samples taken between the named checks, outside the takeover."""
    samples_with_orphans: int = 0
    """Samples that found a model without a live owner."""
    most_orphans: int = 0
    """The most models without a live owner in one sample."""
    samples_with_orphans_by_phase: dict[str, int] = msgspec.field(default_factory=dict)
    samples_with_orphans_after_settled: int = 0
    """samples_with_orphans less the warm-up's (replicas joining, shards handed over): the bar counts these."""
    one_owner_per_model: bool = False
    """Every named check passed and no sample after the shards settled found a model without a live owner."""


class Takeover(msgspec.Struct, kw_only=True):
    """The replica owning the most models SIGKILLed; up to 100 of its models pulsed until claimed again."""

    killed: str
    killed_owned_models: int
    models_pulsed: int
    models_claimed_again: int
    lease_s: float
    """The longest lease_s read from the leases (2.0 when none was read)."""
    bar_ms: float
    """(lease_s + 1 s) in ms."""
    p50_ms: float | None
    """SIGKILL -> first claim of each model claimed again, as this process saw the claims; None when none was."""
    max_ms: float | None
    met: bool
    """Every pulsed model claimed again, the slowest within the bar."""
    stamped: int
    """Claims with their claimer's own stamp (updated_at), the figures below."""
    stamped_p50_ms: float | None
    stamped_max_ms: float | None


class IngestThroughNats(msgspec.Struct, kw_only=True):
    published: int
    publish_s: float
    """From the first publish until every sample was counted (the same as busiest_s)."""
    counted: dict[str, int | None]
    """Per live replica, samples its ``pulsescale_samples_total`` counted; None when it was not scraped before."""
    busiest: int
    """The most samples one replica counted."""
    busiest_s: float
    """From the first publish until the replicas had counted every sample (or their counts stopped moving)."""
    samples_per_s: float | None
    """Samples counted by all the replicas together, per second of busiest_s."""
    cpu_us_per_sample: float | None = None
    """The replicas' CPU (/proc) over the same time, per sample counted."""
    floor_samples_per_s: float | None = None
    """The same samples to a bare nats-py subscriber (decode, count) in a process of its own, right after."""
    floor_cpu_us_per_sample: float | None = None
    ratio_to_floor: float | None = None
    """samples_per_s / floor_samples_per_s (wall time: the publisher bounds both)."""
    ratio_to_floor_per_cpu_s: float | None = None
    """floor_cpu_us_per_sample / cpu_us_per_sample: samples per CPU second, ours over the floor's."""


class Pulse(msgspec.Struct, kw_only=True):
    """One timed pulse and the floor's pulse after it."""

    model: str
    at_s: float | None
    """When it was published, from every model's first live owner."""
    ms: float | None
    """Sample published -> first claim written; None: no claim within the pulse timeout."""
    floor_ms: float | None


class Window(msgspec.Struct, kw_only=True):
    """When the timed pulses ran, in seconds after every model first had a live owner (None: never seen)."""

    began_s: float | None
    ended_s: float | None


class Slack(msgspec.Struct, kw_only=True):
    """From one replica's slack histogram: renewals heard, how many with less than `under_s` of their term left,
    and the lowest bucket bound holding any (the least slack seen is at most this)."""

    renewals: int
    under_s: float
    under: int
    least_within_s: float | None
    """None when no renewal was heard, or the least is past the last finite bucket."""


class ReplicaFigures(msgspec.Struct, kw_only=True):
    identity: str
    killed: bool
    cpu_s: float
    """utime + stime from /proc/<pid>/stat, the last read (before the kill for the killed one)."""
    leases_lost: int
    leases_lost_from: str
    """``pulsescale_lease_lost_total`` where exported, else ``stderr`` (its "no longer the leader" lines)."""
    loop_stalls: Over | None
    """pulsescale_event_loop_lag_seconds over 0.5 s; None when not exported."""
    slow_lease_renewals: Over | None
    """pulsescale_lease_renewal_seconds over 1 s; None when not exported."""
    slack: Slack | None = None
    """pulsescale_lease_renewal_slack_seconds: how close the renewals ran to losing a lease; None when not
    exported (older replicas)."""
    warnings: int
    """stderr lines at WARNING or worse."""
    relists: int = 0
    """Watches of its KV buckets made anew: ``pulsescale_watch_relists_total`` where exported, else its stderr's
    re-listing warnings."""
    relists_from: str = "stderr"
    probes_spared: int | None = None
    """``pulsescale_watch_probes_spared_total``: consumer probes a busy loop once took for a lost consumer, and no
    longer re-list; None when not exported."""


class Bounds(msgspec.Struct, kw_only=True):
    """What bounds each phase, and so the run's length."""

    ingest_in_process_max_s: float
    ready_timeout_s: float
    pulse_budget_s: float
    pulse_timeout_s: float
    takeover_grace_s: float
    """The takeover phase lasts at most lease_s + this."""
    ingest_settle_max_s: float
    """The ingest's counts are read at most this long after publishing."""


class DecideReport(msgspec.Struct, kw_only=True):
    """`bench decide --json`: the run's parameters, then each phase's figures in the order the text prints them."""

    bench: str = "decide"
    models: int
    replicas: int
    pulses: int
    """--pulses as asked; `pulses_timed` is what the run could time (at most one per model)."""
    samples: int
    kill: bool
    """SIGKILL a replica mid-run (--kill; on with --replicas >= 2). With one replica no takeover is timed."""
    gateways_in_step: bool
    gateway_phases: int
    """Phases of each 100 ms the background gateways speak at (1 with --gateways-in-step)."""
    pulse_budget_s: float
    log_level: str
    logs: str | None
    slots_per_model: int = 4
    setup_s: float | None = None
    """Start -> every model's slots and ScaledObject seeded."""
    ingest_in_process_samples_per_s: float | None = None
    """decode + fold + debounced decide in this process, one core."""
    replicas_ready_s: float | None = None
    replicas_settled: bool = False
    """Every model owned and the spread steady within `bounds.ready_timeout_s` of the start."""
    ownership_settled_s: float | None = None
    """After the pulses' warm-up, until every model has a live owner and every replica a share."""
    pulses_timed: int = 0
    """Models pulsed: min(pulses, models), spread over all of them."""
    pulses_sent: int = 0
    """Pulses sent before `pulse_budget_s` ran out (pulses_timed unless `pulse_budget_spent`)."""
    pulse_budget_spent: bool = False
    decision: Percentiles = msgspec.field(default_factory=lambda: percentiles([]))
    """Sample published -> first claim written; `answered` of `pulses_timed`."""
    floor: Percentiles = msgspec.field(default_factory=lambda: percentiles([]))
    """Bare nats-py in the same run: sample published -> one kv.update -> a KV watcher sees it."""
    floor_path: str = "sample published -> a subscriber on its own connection does one kv.update -> watcher sees it"
    ratio_to_floor_p50: float | None = None
    """decision.p50_ms / floor.p50_ms; None when either side answered nothing."""
    ratio_to_floor_p99: float | None = None
    pulses_after_s: float | None = None
    """--pulses-after: the pulses began this long after every model first had a live owner; None: after the
    windows' settling (~10 s of steady traffic), the default."""
    pulses_window_s: Window | None = None
    """When the pulses (ours and the floor's, interleaved) ran, counted from every model's first live owner."""
    replicas_from: str | None = None
    """--replicas-from: the checkout the replicas ran from (None: this one)."""
    cpu_hog: bool = False
    """--cpu-hog: a busy loop on one core for the whole run (`pulsescale.bench.hog`)."""
    each_pulse: list[Pulse] = msgspec.field(default_factory=list)
    """Every timed pulse in order, with the floor's beside it: when in the run the slow ones were."""
    own_decision_time: OwnDecisionTime | None = None
    ownership: Ownership = msgspec.field(default_factory=Ownership)
    takeover: Takeover | None = None
    """None without a kill: one replica, --no-kill, or no replica owned a model to kill."""
    ingest_through_nats: IngestThroughNats | None = None
    leases_lost: int = 0
    """Summed over the replicas."""
    per_replica: list[ReplicaFigures] = msgspec.field(default_factory=list)
    slot_writes: int = 0
    bench_relists: int = 0
    """Re-lists of the bench's own slot watch, which times the claims (a claim first seen in a re-listing is timed
    when the listing came)."""
    double_claims: int = 0
    """Slots claimed twice without a release between (a held record's claim_id replaced while it was held)."""
    run_s: float | None = None
    bounds: Bounds | None = None
