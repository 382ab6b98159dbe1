"""The slot lifecycle table and the claimable rule."""

from __future__ import annotations

import itertools

import pytest

from warmpool import protocol, slots
from warmpool.errors import InvalidTransition
from warmpool.protocol import AgentLease, SlotRecord

HAPPY_PATH = ["prewarming", "warm", "claimed", "activating", "ready", "releasing", "warm"]


def test_table_covers_every_state() -> None:
    assert set(slots.TRANSITIONS) == set(protocol.SLOT_STATES)
    for targets in slots.TRANSITIONS.values():
        assert targets <= set(protocol.SLOT_STATES)


def test_happy_path_is_allowed() -> None:
    for a, b in itertools.pairwise(HAPPY_PATH):
        slots.check_transition(a, b)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("warm", "ready"),
        ("warm", "activating"),
        ("claimed", "ready"),
        ("ready", "warm"),
        ("ready", "claimed"),
        ("prewarming", "claimed"),
        ("failed", "claimed"),
        ("draining", "claimed"),
        ("activating", "warm"),
    ],
)
def test_shortcuts_are_refused(a: str, b: str) -> None:
    with pytest.raises(InvalidTransition, match=f"from {a} to {b}"):
        slots.check_transition(a, b)  # type: ignore[arg-type]


def test_every_state_can_fail_and_only_warm_is_claimed() -> None:
    for state in protocol.SLOT_STATES:
        assert "failed" in slots.TRANSITIONS[state]  # type: ignore[index]
        if state != "claimed":
            assert ("claimed" in slots.TRANSITIONS[state]) == (state == "warm")  # type: ignore[index]


def test_claimable_needs_warm_fresh_lease_and_no_drain() -> None:
    rec = SlotRecord(model="m", node="n", slot="s", state="warm")
    lease = AgentLease(node="n", heartbeat_at=100.0, lease_s=2.0)
    assert slots.claimable(rec, lease, 101.0)
    assert slots.claimable(rec, lease, 102.0)
    assert not slots.claimable(rec, lease, 102.01)  # lease lapsed
    assert not slots.claimable(rec, None, 101.0)  # no agent
    for state in protocol.SLOT_STATES:
        if state != "warm":
            assert not slots.claimable(SlotRecord(model="m", node="n", slot="s", state=state), lease, 101.0)
    drained = SlotRecord(model="m", node="n", slot="s", state="warm", drain=True)
    assert not slots.claimable(drained, lease, 101.0)
    assert slots.release_target(drained) == "draining" and slots.release_target(rec) == "warm"


@pytest.mark.parametrize(
    ("current", "wanted", "drain", "want"),
    [
        ("prewarming", "warm", False, "warm"),  # staged and armed
        ("prewarming", "warm", True, "draining"),  # ready again on a drained node: not offered
        ("warm", "prewarming", False, "prewarming"),  # a re-stage
        ("failed", "prewarming", False, "prewarming"),  # a prewarm retries a failed slot
        ("draining", "warm", True, "draining"),
        ("claimed", "warm", False, None),  # a held slot is its holder's to move on
        ("activating", "prewarming", False, None),
        ("ready", "warm", False, None),
        ("releasing", "warm", False, None),
        ("ready", "failed", False, "failed"),  # ... but the agent may fail it (its engine died)
        ("claimed", "failed", True, "failed"),
        ("warm", "ready", False, None),  # not in the table
        ("prewarming", "claimed", False, None),
    ],
)
def test_agent_target(current: str, wanted: str, drain: bool, want: str | None) -> None:
    assert slots.agent_target(current, wanted, drain=drain) == want  # type: ignore[arg-type]


def test_agent_target_never_leaves_the_table() -> None:
    for current, wanted, drain in itertools.product(protocol.SLOT_STATES, protocol.SLOT_STATES, (False, True)):
        target = slots.agent_target(current, wanted, drain=drain)
        if target is not None:
            slots.check_transition(current, target)
            assert current not in slots.HELD_STATES or target == "failed"
