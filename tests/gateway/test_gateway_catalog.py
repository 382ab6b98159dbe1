"""The gateway's catalog as pure tables (`gateway.catalog`): which models it serves, and when a queue may go; and the
body budget's books (`gateway.budget`)."""

from __future__ import annotations

import pytest

from gateway.budget import BodyBudget, Hold
from gateway.catalog import Catalog, ScalersState, Verdict


@pytest.mark.parametrize(
    ("fixed", "scaled", "state", "model", "ready", "verdict"),
    [
        (frozenset({"a"}), (), "off", "a", False, "known"),
        (frozenset({"a"}), (), "off", "b", True, "unknown"),  # --models is the whole list, ready slot or not
        (None, ("a",), "listed", "a", False, "known"),  # a ScaledObject: known with no slot (scale from zero)
        (None, ("a",), "listed", "b", True, "known"),  # a ready slot vouches for its model
        (None, ("a",), "listed", "junk", False, "unknown"),
        (None, (), "absent", "junk", False, "unknown"),  # no bucket: no ScaledObject anywhere
        (None, (), "listing", "junk", False, "undecided"),  # not read yet: a model scaled to zero or junk?
        (None, (), "unreadable", "junk", False, "undecided"),
    ],
)
def test_catalog_verdicts(
    fixed: frozenset[str] | None,
    scaled: tuple[str, ...],
    state: ScalersState,
    model: str,
    ready: bool,
    verdict: Verdict,
) -> None:
    c = Catalog(fixed)
    if state == "listed":
        c.set_scaled(scaled)
    elif state != "off":
        c.set_scalers(state)
    assert c.verdict(model, ready=ready) == verdict


@pytest.mark.parametrize(
    ("model", "busy", "ready", "idle_for_s", "reclaimable"),
    [
        ("gone", False, False, 0.0, True),  # no longer known: as soon as it is idle
        ("gone", True, False, 999.0, False),  # requests wait or are in flight
        ("gone", False, True, 999.0, False),  # a ready slot
        ("a", False, False, 299.0, False),  # known, idle less than queue_idle_s
        ("a", False, False, 300.0, True),
        ("fixed", False, False, 1e9, False),  # --models queues live as long as the gateway
    ],
)
def test_catalog_reclaims_idle_queues(
    model: str, busy: bool, ready: bool, idle_for_s: float, reclaimable: bool
) -> None:
    c = Catalog(None)
    c.set_scaled(["a"])
    fixed = Catalog(frozenset({"fixed"}))
    cat = fixed if model == "fixed" else c
    assert cat.reclaimable(model, busy=busy, ready=ready, idle_for_s=idle_for_s, queue_idle_s=300.0) is reclaimable


def test_body_budget_holds_are_released_once_and_a_retry_may_overdraw() -> None:
    budget = BodyBudget(limit_bytes=100)
    a, b = Hold(budget), Hold(budget)
    assert a.take(60) and not b.take(50) and b.take(40)
    assert budget.held_bytes == 100
    a.release()
    a.release()  # every way out releases: only the first counts
    assert budget.held_bytes == 40
    b.release()
    b.force(150)  # a retried request waits again whatever the limit: it was admitted
    assert budget.held_bytes == 150 and not a.take(1)
    b.release()
    assert budget.held_bytes == 0
