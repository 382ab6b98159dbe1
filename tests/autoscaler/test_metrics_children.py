"""`AutoscalerMetrics.model` / `sample`: cached label children write the same series `labels()` does."""

from __future__ import annotations

from autoscaler.metrics import AutoscalerMetrics


def test_cached_children_are_the_labelled_series_and_forget_drops_them() -> None:
    m = AutoscalerMetrics()
    series = m.model("llama")
    assert m.model("llama") is series  # looked up once
    series.desired.set(3)
    series.slots["warm"].set(5)
    series.activations_ready.inc()
    m.sample("accepted").inc()
    m.sample("accepted").inc()
    get = m.registry.get_sample_value
    assert get("pulsescale_desired_replicas", {"model": "llama"}) == 3
    assert get("pulsescale_slots", {"model": "llama", "state": "warm"}) == 5
    assert get("pulsescale_slots", {"model": "llama", "state": "ready"}) == 0
    assert get("pulsescale_activations_total", {"model": "llama", "outcome": "ready"}) == 1
    assert get("pulsescale_samples_total", {"outcome": "accepted"}) == 2
    m.forget("llama")
    assert get("pulsescale_desired_replicas", {"model": "llama"}) is None
    assert get("pulsescale_slots", {"model": "llama", "state": "warm"}) is None
    assert m.model("llama") is not series  # made again on next use
