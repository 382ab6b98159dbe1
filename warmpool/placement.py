"""Placement: which claimable slot to try first. Pure; the randomness source is passed in.

Order of preference:
1. slots whose weights are already resident in shm and whose rootfs is mounted (activation is then only the
   device copy and the engine start);
2. nodes, then racks, that hold the fewest slots of this model in service, so one node or rack failing takes
   out as little capacity as possible;
3. a random tie-break, so that concurrent claimers spread over equal slots instead of all racing for the
   first one (each lost compare-and-set costs a round trip).

`rank` states the order over a list of records; `pick` gives the same first choice from the registry's
indexes in time proportional to the number of nodes times the slots each may offer (at most
`protocol.MAX_SLOTS_PER_NODE`, whatever a node writes), since it runs on every claim.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence

from warmpool.protocol import SlotRecord
from warmpool.slots import HELD_STATES

__all__ = ["pick", "rank", "tier"]


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
