"""`bridge.readings` and `bridge.board` on a hand-advanced clock: demand and counters from engine readings,
counter resets, freshness, and the rule that a stale model is taken out of what is published, never sent stale."""

from __future__ import annotations

import pytest

from bridge.board import DemandBoard, Outcome
from bridge.errors import SourceError
from bridge.metrics import BridgeMetrics
from bridge.parse import Page
from bridge.readings import EngineReading, Readings

R = EngineReading

# (reading, expected (arrivals_total, completions_total) after it, a reset?)
STEPS: list[tuple[EngineReading, tuple[int, int], bool]] = [
    (R(2, 1, 10), (3, 0), False),  # baseline: the present requests arrived; the 10 finished before are not ours
    (R(4, 2, 12), (3 + 2 + 3, 2), False),  # 2 finished, 3 more present: 5 arrived
    (R(0, 0, 18), (8, 8), False),  # 6 finished, 6 fewer present: none arrived
    (R(1, 0, 17), (8 + 18, 8 + 17), True),  # the counter went down: a restart; 17 finished since, 1 present
    (R(0, 0, 18), (26, 26), False),  # 1 finished, 1 fewer present
]


def test_counters_follow_the_engine_and_read_a_reset_as_increase_does() -> None:
    r = Readings()
    for i, (reading, (arrivals, completions), reset) in enumerate(STEPS):
        rec = r.record("e1", {"m": reading}, now=float(i), stale_after_s=1.0)
        assert rec.resets == (("m",) if reset else ())
        assert (r.totals["m"].arrivals_total, r.totals["m"].completions_total) == (arrivals, completions), i
        assert r.totals["m"].arrivals_total >= reading.waiting + reading.running


def test_a_negative_arrivals_step_is_carried_not_published() -> None:
    # Gauges and counters are not read at one instant: one request finished on the counter but still running on
    # the gauge reads as one arrival too many, then one too few.
    r = Readings()
    r.record("e", {"m": R(0, 1, 0)}, now=0.0, stale_after_s=1.0)
    r.record("e", {"m": R(0, 1, 1)}, now=0.1, stale_after_s=1.0)  # 1 finished, 1 present: reads as 1 arrival
    assert r.totals["m"].arrivals_total == 2
    r.record("e", {"m": R(0, 0, 1)}, now=0.2, stale_after_s=1.0)  # the gauge catches up: -1, carried
    assert r.totals["m"].arrivals_total == 2
    r.record("e", {"m": R(0, 2, 1)}, now=0.3, stale_after_s=1.0)  # 2 arrive: 2 - 1 owed
    assert r.totals["m"].arrivals_total == 3


def test_two_engines_of_one_model_add_up_and_each_must_be_fresh() -> None:
    r = Readings()
    r.record("e1", {"m": R(1, 2, 0)}, now=0.0, stale_after_s=1.0)
    r.record("e2", {"m": R(3, 4, 0)}, now=0.5, stale_after_s=1.0)
    assert r.demand("m") == (4, 6) and r.fresh("m", 1.0)
    assert not r.fresh("m", 1.01)  # e1's reading is past its bound: the sum would be a silent under-count
    assert r.stale_sources("m", 1.01) == [("e1", pytest.approx(1.01))]
    assert r.expires_at("m") == 1.0 and r.age("m", 1.0) == 1.0


def test_an_expected_source_with_no_reading_counts_from_when_it_was_expected() -> None:
    r = Readings()
    r.expect("slot", "m", now=0.0, stale_after_s=1.0)
    assert not r.fresh("m", 0.1)  # no reading at all: nothing to publish
    r.record("other", {"m": R(1, 0)}, now=0.2, stale_after_s=1.0)
    assert r.fresh("m", 0.9) and not r.fresh("m", 1.01)
    assert r.rates_known("m") is False


def test_an_unbound_page_that_stops_naming_a_model_drops_it() -> None:
    r = Readings()
    r.record("e", {"a": R(1, 0), "b": R(2, 0)}, now=0.0, stale_after_s=1.0, named={"a", "b"})
    rec = r.record("e", {"a": R(1, 0)}, now=0.1, stale_after_s=1.0, named={"a", "b"})  # b named, but bad
    assert rec.models == {"a", "b"} and r.sources_of("b") == ["e"]
    r.record("e", {"a": R(1, 0)}, now=0.1, stale_after_s=1.0, named={"a", "c"})  # c named, never good: expected
    assert r.sources_of("c") == ["e"] and not r.fresh("c", 0.2) and r.sources_of("b") == []
    assert r.stale_sources("c", 1.2) == [("e", pytest.approx(1.1))]
    rec = r.record("e", {"a": R(1, 0)}, now=0.2, stale_after_s=1.0, named={"a"})  # c no longer served
    assert rec.models == {"a", "c"} and r.sources_of("c") == [] and r.models() == ["a"]


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    def changed(self, model: str) -> None:
        self.events.append(("changed", model))

    def forget(self, model: str) -> None:
        self.events.append(("forget", model))


def board_at(t: list[float]) -> tuple[DemandBoard, Recorder]:
    board = DemandBoard(BridgeMetrics(), clock=lambda: t[0])
    rec = Recorder()
    board.publisher = rec
    return board, rec


def good(model: str, w: int, r: int, done: int | None = None) -> Outcome:
    return Outcome(Page({model: EngineReading(w, r, done)}))


def test_the_board_publishes_fresh_models_and_takes_stale_ones_out() -> None:
    t = [100.0]
    board, rec = board_at(t)
    board.expect("e", "m", 1.0)
    assert board.published == {} and board.next_check_at() is None
    board.apply("e", good("m", 3, 2, 0), 1.0)
    assert board.published["m"].counts().queue_depth == 3 and rec.events == [("changed", "m")]
    board.apply("e", good("m", 3, 2, 0), 1.0)
    assert rec.events == [("changed", "m")]  # same figures: no extra sample asked for
    t[0] = 100.5
    board.apply("e", Outcome(error=SourceError("unreachable", "refused")), 1.0)
    assert "m" in board.published  # within its bound, the last good reading stands
    assert board.next_check_at() == pytest.approx(101.001)
    t[0] = 101.001
    board.next_check_at()
    assert board.published == {} and rec.events[-1] == ("forget", "m")
    m = board.metrics.registry
    assert m.get_sample_value("pulsescale_bridge_publishing", {"model": "m"}) == 0
    assert m.get_sample_value("pulsescale_bridge_samples_stopped_total", {"model": "m"}) == 1
    assert m.get_sample_value("pulsescale_bridge_errors_total", {"source": "e", "reason": "unreachable"}) == 1
    assert m.get_sample_value("pulsescale_bridge_reading_age_seconds", {"model": "m"}) == pytest.approx(1.001)
    t[0] = 101.2
    board.apply("e", good("m", 1, 0, 0), 1.0)  # reads well again: published again
    assert board.published["m"].counts().queue_depth == 1 and rec.events[-1] == ("changed", "m")


def test_a_source_dropped_takes_its_model_with_it() -> None:
    t = [0.0]
    board, rec = board_at(t)
    board.apply("slot", good("m", 1, 1), 1.0)
    assert "m" in board.published
    board.drop("slot")
    assert board.published == {} and rec.events[-1] == ("forget", "m")
    assert board.metrics.registry.get_sample_value("pulsescale_bridge_publishing", {"model": "m"}) is None


def test_only_the_listed_models_are_published() -> None:
    board = DemandBoard(BridgeMetrics(), clock=lambda: 0.0, models=frozenset({"a"}))
    board.apply("e", Outcome(Page({"a": EngineReading(1, 0), "b": EngineReading(1, 0)}, frozenset({"a", "b"}))), 1.0)
    assert set(board.published) == {"a"} and board.readings.models() == ["a"]
