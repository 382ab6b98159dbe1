"""The on-call command plane, server side: ``pulse.cmd.<verb>`` → checks → the owner of the model → reply, audit.

Every request goes through the same steps, in this order:

0. a message that did not arrive on ``pulse.cmd.<verb>`` itself, or on this replica's own hand-over subject
   ``pulse.autoscaler.<identity>.cmd.<verb>`` (`protocol.replica_subject`), is dropped (a bucket's consumer relaying
   onto our subject); so is one that asks for its reply anywhere but an ``_INBOX.`` inbox: counted, never applied
   nor answered;
1. decode with `protocol.decode` into ``COMMAND_TYPES[verb]``; a malformed request is answered with its reason as
   the error code (``missing_field``, ``bad_name``, ...), counted by `Rejections`, and the service keeps going;
2. routing (with a `Router`, below): a request naming a model another replica owns is handed to it unchanged and
   this replica is done with it; one for a model nobody owns right now is refused ``not_leader``;
3. `protocol.admit`: past ``expires_at`` → ``expired``; an ``id`` already answered → the first reply is sent
   again and nothing is applied;
4. the leader fence (below) → ``not_leader``;
5. checks against the model's ScaledObject: ``unknown_model`` (listing the known ones), ``out_of_bounds``
   (saying ``[minReplicaCount, maxReplicaCount]``), ``unknown_node`` for drains;
6. apply through the `ControlPlane` (overrides) or the registry (drains);
7. one `AuditRecord` on ``pulse.audit.<verb>`` in stream ``PULSE_AUDIT`` — for every request this replica
   answers, applied or not (a handed-over request is audited once, by the replica that answers it) — written
   *before* the reply, so a client that got its answer can read its audit record;
8. the reply.

Idempotency. The ledger remembers the replies of the mutating verbs (scale, pause, resume, drain, undrain),
applied or refused by a check, so a repeat gets the same answer. Read-only verbs (status, pool) are not
remembered: running them again is harmless, gives fresher data, and their replies are the large ones. Transient
refusals (``not_leader``, ``internal``) are not remembered either, so a retry is tried again. The ledger lives in
the answering replica's memory: a retry that lands on a new owner after a failover or a hand-over is applied
again. Every mutating command is idempotent in effect (the same override, the same drain), except that a repeated
``scale`` restarts its ``for_s`` from the new owner's clock.

Leadership. Only a leading replica answers. A standby does not subscribe at all, so with no leader the client
gets ``NoResponders`` at once (which the CLI explains) instead of a refusal from whichever standby the queue group
picked. Subscriptions use the queue group `CommandSettings.queue_group`, so while an old and a new leader overlap
(until the old one's deposition unsubscribes it) a request is still handled once; and `is_leader` is checked on
every request, so the old leader answers ``not_leader`` rather than acting after it lost the lease. The service
follows `is_leader` by itself (a cheap check every `CommandSettings.leadership_poll_s`); the election's
``on_elected`` / ``on_deposed`` may also call `on_leadership` to (un)subscribe at once.

Sharding (protocol revision 6). With a `Router` (the replica's shard leases), models are split over replicas and
`is_leader` means "holds at least one shard". Every such replica is a *front*: it answers ``pulse.cmd.<verb>`` in
the queue group. A request naming a model (scale, pause, resume, status of one model) is handled by the front if
it owns the model; if another live replica does, the front publishes the very same bytes to
``pulse.autoscaler.<owner>.cmd.<verb>`` with the client's inbox as reply-to, and the owner runs the whole pipeline
(admit, ledger, checks, apply, audit, reply) — no extra round trip, one reply, one audit record. With no owner (its
shard is being handed over) the front answers ``not_leader`` naming the model and its shard. Each replica also
subscribes its own hand-over subject, without a queue group; a request there for a model it no longer owns (the
hand-over raced a rebalance) is refused ``not_leader``, never forwarded again, so a request cannot loop.
``status`` of every model is answered by the front with its own rows plus those of every other live replica,
asked in parallel on their hand-over subjects (there, a status without a model means "your own models only"); a
replica that does not answer within `CommandSettings.peer_status_timeout_s` is named in the reply's ``error``
(the reply stays ``ok``: the rows that came are worth showing) and its models are missing. Every row carries its
``owner`` and ``shard``; the reply carries the live replicas. ``pool``, ``drain`` and ``undrain`` name no model
and act on the shared registry, so any front answers them. Without a router one replica owns every model: nothing
is handed over and the replies are as before revision 6.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import DiscardPolicy, StorageType, StreamConfig

from autoscaler import scaledobject
from warmpool import protocol, registry
from warmpool.errors import BadMessage, DuplicateRequest
from warmpool.protocol import (
    AuditRecord,
    Command,
    CommandReply,
    DrainCommand,
    DrainReply,
    ErrorCode,
    Override,
    OverrideReply,
    PauseCommand,
    PoolCommand,
    PoolReply,
    PoolSlot,
    ReplicaRecord,
    ResumeCommand,
    ScaleCommand,
    ScaledObjectSpec,
    StatusCommand,
    StatusReply,
    StatusRow,
    UndrainCommand,
)
from warmpool.registry import KvSlotStore
from warmpool.rejects import Rejections

__all__ = [
    "MAX_OVERRIDE_S",
    "REPLY_PREFIX",
    "CommandService",
    "CommandSettings",
    "ControlPlane",
    "Router",
    "ensure_audit_stream",
]

log = logging.getLogger("pulsescale.commands")

MAX_OVERRIDE_S: Final = 24 * 3600.0
"""The longest a ``scale`` override may last (``--for``): a day covers any incident and its night; an override
that outlives its reason holds a model at a stale count unnoticed, so a longer hold is refused — scale again when
it lapses, or ``pause``, which is visible as paused until someone resumes it."""


class ControlPlane(Protocol):
    """What the command plane needs from the controller; the controller implements it."""

    def spec_for(self, model: str) -> ScaledObjectSpec | None:
        """The model's ScaledObject spec, or None for a model no ScaledObject names."""
        ...

    def models(self) -> list[str]: ...

    async def set_override(self, model: str, override: Override | None) -> None:
        """Install an on-call override (it beats the policy until it expires); None hands the model back."""
        ...

    def status(self, model: str | None) -> list[StatusRow]:
        """One row per model (all, or `model`), its decisions newest last."""
        ...


class Router(Protocol):
    """Who owns which model, from this replica's view of the shard leases (`autoscaler.shards.ShardLeases`
    implements it). Read on every request: it must be cheap and never block."""

    @property
    def identity(self) -> str:
        """This replica's identity (`protocol.IDENTITY_PATTERN`): its hand-over subject's token."""
        ...

    def owns_model(self, model: str) -> bool:
        """Whether this replica holds the lease of the model's shard now."""
        ...

    def owner_of_model(self, model: str) -> str | None:
        """Identity of the live replica holding the model's shard, or None while none does."""
        ...

    def replicas(self) -> Sequence[ReplicaRecord]:
        """The live replicas, this one included."""
        ...


STATUS_IN_FLIGHT: Final = 8
"""`status` requests one replica answers at once beside the other commands (each may wait on a hung peer)."""


@dataclass(frozen=True)
class CommandSettings:
    queue_group: str = "pulsescale-autoscaler"
    """Queue group of the command subscription: while two replicas briefly both believe they lead, each request
    still reaches only one of them."""
    audit_max_age_s: float = 90 * 24 * 3600.0
    """How long audit records are kept: 90 days covers a quarter's incident reviews; longer belongs in a log
    archive, not on the broker's disk."""
    audit_max_bytes: int = 1 << 30
    """Size cap of the audit stream (oldest dropped first), so a misbehaving client cannot fill the broker's disk."""
    audit_replicas: int | None = None
    """JetStream replicas of the audit stream; None: as the registry's buckets (`registry.replicas_for`: 1 on a
    single server, 3 on a cluster, or ``$PULSESCALE_KV_REPLICAS``)."""
    audit_timeout_s: float = 1.0
    """How long the audit write may take before the reply goes out anyway (logged): well under the CLI's 5 s."""
    ledger_entries: int = 10_000
    """Replies remembered for duplicate ids; far more than on-call traffic within one request lifetime."""
    status_decisions: int = 10
    """Newest decisions per model sent in a status reply; the autoscaler may keep more."""
    max_replicas: int = scaledobject.DEFAULT_MAX_REPLICAS
    """The largest replica count ``scale`` and ``pause`` accept, whatever a ScaledObject's maxReplicaCount says
    (`scaledobject.DEFAULT_MAX_REPLICAS`; ``pulsescale autoscaler --max-replicas``)."""
    max_override_s: float = MAX_OVERRIDE_S
    """The longest ``scale --for`` accepted (`MAX_OVERRIDE_S`)."""
    leadership_poll_s: float = 0.25
    """How often the service checks `is_leader` to (un)subscribe: elections take a lease period (seconds), so
    this adds little to a failover; the per-request fence covers the lag on deposition."""
    peer_status_timeout_s: float = 1.5
    """How long the front waits for the other replicas' rows in a ``status`` of every model: a live replica
    answers in milliseconds, and the CLI gives up after 5 s, so a silent replica (dying, partitioned) is named in
    the reply with time to spare instead of costing the whole answer."""


async def ensure_audit_stream(nc: Client, settings: CommandSettings = CommandSettings()) -> None:
    """Create stream `PULSE_AUDIT` on ``pulse.audit.>`` unless it exists (an existing one is left as configured:
    an operator may have tuned its limits)."""
    js = nc.jetstream(timeout=2.0)
    try:
        await js.stream_info(protocol.AUDIT_STREAM)
        return
    except nats.js.errors.NotFoundError:
        pass
    config = StreamConfig(
        name=protocol.AUDIT_STREAM,
        description="pulsescale on-call commands and their outcomes",
        subjects=[protocol.AUDIT_WILDCARD],
        storage=StorageType.FILE,
        max_age=settings.audit_max_age_s,
        max_bytes=settings.audit_max_bytes,
        discard=DiscardPolicy.OLD,
        num_replicas=settings.audit_replicas or registry.replicas_for(nc),
    )
    try:
        await js.add_stream(config)
    except nats.js.errors.BadRequestError as err:
        if err.err_code != 10058:  # created meanwhile by another replica ("stream name already in use")
            raise


@dataclass
class _Outcome:
    reply: bytes
    applied: bool
    remember: bool
    audit_reply: dict[str, Any] | None = None
    """What the audit record keeps of the reply, when not all of it (status and pool are summarised)."""


class _Refused(Exception):
    def __init__(self, code: ErrorCode, message: str, *, remember: bool = True) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.remember = remember


class CommandService:
    """Answers ``pulse.cmd.<verb>`` while this replica leads (with a `Router`: while it holds a shard, and its
    hand-over subject too). ``start()``, then ``on_leadership(...)`` from the election's callbacks (or leave
    `is_leader` at its default for a single replica), ``stop()`` at shutdown."""

    def __init__(
        self,
        nc: Client,
        control: ControlPlane,
        store: KvSlotStore,
        *,
        clock: Callable[[], float] = time.time,
        rejections: Rejections | None = None,
        is_leader: Callable[[], bool] = lambda: True,
        settings: CommandSettings = CommandSettings(),
        router: Router | None = None,
    ) -> None:
        self.nc = nc
        self.control = control
        self.store = store
        self.clock = clock
        self.rejections = rejections or Rejections(log)
        self.is_leader = is_leader
        self.settings = settings
        self.router = router
        self.ledger = protocol.RequestLedger(settings.ledger_entries)
        self.outcomes: Counter[str] = Counter()
        """Handled requests by outcome (``applied``, an error code, ``duplicate``): a metric can read it."""
        self._js = nc.jetstream(timeout=settings.audit_timeout_s)
        self._sub: Subscription | None = None
        self._own_sub: Subscription | None = None
        """The hand-over subscription (``pulse.autoscaler.<identity>.cmd.*``), held with `_sub` when routing."""
        self._lock = asyncio.Lock()
        self._started = False
        self._pending: set[asyncio.Task[None]] = set()
        self._statuses = 0  # `status` requests running beside the others
        self._follower: asyncio.Task[None] | None = None

    @property
    def subscribed(self) -> bool:
        return self._sub is not None

    async def start(self) -> None:
        """Create the audit stream if needed, subscribe if this replica leads now, and follow leadership."""
        await ensure_audit_stream(self.nc, self.settings)
        self._started = True
        await self.set_leading(self.is_leader())
        if self._follower is None:
            self._follower = asyncio.create_task(self._follow_leadership(), name="commands-follow-leadership")

    async def stop(self) -> None:
        """Unsubscribe and stop following leadership."""
        self._started = False
        if self._follower is not None:
            self._follower.cancel()
            await asyncio.gather(self._follower, return_exceptions=True)
            self._follower = None
        for task in list(self._pending):
            await asyncio.gather(task, return_exceptions=True)
        await self.set_leading(False)

    async def _follow_leadership(self) -> None:
        while self._started:
            await asyncio.sleep(self.settings.leadership_poll_s)
            leading = self.is_leader()
            if leading != self.subscribed:
                try:
                    await self.set_leading(leading)
                except nats.errors.Error as err:  # disconnected: try again on the next check
                    log.warning("could not %s on-call commands: %s", "answer" if leading else "stop answering", err)

    async def set_leading(self, leading: bool) -> None:
        """Subscribe (leader) or unsubscribe (standby); idempotent. With a router, the hand-over subject too: it
        is subscribed first, so a front never hands a request to a replica that could not yet hear it."""
        async with self._lock:
            if leading and self._started and self._sub is None:
                if self.router is not None and self._own_sub is None:
                    own = protocol.replica_subject(self.router.identity, "*")
                    self._own_sub = await self.nc.subscribe(own, cb=self._on_msg)  # no queue group: ours alone
                self._sub = await self.nc.subscribe(
                    protocol.CMD_WILDCARD, queue=self.settings.queue_group, cb=self._on_msg
                )
                if self.router is not None:
                    # The server has the subscriptions once this returns: a peer asked for status right after
                    # this replica announced itself must not get "no responders".
                    await self.nc.flush()
                log.info("answering on-call commands on %s", protocol.CMD_WILDCARD)
            elif not leading and self._sub is not None:
                subs = [s for s in (self._sub, self._own_sub) if s is not None]
                self._sub = self._own_sub = None
                for sub in subs:
                    try:
                        await sub.unsubscribe()
                    except nats.errors.Error as err:  # closed or draining connection: nothing left to stop
                        log.debug("unsubscribe %s: %s", sub.subject, err)
                log.info("stopped answering on-call commands (not the leader)")

    def on_leadership(self, leading: bool) -> None:
        """Synchronous hook for the election's ``on_elected`` / ``on_deposed``; schedules `set_leading`."""
        task = asyncio.get_running_loop().create_task(self.set_leading(leading), name="commands-leadership")
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    # --- one request ---------------------------------------------------------------------------------------------

    async def _on_msg(self, msg: Msg) -> None:
        # nats-py runs a subscription's callback for one message at a time: commands are applied in arrival
        # order and the ledger's check-then-record cannot interleave (`status`, read-only, runs beside them).
        refused = _misrouted(msg, self._own_prefix)
        if refused is not None:
            # Dropped, never answered nor applied: a reply would be a publish with our grants to a subject the
            # sender chose (a KV key), and a message a consumer relayed was not sent by on-call.
            self.rejections(refused, source=msg.subject)
            self.outcomes[f"dropped_{refused.reason}"] += 1
            return
        if self._verb(msg.subject) == "status" and self._started and self._statuses < STATUS_IN_FLIGHT:
            # Read-only, and its fan-out may wait `peer_status_timeout_s` on a hung replica: it runs beside the
            # commands that arrive meanwhile instead of holding them up (those keep their arrival order). At most
            # `STATUS_IN_FLIGHT` at once (past it, and while stopping, one at a time as before).
            self._statuses += 1
            task = asyncio.get_running_loop().create_task(self._handle_logged(msg), name="commands-status")
            self._pending.add(task)
            task.add_done_callback(self._status_done)
            return
        await self._handle_logged(msg)

    def _status_done(self, task: asyncio.Task[None]) -> None:
        self._statuses -= 1
        self._pending.discard(task)

    async def _handle_logged(self, msg: Msg) -> None:
        try:
            await self.handle(msg.subject, msg.data, reply_to=msg.reply)
        except Exception:
            log.exception("command on %s failed unexpectedly", msg.subject)

    def _verb(self, subject: str) -> str:
        """The verb of a request on ``pulse.cmd.<verb>`` or on this replica's hand-over subject."""
        own = self._own_prefix
        if own is not None and subject.startswith(own):
            return subject[len(own) :]
        return subject[len(protocol.CMD_PREFIX) :] if subject.startswith(protocol.CMD_PREFIX) else subject

    @property
    def _own_prefix(self) -> str | None:
        """``pulse.autoscaler.<identity>.cmd.``: where other replicas hand this one requests; None without routing."""
        return None if self.router is None else protocol.replica_subject(self.router.identity, "")

    async def handle(self, subject: str, data: bytes, *, reply_to: str = "") -> bytes | None:
        """Handle one request and return the reply (also sent to `reply_to` when there is one); None when it was
        handed to the replica owning its model, which answers it."""
        own = self._own_prefix
        handed = own is not None and subject.startswith(own)
        verb = self._verb(subject)
        now = self.clock()
        req: Command | None = None
        try:
            req = self._decode(verb, data)
            if await self._hand_over(verb, req, data, reply_to, handed=handed):
                self.outcomes["handed_over"] += 1
                return None
            protocol.admit(req, now, self.ledger)
            if not self.is_leader():
                raise _Refused("not_leader", "this autoscaler replica is not the leader; retry", remember=False)
            outcome = await self._apply(verb, req, now, handed=handed)
            self.outcomes["applied" if outcome.applied else "refused"] += 1
        except DuplicateRequest as dup:
            self.rejections(dup, source=subject)
            self.outcomes["duplicate"] += 1
            outcome = _Outcome(dup.reply, applied=False, remember=False)
        except BadMessage as err:
            self.rejections(err, source=subject)
            self.outcomes[err.reason] += 1
            outcome = _Outcome(_refusal(err.reason, err.detail or str(err)), applied=False, remember=False)
        except _Refused as ref:
            self.outcomes[ref.code] += 1
            outcome = _Outcome(_refusal(ref.code, ref.message), applied=False, remember=ref.remember)
        except Exception as err:
            log.exception("%s command failed", verb)
            self.outcomes["internal"] += 1
            outcome = _Outcome(_refusal("internal", f"{type(err).__name__}: {err}"), applied=False, remember=False)
        if req is not None and outcome.remember:
            self.ledger.record(req, outcome.reply, now)
        await self._audit(verb, req, data, outcome, now)
        if reply_to:
            try:
                await self.nc.publish(reply_to, outcome.reply)
            except nats.errors.Error as err:
                log.warning("could not reply to %s command: %s", verb, err)
        return outcome.reply

    async def _hand_over(self, verb: str, req: Command, data: bytes, reply_to: str, *, handed: bool) -> bool:
        """Route a request naming a model: True when it was published, as it came, to the replica owning the
        model (which answers it); False to handle it here; `_Refused` ``not_leader`` when nobody owns it now, or
        when it was handed here and this replica no longer owns it (never handed on again: no loops)."""
        model = _model_of(req)
        if self.router is None or model is None:
            return False
        if self.router.owns_model(model):
            return False
        shard = protocol.shard_of(model)
        if handed:
            raise _Refused(
                "not_leader",
                f"model {model} (shard {shard}) moved off replica {self.router.identity} while the request was "
                "handed to it: handing over; retry",
                remember=False,
            )
        owner = self.router.owner_of_model(model)
        if owner is None or owner == self.router.identity:
            raise _Refused(
                "not_leader",
                f"no autoscaler replica owns model {model} (shard {shard}) right now: handing over; retry",
                remember=False,
            )
        # The same bytes, the client's inbox as reply-to: the owner answers the client directly.
        await self.nc.publish(protocol.replica_subject(owner, verb), data, reply=reply_to)
        return True

    def _decode(self, verb: str, data: bytes) -> Command:
        type_ = protocol.COMMAND_TYPES.get(verb)
        if type_ is None:
            raise BadMessage("bad_value", f"unknown command verb {verb!r}; known: {', '.join(protocol.CMD_VERBS)}")
        return protocol.decode(data, type_)

    async def _apply(self, verb: str, req: Command, now: float, *, handed: bool = False) -> _Outcome:
        if isinstance(req, ScaleCommand):
            spec = self._spec(req.model)
            self._check_bounds(req.model, spec, req.replicas, "scale")
            if req.for_s > self.settings.max_override_s:
                raise _Refused(
                    "out_of_bounds",
                    f"scale {req.model} for {req.for_s:g} s is longer than an override may last "
                    f"({self.settings.max_override_s:g} s); scale again when it lapses, or pause it until resumed",
                )
            override = Override(kind="scale", replicas=req.replicas, expires_at=now + req.for_s, by=req.by)
            await self.control.set_override(req.model, override)
            return self._ok(OverrideReply(model=req.model, override=override))
        if isinstance(req, PauseCommand):
            spec = self._spec(req.model)
            if req.replicas is not None:
                self._check_bounds(req.model, spec, req.replicas, "pause")
            override = Override(kind="pause", replicas=req.replicas, expires_at=None, by=req.by)
            await self.control.set_override(req.model, override)
            return self._ok(OverrideReply(model=req.model, override=override))
        if isinstance(req, ResumeCommand):
            self._spec(req.model)
            await self.control.set_override(req.model, None)
            return self._ok(OverrideReply(model=req.model, override=None))
        if isinstance(req, StatusCommand):
            return await self._status(req, now, handed=handed)
        if isinstance(req, PoolCommand):
            return self._pool(req.model, now)
        if isinstance(req, DrainCommand | UndrainCommand):
            self._check_node(req.node)
            on = isinstance(req, DrainCommand)
            touched = await (self.store.drain(req.node) if on else self.store.undrain(req.node))
            return self._ok(DrainReply(node=req.node, drained=on, touched=sorted(touched)))
        raise BadMessage("bad_value", f"unknown command verb {verb!r}")  # pragma: no cover - COMMAND_TYPES is closed

    @staticmethod
    def _ok(reply: CommandReply) -> _Outcome:
        """A mutating command applied: its reply is remembered for a repeat of its id."""
        return _Outcome(protocol.encode(reply), applied=True, remember=True)

    def _spec(self, model: str) -> ScaledObjectSpec:
        spec = self.control.spec_for(model)
        if spec is None:
            known = sorted(self.control.models())
            listed = ", ".join(known) if known else "none (no ScaledObject is applied yet: `pulsescale apply -f`)"
            raise _Refused("unknown_model", f"no ScaledObject names model {model!r}; known models: {listed}")
        return spec

    def _check_bounds(self, model: str, spec: ScaledObjectSpec, replicas: int, verb: str) -> None:
        cap = self.settings.max_replicas
        if replicas > cap:
            raise _Refused(
                "out_of_bounds",
                f"{verb} {model} to {replicas} replicas is over this autoscaler's limit of {cap} replicas per model; "
                f"raise it with `pulsescale autoscaler --max-replicas N` (or ${scaledobject.MAX_REPLICAS_ENV})",
            )
        lo, hi = spec.min_replica_count, spec.max_replica_count
        if not lo <= replicas <= hi:
            raise _Refused(
                "out_of_bounds",
                f"{verb} {model} to {replicas} replicas is outside its ScaledObject's "
                f"[minReplicaCount, maxReplicaCount] = [{lo}, {hi}]",
            )

    def _check_node(self, node: str) -> None:
        if self.store.lease(node) is not None or any(r.node == node for r in self.store.records()):
            return
        known = sorted({r.node for r in self.store.records()} | set(self.store.leases()))
        raise _Refused("unknown_node", f"no agent or slot on node {node!r}; known nodes: {', '.join(known) or 'none'}")

    def _trim(self, row: StatusRow) -> StatusRow:
        if len(row.decisions) > self.settings.status_decisions:
            row = msgspec.structs.replace(row, decisions=row.decisions[-self.settings.status_decisions :])
        return row

    def _own_rows(self, model: str | None) -> list[StatusRow]:
        rows = [self._trim(row) for row in self.control.status(model)]
        if self.router is None:
            return rows
        me = self.router.identity
        # The daemon's rows name their owner and shard already; a control plane that does not, gets them here.
        return [
            row if row.owner == me else msgspec.structs.replace(row, owner=me, shard=protocol.shard_of(row.model))
            for row in rows
            if self.router.owns_model(row.model)
        ]

    async def _status(self, req: StatusCommand, now: float, *, handed: bool) -> _Outcome:
        if req.model is not None:
            self._spec(req.model)
        rows = self._own_rows(req.model)
        silent: list[str] = []
        replicas: list[ReplicaRecord] = []
        if self.router is not None:
            replicas = sorted(self.router.replicas(), key=lambda r: r.identity)
            if req.model is None and not handed:  # a front asking its peers: their own rows only, never on
                peers = [r.identity for r in replicas if r.identity != self.router.identity]
                answers = await asyncio.gather(*(self._peer_rows(p, req, now) for p in peers))
                for peer, peer_rows in zip(peers, answers, strict=True):
                    if peer_rows is None:
                        silent.append(peer)
                    else:
                        rows += [r if r.owner else msgspec.structs.replace(r, owner=peer) for r in peer_rows]
                rows.sort(key=lambda r: r.model)
        reply = StatusReply(models=rows, replicas=replicas, missing=silent)
        audit: dict[str, Any] = {"ok": True, "models": len(rows)}
        if silent:
            audit["silent"] = silent
        return _Outcome(protocol.encode(reply), applied=True, remember=False, audit_reply=audit)

    async def _peer_rows(self, peer: str, req: StatusCommand, now: float) -> list[StatusRow] | None:
        """`peer`'s own rows, or None when it did not answer in time (or answered a refusal)."""
        bound = self.settings.peer_status_timeout_s
        ask = StatusCommand(id=uuid.uuid4().hex, expires_at=now + bound, by=req.by)
        try:
            msg = await self.nc.request(protocol.replica_subject(peer, "status"), protocol.encode(ask), timeout=bound)
            reply = protocol.decode(msg.data, StatusReply)
        except (nats.errors.Error, TimeoutError, BadMessage) as err:
            log.warning("autoscaler replica %s did not answer status: %s", peer, err or type(err).__name__)
            return None
        if not reply.ok:
            log.warning("autoscaler replica %s refused status: %s", peer, reply.error)
            return None
        return reply.models

    def _pool(self, model: str | None, now: float) -> _Outcome:
        records = sorted(self.store.records(model), key=lambda r: r.key)
        if model is not None and not records:
            self._spec(model)  # a model with neither slots nor a ScaledObject is a typo
        slots = []
        counts: dict[str, Counter[str]] = {}
        for r in records:
            lease = self.store.lease(r.node)
            slots.append(
                PoolSlot(
                    key=r.key,
                    model=r.model,
                    node=r.node,
                    rack=r.rack,
                    state=r.state,
                    drain=r.drain,
                    agent="fresh" if lease is not None and lease.fresh(now) else "stale",
                    resident=r.weights_resident,
                    endpoint=r.endpoint,
                    reason=r.reason,
                    engine=r.engine,
                    engine_mode=r.engine_mode,
                )
            )
            counts.setdefault(r.model, Counter())[r.state] += 1
        by_model = {m: dict(sorted(c.items())) for m, c in sorted(counts.items())}
        # The contract caps a message at 64 KiB; a big pool sends every count but only as many slots as fit.
        shown = len(slots)
        while True:
            reply = PoolReply(slots=slots[:shown], counts=by_model, now=now, truncated=len(slots) - shown)
            try:
                data = protocol.encode(reply)
                break
            except BadMessage:  # too_large
                if not shown:
                    raise
                shown //= 2
        return _Outcome(
            data, applied=True, remember=False, audit_reply={"ok": True, "slots": len(slots), "counts": by_model}
        )

    # --- audit ---------------------------------------------------------------------------------------------------

    async def _audit(self, verb: str, req: Command | None, data: bytes, outcome: _Outcome, now: float) -> None:
        if req is not None:
            request: dict[str, Any] = msgspec.to_builtins(req)
            req_id, by = req.id, req.by
        else:
            request, req_id, by = _raw_request(data)
        if outcome.audit_reply is not None:
            reply = outcome.audit_reply
        else:
            reply = msgspec.json.decode(outcome.reply)
            reply.pop("v", None)
        record = AuditRecord(
            verb=verb[:64], id=req_id, by=by, ts=now, request=request, reply=reply, applied=outcome.applied
        )
        try:
            await self._js.publish(protocol.audit_subject(verb), protocol.encode(record), stream=protocol.AUDIT_STREAM)
        except (nats.errors.Error, BadMessage, TimeoutError) as err:
            # The command's outcome stands; the record goes to the log so it is not lost entirely.
            log.error("audit record not written (%s): %s", err, protocol.encode(record).decode(errors="replace"))


REPLY_PREFIX: Final = "_INBOX."
"""Replies go only to inboxes. Every client (nats-py's request, `pulsescale` commands) asks from
``_INBOX.<user>.…`` (`warmpool.natsauth.inbox_prefix`); any other reply subject would make our answer a publish,
under the autoscaler's grants, to a subject the sender picked: ``$KV.pulse_slots.<key>`` overwrote a slot."""


def _misrouted(msg: Msg, own_prefix: str | None = None) -> BadMessage | None:
    """Why a message on the command subscriptions must be dropped unanswered, or None.

    It must have arrived on ``pulse.cmd.<verb>`` itself, or on this replica's hand-over subject `own_prefix`
    ``<verb>`` (and no other replica's): a consumer of a bucket the sender may read, created with
    ``pulse.cmd.<verb>`` as its deliver subject, relays the bucket's messages here under their own subjects
    (``$KV.…``) with a ``$JS.ACK.…`` reply. And a reply subject, if any, must be an inbox (`REPLY_PREFIX`); a
    command without one is applied and audited, unanswered (only on-call may publish on ``pulse.cmd.>``, only
    autoscalers on ``pulse.autoscaler.>``)."""
    own = own_prefix is not None and msg.subject.startswith(own_prefix) and "." not in msg.subject[len(own_prefix) :]
    if not own and not msg.subject.startswith(protocol.CMD_PREFIX):
        return BadMessage("subject_mismatch", f"a message on {msg.subject} reached the {protocol.CMD_WILDCARD} service")
    if msg.reply and not msg.reply.startswith(REPLY_PREFIX):
        return BadMessage(
            "bad_value", f"{msg.subject} asks for its reply on {msg.reply}, not on an {REPLY_PREFIX}* inbox"
        )
    return None


def _model_of(req: Command) -> str | None:
    """The model a request is about, when it is one the model's owner must answer (pool names a model only to
    filter the shared registry: any replica answers it)."""
    if isinstance(req, ScaleCommand | PauseCommand | ResumeCommand | StatusCommand):
        return req.model
    return None


def _refusal(code: str, message: str) -> bytes:
    """A failed reply: the envelope alone (``{"v", "ok": false, "error"}``), which every verb's reply type reads."""
    return protocol.encode(protocol.refusal(CommandReply, code, message))


def _raw_request(data: bytes) -> tuple[dict[str, Any], str, str]:
    """What can be kept of a request that did not decode: its fields if it is a JSON object, else its text."""
    try:
        raw = msgspec.json.decode(data[: protocol.MAX_MESSAGE_BYTES])
    except msgspec.DecodeError:
        raw = None
    if isinstance(raw, dict) and len(data) <= 4096:
        req_id, by = raw.get("id"), raw.get("by")
        return raw, req_id if isinstance(req_id, str) else "", by if isinstance(by, str) else ""
    return {"raw": data[:1024].decode("utf-8", errors="replace"), "bytes": len(data)}, "", ""
