"""Placement: which warm slot a claim tries first (`rank` over records, `pick` over the registry's indexes).

`tests/test_registry.py::test_placement_pick_matches_rank` checks that the two agree on random pools; these
tables pin what each preference is for.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from warmpool import placement
from warmpool.protocol import SlotRecord, SlotState


def rec(
    node: str,
    slot: str = "s0",
    *,
    weights: bool = False,
    rootfs: bool = False,
    rack: str = "",
    state: SlotState = "warm",
) -> SlotRecord:
    return SlotRecord(
        model="m", node=node, slot=slot, state=state, rack=rack, weights_resident=weights, rootfs_mounted=rootfs
    )


@pytest.mark.parametrize(
    ("weights", "rootfs", "tier"),
    [
        (True, True, 0),  # activation is only the device copy and the engine start
        (True, False, 1),  # the weights are the gigabytes: resident weights beat a mounted rootfs ...
        (False, True, 2),  # ... and a mounted rootfs still beats neither (no image to mount)
        (False, False, 3),
    ],
)
def test_tier_prefers_resident_weights_then_a_mounted_rootfs(weights: bool, rootfs: bool, tier: int) -> None:
    assert placement.tier(rec("n", weights=weights, rootfs=rootfs)) == tier


def test_rank_puts_the_cheapest_activation_first_whatever_the_load() -> None:
    neither, rootfs, weights, both = (
        rec("n0", weights=False, rootfs=False),
        rec("n1", weights=False, rootfs=True),
        rec("n2", weights=True, rootfs=False),
        rec("n3", weights=True, rootfs=True),
    )
    # n3 already serves two replicas: a cheaper activation still wins over spreading (the tier comes first).
    held = [rec("n3", "h0", state="ready"), rec("n3", "h1", state="ready")]
    for seed in range(20):
        ranked = placement.rank([neither, rootfs, weights, both], held, random.Random(seed))
        assert ranked == [both, weights, rootfs, neither]


def test_loads_count_only_slots_held_by_a_claim() -> None:
    in_service = [
        rec("n1", "a", rack="r1", state="claimed"),
        rec("n1", "b", rack="r1", state="activating"),
        rec("n2", "c", rack="r1", state="ready"),
        rec("n2", "d", rack="r1", state="releasing"),
        # Not serving and not about to: they take no capacity of this model out when their node fails.
        rec("n3", "e", rack="r2", state="warm"),
        rec("n3", "f", rack="r2", state="failed"),
        rec("n3", "g", rack="r2", state="draining"),
        rec("n3", "h", rack="r2", state="prewarming"),
    ]
    node_load, rack_load = placement.loads(in_service)
    assert node_load == Counter({"n1": 2, "n2": 2})
    assert rack_load == Counter({"r1": 4})


def test_rank_spreads_over_nodes_then_racks() -> None:
    busy_node = rec("n1", rack="r1")
    busy_rack = rec("n2", rack="r1")
    free = rec("n3", rack="r2")
    held = [rec("n1", "h0", rack="r1", state="ready")]
    for seed in range(20):
        ranked = placement.rank([busy_node, busy_rack, free], held, random.Random(seed))
        # n2 and n3 hold nothing; n3's rack holds nothing either: one rack failing takes out the least.
        assert ranked == [free, busy_rack, busy_node]
    # The node comes before the rack: a free node in a busy rack beats a busy node in a free rack.
    held = [rec(n, "h", rack=r, state="ready") for n, r in [("n1", "r1"), ("n5", "r1"), ("n4", "r2")]]
    in_busy_rack, on_busy_node = rec("n2", rack="r1"), rec("n4", rack="r2")
    for seed in range(20):
        assert placement.rank([on_busy_node, in_busy_rack], held, random.Random(seed)) == [in_busy_rack, on_busy_node]


def test_equal_slots_are_tried_in_random_order() -> None:
    # Concurrent claimers must spread over equal slots, not all race for the first (each lost race costs a trip).
    slots = [rec(f"n{i}") for i in range(4)]
    firsts = {placement.rank(slots, [], random.Random(seed))[0].node for seed in range(40)}
    assert firsts == {"n0", "n1", "n2", "n3"}


def _pick(
    warm: dict[int, dict[str, set[str]]],
    *,
    seed: int = 0,
    node_load: dict[str, int] | None = None,
    rack_load: dict[str, int] | None = None,
    rack_of: dict[str, str] | None = None,
    stale: set[str] | frozenset[str] = frozenset(),
    skip: set[str] | frozenset[str] = frozenset(),
) -> str | None:
    return placement.pick(
        warm,
        rack_of=rack_of or {},
        node_load=node_load or {},
        rack_load=rack_load or {},
        usable=lambda node, keys: () if node in stale else keys,
        skip=skip,
        rng=random.Random(seed),
    )


@pytest.mark.parametrize(
    ("name", "warm", "kw", "want"),
    [
        ("the best tier first", {1: {"a": {"a.1"}}, 0: {"b": {"b.1"}}}, {}, {"b.1"}),
        # A node whose agent lease lapsed is skipped, even when it is the least loaded of the tier.
        (
            "a stale node ahead of a good one",
            {0: {"a": {"a.1"}, "b": {"b.1"}}},
            {"stale": {"a"}, "node_load": {"b": 3}},
            {"b.1"},
        ),
        # A node all of whose slots were tried (lost races) is skipped, however good its score.
        (
            "an already-tried node ahead of a good one",
            {0: {"a": {"a.1"}, "b": {"b.1"}}},
            {"skip": {"a.1"}, "node_load": {"b": 3}},
            {"b.1"},
        ),
        # On a node with one slot tried and one not, the untried one.
        ("the untried slot of a node", {0: {"a": {"a.1", "a.2"}}}, {"skip": {"a.1"}}, {"a.2"}),
        ("an empty node entry", {0: {"a": set(), "b": {"b.1"}}}, {}, {"b.1"}),
        # Nothing usable in the best tier: the next tier, not nothing.
        ("falls through to the next tier", {0: {"a": {"a.1"}}, 2: {"b": {"b.1"}}}, {"stale": {"a"}}, {"b.1"}),
        ("the least loaded node", {0: {"a": {"a.1"}, "b": {"b.1"}}}, {"node_load": {"a": 2, "b": 1}}, {"b.1"}),
        (
            "then the least loaded rack",
            {0: {"a": {"a.1"}, "b": {"b.1"}}},
            {"rack_of": {"a": "r1", "b": "r2"}, "rack_load": {"r1": 1}},
            {"b.1"},
        ),
        (
            "the node before the rack",
            {0: {"a": {"a.1"}, "b": {"b.1"}}},
            {"rack_of": {"a": "r1", "b": "r2"}, "node_load": {"b": 1}, "rack_load": {"r1": 5}},
            {"a.1"},
        ),
        (
            # A node the rack index does not know is in the unnamed rack, as its records say (rack ""): it shares
            # that rack's load, as `rank` counts it.
            "a node of unknown rack counts with the rack-less ones",
            {0: {"a": {"a.1"}, "b": {"b.1"}}},
            {"rack_of": {"b": "r2"}, "rack_load": {"": 3, "r2": 1}},
            {"b.1"},
        ),
        ("nothing eligible", {0: {"a": {"a.1"}}, 1: {"b": {"b.1"}}}, {"stale": {"a", "b"}}, {None}),
        ("everything tried", {0: {"a": {"a.1"}}}, {"skip": {"a.1"}}, {None}),
        ("an empty pool", {}, {}, {None}),
    ],
)
def test_pick(name: str, warm: dict[int, dict[str, set[str]]], kw: dict[str, object], want: set[str | None]) -> None:
    for seed in range(10):  # whatever the tie-break draws
        assert _pick(warm, seed=seed, **kw) in want, name  # type: ignore[arg-type]


def test_pick_spreads_over_equal_nodes_and_their_slots() -> None:
    warm = {0: {"a": {"a.1", "a.2"}, "b": {"b.1", "b.2"}}}
    picked = {_pick(warm, seed=seed) for seed in range(60)}
    assert picked == {"a.1", "a.2", "b.1", "b.2"}
