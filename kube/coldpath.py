"""The cold path: when the warm pool cannot provide the replicas the autoscaler wants, scale the target workload as
an HPA would.

The autoscaler says so twice: a `protocol.Event` ``cold.start`` on ``pulse.events.<model>`` with `desired` = the
replicas the pool could not give (sent once per shortfall), and `StatusRow.cold_requested` in every ``status``
reply while the shortfall lasts (0 once met). The event is the fast path; the status rows are the reconciliation
that catches an event lost while the operator restarted or changed leader.

For each ScaledObject of the model (published, ``Ready``), one request of `needed` replicas:

- reads the target's ``scale`` subresource (``apps/v1`` ``deployments|statefulsets/<name>/scale``) and patches
  ``spec.replicas`` to ``current + needed``, capped at ``maxReplicaCount`` — the body ``{"spec": {"replicas": N}}``,
  a merge patch, as ``kubectl scale`` and the scale client of an HPA write it;
- before the first change, records the replica count the target had in ``status.originalReplicaCount`` (KEDA's
  field; with ``advanced.restoreToOriginalReplicaCount`` the delete handler puts it back);
- is idempotent: a request is an *episode* (``status.coldPath``: the `needed` asked, the replica count it started
  from, the count it patched to), so the same request again — the event and the status row of one shortfall, or a
  new leader re-reading the status — patches nothing, and a larger one within the episode patches to
  ``from + needed``. The episode ends when the autoscaler reports ``cold_requested == 0``;
- says what it did in a Kubernetes Event on the ScaledObject (``ColdPathScaled``, or ``ColdPathAtMax`` when the
  cap holds it back).

Writes are made only while this replica leads (``ctx.extra["leading"]``).

The cold path only ever raises the target; nothing here lowers it. The workload keeps the replicas it was given
when the shortfall ends, when the autoscaler's desired count falls, and when a pause (``paused-replicas: "0"``
included) holds the model lower: the pause holds pulsescale's slots, not the Deployment. They go only when someone
scales the workload, or when the ScaledObject is deleted with ``advanced.restoreToOriginalReplicaCount``. So a new
episode counts from ``status.originalReplicaCount`` (`scale_to`), not from the replicas an earlier episode left:
``max(current, min(original + needed, maxReplicaCount))``, so successive shortfalls do not stack.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import kopf

from kube import aio, apicall, operator
from kube.context import OperatorContext
from kube.events import ObjectRef
from kube.status import rfc3339
from manifests.crdtypes import GROUP, PLURAL, VERSION
from warmpool import protocol

__all__ = ["COLD_PATH_STATUS", "ColdPath", "Episode", "register", "scale_to"]

log = logging.getLogger("pulsescale.operator.coldpath")

COLD_PATH_STATUS: Final = "coldPath"
"""``status.coldPath``: the current episode, ``{"requested", "fromReplicas", "toReplicas", "time"}``."""
TARGETS: Final = ("Deployment", "StatefulSet")
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


def scale_to(
    current: int, needed: int, max_replicas: int, episode: Episode | None, original: int | None = None
) -> tuple[int, Episode]:
    """The replica count to patch to (== `current`: no patch) and the episode after this request. Pure.

    A new episode counts from `original` (``status.originalReplicaCount``, the count before the cold path first
    raised it) when there is one, not from `current`: replicas an earlier episode added are still there, and
    stacking each shortfall on top of them climbed 1 -> 4 -> 6 -> 8 while the autoscaler wanted 2."""
    start = current if original is None else min(original, current)  # scaled below it since: from there
    base = episode.from_replicas if episode is not None else start
    target = min(base + needed, max_replicas)
    target = max(target, current)  # the cold path only adds
    return target, Episode(needed, base, target)


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

    def _scaledobjects(self, model: str) -> list[Obj]:
        so = self.ctx.extra.get("scaledobjects")
        known = getattr(so, "known", {}) or {}
        return [k.body for k in list(known.values()) if k.model == model and k.verdict.ready]

    # --- inputs -------------------------------------------------------------------------------------------

    async def on_event(self, event: protocol.Event) -> None:
        """A ``cold.start`` from the operator's ``pulse.events.>`` subscription (`operator.EVENT_LISTENERS`)."""
        if event.type != "cold.start" or not event.desired:
            return
        for body in self._scaledobjects(event.model):
            await self._guarded(body, event.desired, event.reason or "")

    async def reconcile(self) -> None:
        """From the autoscaler's last status rows: outstanding requests asked again (idempotent), met ones ended."""
        so = self.ctx.extra.get("scaledobjects")
        rows: Mapping[str, protocol.StatusRow] = getattr(so, "rows", {}) or {}
        known = getattr(so, "known", {}) or {}
        for key, k in list(known.items()):
            row = rows.get(key)
            if row is None or not k.verdict.ready:
                continue
            if row.cold_requested:
                await self._guarded(k.body, row.cold_requested, row.reason)
            elif key in self.episodes or Episode.from_status(k.body.get("status")) is not None:
                await self._end(k.body)
        self.rounds += 1

    async def _guarded(self, body: Obj, needed: int, reason: str) -> None:
        try:
            await self.request(body, needed, reason)
        except (apicall.ApiException, apicall.ApiUnreachable, OSError) as err:
            meta = body.get("metadata") or {}
            log.warning("cold path for %s/%s failed: %s (asked again with the next status)", meta.get("namespace"),
                        meta.get("name"), err)  # fmt: skip
        except Exception:  # noqa: BLE001 - logged with its traceback by count_failure; a bug met on one object: logged and counted, the others go on
            meta = body.get("metadata") or {}
            self.ctx.count_failure("coldpath", f"{meta.get('namespace')}/{meta.get('name')}")

    # --- one request ----------------------------------------------------------------------------------------

    async def request(self, body: Obj, needed: int, reason: str = "") -> int | None:
        """Ask for `needed` more replicas of `body`'s target. Returns the count patched to, None if no patch."""
        async with self._lock:  # one request at a time: the event and the status round must not both patch
            if not self.leading():
                return None
            meta = body["metadata"]
            namespace, name = meta["namespace"], meta["name"]
            key = f"{namespace}.{name}"
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
            original = status.get("originalReplicaCount")
            to, episode = scale_to(current, needed, cap, episode, original if isinstance(original, int) else None)
            status_patch: Obj = {COLD_PATH_STATUS: episode.to_status(self.ctx.clock())}
            if to > current and status.get("originalReplicaCount") is None:
                status_patch["originalReplicaCount"] = current  # before the first change
            if to > current:
                # The record first: if the scale patch then fails, the next request starts from the same count.
                await self._patch_status(namespace, name, status_patch)
                await self._scale(kind, target, namespace, to)
                self.patches += 1
                message = (
                    f"scaled {kind}/{target} from {current} to {to} replicas: the warm pool could not provide "
                    f"{needed}" + (f" ({reason})" if reason else "")
                )
                await self._record(fresh, "Normal", "ColdPathScaled", message)
                log.info("%s: %s", key, message)
            else:
                await self._patch_status(namespace, name, status_patch)
                if current >= cap:
                    await self._record(fresh, "Warning", "ColdPathAtMax",
                                       f"{kind}/{target} is at maxReplicaCount ({cap}); {needed} more were asked "
                                       "and not added")  # fmt: skip
            self.episodes[key] = episode
            return to if to > current else None

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
