"""The slot lifecycle as one table, and the pure rules built on it.

``prewarming → warm → claimed → activating → ready → releasing → warm``, plus ``failed`` (with a reason) and
``draining`` (its node is drained: finish serving, then stop offering the slot). Every change is a KV
compare-and-set in `registry`; this module only says which changes exist and which slots are claimable.
"""

from __future__ import annotations

from typing import Final

from warmpool.errors import InvalidTransition
from warmpool.protocol import AgentLease, SlotRecord, SlotState

__all__ = ["HELD_STATES", "TRANSITIONS", "agent_target", "check_transition", "claimable", "release_target"]

# from-state -> the states it may move to. Self-loops are field updates (endpoint, residency, drain flag).
TRANSITIONS: Final[dict[SlotState, frozenset[SlotState]]] = {
    "prewarming": frozenset({"prewarming", "warm", "failed", "draining"}),
    "warm": frozenset({"warm", "claimed", "prewarming", "failed", "draining"}),
    "claimed": frozenset({"claimed", "activating", "releasing", "warm", "failed", "draining"}),
    "activating": frozenset({"activating", "ready", "releasing", "failed"}),
    "ready": frozenset({"ready", "releasing", "failed"}),
    "releasing": frozenset({"releasing", "warm", "draining", "failed"}),
    "failed": frozenset({"failed", "prewarming", "warm", "draining"}),
    "draining": frozenset({"draining", "warm", "prewarming", "failed"}),
}

# States in which a claim (claim_id + token) holds the slot; only its holder may move it on.
HELD_STATES: Final[frozenset[SlotState]] = frozenset({"claimed", "activating", "ready", "releasing"})


def check_transition(current: SlotState, target: SlotState) -> None:
    if target not in TRANSITIONS[current]:
        allowed = ", ".join(sorted(TRANSITIONS[current]))
        raise InvalidTransition(f"a slot cannot go from {current} to {target} (from {current}: {allowed})")


def release_target(record: SlotRecord) -> SlotState:
    """Where a released slot goes: back to `warm`, or to `draining` when its node was drained meanwhile."""
    return "draining" if record.drain else "warm"


def claimable(record: SlotRecord, lease: AgentLease | None, now: float, *, fresh: bool | None = None) -> bool:
    """A slot may be claimed only while warm, not drained, and its agent's lease is fresh at `now` and lists it:
    the node's agent user can write any key under its node, so a record alone is no proof that a slot exists.
    `fresh` is the reader's verdict on the lease (contract revision 10: by when it heard it,
    `warmpool.agentclocks`); None: the lease is judged by its stamp at `now` (`AgentLease.fresh`)."""
    return (
        record.state == "warm"
        and not record.drain
        and lease is not None
        and (lease.fresh(now) if fresh is None else fresh)
        and record.slot in lease.slots
    )


def agent_target(current: SlotState, wanted: SlotState, *, drain: bool) -> SlotState | None:
    """The state a node agent's own write moves a slot to, when the slot is `current` and the agent wants it
    `wanted` (its staging, arming or failure says so); None: the agent leaves the slot alone.

    A held slot belongs to its claim's holder, so the agent only ever fails it (its engine died, its weights are
    damaged). A slot of a drained node that is ready again goes to `draining`, not `warm`: ready, not offered.
    Anything else follows the lifecycle table.
    """
    if wanted == "failed":
        return "failed"
    if current in HELD_STATES:
        return None
    target: SlotState = "draining" if wanted == "warm" and drain else wanted
    return target if target in TRANSITIONS[current] else None
