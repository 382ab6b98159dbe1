"""What the policy reads of a ScaledObject, derived once when it changes (Knative's ``DeciderSpec``).

A ScaledObject is KEDA's wire type: bounds spread over three fields, the target and activation depths over a list
of triggers, windows that fall back to each other. `PolicySpec.of` resolves them once, when the decider is built and
when the ScaledObject is edited (`autoscaler.decide.decider.ModelDecider.update_record`), so `policy.decide`, which
runs on every sample of every model, derives nothing from the spec. The KEDA terms the rules read as they are (the
fallback, the HPA scale-down behaviour, the cooldowns) stay on `keda`. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass

from autoscaler.decide import detector, need, scalein
from autoscaler.decide.policystate import Bounds, bounds_of, trigger_of
from warmpool.protocol import ScaledObjectSpec

__all__ = ["PolicySpec"]


@dataclass(frozen=True, slots=True)
class PolicySpec:
    """One ScaledObject as the policy reads it; build it with `PolicySpec.of`."""

    keda: ScaledObjectSpec
    """The ScaledObject it was built from: the terms the rules read as they are."""
    bounds: Bounds
    target: float
    """Queue + in-flight one replica carries: the smallest ``targetQueueDepth`` over the triggers."""
    activation: float
    """Demand above this activates an idle model: the smallest ``activationQueueDepth`` over the triggers."""
    detector: detector.DetectorConfig
    """The pulse detector's windows and thresholds; `calm_s` unset (each decision's scale-in windows set it)."""
    need: need.NeedConfig
    """The rates' windows (`autoscaler.decide.need`)."""
    span_s: float
    """The recommendations' window: the longest stabilisation the scale-in windows can resolve to."""
    settle_s: float
    """Seconds after the last change of the demand past which a decision on the same inputs repeats the last one,
    as far as the windows go (`autoscaler.decide.settling`): the trend is fitted over a panic window, the mean over
    the stable window, panic is left a stable window after its condition, the recommendations of the panic window's
    forecast are stabilised over the scale-down window, and the rate limit remembers a period of steps. Summed, not
    maxed: each starts when the one before has settled. Two buckets of slack for keys that round either way."""
    trend_settle_s: float
    """Seconds of decisions on one unchanged demand, from its first, past which the next repeats the last when the
    windows never held another value: the trend's fit needs points all along its panic window before its forecast
    is the demand itself. Two buckets of slack, as `settle_s`."""

    @classmethod
    def of(cls, keda: ScaledObjectSpec) -> PolicySpec:
        adv = keda.advanced
        target, activation = trigger_of(keda)
        # Unset windows at their longest (`scale_in` at a lead time of AUTO_HOLD_MAX_S or more): settling later is
        # safe, settling early is a model left unscaled.
        longest = scalein.scale_in(keda, scalein.AUTO_HOLD_MAX_S)
        slack = 2 * detector.BUCKET_S
        return cls(
            keda=keda,
            bounds=bounds_of(keda),
            target=target,
            activation=activation,
            detector=detector.DetectorConfig(
                stable_window_s=adv.stable_window_seconds,
                panic_window_s=adv.panic_window_seconds,
                panic_threshold=adv.panic_threshold,
                target_queue_depth=target,
                activation_queue_depth=activation,
                carry_s=adv.stale_after_seconds,
            ),
            need=need.config(keda, target),
            span_s=scalein.span_s(keda),
            settle_s=adv.stable_window_seconds + adv.panic_window_seconds + longest.hold_s + longest.period_s + slack,
            trend_settle_s=adv.panic_window_seconds + slack,
        )
