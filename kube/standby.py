"""Standby pods: per ScaledObject, `spec.warmPool.size` pods made from the target's pod template, and the serving
label that moves one into service when its slot turns ``ready``.

A warm slot on Kubernetes is a standby pod (DESIGN.md, "On Kubernetes"): created here from the scale target's pod
template (``GET`` the Deployment/StatefulSet named by ``scaleTargetRef`` -> ``spec.template``), scheduled by
Kubernetes onto a node, with

- labels ``pulsescale.io/scaledobject=<name>``, ``pulsescale.io/model=<model>``, ``pulsescale.io/standby=true``,
  ``pulsescale.io/serving=false`` and ``pulsescale.io/template-hash=<hash of the template>`` (the template's own
  labels kept, so the pod is what the workload's pods are);
- a controller owner reference to the ScaledObject, so the garbage collector removes them with it (and the
  workload's ReplicaSet never adopts them: a pod with a controller is not an orphan).

Upkeep (`plan`, pure): pods that failed or finished are deleted and replaced; non-serving pods of an older template
hash are replaced; extras beyond the size are deleted, newest and least useful first (unscheduled, then not
running) — never a serving one: a serving pod carries traffic and goes back to the pool (or away) when its slot is
released. Serving pods count toward the size: the pool is the slots, busy or not.

Scheduled warm-ups (protocol revision 8, `pool_size`): while a schedule is in force, or starts within
`autoscaler.decide.schedules.POOL_LEAD_S`, the pool is at least the schedule's floor, so the floor is reached from warm
slots at its start. The ScaledObject's own ``spec.schedules`` are read from its body (the autoscaler need not
answer); on-call ones (``pulsescale schedule``, kept in NATS) come through the autoscaler's status row
(`StatusRow.pool_floor`, refreshed every status round).

Serving flip (`serving_changes`, pure), from the `pulse_slots` bucket (read through a `BucketView`): when a slot
of the model is ``ready``, one standby pod on the slot's node (``spec.nodeName``) is labelled
``pulsescale.io/serving=true`` and annotated ``pulsescale.io/slot=<slot key>``; when the slot leaves ``ready``
(released, failed, gone) the pod goes back to ``serving=false`` and the annotation is removed. The Service of the
workload selects ``serving=true``. Flips are made only while the slot view is current (listed since the last NATS
reconnect): a stale view never takes a pod out of service.

Everything runs in one loop per operator (`StandbyKeeper.run`, beside kopf while it runs), woken by kopf's
watch events on ScaledObjects and standby pods and by slot changes, plus a resync every `RESYNC_S`; one loop means
no two reconciles of the same object race in this process. Writes are made only while this replica leads
(``ctx.extra["leading"]``, set by `pulsescale operator` from the Lease).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hashlib
import json
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

import kopf
import msgspec

from autoscaler.decide import schedules
from kube import aio, apicall, operator
from kube.context import OperatorContext
from manifests.crdtypes import GROUP, PLURAL, VERSION
from warmpool import protocol
from warmpool.protocol import SlotRecord
from warmpool.registry import BucketView, Changed, Removed, Snapshot
from warmpool.rejects import Rejections

__all__ = [
    "MODEL_LABEL",
    "SCALEDOBJECT_LABEL",
    "SERVING_LABEL",
    "SLOT_ANNOTATION",
    "STANDBY_LABEL",
    "TEMPLATE_HASH_LABEL",
    "Plan",
    "PodListener",
    "StandbyKeeper",
    "gone",
    "plan",
    "pool_size",
    "register",
    "serving_changes",
    "standby_pod",
    "template_hash",
]

log = logging.getLogger("pulsescale.operator.standby")

SCALEDOBJECT_LABEL: Final = "pulsescale.io/scaledobject"
MODEL_LABEL: Final = "pulsescale.io/model"
STANDBY_LABEL: Final = "pulsescale.io/standby"
SERVING_LABEL: Final = "pulsescale.io/serving"
TEMPLATE_HASH_LABEL: Final = "pulsescale.io/template-hash"
SLOT_ANNOTATION: Final = "pulsescale.io/slot"

RESYNC_S: Final = 10.0
"""Every ScaledObject is reconciled at least this often, events or not: a missed watch event costs this much."""
ERROR_BACKOFF_S: Final = 2.0
"""After a failed reconcile (API server unreachable), try that object again this much later."""
TARGET_KINDS: Final = {"Deployment": "deployments", "StatefulSet": "statefulsets"}
_DONE_PHASES: Final = ("Failed", "Succeeded")

Obj = dict[str, Any]


# --- pure parts ---------------------------------------------------------------------------------------------------


def template_hash(template: Mapping[str, Any]) -> str:
    """A short, stable digest of a pod template (canonical JSON), a label value: equal templates, equal hashes."""
    canonical = json.dumps(template, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:10]


def standby_pod(so: Mapping[str, Any], model: str, template: Mapping[str, Any]) -> Obj:
    """The standby pod for ScaledObject `so` (its body) from the target's pod `template`."""
    meta = so["metadata"]
    tmeta = template.get("metadata") or {}
    labels = {
        **(tmeta.get("labels") or {}),
        SCALEDOBJECT_LABEL: meta["name"],
        MODEL_LABEL: model,
        STANDBY_LABEL: "true",
        SERVING_LABEL: "false",
        TEMPLATE_HASH_LABEL: template_hash(template),
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "generateName": f"{meta['name'][:50]}-standby-",
            "namespace": meta["namespace"],
            "labels": labels,
            "annotations": dict(tmeta.get("annotations") or {}),
            "ownerReferences": [
                {
                    "apiVersion": f"{GROUP}/{VERSION}",
                    "kind": "ScaledObject",
                    "name": meta["name"],
                    "uid": meta.get("uid", ""),
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": copy.deepcopy(template.get("spec") or {}),
    }


def _labels(pod: Mapping[str, Any]) -> Mapping[str, str]:
    return (pod.get("metadata") or {}).get("labels") or {}


def _serving(pod: Mapping[str, Any]) -> bool:
    return _labels(pod).get(SERVING_LABEL) == "true"


def gone(pod: Mapping[str, Any]) -> bool:
    """Terminating, or done for good (failed or finished): not a standby pod any more."""
    return (
        bool((pod.get("metadata") or {}).get("deletionTimestamp"))
        or (pod.get("status") or {}).get("phase") in _DONE_PHASES
    )


def _name(pod: Mapping[str, Any]) -> str:
    return str(pod["metadata"]["name"])


@dataclass(frozen=True)
class Plan:
    create: int = 0
    delete: tuple[str, ...] = ()
    reasons: tuple[str, ...] = ()


def plan(pods: Iterable[Mapping[str, Any]], size: int, current_hash: str) -> Plan:
    """What to create and delete so `size` standby pods of `current_hash` exist (see the module docstring)."""
    delete: list[str] = []
    reasons: list[str] = []
    live: list[Mapping[str, Any]] = []
    for pod in pods:
        if (pod.get("metadata") or {}).get("deletionTimestamp"):
            continue  # already going
        if (pod.get("status") or {}).get("phase") in _DONE_PHASES:
            delete.append(_name(pod))
            reasons.append(f"{_name(pod)}: {pod['status']['phase']}, replaced")
        elif _labels(pod).get(TEMPLATE_HASH_LABEL) != current_hash and not _serving(pod):
            delete.append(_name(pod))
            reasons.append(f"{_name(pod)}: pod template changed, replaced")
        else:
            live.append(pod)
    extra = len(live) - size
    if extra > 0:

        def usefulness(pod: Mapping[str, Any]) -> tuple[int, int, str]:
            spec, status = pod.get("spec") or {}, pod.get("status") or {}
            scheduled = 1 if spec.get("nodeName") else 0
            running = 1 if status.get("phase") == "Running" else 0
            # lowest first: unscheduled, then not running, then the newest
            created = str((pod.get("metadata") or {}).get("creationTimestamp") or "")
            return (scheduled, running, _invert(created))

        idle = sorted((p for p in live if not _serving(p)), key=usefulness)
        for pod in idle[:extra]:
            delete.append(_name(pod))
            reasons.append(f"{_name(pod)}: warm pool shrunk to {size}")
    create = max(0, size - len(live))
    return Plan(create=create, delete=tuple(delete), reasons=tuple(reasons))


def pool_size(body: Mapping[str, Any], now: float, row_pool_floor: int | None = None) -> int:
    """Standby pods to keep for a ScaledObject at `now`: ``spec.warmPool.size``, raised to the floor of a schedule
    in force or starting within `schedules.POOL_LEAD_S` (its own ``spec.schedules``, and `row_pool_floor`, the
    autoscaler's view with the on-call ones). Schedules that do not read are ignored here (the operator's
    validation reports them)."""
    spec = body.get("spec") or {}
    size = int((spec.get("warmPool") or {}).get("size") or 0)
    floor = row_pool_floor or 0
    raw = spec.get("schedules") if isinstance(spec, Mapping) else None
    if raw:
        try:
            own = msgspec.convert(raw, list[protocol.Schedule])
        except (msgspec.ValidationError, ValueError, TypeError):
            own = []
        floor = max(floor, schedules.pool_floor(schedules.windows(own), now) or 0)
    return max(size, floor)


def _invert(text: str) -> str:
    """Sorts RFC 3339 times newest first in an ascending sort."""
    return "".join(chr(0x10FFFF - ord(c)) for c in text)


@dataclass(frozen=True)
class Flip:
    pod: str
    serving: bool
    slot: str | None  # the slot key annotated (None: the annotation is removed)


def serving_changes(pods: Iterable[Mapping[str, Any]], ready_slots: Mapping[str, str]) -> tuple[list[Flip], list[str]]:
    """Flips that make the serving label follow `ready_slots` (slot key -> node, the model's ``ready`` slots), and
    the ready slots that have no standby pod on their node (said in the log, not fixed here)."""
    pods = [p for p in pods if not gone(p)]
    flips: list[Flip] = []
    assigned: dict[str, str] = {}  # slot key -> pod
    for pod in pods:
        slot = ((pod.get("metadata") or {}).get("annotations") or {}).get(SLOT_ANNOTATION)
        if slot and slot in ready_slots and slot not in assigned:
            assigned[slot] = _name(pod)
            if not _serving(pod):
                flips.append(Flip(_name(pod), True, slot))
        elif _serving(pod) or slot:
            flips.append(Flip(_name(pod), False, None))  # its slot was released (or it is a second claimant)
    taken = set(assigned.values())
    unplaced: list[str] = []
    for slot, node in sorted(ready_slots.items()):
        if slot in assigned:
            continue
        free = [
            p
            for p in pods
            if _name(p) not in taken and (p.get("spec") or {}).get("nodeName") == node and not _serving(p)
        ]
        free.sort(key=lambda p: ((p.get("status") or {}).get("phase") != "Running", _name(p)))
        if not free:
            unplaced.append(slot)
            continue
        pod_name = _name(free[0])
        taken.add(pod_name)
        flips = [f for f in flips if f.pod != pod_name]
        flips.append(Flip(pod_name, True, slot))
    return flips, unplaced


# --- the keeper ---------------------------------------------------------------------------------------------------


Key = tuple[str, str]  # (namespace, name)


class PodListener(Protocol):
    """Told every listing of a ScaledObject's standby pods (kube/assignments.py follows their nodes)."""

    def observe(self, key: Key, pods: Iterable[Mapping[str, Any]]) -> None: ...

    def forget(self, key: Key) -> None: ...


@dataclass
class StandbyKeeper:
    """Keeps the standby pods of every ScaledObject in scope; one loop (`run`) does all the writes."""

    ctx: OperatorContext
    resync_s: float = RESYNC_S
    bodies: dict[Key, Obj] = field(default_factory=dict)
    dirty: set[Key] = field(default_factory=set)
    view: BucketView[SlotRecord] | None = None
    rejected: Rejections = field(default_factory=lambda: Rejections(log))
    _wake: asyncio.Event = field(default_factory=asyncio.Event)
    reconciles: int = 0
    listeners: list[PodListener] = field(default_factory=list)
    """Told each listing of an object's standby pods, and when the object is gone (kube/assignments.py)."""

    @property
    def leading(self) -> Callable[[], bool]:
        fn = self.ctx.extra.get("leading")
        return fn if callable(fn) else (lambda: True)

    # --- inputs -------------------------------------------------------------------------------------------

    def on_scaledobject(self, body: Mapping[str, Any], type_: str | None) -> None:
        meta = body.get("metadata") or {}
        key = (str(meta.get("namespace", "")), str(meta.get("name", "")))
        if type_ == "DELETED":
            self.bodies.pop(key, None)
            for listener in self.listeners:
                listener.forget(key)
            return
        self.bodies[key] = json.loads(json.dumps(dict(body), default=str))
        self.mark(key)

    def on_pod(self, body: Mapping[str, Any]) -> None:
        meta = body.get("metadata") or {}
        so = _labels(body).get(SCALEDOBJECT_LABEL)
        if so:
            self.mark((str(meta.get("namespace", "")), so))

    def on_slots(self, models: Iterable[str] | None) -> None:
        """Slots of `models` changed (None: all of them, a new snapshot)."""
        wanted = None if models is None else set(models)
        for key, body in self.bodies.items():
            if wanted is None or _model(body) in wanted:
                self.mark(key)

    def mark(self, key: Key) -> None:
        self.dirty.add(key)
        self._wake.set()

    # --- the loop -----------------------------------------------------------------------------------------

    async def run_until(self, stop: asyncio.Event) -> None:
        """The loop, from kopf's start until `stop` (set when kopf stops: leadership lost, or shutdown)."""
        self.view = BucketView(self.ctx.nc, self.ctx.slots, SlotRecord, self.rejected)
        task = asyncio.create_task(self.run(), name="standby-pods")
        try:
            await stop.wait()
        finally:
            # `closed` and a wake-up stop the loop even if the cancellation below is lost (kube/aio.py)
            self.view.closed = True
            self._wake.set()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def run(self) -> None:
        assert self.view is not None
        view = self.view
        tasks = [asyncio.create_task(view.run(), name="standby-slots-view"), asyncio.create_task(self._follow(view))]
        try:
            loop = asyncio.get_running_loop()
            next_resync = loop.time()
            while not view.closed:
                await aio.wait_event(self._wake, next_resync - loop.time())
                self._wake.clear()
                if view.closed:
                    break
                if loop.time() >= next_resync:
                    self.dirty.update(self.bodies)
                    next_resync = loop.time() + self.resync_s
                work, self.dirty = self.dirty, set()
                for key in sorted(work):
                    if view.closed:
                        break
                    if not self.leading():
                        self.dirty.add(key)  # kept for when (if) this replica leads
                        continue
                    try:
                        await self.reconcile(key)
                    except (apicall.ApiException, apicall.ApiUnreachable, OSError) as err:
                        log.warning("standby pods of %s/%s: %s; retrying", *key, _short(err))
                        loop.call_later(ERROR_BACKOFF_S, self.mark, key)
                    except Exception:  # noqa: BLE001 - logged with its traceback by count_failure; a bug met on one object: logged and counted, the others go on
                        self.ctx.count_failure("standby", "/".join(key))
                        loop.call_later(ERROR_BACKOFF_S, self.mark, key)
        finally:
            view.closed = True
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _follow(self, view: BucketView[SlotRecord]) -> None:
        async for event in view.changes():
            try:
                self._on_slot_event(event)
            except Exception:  # noqa: BLE001 - logged with its traceback by count_failure; one odd slot record must not end the following of slots
                self.ctx.count_failure("standby", "a pulse_slots change")

    def _on_slot_event(self, event: object) -> None:
        if isinstance(event, Snapshot):
            self.on_slots(None)
        elif isinstance(event, Changed):
            self.on_slots([event.record.model])
        elif isinstance(event, Removed):
            with contextlib.suppress(Exception):
                self.on_slots([protocol.parse_slot_key(event.key)[0]])

    def ready_slots(self, model: str) -> dict[str, str] | None:
        """Slot key -> node of the model's ``ready`` slots; None while the view is not current (no flips then)."""
        view = self.view
        if view is None or not view.current():
            return None
        return {rec.key: rec.node for rec in view.values() if rec.model == model and rec.state == "ready"}

    # --- one ScaledObject ----------------------------------------------------------------------------------

    async def reconcile(self, key: Key) -> None:
        namespace, name = key
        body = self.bodies.get(key)
        if body is None:
            return
        self.reconciles += 1
        core = self.ctx.core
        selector = f"{SCALEDOBJECT_LABEL}={name},{STANDBY_LABEL}=true"
        pods = (await apicall.call(core.list_namespaced_pod, namespace, label_selector=selector)).get("items") or []
        for listener in self.listeners:
            listener.observe(key, pods)
        if (body.get("metadata") or {}).get("deletionTimestamp"):
            # Going: the garbage collector would remove them after the ScaledObject; the finalizer may take a
            # while (it waits for slot releases), and idle standby pods hold GPUs meanwhile.
            for pod in pods:
                if not _serving(pod) and not gone(pod):
                    await self._delete(namespace, _name(pod), "its ScaledObject is being deleted")
            return
        model = _model(body)
        size = pool_size(body, self.ctx.clock(), self._row_pool_floor(key))
        template = await self._template(body)
        if model is None or template is None:
            return
        wanted = plan(pods, size, template_hash(template))
        for pod_name, why in zip(wanted.delete, wanted.reasons, strict=True):
            await self._delete(namespace, pod_name, why)
        for _ in range(wanted.create):
            await self._create(body, model, template)
        ready = self.ready_slots(model)
        if ready is None:
            return
        remaining = [p for p in pods if _name(p) not in wanted.delete]
        flips, unplaced = serving_changes(remaining, ready)
        for flip in flips:
            await self._flip(namespace, flip)
        for slot in unplaced:
            log.info("%s/%s: slot %s is ready but no standby pod runs on its node", namespace, name, slot)

    def _row_pool_floor(self, key: Key) -> int | None:
        """The autoscaler's `StatusRow.pool_floor` for the object, from the operator's last status round."""
        so = self.ctx.extra.get("scaledobjects")
        rows = getattr(so, "rows", None)
        row = rows.get(f"{key[0]}.{key[1]}") if isinstance(rows, dict) else None
        return row.pool_floor if isinstance(row, protocol.StatusRow) else None

    async def _template(self, body: Obj) -> Obj | None:
        meta = body["metadata"]
        ref = (body.get("spec") or {}).get("scaleTargetRef") or {}
        kind, target = ref.get("kind") or "Deployment", ref.get("name")
        apps = self.ctx.apps
        read = {"Deployment": apps.read_namespaced_deployment, "StatefulSet": apps.read_namespaced_stateful_set}
        if kind not in read or not target:
            log.warning("%s/%s: scaleTargetRef kind %r has no pod template here (Deployment or StatefulSet)",
                        meta["namespace"], meta["name"], kind)  # fmt: skip
            return None
        try:
            workload = await apicall.call(read[kind], target, meta["namespace"])
        except apicall.ApiException as err:
            if err.status == 404:
                log.warning("%s/%s: target %s/%s not found; no standby pods", meta["namespace"], meta["name"], kind,
                            target)  # fmt: skip
                return None
            raise
        template = (workload.get("spec") or {}).get("template")
        return template if isinstance(template, dict) else None

    async def _create(self, body: Obj, model: str, template: Obj) -> None:
        pod = standby_pod(body, model, template)
        created = await apicall.call(self.ctx.core.create_namespaced_pod, body["metadata"]["namespace"], pod)
        log.info("created standby pod %s/%s for %s", body["metadata"]["namespace"],
                 (created.get("metadata") or {}).get("name"), body["metadata"]["name"])  # fmt: skip

    async def _delete(self, namespace: str, pod: str, why: str) -> None:
        try:
            await apicall.call(self.ctx.core.delete_namespaced_pod, pod, namespace)
        except apicall.ApiException as err:
            if err.status != 404:
                raise
        log.info("deleted standby pod %s/%s: %s", namespace, pod, why)

    async def _flip(self, namespace: str, flip: Flip) -> None:
        patch = {
            "metadata": {
                "labels": {SERVING_LABEL: "true" if flip.serving else "false"},
                "annotations": {SLOT_ANNOTATION: flip.slot},
            }
        }
        try:
            await apicall.call(
                self.ctx.core.patch_namespaced_pod, flip.pod, namespace, patch, _content_type=apicall.MERGE_PATCH
            )
        except apicall.ApiException as err:
            if err.status != 404:
                raise
            return
        log.info("standby pod %s/%s %s", namespace, flip.pod,
                 f"serving slot {flip.slot}" if flip.serving else "back to standby")  # fmt: skip


_model = operator.model_of  # never raises, whatever the body's shape (a CR may never have been valid)


def _short(err: BaseException) -> str:
    if isinstance(err, apicall.ApiException):
        return f"API server answered {err.status} {err.reason}"
    return str(err).splitlines()[0] if str(err) else type(err).__name__


def register(registry: kopf.OperatorRegistry, ctx: OperatorContext) -> None:
    """The standby-pod handlers: watch events of ScaledObjects and standby pods feed one `StandbyKeeper`, whose
    loop runs beside kopf (`run_operator`'s background work, so only while this replica leads). Kept in
    ``ctx.extra["standby"]``."""
    keeper = StandbyKeeper(ctx)
    ctx.extra["standby"] = keeper

    ctx.extra.setdefault(operator.BACKGROUND, []).append(keeper.run_until)

    @kopf.on.event(GROUP, VERSION, PLURAL, registry=registry)
    async def standby_scaledobject_event(body: kopf.Body, type: str | None, **_: Any) -> None:
        keeper.on_scaledobject(body, type)

    @kopf.on.event("", "v1", "pods", labels={STANDBY_LABEL: "true"}, registry=registry)
    async def standby_pod_event(body: kopf.Body, **_: Any) -> None:
        keeper.on_pod(body)
