"""Replay a request trace (`warmpool.traces`) against an OpenAI-style endpoint: ``pulsescale load URL --trace FILE``.

Each request is sent at its offset in the trace (divided by the trace's speed), open loop as the pulse generator
(`gateway.loadgen`) is: nothing waits for earlier answers, and a replay that falls behind its schedule says by how
much. A request asks for the trace's generated tokens as ``max_tokens`` (at least 1; `default_max_tokens` where the
trace gives none), the trace row's model (or `model` where the row names none), and, where the trace gives context
tokens, a prompt of about that many tokens (one filler word per token), else `prompt`. The replay is bounded: it
ends after the trace's last request, or after `max_requests` or `duration_s` if they come first, once every answer
is in (or `request_timeout_s` passed).

    trace = traces.read_trace(Path("AzureLLMInferenceTrace_conv.csv"), speed=10)
    result = await run_trace("http://127.0.0.1:8080", trace, model="tiny")
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable, Iterator

import numpy as np

from gateway.loadgen import LoadResult, Second, send_schedule
from warmpool import traces

__all__ = ["FILLER_WORD", "MissingModel", "prompt_of", "run_trace"]

FILLER_WORD = "hello"
"""A prompt of N context tokens is this word N times: one token each (with its leading space) in the common BPE
vocabularies, so the length is about right without a tokenizer."""


class MissingModel(ValueError):
    """Some of the trace's requests name no model and no default model was given."""


def prompt_of(context_tokens: int, fallback: str) -> str:
    """A prompt of about `context_tokens` tokens (at least one word); `fallback` when the trace gives none (-1)."""
    if context_tokens < 0:
        return fallback
    return " ".join([FILLER_WORD] * max(1, context_tokens))


async def run_trace(
    url: str,
    trace: traces.Trace,
    *,
    model: str | None = None,
    prompt: str = "hello",
    default_max_tokens: int = traces.DEFAULT_GENERATED_TOKENS,
    max_requests: int | None = None,
    duration_s: float | None = None,
    path: str = "/v1/completions",
    request_timeout_s: float = 120.0,
    max_outstanding: int = 10_000,
    on_second: Callable[[Second], None] | None = None,
    stop: asyncio.Event | None = None,
) -> LoadResult:
    """Replay `trace` against `url` + `path` (module doc). Raises `MissingModel` before sending anything when a
    request names no model and `model` is None; ValueError for a bound below 0."""
    n = len(trace)
    if max_requests is not None:
        if max_requests < 0:
            raise ValueError(f"max_requests must be >= 0, not {max_requests}")
        n = min(n, max_requests)
    if duration_s is not None:
        if not (math.isfinite(duration_s) and duration_s >= 0):
            raise ValueError(f"duration_s must be finite and >= 0, not {duration_s}")
        n = min(n, int(np.searchsorted(trace.t_s, duration_s, side="left")))
    models = trace.models
    if model is None and (models is None or any(m is None for m in models[:n])):
        unnamed = n if models is None else sum(m is None for m in models[:n])
        raise MissingModel(f"{unnamed} of the trace's requests name no model: give the model to send them to")
    t_s = trace.t_s[:n]
    per_second = np.bincount(np.floor(t_s).astype(np.int64), minlength=1) if n else np.zeros(1, np.int64)
    seconds = [Second(t, "trace", float(c)) for t, c in enumerate(per_second)]

    def schedule() -> Iterator[tuple[float, bytes]]:
        for i in range(n):
            generated = int(trace.generated_tokens[i])
            body = {
                "model": (models[i] if models is not None else None) or model,
                "prompt": prompt_of(int(trace.context_tokens[i]), prompt),
                "max_tokens": max(1, generated if generated >= 0 else default_max_tokens),
            }
            yield float(t_s[i]), json.dumps(body).encode()

    started_at = await send_schedule(
        url.rstrip("/") + path,
        schedule(),
        seconds,
        request_timeout_s=request_timeout_s,
        max_outstanding=max_outstanding,
        on_second=on_second,
        stop=stop,
    )
    used = set(models[:n]) if models is not None else {None}
    sent_to = ",".join(sorted({m or model or "" for m in used}))
    info: dict[str, object] = {
        "file": trace.source,
        "format": trace.format,
        "speed": trace.speed,
        "requests": n,
        "of": len(trace),
        "duration_s": float(t_s[-1]) if n else 0.0,
    }
    return LoadResult(url, sent_to, None, "trace", seconds, started_at, trace=info)
