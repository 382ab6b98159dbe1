"""Incremental housekeeping: the slot gauges' counts kept from the slot view's events equal a full scan."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from autoscaler.daemon import SlotCounts
from warmpool import protocol
from warmpool.protocol import SlotRecord
from warmpool.registry import Changed, Removed, Snapshot

KEYS = [(m, n, s) for m in ("a", "b", "c") for n in ("n1", "n2") for s in ("s0", "s1")]
STATES = list(protocol.SLOT_STATES)


def _rec(i: int, state: str) -> SlotRecord:
    m, n, s = KEYS[i]
    return SlotRecord(model=m, node=n, slot=s, state=state)  # type: ignore[arg-type]


def _scan(records: dict[str, SlotRecord]) -> dict[tuple[str, str], int]:
    out: dict[tuple[str, str], int] = {}
    for r in records.values():
        out[(r.model, r.state)] = out.get((r.model, r.state), 0) + 1
    return out


step = st.one_of(
    st.tuples(st.just("put"), st.integers(0, len(KEYS) - 1), st.sampled_from(STATES)),
    st.tuples(st.just("del"), st.integers(0, len(KEYS) - 1), st.just("")),
    st.tuples(st.just("snapshot"), st.just(0), st.just("")),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(step, max_size=60))
def test_counts_kept_from_events_equal_a_full_scan(steps: list[tuple[str, int, str]]) -> None:
    counts = SlotCounts()
    truth: dict[str, SlotRecord] = {}
    shown: dict[tuple[str, str], int] = {}  # what the gauges would read: set only for the pairs `apply` returns
    for rev, (op, i, state) in enumerate(steps, start=1):
        if op == "put":
            rec = _rec(i, state)
            truth[rec.key] = rec
            event: Snapshot[SlotRecord] | Changed[SlotRecord] | Removed = Changed(rec.key, rec, rev)
        elif op == "del":
            key = _rec(i, "warm").key
            truth.pop(key, None)
            event = Removed(key, rev)  # also for a key never seen: the view may say so after a purge
        else:
            event = Snapshot(dict(truth))
        for pair in counts.apply(event):
            shown[pair] = counts.count(*pair)
        scan = _scan(truth)
        assert counts.counts == scan
        assert {p: v for p, v in shown.items() if v} == scan
