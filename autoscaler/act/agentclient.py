"""The autoscaler's client of the node agents' verbs (``pulse.agent.<node>.activate`` / ``.deactivate``).

It builds the contract's requests from a held claim — `ActivateRequest` and `DeactivateRequest` carry both halves
of the claim (the fencing token and the claim id), a fresh request id, and an expiry — and decodes the typed
replies, `ActivateReply` and `DeactivateReply`. A reply that came back is returned as it is, failed or not: the
caller branches on its ``error.code`` (one of `protocol.ErrorCode`), never on message text. No reply at all (no
agent subscribed, no answer in time, an answer that breaks the contract) raises `AgentUnavailable`.

The agent judges a request's `expires_at` and `deadline` on its own clock, so they are stated in the agent's clock
(contract revision 10): our time plus the agent's clock skew as its heartbeats show it (`skew(node)`, the
registry's `KvSlotStore.clock_skew`; 0 until one was heard). An agent seconds or minutes off then refuses what is
late and accepts what is not, whatever its revision, and a request buffered through a reconnect still expires. An
activation also carries its deadline as seconds (`deadline_s`), which an agent of revision 10 times from arrival
on its monotonic clock.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import TypeVar

import nats.errors
from nats.aio.client import Client

from warmpool import protocol
from warmpool.errors import BadMessage, PulsescaleError
from warmpool.protocol import ActivateReply, ActivateRequest, DeactivateReply, DeactivateRequest
from warmpool.registry import Claim

__all__ = ["AgentClient", "AgentUnavailable", "AgentUnsubscribed"]

Reply = TypeVar("Reply", ActivateReply, DeactivateReply)


class AgentUnavailable(PulsescaleError):
    """The agent gave no usable answer: nobody subscribed, no answer in time, or a reply that breaks the contract.
    The slot's state is unknown; the caller releases its claim (fenced) rather than wait longer."""

    code = "agent_unavailable"


class AgentUnsubscribed(AgentUnavailable):
    """Nobody is subscribed to the agent's verb (NATS no responders): the agent is dead or not connected, whatever
    its lease still says. The caller stops offering the node's slots until it heartbeats again."""


class AgentClient:
    def __init__(
        self,
        nc: Client,
        *,
        clock: Callable[[], float] = time.time,
        skew: Callable[[str], float | None] = lambda node: None,
    ) -> None:
        """`skew(node)`: how far that node's clock is ahead of `clock` (seconds; None: not measured)."""
        self.nc = nc
        self.clock = clock
        self.skew = skew

    def _agent_time(self, node: str) -> float:
        """Now on `node`'s clock, as far as its heartbeats tell."""
        return self.clock() + (self.skew(node) or 0.0)

    async def activate(self, claim: Claim, *, deadline_s: float) -> ActivateReply:
        """Ask the slot's agent to take it into service within `deadline_s` (the request carries the deadline, so
        the agent gives up at the same moment we stop waiting)."""
        deadline = self.clock() + deadline_s
        agent_deadline = self._agent_time(claim.node) + deadline_s
        req = ActivateRequest(
            id=uuid.uuid4().hex,
            expires_at=agent_deadline,
            slot=claim.slot,
            token=claim.token,
            claim_id=claim.claim_id,
            deadline=agent_deadline,
            deadline_s=deadline_s,
        )
        data = await self._request(claim.node, "activate", protocol.encode(req), max(0.01, deadline - self.clock()))
        if data is None:
            raise AgentUnavailable(f"no answer from {claim.node} within the {deadline_s} s deadline")
        return self._decode(claim.node, data, ActivateReply)

    async def deactivate(self, claim: Claim, *, timeout_s: float) -> DeactivateReply:
        """Ask the slot's agent to take it out of service (stop its engine, give the slot back)."""
        req = DeactivateRequest(
            id=uuid.uuid4().hex,
            expires_at=self._agent_time(claim.node) + timeout_s,
            slot=claim.slot,
            token=claim.token,
            claim_id=claim.claim_id,
        )
        data = await self._request(claim.node, "deactivate", protocol.encode(req), timeout_s)
        if data is None:
            raise AgentUnavailable(f"no answer from {claim.node} to deactivate within {timeout_s} s")
        return self._decode(claim.node, data, DeactivateReply)

    async def _request(self, node: str, verb: str, payload: bytes, timeout_s: float) -> bytes | None:
        """The reply's bytes, or None when it timed out."""
        try:
            msg = await self.nc.request(protocol.agent_subject(node, verb), payload, timeout=timeout_s)
        except nats.errors.NoRespondersError:
            raise AgentUnsubscribed(f"agent {node} is not answering (nobody subscribed to {verb})") from None
        except (nats.errors.TimeoutError, TimeoutError):
            return None
        except nats.errors.Error as err:  # disconnected, connection closed, ...
            raise AgentUnavailable(f"cannot reach agent {node}: {err}") from None
        return bytes(msg.data)

    @staticmethod
    def _decode(node: str, data: bytes, type_: type[Reply]) -> Reply:
        try:
            return protocol.decode(data, type_)
        except BadMessage as err:
            raise AgentUnavailable(f"unreadable reply from {node}: {err}") from None
