"""Placement: which claimable slot to try first. Pure; the randomness source is passed in.

Order of preference:
1. slots whose weights are already resident in shm and whose rootfs is mounted (activation is then only the
   device copy and the engine start);
2. nodes, then racks, that hold the fewest slots of this model in service, so one node or rack failing takes
   out as little capacity as possible;
3. a random tie-break, so that concurrent claimers spread over equal slots instead of all racing for the
   first one (each lost compare-and-set costs a round trip).

`rank` states the order over a list of records. `Pool` gives the same first choice in O(1) amortised per claim
(it runs on every claim): one model's nodes are filed by tier, then by how many slots of the model they hold, then
by rack, so a pick looks at the few (tier, load) buckets and the racks of the first non-empty one, then draws a
node there. A node whose load changed is refiled by the next pick (a claim moves its node's load up to three
times: reserved while in flight, answered, applied). Leases are checked lazily: a drawn node whose lease no longer
offers its slots is parked (taken out of the buckets) and filed again when its lease or its warm slots change.
`pick` is the same rule as a scan over all nodes: the reference `Pool` is tested against.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from typing import Generic, TypeVar

from warmpool.protocol import SlotRecord
from warmpool.slots import HELD_STATES

__all__ = ["Pool", "pick", "rank", "tier"]


def tier(rec: SlotRecord) -> int:
    """0 = weights resident and rootfs mounted, 1 = weights only, 2 = rootfs only, 3 = neither."""
    return (0 if rec.weights_resident else 2) + (0 if rec.rootfs_mounted else 1)


def loads(in_service: Iterable[SlotRecord]) -> tuple[Counter[str], Counter[str]]:
    node_load: Counter[str] = Counter()
    rack_load: Counter[str] = Counter()
    for rec in in_service:
        if rec.state in HELD_STATES:
            node_load[rec.node] += 1
            rack_load[rec.rack] += 1
    return node_load, rack_load


def rank(candidates: Sequence[SlotRecord], in_service: Iterable[SlotRecord], rng: random.Random) -> list[SlotRecord]:
    """Candidates best first. `in_service` is every slot of the model already claimed or serving."""
    node_load, rack_load = loads(in_service)
    return sorted(candidates, key=lambda r: (tier(r), node_load[r.node], rack_load[r.rack], rng.random()))


def pick(
    warm: Mapping[int, Mapping[str, Collection[str]]],
    *,
    rack_of: Mapping[str, str],
    node_load: Mapping[str, int],
    rack_load: Mapping[str, int],
    usable: Callable[[str, Collection[str]], Collection[str]],
    skip: Collection[str],
    rng: random.Random,
) -> str | None:
    """The key `rank` would put first. `warm` is tier -> node -> warm slot keys; `usable(node, keys)` gives the
    keys among them that may be claimed (none when the node's agent lease is not fresh; only the slots its lease
    lists otherwise); keys in `skip` were already tried."""
    for t in sorted(warm):
        best: tuple[int, int, float] | None = None
        best_keys: list[str] = []
        for node, keys in warm[t].items():
            if not keys:
                continue
            candidates = [k for k in usable(node, keys) if k not in skip]
            if not candidates:
                continue
            score = (node_load.get(node, 0), rack_load.get(rack_of.get(node, ""), 0), rng.random())
            if best is None or score < best:
                best, best_keys = score, candidates
        if best is not None:
            return rng.choice(sorted(best_keys))
    return None


T = TypeVar("T")


class _Bag(Generic[T]):
    """A set with O(1) add, remove and random draw (a list plus each item's position)."""

    __slots__ = ("_items", "_pos")

    def __init__(self) -> None:
        self._items: list[T] = []
        self._pos: dict[T, int] = {}

    def __len__(self) -> int:
        return len(self._items)

    def add(self, item: T) -> None:
        if item not in self._pos:
            self._pos[item] = len(self._items)
            self._items.append(item)

    def remove(self, item: T) -> None:
        i = self._pos.pop(item)
        last = self._items.pop()
        if i < len(self._items):
            self._items[i] = last
            self._pos[last] = i

    def from_random_start(self, rng: random.Random) -> Iterator[T]:
        """Every item once, lazily, starting at a random one (equal items are drawn evenly when none is passed
        over). The bag must not change while this runs."""
        n = len(self._items)
        if n:
            start = rng.randrange(n)
            for j in range(n):
                yield self._items[(start + j) % n]


Usable = Callable[[str, Collection[str]], Collection[str]]


class Pool:
    """One model's warm slots, filed so that `pick` costs O(1) amortised instead of a scan of every node.

    Fed by the registry's view changes: `add_warm` / `remove_warm` for warm, undrained slots, `held` for slots
    entering or leaving `slots.HELD_STATES` (and for the registry's own claims while they are in flight),
    `unpark(node)` when the node's agent lease changes. The filing is tier -> node load -> rack -> nodes; rack
    loads are read at pick time (a claim changes one rack's load, which would otherwise move every node of that
    rack)."""

    def __init__(self, on_park: Callable[[str], None] = lambda node: None) -> None:
        self._on_park = on_park
        """Told the node a pick parked, so the owner can `unpark` it when that node's lease changes."""
        self._keys: dict[tuple[int, str], set[str]] = {}  # (tier, node) -> warm keys
        self._node_load: Counter[str] = Counter()
        self._rack_load: Counter[str] = Counter()
        self._rack_of: dict[str, str] = {}
        self._filed: dict[int, dict[int, dict[str, _Bag[str]]]] = {}  # tier -> node load -> rack -> nodes
        self._where: dict[tuple[int, str], tuple[int, str]] = {}  # (tier, node) -> (load, rack) it is filed under
        self._parked: dict[str, set[int]] = {}  # node -> tiers taken out until its lease changes
        self._tiers: dict[str, set[int]] = {}  # node -> tiers it has warm keys in
        self._moved: set[str] = set()  # nodes whose load changed since the last pick: refiled by the next one

    def __bool__(self) -> bool:
        return bool(self._keys) or bool(self._node_load)

    # --- filing ----------------------------------------------------------------------------------------------

    def _file(self, t: int, node: str) -> None:
        load, rack = self._node_load.get(node, 0), self._rack_of.get(node, "")
        self._filed.setdefault(t, {}).setdefault(load, {}).setdefault(rack, _Bag()).add(node)
        self._where[(t, node)] = (load, rack)

    def _unfile(self, t: int, node: str) -> None:
        where = self._where.pop((t, node), None)
        if where is None:
            return
        load, rack = where
        by_load = self._filed[t]
        by_rack = by_load[load]
        bag = by_rack[rack]
        bag.remove(node)
        if not bag:
            del by_rack[rack]
            if not by_rack:
                del by_load[load]
                if not by_load:
                    del self._filed[t]

    def _refile(self, node: str) -> None:
        for t in self._tiers.get(node, ()):
            if (t, node) in self._where:
                self._unfile(t, node)
                self._file(t, node)

    def _set_rack(self, node: str, rack: str) -> None:
        if self._rack_of.get(node) != rack:
            self._rack_of[node] = rack
            self._refile(node)

    def add_warm(self, key: str, t: int, node: str, rack: str) -> None:
        self._set_rack(node, rack)
        keys = self._keys.setdefault((t, node), set())
        keys.add(key)
        self._tiers.setdefault(node, set()).add(t)
        parked = self._parked.get(node)
        if parked is not None:
            parked.discard(t)  # new keys: the lease may offer them
            if not parked:
                del self._parked[node]
        if (t, node) not in self._where:
            self._file(t, node)

    def remove_warm(self, key: str, t: int, node: str) -> None:
        keys = self._keys.get((t, node))
        if keys is None:
            return
        keys.discard(key)
        if keys:
            return
        del self._keys[(t, node)]
        self._unfile(t, node)
        tiers = self._tiers[node]
        tiers.discard(t)
        if not tiers:
            del self._tiers[node]
        parked = self._parked.get(node)
        if parked is not None:
            parked.discard(t)
            if not parked:
                del self._parked[node]

    def held(self, node: str, rack: str, delta: int) -> None:
        """A slot of the model on `node` in `rack` entered (+1) or left (-1) a held state."""
        self._set_rack(node, rack)
        self.node_held(node, delta)
        self.rack_held(rack, delta)

    def node_held(self, node: str, delta: int) -> None:
        self._node_load[node] += delta
        if not self._node_load[node]:
            del self._node_load[node]
        # Refiled lazily: a claim moves its node's load up to three times (reserved, answered, applied).
        self._moved.add(node)

    def rack_held(self, rack: str, delta: int) -> None:
        self._rack_load[rack] += delta
        if not self._rack_load[rack]:
            del self._rack_load[rack]

    def unpark(self, node: str) -> None:
        """The node's lease changed: file its parked tiers again."""
        for t in self._parked.pop(node, ()):
            if (t, node) in self._keys:
                self._file(t, node)

    # --- picking ---------------------------------------------------------------------------------------------

    def pick(self, *, usable: Usable, skip: Collection[str], rng: random.Random) -> str | None:
        """The key `rank` would put first, or None. `usable(node, keys)` gives the keys among `keys` that may be
        claimed now (none when the node's lease is not fresh); a node given none is parked until `unpark`. Keys
        in `skip` were already tried (lost races): passed over for this pick only."""
        for node in self._moved:
            self._refile(node)
        self._moved.clear()
        for t in sorted(self._filed):
            by_load = self._filed[t]
            for load in sorted(by_load):
                by_rack = by_load[load]
                racks = sorted(by_rack, key=lambda r: (self._rack_load.get(r, 0), rng.random()))
                for rack in racks:
                    parked: list[str] = []
                    found: list[str] = []
                    for node in by_rack[rack].from_random_start(rng):
                        offered = usable(node, self._keys[(t, node)])
                        if not offered:
                            parked.append(node)
                            continue
                        found = [k for k in offered if k not in skip]
                        if found:
                            break
                    for node in parked:
                        self._park(t, node)
                    if found:
                        return rng.choice(sorted(found))
                    if t not in self._filed:
                        break
                if t not in self._filed:
                    break
        return None

    def _park(self, t: int, node: str) -> None:
        self._unfile(t, node)
        self._parked.setdefault(node, set()).add(t)
        self._on_park(node)
