"""The scale-in windows of the policy: the stabilisation window, the scale-down rate and when panic is left.

A ScaledObject field that is set means what HPA's behaviour (and revision 8) made it mean; one left unset (revision
9) is sized from the measured lead time (`scale_in`). `rate_floor` is HPA's ``calculateScaleDownLimitWithBehaviors``
over the windows in force. Pure: `autoscaler.decide.policy` calls these with the spec, the lead time and its own steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import msgspec

from autoscaler.decide import detector
from autoscaler.decide.policystate import number_text as _n
from warmpool.protocol import ScaledObjectSpec

__all__ = ["AUTO_HOLD_MAX_S", "ScaleIn", "rate_floor", "rate_text", "scale_in", "span_s", "step_gap_s"]


AUTO_HOLD_MAX_S: Final = 60.0
"""The longest scale-in hold an unset stabilisation takes (revision 8's default window): a lead time of minutes, the
cold path's, holds no longer than an HPA-like window would."""
SET_STABILIZATION_PERIOD_S: Final = 60.0
"""`scaleDownPeriodSeconds` left unset where the stabilisation is set: revision 8's default, so a ScaledObject that
sets only the window scales as it did."""
SET_STABILIZATION_PERCENT: Final = 50.0
"""`scaleDownPercent` left unset where the stabilisation is set: revision 8's default, for the same reason."""


@dataclass(frozen=True, slots=True)
class ScaleIn:
    """The scale-in windows in force: a field that is set as given, an unset one from the lead time (revision 9).

    Bringing a released replica back costs one lead time from the warm pool (claim -> ready), so an idle replica
    is held about that long (ski rental's break-even) but never less than a panic window, the evidence a rise needs
    too, and never more than `AUTO_HOLD_MAX_S`. HPA's 300 s and Knative's 60 s windows price a cold start of
    minutes: held after each 10 s burst of the bursty trace replayed 10x, 60 s windows spent 2.1 x the oracle's
    replica-seconds, the hold 1.17 x (README, `pulsescale simulate --trace`)."""

    hold_s: float
    """The stabilisation window: scale down to the highest recommendation over it."""
    period_s: float
    """The scale-down rate's period."""
    percent: float
    """The share of the replicas the scale-down rate removes per period."""
    calm_s: float
    """Panic is left this long after its condition last held: the stable window, or the hold where it is unset."""
    auto: bool
    """The stabilisation window was unset: `hold_s` comes from the lead time."""


def scale_in(spec: ScaledObjectSpec, lead_s: float) -> ScaleIn:
    """The scale-in windows at a measured lead time of `lead_s` (claim -> ready p90) for `spec`."""
    adv = spec.advanced
    stab, period, percent = adv.scale_down_stabilization_seconds, adv.scale_down_period_seconds, adv.scale_down_percent
    if not isinstance(stab, msgspec.UnsetType):
        return ScaleIn(
            stab,
            SET_STABILIZATION_PERIOD_S if isinstance(period, msgspec.UnsetType) else period,
            SET_STABILIZATION_PERCENT if isinstance(percent, msgspec.UnsetType) else percent,
            adv.stable_window_seconds,
            auto=False,
        )
    hold = min(max(lead_s, adv.panic_window_seconds), AUTO_HOLD_MAX_S)
    return ScaleIn(
        hold,
        hold if isinstance(period, msgspec.UnsetType) else period,
        100.0 if isinstance(percent, msgspec.UnsetType) else percent,
        min(adv.stable_window_seconds, hold),
        auto=True,
    )


def span_s(spec: ScaledObjectSpec) -> float:
    """The recommendations' window: the longest stabilisation `scale_in` can resolve to for `spec`."""
    stab = spec.advanced.scale_down_stabilization_seconds
    return max(AUTO_HOLD_MAX_S if isinstance(stab, msgspec.UnsetType) else stab, detector.BUCKET_S)


def _in_period(changes: tuple[tuple[float, int], ...], period_s: float, now: float) -> int:
    """Replicas changed within the last `period_s` (HPA's ``getReplicasChangePerPeriod``: after now - period)."""
    return sum(n for ts, n in changes if now - ts < period_s)


def rate_floor(
    prev: int,
    scale_ups: tuple[tuple[float, int], ...],
    scale_downs: tuple[tuple[float, int], ...],
    spec: ScaledObjectSpec,
    windows: ScaleIn,
    now: float,
) -> int:
    """The lowest count the scale-down policies allow now, as HPA's ``calculateScaleDownLimitWithBehaviors``:
    `scale_ups` / `scale_downs` are the policy's own steps, ``(when, replicas)``."""
    adv = spec.advanced
    if adv.scale_down_select_policy == "Disabled":
        return prev
    period_s = windows.period_s
    at_period_start = prev - _in_period(scale_ups, period_s, now) + _in_period(scale_downs, period_s, now)
    # HPA's int32(float64(start) * (1 - float64(value)/100)): the same float expression, truncated, so the count
    # is HPA's bit for bit (a ceiling kept one replica more: 25 % of 10 kept 8 where HPA keeps 7).
    keep = int(at_period_start * (1 - windows.percent / 100))
    if adv.scale_down_pods is not None:
        by_pods = at_period_start - adv.scale_down_pods
        # Max: the policy that removes more (keeps fewer) wins; Min: the one that removes fewer.
        keep = min(keep, by_pods) if adv.scale_down_select_policy == "Max" else max(keep, by_pods)
    # A limit above the count (steps down already used up) holds the count, as HPA's; never below zero.
    return min(prev, max(keep, 0))


def step_gap_s(windows: ScaleIn) -> float:
    """On rates, the least time between two scale-in steps: the stabilisation window, or the period if longer."""
    return max(windows.hold_s, windows.period_s)


def rate_text(spec: ScaledObjectSpec, windows: ScaleIn) -> str:
    """The scale-down policies for a reason string: ``50 %/60 s``, ``max(50 %, 2 pods)/60 s``."""
    adv = spec.advanced
    pct = f"{_n(windows.percent)} %"
    if adv.scale_down_pods is not None:
        pct = f"{adv.scale_down_select_policy.lower()}({pct}, {adv.scale_down_pods} pods)"
    return f"{pct}/{_n(windows.period_s)} s"
