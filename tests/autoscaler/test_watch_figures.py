"""``pulsescale_watch_relists_total`` and ``pulsescale_watch_probes_spared_total``: read at scrape time from the
bucket views the daemon binds (`metrics.WatchFigures`)."""

from __future__ import annotations

from prometheus_client import generate_latest

from autoscaler.metrics import AutoscalerMetrics


def test_the_watch_figures_are_the_views_counts_at_scrape_time() -> None:
    metrics = AutoscalerMetrics()
    r = metrics.registry
    assert r.get_sample_value("pulsescale_watch_relists_total", {"bucket": "pulse_slots"}) is None  # nothing bound
    counts = {"relists": 0, "late": 0}
    metrics.watches.source = lambda: [
        ("pulse_slots", counts["relists"], {"late": counts["late"], "in_flight": 1}),
        ("pulse_agents", 0, {"late": 0, "in_flight": 0}),
    ]
    counts["relists"], counts["late"] = 2, 5  # read when scraped, not when bound
    assert r.get_sample_value("pulsescale_watch_relists_total", {"bucket": "pulse_slots"}) == 2
    assert r.get_sample_value("pulsescale_watch_relists_total", {"bucket": "pulse_agents"}) == 0
    spared = "pulsescale_watch_probes_spared_total"
    assert r.get_sample_value(spared, {"bucket": "pulse_slots", "why": "late"}) == 5
    assert r.get_sample_value(spared, {"bucket": "pulse_slots", "why": "in_flight"}) == 1
    text = metrics.exposition.render_now().decode()  # /metrics' own text says the same
    assert 'pulsescale_watch_relists_total{bucket="pulse_slots"} 2.0' in text
    assert 'pulsescale_watch_probes_spared_total{bucket="pulse_slots",why="late"} 5.0' in text
    assert 'pulsescale_watch_relists_total{bucket="pulse_slots"} 2.0' in generate_latest(r).decode()
