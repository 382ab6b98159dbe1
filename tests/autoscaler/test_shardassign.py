"""The deciding half of the shard leases, pure: `assign` pinned by value, and `ShardAssignment` over a hand-made
view of `pulse_leases` (no broker: tests/autoscaler/test_shards.py runs the whole protocol against a real nats-server).

Every replica computes the plan on its own, so two versions of the autoscaler side by side during a rolling
upgrade must compute the same one: the fixed plans below fail on any change of the rule (the hash, the input it
hashes, the order of the members, the quotas), which would split the shards two ways at once.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable

import pytest

from autoscaler.shards.assign import FORGET_AFTER_LEASES, ShardAssignment, assign
from warmpool import protocol
from warmpool.protocol import LeaderLease, ReplicaRecord

# --- assign, by value ------------------------------------------------------------------------------------------------


def blake(text: str) -> bytes:
    """The documented weight of a (member, shard) pair: blake2b, 8 bytes, of ``member NUL shard``."""
    return hashlib.blake2b(text.encode(), digest_size=8).digest()


def test_the_plan_of_two_members_over_three_shards_follows_the_rule_by_hand() -> None:
    """a before b (a's order weight, of shard -1, is the smaller), so a has the one extra shard: room a 2, b 1.
    Pairs heaviest first: a/2, a/1 (a is full), b/1 and b/2 (taken), a/0 (no room), b/0."""
    assert blake("a\x00-1") < blake("b\x00-1")
    pairs = sorted(((blake(f"{m}\x00{s}"), s, m) for m in "ab" for s in range(3)), reverse=True)
    assert [(m, s) for _, s, m in pairs] == [("a", 2), ("a", 1), ("b", 1), ("b", 2), ("a", 0), ("b", 0)]
    assert assign(3, ["b", "a"]) == {2: "a", 1: "a", 0: "b"}
    assert assign(3, ["a"]) == {0: "a", 1: "a", 2: "a"}
    assert assign(0, ["a", "b"]) == {}
    # More members than shards: the first in the order get one each, the others none.
    assert assign(1, ["a", "b"]) == {0: "a"}


# What every version must compute for these fleets (protocol.SHARDS = 32): 32 = 11 + 11 + 10, then 4 x 8.
THREE = ["autoscaler-0", "autoscaler-1", "autoscaler-2"]
THREE_PLAN = {
    "autoscaler-0": [0, 2, 4, 9, 13, 15, 21, 23, 25, 30, 31],
    "autoscaler-1": [5, 6, 11, 14, 16, 17, 18, 19, 24, 27],
    "autoscaler-2": [1, 3, 7, 8, 10, 12, 20, 22, 26, 28, 29],
}
FOUR_PLAN = {
    "autoscaler-0": [0, 2, 9, 13, 15, 21, 25, 31],
    "autoscaler-1": [5, 6, 11, 16, 17, 18, 24, 27],
    "autoscaler-2": [1, 3, 7, 10, 20, 22, 26, 28],
    "autoscaler-3": [4, 8, 12, 14, 19, 23, 29, 30],
}


def _by_member(plan: dict[int, str]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for shard in sorted(plan):
        out.setdefault(plan[shard], []).append(shard)
    return out


def _reference(shards: int, members: Iterable[str]) -> dict[int, str]:
    """The rule as `assign`'s docstring states it, written out again: members ordered by the weight of shard -1
    (then name), quotas shards // n with the first shards % n one more, pairs taken heaviest first."""
    order = sorted(set(members), key=lambda m: (blake(f"{m}\x00-1"), m))
    quota = {m: shards // len(order) + (1 if i < shards % len(order) else 0) for i, m in enumerate(order)}
    plan: dict[int, str] = {}
    for _, shard, m in sorted(((blake(f"{m}\x00{s}"), s, m) for s in range(shards) for m in order), reverse=True):
        if shard not in plan and quota[m]:
            plan[shard] = m
            quota[m] -= 1
    return plan


@pytest.mark.parametrize(("members", "want"), [(THREE, THREE_PLAN), ([*THREE, "autoscaler-3"], FOUR_PLAN)])
def test_the_shard_plan_is_fixed_by_value(members: list[str], want: dict[str, list[int]]) -> None:
    assert protocol.SHARDS == 32
    assert _by_member(_reference(protocol.SHARDS, members)) == want  # the literal is the documented rule's
    assert _by_member(assign(protocol.SHARDS, members)) == want
    assert _by_member(assign(protocol.SHARDS, reversed(members))) == want


def test_the_member_that_goes_without_the_extra_shard_is_fixed_by_the_order_weight() -> None:
    """32 over 3: the two first in the order (shard -1's weight) hold 11, the last 10, whatever the names sort."""
    order = sorted(THREE, key=lambda m: blake(f"{m}\x00-1"))
    counts = {m: len(s) for m, s in _by_member(assign(protocol.SHARDS, THREE)).items()}
    assert [counts[m] for m in order] == [11, 11, 10]
    assert order[-1] != max(THREE)  # not the name order: the rule is the hash's


# --- ShardAssignment over a hand-made view ----------------------------------------------------------------------------


class View:
    """What `ShardAssignment` reads of `pulse_leases`: key -> value (a decoded lease or record, or anything else for
    a value that did not decode) with its revision, in insertion order."""

    def __init__(self, entries: dict[str, object]) -> None:
        self.data = {key: (value, rev) for rev, (key, value) in enumerate(entries.items(), start=1)}

    def value(self, key: str) -> object:
        return self.data.get(key, (None, 0))[0]

    def entries(self) -> list[tuple[str, object, int]]:
        return [(key, value, rev) for key, (value, rev) in self.data.items()]

    def __contains__(self, key: object) -> bool:
        return key in self.data


def record(identity: str, renewed_at: float, lease_s: float = 1.0) -> ReplicaRecord:
    return ReplicaRecord(identity=identity, renewed_at=renewed_at, lease_s=lease_s, started_at=0.0)


def lease(holder: str, renewed_at: float, lease_s: float = 1.0) -> LeaderLease:
    return LeaderLease(holder=holder, renewed_at=renewed_at, lease_s=lease_s)


def rkey(identity: str) -> str:
    return protocol.REPLICA_KEY_PREFIX + identity


def test_replicas_are_the_live_records_sorted_by_identity() -> None:
    view = View(
        {
            rkey("b"): record("b", 10.0, 2.0),  # live until 12 inclusive
            rkey("a"): record("a", 11.0, 1.0),  # live until 12 inclusive
            rkey("c"): record("c", 5.0, 2.0),  # lapsed at 7
            rkey("x"): lease("x", 11.0),  # not a record: ignored
            "other.d": record("d", 11.0),  # not under the replica prefix: ignored
            protocol.shard_key(0): lease("a", 11.0),
        }
    )
    sa = ShardAssignment("a", protocol.SHARDS, view)
    assert [r.identity for r in sa.replicas(6.0)] == ["a", "b", "c"]
    assert [r.identity for r in sa.replicas(12.0)] == ["a", "b"]
    assert [r.identity for r in sa.replicas(12.01)] == []


def test_holder_is_the_live_holder_of_a_shard_lease_other_than_us() -> None:
    view = View(
        {
            protocol.shard_key(1): lease("other", 10.0),
            protocol.shard_key(2): lease("me", 10.0),
            protocol.shard_key(4): record("other", 10.0),  # a value that is no lease reads as none
        }
    )
    sa = ShardAssignment("me", protocol.SHARDS, view)
    assert sa.holder(1, 11.0) == "other"  # its last instant
    assert sa.holder(1, 11.01) is None
    assert sa.holder(2, 10.5) is None  # ours
    assert sa.holder(3, 10.5) is None  # no lease
    assert sa.holder(4, 10.5) is None


def test_next_lapse_is_the_first_end_of_another_replicas_record_or_shard_lease() -> None:
    view = View(
        {
            rkey("b"): record("b", 11.0),  # ends 12
            rkey("me"): record("me", 9.5),  # ours: ends 10.5, not counted
            protocol.shard_key(1): lease("b", 10.5),  # ends 11.5
            protocol.shard_key(2): lease("me", 10.0),  # ours: ends 11, not counted
            protocol.LEADER_LEASE_KEY: lease("b", 10.0, 0.25),  # not a shard lease: ends 10.25, not counted
        }
    )
    sa = ShardAssignment("me", protocol.SHARDS, view)
    assert sa.next_lapse(10.0) == 11.5
    assert sa.next_lapse(11.5) == 12.0  # an end at `now` has passed
    assert sa.next_lapse(12.0) is None


def test_lapsed_records_are_those_past_ten_of_their_leases() -> None:
    assert FORGET_AFTER_LEASES == 10
    view = View(
        {
            protocol.shard_key(0): lease("x", 0.0),  # a lease, however old, is not a record
            rkey("x"): record("x", 0.0, 1.0),  # forgotten after 0 + 1 x 11
            rkey("y"): record("y", 5.0, 2.0),  # after 5 + 2 x 11
        }
    )
    sa = ShardAssignment("me", protocol.SHARDS, view)
    assert sa.lapsed_records(11.0) == []
    assert sa.lapsed_records(11.01) == [(rkey("x"), 2)]
    assert sa.lapsed_records(27.01) == [(rkey("x"), 2), (rkey("y"), 3)]


def test_our_leases_are_the_shard_leases_that_name_us_live_or_not() -> None:
    view = View(
        {
            protocol.shard_key(3): lease("me", 10.0),
            protocol.shard_key(7): lease("me", 0.0),  # long expired: still ours by the view
            protocol.shard_key(5): lease("other", 10.0),
            protocol.LEADER_LEASE_KEY: lease("me", 10.0),  # not a shard
            rkey("me"): record("me", 10.0),
        }
    )
    assert ShardAssignment("me", protocol.SHARDS, view).our_leases() == {3, 7}


def test_free_is_no_lease_an_expired_one_or_ours() -> None:
    view = View(
        {
            protocol.shard_key(1): lease("other", 10.0),  # ends 11
            protocol.shard_key(2): lease("me", 10.0),
            protocol.shard_key(3): b"\xff not a lease",
        }
    )
    sa = ShardAssignment("me", protocol.SHARDS, view)
    assert not sa.free(1, 11.0)
    assert sa.free(1, 11.01)
    assert sa.free(2, 10.5)
    assert sa.free(3, 10.5)
    assert sa.free(4, 10.5)


def test_moves_give_up_what_the_plan_gives_others_and_take_what_is_ours_and_free(
    caplog: pytest.LogCaptureFixture,
) -> None:
    plan = assign(protocol.SHARDS, ["a", "b"])
    mine = sorted(s for s, m in plan.items() if m == "a")
    theirs = sorted(s for s, m in plan.items() if m == "b")
    busy, lapsed, held_mine = mine[0], mine[1], mine[2]
    view = View(
        {
            protocol.shard_key(busy): lease("c", 10.0),  # a live lease of another: not worth a try yet
            protocol.shard_key(lapsed): lease("c", 5.0),
        }
    )
    sa = ShardAssignment("a", protocol.SHARDS, view)
    caplog.set_level(logging.INFO, logger="pulsescale.shards")
    members = ["b"]
    give_up, take = sa.moves(10.5, members, [held_mine, theirs[0], theirs[1]])
    assert members == ["b", "a"]  # ours is added to the live ones
    assert caplog.records == [], "no older replica led, none leads: nothing to say"
    assert give_up == [theirs[0], theirs[1]]
    assert sorted(take) == [s for s in mine if s not in (busy, held_mine)]
    assert lapsed in take
    members = ["a", "b"]
    assert sa.moves(11.5, members, mine) == ([], [])  # holding exactly our share: nothing to do
    assert members == ["a", "b"]


def test_the_plan_is_recomputed_when_the_members_change_and_only_then() -> None:
    sa = ShardAssignment("a", protocol.SHARDS, View({}))
    first = sa.plan(["a", "b"])
    assert first == assign(protocol.SHARDS, ["a", "b"])
    assert sa.plan(["b", "a"]) is first  # the same members: the plan already made
    assert sa.plan(["a", "b", "c"]) == assign(protocol.SHARDS, ["a", "b", "c"])
    assert sa.plan(["a", "b"]) == first


def test_an_older_replica_leading_takes_every_shard_from_us_until_it_stops(caplog: pytest.LogCaptureFixture) -> None:
    """An older version leads through the leader lease and writes no replica record: take no shard and give up
    every held one while its lease lives, saying so once when it starts and once when it stops."""
    view = View({protocol.LEADER_LEASE_KEY: lease("old", 10.0, 2.0)})  # live until 12 inclusive
    sa = ShardAssignment("a", protocol.SHARDS, view)
    caplog.set_level(logging.INFO, logger="pulsescale.shards")
    assert sa.legacy_holder(12.0) == "old"
    assert sa.moves(10.5, ["a"], [0, 5]) == ([0, 5], [])
    assert sa.moves(12.0, ["a"], []) == ([], [])
    assert sa.legacy == "old"
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (
            logging.WARNING,
            f"a: an older replica (old, no replica record) leads through the {protocol.LEADER_LEASE_KEY!r} lease: "
            "taking no shard until it stops",
        )
    ]
    caplog.clear()
    assert sa.legacy_holder(12.01) is None
    give_up, take = sa.moves(12.01, ["a"], [0])
    assert (give_up, sorted(take)) == ([], list(range(1, protocol.SHARDS)))  # alone: every shard is ours
    assert sa.moves(12.5, ["a"], list(range(protocol.SHARDS))) == ([], [])
    assert sa.legacy is None
    infos = [r.getMessage() for r in caplog.records]
    assert infos == ["a: no older replica leads any more: taking shards"]


def test_a_leader_lease_is_no_older_replica_when_it_is_ours_or_its_holder_has_a_record() -> None:
    live = lease("old", 10.0)
    assert ShardAssignment("old", protocol.SHARDS, View({protocol.LEADER_LEASE_KEY: live})).legacy_holder(10.5) is None
    # A replica of ours that died: its record lapsed, but it says the holder was one of us.
    with_record = View({protocol.LEADER_LEASE_KEY: live, rkey("old"): record("old", 0.0)})
    assert ShardAssignment("a", protocol.SHARDS, with_record).legacy_holder(10.5) is None
    not_a_lease = View({protocol.LEADER_LEASE_KEY: record("old", 10.0)})
    assert ShardAssignment("a", protocol.SHARDS, not_a_lease).legacy_holder(10.5) is None
    assert ShardAssignment("a", protocol.SHARDS, View({})).legacy_holder(10.5) is None
