"""Request handling: the agent's side of ``pulse.agent.<node>.<verb>``, from the message to the reply.

One subscription per verb (`protocol.AGENT_VERBS`). Each message is handled in its own task, so a slow
activation never delays another slot or a status call: decoded into its request type, admitted (not expired,
not an id already applied), handed to the verb's handler, and answered with the typed reply the handler
returns, encoded by `protocol.encode`. What breaks the contract is counted by reason, logged at a bounded rate
and answered ``bad_message``; a handler that raises is answered ``internal``: the daemon never dies of a message.

The tasks are bounded (contract revision 3): at most `max_in_flight` requests are handled at once, and `status`
has an allowance of its own (`max_status_in_flight`) so on-call can still see the agent under a flood. A message
beyond its allowance is answered ``busy`` at once, undecoded and unrecorded (nothing was applied: a retry is
handled normally), and counted (`on_busy`).

Idempotency has two halves: an id already applied is answered from the `warmpool.ledger.RequestLedger` with its first
reply, and a repeat of a request still being applied waits for that request's reply (`_pending`) rather than
applying it twice. The handlers (activation, prewarm, status) know nothing of NATS.

Where a message came from is checked before anything else (issue 8 review): only a message published to the exact
``pulse.agent.<node>.<verb>`` subject with a reply subject in ``_INBOX.`` is handled. A JetStream consumer whose
deliver subject is ours relays KV values to us with their stream subject (``$KV...``) and a ``$JS.ACK...`` reply,
and a request whose reply names a KV subject would make our answer a write there with our permissions: both are
dropped unanswered, never applied, and counted (``subject_mismatch``, ``bad_value``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any, Final

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from warmpool import protocol
from warmpool.errors import BadMessage, DuplicateRequest
from warmpool.ledger import RequestLedger, admit
from warmpool.rejects import Rejections

__all__ = ["REPLY_PREFIX", "REPLY_TYPES", "Handler", "Requests"]

log = logging.getLogger("pulsescale.agent")

Handler = Callable[[Any, float], Awaitable[protocol.TypedReply]]
"""``handler(request, t_recv)``: the verb's typed reply; `t_recv` is `time.perf_counter()` at arrival."""

REPLY_PREFIX: Final = "_INBOX."
"""Replies go only to inboxes: any other reply subject (a KV key, a JetStream API or ack subject) is refused."""

REPLY_TYPES: Final[dict[str, type[protocol.TypedReply]]] = {
    "prewarm": protocol.PrewarmReply,
    "activate": protocol.ActivateReply,
    "deactivate": protocol.DeactivateReply,
    "status": protocol.AgentStatusReply,
}
"""The reply type of each agent verb: also the type of its refusals."""


class Requests:
    """Serves ``pulse.agent.<node>.<verb>`` with `handlers` (verb -> handler); `spawn` runs each message's task."""

    def __init__(
        self,
        nc: Client,
        node: str,
        handlers: Mapping[str, Handler],
        *,
        on_reject: Callable[[str], None],
        spawn: Callable[[Coroutine[Any, Any, Any], str], object],
        max_in_flight: int = 64,
        max_status_in_flight: int = 8,
        on_busy: Callable[[str], None] = lambda verb: None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """`clock`: this node's wall clock, which a request's `expires_at` is stated in (contract revision 10: the
        autoscaler states it in our clock, as it measures it from our heartbeats)."""
        self.nc = nc
        self.clock = clock
        self.node = node
        self.handlers = dict(handlers)
        self.spawn = spawn
        self.on_busy = on_busy
        self._limits = {"status": max_status_in_flight, "": max_in_flight}
        self.in_flight = {"status": 0, "": 0}
        """Requests being handled now, by pool: ``status`` and ``""`` (every other verb)."""
        self.ledger = RequestLedger()
        self.rejected = Rejections(log, on_reject=on_reject)
        self._pending: dict[str, asyncio.Future[bytes]] = {}
        self._subs: list[Subscription] = []

    async def subscribe(self) -> None:
        for verb in protocol.AGENT_VERBS:
            handler = self.handlers[verb]

            subject = protocol.agent_subject(self.node, verb)

            async def cb(msg: Msg, verb: str = verb, handler: Handler = handler, subject: str = subject) -> None:
                t_recv = time.perf_counter()
                if (refused := _foreign(msg, subject)) is not None:
                    self.rejected(refused, source=msg.subject)  # dropped: never answered, never applied
                    return
                pool = "status" if verb == "status" else ""
                if self.in_flight[pool] >= self._limits[pool]:
                    await self._busy(msg, verb, pool)
                    return
                self.in_flight[pool] += 1
                self.spawn(self._handle_counted(msg, verb, handler, t_recv, pool), f"{verb}-request")

            self._subs.append(await self.nc.subscribe(subject, cb=cb))

    async def unsubscribe(self) -> None:
        for sub in self._subs:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()
        self._subs = []

    async def _busy(self, msg: Msg, verb: str, pool: str) -> None:
        self.on_busy(verb)
        limit = self._limits[pool]
        what = "status requests" if pool else "requests"
        await self._respond(
            msg,
            protocol.encode(
                protocol.refusal(
                    REPLY_TYPES[verb],
                    "busy",
                    f"agent on {self.node} has {limit} {what} in flight (its limit); nothing was done, retry later",
                )
            ),
        )

    async def _handle_counted(self, msg: Msg, verb: str, handler: Handler, t_recv: float, pool: str) -> None:
        try:
            await self._handle(msg, verb, handler, t_recv)
        finally:
            self.in_flight[pool] -= 1

    async def _handle(self, msg: Msg, verb: str, handler: Handler, t_recv: float) -> None:
        try:
            req = protocol.decode(msg.data, protocol.AGENT_REQUEST_TYPES[verb])
            admit(req, self.clock(), self.ledger)
        except DuplicateRequest as dup:
            self.rejected(dup, source=msg.subject)
            await self._respond(msg, dup.reply)
            return
        except BadMessage as err:
            self.rejected(err, source=msg.subject)
            await self._respond(msg, _bad_message(verb, err))
            return
        pending = self._pending.get(req.id)
        if pending is not None:  # a repeat of a request still being applied: answer with its result
            await self._respond(msg, await asyncio.shield(pending))
            return
        fut: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._pending[req.id] = fut
        try:
            reply = protocol.encode(await handler(req, t_recv))
        except Exception as err:
            log.exception("%s request %s failed", verb, req.id)
            reply = protocol.encode(protocol.refusal(REPLY_TYPES[verb], "internal", f"{type(err).__name__}: {err}"))
        finally:
            self._pending.pop(req.id, None)
        if not fut.done():
            fut.set_result(reply)
        self.ledger.record(req, reply, self.clock())
        await self._respond(msg, reply)

    async def _respond(self, msg: Msg, reply: bytes) -> None:
        if msg.reply:
            with contextlib.suppress(nats.errors.Error):
                await msg.respond(reply)


def _foreign(msg: Msg, subject: str) -> BadMessage | None:
    """Why `msg` is not a request to handle: not published to `subject` itself (a relay through a JetStream
    consumer keeps its stream subject), or a reply subject outside `REPLY_PREFIX` (no reply, a KV key, an ack)."""
    if msg.subject != subject:
        return BadMessage("subject_mismatch", f"delivered to {subject} from subject {msg.subject!r}; dropped")
    if not msg.reply.startswith(REPLY_PREFIX):
        return BadMessage(
            "bad_value", f"reply subject {msg.reply[:120]!r} is not an inbox ({REPLY_PREFIX}...); dropped unanswered"
        )
    return None


def _bad_message(verb: str, err: BadMessage) -> bytes:
    """``bad_message``, with the rejection reason in `reason`."""
    return protocol.encode(protocol.refusal(REPLY_TYPES[verb], "bad_message", str(err), reason=err.reason))
