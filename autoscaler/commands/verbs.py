"""The work of the on-call verbs, once a request is decoded, routed to this replica and admitted.

`Verbs.apply` checks a request against the model's ScaledObject (``unknown_model`` listing the known ones,
``out_of_bounds`` saying ``[minReplicaCount, maxReplicaCount]``) or the registry (``unknown_node``), then does what
it asks: ``scale``, ``pause`` and ``resume`` install or clear the model's override through the `ControlPlane`,
``schedule`` adds, deletes or lists the model's on-call schedules (revision 8: `_schedule`),
``drain`` and ``undrain`` mark a node's slots in the registry, ``pool`` lists the registry's slots, and ``status``
is answered by `autoscaler.commands.status.StatusRows`. It returns an `Outcome` or raises `Refused`: the subjects,
the ledger, the leader fence and the audit record are the service's (`autoscaler.commands.service`; these are steps 5
and 6 of its pipeline).
"""

from __future__ import annotations

from collections import Counter

from autoscaler.commands.base import MAX_SCHEDULE_AHEAD_S, CommandSettings, ControlPlane, Outcome, Refused
from autoscaler.commands.status import StatusRows
from autoscaler.decide import schedules
from warmpool import durations, protocol
from warmpool.errors import BadMessage
from warmpool.output import replicas_text
from warmpool.protocol import (
    Command,
    CommandReply,
    DrainCommand,
    DrainReply,
    OnCallSchedule,
    Override,
    OverrideReply,
    PauseCommand,
    PoolCommand,
    PoolReply,
    PoolSlot,
    ResumeCommand,
    ScaleCommand,
    ScaledObjectSpec,
    ScheduleCommand,
    ScheduleReply,
    StatusCommand,
    UndrainCommand,
)
from warmpool.registry import KvSlotStore

__all__ = ["Verbs"]



class Verbs:
    """Checks each verb's request and does its work, on the `ControlPlane` (overrides) and the registry (drains,
    the pool); ``status`` goes to `StatusRows`."""

    def __init__(
        self, control: ControlPlane, store: KvSlotStore, status: StatusRows, *, settings: CommandSettings
    ) -> None:
        self.control = control
        self.store = store
        self.status = status
        self.settings = settings

    async def apply(self, verb: str, req: Command, now: float, *, handed: bool = False) -> Outcome:
        """Check `req` and do what it asks: an `Outcome`, or `Refused` by a check. `handed`: it came on this
        replica's hand-over subject (a ``status`` there gives this replica's own rows only)."""
        if isinstance(req, ScaleCommand):
            spec = self._spec(req.model)
            self._check_bounds(req.model, spec, req.replicas, "scale")
            if req.for_s > self.settings.max_override_s:
                raise Refused(
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
            if req.model is not None:
                self._spec(req.model)
            return await self.status.answer(req, now, handed=handed)
        if isinstance(req, ScheduleCommand):
            return await self._schedule(req, self._spec(req.model), now)
        if isinstance(req, PoolCommand):
            return self._pool(req.model, now)
        if isinstance(req, DrainCommand | UndrainCommand):
            self._check_node(req.node)
            on = isinstance(req, DrainCommand)
            touched = await (self.store.drain(req.node) if on else self.store.undrain(req.node))
            return self._ok(DrainReply(node=req.node, drained=on, touched=sorted(touched)))
        raise BadMessage("bad_value", f"unknown command verb {verb!r}")  # pragma: no cover - COMMAND_TYPES is closed

    @staticmethod
    def _ok(reply: CommandReply) -> Outcome:
        """A mutating command applied: its reply is remembered for a repeat of its id."""
        return Outcome(protocol.encode(reply), applied=True, remember=True)

    def _spec(self, model: str) -> ScaledObjectSpec:
        spec = self.control.spec_for(model)
        if spec is None:
            known = sorted(self.control.models())
            listed = ", ".join(known) if known else "none (no ScaledObject is applied yet: `pulsescale apply -f`)"
            raise Refused("unknown_model", f"no ScaledObject names model {model!r}; known models: {listed}")
        return spec

    def _check_bounds(self, model: str, spec: ScaledObjectSpec, replicas: int, verb: str) -> None:
        cap = self.settings.max_replicas
        if replicas > cap:
            raise Refused(
                "out_of_bounds",
                f"{verb} {model} to {replicas_text(replicas)} is over this autoscaler's limit of "
                f"{replicas_text(cap)} per model; raise it with `pulsescale autoscaler --max-replicas N` "
                f"(or ${protocol.MAX_REPLICAS_ENV})",
            )
        lo, hi = spec.min_replica_count, spec.max_replica_count
        if not lo <= replicas <= hi:
            raise Refused(
                "out_of_bounds",
                f"{verb} {model} to {replicas_text(replicas)} is outside its ScaledObject's "
                f"[minReplicaCount, maxReplicaCount] = [{lo}, {hi}]",
            )

    async def _schedule(self, req: ScheduleCommand, spec: ScaledObjectSpec, now: float) -> Outcome:
        """``schedule``: add one on-call schedule, delete one by name, or list them (with the ScaledObject's).
        Schedules that have ended are dropped from the stored ones whenever they are written."""
        model = req.model
        kept = tuple(o for o in self.control.schedules_for(model) if o.schedule.window()[1] > now)
        if req.add is not None:
            new = req.add
            self._check_schedule(model, spec, new, kept, now)
            kept = (*kept, OnCallSchedule(schedule=new, by=req.by, set_at=now))
        elif req.delete is not None:
            gone = [o for o in kept if o.schedule.name == req.delete]
            if not gone:
                if any(s.name == req.delete for s in spec.schedules):
                    why = "it is the ScaledObject's: edit its spec.schedules"
                else:
                    names = ", ".join(o.schedule.name for o in kept) or "none"
                    why = f"the on-call schedules of {model} not yet ended: {names}"
                raise Refused("unknown_schedule", f"no on-call schedule {req.delete!r} of {model}; {why}")
            kept = tuple(o for o in kept if o.schedule.name != req.delete)
        else:
            rows = schedules.pending_rows(schedules.windows(spec.schedules, kept), now)
            reply = ScheduleReply(model=model, schedules=rows)
            return Outcome(protocol.encode(reply), applied=True, remember=False)
        await self.control.set_schedules(model, kept)
        rows = schedules.pending_rows(schedules.windows(spec.schedules, kept), now)
        added = req.add.name if req.add is not None else None
        return self._ok(ScheduleReply(model=model, schedules=rows, added=added, deleted=req.delete))

    def _check_schedule(
        self,
        model: str,
        spec: ScaledObjectSpec,
        new: protocol.Schedule,
        kept: tuple[OnCallSchedule, ...],
        now: float,
    ) -> None:
        """Refuse a schedule that ends in the past, starts too far ahead, exceeds the bounds, is one too many,
        takes a name, or overlaps another of the model (the ScaledObject's or on-call) with a different floor."""
        start, end = new.window()
        if end <= now:
            raise Refused(
                "out_of_bounds",
                f"schedule {new.name} of {model} would have ended {durations.rfc3339(end)} "
                f"({durations.age(now - end)} ago): check --at, --tz and the year",
            )
        if start > now + MAX_SCHEDULE_AHEAD_S:
            raise Refused(
                "out_of_bounds",
                f"schedule {new.name} of {model} starts {durations.rfc3339(start)}, more than "
                f"{MAX_SCHEDULE_AHEAD_S / 86_400:.0f} days ahead: check the year",
            )
        self._check_bounds_max(model, spec, new.replicas, f"schedule {new.name} of")
        if len(kept) >= protocol.MAX_SCHEDULES:
            raise Refused(
                "out_of_bounds",
                f"{model} has {len(kept)} on-call schedules not yet ended, the most kept; delete one first",
            )
        for other, source in [(s, "its ScaledObject's") for s in spec.schedules] + [
            (o.schedule, "an on-call") for o in kept
        ]:
            if other.name == new.name:
                raise Refused(
                    "conflict",
                    f"{model} already has {source} schedule named {new.name!r}"
                    + ("; delete it first or pick another name" if source == "an on-call" else "; pick another name"),
                )
            problem = protocol.schedule_conflict([other, new])
            if problem is not None:
                raise Refused("conflict", f"{problem} ({other.name} is {source} schedule of {model})")

    def _check_bounds_max(self, model: str, spec: ScaledObjectSpec, replicas: int, what: str) -> None:
        """A floor is at most ``maxReplicaCount`` and the autoscaler's limit (below ``minReplicaCount`` it is
        harmless: the floor is already higher)."""
        cap = min(self.settings.max_replicas, spec.max_replica_count)
        if replicas > cap:
            bound = (
                f"its ScaledObject's maxReplicaCount {spec.max_replica_count}"
                if cap == spec.max_replica_count
                else f"this autoscaler's limit of {replicas_text(cap)} per model"
            )
            raise Refused("out_of_bounds", f"{what} {model}: a floor of {replicas_text(replicas)} exceeds {bound}")

    def _check_node(self, node: str) -> None:
        if self.store.index.lease(node) is not None or any(r.node == node for r in self.store.records()):
            return
        known = sorted({r.node for r in self.store.records()} | set(self.store.index.leases()))
        raise Refused("unknown_node", f"no agent or slot on node {node!r}; known nodes: {', '.join(known) or 'none'}")

    def _pool(self, model: str | None, now: float) -> Outcome:
        records = sorted(self.store.records(model), key=lambda r: r.key)
        if model is not None and not records:
            self._spec(model)  # a model with neither slots nor a ScaledObject is a typo
        slots = []
        counts: dict[str, Counter[str]] = {}
        fresh = {node: self.store.index.lease_fresh(node, now) for node in {r.node for r in records}}
        for r in records:
            skew_s = self.store.index.clock_skew(r.node)
            slots.append(
                PoolSlot(
                    key=r.key,
                    model=r.model,
                    node=r.node,
                    rack=r.rack,
                    state=r.state,
                    drain=r.drain,
                    agent="fresh" if fresh[r.node] else "stale",
                    resident=r.weights_resident,
                    endpoint=r.endpoint,
                    reason=r.reason,
                    engine=r.engine,
                    engine_mode=r.engine_mode,
                    rootfs_mounted=r.rootfs_mounted,
                    image_digest=r.image_digest,
                    skew_s=None if skew_s is None else round(skew_s, 3),
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
        return Outcome(
            data, applied=True, remember=False, audit_reply={"ok": True, "slots": len(slots), "counts": by_model}
        )
