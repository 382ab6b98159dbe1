"""The kopf operator for ``scaledobjects.pulsescale.io``: Kubernetes CRs in, KV `pulse_scalers` out, status back.

kopf runs embedded (`run_operator`), with an explicit registry (`build_registry`) and settings (`build_settings`):
standalone (no kopf peering: two replicas are arbitrated by a Kubernetes Lease, kube/leader.py, which runs this only
while leading), no cluster scanning (the operator needs no RBAC on CRDs or namespaces), its progress and its
finalizer under ``pulsescale.io/`` names, and kopf's own log-to-Events posting off (`kube.events` writes
aggregated Events instead).

What it does with a ScaledObject (`ScaledObjects`):

- create, update, resume (operator start) and any change of annotations: the body goes through the shared validator
  (`manifests.scaledobject.from_manifest`, the one `pulsescale apply` uses: both pause-annotation families are
  read there) and the record is written to `pulse_scalers` under ``<namespace>.<name>``; unchanged content writes
  nothing (`same_content`). ``Ready=True ScalerPublished``.
- an invalid body: ``Ready=False InvalidSpec`` with the validator's message, a Warning Event, nothing published.
  A previously published valid version stays in force (as ``kubectl apply`` refusing a bad edit leaves the running
  one): deleting it would drop the workload to zero for a typo. The condition says which generation is in force.
- a scale target that does not exist: ``Ready=False ScaleTargetNotFound`` and a Warning Event, as KEDA keeps such
  an object not Ready; the record is published all the same (its warm slots serve without the workload; only
  standby pods, the cold path and the pause need it). A missing target is re-checked every status round. A kind
  other than an apps/v1 Deployment or StatefulSet (an Argo Rollout) is refused by the validator (``InvalidSpec``),
  as by the CRD and ``pulsescale apply``: the operator reads no other pod template or scale subresource.
- a second ScaledObject, or an HPA, targeting the same workload (namespace, kind, name): ``Ready=False
  TargetConflict`` naming the other object, a Warning Event, nothing published for it. Only a published
  ScaledObject holds a target (one never published, invalid or refused, blocks nothing: KEDA's webhook would have
  refused it); verdicts are judged one at a time (`ScaledObjects.judging`), so of two new ones the first published
  keeps it. An HPA always wins (the operator does not fight another controller: its record is withdrawn). Likewise
  one ScaledObject per model (``Ready=False ModelConflict``): the autoscaler runs one controller per model and would
  silently ignore a second record. Refused objects are re-checked every status round, so deleting the other object
  lets this one through.
- a model owned by another namespace (kube/records.py `ModelOwners`: the first namespace to publish it, or the one
  the platform team named in the ConfigMap ``pulsescale-model-owners``): ``Ready=False ModelOwnedByOtherNamespace``
  naming the owner, a Warning Event, nothing published (a record it had is withdrawn: the platform team moved the
  model). Checked before the one-per-model rule, which still holds within the owner's namespace. An unowned model
  is claimed for the object's namespace before its record is written; the claim stays when the object goes. An
  unreadable ConfigMap is ``Ready=False ModelOwnerUnknown``: nothing new published, a record in force kept.
- a record under the object's key that ``pulsescale apply`` wrote (on-call; without the operator's mark
  `protocol.ScalerRecord.managed_by`, which every record the operator publishes carries) and that says
  something else than the CR: ``Ready=False ScalerWrittenByApply``, a Warning Event, the record left in force and
  never withdrawn. Re-checked every status round, as is every published record (``apply --force`` may replace it):
  a record that says what the CR says is taken over, a deleted one is replaced by the CR's.
- delete (finalizer ``pulsescale.io/finalizer``): the record is removed from `pulse_scalers` (only one the operator
  published; one of ``apply`` stays); then, unless another record names the same model, the operator waits (up
  to `OperatorContext.delete_wait_s`, ``Ready=False Deleting`` and a Normal Event while it waits, a Warning if it
  gives up) until the model's slots in `pulse_slots` are released (the autoscaler releases them when the record
  goes; only for an object that was published: an invalid or refused one never held any); then, with
  ``advanced.restoreToOriginalReplicaCount``, the target's scale subresource goes back to
  ``status.originalReplicaCount``; then the finalizer is removed.
- status: every `OperatorContext.status_every_s` one ``pulse.cmd.status`` request to the autoscaler; each object's
  row (`StatusRow.key`) is composed into the status (kube/status.py) and patched only when it changed. ``Active``
  is KEDA's (demand above the activation threshold within two rounds), not "has replicas". After `SILENT_ROUNDS`
  (kube/statuswriter.py) unanswered rounds Active and Fallback become Unknown (the last counts stay). Active,
  Fallback and Paused flips become Events.
- Events: ``pulse.events.>`` (scale.decision, pool.exhausted, cold.start) become Events on every ScaledObject of the
  model, aggregated and rate-limited (kube/events.py).
- the mirror (contract revision 13): whatever the verdict, each status written (or found unchanged) is copied
  into KV `pulse_objects` as the object's `ObjectStatus` when it changed (kube/records.py `ObjectMirror`), and
  deleted when the finalizer is done, so ``pulsescale get so`` says what the CR says, unpublished objects included.
  A record whose CR is gone without that delete (deleted while no operator led, or its delete did not reach the
  bucket) is swept when the operator starts leading and every `OperatorContext.mirror_sweep_every_s`, only in the
  namespaces it watches and only against a complete LIST of their ScaledObjects (kube/records.py `MirrorSweep`).

`ScaledObjects` holds the handlers, the verdict and the loops; it composes `Records` (kube/records.py: the records
in `pulse_scalers` and the held slots in `pulse_slots`), `ObjectMirror` and `MirrorSweep` (kube/records.py:
`pulse_objects`) and
`StatusWriter` (kube/statuswriter.py: the autoscaler's rows and the status subresource, which it mirrors).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Final

import kopf
import msgspec
import nats.errors
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from kube import aio, bodies
from kube import status as status_mod
from kube.context import FIELD_MANAGER, OperatorContext
from kube.events import EventRecorder, ObjectRef
from kube.records import (
    HELD_SLOT_STATES,
    MirrorSweep,
    ModelOwners,
    ModelOwnersUnavailable,
    ObjectMirror,
    Records,
    applied_by_hand,
    applied_message,
    marked,
    record_key,
)
from kube.status import model_of
from kube.statuswriter import StatusWriter
from manifests import scaledobject
from manifests.crdtypes import GROUP, PLURAL, VERSION
from warmpool import protocol
from warmpool.errors import BadMessage

__all__ = [
    "BACKGROUND",
    "EVENT_LISTENERS",
    "EVENT_TYPES_POSTED",
    "FINALIZER",
    "HELD_SLOT_STATES",
    "PROGRESS_PREFIX",
    "ScaledObjects",
    "model_of",
]

FINALIZER: Final = "pulsescale.io/finalizer"
PROGRESS_PREFIX: Final = "kopf.pulsescale.io"  # kopf's handler progress and last-handled state (annotations)
SLOT_POLL_S: Final = 0.5  # how often the finalizer re-reads pulse_slots while it waits
FLUSH_EVERY_S: Final = 1.0  # how often aggregated Events are written
EVENT_TYPES_POSTED: Final = {
    "scale.decision": ("Normal", "ScaleDecision"),
    "pool.exhausted": ("Warning", "PoolExhausted"),
    "cold.start": ("Normal", "ColdStart"),
}
OPTIONAL_PARTS: Final = ("kube.standby", "kube.assignments", "kube.coldpath")  # each has register(registry, ctx)
BACKGROUND: Final = "background"
"""``ctx.extra[BACKGROUND]``: a list of ``async (stop: asyncio.Event) -> None`` that `register` of a part may append
to; `run_operator` runs each on the caller's loop beside kopf until the stop flag is set (e.g. a NATS watch)."""
RECHECKED_REASONS: Final = frozenset(
    {
        "TargetConflict",
        "ModelConflict",
        "ScaleTargetNotFound",
        "ModelOwnedByOtherNamespace",
        "ModelOwnerUnknown",
        "ScalerWrittenByApply",
    }
)
"""Refusals that end when another object goes, the target comes or the platform team moves a model: re-checked
every status round."""
EVENT_LISTENERS: Final = "event_listeners"
"""``ctx.extra[EVENT_LISTENERS]``: a list of ``async (event: protocol.Event) -> None`` that `register` of a part may
append: the operator's one ``pulse.events.>`` subscription decodes each event once and hands it to each of them."""
BACKGROUND_STOP_S: Final = 5.0  # how long run_operator waits for background work to end after the stop flag
READY_POLL_S: Final = 0.05  # how often run_operator looks whether kopf (in its thread) is ready
RESTORABLE_KINDS: Final = tuple(kind for _, kind in scaledobject.SCALE_TARGETS)  # what the restore can patch

log = logging.getLogger("pulsescale.operator")


@dataclass
class _Known:
    """What the operator remembers of one ScaledObject between handler calls."""

    body: dict[str, Any]
    verdict: status_mod.Verdict
    model: str | None = None  # the model of the published record (None: nothing published)
    record: protocol.ScalerRecord | None = None
    """The published record in force (its pauses are what kube/coldpath.py holds the target to); None: none."""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def set_record(self, record: protocol.ScalerRecord | None) -> None:
        """The record now in force (None: withdrawn), and its model."""
        self.record, self.model = record, (None if record is None else record.spec.model)


class ScaledObjects:
    """The ScaledObject handlers and the status/Event loops, over one `OperatorContext`; the buckets are `Records`',
    the status subresource `StatusWriter`'s."""

    def __init__(self, ctx: OperatorContext) -> None:
        self.ctx = ctx
        self.known: dict[str, _Known] = {}
        self.recorder = EventRecorder(ctx.api, component=FIELD_MANAGER, instance=ctx.identity, clock=ctx.clock)
        self.records = Records(ctx)
        """The records in `pulse_scalers` and the held slots in `pulse_slots` (kube/records.py)."""
        self.owners = ModelOwners(ctx)
        """Which namespace owns which model (kube/records.py)."""
        self.mirror = ObjectMirror(ctx)
        """Each object's conditions in `pulse_objects`, for `pulsescale get so` (kube/records.py)."""
        self.sweep = MirrorSweep(ctx, self.mirror)
        """Deletes the records of `pulse_objects` whose ScaledObject is gone (kube/records.py)."""
        self.status = StatusWriter(ctx, self.recorder, self.mirror)
        """The autoscaler's rows and the status subresource, mirrored (kube/statuswriter.py)."""
        self.judging = asyncio.Lock()
        """Held by `reconcile` from the conflict checks to the publish: a target or a model goes to one object."""

    @property
    def rows(self) -> dict[str, protocol.StatusRow]:
        """The autoscaler's rows by key (`StatusWriter.rows`)."""
        return self.status.rows

    @rows.setter
    def rows(self, rows: dict[str, protocol.StatusRow]) -> None:
        self.status.rows = rows

    @property
    def rows_at(self) -> float | None:
        """When the autoscaler last answered `status` (`StatusWriter.rows_at`)."""
        return self.status.rows_at

    @rows_at.setter
    def rows_at(self, at: float | None) -> None:
        self.status.rows_at = at

    # --- Kubernetes reads and writes (the `kubernetes` client on a worker thread) ---------------------------------

    async def _list_scaledobjects(self, namespace: str) -> list[dict[str, Any]]:
        rsp: Any = await self.ctx.call(self.ctx.custom.list_namespaced_custom_object, GROUP, VERSION, namespace, PLURAL)
        return list(rsp.get("items") or [])

    async def _list_hpas(self, namespace: str) -> list[dict[str, Any]]:
        api = k8s.AutoscalingV2Api(self.ctx.api)
        rsp = await self.ctx.call(api.list_namespaced_horizontal_pod_autoscaler, namespace)
        plain: dict[str, Any] = self.ctx.api.sanitize_for_serialization(rsp)  # type: ignore[no-untyped-call]
        return list(plain.get("items") or [])

    async def _get(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            obj: Any = await self.ctx.call(
                self.ctx.custom.get_namespaced_custom_object, GROUP, VERSION, namespace, PLURAL, name
            )
        except ApiException as err:
            if err.status == 404:
                return None
            raise
        return dict(obj)

    # --- the verdict --------------------------------------------------------------------------------------------

    async def _conflict(self, body: dict[str, Any], published: bool) -> str | None:
        """The other object (ScaledObject or HPA) that owns this one's target, as a message; None if none.

        Between ScaledObjects only a published one (its record in `pulse_scalers`) holds a target: one that never was
        (an invalid spec, a refused one) blocks nothing, as KEDA's webhook would have refused it at admission. So a
        newer object never takes a target over, and a broken older one never keeps a valid one out. Of two that are
        both published (written by an older operator) the older (creationTimestamp, then name) keeps it."""
        meta = body["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        target = bodies.scale_target(body)
        if target is None:
            return None
        kind, target_name = target
        for hpa in await self._list_hpas(namespace):
            ref = (hpa.get("spec") or {}).get("scaleTargetRef") or {}
            if (ref.get("kind"), ref.get("name")) == (kind, target_name):
                return (
                    f"HorizontalPodAutoscaler {hpa['metadata']['name']} already scales {kind}/{target_name}; two "
                    "autoscalers on one workload fight each other: delete the HPA (or this ScaledObject)"
                )
        mine = (meta.get("creationTimestamp") or "", name)
        for other in await self._list_scaledobjects(namespace):
            ometa = other.get("metadata") or {}
            if ometa.get("name") == name or ometa.get("deletionTimestamp") or bodies.scale_target(other) != target:
                continue
            if await self.records.read(record_key(namespace, ometa.get("name", ""))) is None:
                continue  # never published: it holds nothing
            theirs = (ometa.get("creationTimestamp") or "", ometa.get("name", ""))
            if not published or theirs < mine:
                return (
                    f"ScaledObject {ometa.get('name')} already scales {kind}/{target_name}; "
                    "one ScaledObject per workload: delete one of them, or point this one at another target"
                )
        return None

    async def reconcile(self, body: dict[str, Any]) -> status_mod.Verdict:
        """Validate, check the target, publish; record the verdict and patch the status. The handler of create,
        update, resume and annotation changes, and the re-check of refused objects."""
        meta = body["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        key = record_key(namespace, name)
        ref = ObjectRef.of(body)
        known = self.known.setdefault(key, _Known(body=body, verdict=status_mod.Verdict(False, "Pending", "")))
        # One verdict at a time: two objects on one target, judged at once, would each find the other unpublished.
        async with known.lock, self.judging:
            if known.verdict.reason == "Deleting":
                return known.verdict  # the finalizer owns it now
            known.body = body
            previous = await self.records.read(key)
            try:
                kwargs: dict[str, Any] = {"updated_at": self.ctx.clock()}
                if self.ctx.max_replicas is not None:
                    kwargs["max_replicas"] = self.ctx.max_replicas
                record = marked(scaledobject.from_manifest(body, **kwargs))
            except scaledobject.ScaledObjectError as err:
                if previous is not None and not previous.published_by_operator:
                    previous = None  # `pulsescale apply`'s: not the operator's to keep in force or withdraw
                # The record in force stays only while its model is still this namespace's.
                moved = None if previous is None else await self._owner_refusal(previous.spec.model, namespace,
                                                                                 claim=False)  # fmt: skip
                if previous is None:
                    known.set_record(None)
                    verdict = status_mod.Verdict(False, "InvalidSpec", str(err))
                elif moved is not None and moved[0] == "ModelOwnedByOtherNamespace" and moved[1] is not None:
                    verdict = status_mod.Verdict(False, moved[0], moved[1])
                    await self.records.withdraw(key)
                    known.set_record(None)
                else:
                    # The last valid record runs on: the status keeps describing it (its pause, notes, the
                    # autoscaler's row for it), only Ready says the edit was refused.
                    known.set_record(previous)
                    verdict = status_mod.Verdict(
                        False, "InvalidSpec",
                        f"{err}; generation {previous.generation} (the last valid spec) stays in force",
                        paused_by_annotation=previous.paused, notes=tuple(previous.notes),
                        one_way_pause=bodies.one_way_pause(previous), in_force=True,
                    )  # fmt: skip
                await self.recorder.record(ref, "Warning", "InvalidSpec", str(err))
            else:
                model = record.spec.model
                reason, conflict = "TargetConflict", None
                if applied_by_hand(previous, record):  # on-call's record stays: said, never silently replaced
                    reason, conflict = "ScalerWrittenByApply", applied_message(namespace, name)
                if conflict is None:
                    conflict = await self._conflict(body, previous is not None)
                if conflict is None:
                    reason, conflict = await self._owner_refusal(model, namespace, claim=False)
                if conflict is None and previous is None:
                    reason, conflict = "ModelConflict", await self.records.model_conflict(model, key)
                if conflict is None:  # about to publish: the model is this namespace's from now on
                    reason, conflict = await self._owner_refusal(model, namespace, claim=True)
                paused_by_annotation = record.paused  # one-way pauses are not Paused (as KEDA): noted in its message
                one_way = bodies.one_way_pause(record)
                if conflict is not None:
                    # Not knowing the owners refuses new writes but withdraws nothing: an API server hiccup must
                    # not drop running models to zero.
                    keep = reason == "ModelOwnerUnknown" and previous is not None
                    verdict = status_mod.Verdict(False, reason, conflict, in_force=keep)
                    if previous is not None and not keep:
                        await self.records.withdraw(key)  # only the operator's own: `apply`'s stays
                        known.set_record(None)
                    await self.recorder.record(ref, "Warning", reason, conflict)
                else:
                    created = bodies.parse_time(meta.get("creationTimestamp"))
                    record = msgspec.structs.replace(record, created_at=created)
                    changed = previous is None or not scaledobject.same_content(previous, record)
                    if changed:
                        # The model first: the autoscaler's first events for it (cold.start) can arrive before
                        # the put below returns, and `on_nats_event` posts only for objects with a model.
                        prior = known.record
                        known.model = record.spec.model
                        try:
                            await self.records.publish(key, record)
                        except BaseException:
                            known.set_record(prior)
                            raise
                        action = "created" if previous is None else "configured"
                        await self.recorder.record(
                            ref, "Normal", "Published",
                            f"{action} {protocol.SCALERS_BUCKET}/{key} (generation {record.generation}, model "
                            f"{record.spec.model})",
                        )  # fmt: skip
                    known.set_record(record)
                    published = f"published to {protocol.SCALERS_BUCKET} as {key} (model {record.spec.model})"
                    missing = await self._target_problem(body)
                    verdict = status_mod.Verdict(
                        missing is None, "ScalerPublished" if missing is None else missing[0],
                        published if missing is None else f"{missing[1]}; {published}: its warm slots still serve",
                        paused_by_annotation=paused_by_annotation, notes=tuple(record.notes),
                        one_way_pause=one_way, in_force=missing is not None,
                    )  # fmt: skip
                    if missing is not None and known.verdict.reason != missing[0]:
                        await self.recorder.record(ref, "Warning", missing[0], missing[1])
            known.verdict = verdict
            await self.status.write(known)
            return verdict

    async def _overridden(self, key: str, known: _Known) -> bool:
        """Whether the record of a published object was replaced by ``pulsescale apply --force`` since: then it is
        judged again (``Ready=False ScalerWrittenByApply``), and never published over."""
        if known.model is None or known.verdict.reason == "Deleting":
            return False
        record = await self.records.read(key)
        return record is not None and not record.published_by_operator

    async def _owner_refusal(self, model: str, namespace: str, *, claim: bool) -> tuple[str, str | None]:
        """(reason, message) when `model` is not this namespace's: owned by another (``ModelOwnedByOtherNamespace``)
        or the owners cannot be read (``ModelOwnerUnknown``); message None when it may go on. With `claim`, an
        unowned model becomes this namespace's (written before the record)."""
        try:
            owner = await (self.owners.claim(model, namespace) if claim else self.owners.owner(model))
        except ModelOwnersUnavailable as err:
            return "ModelOwnerUnknown", str(err)
        if owner is None or owner == namespace:
            return "ModelOwnedByOtherNamespace", None
        return "ModelOwnedByOtherNamespace", self.owners.refusal(model, owner)

    async def _target_problem(self, body: dict[str, Any]) -> tuple[str, str] | None:
        """(reason, message) when the scale target does not exist (KEDA keeps such a ScaledObject not Ready). The
        record is published anyway: the warm pool serves the model without the workload, only standby pods, the
        cold path and the pause need it."""
        target = bodies.scale_target(body)
        if target is None:
            return None
        kind, name = target
        namespace = body["metadata"]["namespace"]
        # Its scale subresource: what the cold path, the pause and the restore write (and a small read). Other
        # kinds never get here: the validator refuses them (`scaledobject.SCALE_TARGETS`).
        read = {"Deployment": self.ctx.apps.read_namespaced_deployment_scale,
                "StatefulSet": self.ctx.apps.read_namespaced_stateful_set_scale}.get(kind)  # fmt: skip
        if read is None:
            return None
        try:
            await self.ctx.call(read, name, namespace)
        except ApiException as err:
            if err.status == 404:
                return ("ScaleTargetNotFound",
                        f"scaleTargetRef {kind}/{name} does not exist in {namespace}: create it or fix the name; "
                        "no standby pods and no cold path until then")  # fmt: skip
            log.debug("reading %s/%s/%s: %s", namespace, kind, name, err)  # unknown: not held against the object
        return None

    # --- kopf handlers --------------------------------------------------------------------------------------

    async def on_change(self, body: kopf.Body, **_: Any) -> None:
        if body.get("metadata", {}).get("deletionTimestamp"):
            return  # the delete handler owns it now
        await self.reconcile(bodies.plain(body))

    async def on_delete(self, body: kopf.Body, runtime: datetime.timedelta, **_: Any) -> None:
        plain = bodies.plain(body)
        meta = plain["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        key = record_key(namespace, name)
        ref = ObjectRef.of(plain)
        known = self.known.setdefault(key, _Known(body=plain, verdict=status_mod.Verdict(False, "Deleting", "")))
        async with known.lock:  # from here on, a re-check (status round) cannot publish it again
            known.body = plain
            if known.verdict.reason != "Deleting":
                known.verdict = status_mod.Verdict(False, "Deleting", "the ScaledObject is being deleted")
            withdrawn = await self.records.withdraw(key)
        model = known.model or model_of(plain)
        if withdrawn:
            await self.recorder.record(ref, "Normal", "Unpublished", f"removed {protocol.SCALERS_BUCKET}/{key}")
        # Only a published object's model holds slots on its behalf; an invalid or refused one never did. (Across
        # retries and operator restarts the record is already gone: the status still says it was published.)
        ready: dict[str, Any] = next(
            (c for c in (plain.get("status") or {}).get("conditions") or [] if c.get("type") == "Ready"), {}
        )
        published = withdrawn or known.model is not None or ready.get("reason") in ("ScalerPublished", "Deleting")
        if published and model is not None and not await self.records.model_still_scaled(model, key):
            held = await self.records.held_slots(model)
            if held:
                waited = runtime.total_seconds()
                if waited < self.ctx.delete_wait_s:
                    message = (
                        f"waiting for {len(held)} slot(s) of model {model} to be released "
                        f"({', '.join(sorted(held)[:5])}{', ...' if len(held) > 5 else ''}); "
                        f"{waited:.0f}s of at most {self.ctx.delete_wait_s:.0f}s"
                    )
                    known.verdict = status_mod.Verdict(False, "Deleting", message)
                    await self.status.write(known)
                    await self.recorder.record(ref, "Normal", "WaitingForSlotRelease", message)
                    raise kopf.TemporaryError(message, delay=SLOT_POLL_S)
                await self.recorder.record(
                    ref, "Warning", "SlotsNotReleased",
                    f"{len(held)} slot(s) of model {model} still held after {waited:.0f}s; letting the ScaledObject "
                    "go (check the autoscaler: `pulsescale pool`)",
                )  # fmt: skip
        await self._restore_replicas(plain, ref)
        async with known.lock:  # a status round waiting on the lock finds it gone and mirrors nothing after this
            self.known.pop(key, None)
            self.status.rows.pop(key, None)
            await self.mirror.delete(key)  # the finalizer goes next: the CR and its mirror go together

    async def on_event(self, body: kopf.Body, type: str | None, **_: Any) -> None:
        if type == "DELETED":
            meta = body.get("metadata", {})
            key = record_key(meta.get("namespace", ""), meta.get("name", ""))
            self.known.pop(key, None)
            if self.mirror.wrote(key):  # gone without our delete handler (its finalizer removed by hand)
                await self.mirror.delete(key)

    async def _restore_replicas(self, body: dict[str, Any], ref: ObjectRef) -> None:
        spec = body.get("spec") or {}
        if not (spec.get("advanced") or {}).get("restoreToOriginalReplicaCount"):
            return
        original = (body.get("status") or {}).get("originalReplicaCount")
        target = bodies.scale_target(body)
        if not isinstance(original, int) or target is None:
            return  # never scaled by the cold path: nothing to restore
        kind, name = target
        namespace = body["metadata"]["namespace"]
        patch = {"spec": {"replicas": original}}
        if kind == "Deployment":
            call: Callable[..., Any] = self.ctx.apps.patch_namespaced_deployment_scale
        elif kind == "StatefulSet":
            call = self.ctx.apps.patch_namespaced_stateful_set_scale
        else:
            await self.recorder.record(
                ref, "Warning", "RestoreSkipped", f"cannot restore {kind}/{name}: only {', '.join(RESTORABLE_KINDS)}"
            )
            return
        try:
            await self.ctx.call(call, name, namespace, patch)
        except ApiException as err:
            if err.status != 404:
                raise
            return  # the target is gone: nothing to restore
        await self.recorder.record(
            ref, "Normal", "ReplicasRestored", f"{kind}/{name} restored to {original} replicas (originalReplicaCount)"
        )

    # --- loops ------------------------------------------------------------------------------------------------

    async def status_round(self) -> None:
        """One status refresh: ask the autoscaler, patch each changed status, re-check refused objects and
        published ones whose model the platform team gave to another namespace."""
        await self.status.refresh()
        owners: dict[str, str] = {}
        if any(k.model is not None for k in self.known.values()):
            with contextlib.suppress(ModelOwnersUnavailable):  # unreadable: nothing is taken away this round
                owners = await self.owners.read()
        for key, known in list(self.known.items()):
            namespace = known.body["metadata"]["namespace"]
            moved = known.model is not None and owners.get(known.model, namespace) != namespace
            if known.verdict.reason in RECHECKED_REASONS or moved or await self._overridden(key, known):
                meta = known.body["metadata"]
                fresh = await self._get(meta["namespace"], meta["name"])
                if fresh is not None and not fresh["metadata"].get("deletionTimestamp"):
                    await self.reconcile(fresh)
                continue
            if known.verdict.reason == "Deleting" or key not in self.known:
                continue
            async with known.lock:
                if self.known.get(key) is known:  # not deleted while this round waited for the lock
                    await self.status.write(known)

    async def on_nats_event(self, event: protocol.Event) -> None:
        posted = EVENT_TYPES_POSTED.get(event.type)
        if posted is None:
            return
        event_type, reason = posted
        if event.type == "scale.decision":
            message = f"desired {event.desired} for model {event.model}" + (f": {event.reason}" if event.reason else "")
        elif event.type == "pool.exhausted":
            message = f"no warm slot left for model {event.model}" + (f": {event.reason}" if event.reason else "")
        else:
            message = (
                f"asked the cold path for {event.desired} replica(s) of model {event.model} (the pool could not "
                "provide them)" + (f": {event.reason}" if event.reason else "")
            )
        for known in list(self.known.values()):
            # Every object whose published record names the model (also one whose last edit was invalid: its
            # previous record is in force) but a deleting one; not `verdict.ready`, set only after the put.
            if known.model == event.model and known.verdict.reason != "Deleting":
                await self.recorder.record(ObjectRef.of(known.body), event_type, reason, message)  # type: ignore[arg-type]

    async def run_loops(self, stop: asyncio.Event) -> None:
        """The status loop, the Events flush, the sweep of `pulse_objects` (at once: this replica has just started
        leading) and the pulse.events subscription, until `stop` is set."""
        sub = await self.ctx.nc.subscribe(f"{protocol.EVENTS_PREFIX}>")

        listeners: list[tuple[str, Callable[[protocol.Event], Awaitable[None]]]] = [
            ("events", self.on_nats_event),
            *(("listener", fn) for fn in self.ctx.extra.get(EVENT_LISTENERS, [])),
        ]

        async def events() -> None:
            async for msg in sub.messages:
                try:
                    event = protocol.decode(msg.data, protocol.Event)
                except BadMessage:
                    continue
                for what, listener in listeners:
                    try:
                        await listener(event)
                    except Exception:  # noqa: BLE001 - logged with its traceback by count_failure; one bad event must not end the subscription
                        self.ctx.count_failure(what, f"event on {msg.subject}")

        async def every(period: float, work: Callable[[], Awaitable[object]]) -> None:
            while not stop.is_set():
                try:
                    await work()
                except Exception:
                    log.exception("operator loop round failed")
                await aio.wait_event(stop, period)

        tasks = [
            asyncio.create_task(events()),
            asyncio.create_task(every(self.ctx.status_every_s, self.status_round)),
            asyncio.create_task(every(FLUSH_EVERY_S, self.recorder.flush)),
            asyncio.create_task(every(self.ctx.mirror_sweep_every_s, self.sweep.round)),
        ]
        try:
            await stop.wait()
        finally:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
