"""The registry's local picture: the views of `pulse_slots` and `pulse_agents`, the indexes kept in step with
them, and every lookup a claim or a reader makes (no I/O).

A claim looks only at its model's warm slots, filed by tier and node in a `placement.Pool`, and takes one only
while its agent's lease is fresh and lists it. Slots whose claim by this process is in flight are reserved here:
out of their pool and counted as load on their node until the broker answers. Leases are judged by when this
process heard them, on its own monotonic clock (`warmpool.agentclocks.AgentClocks`, which also measures each
agent's clock skew), and called lapsed only on a current view (`lease_lapsed`). `warmpool.registry.KvSlotStore`
reads through this.

Revision 11: a store that follows `pulse_assignments` offers a node's slots only of the models its assignment
lists (`Assignments`): the agent's user may write any key under its node, the model part included, so the slot
record alone does not say that the node should serve that model.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection

from nats.aio.client import Client
from nats.js.kv import KeyValue

from warmpool import placement, protocol, slots
from warmpool.agentclocks import AgentClocks, Verdict
from warmpool.bucketview import BucketView, Clock
from warmpool.errors import BadMessage
from warmpool.protocol import AgentLease, NodeAssignment, SlotRecord
from warmpool.rejects import Rejections

__all__ = ["Assignments", "SlotIndex"]


class Assignments:
    """Which models each node may offer (revision 11: `pulse_assignments`, which only the operator's user may write;
    an agent may only read it), and the count of the slots that break it.

    A `warm` or `ready` slot of a model its node's assignment does not list is not offered (`SlotIndex.usable`,
    `Claimer.claim_slot`) nor adopted (`Claimer.adopt`), and is counted ``unassigned_model`` once per record (again
    when it changes, not when a re-list brings it back unchanged). A node with no assignment is unbound, offering
    what its agent writes as before revision 11, unless `require`: then it offers nothing. Without a `view` (a
    store that does not follow the bucket: the agents, the tools) every node is unbound."""

    JUDGED_STATES: tuple[protocol.SlotState, ...] = ("warm", "ready")
    """The states that offer a slot: `warm` to a claim, `ready` to adoption (and to the gateways, which route on the
    record and judge it by the same assignments: `gateway.routes`)."""

    def __init__(self, view: BucketView[NodeAssignment] | None, rejected: Rejections, *, require: bool = False) -> None:
        self.view = view
        self.rejected = rejected
        self.require = require
        """A node without an assignment offers nothing (``pulsescale autoscaler --require-assignment``)."""
        self._counted: dict[str, SlotRecord] = {}  # key -> the refused record that was counted
        self._by_node: dict[str, set[str]] = {}  # node -> its slot keys, judged again when its assignment changes

    def allows(self, model: str, node: str) -> bool:
        """Whether `node` may offer slots of `model`."""
        assignment = self.view.value(node) if self.view is not None else None
        if assignment is None:
            return not self.require
        return model in assignment.models

    def judge(self, key: str, rec: SlotRecord | None, node: str) -> None:
        """The slot under `key` of `node` is now `rec` (None: gone): count it if its node may not offer it."""
        if self.view is None and not self.require:
            return  # every node unbound: nothing to count, nothing to remember
        if rec is None:
            self._counted.pop(key, None)
            keys = self._by_node.get(node)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._by_node[node]
            return
        self._by_node.setdefault(node, set()).add(key)
        if self.view is not None and not self.view.ready.is_set():
            return  # not listed yet: every node would look unassigned (`judge_all` follows the listing)
        if rec.state not in self.JUDGED_STATES or self.allows(rec.model, node):
            self._counted.pop(key, None)
            return
        if self._counted.get(key) == rec:
            return  # counted already (a re-list brought it back unchanged)
        self._counted[key] = rec
        assignment = self.view.value(node) if self.view is not None else None
        lists = f"lists {', '.join(assignment.models) or 'no model'}" if assignment else "has no record of it"
        self.rejected(
            BadMessage(
                "unassigned_model",
                f"slot {key} is {rec.state}, but model {rec.model} is not assigned to node {node} "
                f"({protocol.ASSIGNMENTS_BUCKET} {lists}): not offered; if that node should serve it, "
                f"`pulsescale assign {node} {rec.model}` with the operator's NATS user",
            ),
            source=f"{protocol.SLOTS_BUCKET}/{key}",
        )

    def judge_node(self, node: str, record: Callable[[str], SlotRecord | None]) -> None:
        """The assignment of `node` changed: judge its slots again (`record` reads one from the view)."""
        for key in list(self._by_node.get(node, ())):
            self.judge(key, record(key), node)

    def judge_all(self, record: Callable[[str], SlotRecord | None]) -> None:
        """The assignments are listed: judge every slot seen before (a node without a record included)."""
        for node in list(self._by_node):
            self.judge_node(node, record)


class SlotIndex:
    """The views of both buckets (`slots`, `agents`) and the indexes a claim picks from; reading, no I/O:
    `record`, `entry`, `records`, `lease`, `leases`, `nodes`, `claimable`, `lease_lapsed`, `lease_verdict`,
    `clock_skew`."""

    def __init__(
        self,
        nc: Client,
        slots_kv: KeyValue,
        agents_kv: KeyValue,
        rejected: Rejections,
        *,
        clock: Clock = time.time,
        monotonic: Clock = time.monotonic,
        assignments_kv: KeyValue | None = None,
        require_assignment: bool = False,
    ) -> None:
        """`assignments_kv`: follow `pulse_assignments` (`Assignments`); `require_assignment`: a node without one
        offers nothing."""
        self.clock = clock
        self.monotonic = monotonic
        self.slots: BucketView[SlotRecord] = BucketView(nc, slots_kv, SlotRecord, rejected, clock=monotonic)
        self.agents: BucketView[AgentLease] = BucketView(nc, agents_kv, AgentLease, rejected, clock=monotonic)
        self.clocks = AgentClocks(rejected, clock=clock, monotonic=monotonic)
        """When each agent's lease was heard, and each agent's clock skew (contract revision 10)."""
        # Indexes kept in step with the view, so a claim looks only at the model's warm and held slots.
        self._by_model: dict[str, set[str]] = {}
        self._warm: dict[str, dict[int, dict[str, set[str]]]] = {}  # model -> tier -> node -> keys
        self._offered: dict[str, frozenset[str]] = {}  # node -> slot names its lease lists
        self.pools: dict[str, placement.Pool] = {}  # model -> its warm slots filed for `placement.Pool.pick`
        self._parked_in: dict[str, set[str]] = {}  # node -> models whose pool parked it (refiled on a lease change)
        self.reserved: dict[str, SlotRecord] = {}
        """Slots whose claim by this store is in flight (key -> the record the claim was built on): out of their
        pool and counted as load on their node until the broker answers, so a concurrent local claimer neither
        tries the same slot (a certain lost race: two round trips) nor piles onto the same node."""
        self.unreachable: dict[str, AgentLease | None] = {}
        """Node -> the lease in the view when its agent was found not subscribed to its verbs (NATS no responders:
        dead, or not connected). Its slots are not offered until a newer heartbeat is heard (`_index_lease`):
        a dead agent's lease stays fresh for up to `lease_s`, and every claim of its slots meanwhile fails."""
        self.assigned: BucketView[NodeAssignment] | None = None
        """The view of `pulse_assignments`, when this store follows it."""
        if assignments_kv is not None:
            self.assigned = BucketView(nc, assignments_kv, NodeAssignment, rejected, clock=monotonic)
            self.assigned._on_change = self._index_assignment
        self.assignments = Assignments(self.assigned, rejected, require=require_assignment)
        """Which models each node may offer (revision 11)."""
        self.slots._on_change = self._index
        self.agents._on_change = self._index_lease
        self.agents._on_arrival = self.clocks.heard

    def _index(self, key: str, old: SlotRecord | None, new: SlotRecord | None) -> None:
        node = new.node if new is not None else old.node if old is not None else None
        if node is not None:
            self.assignments.judge(key, new, node)
        for rec, delta in ((old, -1), (new, 1)):
            if rec is None:
                continue
            m = rec.model
            if delta > 0:
                self._by_model.setdefault(m, set()).add(key)
            else:
                self._by_model[m].discard(key)
            if rec.state == "warm" and not rec.drain:
                t = placement.tier(rec)
                keys = self._warm.setdefault(m, {}).setdefault(t, {}).setdefault(rec.node, set())
                if delta > 0:
                    keys.add(key)
                    if key not in self.reserved:  # filed again when its claim is answered (`unreserve`)
                        self._pool(m).add_warm(key, t, rec.node, rec.rack)
                else:
                    keys.discard(key)
                    self._pool(m).remove_warm(key, t, rec.node)
            elif rec.state in slots.HELD_STATES:
                self._pool(m).held(rec.node, rec.rack, delta)

    def _pool(self, model: str) -> placement.Pool:
        pool = self.pools.get(model)
        if pool is None:

            def parked(node: str, model: str = model) -> None:
                self._parked_in.setdefault(node, set()).add(model)

            pool = self.pools[model] = placement.Pool(on_park=parked)
        return pool

    def reserve(self, key: str, rec: SlotRecord) -> None:
        """A claim of `key` (warm in the view as `rec`) is about to be sent: take it out of its pool and count it
        as load on its node, as a claim that already landed would be."""
        pool = self._pool(rec.model)
        pool.remove_warm(key, placement.tier(rec), rec.node)
        pool.held(rec.node, rec.rack, 1)
        self.reserved[key] = rec

    def unreserve(self, key: str) -> None:
        """The claim of `key` is answered (either way): undo `reserve`, then file the slot as the view has it now
        (still warm when the claim was lost to a write we have not seen; the caller applies a won claim at once)."""
        rec = self.reserved.pop(key)
        pool = self._pool(rec.model)
        pool.held(rec.node, rec.rack, -1)
        cur = self.slots.value(key)
        if cur is not None and cur.state == "warm" and not cur.drain:
            pool.add_warm(key, placement.tier(cur), cur.node, cur.rack)

    def _index_lease(self, node: str, _old: AgentLease | None, new: AgentLease | None) -> None:
        self.clocks.listed(node, new)
        if node in self.unreachable and new is not None and new != self.unreachable[node]:
            del self.unreachable[node]  # renewed since: its agent is back (a re-list of the same lease is not)
        if new is None:
            self._offered.pop(node, None)
        else:
            self._offered[node] = frozenset(new.slots)
        self._unpark(node)

    def _index_assignment(self, node: str, _old: NodeAssignment | None, _new: NodeAssignment | None) -> None:
        self.assignments.judge_node(node, self.slots.value)
        self._unpark(node)  # a model it may offer now is filed again; one it may not is parked at the next pick

    def _unpark(self, node: str) -> None:
        """File `node` again in the pools that parked it: what it may offer changed."""
        for model in self._parked_in.pop(node, ()):
            if (pool := self.pools.get(model)) is not None:
                pool.unpark(node)

    def usable(self, model: str, node: str, keys: Collection[str], now: float) -> list[str]:
        """The keys among `keys` (warm slots of `model` on `node`) that a claim may take at `now`: none unless the
        node's lease is fresh, and only the slots that lease lists (a record alone offers nothing: any key under
        the node can be written by its agent user), and only of a model the node's assignment lets it offer
        (`Assignments`). Costs at most `protocol.MAX_SLOTS_PER_NODE` lookups."""
        if not self.assignments.allows(model, node):
            return []
        lease = self.lease(node)
        if lease is None or node in self.unreachable or self.clocks.judge(node, lease, now) != "fresh":
            return []
        names = self._offered.get(node, frozenset())
        if len(keys) <= len(names):
            # A key is `protocol.slot_key`'s "<model>.<node>.<slot>" (`check_record` holds every record to it).
            start = len(model) + len(node) + 2
            return [k for k in keys if k[start:] in names]
        return [key for name in names if (key := f"{model}.{node}.{name}") in keys]

    # --- reading -----------------------------------------------------------------------------------------------

    def record(self, key: str) -> SlotRecord | None:
        """The slot under `key` in the view, or None."""
        return self.slots.value(key)

    def entry(self, key: str) -> tuple[SlotRecord, int] | None:
        """(record, revision) of the slot under `key` in the view, or None."""
        return self.slots.get(key)

    def unchanged_s(self, key: str) -> float:
        """Seconds this process has seen `key`'s current revision stand, on its monotonic clock (0 when not in the
        view; a record first seen in a listing counts from the listing): a record's age judged without its
        writer's clock, since an agent's ``updated_at`` is on the agent's, which may be off by minutes."""
        heard = self.slots.heard_at(key)
        return 0.0 if heard is None else self.monotonic() - heard

    def records(self, model: str | None = None) -> list[SlotRecord]:
        """Slots in the current view (of one model, or all)."""
        if model is None:
            return self.slots.values()
        return [rec for k in self._by_model.get(model, ()) if (rec := self.slots.value(k)) is not None]

    def models(self) -> list[str]:
        """The models with slots in the view (and any whose last slot left it: their entries stay, empty)."""
        return list(self._by_model)

    def lease(self, node: str) -> AgentLease | None:
        return self.agents.value(node)

    def leases(self) -> dict[str, AgentLease]:
        return {node: lease for node, lease, _ in self.agents.entries()}

    def nodes(self) -> set[str]:
        """Every node that has a lease or a slot in the views."""
        return {r.node for r in self.slots.values()} | set(self.agents.keys())

    def lease_verdict(self, node: str, now: float | None = None) -> Verdict | None:
        """`AgentClocks.judge` of the node's lease at `now` (our wall clock, default the store's; it matters only
        for a lease listed but not heard); None: no lease."""
        lease = self.lease(node)
        if lease is None:
            return None
        return self.clocks.judge(node, lease, self.clock() if now is None else now)

    def lease_fresh(self, node: str, now: float | None = None) -> bool:
        """The node's agent holds a fresh lease: its slots may be offered (`lease_verdict` is ``fresh``, and its
        agent was not found `unreachable` since)."""
        return node not in self.unreachable and self.lease_verdict(node, now) == "fresh"

    def mark_unreachable(self, node: str) -> None:
        """Nobody is subscribed to `node`'s agent verbs (NATS answered no responders): offer none of its slots
        until its agent heartbeats again, and release its slots `failed`, not `warm` (`Claimer.release`)."""
        self.unreachable[node] = self.lease(node)

    def clock_skew(self, node: str) -> float | None:
        """`AgentClocks.skew_s`: the node's clock minus ours, seconds, as its heartbeats show (None: none heard)."""
        return self.clocks.skew_s(node)

    def claimable(self, model: str, now: float | None = None) -> list[SlotRecord]:
        """The model's slots that a claim could take at `now` (default: the store's clock)."""
        now = self.clock() if now is None else now
        out = []
        for by_node in self._warm.get(model, {}).values():
            for node, keys in by_node.items():
                out += [rec for k in self.usable(model, node, keys, now) if (rec := self.record(k)) is not None]
        return out

    def lease_lapsed(self, node: str, now: float) -> bool:
        """True only when we *know* the agent of `node` stopped renewing: its lease is missing or old in a view
        that is current, and the agent had two heartbeat intervals since that view was listed to renew it.

        A stale view (disconnected, or not re-listed since a reconnect) proves nothing: after a broker outage
        longer than a lease, every agent's last heartbeat is old until the agents reconnect and renew.

        An agent that renews with a clock we do not trust (``skewed``), or whose lease we listed but did not yet
        hear renewed (``unheard``), has not stopped: its slots are not offered, but it is not lapsed. Time since
        the listing is on our monotonic clock; `now` (wall) only judges a lease listed but not heard
        (`AgentClocks.judge`)."""
        view = self.agents
        if not view.current() or view.listed_at is None:
            return False
        lease = self.lease(node)
        if lease is None:
            return True  # withdrawn (a clean shutdown), or gone from a current listing
        if self.clocks.judge(node, lease, now) != "lapsed":
            return False
        # Two intervals, not one: the agent reconnects on its own schedule (possibly after us), and its first
        # write after the outage may be a stale buffered heartbeat replayed by its client.
        return self.monotonic() - view.listed_at >= 2 * lease.renew_every_s
