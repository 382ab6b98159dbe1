"""``--ready-path`` (`AgentSettings.ready_path`) of a standby server is the path every health check of it asks:
the warm check, activation's readiness check and the liveness probe of a serving engine. Driven through a real
agent, a real nats-server and a real server process (`tests/openai_server_double.py`) that answers health only on
``/ready`` and 404 on ``/health``."""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path

from nats.aio.client import Client

from nodeagent import served
from tests.nodeagent_helpers import (  # noqa: F401
    activate,
    completion,
    deactivate,
    key,
    model_dir_fixture,
    running_agent,
    settings,
    shm_dir_fixture,
    state,
    tiny_source_fixture,
    wait_for,
    wait_state,
)
from tests.test_command_engine import command, no_leftovers
from warmpool.embedded import NatsServer
from warmpool.registry import KvSlotStore

PROBE_INTERVAL_S = 0.1


def _gets(log_path: str, path: str, status: str | None = "200") -> int:
    """Answers to ``GET path`` the server logged with `status`, None: any (``"GET /ready HTTP/1.1" 200 -``; the
    warm check speaks HTTP/1.0)."""
    return sum(
        f'"GET {path} HTTP/1.' in line and (status is None or line.endswith(f" {status} -"))
        for line in Path(log_path).read_text().splitlines()
    )


async def test_a_server_healthy_only_on_its_ready_path_activates_and_passes_the_liveness_probe(
    nats_server: NatsServer, nc: Client, store: KvSlotStore, model_dir: Path, shm_dir: Path
) -> None:
    marker = f"m{secrets.token_hex(4)}"
    cfg = settings(
        model_dir,
        shm_dir,
        nats_server.url,
        engine="command",
        engine_cmd=command("--model", marker, "--health-path", "/ready"),
        ready_path="/ready",
        engine_probe_interval_s=PROBE_INTERVAL_S,
        engine_probe_timeout_s=0.5,
    )
    async with no_leftovers(marker), running_agent(cfg) as (agent, registry):
        await wait_state(store, key("s0"), "warm")
        slot = agent.slots["s0"]
        assert isinstance(slot.engine, served.ServedEngine)
        st = agent.status().slots[0]
        assert st.log_path is not None

        claim = await store.claim_slot(key("s0"))
        reply = await activate(nc, claim)
        assert reply.ok, reply.error  # before the fix: "not ready after ... : /health answered 404"
        rec = await wait_state(store, key("s0"), "ready")
        assert rec.endpoint == reply.fields["endpoint"]
        active = slot.active
        assert active is not None and active.started.health_path == "/ready"

        # The liveness probe asks /ready too: over many probe intervals (3 failures in a row would stop the
        # engine) the engine keeps serving under the same claim, and the server saw the probes arrive.
        before = _gets(st.log_path, "/ready")
        await asyncio.sleep(PROBE_INTERVAL_S * 15)
        # before the fix: stopped after 3 probes ("/health answered 404"), the claim failed
        assert not registry.get_sample_value("pulsescale_agent_engines_unresponsive_total")
        assert slot.active is active
        rec = state(store, key("s0"))
        assert rec is not None and rec.state == "ready", rec
        assert rec.claim_id == claim.claim_id and rec.endpoint == reply.fields["endpoint"]
        await wait_for(lambda: _gets(st.log_path, "/ready") >= before + 5, 10, "liveness probes on /ready")
        out = await completion(reply.fields["endpoint"])
        assert out["object"] == "text_completion"
        # Nothing of the agent asked the default path, which this server does not serve.
        assert _gets(st.log_path, "/health", status=None) == 0

        reply = await deactivate(nc, claim)
        assert reply.ok, reply.error
        await wait_state(store, key("s0"), "warm")
