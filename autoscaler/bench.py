"""`pulsescale bench decide`: decision latency and ingest throughput.

1. In-process ingest: decode + fold + (debounced) decide for samples spread over `--models` models, one core.
2. End to end, against an embedded nats-server and a real `pulsescale autoscaler` process: `--models` models
   have ScaledObjects and warm slots and get steady background samples; then one model at a time gets a pulse,
   and we time *sample published -> first claim written* by watching `pulse_slots`. A stand-in agent in this
   process answers `activate` at once (writing `activating` and `ready` as a holder's agent does), so the figure
   is the autoscaler's own and not an engine's.
   Next to it, the floor measured in the same run and conditions (the background samples flowing): bare nats-py
   doing the path's irreducible work, *sample published -> a subscriber on its own connection does one
   kv.update(key, value, last=rev) -> a KV watcher sees it*, one pulse per model like the timed ones; and the
   ratio of the two.
3. Ingest throughput through NATS: samples published as fast as one publisher can, counted by the
   autoscaler's `pulsescale_samples_total` metric.
Figures are printed, not asserted: these machines are shared and noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import time
import urllib.request

import msgspec
import numpy as np
from nats.js.api import KeyValueConfig

from autoscaler.controller import Deps, LocalColdPath, ModelController
from autoscaler.metrics import AutoscalerMetrics
from warmpool import connect, protocol
from warmpool.embedded import NatsServer, free_port
from warmpool.errors import PulsescaleError
from warmpool.protocol import QueueSample, ScaledObjectSpec, ScalerRecord
from warmpool.registry import BucketSettings, Changed, KvSlotStore, ensure_buckets
from warmpool.seed import seed_pool


def _spec(model: str) -> ScaledObjectSpec:
    return protocol.decode(
        msgspec.json.encode(
            {
                "scaleTargetRef": {"name": model},
                "minReplicaCount": 0,
                "maxReplicaCount": 4,
                "triggers": [{"type": "gateway-queue", "metadata": {"model": model, "targetQueueDepth": 4}}],
            }
        ),
        ScaledObjectSpec,
    )


def _sample(model: str, seq: int, depth: int, gateway: str = "bench") -> bytes:
    return protocol.encode(
        QueueSample(
            gateway=gateway,
            model=model,
            seq=seq,
            ts=time.time(),
            queue_depth=depth,
            inflight=0,
            arrivals_total=seq,
            completions_total=seq,
            timeouts_total=0,
        )
    )


async def _ingest_in_process(nc, store: KvSlotStore, models: int, samples: int) -> float:  # type: ignore[no-untyped-def]
    """Samples/s through decode -> ingest -> debounced decide; a follower's controllers, so nothing is claimed."""
    deps = Deps(
        nc=nc,
        store=store,
        metrics=AutoscalerMetrics(),
        cold_path=LocalColdPath(),
        is_leader=lambda: False,
    )
    ctrls = {
        f"x{i}": ModelController(ScalerRecord(namespace="bench", name=f"x{i}", spec=_spec(f"x{i}")), deps)
        for i in range(models)
    }
    names = list(ctrls)
    payloads = [_sample(names[i % models], i // models + 1, i % 7) for i in range(samples)]
    t0 = time.perf_counter()
    for data in payloads:
        s = protocol.decode(data, QueueSample)
        ctrls[s.model].on_sample(s, time.time())
    return samples / (time.perf_counter() - t0)


async def _stand_in_agent(nc, store: KvSlotStore) -> None:  # type: ignore[no-untyped-def]
    """Answers for every node at once, as the holder's agent would: `activating`, then `ready` with the endpoint
    (the autoscaler reads the endpoint from that fenced write), then the reply; `deactivate` gives the slot back."""

    def key_of(subject: str, slot: str, claim_id: str) -> str | None:
        node = subject.split(".")[2]
        held = [r for r in store.records() if r.node == node and r.slot == slot and r.claim_id == claim_id]
        return held[0].key if held else None

    async def activate(msg) -> None:  # type: ignore[no-untyped-def]
        req = protocol.decode(msg.data, protocol.ActivateRequest)
        key = key_of(msg.subject, req.slot, req.claim_id)
        for _ in range(100):  # the claim's watch echo may still be on its way to this process
            if key is not None:
                break
            await asyncio.sleep(0.002)
            key = key_of(msg.subject, req.slot, req.claim_id)
        try:
            if key is None:
                raise PulsescaleError(f"no slot {req.slot} held by {req.claim_id}")
            await store.set_state(key, "activating", expect=["claimed"], token=req.token)
            await store.set_state(key, "ready", expect=["activating"], endpoint="http://127.0.0.1:1/bench")
        except PulsescaleError as err:
            reply = protocol.refusal(protocol.ActivateReply, "stale_token", str(err), slot=req.slot)
        else:
            reply = protocol.ActivateReply(slot=req.slot, key=key, state="ready", timings=protocol.StageTimings())
        await msg.respond(protocol.encode(reply))

    async def deactivate(msg) -> None:  # type: ignore[no-untyped-def]
        req = protocol.decode(msg.data, protocol.DeactivateRequest)
        key = key_of(msg.subject, req.slot, req.claim_id)
        claim = store.adopt(key) if key is not None else None
        if claim is not None:
            with contextlib.suppress(PulsescaleError):
                await store.release(claim, reason="deactivated")
        await msg.respond(protocol.encode(protocol.DeactivateReply(slot=req.slot, key=key)))

    await nc.subscribe("pulse.agent.*.activate", cb=activate)
    await nc.subscribe("pulse.agent.*.deactivate", cb=deactivate)


FLOOR_BUCKET = "pulse_bench_decide_floor"
"""Scratch bucket for the bare nats-py floor; never one the system uses."""
FLOOR_PREFIX = "bench.decide.floor."


async def _floor(nc, url: str, models: list[str], value: bytes) -> list[float]:  # type: ignore[no-untyped-def]
    """Bare nats-py, the decide path's irreducible work: a sample published -> a subscriber on its own connection
    (as the autoscaler has) decodes it and does one kv.update on the revision it last wrote -> our KV watcher sees
    the update. One pulse per model, one at a time, as the timed pulses. Latencies (s)."""
    js = nc.jetstream(timeout=5.0)
    with contextlib.suppress(Exception):
        await js.delete_key_value(FLOOR_BUCKET)
    settings = BucketSettings()
    kv = await js.create_key_value(
        KeyValueConfig(bucket=FLOOR_BUCKET, history=settings.slot_history, storage=settings.storage)
    )
    keys = {m: f"{m}.floor.s0" for m in models}
    revs = {m: await kv.put(keys[m], value) for m in models}
    responder = await connect.connect(connect.NatsOptions(servers=(url,), name="bench-decide-floor"))
    rkv = await responder.jetstream(timeout=5.0).key_value(FLOOR_BUCKET)

    async def on_sample(msg) -> None:  # type: ignore[no-untyped-def]
        sample = protocol.decode(msg.data, QueueSample)
        revs[sample.model] = await rkv.update(keys[sample.model], value, last=revs[sample.model])

    sub = await responder.subscribe(FLOOR_PREFIX + "*", cb=on_sample)
    await responder.flush()
    seen: dict[str, asyncio.Event] = {k: asyncio.Event() for k in keys.values()}
    watcher = await kv.watchall()

    async def follow() -> None:
        async for entry in watcher:
            if entry is not None and entry.key in seen:
                seen[entry.key].set()

    follower = asyncio.create_task(follow())
    await asyncio.sleep(0.2)  # the watcher's initial listing goes by
    latencies: list[float] = []
    try:
        for seq, m in enumerate(models, 1):
            event = seen[keys[m]]
            event.clear()
            t0 = time.perf_counter()
            await nc.publish(FLOOR_PREFIX + m, _sample(m, seq, 16))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), 2.0)
                latencies.append(time.perf_counter() - t0)
            await asyncio.sleep(0.02)
    finally:
        follower.cancel()
        await watcher.stop()
        await sub.unsubscribe()
        await responder.close()
        with contextlib.suppress(Exception):
            await js.delete_key_value(FLOOR_BUCKET)
    return latencies


def _metric(port: int, name: str) -> float:
    total = 0.0
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
    return total


async def _end_to_end(args: argparse.Namespace) -> None:
    server = NatsServer().start()
    proc = None
    try:
        nc = await connect.connect(connect.NatsOptions(servers=(server.url,), name="bench-decide"))
        store = await KvSlotStore.open(nc)
        await store.start()
        scalers = (await ensure_buckets(nc.jetstream()))[protocol.SCALERS_BUCKET]
        models = [f"m{i}" for i in range(args.models)]
        for i, m in enumerate(models):
            await seed_pool(store, m, nodes=2, slots_per_node=2, node_prefix=f"n{i}")
            rec = ScalerRecord(namespace="bench", name=m, spec=_spec(m))
            await scalers.put(rec.key, protocol.encode(rec))
        await _stand_in_agent(nc, store)
        rate = await _ingest_in_process(nc, store, args.models, args.samples)
        print(f"ingest in process (decode + fold + debounced decide, one core): {rate:,.0f} samples/s")
        port = free_port()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen(  # noqa: ASYNC220 - one start in a benchmark harness
            [sys.executable, "-m", "pulsescale", "autoscaler", "--nats", server.url, "--metrics-port", str(port),
             "--log-level", "WARNING"],
            env=env,
        )  # fmt: skip
        # Wait until it leads and follows every model.
        for _ in range(200):
            with contextlib.suppress(OSError):
                if _metric(port, "pulsescale_leader") == 1:
                    break
            await asyncio.sleep(0.05)
        seq = [1]

        async def background(stop: asyncio.Event) -> None:
            # Every model's gateway speaks every 100 ms (the contract's pace): 10 samples/s x models.
            while not stop.is_set():
                t0 = time.perf_counter()
                for m in models:
                    if m not in pulsed:
                        await nc.publish(protocol.queue_subject(m), _sample(m, seq[0], 0))
                seq[0] += 1
                await asyncio.sleep(max(0.0, 0.1 - (time.perf_counter() - t0)))

        pulsed: set[str] = set()
        claimed: dict[str, float] = {}

        async def watch_claims() -> None:
            async for ev in store.watch():
                if isinstance(ev, Changed) and ev.record.state == "claimed":
                    claimed.setdefault(ev.record.model, time.perf_counter())

        watcher = asyncio.create_task(watch_claims())
        stop = asyncio.Event()
        bg = asyncio.create_task(background(stop))
        await asyncio.sleep(1.5)  # windows see steady traffic first
        floor_value = protocol.encode(store.records()[0]) if store.records() else b"x" * 200
        floor = await _floor(nc, server.url, models[: args.pulses], floor_value)
        latencies = []
        for m in models[: args.pulses]:
            pulsed.add(m)
            t0 = time.perf_counter()
            await nc.publish(protocol.queue_subject(m), _sample(m, seq[0], 16))
            while m not in claimed and time.perf_counter() - t0 < 2.0:
                await asyncio.sleep(0.0005)
            if m in claimed:
                latencies.append(claimed[m] - t0)
            await asyncio.sleep(0.02)
        stop.set()
        await bg
        watcher.cancel()
        ms = np.array(latencies) * 1e3
        print(f"decision latency, sample published -> first claim written ({args.models} models active, "
              f"{len(ms)}/{args.pulses} pulses answered):")  # fmt: skip
        if len(ms):
            print(f"  p50 {np.percentile(ms, 50):.2f} ms   p99 {np.percentile(ms, 99):.2f} ms   max {ms.max():.2f} ms")
        fs = np.array(floor) * 1e3
        print(f"floor, bare nats-py in the same run: sample published -> one kv.update -> watcher sees it "
              f"({len(fs)}/{len(models[: args.pulses])} answered):")  # fmt: skip
        if len(fs):
            print(f"  p50 {np.percentile(fs, 50):.2f} ms   p99 {np.percentile(fs, 99):.2f} ms   max {fs.max():.2f} ms")
        if len(ms) and len(fs):
            print(f"ratio to the floor: p50 {np.percentile(ms, 50) / np.percentile(fs, 50):.2f}x   "
                  f"p99 {np.percentile(ms, 99) / np.percentile(fs, 99):.2f}x")  # fmt: skip
        # Ingest throughput through NATS into the autoscaler process.
        before = _metric(port, "pulsescale_samples_total")
        n = args.samples
        t0 = time.perf_counter()
        for i in range(n):
            m = models[i % len(models)]
            await nc.publish(protocol.queue_subject(m), _sample(m, seq[0] + i, 0, gateway="flood"))
        await nc.flush()
        deadline = time.perf_counter() + 30
        got = 0.0
        while time.perf_counter() < deadline:
            got = _metric(port, "pulsescale_samples_total") - before
            if got >= n:
                break
            await asyncio.sleep(0.05)
        secs = time.perf_counter() - t0
        print(f"ingest through NATS into the autoscaler process: {got:.0f}/{n} samples in {secs:.2f} s "
              f"= {got / secs:,.0f} samples/s")  # fmt: skip
        await store.close()
        await nc.close()
    finally:
        if proc is not None:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
            if proc.poll() is None:
                proc.kill()
        server.stop()


def decide(argv: list[str], prog: str) -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", type=int, default=100, help="models active at once [100]")
    p.add_argument("--pulses", type=int, default=100, help="pulses timed, one model each [100]")
    p.add_argument("--samples", type=int, default=50_000, help="samples for the throughput runs [50000]")
    args = p.parse_args(argv)
    asyncio.run(_end_to_end(args))
    return 0
