"""Reading what a source answered: an engine's Prometheus page (vLLM's ``/metrics``) or a Prometheus server's instant
query (``/api/v1/query``, as KEDA's prometheus scaler asks it). Pure: bytes in, readings or a `SourceError` out.

The text format is parsed by ``prometheus_client.parser.text_string_to_metric_families`` (the client library's own
parser). A vLLM page is mostly histograms (hundreds of lines per model) and the parser is pure Python, so only the
lines of the three families read here are handed to it; every other line is still checked to look like the text
format (a comment, or a metric name first), so an HTML or JSON body is ``bad_body``, not an empty page.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

from prometheus_client.parser import text_string_to_metric_families

from bridge.errors import SourceError
from bridge.readings import MAX_COUNT, EngineReading
from warmpool import protocol

__all__ = ["FINISHED", "MODEL_LABEL", "RUNNING", "WAITING", "Page", "engine_page", "query_value"]

WAITING: Final = "vllm:num_requests_waiting"
RUNNING: Final = "vllm:num_requests_running"
FINISHED: Final = "vllm:request_success_total"
"""Every finished request, by ``finished_reason`` (stop, length, abort, error, ...): summed."""
MODEL_LABEL: Final = "model_name"
_WANTED: Final = (WAITING, RUNNING, FINISHED)
# A sample line starts with a metric name (colons allowed, as vLLM's), then labels, a space or the end.
_SAMPLE_LINE: Final = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*(?:[{ \t]|$)")


@dataclass(frozen=True)
class Page:
    """What one engine page says, per pulsescale model."""

    readings: dict[str, EngineReading]
    """Models with a usable reading."""
    named: frozenset[str] | None = None
    """An unbound source's page: every model it names, usable or not (a model it stops naming is dropped from the
    source). None: a bound source's, whose one model stays expected."""
    errors: tuple[SourceError, ...] = field(default=())
    """Per-model problems of an otherwise good page (that model left out), and names refused."""


def _wanted_lines(text: str) -> str:
    out = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 3 and parts[1] in ("HELP", "TYPE") and parts[2].startswith(_WANTED):
                out.append(line)
            continue
        if not _SAMPLE_LINE.match(line):
            raise SourceError("bad_body", f"not the Prometheus text format: {line[:80]!r}")
        if line.startswith(_WANTED):
            out.append(line)
    return "\n".join(out) + "\n"


def _count(value: float, what: str) -> int:
    if not math.isfinite(value):
        raise SourceError("not_finite", f"{what} is {value}")
    if value < 0 or value > MAX_COUNT:
        raise SourceError("bad_value", f"{what} is {value:g}: a count is >= 0 and at most 2**53")
    return math.floor(value + 0.5)  # gauges of counts are whole; a fraction (an average) is rounded, not cut


def engine_page(body: bytes, *, model: str | None, names: Mapping[str, str]) -> Page:
    """The readings of a vLLM-style page. `model`: every series counts for it (a slot's engine, a target bound to a
    model); None: by each series' ``model_name``, renamed by `names` (served name -> pulsescale model)."""
    try:
        text = body.decode()
    except UnicodeDecodeError:
        raise SourceError("bad_body", "not UTF-8 text") from None
    wanted = _wanted_lines(text)
    sums: dict[str, dict[str, float]] = {}
    refused: dict[str, SourceError] = {}
    try:
        for family in text_string_to_metric_families(wanted):
            for s in family.samples:
                if s.name not in _WANTED:
                    continue  # e.g. request_success_created
                served = s.labels.get(MODEL_LABEL, "")
                name = model if model is not None else names.get(served, served)
                if not protocol.is_name(name):
                    refused.setdefault(
                        served,
                        SourceError(
                            "bad_model_name",
                            f"{MODEL_LABEL}={served!r} is not a model name ({protocol.NAME_PATTERN}); map it with "
                            "--model-name SERVED=MODEL",
                        ),
                    )
                    continue
                per = sums.setdefault(name, {})
                per[s.name] = per.get(s.name, 0.0) + float(s.value)  # NaN and Inf stay what they are
    except (ValueError, IndexError, KeyError, TypeError) as err:
        raise SourceError("bad_body", f"not the Prometheus text format: {err}") from None
    if not sums and not refused:
        raise SourceError("no_series", f"none of {', '.join(_WANTED)}: is this a vLLM /metrics page?")
    readings: dict[str, EngineReading] = {}
    errors: list[SourceError] = list(refused.values())
    for name, per in sums.items():
        try:
            if WAITING not in per or RUNNING not in per:
                missing = WAITING if WAITING not in per else RUNNING
                raise SourceError("no_series", f"{name}: no {missing}")
            finished = per.get(FINISHED)
            readings[name] = EngineReading(
                waiting=_count(per[WAITING], f"{name}: {WAITING}"),
                running=_count(per[RUNNING], f"{name}: {RUNNING}"),
                finished_total=None if finished is None else _count(finished, f"{name}: {FINISHED}"),
            )
        except SourceError as err:
            if model is not None:
                raise  # the one model this source reports
            errors.append(err)
    if model is not None and not readings:
        raise errors[0] if errors else SourceError("no_series", f"no series for {model}")
    return Page(readings, frozenset(sums) if model is None else None, tuple(errors))


def query_value(body: bytes, status: int = 200) -> int:
    """The demand an instant query's answer says: its one series' value (or the scalar), rounded to a count."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        if status != 200:
            raise SourceError("http_status", f"HTTP {status}") from None
        raise SourceError("bad_body", "not JSON: not a Prometheus /api/v1/query answer") from None
    if not isinstance(doc, dict):
        raise SourceError("bad_body", "not a JSON object")
    if doc.get("status") == "error":
        raise SourceError("query_error", f"{doc.get('errorType', 'error')}: {str(doc.get('error', ''))[:200]}")
    if status != 200:
        raise SourceError("http_status", f"HTTP {status}")
    data = doc.get("data")
    if doc.get("status") != "success" or not isinstance(data, dict):
        raise SourceError("bad_body", "no status success with data: not a Prometheus /api/v1/query answer")
    kind, result = data.get("resultType"), data.get("result")
    try:
        if kind == "vector" and isinstance(result, list):
            if not result:
                raise SourceError("no_series", "the query returned no series (is the engine scraped? a typo?)")
            if len(result) > 1:
                raise SourceError(
                    "several_series", f"the query returned {len(result)} series; aggregate it, e.g. sum(...)"
                )
            raw = result[0]["value"][1]
        elif kind == "scalar" and isinstance(result, list):
            raw = result[1]
        else:
            raise SourceError("bad_body", f"result type {kind!r}: give an instant vector or scalar query")
        value = float(raw)  # the API writes numbers as strings: "3", "NaN", "+Inf"
    except (KeyError, IndexError, TypeError, ValueError):
        raise SourceError("bad_body", "a result without a [time, value] pair") from None
    return _count(value, "the query's value")
