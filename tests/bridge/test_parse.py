"""The parsers of `bridge.parse`: vLLM pages (as prometheus_client renders them, as vLLM does) and instant-query
answers (as the Prometheus HTTP API writes them), and every bad input named."""

from __future__ import annotations

import json

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from bridge.errors import SourceError
from bridge.parse import engine_page, query_value
from bridge.readings import EngineReading


def vllm_page(models: dict[str, tuple[float, float, int]], *, engines: int = 1) -> bytes:
    """A page with vLLM's families and labels, and a histogram as noise (most of a real page is histograms)."""
    r = CollectorRegistry()
    labels = ["model_name", "engine"]
    waiting = Gauge("vllm:num_requests_waiting", "w", labels, registry=r)
    running = Gauge("vllm:num_requests_running", "r", labels, registry=r)
    success = Counter("vllm:request_success", "s", [*labels, "finished_reason"], registry=r)
    latency = Histogram("vllm:e2e_request_latency_seconds", "l", labels, registry=r)
    for model, (w, run, done) in models.items():
        for e in range(engines):
            waiting.labels(model, str(e)).set(w)
            running.labels(model, str(e)).set(run)
            success.labels(model, str(e), "stop").inc(done)
            success.labels(model, str(e), "abort").inc(1)
            latency.labels(model, str(e)).observe(0.5)
    return generate_latest(r)


def test_a_vllm_page_sums_engines_and_finish_reasons() -> None:
    page = engine_page(vllm_page({"tiny": (3, 2, 10)}, engines=2), model=None, names={})
    assert page.readings == {"tiny": EngineReading(waiting=6, running=4, finished_total=22)}
    assert page.named == frozenset({"tiny"}) and page.errors == ()


def test_a_bound_source_counts_every_series_for_its_model() -> None:
    page = engine_page(vllm_page({"Qwen/Qwen2.5-0.5B": (1, 1, 0)}), model="qwen", names={})
    assert page.readings == {"qwen": EngineReading(1, 1, 1)} and page.named is None


def test_served_names_are_mapped_and_a_bad_one_is_named_and_left_out() -> None:
    body = vllm_page({"Qwen/Qwen2.5-0.5B": (2, 1, 5), "Other/Model": (9, 9, 9), "ok": (1, 0, 0)})
    page = engine_page(body, model=None, names={"Qwen/Qwen2.5-0.5B": "qwen"})
    assert set(page.readings) == {"qwen", "ok"} and page.readings["qwen"].waiting == 2
    assert [e.reason for e in page.errors] == ["bad_model_name"]
    assert "Other/Model" in str(page.errors[0]) and "--model-name" in str(page.errors[0])


def test_a_page_without_the_counter_reads_no_rates() -> None:
    body = b"vllm:num_requests_waiting{model_name='x'} 1\n".replace(b"'", b'"')
    body += b'vllm:num_requests_running{model_name="x"} 2\n'
    assert engine_page(body, model=None, names={}).readings == {"x": EngineReading(1, 2, None)}


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"<html><body>502 Bad Gateway</body></html>", "bad_body"),
        (b'{"status": "ok"}', "bad_body"),
        (b"\xff\xfe\x00", "bad_body"),
        (b'vllm:num_requests_waiting{model_name="x" 1\n', "bad_body"),
        (b"", "no_series"),
        (b"# HELP up 1\nup 1\n", "no_series"),
        (b'vllm:num_requests_waiting{model_name="x"} 1\n', "no_series"),  # no running
        (b'vllm:num_requests_waiting{model_name="x"} NaN\nvllm:num_requests_running{model_name="x"} 1\n',
         "not_finite"),
        (b'vllm:num_requests_waiting{model_name="x"} +Inf\nvllm:num_requests_running{model_name="x"} 1\n',
         "not_finite"),
        (b'vllm:num_requests_waiting{model_name="x"} -1\nvllm:num_requests_running{model_name="x"} 1\n', "bad_value"),
    ],
)  # fmt: skip
def test_bad_pages_are_named(body: bytes, reason: str) -> None:
    # A bound source fails whole; an unbound one leaves the model out and names why (or fails: nothing usable).
    with pytest.raises(SourceError) as err:
        engine_page(body, model="x", names={})
    assert err.value.reason == reason
    if reason in ("not_finite", "bad_value"):
        page = engine_page(body, model=None, names={})
        assert page.readings == {} and page.named == frozenset({"x"}) and [e.reason for e in page.errors] == [reason]


def test_an_unbound_page_keeps_its_good_models_beside_a_bad_one() -> None:
    body = vllm_page({"good": (1, 2, 3)}) + b'vllm:num_requests_waiting{model_name="bad"} NaN\n'
    body += b'vllm:num_requests_running{model_name="bad"} 1\n'
    page = engine_page(body, model=None, names={})
    assert set(page.readings) == {"good"} and page.named == frozenset({"good", "bad"})
    assert [e.reason for e in page.errors] == ["not_finite"]


def answer(kind: str, result: object, status: str = "success") -> bytes:
    return json.dumps({"status": status, "data": {"resultType": kind, "result": result}}).encode()


@pytest.mark.parametrize(
    ("body", "status", "expected"),
    [
        (answer("vector", [{"metric": {}, "value": [1.7e9, "4"]}]), 200, 4),
        (answer("vector", [{"metric": {}, "value": [1.7e9, "2.5"]}]), 200, 3),  # rounded, half up
        (answer("scalar", [1.7e9, "7"]), 200, 7),
        (answer("vector", []), 200, "no_series"),
        (answer("vector", [{"metric": {"a": "1"}, "value": [1, "1"]}, {"metric": {"a": "2"}, "value": [1, "2"]}]),
         200, "several_series"),
        (answer("vector", [{"metric": {}, "value": [1.7e9, "NaN"]}]), 200, "not_finite"),
        (answer("vector", [{"metric": {}, "value": [1.7e9, "+Inf"]}]), 200, "not_finite"),
        (answer("vector", [{"metric": {}, "value": [1.7e9, "-3"]}]), 200, "bad_value"),
        (answer("matrix", [{"metric": {}, "values": [[1, "1"]]}]), 200, "bad_body"),
        (answer("vector", [{"metric": {}}]), 200, "bad_body"),
        (b'{"status": "error", "errorType": "bad_data", "error": "parse error"}', 400, "query_error"),
        (b"<html>proxy error</html>", 502, "http_status"),
        (b"not json", 200, "bad_body"),
        (b"[1, 2]", 200, "bad_body"),
    ],
)  # fmt: skip
def test_query_answers(body: bytes, status: int, expected: int | str) -> None:
    if isinstance(expected, int):
        assert query_value(body, status) == expected
        return
    with pytest.raises(SourceError) as err:
        query_value(body, status)
    assert err.value.reason == expected
