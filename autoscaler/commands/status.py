"""The rows of a ``status`` reply, gathered across the autoscaler replicas.

`StatusRows.answer` gives this replica's own rows (the newest `CommandSettings.status_decisions` decisions of each;
with a `Router`, only the models this replica owns, each naming its ``owner`` and ``shard``) and, on the front of a
``status`` of every model, those of every other live replica, asked in parallel on their hand-over subjects
(`protocol.replica_subject`) for their own rows only. A replica that does not answer within
`CommandSettings.peer_status_timeout_s` is named in the reply (which stays ``ok``) and its models are missing.
The model a request names is checked before (`autoscaler.commands.verbs.Verbs`); without a `Router` the rows are
this replica's, as before protocol revision 6.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

import msgspec
import nats.errors
from nats.aio.client import Client

from autoscaler.commands.base import CommandSettings, ControlPlane, Outcome, Router
from warmpool import protocol
from warmpool.errors import BadMessage
from warmpool.protocol import ReplicaRecord, StatusCommand, StatusReply, StatusRow

__all__ = ["StatusRows"]

log = logging.getLogger("pulsescale.commands")


class StatusRows:
    """Answers ``status``: this replica's rows, and on a front those of every other live replica."""

    def __init__(self, nc: Client, control: ControlPlane, router: Router | None, *, settings: CommandSettings) -> None:
        self.nc = nc
        self.control = control
        self.router = router
        self.settings = settings

    def _trim(self, row: StatusRow) -> StatusRow:
        if len(row.decisions) > self.settings.status_decisions:
            row = msgspec.structs.replace(row, decisions=row.decisions[-self.settings.status_decisions :])
        return row

    def _own_rows(self, model: str | None) -> list[StatusRow]:
        rows = [self._trim(row) for row in self.control.status(model)]
        if self.router is None:
            return rows
        me = self.router.identity
        # The daemon's rows name their owner and shard already; a control plane that does not, gets them here.
        return [
            row if row.owner == me else msgspec.structs.replace(row, owner=me, shard=protocol.shard_of(row.model))
            for row in rows
            if self.router.owns_model(row.model)
        ]

    async def answer(self, req: StatusCommand, now: float, *, handed: bool) -> Outcome:
        """The ``status`` reply (read-only: not remembered); its audit record keeps how many rows and which
        replicas were silent."""
        rows = self._own_rows(req.model)
        silent: list[str] = []
        replicas: list[ReplicaRecord] = []
        if self.router is not None:
            replicas = sorted(self.router.replicas(), key=lambda r: r.identity)
            if req.model is None and not handed:  # a front asking its peers: their own rows only, never on
                peers = [r.identity for r in replicas if r.identity != self.router.identity]
                answers = await asyncio.gather(*(self._peer_rows(p, req, now) for p in peers))
                for peer, peer_rows in zip(peers, answers, strict=True):
                    if peer_rows is None:
                        silent.append(peer)
                    else:
                        rows += [r if r.owner else msgspec.structs.replace(r, owner=peer) for r in peer_rows]
                rows.sort(key=lambda r: r.model)
        reply = StatusReply(models=rows, replicas=replicas, missing=silent)
        audit: dict[str, Any] = {"ok": True, "models": len(rows)}
        if silent:
            audit["silent"] = silent
        return Outcome(protocol.encode(reply), applied=True, remember=False, audit_reply=audit)

    async def _peer_rows(self, peer: str, req: StatusCommand, now: float) -> list[StatusRow] | None:
        """`peer`'s own rows, or None when it did not answer in time (or answered a refusal)."""
        bound = self.settings.peer_status_timeout_s
        ask = StatusCommand(id=uuid.uuid4().hex, expires_at=now + bound, by=req.by)
        try:
            msg = await self.nc.request(protocol.replica_subject(peer, "status"), protocol.encode(ask), timeout=bound)
            reply = protocol.decode(msg.data, StatusReply)
        except (nats.errors.Error, TimeoutError, BadMessage) as err:
            log.warning("autoscaler replica %s did not answer status: %s", peer, err or type(err).__name__)
            return None
        if not reply.ok:
            log.warning("autoscaler replica %s refused status: %s", peer, reply.error)
            return None
        return reply.models
