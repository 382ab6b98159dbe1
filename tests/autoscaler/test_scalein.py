"""`autoscaler.decide.scalein` by fixed values: HPA's scale-down limit (``calculateScaleDownLimitWithBehaviors``:
Percent and Pods policies, ``selectPolicy`` Max / Min / Disabled), the windows a set stabilisation takes, and the
rate as a reason says it."""

from __future__ import annotations

import pytest

from autoscaler.decide.scalein import rate_floor, rate_text, scale_in
from tests.autoscaler.test_policy import make_spec

NOW = 1_000.0


def _spec(**advanced: object):  # type: ignore[no-untyped-def]
    return make_spec(advanced={"scale_down_stabilization_seconds": 60.0, "scale_down_period_seconds": 60.0,
                               "scale_down_percent": 25.0, **advanced})  # fmt: skip


@pytest.mark.parametrize(
    ("advanced", "prev", "downs", "want"),
    [
        ({}, 10, (), 7),  # int(10 x 0.75): rounded down, as HPA's int32()
        ({}, 10, ((NOW - 30.0, 2),), 9),  # 2 removed 30 s ago: the period began at 12, 75 % of 12 keeps 9
        ({"scale_down_pods": 4}, 10, (), 6),  # Max: the policy that removes more (10 - 4 = 6 < 7)
        ({"scale_down_pods": 1}, 10, (), 7),  # Max: 7 < 9
        ({"scale_down_pods": 4, "scale_down_select_policy": "Min"}, 10, (), 7),  # Min: the one that removes fewer
        ({"scale_down_pods": 1, "scale_down_select_policy": "Min"}, 10, (), 9),
        ({"scale_down_select_policy": "Disabled"}, 10, (), 10),  # never down
        ({"scale_down_pods": 20}, 10, (), 0),  # more pods than there are: never below 0
    ],
)
def test_the_scale_down_limit_is_hpas(advanced: dict[str, object], prev: int, downs: tuple[tuple[float, int], ...],
                                      want: int) -> None:  # fmt: skip
    spec = _spec(**advanced)
    windows = scale_in(spec, 2.0)
    assert rate_floor(prev, (), downs, spec, windows, NOW) == want


def test_steps_up_within_the_period_do_not_raise_the_start() -> None:
    spec = _spec()
    windows = scale_in(spec, 2.0)
    # 10 now, 4 of them added 10 s ago: the period began at 6, 75 % of 6 keeps 4.
    assert rate_floor(10, ((NOW - 10.0, 4),), (), spec, windows, NOW) == 4
    # Added a whole period ago: no longer in it.
    assert rate_floor(10, ((NOW - 60.0, 4),), (), spec, windows, NOW) == 7


def test_a_set_window_keeps_a_set_period_and_the_rate_reads_as_policies() -> None:
    spec = _spec(scale_down_period_seconds=15.0)
    w = scale_in(spec, 2.0)
    assert (w.hold_s, w.period_s, w.percent, w.auto) == (60.0, 15.0, 25.0, False)
    assert rate_text(spec, w) == "25 %/15 s"
    both = _spec(scale_down_pods=2)
    assert rate_text(both, scale_in(both, 2.0)) == "max(25 %, 2 pods)/60 s"
    fewer = _spec(scale_down_pods=2, scale_down_select_policy="Min")
    assert rate_text(fewer, scale_in(fewer, 2.0)) == "min(25 %, 2 pods)/60 s"
