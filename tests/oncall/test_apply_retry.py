"""`pulsescale apply` against a real nats-server whose first writes of `pulse_scalers` find no responder or time
out, as the first write to a stream a fresh cluster just made can (issue 25, finding 4): asked again, bounded."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import nats
import nats.errors
import nats.js.errors
import pytest
from nats.js.kv import KeyValue

from oncall import apply as oncall_apply
from oncall.client import EXIT_REFUSED
from warmpool import protocol
from warmpool.embedded import NatsServer

EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "examples" / "scaledobject-qwen.yaml"


def unanswered_first(monkeypatch: pytest.MonkeyPatch, *errors: Exception) -> list[str]:
    """`KeyValue.put` raises `errors` on its first calls (the broker never saw them), then writes for real."""
    real = KeyValue.put
    left = list(errors)
    calls: list[str] = []

    async def put(self: KeyValue, key: str, value: bytes, *args: Any, **kw: Any) -> int:
        calls.append(key)
        if left:
            raise left.pop(0)
        return await real(self, key, value, *args, **kw)

    monkeypatch.setattr(KeyValue, "put", put)
    return calls


async def stored_keys(url: str) -> list[str]:
    nc = await nats.connect(url)
    try:
        kv = await nc.jetstream().key_value(protocol.SCALERS_BUCKET)
        return sorted(await kv.keys())
    finally:
        await nc.close()


@pytest.mark.parametrize(
    "errors",
    [
        pytest.param([nats.js.errors.NoStreamResponseError()], id="no-responders"),
        pytest.param([nats.errors.TimeoutError(), nats.js.errors.NoStreamResponseError()], id="timeout"),
    ],
)
def test_apply_retries_a_first_write_that_is_not_answered(
    nats_server: NatsServer,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    errors: list[Exception],
) -> None:
    calls = unanswered_first(monkeypatch, *errors)
    code = oncall_apply.apply(["-f", str(EXAMPLE), "--nats", nats_server.url], "pulsescale apply")
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "created" in out.out
    assert len(calls) == len(errors) + 1
    assert asyncio.run(stored_keys(nats_server.url)) == [calls[-1]]


def test_apply_gives_up_on_a_write_never_answered(
    nats_server: NatsServer, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(oncall_apply, "APPLY_RETRY_S", 1.0)
    calls = unanswered_first(monkeypatch, *(nats.js.errors.NoStreamResponseError() for _ in range(100)))
    code = oncall_apply.apply(["-f", str(EXAMPLE), "--nats", nats_server.url], "pulsescale apply")
    assert code == EXIT_REFUSED
    assert "failed" in capsys.readouterr().err
    assert 2 <= len(calls) <= 6, calls
