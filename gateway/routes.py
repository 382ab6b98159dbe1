"""Ready endpoints per model, learned from `pulse_slots` (read only: the gateway role may not write it).

A slot is routable while its record says ``ready`` with an endpoint; the moment a change says anything else (or the
key is deleted) it is dropped. A snapshot (the first listing, and every re-list after a reconnect) replaces the whole
table, so a slot that left while the gateway was disconnected is dropped too. `ready_endpoints` is the pure part.

The endpoint is what the slot's agent wrote in its fenced ``ready`` write; only ``http``/``https`` URLs with a host
and no credentials, path or query are routed (an agent's typo must not point the gateway somewhere odd), others are
counted in `refused` and skipped.

Revision 11: a node's agent may write any model under its node's keys, endpoint included, so a ``ready`` record alone
does not say that the node should serve that model. `NodeModels` follows `pulse_assignments` (read only) and a slot
is routed only when its node's assignment lists its model, the rule the autoscaler claims by
(`warmpool.slotindex.Assignments`); a node without one is routed unless `require_assignment`. Each ready record
refused so is counted once (``unassigned_model``, in `rejected`). Nothing is routed before the assignments are read,
or known absent (no bucket: an autoscaler from before revision 11); a NATS user that may not read them routes
nothing, and says so with the fix. A ``claim_id`` in the record proves nothing: the agent writes the ready record
itself, and may copy any claim id it reads in `pulse_slots`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import Literal
from urllib.parse import urlsplit

import nats.js.errors
from nats.aio.client import Client

from warmpool import buckets, protocol
from warmpool.errors import BadMessage
from warmpool.protocol import NodeAssignment, SlotRecord
from warmpool.registry import BucketView, Changed, Removed, Snapshot
from warmpool.rejects import Rejections
from warmpool.slotindex import Assignments

__all__ = ["AssignmentsState", "NodeModels", "Routes", "endpoint_ok", "ready_endpoints"]

log = logging.getLogger("pulsescale.gateway")

Table = dict[str, dict[str, str]]
"""model -> slot key -> endpoint URL."""


def endpoint_ok(url: str) -> bool:
    """An endpoint the gateway routes to: ``http(s)://host[:port]`` and nothing else."""
    try:
        parts = urlsplit(url)
        _ = parts.port  # raises on a bad port
    except ValueError:
        return False
    return (
        parts.scheme in ("http", "https")
        and bool(parts.hostname)
        and parts.username is None
        and parts.password is None
        and parts.path in ("", "/")
        and not parts.query
        and not parts.fragment
    )


def ready_endpoints(
    records: Iterable[SlotRecord],
    models: frozenset[str] | None,
    routable: Callable[[SlotRecord], bool] = lambda _: True,
) -> Table:
    """The routing table of `records`: ready slots with a good endpoint, of `models` (None: every model), that
    `routable` lets through (`NodeModels.routable`)."""
    table: Table = {}
    for r in records:
        if r.state != "ready" or not r.endpoint or not endpoint_ok(r.endpoint):
            continue
        if (models is None or r.model in models) and routable(r):
            table.setdefault(r.model, {})[r.key] = r.endpoint.rstrip("/")
    return table


AssignmentsState = Literal["listing", "listed", "absent", "unreadable"]
"""How far `pulse_assignments` has been read: ``listing`` (not yet), ``listed`` (followed), ``absent`` (no bucket:
every node unbound), ``unreadable`` (no answer: a NATS user without KV reads of it is refused silently, or
JetStream is down)."""


class _ReadyAssignments(Assignments):
    """The autoscaler's rule and count, judging `ready` slots only: a gateway routes nothing else, and a `warm` slot
    of an unassigned model is the autoscaler's to refuse (and count)."""

    JUDGED_STATES: tuple[protocol.SlotState, ...] = ("ready",)


class NodeModels:
    """Which node may be routed to for which model: `pulse_assignments` (module doc), followed with the registry's
    `BucketView`; `on_change()` after each change of it. `routable` is False for every slot until `known`."""

    def __init__(
        self,
        nc: Client,
        rejected: Rejections,
        *,
        require: bool = False,
        on_change: Callable[[], None] = lambda: None,
        retry_s: float = 2.0,
        open_timeout_s: float = 2.0,
    ) -> None:
        self._nc = nc
        self._rejected = rejected
        self._on_change = on_change
        self._retry_s = retry_s
        self._open_timeout_s = open_timeout_s
        self.rule = _ReadyAssignments(None, rejected, require=require)
        """Gets the view once it is listed: until then (no bucket) every node is unbound, unless `require`."""
        self.state: AssignmentsState = "listing"
        self.known = asyncio.Event()
        """Set once the assignments are listed or known absent; stays set (a later failure keeps what was read)."""

    def routable(self, rec: SlotRecord) -> bool:
        return self.known.is_set() and self.rule.allows(rec.model, rec.node)

    def judge(self, key: str, rec: SlotRecord | None, node: str) -> None:
        """The slot `key` of `node` is now `rec` (None: gone): counted once if it is ready and may not be routed."""
        if self.known.is_set():
            self.rule.judge(key, rec, node)

    def judge_all(self, records: dict[str, SlotRecord]) -> None:
        """`records` are every slot now (a listing, or the assignments changed): judge each, forget the others."""
        for key, rec in records.items():
            self.judge(key, rec, rec.node)
        if self.known.is_set():
            self.rule.judge_all(records.get)

    def _state(self, state: AssignmentsState, why: str = "") -> None:
        """Move to `state`; into ``absent`` or ``listed`` the rule changed: `known`, and `on_change()`."""
        if state == self.state:
            return
        if state == "unreadable" and not self.known.is_set():
            log.warning(
                "cannot read %s (%s): no slot is routed until it is read; give this gateway's NATS user KV reads of "
                "%s (the gateway role has them since contract revision 11: render the authorization again)",
                protocol.ASSIGNMENTS_BUCKET,
                why,
                protocol.ASSIGNMENTS_BUCKET,
            )
        elif state == "unreadable":
            log.info("cannot look for %s again (%s): nothing changes meanwhile", protocol.ASSIGNMENTS_BUCKET, why)
        elif state == "absent":
            unbound = "no node is routed (--require-assignment)" if self.rule.require else "every node is unbound"
            log.info("bucket %s does not exist (yet): %s", protocol.ASSIGNMENTS_BUCKET, unbound)
        self.state = state
        if state in ("absent", "listed"):
            self.known.set()
            self._on_change()

    async def run(self, stop: asyncio.Event) -> None:
        def on_event(view: BucketView[NodeAssignment], _: object) -> None:
            # From the first listing on its records decide (until then, a bucket that just appeared keeps the
            # rule of an absent one).
            self.rule.view = view
            if self.state == "listed":
                self._on_change()
            else:
                self._state("listed")

        await buckets.follow_view(
            self._nc, protocol.ASSIGNMENTS_BUCKET, NodeAssignment, self._rejected, stop,
            on_state=self._state, on_event=on_event, name="gateway-assignments-view",
            retry_s=self._retry_s, open_timeout_s=self._open_timeout_s,
        )  # fmt: skip


class Routes:
    """Follows `pulse_slots` and calls `on_ready(model, key, url)` / `on_gone(model, key)` as slots come and go,
    judged by `pulse_assignments` (`assigned`; `require_assignment`: a node without an assignment is not routed)."""

    def __init__(
        self,
        nc: Client,
        models: frozenset[str] | None,
        *,
        on_ready: Callable[[str, str, str], None],
        on_gone: Callable[[str, str], None],
        rejected: Rejections,
        require_assignment: bool = False,
    ) -> None:
        self._nc = nc
        self.models = models
        self._on_ready, self._on_gone = on_ready, on_gone
        self._rejected = rejected
        self.table: Table = {}
        self.view: BucketView[SlotRecord] | None = None
        self.listed = asyncio.Event()
        """Set once the first snapshot is in, judged by the assignments: before it, the gateway knows no endpoint."""
        self.assigned = NodeModels(nc, rejected, require=require_assignment, on_change=self.rejudge)
        """`pulse_assignments`: a ready slot is routed only if its node may offer its model (module doc)."""

    async def open(self, stop: asyncio.Event, retry_s: float = 0.5) -> None:
        """Open the bucket, waiting while it does not exist yet (the autoscaler creates it; this role may not)."""
        said = False
        while not stop.is_set():
            try:
                kv = await self._nc.jetstream(timeout=2.0).key_value(protocol.SLOTS_BUCKET)
            except nats.js.errors.BucketNotFoundError:
                if not said:
                    log.info("waiting for bucket %s (the autoscaler creates it)", protocol.SLOTS_BUCKET)
                    said = True
                await asyncio.sleep(retry_s)
                continue
            self.view = BucketView(self._nc, kv, SlotRecord, self._rejected)
            return

    async def run(self, stop: asyncio.Event) -> None:
        await asyncio.gather(self.assigned.run(stop), self._follow(stop))

    async def _follow(self, stop: asyncio.Event) -> None:
        await self.open(stop)
        view = self.view
        if view is None:
            return
        watch = asyncio.create_task(view.run(), name="gateway-slots-view")
        try:
            await self.assigned.known.wait()  # no slot is routed before the assignments are read
            async for event in view.changes():
                self._apply(event)
                if stop.is_set():
                    break
        finally:
            view.closed = True
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)

    def rejudge(self) -> None:
        """The assignments changed: route every slot by them again (an operator's edit: rare)."""
        if self.view is not None and self.listed.is_set():
            self._replace({key: rec for key, rec, _ in self.view.entries()})

    def _replace(self, records: dict[str, SlotRecord]) -> None:
        """Route `records`, every slot there is now, and no other."""
        mine = {k: r for k, r in records.items() if self.models is None or r.model in self.models}
        self.assigned.judge_all(mine)
        new = ready_endpoints(mine.values(), None, self.assigned.routable)
        for model, slots in self.table.items():
            for key in slots.keys() - new.get(model, {}).keys():
                self._on_gone(model, key)
        for model, slots in new.items():
            for key, url in slots.items():
                if self.table.get(model, {}).get(key) != url:
                    self._on_ready(model, key, url)
        self.table = new

    def _apply(self, event: Snapshot[SlotRecord] | Changed[SlotRecord] | Removed) -> None:
        if isinstance(event, Snapshot):
            self._replace(event.records)
            self.listed.set()
            return
        try:
            model, node, _ = protocol.parse_slot_key(event.key)
        except BadMessage:
            return  # the view already refused such a record
        if self.models is not None and model not in self.models:
            return
        rec = event.record if isinstance(event, Changed) else None
        self.assigned.judge(event.key, rec, node)
        if rec is not None and rec.state == "ready" and rec.endpoint and self.assigned.routable(rec):
            url = rec.endpoint
            if not endpoint_ok(url):
                log.warning("slot %s: endpoint %r is not http(s)://host[:port]; not routed", event.key, url)
            else:
                url = url.rstrip("/")
                if self.table.get(model, {}).get(event.key) != url:
                    self.table.setdefault(model, {})[event.key] = url
                    self._on_ready(model, event.key, url)
                return
        if self.table.get(model, {}).pop(event.key, None) is not None:
            self._on_gone(model, event.key)
