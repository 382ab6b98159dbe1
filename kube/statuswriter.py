"""The status subresource of the ScaledObjects: the autoscaler's rows asked each round, composed and patched.

`StatusWriter.refresh` asks the autoscaler for its rows (one ``pulse.cmd.status`` request; a round it does not
answer keeps the last rows). `StatusWriter.write` composes one object's status from the operator's verdict and its
row (kube/status.py) and patches the status subresource only when that differs from what the object carries; after
`SILENT_ROUNDS` unanswered rounds Active and Fallback become Unknown. Active, Fallback and Paused flips become
Events. The rounds themselves, and which objects are written, are the handlers' (`kube.operator.ScaledObjects`).
Each object's composed status is then mirrored into KV `pulse_objects` (`kube.records.ObjectMirror`, contract
revision 13): the same conditions, no further API call, written only when they changed.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any, Final, Protocol

import nats.errors
from kubernetes.client.exceptions import ApiException

from kube import status as status_mod
from kube.context import OperatorContext
from kube.events import EventRecorder, ObjectRef
from kube.records import ObjectMirror, record_key
from manifests.crdtypes import GROUP, PLURAL, VERSION
from warmpool import protocol
from warmpool.errors import BadMessage

__all__ = ["SILENT_ROUNDS", "Described", "StatusWriter"]

SILENT_ROUNDS: Final = 3  # unanswered status rounds before Active/Fallback say the autoscaler is not reporting

log = logging.getLogger("pulsescale.operator")


class Described(Protocol):
    """What one object's status is written from (one of `kube.operator.ScaledObjects.known`): its body, replaced by the
    patched one, and the operator's verdict on it."""

    body: dict[str, Any]

    @property
    def verdict(self) -> status_mod.Verdict: ...


class StatusWriter:
    """The autoscaler's rows and the status subresource of one `OperatorContext`'s ScaledObjects; mode flips are
    Events through `recorder`."""

    def __init__(self, ctx: OperatorContext, recorder: EventRecorder, mirror: ObjectMirror | None = None) -> None:
        self.ctx = ctx
        self.recorder = recorder
        self.mirror = mirror
        """Where each written status is copied for `pulsescale get so` (None: nowhere)."""
        self._unmirrorable: set[str] = set()  # keys said once not to fit the mirror
        self.rows: dict[str, protocol.StatusRow] = {}
        self.rows_at: float | None = None  # when the autoscaler last answered `status`

    async def refresh(self) -> None:
        """Asks the autoscaler for its rows and keeps them; a failed request keeps the last ones."""
        try:
            rows = await self._ask_status()
        except (nats.errors.Error, BadMessage, TimeoutError) as err:
            log.debug("status request failed: %r", err)
            rows = None
        if rows is not None:
            self.rows = {row.key: row for row in rows if row.key}
            self.rows_at = self.ctx.clock()

    async def _ask_status(self) -> list[protocol.StatusRow]:
        command = protocol.StatusCommand(
            id=uuid.uuid4().hex, expires_at=time.time() + self.ctx.status_timeout_s, by=self.ctx.identity
        )
        msg = await self.ctx.nc.request(
            protocol.cmd_subject("status"), protocol.encode(command), timeout=self.ctx.status_timeout_s
        )
        reply = protocol.decode(msg.data, protocol.StatusReply)
        if not reply.ok:
            raise BadMessage("internal", f"status refused: {reply.error}")
        return reply.models

    async def write(self, known: Described) -> None:
        """Composes the status and patches it if it differs from what the object carries; Events for mode flips."""
        body = known.body
        meta = body["metadata"]
        in_force = known.verdict.ready or known.verdict.in_force
        row = self.rows.get(record_key(meta["namespace"], meta["name"])) if in_force else None
        now = self.ctx.clock()
        silent = self.rows_at is not None and now - self.rows_at > SILENT_ROUNDS * self.ctx.status_every_s
        composed = status_mod.compose(
            body, known.verdict, row, now, active_window_s=2 * self.ctx.status_every_s,
            silent_since=self.rows_at if silent else None,
        )  # fmt: skip
        current = body.get("status") or {}
        patch = status_mod.body_of(composed, current)
        if status_mod.differs(patch, current):
            updated = await self._patch_status(meta["namespace"], meta["name"], patch)
            if updated is None:
                return  # gone meanwhile: its delete removes the mirror
            known.body = updated
            ref = ObjectRef.of(updated)
            for change in status_mod.mode_changes(current, updated.get("status") or {}):
                await self.recorder.record(ref, change.event_type, change.reason, change.message)  # type: ignore[arg-type]
        await self._mirror(known.body, composed, published=in_force, now=now)

    async def _mirror(
        self, body: dict[str, Any], composed: status_mod.ScaledObjectStatus, *, published: bool, now: float
    ) -> None:
        """Copies the status just written (or found already there) into `pulse_objects`; `published`: the object's
        record is in force (ready, or an earlier valid record runs on)."""
        if self.mirror is None:
            return
        try:
            record = status_mod.mirror_of(body, composed, published=published, now=now)
        except BadMessage as err:
            key = record_key(body["metadata"]["namespace"], body["metadata"]["name"])
            if key not in self._unmirrorable:  # never from a real API server: say it once, not every round
                log.warning("%s: not mirrored to %s: %s", key, protocol.OBJECTS_BUCKET, err)
                self._unmirrorable.add(key)
            return
        await self.mirror.write(record)

    async def _patch_status(self, namespace: str, name: str, body: dict[str, Any]) -> dict[str, Any] | None:
        try:
            obj: Any = await self.ctx.call(
                self.ctx.custom.patch_namespaced_custom_object_status, GROUP, VERSION, namespace, PLURAL, name,
                {"status": body},
            )  # fmt: skip
        except ApiException as err:
            if err.status == 404:
                return None  # gone meanwhile
            raise
        return dict(obj)
