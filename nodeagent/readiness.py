"""The readiness check every engine passes before its slot is `ready`: ``GET`` of its health path answers 200,
then one real 1-token completion comes back in the OpenAI shape. The health path is the engine's
(`nodeagent.engine.Started.health_path`): /health for the local engine and vLLM, a ``command`` server's
``--ready-path``. A health endpoint alone proves the process listens, not that the model computes; the
completion proves both (and warms the first request's code path)."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Final

import aiohttp

from nodeagent.errors import EngineFailed

__all__ = ["PROBE_PROMPT", "check"]

PROBE_PROMPT: Final = "The warm pool says"
_POLL_S: Final = (0.002, 0.005, 0.01, 0.02, 0.05)
"""Health retry pauses: the local engine listens before it reports, so the first try normally succeeds; an
engine that answers 503 while it warms up is polled fast at first, then every 50 ms."""


async def check(
    session: aiohttp.ClientSession, endpoint: str, model: str, *, timeout_s: float, health_path: str = "/health"
) -> dict[str, Any]:
    """Wait for ``GET {endpoint}{health_path}`` to answer 200, then ask for one token; returns the completion.
    Raises `EngineFailed` at the deadline (code ``deadline``) or on a wrong answer (code ``not_ready``)."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    attempt = 0
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                try:
                    async with session.get(f"{endpoint}{health_path}") as r:
                        if r.status == 200:
                            break
                        last = f"{health_path} answered {r.status}"
                except aiohttp.ClientError as err:
                    last = f"{health_path}: {err}"
                await asyncio.sleep(min(_POLL_S[min(attempt, len(_POLL_S) - 1)], max(0.0, deadline - time.monotonic())))
                attempt += 1
            body = {"model": model, "prompt": PROBE_PROMPT, "max_tokens": 1, "temperature": 0}
            try:
                async with session.post(f"{endpoint}/v1/completions", json=body) as r:
                    if r.status != 200:
                        text = (await r.text())[:300]
                        raise EngineFailed(
                            "readiness", f"/v1/completions answered {r.status}: {text}", code="not_ready"
                        )
                    out: object = await r.json()
            except (aiohttp.ClientError, ValueError) as err:
                raise EngineFailed("readiness", f"/v1/completions failed: {err}", code="not_ready") from None
    except TimeoutError:
        raise EngineFailed("readiness", f"not ready after {timeout_s * 1e3:.0f} ms: {last}", code="deadline") from None
    if not isinstance(out, dict):
        raise EngineFailed(
            "readiness", f"/v1/completions answered JSON {type(out).__name__}, not an object", code="not_ready"
        )
    choices = out.get("choices")
    if out.get("object") != "text_completion" or not isinstance(choices, list) or not choices:
        raise EngineFailed("readiness", f"/v1/completions answered without choices: {str(out)[:300]}", code="not_ready")
    if not isinstance(choices[0], dict) or not isinstance(choices[0].get("text"), str):
        raise EngineFailed("readiness", "/v1/completions choice has no text", code="not_ready")
    return out
