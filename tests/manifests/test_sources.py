"""Contract revision 14 in the ScaledObject reader: a trigger's demand source (`metadata.source`) and its parameters,
each refusal naming the key, and the record `apply` and the operator write (the wire's side: tests/warmpool/
test_protocol_sources.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from manifests import keda
from manifests.scaledobject import ScaledObjectError, from_manifest, load_documents
from warmpool import protocol
from warmpool.protocol import ScalerRecord

CORPUS = Path(__file__).resolve().parent


def _doc(*metas: dict[str, Any], **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "pulsescale.io/v1alpha1",
        "kind": "ScaledObject",
        "metadata": {"name": "qwen", "namespace": "inference"},
        "spec": {
            "scaleTargetRef": {"name": "qwen"},
            "triggers": [{"type": "gateway-queue", "metadata": {"model": "qwen", **m}} for m in metas or ({},)],
            **spec,
        },
    }


PROMETHEUS = {"source": "prometheus", "serverAddress": "http://prometheus:9090", "query": "sum(demand)"}


def _corpus(name: str) -> ScalerRecord:
    [m] = load_documents((CORPUS / "keda" / name).read_text(), name)
    return m.record


def test_each_source_reaches_the_record_as_written_and_round_trips() -> None:
    meta = _corpus("36-source-prometheus.yaml").spec.triggers[0].metadata
    assert (meta.source_kind, meta.server_address) == ("prometheus", "http://prometheus.monitoring:9090")
    assert isinstance(meta.query, str) and meta.query.startswith("sum(vllm:num_requests_waiting")
    assert (meta.target_queue_depth, meta.activation_queue_depth) == (4.0, 1.0)  # KEDA's strings, as numbers
    listed = _corpus("37-source-vllm-metrics-listed.yaml").spec.triggers[0].metadata
    assert listed.source_kind == "vllm-metrics"
    assert listed.metrics_urls() == ("http://10.0.0.5:8000", "http://10.0.0.6:8000/metrics")
    slots = _corpus("38-source-vllm-metrics-slots.yaml").spec.triggers[0].metadata
    assert (slots.source_kind, slots.metrics_urls(), slots.parameters()) == ("vllm-metrics", (), {})
    for name in (
        "36-source-prometheus.yaml",
        "37-source-vllm-metrics-listed.yaml",
        "38-source-vllm-metrics-slots.yaml",
    ):
        rec = _corpus(name)
        assert rec.spec.source_problem() is None
        assert protocol.decode(protocol.encode(rec), ScalerRecord) == rec


def test_a_gateway_trigger_writes_what_revision_13_wrote() -> None:
    """No source key on the wire unless the manifest sets one: an older reader sees the record it always saw."""
    record = from_manifest(_doc())
    wire = json.loads(protocol.encode(record))["spec"]["triggers"][0]["metadata"]
    assert set(wire) == {"model", "targetQueueDepth", "activationQueueDepth"}
    assert record.spec.triggers[0].metadata.source_kind == "gateway"
    explicit = from_manifest(_doc({"source": "gateway"}))
    assert json.loads(protocol.encode(explicit))["spec"]["triggers"][0]["metadata"]["source"] == "gateway"


REFUSALS: list[tuple[dict[str, Any], str]] = [
    ({"source": "kafka"}, "metadata.source: 'kafka' is not a source: one of gateway, vllm-metrics, prometheus"),
    ({"source": "Prometheus"}, "metadata.source: 'Prometheus' is not a source: one of gateway"),
    ({"source": ["prometheus"]}, "metadata.source: Expected `str`, got `array`"),
    ({"source": "prometheus"}, "metadata.serverAddress: required with source prometheus: the Prometheus server"),
    ({**PROMETHEUS, "query": 7}, "metadata.query: Expected `str`, got `int`"),
    (
        {"source": "prometheus", "serverAddress": "http://p:9090"},
        "metadata.query: required with source prometheus: the PromQL query",
    ),
    ({**PROMETHEUS, "query": "  "}, "metadata.query: is blank"),
    ({**PROMETHEUS, "serverAddress": "p:9090"}, "metadata.serverAddress: 'p:9090': give an http(s)://HOST"),
    ({**PROMETHEUS, "serverAddress": "http://p:99999"}, "metadata.serverAddress: 'http://p:99999': Port out of"),
    ({**PROMETHEUS, "serverAddress": "https://u:pw@p"}, "'https://u:pw@p': no credentials or #fragment"),
    ({**PROMETHEUS, "serverAddress": "http://p:9090/#x"}, "no credentials or #fragment"),
    ({**PROMETHEUS, "serverAddress": "http://p:9090/?a=1"}, "metadata.serverAddress: 'http://p:9090/?a=1': no ?query"),
    ({**PROMETHEUS, "serverAddress": "http://p :9090"}, "no spaces or control characters"),
    (
        {"serverAddress": "http://p:9090"},
        "metadata.serverAddress: belongs to source prometheus, not gateway (source unset)",
    ),
    ({"source": "gateway", "query": "up"}, "metadata.query: belongs to source prometheus, not gateway, which reads no"),
    ({"source": "vllm-metrics", "query": "up"}, "metadata.query: belongs to source prometheus, not vllm-metrics"),
    ({**PROMETHEUS, "metricsURL": "http://a:1"}, "metadata.metricsURL: belongs to source vllm-metrics, not prometheus"),
    ({"metricsURL": "http://a:1"}, "metadata.metricsURL: belongs to source vllm-metrics, not gateway"),
    ({"source": "vllm-metrics", "metricsURL": "http://a:1,"}, "metadata.metricsURL: 'http://a:1,' has an empty entry"),
    ({"source": "vllm-metrics", "metricsURL": ""}, "metadata.metricsURL: '' has an empty entry"),
    ({"source": "vllm-metrics", "metricsURL": "http://a:1, http://a:1"}, "'http://a:1' is listed twice"),
    ({"source": "vllm-metrics", "metricsURL": "http://a:1,file:///etc"}, "'file:///etc': give an http(s)://"),
    (
        {"source": "vllm-metrics", "metricsURL": ",".join(f"http://e{i}:8000" for i in range(65))},
        "metadata.metricsURL: 65 URLs, at most 64",
    ),
    ({**PROMETHEUS, "threshold": "4"}, "metadata.threshold: KEDA's prometheus key; pulsescale names it targetQueue"),
    ({**PROMETHEUS, "activationThreshold": "1"}, "metadata.activationThreshold: KEDA's prometheus key; pulsescale"),
    ({**PROMETHEUS, "unsafeSsl": "true"}, "metadata.unsafeSsl: unknown field"),
]


@pytest.mark.parametrize(
    ("meta", "error"), REFUSALS, ids=[e.split(":")[0] + str(i) for i, (_, e) in enumerate(REFUSALS)]
)
def test_each_source_rule_refuses_naming_the_key(meta: dict[str, Any], error: str) -> None:
    with pytest.raises(ScaledObjectError) as exc:
        from_manifest(_doc(meta))
    assert str(exc.value).startswith("spec.triggers[0].metadata.") and error in str(exc.value), str(exc.value)


def test_the_triggers_of_one_scaledobject_read_one_source() -> None:
    same = from_manifest(_doc(PROMETHEUS, {**PROMETHEUS}))
    assert same.spec.source_problem() is None
    unset_and_gateway = from_manifest(_doc({}, {"source": "gateway"}))  # the same source, written two ways
    assert unset_and_gateway.spec.source_problem() is None
    for second, words in (
        ({}, "spec.triggers[1].metadata.source: reads another source than triggers[0]"),
        ({**PROMETHEUS, "query": "sum(other)"}, "spec.triggers[1].metadata.source: reads another source"),
        ({"source": "kafka"}, "spec.triggers[1].metadata.source: 'kafka' is not a source"),
    ):
        with pytest.raises(ScaledObjectError) as exc:
            from_manifest(_doc(PROMETHEUS, second))
        assert str(exc.value).startswith(words), str(exc.value)


def test_a_source_read_by_the_bridge_says_so_in_its_notes() -> None:
    """`pollingInterval`, `useCachedMetrics` and `authenticationRef` have no effect either way; a pulled source's
    notes say why in its terms (the bridge's own periods, no credentials), a pushed one's as before."""
    listed = _corpus("37-source-vllm-metrics-listed.yaml")
    assert listed.notes == [keda._NOTE_POLLING_PULLED] and "--scrape-every" in listed.notes[0]
    doc = _doc(PROMETHEUS, pollingInterval=5)
    doc["spec"]["triggers"][0] |= {"useCachedMetrics": True, "authenticationRef": {"name": "prometheus-creds"}}
    assert from_manifest(doc).notes == [keda._NOTE_CACHED_PULLED, keda._NOTE_AUTH_PULLED, keda._NOTE_POLLING_PULLED]
    pushed = _doc(pollingInterval=5)
    pushed["spec"]["triggers"][0] |= {"useCachedMetrics": True, "authenticationRef": {"name": "x"}}
    assert from_manifest(pushed).notes == [keda._NOTE_CACHED, keda._NOTE_AUTH, keda._NOTE_POLLING]


def test_a_keda_prometheus_trigger_is_told_how_to_write_it_here() -> None:
    doc = _doc()
    doc["spec"]["triggers"] = [{"type": "prometheus", "metadata": {"serverAddress": "http://p:9090", "query": "up"}}]
    with pytest.raises(ScaledObjectError) as exc:
        from_manifest(doc)
    assert "write type: gateway-queue with metadata source: prometheus, serverAddress and query" in str(exc.value)
