"""Issue 8 (security), the autoscaler's side, against a real nats-server and the real daemon. A fake or malicious
node is the protocol-level double in tests/agent_double.py; everything else is real.

- a node cannot capture traffic: a future-dated or over-long lease never wins placement and shows stale, and a
  slot's endpoint comes only from its holder's fenced ``ready`` write, never from the activate reply;
- one ScaledObject cannot freeze the autoscaler: replica counts are capped at a configured maximum (with the way
  to raise it), and bring-ups per model are bounded by the claimable slots and `max_claims_in_flight`;
- on-call overrides are bounded in time (`protocol.MAX_OVERRIDE_S`), stored ones too;
- ``/metrics`` binds to loopback unless told otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import msgspec
import nats.errors
import pytest
from nats.aio.client import Client

from autoscaler.controller import ControllerSettings
from manifests import scaledobject
from oncall import verbs
from oncall.apply import apply
from oncall.client import EXIT_REFUSED
from tests.agent_double import AgentDouble
from tests.autoscaler.test_autoscaler import Gateway, collect_events, put_scaler, running_autoscaler
from tests.helpers import wait_for
from warmpool import protocol
from warmpool.embedded import NatsServer, free_port
from warmpool.protocol import Override, OverrideRecord
from warmpool.registry import KvSlotStore, ensure_buckets


def request(verb: str, **fields: Any) -> dict[str, Any]:
    return {"v": 1, "id": uuid.uuid4().hex, "expires_at": time.time() + 30, "by": "mallory@test", **fields}


async def answering(nc: Client) -> None:
    """Wait until the leader answers on-call commands: it subscribes shortly after it is elected, and the broker
    has the subscription only once its SUB arrived."""

    async def answers() -> bool:
        try:
            return bool((await send(nc, "status", request("status")))["ok"])
        except nats.errors.NoRespondersError:
            return False

    await wait_for(answers, 5, "commands answered")


async def send(nc: Client, verb: str, body: dict[str, Any], timeout_s: float = 5.0) -> dict[str, Any]:
    msg = await nc.request(protocol.cmd_subject(verb), json.dumps(body).encode(), timeout=timeout_s)
    return json.loads(msg.data)  # type: ignore[no-any-return]


def ready_count(store: KvSlotStore, model: str) -> int:
    return sum(1 for r in store.records(model) if r.state == "ready")


# --- a fake node cannot capture traffic ------------------------------------------------------------------------------


async def test_a_future_dated_or_overlong_lease_never_wins_placement_and_shows_stale(
    nats_server: NatsServer, nc: Client, store: KvSlotStore
) -> None:
    # The fake nodes' slots are the preferred tier (weights resident); the honest node's are not.
    future = await AgentDouble(nc, store, "future", "m", slots=2, heartbeat_ahead_s=3600.0).start()
    overlong = await AgentDouble(nc, store, "overlong", "m", slots=2).start()
    await overlong.put_raw_lease(lease_s=1e9)  # "fresh" for 30 years, refused at decode
    honest = await AgentDouble(nc, store, "honest", "m", slots=2, resident=False).start()
    await put_scaler(nc, "m", maxReplicaCount=2)
    claimed: set[str] = set()

    async def watch() -> None:
        async for ev in store.watch():
            rec = getattr(ev, "record", None)
            if rec is not None and rec.state != "warm":
                claimed.add(ev.key)  # type: ignore[union-attr]

    watcher = asyncio.create_task(watch())
    try:
        async with running_autoscaler(nats_server.url) as scaler:
            Gateway(nc, "m").background(8, 5.0)  # 8 queued at 4 per replica: 2 replicas
            await wait_for(lambda: ready_count(store, "m") == 2, 5, "two ready replicas")
            assert {r.node for r in store.records("m") if r.state == "ready"} == {"honest"}
            assert not {k for k in claimed if not k.startswith("m.honest.")}, "a fake node's slot was claimed"

            await answering(nc)
            [row] = (await send(nc, "status", request("status", model="m")))["models"]
            assert (row["warm"], row["stale"]) == (0, 4), row
            pool = (await send(nc, "pool", request("pool", model="m")))["slots"]
            assert {s["key"]: s["agent"] for s in pool if s["node"] != "honest"} == {
                f"m.{n}.s{i}": "stale" for n in ("future", "overlong") for i in range(2)
            }
            rejected = scaler.metrics.registry.get_sample_value
            assert rejected("pulsescale_registry_rejected_records_total", {"reason": "bad_value"}) == 1
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        for a in (future, overlong, honest):
            await a.stop()


async def test_the_endpoint_comes_from_the_fenced_ready_write_never_from_the_reply(
    nats_server: NatsServer, nc: Client, store: KvSlotStore
) -> None:
    liar = await AgentDouble(nc, store, "liar", "m", slots=1, behaviour="lie_endpoint").start()
    await put_scaler(nc, "m", maxReplicaCount=1)
    events = await collect_events(nc, "m")
    try:
        async with running_autoscaler(nats_server.url):
            Gateway(nc, "m").background(4, 5.0)
            await wait_for(lambda: any(e.type == "slot.ready" for e in events), 5, "slot.ready")
            [ready] = [e for e in events if e.type == "slot.ready"]
            assert ready.endpoint == "http://liar.test:8000"  # what the holder wrote, fenced
            assert not any(liar.reply_endpoint in json.dumps(msgspec.to_builtins(e)) for e in events)
            # Events reach every gateway: none carries a claim id (with the public token, it stops a slot).
            assert any(e.type == "slot.claimed" for e in events)
            assert [e.type for e in events if e.claim_id is not None] == []
    finally:
        await liar.stop()


async def test_a_ready_reply_without_the_fenced_ready_write_is_not_counted_ready(
    nats_server: NatsServer, nc: Client, store: KvSlotStore
) -> None:
    fake = await AgentDouble(nc, store, "fake", "m", slots=1, behaviour="no_ready_write").start()
    honest = await AgentDouble(nc, store, "honest", "m", slots=1, resident=False).start()
    await put_scaler(nc, "m", maxReplicaCount=1)
    events = await collect_events(nc, "m")
    try:
        async with running_autoscaler(nats_server.url) as scaler:
            Gateway(nc, "m").background(4, 5.0)
            await wait_for(lambda: ready_count(store, "m") == 1, 5, "one ready replica")
            await wait_for(lambda: any(e.type == "slot.ready" for e in events), 2, "slot.ready")
            assert fake.activations == ["m.fake.s0"], "the fake (preferred) slot was tried first"
            assert [(e.node, e.endpoint) for e in events if e.type == "slot.ready"] == [
                ("honest", "http://honest.test:8000")
            ]
            [failed] = [e for e in events if e.type == "slot.failed"]
            assert failed.node == "fake" and "no ready write" in (failed.reason or "")
            count = scaler.metrics.registry.get_sample_value
            assert count("pulsescale_activations_total", {"model": "m", "outcome": "ready"}) == 1
            rec, _ = await store.get("m.fake.s0")
            assert rec.state == "warm" and rec.claim_id is None  # our claim given back
    finally:
        for a in (fake, honest):
            await a.stop()


# --- one ScaledObject cannot freeze the autoscaler ----------------------------------------------------------------


async def test_scale_over_the_replica_limit_is_refused_with_the_limit_and_how_to_raise_it(
    nats_server: NatsServer, nc: Client, store: KvSlotStore
) -> None:
    await put_scaler(nc, "big", maxReplicaCount=100_000)  # the wire allows it; the autoscaler's limit does not
    async with running_autoscaler(nats_server.url) as scaler:
        await wait_for(lambda: "big" in scaler.fleet.by_model, 5, "big followed")
        await answering(nc)
        assert scaler.fleet.by_model["big"].spec.max_replica_count == scaledobject.DEFAULT_MAX_REPLICAS
        for verb, extra in (("scale", {"for_s": 60}), ("pause", {})):
            reply = await send(nc, verb, request(verb, model="big", replicas=100_000, **extra))
            assert reply["ok"] is False and reply["error"]["code"] == "out_of_bounds", reply
            message = reply["error"]["message"]
            assert "100000" in message and f"limit of {scaledobject.DEFAULT_MAX_REPLICAS}" in message
            assert "--max-replicas" in message and scaledobject.MAX_REPLICAS_ENV in message
        assert scaler.fleet.by_model["big"].override is None


async def test_a_huge_target_with_two_slots_keeps_the_autoscaler_answering(
    nats_server: NatsServer, nc: Client, store: KvSlotStore
) -> None:
    agent = await AgentDouble(nc, store, "node-0", "big", slots=2).start()
    await put_scaler(nc, "big", maxReplicaCount=100_000)
    await put_scaler(nc, "other")
    events = await collect_events(nc, "big")
    bound = 4
    try:
        async with running_autoscaler(
            nats_server.url, max_replicas=100_000, controller=ControllerSettings(max_claims_in_flight=bound)
        ) as scaler:
            await answering(nc)
            big = scaler.fleet.by_model["big"].scaler
            peak = 0

            async def sample_in_flight() -> None:
                nonlocal peak
                while True:
                    bring_ups = sum(1 for t in asyncio.all_tasks() if t.get_name().startswith("bring-up-"))
                    peak = max(peak, big.activating, bring_ups)
                    await asyncio.sleep(0.001)

            sampler = asyncio.create_task(sample_in_flight())
            try:
                reply = await send(nc, "scale", request("scale", model="big", replicas=100_000, for_s=60))
                assert reply["ok"], reply
                await wait_for(lambda: ready_count(store, "big") == 2, 5, "both slots ready")
                # Several housekeeping ticks (0.25 s each) while the target stays out of reach.
                slowest = 0.0
                for _ in range(10):
                    t0 = time.monotonic()
                    status = await send(nc, "status", request("status", model="other"), timeout_s=10)
                    slowest = max(slowest, time.monotonic() - t0)
                    assert status["ok"], status
                    await asyncio.sleep(0.1)
            finally:
                sampler.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sampler
            assert slowest < 1.0, f"status of another model took {slowest:.2f} s"
            assert peak <= bound, f"{peak} bring-ups in flight for one model"
            exhausted = [e for e in events if e.type == "pool.exhausted"]
            assert len(exhausted) == 1, [e.reason for e in exhausted]  # said once, not every tick
            assert scaler.metrics.registry.get_sample_value("pulsescale_cold_path_total", {"model": "big"}) == 1
    finally:
        await agent.stop()


def test_apply_refuses_replica_counts_over_the_limit_unless_raised(
    tmp_path: Any, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    doc = {
        "apiVersion": scaledobject.API_VERSION,
        "kind": scaledobject.KIND,
        "metadata": {"name": "big"},
        "spec": {
            "scaleTargetRef": {"name": "big"},
            "maxReplicaCount": 100_000,
            "triggers": [{"type": "gateway-queue", "metadata": {"model": "big"}}],
        },
    }
    path = tmp_path / "big.yaml"
    path.write_text(json.dumps(doc))  # JSON is YAML
    monkeypatch.delenv(scaledobject.MAX_REPLICAS_ENV, raising=False)
    assert apply(["-f", str(path), "--dry-run"], "pulsescale apply") == EXIT_REFUSED
    err = capsys.readouterr().err
    assert "spec.maxReplicaCount: 100000 is over the limit of 1000" in err and "--max-replicas" in err
    assert apply(["-f", str(path), "--dry-run", "--max-replicas", "100000"], "pulsescale apply") == 0
    monkeypatch.setenv(scaledobject.MAX_REPLICAS_ENV, "100000")
    assert apply(["-f", str(path), "--dry-run"], "pulsescale apply") == 0
    assert "replicas 0..100000" in capsys.readouterr().out


# --- overrides are bounded in time -----------------------------------------------------------------------------------


async def test_scale_for_longer_than_a_day_is_refused_and_a_stored_one_is_not_obeyed(
    nats_server: NatsServer, nc: Client, store: KvSlotStore, capsys: pytest.CaptureFixture[str]
) -> None:
    leases = (await ensure_buckets(nc.jetstream()))[protocol.LEASES_BUCKET]
    await put_scaler(nc, "m")
    await put_scaler(nc, "n")
    # Written around the command service: held at 8 for a year.
    forged = Override(kind="scale", replicas=8, expires_at=time.time() + 365 * 86400, by="mallory")
    await leases.put(protocol.override_key("n"), protocol.encode(OverrideRecord(model="n", override=forged)))
    async with running_autoscaler(nats_server.url) as scaler:
        await wait_for(lambda: "n" in scaler.fleet.by_model and "m" in scaler.fleet.by_model, 5, "m and n followed")
        await answering(nc)
        count = scaler.metrics.registry.get_sample_value
        await wait_for(lambda: count("pulsescale_registry_rejected_records_total", {"reason": "too_late"}), 5)
        assert scaler.fleet.by_model["n"].override is None

        too_long = protocol.MAX_OVERRIDE_S + 1
        reply = await send(nc, "scale", request("scale", model="m", replicas=2, for_s=too_long))
        assert reply["ok"] is False and reply["error"]["code"] == "out_of_bounds", reply
        assert "longer than an override may last (86400 s)" in reply["error"]["message"]
        assert scaler.fleet.by_model["m"].override is None
        ok = await send(nc, "scale", request("scale", model="m", replicas=2, for_s=protocol.MAX_OVERRIDE_S))
        assert ok["ok"] and ok["override"]["expires_at"] <= time.time() + protocol.MAX_OVERRIDE_S

    with pytest.raises(SystemExit) as exit_:
        verbs.scale(["m", "--replicas", "2", "--for", "25h", "--nats", nats_server.url], "pulsescale scale")
    assert exit_.value.code == 2
    assert "longer than an override may last (24h)" in capsys.readouterr().err


# --- /metrics binds where told ------------------------------------------------------------------------------------


def _get(host: str, port: int) -> int | None:
    """The status of GET /metrics on `host`, or None when nothing listens there."""
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=2) as r:
            return int(r.status)
    except ConnectionRefusedError:
        return None
    except urllib.error.URLError as err:
        if isinstance(err.reason, ConnectionRefusedError):
            return None
        raise


@pytest.mark.parametrize(("host", "other"), [(None, "127.0.0.2"), ("127.0.0.2", "127.0.0.1")])
async def test_metrics_listen_on_loopback_unless_told(nats_server: NatsServer, host: str | None, other: str) -> None:
    kw: dict[str, Any] = {"metrics_port": 0} | ({"metrics_host": host} if host else {})
    async with running_autoscaler(nats_server.url, **kw) as scaler:
        port = scaler.metrics_port
        assert port
        assert await asyncio.to_thread(_get, host or "127.0.0.1", port) == 200
        assert await asyncio.to_thread(_get, other, port) is None, f"/metrics answers on {other} too"


@contextlib.contextmanager
def _daemon(argv: list[str]) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "pulsescale", "autoscaler", "--log-level", "WARNING", *argv],
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def test_the_metrics_host_flag_binds_the_daemon_there(nats_server: NatsServer) -> None:
    port = free_port()
    with _daemon(["--nats", nats_server.url, "--metrics-host", "127.0.0.2", "--metrics-port", str(port)]):
        await wait_for(lambda: asyncio.to_thread(_get, "127.0.0.2", port), 15, "/metrics on 127.0.0.2")
        assert await asyncio.to_thread(_get, "127.0.0.1", port) is None
