"""Node assignments on Kubernetes: the operator keeps KV `pulse_assignments` (contract revision 11) in step with
where its standby pods are scheduled, so that a node offers only the models whose standby pods run on it (the
security review's M3: an agent's credential may write any model under its node's keys; the assignment, which only
the operator's NATS user may write, is what binds the node to its models).

For each node, the models this operator assigns are those of its *published* ScaledObjects (a record in
`pulse_scalers`, so the model is the namespace's: kube/records.py `ModelOwners`) that have a standby pod on the node
(``spec.nodeName``, not terminating, not finished, the pod's ``pulsescale.io/model`` label the published model).
The pods come from the standby keeper's own listings (kube/standby.py `StandbyKeeper.reconcile`): no extra request
to the API server, no extra permission.

Rules (`node_models`, pure; `AssignmentKeeper`, the loop):

- Writes only while this replica leads (as the standby keeper), each a compare-and-set on the record's KV revision
  (create when absent), read again and retried on a conflict (another operator, a person).
- A record the operator keeps has ``by`` `protocol.NodeAssignment.OPERATOR`. Several operators (the namespaced mode)
  share it: each adds and removes only the models it manages (published by it, owned by a namespace it watches in
  the ConfigMap of model owners, or assigned by it since it started; in the cluster-wide mode also every model of
  an operator-kept record) and keeps the others as they are.
- A record with another ``by`` was written by a person (``pulsescale assign``): it is left alone, said once per
  node and writer; ``pulsescale assign NODE --hand-back`` gives it back (the models stay, then follow the pods).
- A model is added as soon as one of its standby pods is scheduled on the node. It is removed only when no standby
  pod of it is on the node *and* no slot of it there is held (``claimed``, ``activating``, ``ready``,
  ``releasing``, as a current view of `pulse_slots` shows): the autoscaler keeps a slot it holds whose assignment
  vanished, but the gateways stop routing to it at once, and a new autoscaler leader never adopts it (so nothing
  could release it). The operator therefore takes a model off a node only after its slots there are back to warm,
  and not at all while the slot view is stale or in the first `SETTLE_S` after it started leading (the standby
  keeper has not listed every object yet). A claim that lands just as the model is taken off (the autoscaler
  claimed a warm slot between the operator's read and its write) is repaired: within `RACE_S` of the removal, a
  held slot of the model on that node puts the model back.
- Nothing is written for a node that has no record and gets no model; a record the operator keeps whose last model
  goes stays, with no model (the node offers nothing), rather than being deleted (which would unbind the node).

``pulsescale operator --no-assignments`` turns all of this off (nodes are assigned by hand, or not at all).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import nats.errors
import nats.js.errors
from nats.js.kv import KeyValue

from kube import aio, standby
from kube.context import OperatorContext
from kube.operator import BACKGROUND
from kube.records import HELD_SLOT_STATES, ModelOwnersUnavailable
from warmpool import protocol
from warmpool.errors import BadMessage

__all__ = ["CAS_TRIES", "EVERY_S", "RACE_S", "SETTLE_S", "AssignmentKeeper", "node_models", "register"]

log = logging.getLogger("pulsescale.operator.assignments")

EVERY_S: Final = 5.0
"""A full pass at least this often (standby pod listings wake it sooner)."""
SETTLE_S: Final = 2 * standby.RESYNC_S
"""After it starts leading, the keeper removes nothing for this long: every ScaledObject is listed by the standby
keeper within one resync, so a model not seen by then has no standby pod (adding starts at once)."""
RACE_S: Final = 30.0
"""How long after taking a model off a node a held slot of it there puts it back (a claim that raced the removal)."""
CAS_TRIES: Final = 5
"""Compare-and-set rounds for one node before giving up until the next pass (each loss is another writer's win)."""

Key = tuple[str, str]  # (namespace, ScaledObject name)


def node_models(
    current: Iterable[str] | None,
    desired: set[str],
    ours: set[str],
    held: set[str],
    *,
    may_remove: bool,
) -> list[str] | None:
    """The models a node's operator-kept record should list; None: write nothing.

    `current`: the record's models (None: no record); `desired`: the models of this operator's standby pods on the
    node; `ours`: every model this operator manages (it removes only those); `held`: models with a held slot on the
    node (never removed); `may_remove`: removals allowed now (the views are complete and current)."""
    cur = set(current or ())
    new = cur | desired
    if may_remove:
        new -= {m for m in cur & ours if m not in desired and m not in held}
    if current is None:
        return sorted(new) if new else None
    return None if new == cur else sorted(new)


@dataclass
class AssignmentKeeper:
    """Keeps `pulse_assignments` from the standby pods' nodes (see the module docstring); one loop (`run_until`)."""

    ctx: OperatorContext
    kv: KeyValue
    every_s: float = EVERY_S
    settle_s: float = SETTLE_S
    listed: dict[Key, dict[str, set[str]]] = field(default_factory=dict)
    """ScaledObject -> model (the pods' label) -> the nodes its standby pods are scheduled on, as last listed."""
    assigned_here: set[str] = field(default_factory=set)
    """Models this process has assigned to some node: still managed (removed) after their ScaledObject went."""
    removed_at: dict[tuple[str, str], float] = field(default_factory=dict)
    """(node, model) -> when this process took the model off the node (monotonic), for the raced-claim repair."""
    writes: int = 0
    _said: set[tuple[str, str]] = field(default_factory=set)
    _wake: asyncio.Event = field(default_factory=asyncio.Event)
    _started: float | None = None
    monotonic: Callable[[], float] = time.monotonic

    @property
    def leading(self) -> Callable[[], bool]:
        fn = self.ctx.extra.get("leading")
        return fn if callable(fn) else (lambda: True)

    # --- inputs (the standby keeper) ---------------------------------------------------------------------------

    def observe(self, key: Key, pods: Iterable[Mapping[str, Any]]) -> None:
        """The standby pods of ScaledObject `key`, just listed."""
        nodes: dict[str, set[str]] = {}
        for pod in pods:
            node = (pod.get("spec") or {}).get("nodeName")
            model = ((pod.get("metadata") or {}).get("labels") or {}).get(standby.MODEL_LABEL)
            if not node or not model or standby.gone(pod):
                continue
            if not protocol.is_name(node):
                self._say_once(node, "bad-name", "node %s cannot be assigned: a node name in pulse_assignments "
                               "matches %s (no dots); its agent's --node cannot be it either", node,
                               protocol.NAME_PATTERN)  # fmt: skip
                continue
            nodes.setdefault(str(model), set()).add(str(node))
        if self.listed.get(key) != nodes:
            self.listed[key] = nodes
            self._wake.set()

    def forget(self, key: Key) -> None:
        """ScaledObject `key` is gone (its pods with it)."""
        if self.listed.pop(key, None) is not None:
            self._wake.set()

    # --- what to assign ----------------------------------------------------------------------------------------

    def published(self) -> dict[Key, str]:
        """ScaledObject -> the model of its record in `pulse_scalers` (this operator's)."""
        so = self.ctx.extra.get("scaledobjects")
        known = getattr(so, "known", None)
        if not isinstance(known, dict):
            return {}
        out: dict[Key, str] = {}
        for key, k in known.items():
            model = getattr(k, "model", None)
            ns, _, name = str(key).partition(".")
            if model is not None:
                out[(ns, name)] = model
        return out

    def desired(self, published: Mapping[Key, str]) -> dict[str, set[str]]:
        """Node -> the published models with a standby pod scheduled there."""
        out: dict[str, set[str]] = {}
        for key, model in published.items():
            for node in self.listed.get(key, {}).get(model, ()):
                out.setdefault(node, set()).add(model)
        return out

    async def ours(self, published: Mapping[Key, str], records: Iterable[protocol.NodeAssignment]) -> set[str]:
        """The models this operator manages (may remove): see the module docstring."""
        models = set(published.values()) | self.assigned_here
        so = self.ctx.extra.get("scaledobjects")
        owners = getattr(so, "owners", None)
        if owners is not None:
            try:
                models |= {m for m, ns in (await owners.read()).items() if self.ctx.watches(ns)}
            except ModelOwnersUnavailable:
                pass  # unreadable: those models are not removed this pass
        if self.ctx.clusterwide:
            models |= {m for r in records if r.by == protocol.NodeAssignment.OPERATOR for m in r.models}
        return models

    def held(self) -> dict[str, set[str]] | None:
        """Node -> models with a held slot there; None while the slot view is not current (nothing removed)."""
        keeper = self.ctx.extra.get("standby")
        view = getattr(keeper, "view", None)
        if view is None or not view.current():
            return None
        out: dict[str, set[str]] = {}
        for rec in view.values():
            if rec.state in HELD_SLOT_STATES:
                out.setdefault(rec.node, set()).add(rec.model)
        return out

    # --- the loop ----------------------------------------------------------------------------------------------

    async def run_until(self, stop: asyncio.Event) -> None:
        """Passes from when this replica starts leading (kopf runs only then) until `stop`."""
        self._started = self.monotonic()
        while not stop.is_set():
            self._wake.clear()
            if self.leading():
                try:
                    await self.sync()
                except (nats.errors.Error, TimeoutError) as err:
                    log.warning("%s: %s; trying again", protocol.ASSIGNMENTS_BUCKET, err or type(err).__name__)
                except Exception:  # noqa: BLE001 - logged with its traceback by count_failure; the next pass tries again
                    self.ctx.count_failure("assignments", protocol.ASSIGNMENTS_BUCKET)
            await aio.wait_event(self._wake, self.every_s)
            if stop.is_set():
                break
            await aio.wait_event(stop, 0.05)  # gather a burst of listings into one pass

    async def _records(self) -> dict[str, tuple[protocol.NodeAssignment | None, int | None]]:
        """Node -> (its record or None when unreadable, revision): every key of the bucket."""
        try:
            keys = await self.kv.keys()
        except nats.js.errors.NoKeysError:
            return {}
        out: dict[str, tuple[protocol.NodeAssignment | None, int | None]] = {}
        for node in keys:
            out[node] = await self._read(node)
        return out

    async def _read(self, node: str) -> tuple[protocol.NodeAssignment | None, int | None]:
        """(record, revision) of `node`; (None, None) when absent or deleted; (None, revision) when unreadable."""
        try:
            entry = await self.kv.get(node)
        except nats.js.errors.KeyNotFoundError:  # KeyDeletedError too
            return None, None
        if not entry.value:
            return None, None
        try:
            return protocol.decode(entry.value, protocol.NodeAssignment), entry.revision
        except BadMessage:
            return None, entry.revision

    async def sync(self) -> None:
        """One pass over every node that has a record or a standby pod of ours."""
        now = self.monotonic()
        published = self.published()
        desired = self.desired(published)
        records = await self._records()
        ours = await self.ours(published, (r for r, _ in records.values() if r is not None))
        held = self.held()
        settled = self._started is not None and now - self._started >= self.settle_s
        may_remove = settled and held is not None
        for (node, model), at in list(self.removed_at.items()):
            if now - at > RACE_S:
                del self.removed_at[(node, model)]
            elif held is not None and model in held.get(node, ()):
                log.warning("a slot of model %s on node %s was claimed as the operator took %s off it: assigned "
                            "again, so that its holder keeps it", model, node, model)  # fmt: skip
                desired.setdefault(node, set()).add(model)
                del self.removed_at[(node, model)]
        for node in sorted(set(records) | set(desired)):
            if not self.leading():
                return
            await self._sync_node(node, desired.get(node, set()), ours, (held or {}).get(node, set()), may_remove)

    async def _sync_node(self, node: str, desired: set[str], ours: set[str], held: set[str], may_remove: bool) -> None:
        for _ in range(CAS_TRIES):
            record, revision = await self._read(node)
            if revision is not None and record is None:
                self._say_once(node, "unreadable", "node %s: its record in %s does not read; left as it is "
                               "(`pulsescale assign %s MODEL...` writes a good one)", node,
                               protocol.ASSIGNMENTS_BUCKET, node)  # fmt: skip
                return
            if record is not None and record.by != protocol.NodeAssignment.OPERATOR:
                if desired - set(record.models) or (may_remove and set(record.models) & ours - desired - held):
                    self._say_once(
                        node, f"manual:{record.by}",
                        "node %s was assigned by hand (%s: %s); the operator leaves it as it is, a manual "
                        "assignment overriding the standby pods' (%s); `pulsescale assign %s --hand-back` gives it "
                        "back", node, record.by or "no name", ", ".join(record.models) or "no model",
                        ", ".join(sorted(desired)) or "none", node,
                    )  # fmt: skip
                return
            models = node_models(None if record is None else record.models, desired, ours, held,
                                 may_remove=may_remove)  # fmt: skip
            if models is None:
                return
            value = protocol.encode(protocol.NodeAssignment(
                node=node, models=models, by=protocol.NodeAssignment.OPERATOR, updated_at=self.ctx.clock()
            ))  # fmt: skip
            if not self.leading():
                return
            try:
                if revision is None:
                    await self.kv.create(node, value)
                else:
                    await self.kv.update(node, value, last=revision)
            except nats.js.errors.KeyWrongLastSequenceError:
                continue  # written meanwhile: read again
            before = set(() if record is None else record.models)
            added, removed = set(models) - before, before - set(models)
            self.writes += 1
            self.assigned_here |= added
            now = self.monotonic()
            for model in removed:
                self.removed_at[(node, model)] = now
            log.info("node %s may offer %s%s%s", node, ", ".join(models) or "no model",
                     f" (added {', '.join(sorted(added))})" if added else "",
                     f" (removed {', '.join(sorted(removed))})" if removed else "")  # fmt: skip
            return
        log.warning("node %s: %s changed under each of %d tries; the next pass tries again", node,
                    protocol.ASSIGNMENTS_BUCKET, CAS_TRIES)  # fmt: skip

    def _say_once(self, node: str, what: str, fmt: str, *args: Any) -> None:
        if (node, what) in self._said:
            return
        self._said.add((node, what))
        log.warning(fmt, *args)


def register(registry: Any, ctx: OperatorContext) -> None:
    """Feeds an `AssignmentKeeper` from the standby keeper's listings and runs its loop beside kopf (only while
    leading), unless ``ctx.assignments`` is None (``--no-assignments``, or no bucket). Kept in
    ``ctx.extra["assignments"]``."""
    del registry  # no kopf handler of its own: the standby keeper's listings are its input
    keeper = ctx.extra.get("standby")
    if ctx.assignments is None or not isinstance(keeper, standby.StandbyKeeper):
        return
    assigner = AssignmentKeeper(ctx, ctx.assignments, settle_s=ctx.assignments_settle_s)
    ctx.extra["assignments"] = assigner
    keeper.listeners.append(assigner)
    ctx.extra.setdefault(BACKGROUND, []).append(assigner.run_until)
