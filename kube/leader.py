"""Leader election over a Kubernetes Lease: two operator replicas, only the leader acts.

As client-go's ``leaderelection`` does it, on a ``coordination.k8s.io/v1`` Lease (`holderIdentity`,
`leaseDurationSeconds`, `acquireTime`, `renewTime`, `leaseTransitions`):

- a candidate acquires by creating the Lease, or by replacing it with the `resourceVersion` it read: a 409 means
  another replica wrote first, and it lost (optimistic concurrency; the API server decides every race);
- it takes over another holder's Lease only once the record has not changed for `leaseDurationSeconds` *by its own
  clock*, counted from when it first saw that version (never from the holder's `renewTime`: clocks of two
  machines are not trusted to agree), or at once when the holder released it (empty `holderIdentity`);
- the leader renews every duration/3.

The leader stops acting before its lease could expire. Another replica can take over no earlier than duration after
it saw our last renewal, which was after we sent it; so we may act until duration after *sending* our last
successful renewal, and no longer. Without a renewal for `act_window_s` (2/3 of the duration) the acting side is
told to stop (kopf's ``stop_flag``) and waited for; if it has not returned `stop_margin_s` before the lease could
expire it is cancelled. A handover therefore never has two actors, even when the old leader is cut off from the
API server (its renewals fail) rather than gone. `LeaseElector.leading()` says whether this replica may act now; a
write that must not happen after a handover checks it first.

On a clean stop (SIGTERM) the leader releases the Lease once its acting side has returned, so the other replica
takes over at once instead of after a lease duration.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import math
import os
import socket
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Final

from kubernetes.client import CoordinationV1Api
from kubernetes.client.exceptions import ApiException

from kube import aio, apicall

__all__ = ["LeaseElector", "LeaseSettings", "default_identity", "run_elected"]

log = logging.getLogger("pulsescale.operator.leader")

DEFAULT_LEASE_NAME: Final = "pulsescale-operator"
DEFAULT_LEASE_DURATION_S: Final = 15.0
RELEASE_TIMEOUT_S: Final = 5.0
"""Per request of the release on stop: generous (a loaded API server; the pod's grace period is 30 s), as a missed
release costs the other replica a whole lease duration."""
_MICROTIME: Final = "%Y-%m-%dT%H:%M:%S.%fZ"  # metav1.MicroTime, as the API server writes it


def default_identity() -> str:
    """$POD_NAME (the Deployment sets it from the downward API), else the host name: unique per replica."""
    return os.environ.get("POD_NAME") or socket.gethostname()


@dataclass(frozen=True)
class LeaseSettings:
    namespace: str
    """Where the Lease lives: the operator's own namespace."""
    name: str = DEFAULT_LEASE_NAME
    identity: str = field(default_factory=default_identity)
    duration_s: float = DEFAULT_LEASE_DURATION_S
    """`leaseDurationSeconds`: how long after a replica last saw the Lease change it may take it over. client-go's
    default; a failover costs up to this long without an operator (the autoscaler keeps scaling meanwhile)."""
    retry_every_s: float = 1.0
    """How often a candidate reads the Lease, and a leader retries a failed renewal."""

    @property
    def renew_every_s(self) -> float:
        return self.duration_s / 3

    @property
    def act_window_s(self) -> float:
        """After sending the last successful renewal, act this long at most before stopping: two failed renewals
        (client-go's renewDeadline is 10 s of 15 s), leaving a third of the duration for the acting side to stop."""
        return self.duration_s * 2 / 3

    @property
    def stop_margin_s(self) -> float:
        """Cancel an acting side that has not stopped this long before the lease could expire."""
        return min(1.0, self.duration_s / 10)

    def __post_init__(self) -> None:
        if not self.identity:
            raise ValueError("the leader election needs an identity: pass --identity or set $POD_NAME")
        if not (1.0 <= self.duration_s <= 3600):
            raise ValueError(f"--lease-duration {self.duration_s:g} s is outside 1..3600 s")


def _microtime(wall: float) -> str:
    return datetime.datetime.fromtimestamp(wall, datetime.UTC).strftime(_MICROTIME)


class LeaseElector:
    """One replica's view of the Lease: `try_acquire_or_renew` does one round; `leading` says whether it may act."""

    def __init__(
        self,
        api: CoordinationV1Api,
        settings: LeaseSettings,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.api = api
        self.settings = settings
        self._clock = clock
        self._wall = wall
        self._act_until = -1.0  # our clock: the end of the current right to act
        self._observed: tuple[str, float] | None = None  # (resourceVersion, our time it was first seen)
        self.holder: str | None = None
        """The holder the last read or write saw."""
        self.transitions = 0
        self.reached = False
        """The last round got an answer from the API server (``/readyz`` of a standby replica)."""

    def leading(self) -> bool:
        """True while this replica holds the Lease and may still act (renewed within `act_window_s`)."""
        return self._clock() < self._act_until

    @property
    def act_until(self) -> float:
        return self._act_until

    def lease_lost_at(self) -> float:
        """Our clock: the earliest moment another replica could take over."""
        return self._act_until - self.settings.act_window_s + self.settings.duration_s

    def _spec(self, *, acquire: bool, transitions: int, wall: float) -> dict[str, Any]:
        spec: dict[str, Any] = {
            "holderIdentity": self.settings.identity,
            # Whole seconds on the wire, rounded up: the others wait at least as long as we act.
            "leaseDurationSeconds": math.ceil(self.settings.duration_s),
            "renewTime": _microtime(wall),
            "leaseTransitions": transitions,
        }
        if acquire:
            spec["acquireTime"] = _microtime(wall)
        return spec

    async def try_acquire_or_renew(self) -> bool:
        """One round: read the Lease, then create, renew, take over or leave it. True when we hold it now.

        Every write carries the `resourceVersion` read, so a 409 (someone else wrote since) is a loss, never a
        second holder."""
        s = self.settings
        sent_at = self._clock()
        wall = self._wall()
        timeout = max(0.5, min(s.renew_every_s, s.retry_every_s * 2))
        try:
            lease = await apicall.call(self.api.read_namespaced_lease, s.name, s.namespace, _request_timeout=timeout)
        except ApiException as err:
            self.reached = err.status < 500
            if err.status != 404:
                raise
            body: dict[str, Any] = {
                "metadata": {"name": s.name, "namespace": s.namespace},
                "spec": self._spec(acquire=True, transitions=0, wall=wall),
            }
            try:
                await apicall.call(self.api.create_namespaced_lease, s.namespace, body, _request_timeout=timeout)
            except ApiException as err2:
                if err2.status == 409:
                    return self._lost("another replica created the Lease first")
                raise
            return self._won(sent_at, transitions=0, acquired=True)
        self.reached = True
        meta, spec = lease.get("metadata") or {}, lease.get("spec") or {}
        rv = str(meta.get("resourceVersion") or "")
        holder = spec.get("holderIdentity") or ""
        transitions = int(spec.get("leaseTransitions") or 0)
        self.holder, self.transitions = holder or None, transitions
        now = self._clock()
        if self._observed is None or self._observed[0] != rv:
            self._observed = (rv, now)
        ours = holder == s.identity
        if not ours and holder:
            duration = float(spec.get("leaseDurationSeconds") or s.duration_s)
            if now < self._observed[1] + duration:
                self._act_until = -1.0
                return False  # held by another, and it renewed within a duration of our first sight
        new_transitions = transitions if ours else transitions + 1
        body = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {**meta, "resourceVersion": rv},
            "spec": {**spec, **self._spec(acquire=not ours, transitions=new_transitions, wall=wall)},
        }
        try:
            await apicall.call(self.api.replace_namespaced_lease, s.name, s.namespace, body, _request_timeout=timeout)
        except ApiException as err:
            if err.status == 409:
                return self._lost("another replica wrote the Lease first")
            raise
        return self._won(sent_at, transitions=new_transitions, acquired=not ours)

    def _won(self, sent_at: float, *, transitions: int, acquired: bool) -> bool:
        self._act_until = sent_at + self.settings.act_window_s
        self.holder, self.transitions = self.settings.identity, transitions
        self._observed = None  # our own write: the next read sees a new version anyway
        if acquired:
            log.info("leading: %s acquired Lease %s/%s (transition %d)", self.settings.identity,
                     self.settings.namespace, self.settings.name, transitions)  # fmt: skip
        return True

    def _lost(self, why: str) -> bool:
        self._act_until = -1.0
        log.info("not leading: %s", why)
        return False

    def give_up(self) -> None:
        """Stop claiming the right to act now (renewals failed, or we are stopping)."""
        self._act_until = -1.0

    async def release(self) -> None:
        """Hand the Lease back (empty holder, as client-go's ReleaseOnCancel) so another replica takes it at once.
        Only after the acting side has returned; a failure is harmless (the Lease then expires)."""
        s = self.settings
        self.give_up()
        try:
            timeout = RELEASE_TIMEOUT_S
            lease = await apicall.call(self.api.read_namespaced_lease, s.name, s.namespace, _request_timeout=timeout)
            spec = lease.get("spec") or {}
            if spec.get("holderIdentity") != s.identity:
                return
            body = {**lease, "spec": {**spec, "holderIdentity": "", "leaseDurationSeconds": 1,
                                      "renewTime": _microtime(self._wall())}}  # fmt: skip
            await apicall.call(self.api.replace_namespaced_lease, s.name, s.namespace, body, _request_timeout=timeout)
            log.info("released Lease %s/%s", s.namespace, s.name)
        except (ApiException, OSError, apicall.ApiUnreachable) as err:
            log.warning("could not release Lease %s/%s (it expires by itself): %s", s.namespace, s.name, err)


Act = Callable[[asyncio.Event], Coroutine[Any, Any, None]]


async def run_elected(elector: LeaseElector, act: Act, *, stop: asyncio.Event) -> None:
    """Until `stop`: be a candidate; when leading, run `act(stop_flag)` and renew; when a renewal is overdue or
    lost, raise `stop_flag`, wait for `act` to return (cancel it if it would outlive the lease), and stand again.

    `act` returning by itself while leading (it failed) ends the leadership too: the Lease is released so the
    other replica acts instead, and this one stands again."""
    s = elector.settings
    clock = elector._clock
    while not stop.is_set():
        if not await _attempt(elector):
            await _sleep_unless(stop, s.retry_every_s)
            continue
        acting_stop = asyncio.Event()
        task: asyncio.Task[None] = asyncio.create_task(act(acting_stop), name="operator-acting")
        try:
            why = await _lead(elector, task, stop)
        except BaseException:  # cancelled (or worse): the acting side must not outlive its leader
            elector.give_up()
            acting_stop.set()  # as well as the cancel, which the acting side may lose (kube/aio.py)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise
        acting_stop.set()
        hard_deadline = elector.lease_lost_at() - s.stop_margin_s
        elector.give_up()  # our own writes check `leading()`: none from here on
        # asyncio.wait, not wait_for: a cancellation of this task must never be lost (kube/aio.py)
        await asyncio.wait({task}, timeout=max(0.0, hard_deadline - clock()))
        if not task.done():
            log.error("the operator did not stop within the lease; cancelling it so two replicas never act at once")
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        elif not task.cancelled() and task.exception() is not None:
            log.error("the operator stopped with an error: %s", task.exception())
        # Stopping releases whatever ended the leadership: SIGTERM can come while an overdue (or lost) one is
        # being stopped (under load, with a short lease), and `release` touches the Lease only if it is still ours.
        if why in ("stop", "returned") or stop.is_set():
            await elector.release()
        if why == "returned" and not stop.is_set():
            await _sleep_unless(stop, s.retry_every_s)
    elector.give_up()


async def _attempt(elector: LeaseElector) -> bool:
    try:
        return await elector.try_acquire_or_renew()
    except (ApiException, OSError, apicall.ApiUnreachable) as err:
        elector.reached = isinstance(err, ApiException) and err.status < 500
        log.warning("Lease %s/%s: %s", elector.settings.namespace, elector.settings.name, _short(err))
        return False


def _short(err: BaseException) -> str:
    if isinstance(err, ApiException):
        return f"API server answered {err.status} {err.reason}"
    return str(err).splitlines()[0] if str(err) else type(err).__name__


async def _lead(elector: LeaseElector, task: asyncio.Task[None], stop: asyncio.Event) -> str:
    """Renew while leading. Returns why leading ended: ``stop``, ``returned`` (the acting side ended), ``lost``
    (another replica holds the Lease) or ``overdue`` (no renewal within the act window)."""
    s = elector.settings
    clock = elector._clock
    next_renew = clock() + s.renew_every_s
    stopper = asyncio.ensure_future(stop.wait())
    try:
        while True:
            wait_s = max(0.0, min(next_renew, elector.act_until) - clock())
            await asyncio.wait({task, stopper}, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
            if stop.is_set():
                return "stop"
            if task.done():
                return "returned"
            if not elector.leading():
                log.error("no Lease renewal for %.1f s: stopping the operator before the lease can expire",
                          s.act_window_s)  # fmt: skip
                return "overdue"
            if clock() < next_renew:
                continue
            try:
                left = elector.act_until - clock()
                async with asyncio.timeout(max(0.1, left)):  # not wait_for, which can lose a cancel (kube/aio.py)
                    ok = await elector.try_acquire_or_renew()
            except (ApiException, OSError, apicall.ApiUnreachable, TimeoutError) as err:
                elector.reached = isinstance(err, ApiException) and err.status < 500
                log.warning("Lease renewal failed: %s", _short(err))
                next_renew = clock() + s.retry_every_s
                continue
            if not ok:
                return "lost"
            next_renew = clock() + s.renew_every_s
    finally:
        stopper.cancel()


async def _sleep_unless(stop: asyncio.Event, seconds: float) -> None:
    await aio.wait_event(stop, seconds)
