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
3. `warmpool.ledger.admit`: past ``expires_at`` → ``expired``; an ``id`` already answered → the first reply is sent
   again and nothing is applied;
4. the leader fence (below) → ``not_leader``;
5. checks against the model's ScaledObject: ``unknown_model`` (listing the known ones), ``out_of_bounds``
   (saying ``[minReplicaCount, maxReplicaCount]``), ``unknown_node`` for drains;
6. apply through the `ControlPlane` (overrides) or the registry (drains);
7. one `AuditRecord` on ``pulse.audit.<verb>`` in stream ``PULSE_AUDIT`` — for every request this replica
   answers, applied or not (a handed-over request is audited once, by the replica that answers it) — written
   *before* the reply, so a client that got its answer can read its audit record;
8. the reply.

Idempotency. The ledger remembers the replies of the mutating verbs (scale, pause, resume, drain, undrain, and
schedule's add and delete),
applied or refused by a check, so a repeat gets the same answer. Read-only verbs (status, pool) are not
remembered: running them again is harmless, gives fresher data, and their replies are the large ones. Transient
refusals (``not_leader``, ``internal``) are not remembered either, so a retry is tried again (nor is a
``schedule`` that only lists). The ledger lives in
the answering replica's memory: a retry that lands on a new owner after a failover or a hand-over is applied
again. Every mutating command is idempotent in effect (the same override, the same drain), except that a repeated
``scale`` restarts its ``for_s`` from the new owner's clock.

Leadership. Only a leading replica answers. A standby does not subscribe at all, so with no leader the client
gets ``NoResponders`` at once (which the CLI explains) instead of a refusal from whichever standby the queue group
picked. Subscriptions use the queue group `CommandSettings.queue_group`, so while an old and a new leader overlap
(until the old one's deposition unsubscribes it) a request is still handled once; and `holds_shards` is checked on
every request, so the old leader answers ``not_leader`` rather than acting after it lost the lease. The service
follows `holds_shards` by itself (a cheap check every `CommandSettings.leadership_poll_s`); the election's
``on_elected`` / ``on_deposed`` may also call `on_leadership` to (un)subscribe at once. It (un)subscribes only
on a live connection, never while nats-py reconnects (see `CommandService.set_leading`): after a broker restart
the connection holds exactly one subscription per subject.

Sharding (protocol revision 6). With a `Router` (the replica's shard leases), models are split over replicas and
`holds_shards` means "holds at least one shard". Every such replica is a *front*: it answers ``pulse.cmd.<verb>`` in
the queue group. A request naming a model (scale, pause, resume, schedule, status of one model) is handled by the
front if it owns the model; if another live replica does, the front publishes the very same bytes to
``pulse.autoscaler.<owner>.cmd.<verb>`` with the client's inbox as reply-to, and the owner runs the whole pipeline
(admit, ledger, checks, apply, audit, reply) — no extra round trip, one reply, one audit record. With no owner (its
shard is being handed over) the front answers ``not_leader`` naming the model and its shard. Each replica also
subscribes its own hand-over subject, without a queue group; a request there for a model it no longer owns (the
hand-over raced a rebalance) is refused ``not_leader``, never forwarded again, so a request cannot loop.
``status`` of every model is answered by the front with its own rows plus those of every other live replica,
asked in parallel on their hand-over subjects (there, a status without a model means "your own models only"); a
replica that does not answer within `CommandSettings.peer_status_timeout_s` is named in the reply's ``missing``
(the reply stays ``ok``: the rows that came are worth showing) and its models are not in ``models``. Every row
carries its ``owner`` and ``shard``; the reply carries the live replicas. ``pool``, ``drain`` and ``undrain`` name
no model and act on the shared registry, so any front answers them. Without a router one replica owns every model:
nothing is handed over and the replies are as before revision 6.

`CommandService` is the request handling: the subscriptions and the following of leadership, then steps 0 to 4,
7 and 8, routing included. It composes the work: `Verbs` (`autoscaler.commands.verbs`: steps 5 and 6, each verb's
checks and what it does) and `StatusRows` (`autoscaler.commands.status`: the rows of ``status``, gathered across the
replicas). `CommandSettings`, `ControlPlane` and `Router` live in `autoscaler.commands.base` and
are re-exported here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, Final

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import DiscardPolicy, StorageType, StreamConfig

from autoscaler.commands.base import CommandSettings, ControlPlane, Outcome, Refused, Router
from autoscaler.commands.status import StatusRows
from autoscaler.commands.verbs import Verbs
from warmpool import connect, protocol, registry
from warmpool.errors import BadMessage, DuplicateRequest
from warmpool.ledger import RequestLedger, admit
from warmpool.protocol import (
    AuditRecord,
    Command,
    CommandReply,
    PauseCommand,
    ResumeCommand,
    ScaleCommand,
    ScheduleCommand,
    StatusCommand,
)
from warmpool.registry import KvSlotStore
from warmpool.rejects import Rejections

__all__ = [
    "REPLY_PREFIX",
    "CommandService",
    "CommandSettings",
    "ControlPlane",
    "Router",
    "ensure_audit_stream",
]

log = logging.getLogger("pulsescale.commands")

STATUS_IN_FLIGHT: Final = 8
"""`status` requests one replica answers at once beside the other commands (each may wait on a hung peer)."""
FLUSH_WAIT_S: Final = 2.0
"""How long taking the command subjects waits for the server's PONG before going on (the flush goes on meanwhile)."""


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


class CommandService:
    """Answers ``pulse.cmd.<verb>`` while this replica leads (with a `Router`: while it holds a shard, and its
    hand-over subject too). ``start()``, then ``on_leadership(...)`` from the election's callbacks (or leave
    `holds_shards` at its default for a single replica), ``stop()`` at shutdown."""

    def __init__(
        self,
        nc: Client,
        control: ControlPlane,
        store: KvSlotStore,
        *,
        clock: Callable[[], float] = time.time,
        rejections: Rejections | None = None,
        holds_shards: Callable[[], bool] = lambda: True,
        settings: CommandSettings = CommandSettings(),
        router: Router | None = None,
    ) -> None:
        self.nc = nc
        self.control = control
        self.store = store
        self.clock = clock
        self.rejections = rejections or Rejections(log)
        self.holds_shards = holds_shards
        self.settings = settings
        self.router = router
        self.ledger = RequestLedger(settings.ledger_entries)
        self.outcomes: Counter[str] = Counter()
        """Handled requests by outcome (``applied``, an error code, ``duplicate``): a metric can read it."""
        self.status_rows = StatusRows(nc, control, router, settings=settings)
        """The rows of ``status``, this replica's and its peers' (`autoscaler.commands.status`)."""
        self.verbs = Verbs(control, store, self.status_rows, settings=settings)
        """Each verb's checks and work, once a request is handled here (`autoscaler.commands.verbs`)."""
        self._js = nc.jetstream(timeout=settings.audit_timeout_s)
        self._sub: Subscription | None = None
        self._own_sub: Subscription | None = None
        """The hand-over subscription (``pulse.autoscaler.<identity>.cmd.*``), held with `_sub` when routing."""
        self._lock = asyncio.Lock()
        self._started = False
        self._pending: set[asyncio.Task[None]] = set()
        self._flushing: set[asyncio.Task[None]] = set()  # flushes past `FLUSH_WAIT_S`, left to finish (not awaited)
        self._statuses = 0  # `status` requests running beside the others
        self._follower: asyncio.Task[None] | None = None

    @property
    def subscribed(self) -> bool:
        return self._sub is not None

    async def start(self) -> None:
        """Create the audit stream if needed, subscribe if this replica leads now, and follow leadership."""
        await ensure_audit_stream(self.nc, self.settings)
        self._started = True
        await self.set_leading(self.holds_shards())
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
            leading = self.holds_shards()
            if leading != self.subscribed:
                await self._try_set_leading(leading)

    async def _try_set_leading(self, leading: bool) -> None:
        try:
            await self.set_leading(leading)
        except nats.errors.Error as err:  # closed or draining: the next check tries again
            log.warning("could not %s on-call commands: %s", "answer" if leading else "stop answering", err)

    async def set_leading(self, leading: bool) -> None:
        """Subscribe (`leading`, and `holds_shards` says so now) or unsubscribe; idempotent. With a router, the
        hand-over subject too: it is subscribed first, so a front never hands a request to a replica that could
        not yet hear it.

        `leading` may be stale when this runs (`on_leadership` schedules it; a burst of shard losses schedules
        "still leading" for every shard but the last), so subscribing also takes `holds_shards` now. And the
        subscriptions change only while the connection is up (`stop` excepted): while it is down this does
        nothing, and `_follow_leadership` catches up once it is back. nats-py queues the SUB of a subscribe made
        while it reconnects, and an unsubscribe while it reconnects drops the subscription on our side with no
        UNSUB and the queued SUB still sent: after a broker restart the server held a second queue-group
        subscription that nobody read, and took every other on-call command. A subscription made while
        connected is replayed by nats-py on each reconnect, so a leader that loses and retakes its shards in a
        broker outage comes back with its one subscription."""
        async with self._lock:
            want = leading and self._started and self.holds_shards()
            if (self._sub is not None) if want else (self._sub is None and self._own_sub is None):
                return  # as wanted already
            if self._started and not self.nc.is_connected:
                return  # for `_follow_leadership`, once connected
            if want and self._sub is None:
                if self.router is not None and self._own_sub is None:
                    own = protocol.replica_subject(self.router.identity, "*")
                    self._own_sub = await self.nc.subscribe(own, cb=self._on_msg)  # no queue group: ours alone
                self._sub = await self.nc.subscribe(
                    protocol.CMD_WILDCARD, queue=self.settings.queue_group, cb=self._on_msg
                )
                if self.router is not None:
                    # The server has the subscriptions once this returns: a peer asked for status right after
                    # this replica announced itself must not get "no responders". Not `nc.flush(timeout)`: one that
                    # timed out ended the connection's reading (`connect.flush_without_cancel`).
                    await connect.flush_without_cancel(self.nc, FLUSH_WAIT_S, self._flushing)
                log.info("answering on-call commands on %s", protocol.CMD_WILDCARD)
            elif not want:
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
        task = asyncio.get_running_loop().create_task(self._try_set_leading(leading), name="commands-leadership")
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
            admit(req, now, self.ledger)
            if not self.holds_shards():
                raise Refused("not_leader", "this autoscaler replica is not the leader; retry", remember=False)
            outcome = await self.verbs.apply(verb, req, now, handed=handed)
            self.outcomes["applied" if outcome.applied else "refused"] += 1
        except DuplicateRequest as dup:
            self.rejections(dup, source=subject)
            self.outcomes["duplicate"] += 1
            outcome = Outcome(dup.reply, applied=False, remember=False)
        except BadMessage as err:
            self.rejections(err, source=subject)
            self.outcomes[err.reason] += 1
            outcome = Outcome(_refusal(err.reason, err.detail or str(err)), applied=False, remember=False)
        except Refused as ref:
            self.outcomes[ref.code] += 1
            outcome = Outcome(_refusal(ref.code, ref.message), applied=False, remember=ref.remember)
        except Exception as err:
            log.exception("%s command failed", verb)
            self.outcomes["internal"] += 1
            outcome = Outcome(_refusal("internal", f"{type(err).__name__}: {err}"), applied=False, remember=False)
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
        model (which answers it); False to handle it here; `Refused` ``not_leader`` when nobody owns it now, or
        when it was handed here and this replica no longer owns it (never handed on again: no loops)."""
        model = _model_of(req)
        if self.router is None or model is None:
            return False
        if self.router.owns_model(model):
            return False
        shard = protocol.shard_of(model)
        if handed:
            raise Refused(
                "not_leader",
                f"model {model} (shard {shard}) moved off replica {self.router.identity} while the request was "
                "handed to it: handing over; retry",
                remember=False,
            )
        owner = self.router.owner_of_model(model)
        if owner is None or owner == self.router.identity:
            raise Refused(
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

    # --- audit ---------------------------------------------------------------------------------------------------

    async def _audit(self, verb: str, req: Command | None, data: bytes, outcome: Outcome, now: float) -> None:
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
    if isinstance(req, ScaleCommand | PauseCommand | ResumeCommand | StatusCommand | ScheduleCommand):
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
