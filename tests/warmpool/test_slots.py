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


# Every change the lifecycle allows, and who makes it. A change to the table must change this spec too: the agent,
# the registry and the controller all rely on both what is allowed and what is refused.
ALLOWED: dict[tuple[str, str], str] = {
    ("prewarming", "prewarming"): "agent: staging progress (a field update)",
    ("prewarming", "warm"): "agent: staged and armed, now offered",
    ("prewarming", "failed"): "agent: staging failed (bad weights, no shm)",
    ("prewarming", "draining"): "agent: staged on a drained node: ready, not offered",
    ("warm", "warm"): "agent: residency or endpoint update",
    ("warm", "claimed"): "a claimer: the one way into service",
    ("warm", "prewarming"): "agent: a re-stage (new weights version)",
    ("warm", "failed"): "agent: its armed engine died or its weights were damaged",
    ("warm", "draining"): "agent: re-armed on a drained node",
    ("claimed", "claimed"): "holder: the claim's token written",
    ("claimed", "activating"): "agent, as the holder: activation starts",
    ("claimed", "releasing"): "holder: a give-back through the served path",
    ("claimed", "warm"): "holder: given back before it activated",
    ("claimed", "failed"): "agent: the slot broke under the claim; or released while its agent was away",
    ("claimed", "draining"): "holder: given back on a node drained meanwhile",
    ("activating", "activating"): "holder: a field update",
    ("activating", "ready"): "agent, as the holder: the engine answers",
    ("activating", "releasing"): "holder: gave up on an activation (deadline, scale-down)",
    ("activating", "failed"): "agent: the activation broke the slot",
    ("ready", "ready"): "holder: endpoint update",
    ("ready", "releasing"): "holder: scale-down of a serving replica",
    ("ready", "failed"): "agent: the serving engine died",
    ("releasing", "releasing"): "holder: a field update",
    ("releasing", "warm"): "holder: the engine stopped, the slot is offered again",
    ("releasing", "draining"): "holder: stopped on a drained node",
    ("releasing", "failed"): "agent or holder: stopping failed, or the agent was away",
    ("failed", "failed"): "agent: a new reason",
    ("failed", "prewarming"): "agent: a prewarm retries a failed slot",
    ("failed", "warm"): "agent: back after an outage, re-armed",
    ("failed", "draining"): "agent: back on a drained node",
    ("draining", "draining"): "a field update",
    ("draining", "warm"): "agent: re-armed after an undrain",
    ("draining", "prewarming"): "agent: a re-stage on a drained node",
    ("draining", "failed"): "agent: the slot broke while drained",
}
# Everything else is refused; why, per source state:
REFUSED: dict[str, str] = {
    "prewarming": "not staged: nothing to claim, activate, serve or release",
    "warm": "activation starts from a claim (its fencing token), and nothing is held to release",
    "claimed": "re-staging would pull the weights from its holder; ready without activating has no engine",
    "activating": "an engine may be running: out only through releasing or failed; drain waits for the release",
    "ready": "a serving engine leaves only through releasing (or dies: failed)",
    "releasing": "only a warm slot is claimed again; a re-stage waits until it is given back",
    "failed": "re-armed (prewarming or warm) before it is offered, claimed or served again",
    "draining": "a drained slot is not offered: no claim, activation or serving",
}


def test_the_lifecycle_table_edge_by_edge() -> None:
    states = sorted(protocol.SLOT_STATES)
    assert set(REFUSED) == set(states)
    for a, b in itertools.product(states, states):
        try:
            slots.check_transition(a, b)  # type: ignore[arg-type]
            moved = True
        except InvalidTransition as err:
            assert f"from {a} to {b}" in str(err)
            moved = False
        why = ALLOWED.get((a, b), f"refused: {REFUSED[a]}")
        assert moved == ((a, b) in ALLOWED), f"{a} -> {b} ({why})"


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
    lease = AgentLease(node="n", slots=["s"], heartbeat_at=100.0, lease_s=2.0)
    assert slots.claimable(rec, lease, 101.0)
    assert not slots.claimable(rec, AgentLease(node="n", slots=["t"], heartbeat_at=100.0, lease_s=2.0), 101.0)
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


def test_a_refused_change_names_the_states_it_may_go_to() -> None:
    """The refusal an operator reads lists what the slot may do instead, from the spec above, in order."""
    for a, b in (("warm", "ready"), ("ready", "claimed"), ("draining", "activating")):
        allowed = ", ".join(sorted(to for (frm, to) in ALLOWED if frm == a))
        with pytest.raises(InvalidTransition) as err:
            slots.check_transition(a, b)  # type: ignore[arg-type]
        assert str(err.value) == f"a slot cannot go from {a} to {b} (from {a}: {allowed})"
    with pytest.raises(InvalidTransition) as err:
        slots.check_transition("ready", "warm")
    assert str(err.value) == "a slot cannot go from ready to warm (from ready: failed, ready, releasing)"


def test_claimable_takes_the_reader_s_verdict_on_the_lease_over_its_stamp() -> None:
    """`fresh` is when the reader heard the lease (contract revision 10), not the agent's own stamp: an agent
    whose clock runs behind stamps a lease that looks lapsed but was heard just now, and a lease stamped fresh by
    a clock running ahead may not have been heard for long."""
    rec = SlotRecord(model="m", node="n", slot="s", state="warm")
    lease = AgentLease(node="n", slots=["s"], heartbeat_at=100.0, lease_s=2.0)
    assert lease.fresh(101.0) and not lease.fresh(200.0)
    assert not slots.claimable(rec, lease, 101.0, fresh=False)  # fresh by its stamp, not heard: refused
    assert slots.claimable(rec, lease, 200.0, fresh=True)  # lapsed by its stamp, heard: claimable
    assert slots.claimable(rec, lease, 101.0, fresh=None) and not slots.claimable(rec, lease, 200.0, fresh=None)
    # The verdict is about the lease only: the slot must still be warm, undrained and listed.
    assert not slots.claimable(SlotRecord(model="m", node="n", slot="s", state="ready"), lease, 200.0, fresh=True)
    assert not slots.claimable(
        SlotRecord(model="m", node="n", slot="s", state="warm", drain=True), lease, 200.0, fresh=True
    )
    assert not slots.claimable(SlotRecord(model="m", node="n", slot="t", state="warm"), lease, 200.0, fresh=True)
    assert not slots.claimable(rec, None, 101.0, fresh=True)
