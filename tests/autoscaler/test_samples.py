"""`autoscaler.samples.SampleBuffer`: newest sample per (gateway, model), bounded, drops counted, key order kept."""

from __future__ import annotations

import pytest

from autoscaler.samples import SampleBuffer
from warmpool.protocol import QueueSample


def _s(gateway: str, model: str, seq: int, ts: float | None = None, queue: int = 0) -> QueueSample:
    return QueueSample(
        gateway=gateway,
        model=model,
        seq=seq,
        ts=float(seq) if ts is None else ts,
        queue_depth=queue,
        inflight=0,
        arrivals_total=seq,
        completions_total=0,
        timeouts_total=0,
    )


def _drain(buf: SampleBuffer) -> list[tuple[QueueSample, float]]:
    out = []
    while buf:
        out.append(buf.pop())
    return out


def test_newest_wins_per_key() -> None:
    buf = SampleBuffer(10)
    assert buf.put(_s("g1", "m", 1), 1.0) == "queued"
    assert buf.put(_s("g1", "m", 2, queue=5), 2.0) == "coalesced"
    assert buf.put(_s("g1", "m", 3, queue=7), 3.0) == "coalesced"
    assert [(s.seq, s.queue_depth, at) for s, at in _drain(buf)] == [(3, 7, 3.0)]


def test_a_late_packet_does_not_replace_the_newer_sample() -> None:
    buf = SampleBuffer(10)
    buf.put(_s("g1", "m", 5), 5.0)
    assert buf.put(_s("g1", "m", 4), 6.0) == "coalesced"  # counted: it is not kept
    assert [s.seq for s, _ in _drain(buf)] == [5]


def test_a_gateway_restart_replaces_the_old_runs_sample() -> None:
    buf = SampleBuffer(10)
    buf.put(_s("g1", "m", 900, ts=100.0), 1.0)
    buf.put(_s("g1", "m", 1, ts=101.0), 2.0)  # seq starts again, later ts: the new run's sample
    assert [s.seq for s, _ in _drain(buf)] == [1]


def test_distinct_keys_keep_their_first_arrival_order() -> None:
    buf = SampleBuffer(10)
    for gw, model in [("g1", "a"), ("g2", "a"), ("g1", "b"), ("g3", "c")]:
        buf.put(_s(gw, model, 1), 1.0)
    buf.put(_s("g1", "a", 2), 2.0)  # a busy key keeps its place
    got = [(s.gateway, s.model, s.seq) for s, _ in _drain(buf)]
    assert got == [("g1", "a", 2), ("g2", "a", 1), ("g1", "b", 1), ("g3", "c", 1)]


def test_bound_drops_the_oldest_key_and_says_so() -> None:
    buf = SampleBuffer(3)
    outcomes = [buf.put(_s(f"g{i}", "m", 1), float(i)) for i in range(5)]
    assert outcomes == ["queued", "queued", "queued", "dropped", "dropped"]
    assert len(buf) == 3
    assert [s.gateway for s, _ in _drain(buf)] == ["g2", "g3", "g4"]
    # A sample of a key already buffered never drops anything.
    for i in range(3):
        buf.put(_s(f"g{i}", "m", 1), 0.0)
    assert buf.put(_s("g0", "m", 2), 0.0) == "coalesced"
    assert len(buf) == 3


def test_counts_add_up() -> None:
    buf = SampleBuffer(50)
    counts = {"queued": 0, "coalesced": 0, "dropped": 0}
    published = 0
    for seq in range(1, 40):
        for g in range(80):
            counts[buf.put(_s(f"g{g}", f"m{g % 7}", seq), 0.0)] += 1
            published += 1
    drained = len(_drain(buf))
    # Every sample is drained, merged into a newer one, or dropped with its key.
    assert drained + counts["coalesced"] + counts["dropped"] == published


def test_capacity_must_hold_a_sample() -> None:
    with pytest.raises(ValueError, match="at least one"):
        SampleBuffer(0)
