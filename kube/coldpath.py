"""The operator's writes of the target's scale subresource: the cold path (when the warm pool cannot provide the
replicas the autoscaler wants, scale the target workload as an HPA would) and the pause annotations (as KEDA).

The autoscaler says so twice: a `protocol.Event` ``cold.start`` on ``pulse.events.<model>`` with `desired` = the
replicas the pool could not give (sent once per shortfall), and `StatusRow.cold_requested` in every ``status``
reply while the shortfall lasts (0 once met). The event is the fast path; the status rows are the reconciliation
that catches an event lost while the operator restarted or changed leader.

The replicas the target already runs count as capacity: they serve the model as the warm pool's slots do. So a
request for `needed` replicas is met when the target runs at least `needed`; only a target below that is raised,
to ``min(needed, maxReplicaCount)`` (`scale_to`). A ScaledObject created with no demand over a Deployment that
already runs 3 replicas asks the cold path for ``minReplicaCount`` (the pool is empty) and the 3 cover it: nothing
is written (it used to become 4). For each ScaledObject of the model (published, ``Ready``), one request:

- reads the target's ``scale`` subresource (``apps/v1`` ``deployments|statefulsets/<name>/scale``) and, when it
  is below the request, patches ``spec.replicas`` — the body ``{"spec": {"replicas": N}}``, a merge patch, as
  ``kubectl scale`` and the scale client of an HPA write it;
- before the first change, records the replica count the target had in ``status.originalReplicaCount`` (KEDA's
  field; with ``advanced.restoreToOriginalReplicaCount`` the delete handler puts it back);
- is idempotent: a request is an *episode* (``status.coldPath``: the `needed` asked, the replica count it started
  from, the count the target runs for it), so the same request again — the event and the status row of one
  shortfall, or a new leader re-reading the status — is not handled twice. The episode ends when the autoscaler
  reports ``cold_requested == 0``;
- says what it did in a Kubernetes Event on the ScaledObject (``ColdPathScaled``; ``ColdPathCovered`` when the
  target's replicas already cover it; ``ColdPathAtMax`` when the cap holds it back).

The cold path only ever raises the target: the workload keeps the replicas it was given when the shortfall ends
or the desired count falls, until someone scales it or the ScaledObject is deleted with
``advanced.restoreToOriginalReplicaCount``. Successive shortfalls do not stack: each asks for a count, not more.

The pause annotations (read by the validator into the record in force, `_Known.record`), as KEDA reads them:

- ``paused-replicas: "N"`` sets the target to N through its scale subresource (``originalReplicaCount`` recorded
  first, ``status.pausedReplicaCount`` N, KEDA's field) and keeps it there: a change made while paused is put back
  every status round, as KEDA's scale loop does; the autoscaler holds the pool at N (`hold_pause`);
- ``paused: "true"`` holds the target at its current count: while either annotation is on, the cold path writes
  nothing (a request during the pause, from a count the pool cannot hold, is not acted on).

Writes are made only while this replica leads (``ctx.extra["leading"]``), one at a time (the event, the status
round and the pause share one lock).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import kopf

from kube import aio, apicall, operator
from kube.context import OperatorContext
from kube.events import ObjectRef
from kube.status import rfc3339
from manifests.crdtypes import GROUP, PLURAL, VERSION
from manifests.scaledobject import SCALE_TARGETS
from warmpool import protocol

__all__ = ["COLD_PATH_STATUS", "PAUSED_STATUS", "ColdPath", "Episode", "register", "scale_to"]

log = logging.getLogger("pulsescale.operator.coldpath")

COLD_PATH_STATUS: Final = "coldPath"
"""``status.coldPath``: the current episode, ``{"requested", "fromReplicas", "toReplicas", "time"}``."""
PAUSED_STATUS: Final = "pausedReplicaCount"
"""``status.pausedReplicaCount``: KEDA's field, the count ``paused-replicas`` set the target to."""
TARGETS: Final = tuple(kind for _, kind in SCALE_TARGETS)  # what the validator admits (apps/v1)
_MAX_DEFAULT: Final = 100  # protocol.ScaledObjectSpec's default maxReplicaCount

Obj = dict[str, Any]


@dataclass(frozen=True)
class Episode:
    requested: int
    from_replicas: int
    to_replicas: int

    def to_status(self, now: float) -> Obj:
        return {"requested": self.requested, "fromReplicas": self.from_replicas, "toReplicas": self.to_replicas,
                "time": rfc3339(now)}  # fmt: skip

    @classmethod
    def from_status(cls, status: Mapping[str, Any] | None) -> Episode | None:
        raw = (status or {}).get(COLD_PATH_STATUS)
        if not isinstance(raw, Mapping):
            return None
        try:
            return cls(int(raw["requested"]), int(raw["fromReplicas"]), int(raw["toReplicas"]))
        except (KeyError, TypeError, ValueError):
            return None


def scale_to(current: int, needed: int, max_replicas: int, episode: Episode | None) -> tuple[int, Episode]:
    """The replica count the target should run for a request of `needed` (== `current`: no patch) and the episode
    after it. Pure. The target's `current` replicas count as capacity, so they cover `needed` up to their number;
    only a shortfall beyond them raises it, to `needed` (at most `max_replicas`), never by `needed`."""
    target = max(current, min(needed, max_replicas))  # the cold path only adds
    start = episode.from_replicas if episode is not None else current
    return target, Episode(needed, start, target)


@dataclass
class ColdPath:
    ctx: OperatorContext
    episodes: dict[str, Episode] = field(default_factory=dict)
    """Per ScaledObject key, the episode as last written (the status is the record; this saves a read)."""
    patches: int = 0
    rounds: int = 0
    """Reconciliations from status rows done (each one asks every outstanding request again)."""
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def leading(self) -> Callable[[], bool]:
        fn = self.ctx.extra.get("leading")
        return fn if callable(fn) else (lambda: True)

    def _known(self) -> dict[str, Any]:
        """The operator's `_Known` per ScaledObject key (its body, verdict, model and the record in force)."""
        so = self.ctx.extra.get("scaledobjects")
        return dict(getattr(so, "known", {}) or {})

    def _record_of(self, key: str) -> protocol.ScalerRecord | None:
        known = getattr(self.ctx.extra.get("scaledobjects"), "known", None) or {}
        record = getattr(known.get(key), "record", None)
        return record if isinstance(record, protocol.ScalerRecord) else None

    def _paused(self, key: str) -> bool:
        """Paused by annotation (``paused`` or ``paused-replicas``): the target is the pause's, not the cold path's."""
        record = self._record_of(key)
        return record is not None and record.paused

    def _scaledobjects(self, model: str) -> list[Obj]:
        return [k.body for key, k in self._known().items()
                if k.model == model and k.verdict.ready and not self._paused(key)]  # fmt: skip

    # --- inputs -------------------------------------------------------------------------------------------

    async def on_event(self, event: protocol.Event) -> None:
        """A ``cold.start`` from the operator's ``pulse.events.>`` subscription (`operator.EVENT_LISTENERS`)."""
        if event.type != "cold.start" or not event.desired:
            return
        for body in self._scaledobjects(event.model):
            await self._guarded(self.request, body, event.desired, event.reason or "")

    async def reconcile(self) -> None:
        """Every status round: each paused object's target held (`hold_pause`); from the autoscaler's last status
        rows, outstanding requests asked again (idempotent), met ones ended."""
        so = self.ctx.extra.get("scaledobjects")
        rows: Mapping[str, protocol.StatusRow] = getattr(so, "rows", {}) or {}
        for key, k in self._known().items():
            record = self._record_of(key)
            if record is not None and k.verdict.reason != "Deleting":
                pause = record.paused_replicas if record.paused else None
                # Only a paused-replicas object, or one whose status still says so, costs API calls each round.
                if pause is not None or PAUSED_STATUS in (k.body.get("status") or {}):
                    await self._guarded(self.hold_pause, k.body, pause)
                if record.paused:
                    continue  # the pause holds the target: no cold-path request, and its episode waits
            row = rows.get(key)
            if row is None or not k.verdict.ready:
                continue
            if row.cold_requested:
                await self._guarded(self.request, k.body, row.cold_requested, row.reason)
            elif key in self.episodes or Episode.from_status(k.body.get("status")) is not None:
                await self._end(k.body)
        self.rounds += 1

    async def _guarded(self, work: Callable[..., Awaitable[Any]], body: Obj, *args: Any) -> None:
        try:
            await work(body, *args)
        except (apicall.ApiException, apicall.ApiUnreachable, OSError) as err:
            meta = body.get("metadata") or {}
            log.warning("cold path for %s/%s failed: %s (asked again with the next status)", meta.get("namespace"),
                        meta.get("name"), err)  # fmt: skip
        except Exception:  # noqa: BLE001 - logged with its traceback by count_failure; a bug met on one object: logged and counted, the others go on
            meta = body.get("metadata") or {}
            self.ctx.count_failure("coldpath", f"{meta.get('namespace')}/{meta.get('name')}")

    # --- one request ----------------------------------------------------------------------------------------

    async def request(self, body: Obj, needed: int, reason: str = "") -> int | None:
        """Ask for `needed` replicas of `body`'s target beyond what the warm pool serves; the target's own replicas
        count towards them. Returns the count patched to, None if no patch."""
        async with self._lock:  # one request at a time: the event and the status round must not both patch
            if not self.leading():
                return None
            meta = body["metadata"]
            namespace, name = meta["namespace"], meta["name"]
            key = f"{namespace}.{name}"
            if self._paused(key):
                return None  # paused: the target keeps its count (or the paused-replicas count), as KEDA's
            fresh = await self._get(namespace, name)
            if fresh is None or (fresh.get("metadata") or {}).get("deletionTimestamp"):
                return None
            status = fresh.get("status") or {}
            episode = Episode.from_status(status) or self.episodes.get(key)
            if episode is not None and episode.requested == needed:
                return None  # this request is already served
            spec = fresh.get("spec") or {}
            ref = spec.get("scaleTargetRef") or {}
            kind, target = ref.get("kind") or "Deployment", ref.get("name")
            if kind not in TARGETS or not target:
                log.warning("%s: cold path: scaleTargetRef kind %r has no scale subresource here", key, kind)
                return None
            current = await self._replicas(kind, target, namespace)
            cap = int(spec.get("maxReplicaCount") or _MAX_DEFAULT)
            if self.ctx.max_replicas is not None:
                cap = min(cap, self.ctx.max_replicas)
            to, episode = scale_to(current, needed, cap, episode)
            status_patch: Obj = {COLD_PATH_STATUS: episode.to_status(self.ctx.clock())}
            if to > current and status.get("originalReplicaCount") is None:
                status_patch["originalReplicaCount"] = current  # before the first change
            # The record first: if the scale patch then fails, the next request starts from the same count.
            await self._patch_status(namespace, name, status_patch)
            because = f"the warm pool could not provide {needed}" + (f" ({reason})" if reason else "")
            if to > current:
                await self._scale(kind, target, namespace, to)
                self.patches += 1
                message = f"scaled {kind}/{target} from {current} to {to} replicas: {because}"
                await self._record(fresh, "Normal", "ColdPathScaled", message)
                log.info("%s: %s", key, message)
            elif current >= needed:
                await self._record(fresh, "Normal", "ColdPathCovered",
                                   f"{kind}/{target} already runs {current} replicas, which count as capacity: "
                                   f"{because}, and they cover it; not scaled")  # fmt: skip
            else:
                await self._record(fresh, "Warning", "ColdPathAtMax",
                                   f"{kind}/{target} is at maxReplicaCount ({cap}); {needed} were asked and only "
                                   f"{current} run")  # fmt: skip
            self.episodes[key] = episode
            return to if to > current else None

    async def hold_pause(self, body: Obj, replicas: int | None) -> int | None:
        """``paused-replicas`` `replicas`: the target set to that count through its scale subresource (KEDA's
        meaning), ``status.pausedReplicaCount`` said, ``originalReplicaCount`` recorded before the first change;
        a count changed while paused is put back. None (no such pause): ``pausedReplicaCount`` removed, the target
        left as it is. Returns the count patched to, None if no patch."""
        async with self._lock:
            if not self.leading():
                return None
            meta = body["metadata"]
            namespace, name = meta["namespace"], meta["name"]
            fresh = await self._get(namespace, name)
            if fresh is None or (fresh.get("metadata") or {}).get("deletionTimestamp"):
                return None
            status = fresh.get("status") or {}
            if replicas is None:
                if status.get(PAUSED_STATUS) is not None:
                    await self._patch_status(namespace, name, {PAUSED_STATUS: None})
                return None
            ref = (fresh.get("spec") or {}).get("scaleTargetRef") or {}
            kind, target = ref.get("kind") or "Deployment", ref.get("name")
            if kind not in TARGETS or not target:
                return None
            try:
                current = await self._replicas(kind, target, namespace)
            except apicall.ApiException as err:
                if err.status == 404:
                    return None  # no target (Ready=False ScaleTargetNotFound says so): nothing to hold
                raise
            status_patch: Obj = {}
            if status.get(PAUSED_STATUS) != replicas:
                status_patch[PAUSED_STATUS] = replicas
            if current != replicas and status.get("originalReplicaCount") is None:
                status_patch["originalReplicaCount"] = current  # before the first change, for the restore
            if status_patch:
                await self._patch_status(namespace, name, status_patch)
            if current == replicas:
                return None
            await self._scale(kind, target, namespace, replicas)
            self.patches += 1
            message = f"scaled {kind}/{target} from {current} to {replicas} replicas: paused-replicas is {replicas}"
            await self._record(fresh, "Normal", "PausedReplicasScaled", message)
            log.info("%s.%s: %s", namespace, name, message)
            return replicas

    async def _end(self, body: Obj) -> None:
        meta = body["metadata"]
        key = f"{meta['namespace']}.{meta['name']}"
        async with self._lock:
            if not self.leading():
                return
            self.episodes.pop(key, None)
            await self._patch_status(meta["namespace"], meta["name"], {COLD_PATH_STATUS: None})

    # --- API calls ------------------------------------------------------------------------------------------

    async def _get(self, namespace: str, name: str) -> Obj | None:
        try:
            return await apicall.call(self.ctx.custom.get_namespaced_custom_object, GROUP, VERSION, namespace,
                                      PLURAL, name)  # fmt: skip
        except apicall.ApiException as err:
            if err.status == 404:
                return None
            raise

    async def _replicas(self, kind: str, target: str, namespace: str) -> int:
        apps = self.ctx.apps
        read = (
            apps.read_namespaced_deployment_scale if kind == "Deployment" else apps.read_namespaced_stateful_set_scale
        )
        scale = await apicall.call(read, target, namespace)
        return int((scale.get("spec") or {}).get("replicas") or 0)

    async def _scale(self, kind: str, target: str, namespace: str, replicas: int) -> None:
        apps = self.ctx.apps
        patch = (
            apps.patch_namespaced_deployment_scale if kind == "Deployment" else apps.patch_namespaced_stateful_set_scale
        )
        await apicall.call(
            patch, target, namespace, {"spec": {"replicas": replicas}}, _content_type=apicall.MERGE_PATCH
        )

    async def _patch_status(self, namespace: str, name: str, status: Obj) -> None:
        await apicall.call(self.ctx.custom.patch_namespaced_custom_object_status, GROUP, VERSION, namespace, PLURAL,
                           name, {"status": status}, _content_type=apicall.MERGE_PATCH)  # fmt: skip

    async def _record(self, body: Obj, type_: str, reason: str, message: str) -> None:
        recorder = getattr(self.ctx.extra.get("scaledobjects"), "recorder", None)
        if recorder is not None:
            await recorder.record(ObjectRef.of(body), type_, reason, message)

    # --- the loop -------------------------------------------------------------------------------------------

    async def run_until(self, stop: asyncio.Event) -> None:
        """Reconcile every status round, until `stop` (events arrive through `on_event`)."""
        while not stop.is_set():
            try:
                await self.reconcile()
            except Exception:  # one failed round must not end the cold path; it is logged
                log.exception("cold path reconciliation failed")
            await aio.wait_event(stop, self.ctx.status_every_s)


def register(registry: kopf.OperatorRegistry, ctx: OperatorContext) -> None:
    """The cold path runs beside kopf (`run_operator`'s background work): no kopf handler of its own; it reads the
    ScaledObjects the operator knows (``ctx.extra["scaledobjects"]``). Kept in ``ctx.extra["coldpath"]``."""
    del registry  # nothing to register with kopf
    cold = ColdPath(ctx)
    ctx.extra["coldpath"] = cold
    ctx.extra.setdefault(operator.BACKGROUND, []).append(cold.run_until)
    ctx.extra.setdefault(operator.EVENT_LISTENERS, []).append(cold.on_event)
