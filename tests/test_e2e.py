"""End to end, all real: nats-server, a node agent with a pre-forked local engine on real /dev/shm weights,
the autoscaler daemon, and a gateway publishing queue samples. A pulse brings a slot to `ready` with an
endpoint that answers a completion; when the pulse is over the slot goes back to `warm`."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from pathlib import Path

from nats.aio.client import Client

from tests.nodeagent_helpers import (  # noqa: F401 - fixtures
    MODEL,
    model_dir_fixture,
    running_agent,
    settings,
    shm_dir_fixture,
    tiny_source_fixture,
)
from tests.test_autoscaler import Gateway, autoscaler_in_process, put_scaler, wait_for
from warmpool.embedded import NatsServer
from warmpool.registry import KvSlotStore

FAST_WINDOWS = {
    "cooldownPeriod": 0.5,
    "advanced": {
        "stableWindowSeconds": 1.0,
        "panicWindowSeconds": 0.5,
        "scaleDownStabilizationSeconds": 0.5,
        "scaleDownPeriodSeconds": 0.5,
        "scaleDownPercent": 100,
    },
}


def complete(endpoint: str) -> dict:  # type: ignore[type-arg]
    body = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 3}).encode()
    req = urllib.request.Request(f"{endpoint}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


async def test_pulse_to_first_token_and_back(
    nats_server: NatsServer, nc: Client, store: KvSlotStore, model_dir: Path, shm_dir: Path
) -> None:
    cfg = settings(model_dir, shm_dir, nats_server.url, slots=2)
    async with running_agent(cfg):
        await wait_for(lambda: sum(r.state == "warm" for r in store.records(MODEL)) == 2, 30)
        await put_scaler(nc, MODEL, maxReplicaCount=2, **FAST_WINDOWS)
        async with autoscaler_in_process(nats_server.url):
            gw = Gateway(nc, MODEL)
            pulse = asyncio.create_task(gw.steady(4, 2.0))  # one replica's worth
            t0 = time.monotonic()
            await wait_for(lambda: any(r.state == "ready" for r in store.records(MODEL)), 10)
            claim_to_ready = time.monotonic() - t0
            ready = next(r for r in store.records(MODEL) if r.state == "ready")
            assert ready.endpoint
            answer = await asyncio.to_thread(complete, ready.endpoint)
            assert answer["object"] == "text_completion" and answer["choices"][0]["text"]
            assert claim_to_ready < 5
            await pulse
            # Demand gone: the policy scales down after its (short) window; the agent takes the slot back.
            quiet = asyncio.create_task(gw.steady(0, 6.0))
            await wait_for(lambda: all(r.state == "warm" for r in store.records(MODEL)), 8)
            quiet.cancel()
            # And it comes back without re-staging: the same weights, another activation.
            again = asyncio.create_task(gw.steady(4, 3.0))
            await wait_for(lambda: any(r.state == "ready" for r in store.records(MODEL)), 10)
            again.cancel()
