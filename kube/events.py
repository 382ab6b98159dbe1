"""Kubernetes Events (core v1) on ScaledObjects, aggregated so that a traffic pulse does not make thousands.

The autoscaler publishes a `protocol.Event` per scale decision, pool exhaustion and cold start; during a pulse
that is several a second per model. ``kubectl describe`` wants to show "ScaleDecision (x41 over 2m): desired 6:
...", not 41 objects, and every Event is an etcd write. So, as client-go's event correlator does:

- Events with the same object, type and reason within `AGGREGATE_WINDOW_S` are one Event: its ``count`` grows,
  its ``lastTimestamp`` and ``message`` follow the latest occurrence;
- one Event object is written at most once per `MIN_WRITE_INTERVAL_S` (create, then patches); occurrences in
  between are counted and written by `flush` (the operator calls it every second) — never lost, only late;
- at most `MAX_WRITES_PER_S` API writes per second in all (a token bucket); what does not fit waits for `flush`.

Writes go through the `kubernetes` client on a worker thread; a failed write is logged and dropped (an Event is
advice; the status subresource is the record).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from kube.status import rfc3339

__all__ = [
    "AGGREGATE_WINDOW_S",
    "MAX_WRITES_PER_S",
    "MIN_WRITE_INTERVAL_S",
    "EventRecorder",
    "ObjectRef",
]

AGGREGATE_WINDOW_S: Final = 600.0  # same object+type+reason within this many seconds: one Event, count grows
MIN_WRITE_INTERVAL_S: Final = 5.0  # one Event object is written at most this often
MAX_WRITES_PER_S: Final = 10.0  # all Event writes together, per second (burst of the same size)
MAX_MESSAGE_CHARS: Final = 1024  # the API server refuses messages over 1 KiB in events.k8s.io; keep both under it

log = logging.getLogger("pulsescale.operator.events")


@dataclass(frozen=True)
class ObjectRef:
    """The object an Event is about (``involvedObject``)."""

    api_version: str
    kind: str
    namespace: str
    name: str
    uid: str

    @classmethod
    def of(cls, body: dict[str, Any]) -> ObjectRef:
        meta = body.get("metadata") or {}
        return cls(
            api_version=str(body.get("apiVersion", "")),
            kind=str(body.get("kind", "")),
            namespace=str(meta.get("namespace", "")),
            name=str(meta.get("name", "")),
            uid=str(meta.get("uid", "")),
        )


@dataclass
class _Aggregate:
    name: str  # the Event object's name
    first: float
    last: float
    count: int
    message: str
    written_count: int = 0  # count as last written (0: not created yet)
    written_at: float = float("-inf")


@dataclass
class EventRecorder:
    """Records Events for `component` (``source.component``/``reportingComponent``) as `instance`."""

    api: k8s.ApiClient
    component: str = "pulsescale-operator"
    instance: str = ""
    clock: Callable[[], float] = time.time
    min_write_interval_s: float = MIN_WRITE_INTERVAL_S
    _aggregates: dict[tuple[ObjectRef, str, str], _Aggregate] = field(default_factory=dict)
    _tokens: float = MAX_WRITES_PER_S
    _tokens_at: float = float("nan")
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    writes: int = 0  # Event API writes made (for tests and metrics)

    async def record(self, ref: ObjectRef, type_: Literal["Normal", "Warning"], reason: str, message: str) -> None:
        """Counts one occurrence and writes it now if the limits allow, else at a later `flush`."""
        now = self.clock()
        message = message if len(message) <= MAX_MESSAGE_CHARS else message[: MAX_MESSAGE_CHARS - 1] + "…"
        key = (ref, type_, reason)
        agg = self._aggregates.get(key)
        if agg is None or now - agg.first > AGGREGATE_WINDOW_S:
            agg = _Aggregate(name=f"{ref.name}.{uuid.uuid4().hex[:16]}", first=now, last=now, count=1,
                             message=message)  # fmt: skip
            self._aggregates[key] = agg
        else:
            agg.count += 1
            agg.last, agg.message = now, message
        await self._maybe_write(key, agg, now)

    async def flush(self) -> None:
        """Writes every aggregate with unwritten occurrences whose interval has passed; forgets old ones."""
        now = self.clock()
        for key, agg in list(self._aggregates.items()):
            if agg.count > agg.written_count:
                await self._maybe_write(key, agg, now)
            elif now - agg.last > AGGREGATE_WINDOW_S:
                del self._aggregates[key]

    def _take_token(self, now: float) -> bool:
        if self._tokens_at != self._tokens_at:  # NaN: first use
            self._tokens_at = now
        self._tokens = min(MAX_WRITES_PER_S, self._tokens + (now - self._tokens_at) * MAX_WRITES_PER_S)
        self._tokens_at = now
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True

    async def _maybe_write(self, key: tuple[ObjectRef, str, str], agg: _Aggregate, now: float) -> None:
        async with self._lock:
            if agg.count == agg.written_count or now - agg.written_at < self.min_write_interval_s:
                return
            if not self._take_token(now):
                return
            ref, type_, reason = key
            count, first_write = agg.count, agg.written_count == 0
            agg.written_count, agg.written_at = count, now
            try:
                await asyncio.to_thread(self._write, ref, type_, reason, agg, count, first_write=first_write)
                self.writes += 1
            except ApiException as err:
                log.warning("could not write the %s Event %s on %s/%s: %s %s", type_, reason, ref.namespace,
                            ref.name, err.status, err.reason)  # fmt: skip
            except Exception as err:  # noqa: BLE001 - an Event is advice; never fail the caller for it
                log.warning("could not write the %s Event %s on %s/%s: %r", type_, reason, ref.namespace, ref.name,
                            err)  # fmt: skip

    def _write(self, ref: ObjectRef, type_: str, reason: str, agg: _Aggregate, count: int, *,
               first_write: bool) -> None:  # fmt: skip
        core = k8s.CoreV1Api(self.api)
        body = {
            "metadata": {"name": agg.name, "namespace": ref.namespace},
            "involvedObject": {"apiVersion": ref.api_version, "kind": ref.kind, "namespace": ref.namespace,
                               "name": ref.name, "uid": ref.uid},
            "type": type_,
            "reason": reason,
            "message": agg.message,
            "count": count,
            "firstTimestamp": rfc3339(agg.first),
            "lastTimestamp": rfc3339(agg.last),
            "source": {"component": self.component},
            "reportingComponent": self.component,
            "reportingInstance": self.instance,
        }  # fmt: skip
        if first_write:
            core.create_namespaced_event(ref.namespace, body)  # type: ignore[arg-type]  # a dict is converted
            return
        patch = {"count": count, "message": agg.message, "lastTimestamp": rfc3339(agg.last)}
        try:
            core.patch_namespaced_event(agg.name, ref.namespace, patch)
        except ApiException as err:
            if err.status != 404:
                raise
            core.create_namespaced_event(ref.namespace, body)  # type: ignore[arg-type]  # a dict is converted  # expired (Events have a TTL)
