"""Wire contract revision 14: a trigger's demand source on the wire (`TriggerMetadata.source`, `metricsURL`,
`serverAddress`, `query`): added optional keys only, absent unless set, round-tripped through a real nats-server's
`pulse_scalers`; the rules every reader that acts on them applies (`source_problem`, `http_url_problem`)."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from nats.aio.client import Client

from warmpool import protocol
from warmpool.errors import BadMessage
from warmpool.protocol import ScalerRecord, TriggerMetadata
from warmpool.registry import ensure_buckets


def _record(*metas: dict[str, Any]) -> dict[str, Any]:
    return {
        "v": 1,
        "namespace": "inference",
        "name": "qwen",
        "spec": {
            "scaleTargetRef": {"name": "qwen"},
            "triggers": [{"type": "gateway-queue", "metadata": {"model": "qwen", **m}} for m in metas or ({},)],
        },
    }


def _decode(*metas: dict[str, Any]) -> ScalerRecord:
    return protocol.decode(json.dumps(_record(*metas)).encode(), ScalerRecord)


PROMETHEUS = {"source": "prometheus", "serverAddress": "http://prometheus:9090", "query": "sum(up)"}
PAGES = {"source": "vllm-metrics", "metricsURL": "http://10.0.0.5:8000,http://10.0.0.6:8000/metrics"}


def test_the_revision_is_14_and_bad_source_is_a_reason() -> None:
    assert protocol.CONTRACT_REVISION == 14
    assert "bad_source" in protocol.REASONS
    assert protocol.SOURCES == ("gateway", "vllm-metrics", "prometheus")
    assert dict(protocol.SOURCE_PARAMETERS) == {
        "gateway": (),
        "vllm-metrics": ("metricsURL",),
        "prometheus": ("serverAddress", "query"),
    }


def test_absent_is_gateway_and_a_gateway_record_is_what_revision_13_wrote() -> None:
    rec = _decode()
    meta = rec.spec.triggers[0].metadata
    assert meta.source is msgspec.UNSET and meta.source_kind == "gateway" and meta.parameters() == {}
    assert rec.spec.source_problem() is None
    wire = json.loads(protocol.encode(rec))["spec"]["triggers"][0]["metadata"]
    assert wire == {"model": "qwen", "targetQueueDepth": 4.0, "activationQueueDepth": 0.0}


@pytest.mark.parametrize("meta", [PROMETHEUS, PAGES, {"source": "vllm-metrics"}, {"source": "gateway"}])
def test_each_source_block_round_trips(meta: dict[str, Any]) -> None:
    rec = _decode(meta)
    assert rec.spec.source_problem() is None
    wire = json.loads(protocol.encode(rec))["spec"]["triggers"][0]["metadata"]
    assert {k: wire[k] for k in meta} == meta  # the wire names, as written
    assert protocol.decode(protocol.encode(rec), ScalerRecord) == rec


async def test_the_block_round_trips_through_pulse_scalers(nc: Client) -> None:
    kv = (await ensure_buckets(nc.jetstream(), names=[protocol.SCALERS_BUCKET]))[protocol.SCALERS_BUCKET]
    for meta in (PROMETHEUS, PAGES):
        rec = _decode(meta)
        await kv.put(rec.key, protocol.encode(rec))
        entry = await kv.get(rec.key)
        assert entry.value is not None
        back = protocol.decode(entry.value, ScalerRecord)
        assert (
            back == rec
            and back.spec.triggers[0].metadata.source_block() == rec.spec.triggers[0].metadata.source_block()
        )


class _Revision13Metadata(msgspec.Struct, rename="camel"):
    """`TriggerMetadata` as revision 13 declared it (the `_Spec` base: unknown keys ignored)."""

    model: str
    target_queue_depth: float = 4.0
    activation_queue_depth: float = 0.0


def test_an_older_reader_ignores_the_block() -> None:
    wire = protocol.encode(_decode(PROMETHEUS))
    meta = json.loads(wire)["spec"]["triggers"][0]["metadata"]
    assert msgspec.convert(meta, _Revision13Metadata) == _Revision13Metadata("qwen")


def test_a_block_that_breaks_the_rules_still_decodes_and_the_rule_names_the_key() -> None:
    """The autoscaler acts on nothing of the block and a later revision may add a source: `decode` reads such a
    record (its other fields in force); `source_problem` is what the ScaledObject reader and the bridge refuse it by."""
    cases = [
        ({"source": "kafka", "brokers": "k:9092"}, "triggers[0].metadata.source", "'kafka' is not a source: one of"),
        ({"source": "prometheus", "query": "up"}, "triggers[0].metadata.serverAddress", "required with source"),
        ({"source": "prometheus", "serverAddress": "http://p:1"}, "triggers[0].metadata.query", "required with"),
        ({**PROMETHEUS, "query": "\t"}, "triggers[0].metadata.query", "is blank"),
        ({**PROMETHEUS, "serverAddress": "http://p:1?x"}, "triggers[0].metadata.serverAddress", "no ?query"),
        ({"serverAddress": "http://p:1"}, "triggers[0].metadata.serverAddress", "belongs to source prometheus"),
        ({"source": "gateway", "metricsURL": "http://a"}, "triggers[0].metadata.metricsURL", "belongs to source vllm"),
        ({**PROMETHEUS, "metricsURL": "http://a"}, "triggers[0].metadata.metricsURL", "not prometheus"),
        ({"source": "vllm-metrics", "metricsURL": "http://a,http://a"}, "triggers[0].metadata.metricsURL", "twice"),
        ({"source": "vllm-metrics", "metricsURL": "http://a, "}, "triggers[0].metadata.metricsURL", "empty entry"),
        ({"source": "vllm-metrics", "metricsURL": "ftp://a"}, "triggers[0].metadata.metricsURL", "give an http(s)"),
        (
            {"source": "vllm-metrics", "metricsURL": "http://" + "a" * protocol.MAX_URL_LENGTH},
            "triggers[0].metadata.metricsURL",
            f"longer than {protocol.MAX_URL_LENGTH}",
        ),
    ]
    for meta, path, words in cases:
        rec = _decode(meta)
        problem = rec.spec.source_problem()
        assert problem is not None and problem[0] == path and words in problem[1], (meta, problem)
    mixed = _decode(PROMETHEUS, {"source": "gateway"}).spec.source_problem()
    assert mixed is not None and mixed[0] == "triggers[1].metadata.source" and "another source" in mixed[1]


@pytest.mark.parametrize(
    ("meta", "reason"),
    [
        ({"source": 1}, "wrong_type"),
        ({"source": None}, "wrong_type"),
        ({"query": ["up"]}, "wrong_type"),
        ({"source": "x" * 64}, "bad_value"),
        ({"serverAddress": "http://" + "p" * protocol.MAX_URL_LENGTH}, "bad_value"),
    ],
)
def test_the_keys_types_and_lengths_are_the_decoders(meta: dict[str, Any], reason: str) -> None:
    with pytest.raises(BadMessage) as err:
        _decode(meta)
    assert err.value.reason == reason, str(err.value)


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("http://p:9090", None),
        ("https://prometheus.monitoring.svc:443/prom", None),
        ("http://[::1]:8000/metrics", None),
        ("http://10.0.0.5:8000/metrics?x=1", None),
        ("p:9090", "give an http(s)://HOST[:PORT][/PATH] URL"),
        ("http://", "give an http(s)://HOST[:PORT][/PATH] URL"),
        ("http://p:notaport", "Port could not be cast"),
        ("http://[::1", "Invalid IPv6 URL"),
        ("http://u@p", "no credentials or #fragment"),
        ("http://p/#top", "no credentials or #fragment"),
        ("http://p /x", "no spaces or control characters"),
        ("http://p/\x00", "no spaces or control characters"),
    ],
)
def test_the_url_rule(url: str, problem: str | None) -> None:
    found = protocol.http_url_problem(url)
    assert (found is None) if problem is None else (found is not None and problem in found), found


def test_the_parameters_are_the_wire_names() -> None:
    meta = TriggerMetadata(model="qwen", source="prometheus", server_address="http://p:1", query="up")
    assert meta.parameters() == {"serverAddress": "http://p:1", "query": "up"}
    assert meta.source_block() == ("prometheus", (("query", "up"), ("serverAddress", "http://p:1")))
    assert TriggerMetadata(model="qwen", metrics_url=" http://a , http://b ").metrics_urls() == ("http://a", "http://b")
