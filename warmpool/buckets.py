"""The registry's buckets: made, opened and kept in line (`ensure_buckets`), and how many replicas they get.

Only the autoscaler creates and hardens them (DESIGN.md, "Trust boundaries"); every role opens them here, and
waits here for a JetStream that does not answer yet (a cluster deployed together with us). `warmpool.registry`
re-exports what its callers use.

`follow_bucket` is for a reader of a bucket that may not exist yet and may not be readable at all (the gateway's
`pulse_scalers` and `pulse_assignments`): it asks again while the bucket is absent or does not answer, reporting
each, and follows the bucket once it opens.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Literal, TypeVar

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, StorageType, StreamConfig
from nats.js.kv import KeyValue

from warmpool import protocol
from warmpool.bucketview import BucketView, ViewEvent
from warmpool.errors import NatsUnavailable, PulsescaleError
from warmpool.rejects import Rejections

__all__ = [
    "list_keys",
    "ALL_BUCKETS",
    "CLUSTER_KV_REPLICAS",
    "JETSTREAM_WAIT_S",
    "KV_REPLICAS_ENV",
    "MAX_KV_REPLICAS",
    "PLACEMENT_SETTLE_S",
    "UNREADABLE_MAX_WAIT_S",
    "BucketSettings",
    "OpenState",
    "KvReplicasError",
    "ensure_buckets",
    "follow_bucket",
    "follow_view",
    "parse_replicas",
    "replicas_for",
]

log = logging.getLogger("pulsescale.registry")  # the registry's logger: operators filter on it


KV_REPLICAS_ENV = "PULSESCALE_KV_REPLICAS"
MAX_KV_REPLICAS = 5
"""JetStream's own limit on a stream's replicas."""
CLUSTER_KV_REPLICAS = 3
"""Replicas on a cluster when nobody says: a quorum of 2 survives one server's loss; more buys little and
slows every compare-and-set (each waits for a quorum)."""


class KvReplicasError(PulsescaleError):
    """A replica count for the buckets that cannot be used (not a number, out of 1..5)."""

    code = "bad_kv_replicas"


@dataclass(frozen=True)
class BucketSettings:
    replicas: int | None = None
    """JetStream replicas per bucket; None: ``$PULSESCALE_KV_REPLICAS``, else what the server supports
    (`replicas_for`: 1 on a single server, 3 on a cluster)."""
    slot_history: int = 5
    """Revisions kept per slot key: enough to read back how a slot got where it is, small enough to not matter."""
    storage: StorageType = StorageType.FILE
    """File storage, so a broker restart keeps every claim."""


_HISTORY = {
    protocol.SLOTS_BUCKET: None,  # BucketSettings.slot_history
    protocol.AGENTS_BUCKET: 1,
    protocol.SCALERS_BUCKET: 5,
    protocol.LEASES_BUCKET: 1,
    protocol.ASSIGNMENTS_BUCKET: 5,  # as pulse_scalers: who assigned what before, for the record
    protocol.OBJECTS_BUCKET: 1,  # revision 13: a copy of the CRs' status; its history is the CR's Events
}
ALL_BUCKETS = protocol.BUCKETS


def parse_replicas(text: str, *, source: str | None = None) -> int:
    """A replica count from a flag or the environment, or `KvReplicasError` naming `source` (by default the
    environment variable)."""
    source = source or KV_REPLICAS_ENV
    try:
        n = int(text)
    except ValueError:
        n = 0
    if not 1 <= n <= MAX_KV_REPLICAS:
        raise KvReplicasError(
            f"{source}={text!r}: the KV buckets' replicas must be a whole number from 1 to {MAX_KV_REPLICAS} "
            f"(1 on a single nats-server, 3 on a cluster of 3 or more); unset it to detect"
        )
    return n


def replicas_for(nc: Client, settings: BucketSettings = BucketSettings(), env: Mapping[str, str] | None = None) -> int:
    """The replica count buckets are made with: `settings.replicas`, else ``$PULSESCALE_KV_REPLICAS``, else what
    the server we are connected to says of itself (its INFO): no cluster, 1; a cluster, `CLUSTER_KV_REPLICAS`.
    Not the servers it advertises (``connect_urls``): that list fills in as the routes come up, and a bucket made
    from a short one would stay under-replicated. A smaller cluster is met by `ensure_buckets`."""
    if settings.replicas is not None:
        return settings.replicas
    env = os.environ if env is None else env
    if env.get(KV_REPLICAS_ENV):
        return parse_replicas(env[KV_REPLICAS_ENV])
    info = nc._server_info  # nats-py keeps the server's INFO only here; we read it, never write
    return CLUSTER_KV_REPLICAS if info.get("cluster") else 1


async def ensure_buckets(
    js: JetStreamContext,
    settings: BucketSettings = BucketSettings(),
    names: Iterable[str] = ALL_BUCKETS,
    *,
    harden: bool = False,
) -> dict[str, KeyValue]:
    """Open the registry's buckets `names` (all by default), creating those that do not exist yet with
    `replicas_for` replicas.

    Each is looked up first, so a role that may read a bucket but not create it (DESIGN.md, "Trust boundaries";
    only the autoscaler creates) opens an existing one; ask only for the buckets the role reads, since looking up
    another is refused too.

    Buckets are created refusing rollup headers: a writer confined to its own keys could otherwise publish
    ``Nats-Rollup: all`` on one of them and purge every other key of the bucket (watches do not see it). With
    `harden` (the autoscaler, which may update the streams) a bucket that an older version created with rollups
    allowed is updated to refuse them, and one with fewer replicas than `replicas_for` is raised to that count
    (JetStream moves the data to the new peers itself); without `harden`, such a bucket is only reported."""
    replicas = replicas_for(js._nc, settings)  # the context's connection; nats-py offers no public getter
    detected = settings.replicas is None and not os.environ.get(KV_REPLICAS_ENV)
    out: dict[str, KeyValue] = {}
    for bucket in names:
        deadline: float | None = None  # from the first failure of this bucket: a slow but working create is fine
        while True:
            try:
                out[bucket], replicas = await _open(js, bucket, settings, replicas, detected=detected, harden=harden)
                break
            except _NOT_ANSWERING as err:
                _not_answering(js, bucket, err)  # raises what will not clear by waiting
                deadline = deadline or time.monotonic() + JETSTREAM_WAIT_S
                if time.monotonic() >= deadline:
                    raise NatsUnavailable(
                        f"JetStream did not answer for {JETSTREAM_WAIT_S:.0f} s while opening bucket {bucket}: "
                        "is the cluster up, with a JetStream meta leader (nats server report jetstream)?"
                    ) from err
                log.warning(
                    "JetStream does not answer yet (%s) opening bucket %s: a cluster still electing its meta "
                    "leader? asking again for up to %.0f s",
                    _describe(err),
                    bucket,
                    deadline - time.monotonic(),
                )
                await asyncio.sleep(_JETSTREAM_RETRY_S)
    return out


_NOT_ANSWERING = (nats.errors.TimeoutError, nats.errors.NoRespondersError, nats.js.errors.ServiceUnavailableError)

JETSTREAM_WAIT_S = 15.0
"""How long `ensure_buckets` asks again while JetStream times out, has no responder on a server that has JetStream,
or says it is temporarily unavailable (10008): a cluster deployed together with us answers nothing until its
servers have elected a meta leader (a few seconds). Past this it is a `NatsUnavailable`, before the deployed
liveness probes (first at 10 s, three failures 5 s apart) would restart the process without saying why."""

_JETSTREAM_UNAVAILABLE_FOR_NOW = 10008
"""JetStream's "JetStream system temporarily unavailable"; its other 503s (not enabled for the account, 10039; not
enabled, 10076) do not clear by waiting."""


OpenState = Literal["absent", "unreadable"]
"""Why `follow_bucket` could not open its bucket: ``absent`` (it does not exist: asked again every `retry_s`),
``unreadable`` (no answer: a NATS user without KV reads of it is refused silently, or JetStream is down; asked
again with a growing pause)."""

UNREADABLE_MAX_WAIT_S = 30.0
"""The longest pause between two asks of an unreadable bucket: each ask of a refused user is a permission
violation in the server's log."""


async def follow_bucket(
    nc: Client,
    bucket: str,
    stop: asyncio.Event,
    *,
    on_state: Callable[[OpenState, str], None],
    follow: Callable[[KeyValue], Awaitable[None]],
    retry_s: float,
    open_timeout_s: float,
    max_wait_s: float = UNREADABLE_MAX_WAIT_S,
) -> None:
    """Open `bucket` (never create it) and `await follow(kv)`, then return; until it opens, `on_state(state, why)`
    after each failed ask (`OpenState`; `why` is "" for ``absent``, else what went wrong) and ask again after
    `retry_s` (absent) or a pause that doubles from `retry_s` up to `max_wait_s` (unreadable), or return once
    `stop` is set. Each ask waits `open_timeout_s` for JetStream."""
    wait_s = retry_s
    while not stop.is_set():
        try:
            kv = await nc.jetstream(timeout=open_timeout_s).key_value(bucket)
        except nats.js.errors.BucketNotFoundError:
            on_state("absent", "")
            wait_s = retry_s
        except (TimeoutError, nats.errors.Error, OSError) as err:
            on_state("unreadable", "no answer" if isinstance(err, TimeoutError) else str(err) or repr(err))
            wait_s = min(wait_s * 2, max_wait_s)
        else:
            await follow(kv)
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), wait_s)


V = TypeVar("V", bound=msgspec.Struct)


async def follow_view(
    nc: Client,
    bucket: str,
    type_: type[V],
    rejected: Rejections,
    stop: asyncio.Event,
    *,
    on_state: Callable[[OpenState, str], None],
    on_event: Callable[[BucketView[V], ViewEvent[V]], None],
    retry_s: float,
    open_timeout_s: float,
    name: str,
    keep_bad: bool = False,
    on_view: Callable[[BucketView[V]], None] | None = None,
) -> None:
    """`follow_bucket`, following the bucket with a `BucketView` of `type_` records (its watch the task `name`):
    `on_view(view)` once it is made, then `on_event(view, event)` for each of its events (a `Snapshot` first) until
    `stop` is set; the view is closed and its watch stopped on the way out."""

    async def follow(kv: KeyValue) -> None:
        view = BucketView(nc, kv, type_, rejected, keep_bad=keep_bad)
        if on_view is not None:
            on_view(view)
        watch = asyncio.create_task(view.run(), name=name)
        try:
            async for event in view.changes():
                on_event(view, event)
                if stop.is_set():
                    break
        finally:
            view.closed = True
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)

    await follow_bucket(
        nc, bucket, stop, on_state=on_state, follow=follow, retry_s=retry_s, open_timeout_s=open_timeout_s
    )


async def list_keys(js: JetStreamContext, bucket: str, prefix: str = "") -> list[str]:
    """The keys of `bucket` under `prefix`, sorted, deleted ones included (their `get` raises
    `KeyNotFoundError`): one stream-info request with a subjects filter. Not `KeyValue.keys()`, whose watch may
    end before it delivered anything (nats-py signals the end when the consumer has nothing pending and the
    subscription has handled nothing yet, which a busy event loop makes likely): a replica that took its shards in
    a busy moment read no stored override at all, and ran paused models on the policy. The server lists up to
    100,000 subjects in one answer, past any fleet's ScaledObjects or overrides here (the keys of `pulse_slots` are
    not listed this way)."""
    subject = f"$KV.{bucket}."
    info = await js.stream_info(f"KV_{bucket}", subjects_filter=f"{subject}{prefix}>")
    return sorted(s[len(subject) :] for s in (info.state.subjects or {}))


def _not_answering(js: JetStreamContext, bucket: str, err: Exception) -> None:
    """Raise `NatsUnavailable` for a JetStream that is not coming: none on the server (its INFO says so; nats-py
    turns "no responders" into a `ServiceUnavailableError` without an error code) or not for this account."""
    if isinstance(err, nats.errors.TimeoutError):
        return
    code = getattr(err, "err_code", None)
    if code is None and not js._nc._server_info.get("jetstream"):  # the server's INFO, as in `replicas_for`
        raise NatsUnavailable(
            "JetStream does not answer (no responders): start nats-server with JetStream enabled (-js)"
        ) from err
    if code is not None and code != _JETSTREAM_UNAVAILABLE_FOR_NOW:
        raise NatsUnavailable(f"JetStream refused to open bucket {bucket}: {_describe(err)}") from err


def _describe(err: Exception) -> str:
    description = getattr(err, "description", None)
    code = getattr(err, "err_code", None)
    return f"{description} (JetStream error {code})" if description and code else type(err).__name__


_JETSTREAM_RETRY_S = 0.5


async def _open(
    js: JetStreamContext, bucket: str, settings: BucketSettings, replicas: int, *, detected: bool, harden: bool
) -> tuple[KeyValue, int]:
    """One bucket, looked up or created (see `ensure_buckets`); with the replica count for the next: a detected
    count the servers could not place is not asked again (see `_create`)."""
    try:
        kv = await js.key_value(bucket)
    except nats.js.errors.BucketNotFoundError:
        replicas = await _create(js, bucket, settings, replicas, detected=detected)
        return await js.key_value(bucket), replicas
    if harden:
        await _reconcile(js, bucket, replicas)
    elif replicas > 1:
        await _report_replicas(js, bucket, replicas)
    return kv, replicas


# JetStream's answers to a replica count the servers cannot place: "replicas > 1 not supported in non-clustered
# mode" (10074), "no suitable peers for placement" (10005), "insufficient resources" (10023).
_PLACEMENT_ERRORS = (10074, 10005, 10023)


_LEADER_WAIT_S = 10.0
"""How long a new replicated bucket may take to elect its stream leader (a second or so; more on a busy host)."""

PLACEMENT_SETTLE_S = 5.0
"""How long a detected replica count the cluster cannot place is asked again before it comes down: a cluster that
has just formed places on a peer only once it has heard that peer's resources, a moment after they agree on a meta
leader (CI once got 2 replicas of 3 on a fresh cluster of 3). A cluster that truly has fewer servers pays this once."""

_PLACEMENT_RETRY_S = 0.25


async def _create(js: JetStreamContext, bucket: str, settings: BucketSettings, replicas: int, *, detected: bool) -> int:
    """Create a bucket's stream with `replicas`, and wait until it has a leader: a write to a clustered stream
    that has none yet gets no answer at all ("no responders"). (Rarely, the first write just after still finds
    none, on a loaded cluster: writers treat "no responders" as transient.) Detected replicas the servers cannot
    place are asked again for `PLACEMENT_SETTLE_S`, then come down one by one to what they can (said in a warning);
    replicas someone asked for are an error instead. Returns the replicas asked for last (those placed)."""
    settle_until = time.monotonic() + PLACEMENT_SETTLE_S
    n = replicas
    while True:
        try:
            await js.add_stream(_bucket_stream(bucket, dataclasses.replace(settings, replicas=n)))
        except nats.js.errors.APIError as err:
            if err.err_code == 10058:  # created meanwhile by another process ("stream name already in use")
                break
            if err.err_code not in _PLACEMENT_ERRORS:
                raise
            if not detected or n == 1:
                raise KvReplicasError(
                    f"cannot create bucket {bucket} with {n} replicas: {err.description}; set --kv-replicas or "
                    f"${KV_REPLICAS_ENV} to at most the number of JetStream servers up (1 on a single server)"
                ) from err
            if err.err_code != 10074 and time.monotonic() < settle_until:  # 10074: not clustered at all
                await asyncio.sleep(_PLACEMENT_RETRY_S)
                continue
            log.info("bucket %s: %d replica(s) cannot be placed: %s", bucket, n, err.description)
            n -= 1
            continue
        if n < replicas:
            log.warning(
                "bucket %s created with %d replica(s), not %d: the cluster has room for no more; the autoscaler "
                "raises it when it starts on a larger cluster",
                bucket,
                n,
                replicas,
            )
        break
    # Even a one-replica stream on a cluster is placed on some server first: until then a write gets no responder.
    # (On a single server `stream_info` says at once that there is no cluster.)
    await _wait_leader(js, f"KV_{bucket}")
    return n


async def _wait_leader(js: JetStreamContext, stream: str) -> None:
    deadline = time.monotonic() + _LEADER_WAIT_S
    while time.monotonic() < deadline:
        with contextlib.suppress(nats.errors.Error, TimeoutError):
            info = await js.stream_info(stream)
            if info.cluster is None or info.cluster.leader:
                return
        await asyncio.sleep(0.05)
    log.warning("stream %s has no leader %.0f s after it was created; writes wait for one", stream, _LEADER_WAIT_S)


async def _reconcile(js: JetStreamContext, bucket: str, replicas: int) -> None:
    """Bring an existing bucket's stream in line: rollups refused, at least `replicas` replicas."""
    info = await js.stream_info(f"KV_{bucket}")
    config = info.config
    if config.allow_rollup_hdrs:
        config = dataclasses.replace(config, allow_rollup_hdrs=False)
        await js.update_stream(config)
        log.warning("bucket %s allowed rollup headers (made by an older version): now refused", bucket)
    had = config.num_replicas or 1
    if had >= replicas:
        return
    try:
        await js.update_stream(dataclasses.replace(config, num_replicas=replicas))
    except nats.js.errors.APIError as err:
        if err.err_code not in _PLACEMENT_ERRORS:
            raise
        log.warning(
            "bucket %s has %d replica(s), %d asked, and the servers cannot place more: %s; it stays at %d",
            bucket,
            had,
            replicas,
            err.description,
            had,
        )
        return
    log.warning("bucket %s had %d replica(s): raised to %d", bucket, had, replicas)


async def _report_replicas(js: JetStreamContext, bucket: str, replicas: int) -> None:
    """A role that may not update the streams says so when a bucket has fewer replicas than asked."""
    info = await js.stream_info(f"KV_{bucket}")
    had = info.config.num_replicas or 1
    if had < replicas:
        log.warning(
            "bucket %s has %d replica(s), %d asked: the autoscaler raises it when it starts (it may update the "
            "streams); until then losing one server can lose it",
            bucket,
            had,
            replicas,
        )


def _bucket_stream(bucket: str, settings: BucketSettings) -> StreamConfig:
    """The stream of a KV bucket as nats-py's `create_key_value` makes it, except that rollup headers are refused
    (it always allows them). `KeyValue` needs no rollup for what the registry does: put, create, update, delete,
    get, watch and history (a purge would: the registry never purges, it deletes)."""
    return StreamConfig(
        name=f"KV_{bucket}",
        subjects=[f"$KV.{bucket}.>"],
        allow_rollup_hdrs=False,
        deny_delete=True,
        discard=DiscardPolicy.NEW,
        duplicate_window=120.0,  # nats-py's default for a bucket without a TTL
        max_consumers=-1,
        max_msgs=-1,
        max_msgs_per_subject=_HISTORY[bucket] or settings.slot_history,
        num_replicas=settings.replicas,
        storage=settings.storage,
        allow_direct=False,  # reads go to the stream leader (`natsauth`: MSG.GET), so a read follows the writes
    )
