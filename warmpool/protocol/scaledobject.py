"""The ScaledObject on the wire: `ScaledObjectSpec` and its parts, as stored in `pulse_scalers`.

Field names mirror KEDA's where they mean the same (camelCase on the wire, snake_case in Python); the record that
carries a spec is `warmpool.protocol.records.ScalerRecord`. Also the schedule checks (`zone`, `schedule_conflict`,
`check_schedules`) shared with the on-call schedules (revision 8), and the rules of a trigger's demand source
(revision 14: `SOURCES`, `TriggerMetadata.source_problem`, `http_url_problem`), shared by the ScaledObject reader
(manifests/) and the bridge (bridge/). Pure: no I/O.
"""

from __future__ import annotations

import datetime as dt
import re
import zoneinfo
from collections.abc import Mapping, Sequence
from typing import Annotated, Final, Literal
from urllib.parse import urlsplit

import msgspec

from warmpool.protocol.base import Count, Name, Text
from warmpool.protocol.names import MAX_SCHEDULE_S, MAX_SCHEDULES

__all__ = [
    "LOCAL_TIME_PATTERN",
    "MAX_HPA_POLICIES",
    "MAX_METRICS_URLS",
    "MAX_URL_LENGTH",
    "SOURCES",
    "SOURCE_PARAMETERS",
    "ZONE_PATTERN",
    "Advanced",
    "AuthenticationRef",
    "Fallback",
    "FallbackBehavior",
    "HPABehavior",
    "HPAScalingPolicy",
    "HPAScalingRules",
    "HorizontalPodAutoscalerConfig",
    "ScaleTargetRef",
    "ScaledObjectSpec",
    "Schedule",
    "Seconds",
    "Trigger",
    "TriggerMetadata",
    "WarmPool",
    "check_schedules",
    "http_url_problem",
    "schedule_conflict",
    "zone",
]

# --- ScaledObject (KV pulse_scalers, key <namespace>.<name>) ----------------------------------------------------
# Field names mirror KEDA's where they mean the same (camelCase on the wire, snake_case in Python).


class _Spec(msgspec.Struct, kw_only=True, rename="camel", forbid_unknown_fields=False):
    pass


# Upper bounds keep the policy's arithmetic finite: a day is longer than any window anyone means.
Seconds = Annotated[float, msgspec.Meta(gt=0, le=86_400)]


class ScaleTargetRef(_Spec, kw_only=True):
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=253)]
    kind: Annotated[str, msgspec.Meta(min_length=1, max_length=63)] = "Deployment"
    api_version: Annotated[str, msgspec.Meta(min_length=1, max_length=317)] = "apps/v1"
    """A group (a DNS subdomain, 253) and a version (63)."""
    env_source_container_name: Annotated[str, msgspec.Meta(max_length=63)] | None = None
    """Revision 5: KEDA's ``envSourceContainerName``, accepted; no effect (a pushed trigger reads no environment)."""


# --- revision 14: where a trigger's demand comes from -----------------------------------------------------------

SOURCES: Final = ("gateway", "vllm-metrics", "prometheus")
"""Revision 14: the values of `TriggerMetadata.source` (unset: ``gateway``). ``gateway``: the gateways push the
model's samples. ``vllm-metrics`` and ``prometheus``: ``pulsescale bridge --scaledobjects`` reads them and publishes
the samples (the engines' vLLM pages; a PromQL query). Whoever publishes, the autoscaler reads the same samples."""
SOURCE_PARAMETERS: Final[Mapping[str, tuple[str, ...]]] = {
    "gateway": (),
    "vllm-metrics": ("metricsURL",),
    "prometheus": ("serverAddress", "query"),
}
"""The metadata keys (wire names) each source reads; a key of another source is refused, naming it."""
MAX_URL_LENGTH: Final = 2048
"""Longest `serverAddress` and metricsURL entry: what browsers and proxies take; a URL is rarely over 100."""
MAX_METRICS_URLS: Final = 64
"""Most pages one `metricsURL` lists: an engine per page, and a model is rarely served by more (past that, leave
`metricsURL` out: the bridge then reads the model's ready slots, however many)."""
_PROMETHEUS_NEEDS: Final = (
    ("serverAddress", "the Prometheus server the bridge asks (http://prometheus.monitoring:9090)"),
    ("query", "the PromQL query whose one value is the model's demand (queued + in flight)"),
)


def http_url_problem(url: str) -> str | None:
    """Why `url` is not ``http(s)://HOST[:PORT][/PATH]`` without credentials or a ``#fragment``; None when it is.

    The one rule of the URLs the bridge reads: its flags (`bridge.settings.http_url`) and a trigger's
    `serverAddress` and `metricsURL` (`TriggerMetadata.source_problem`)."""
    if any(c.isspace() or not c.isprintable() for c in url):
        return "no spaces or control characters in the URL"
    try:
        parts = urlsplit(url)
        _ = parts.port  # raises on a bad port
    except ValueError as err:
        return str(err)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "give an http(s)://HOST[:PORT][/PATH] URL"
    if parts.username is not None or parts.password is not None or parts.fragment:
        return "no credentials or #fragment in the URL"
    return None


class TriggerMetadata(_Spec, kw_only=True):
    model: Name
    target_queue_depth: Annotated[float, msgspec.Meta(ge=0.001, le=1e9)] = 4.0
    """Queue + in-flight requests one replica should carry; desired = demand / this."""
    activation_queue_depth: Annotated[float, msgspec.Meta(ge=0, le=1e9)] = 0.0
    """From zero replicas, scale up only when demand exceeds this (KEDA's activation threshold)."""
    source: Annotated[str, msgspec.Meta(max_length=63)] | msgspec.UnsetType = msgspec.UNSET
    """Revision 14: where the model's demand comes from. ``gateway`` (unset: the same): the gateways push it.
    ``vllm-metrics``: ``pulsescale bridge --scaledobjects`` reads the engines' vLLM ``/metrics`` pages (`metricsURL`;
    without it, each ready slot of the model). ``prometheus``: the bridge asks `query` of `serverAddress`, as KEDA's
    prometheus scaler does. The bridge publishes what it reads as the gateways would."""
    metrics_url: Annotated[str, msgspec.Meta(max_length=8192)] | msgspec.UnsetType = msgspec.field(
        default=msgspec.UNSET, name="metricsURL"
    )
    """Revision 14: with source ``vllm-metrics`` only, the engines' pages, comma-separated
    (``http://10.0.0.5:8000,http://10.0.0.6:8000/metrics``; no path: ``/metrics``), every series on them counted
    for `model`. Unset: the model's ready slots, found in ``pulse_slots``."""
    server_address: Annotated[str, msgspec.Meta(max_length=MAX_URL_LENGTH)] | msgspec.UnsetType = msgspec.UNSET
    """Revision 14, as KEDA's prometheus scaler: the Prometheus server (``http://prometheus.monitoring:9090``) whose
    ``/api/v1/query`` the bridge asks. With source ``prometheus`` only, and required there."""
    query: Annotated[str, msgspec.Meta(max_length=4096)] | msgspec.UnsetType = msgspec.UNSET
    """Revision 14, as KEDA's prometheus scaler: an instant PromQL query with one series or a scalar, whose value is
    the model's demand (queued + in flight). With source ``prometheus`` only, and required there."""

    @property
    def source_kind(self) -> str:
        """`source`, ``gateway`` where it is unset."""
        return "gateway" if isinstance(self.source, msgspec.UnsetType) else self.source

    def parameters(self) -> dict[str, str]:
        """The source parameters that are set, by wire name."""
        given = {"metricsURL": self.metrics_url, "serverAddress": self.server_address, "query": self.query}
        return {key: value for key, value in given.items() if isinstance(value, str)}

    def metrics_urls(self) -> tuple[str, ...]:
        """`metricsURL`'s entries, each stripped; () when it is unset."""
        if isinstance(self.metrics_url, msgspec.UnsetType):
            return ()
        return tuple(u.strip() for u in self.metrics_url.split(","))

    def source_block(self) -> tuple[str, tuple[tuple[str, str], ...]]:
        """The source and its parameters, comparable (an unset source and ``gateway`` are the same)."""
        return self.source_kind, tuple(sorted(self.parameters().items()))

    def source_problem(self) -> tuple[str, str] | None:
        """(metadata key, why) of the first rule of revision 14 that the source block breaks; None when it keeps them:
        a `source` of `SOURCES`; only that source's parameters (`SOURCE_PARAMETERS`); ``prometheus`` with both of its
        own; URLs by `http_url_problem` (`serverAddress` without a ``?query``: the bridge adds its own); a `metricsURL`
        of 1 to `MAX_METRICS_URLS` distinct entries; a `query` that is not blank.

        Not checked by `decode` (a record that breaks them is read, its other fields in force): the autoscaler acts
        on nothing of the block, and a later revision may add a source. The ScaledObject reader refuses such a
        manifest, and the bridge refuses such a record's block (``bad_source``)."""
        kind = self.source_kind
        if kind not in SOURCES:
            return "source", f"{kind!r} is not a source: one of {', '.join(SOURCES)}"
        given = self.parameters()
        for key in given:
            if key not in SOURCE_PARAMETERS[kind]:
                [owner] = [s for s, keys in SOURCE_PARAMETERS.items() if key in keys]
                reads = ", ".join(SOURCE_PARAMETERS[kind]) or "no parameter"
                unset = " (source unset)" if isinstance(self.source, msgspec.UnsetType) else ""
                return key, (
                    f"belongs to source {owner}, not {kind}{unset}, which reads {reads}; remove it, or set "
                    f"source: {owner}"
                )
        if kind == "prometheus":
            for key, what in _PROMETHEUS_NEEDS:
                if key not in given:
                    return key, f"required with source prometheus: {what}"
            url = given["serverAddress"]
            problem = http_url_problem(url)
            if problem is None and urlsplit(url).query:
                problem = "no ?query in it: the bridge asks <serverAddress>/api/v1/query?query=<query>"
            if problem is not None:
                return "serverAddress", f"{url!r}: {problem}"
            if not given["query"].strip():
                return "query", "is blank: give the PromQL query whose one value is the model's demand"
        if "metricsURL" in given:
            urls = self.metrics_urls()
            if "" in urls:
                return "metricsURL", (
                    f"{given['metricsURL']!r} has an empty entry: give URLs separated by commas "
                    "(http://10.0.0.5:8000,http://10.0.0.6:8000)"
                )
            if len(urls) > MAX_METRICS_URLS:
                return "metricsURL", (
                    f"{len(urls)} URLs, at most {MAX_METRICS_URLS}: leave metricsURL out to read the model's ready "
                    "slots"
                )
            seen: set[str] = set()
            for url in urls:
                problem = http_url_problem(url)
                if problem is None and len(url) > MAX_URL_LENGTH:
                    problem = f"longer than {MAX_URL_LENGTH} characters"
                if problem is not None:
                    return "metricsURL", f"{url!r}: {problem}"
                if url in seen:
                    return "metricsURL", f"{url!r} is listed twice"
                seen.add(url)
        return None


class AuthenticationRef(_Spec, kw_only=True):
    """KEDA's ``authenticationRef`` (revision 5): accepted so a KEDA manifest applies; a pushed trigger needs no
    credentials to read a metric, so it has no effect (the ScalerRecord's `notes` say so)."""

    name: Annotated[str, msgspec.Meta(min_length=1, max_length=253)]
    kind: Literal["TriggerAuthentication", "ClusterTriggerAuthentication"] = "TriggerAuthentication"


class Trigger(_Spec, kw_only=True):
    type: Literal["gateway-queue"]
    metadata: TriggerMetadata
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=63)] | None = None
    """Revision 5, as KEDA: names a trigger (unique within the ScaledObject)."""
    metric_type: Literal["AverageValue"] = "AverageValue"
    """Revision 5: KEDA's ``metricType``. Only ``AverageValue`` (demand / target per replica) is our rule."""
    use_cached_metrics: bool = False
    """Revision 5: accepted, no effect: a pushed trigger is never polled, every sample is used as it arrives."""
    authentication_ref: AuthenticationRef | None = None
    """Revision 5: accepted, no effect (see `AuthenticationRef`)."""


FallbackBehavior = Literal["static", "currentReplicas", "currentReplicasIfHigher", "currentReplicasIfLower"]


class Fallback(_Spec, kw_only=True):
    failure_threshold: Annotated[int, msgspec.Meta(ge=0)]
    """Missed intervals (of `advanced.staleAfterSeconds`) tolerated; the fallback applies at the next, as KEDA's
    failures > failureThreshold (revision 5: 0 admitted, falling back at the first missed interval)."""
    replicas: Count
    behavior: FallbackBehavior = "static"
    """Revision 5, as KEDA: ``static`` uses `replicas`; ``currentReplicas`` keeps the current count;
    ``currentReplicasIfHigher``/``IfLower`` use the current count when it is higher/lower than `replicas`."""


MAX_HPA_POLICIES: Final = 10
"""Most policies in one HPA ``behavior`` rule: the pulsescale mapping uses one Percent and one Pods policy, and the
CRD needs a bound on every list (the API server's cost estimator)."""


class HPAScalingPolicy(_Spec, kw_only=True):
    """One policy of an HPA ``behavior`` rule (autoscaling/v2 ``HPAScalingPolicy``)."""

    type: Literal["Pods", "Percent"]
    value: Annotated[int, msgspec.Meta(ge=1)]
    period_seconds: Annotated[int, msgspec.Meta(ge=1, le=1800)]


class HPAScalingRules(_Spec, kw_only=True):
    """autoscaling/v2 ``HPAScalingRules``."""

    stabilization_window_seconds: Annotated[int, msgspec.Meta(ge=0, le=3600)] | None = None
    select_policy: Literal["Max", "Min", "Disabled"] | None = None
    policies: Annotated[list[HPAScalingPolicy], msgspec.Meta(max_length=MAX_HPA_POLICIES)] | None = None
    tolerance: str | float | None = None


class HPABehavior(_Spec, kw_only=True):
    scale_up: HPAScalingRules | None = None
    scale_down: HPAScalingRules | None = None


class HorizontalPodAutoscalerConfig(_Spec, kw_only=True):
    """KEDA's ``advanced.horizontalPodAutoscalerConfig`` (revision 5): `behavior` is mapped onto this policy's
    scale-down fields by the ScaledObject reader; what cannot map is refused there with the reason."""

    name: Annotated[str, msgspec.Meta(max_length=253)] | None = None
    behavior: HPABehavior | None = None


class Advanced(_Spec, kw_only=True):
    stable_window_seconds: Seconds = 60.0
    panic_window_seconds: Seconds = 6.0
    panic_threshold: Annotated[float, msgspec.Meta(ge=1, le=1000)] = 2.0
    """Panic when panic-window demand >= this x ready capacity (Knative's default 200 %)."""
    scale_down_stabilization_seconds: Annotated[float, msgspec.Meta(ge=0, le=86_400)] | msgspec.UnsetType = (
        msgspec.UNSET
    )
    """Scale down to the highest recommendation of this window. Unset (revision 9): the scale-in hold, one
    measured lead time (claim -> ready p90) kept between `panicWindowSeconds` and 60 s, and panic is then left that
    long after its condition: bringing a released replica back costs one lead time from the warm pool, so an idle
    one is not held longer than the warm path makes worth it."""
    scale_down_percent: Annotated[float, msgspec.Meta(gt=0, le=100)] | msgspec.UnsetType = msgspec.UNSET
    """At most this share of the replicas (and at least one) is removed per `scaleDownPeriodSeconds`. Unset
    (revision 9): 100 while the stabilisation window is unset too (the hold paces scale-in: one step per hold), else
    50 (revision 8's default)."""
    scale_down_period_seconds: Seconds | msgspec.UnsetType = msgspec.UNSET
    """The period of the scale-down rate. Unset (revision 9): the scale-in hold while the stabilisation window is
    unset too, else 60 s."""
    stale_after_seconds: Seconds = 1.0
    """A gateway silent this long leaves the demand sum (ten of the gateways' 100 ms sample intervals)."""
    lead_time_seconds: Seconds = 2.5
    """Forecast horizon until measured claim -> ready times exist (DESIGN: p90, default 2.5 s)."""
    scale_down_pods: Count | None = None
    """Revision 5: at most this many replicas removed per `scaleDownPeriodSeconds` (HPA's ``Pods`` policy); with
    `scaleDownPercent` both apply as `scaleDownSelectPolicy` says."""
    scale_down_select_policy: Literal["Max", "Min", "Disabled"] = "Max"
    """Revision 5, as HPA's ``selectPolicy``: ``Max`` allows the larger of the two removals, ``Min`` the smaller,
    ``Disabled`` never scales down."""
    restore_to_original_replica_count: bool = False
    """Revision 5, as KEDA: on delete, the operator puts the target back to the replica count it had before."""
    horizontal_pod_autoscaler_config: HorizontalPodAutoscalerConfig | None = None


class WarmPool(_Spec, kw_only=True):
    size: Count = 0
    image: Text | None = None
    weights: Text | None = None
    engine: Literal["local", "command", "vllm"] = "local"
    loader: Literal["auto", "host", "cuda-pinned", "kvikio"] = "auto"


LOCAL_TIME_PATTERN: Final = r"^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}(:[0-9]{2})?$"
"""`Schedule.start`: an ISO-8601 local date-time without an offset (``2026-12-24T18:00``); the zone is `timezone`."""
_LOCAL_TIME_RE: Final = re.compile(LOCAL_TIME_PATTERN)
ZONE_PATTERN: Final = r"^[A-Za-z0-9_+-]+(/[A-Za-z0-9_+-]+)*$"
"""An IANA zone name (``Europe/Berlin``, ``UTC``): path segments only, so the name never reaches outside the zone
database (``..`` or an absolute path)."""
_ZONE_RE: Final = re.compile(ZONE_PATTERN)


def zone(name: str) -> zoneinfo.ZoneInfo:
    """The IANA zone `name`, or ValueError ``[bad_value]`` naming it."""
    if not _ZONE_RE.fullmatch(name):
        raise ValueError(f"[bad_value] `timezone` {name!r} is not an IANA zone name (Europe/Berlin, UTC, ...)")
    try:
        return zoneinfo.ZoneInfo(name)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError, OSError):
        raise ValueError(
            f"[bad_value] `timezone` {name!r} is not a zone this machine's zone database knows (an IANA name such "
            "as Europe/Berlin, America/New_York or UTC)"
        ) from None


class Schedule(_Spec, kw_only=True):
    """A scheduled warm-up before a known event (KEDA's cron scaler): from `start` (local time in `timezone`) for
    `durationSeconds`, the model's count is at least `replicas`, and the warm pool is asked
    for that many slots ahead of it. A local time that does not exist (skipped by a DST change) is read with the
    offset before the change (02:30 on a spring-forward night starts at 03:30); one that exists twice (fall-back)
    is the first. The duration is elapsed time, whatever the clocks do meanwhile."""

    name: Name
    """Names the schedule: unique among the ScaledObject's (and among a model's on-call schedules)."""
    start: Annotated[str, msgspec.Meta(max_length=32, extra_json_schema={"pattern": LOCAL_TIME_PATTERN})]
    """When the floor starts: an ISO-8601 local date-time without offset, ``2026-12-24T18:00`` or
    ``2026-12-24T18:00:00``, in `timezone`."""
    duration_seconds: Annotated[float, msgspec.Meta(gt=0, le=MAX_SCHEDULE_S)]
    """How long the floor holds from `start`, in seconds (at most a week)."""
    replicas: Count
    """The floor: at least this many replicas while the schedule is in force (at most `maxReplicaCount`)."""
    timezone: Annotated[str, msgspec.Meta(min_length=1, max_length=64)] = "UTC"
    """IANA zone `start` is read in (``Europe/Berlin``); default UTC."""

    def __post_init__(self) -> None:
        if not _LOCAL_TIME_RE.fullmatch(self.start):
            raise ValueError(
                f"[bad_value] `start` {self.start!r} is not a local date-time YYYY-MM-DDTHH:MM[:SS] (no offset: the "
                "zone is `timezone`)"
            )
        try:
            dt.datetime.fromisoformat(self.start)
        except ValueError as err:
            raise ValueError(f"[bad_value] `start` {self.start!r} is not a date-time: {err}") from None
        zone(self.timezone)

    def window(self) -> tuple[float, float]:
        """(start, end) in Unix seconds: the floor holds for start <= now < end."""
        local = dt.datetime.fromisoformat(self.start).replace(tzinfo=zone(self.timezone))
        begin = local.timestamp()
        return begin, begin + self.duration_seconds


def schedule_conflict(schedules: Sequence[Schedule], *, max_replicas: int | None = None) -> str | None:
    """What is wrong with a set of schedules together, or None: more than `MAX_SCHEDULES`, a name twice, a floor
    over `max_replicas`, or two windows that overlap with different floors ("overlaps badly": which floor holds
    would depend on the order they were written; identical floors may overlap, e.g. to extend one)."""
    if len(schedules) > MAX_SCHEDULES:
        return f"{len(schedules)} schedules; at most {MAX_SCHEDULES} are kept per model"
    names: set[str] = set()
    for s in schedules:
        if s.name in names:
            return f"two schedules are named {s.name!r}; names must be unique"
        names.add(s.name)
        if max_replicas is not None and s.replicas > max_replicas:
            return (
                f"schedule {s.name!r} raises the floor to {s.replicas} replicas, over `maxReplicaCount` {max_replicas}"
            )
    windows = [(s, *s.window()) for s in schedules]
    for i, (a, a0, a1) in enumerate(windows):
        for b, b0, b1 in windows[i + 1 :]:
            if a0 < b1 and b0 < a1 and a.replicas != b.replicas:
                return (
                    f"schedules {a.name!r} ({a.replicas} replicas) and {b.name!r} ({b.replicas} replicas) overlap with "
                    "different floors; make them not overlap, or give them the same replicas"
                )
    return None


def check_schedules(schedules: Sequence[Schedule], *, max_replicas: int | None = None) -> None:
    """`schedule_conflict` as a ValueError ``[bad_value]`` (what the decoders turn into a rejection reason)."""
    problem = schedule_conflict(schedules, max_replicas=max_replicas)
    if problem is not None:
        raise ValueError(f"[bad_value] {problem}")


class ScaledObjectSpec(_Spec, kw_only=True):
    scale_target_ref: ScaleTargetRef
    triggers: Annotated[list[Trigger], msgspec.Meta(min_length=1)]
    min_replica_count: Count = 0
    max_replica_count: Annotated[int, msgspec.Meta(ge=1, le=100_000)] = 100
    idle_replica_count: Count | None = None
    cooldown_period: Annotated[float, msgspec.Meta(ge=0, le=86_400 * 7)] = 300.0
    """Seconds without demand before dropping to `idleReplicaCount` (or `minReplicaCount`), as KEDA."""
    fallback: Fallback | None = None
    advanced: Advanced = msgspec.field(default_factory=Advanced)
    warm_pool: WarmPool = msgspec.field(default_factory=WarmPool)
    polling_interval: Annotated[int, msgspec.Meta(ge=1, le=86_400)] | None = None
    """Revision 5: KEDA's ``pollingInterval``, accepted; a pushed trigger is read as samples arrive, not polled."""
    initial_cooldown_period: Annotated[float, msgspec.Meta(ge=0, le=86_400 * 7)] = 0.0
    """Revision 5, as KEDA: seconds after the ScaledObject is created before it may scale down to
    `idleReplicaCount`/zero."""
    schedules: Annotated[list[Schedule], msgspec.Meta(max_length=MAX_SCHEDULES)] = []
    """Revision 8: scheduled warm-ups (KEDA's cron scaler): each raises the floor to its `replicas` from its
    `start` for its `durationSeconds`. Windows that overlap must have the same `replicas`."""

    def __post_init__(self) -> None:
        if self.min_replica_count > self.max_replica_count:
            raise ValueError("[bad_value] `minReplicaCount` must be <= `maxReplicaCount`")
        if self.idle_replica_count is not None and self.idle_replica_count >= self.min_replica_count > 0:
            raise ValueError("[bad_value] `idleReplicaCount` must be < `minReplicaCount` (as in KEDA)")
        if len({t.metadata.model for t in self.triggers}) != 1:
            raise ValueError("[bad_value] all triggers of one ScaledObject must name the same model")
        if self.schedules:
            check_schedules(self.schedules, max_replicas=self.max_replica_count)

    @property
    def model(self) -> str:
        return self.triggers[0].metadata.model

    def source_problem(self) -> tuple[str, str] | None:
        """(path under ``spec``, why) of the first trigger whose source block breaks revision 14's rules
        (`TriggerMetadata.source_problem`), or of one that reads another source than the first trigger: all of
        them feed one model's demand, and two sources of it would add up. None: the triggers keep the rules."""
        first = self.triggers[0].metadata.source_block()
        for i, trigger in enumerate(self.triggers):
            problem = trigger.metadata.source_problem()
            if problem is not None:
                return f"triggers[{i}].metadata.{problem[0]}", problem[1]
            if trigger.metadata.source_block() != first:
                return f"triggers[{i}].metadata.source", (
                    "reads another source than triggers[0]: every trigger of a ScaledObject feeds one model's "
                    "demand, and two sources of it would add up; give them all the same source and parameters"
                )
        return None
