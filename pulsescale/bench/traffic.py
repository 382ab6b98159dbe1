"""What `pulsescale bench decide` sends, and the stand-ins it runs in place of the rest of the system.

The bench's ScaledObject spec and queue samples, the in-process ingest (decode -> fold -> debounced decide on a
follower's controllers, one core), the stand-in agent that answers every node's ``activate``/``deactivate`` at
once (so the figure is the autoscaler's, not an engine's), and the floor: bare nats-py doing the decide path's
irreducible work, timed in the same run. `pulsescale.bench.decide` says what is measured and how.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import msgspec

from autoscaler.controller import Deps, LocalColdPath, ModelController
from autoscaler.metrics import AutoscalerMetrics
from warmpool import connect, protocol
from warmpool.bench import scratch_bucket
from warmpool.errors import PulsescaleError
from warmpool.protocol import QueueSample, ScaledObjectSpec, ScalerRecord
from warmpool.registry import KvSlotStore


def _spec(model: str, *, stale_after_s: float | None = None) -> ScaledObjectSpec:
    """The bench's ScaledObject; `stale_after_s` sets ``advanced.staleAfterSeconds`` (default: the contract's)."""
    spec: dict[str, object] = {
        "scaleTargetRef": {"name": model},
        "minReplicaCount": 0,
        "maxReplicaCount": 4,
        "triggers": [{"type": "gateway-queue", "metadata": {"model": model, "targetQueueDepth": 4}}],
    }
    if stale_after_s is not None:
        spec["advanced"] = {"staleAfterSeconds": stale_after_s}
    return protocol.decode(msgspec.json.encode(spec), ScaledObjectSpec)


def _sample(model: str, seq: int, depth: int, gateway: str = "bench", *, served: int | None = None) -> bytes:
    """A gateway's sample; its counters are `served` (by default `seq`: one request per sample period)."""
    served = seq if served is None else served
    return protocol.encode(
        QueueSample(
            gateway=gateway,
            model=model,
            seq=seq,
            ts=time.time(),
            queue_depth=depth,
            inflight=0,
            arrivals_total=served,
            completions_total=served,
            timeouts_total=0,
        )
    )


INGEST_IN_PROCESS_MAX_S = 10.0
"""The in-process ingest stops after this long (at thousands of models it is slow), and its rate is what it did."""


async def _ingest_in_process(nc, store: KvSlotStore, models: int, samples: int) -> float:  # type: ignore[no-untyped-def]
    """Samples/s through decode -> ingest -> debounced decide; a follower's controllers, so nothing is claimed."""
    deps = Deps(
        nc=nc,
        store=store,
        metrics=AutoscalerMetrics(),
        cold_path=LocalColdPath(),
        owns=lambda: False,
    )
    ctrls = {
        f"x{i}": ModelController(ScalerRecord(namespace="bench", name=f"x{i}", spec=_spec(f"x{i}")), deps)
        for i in range(models)
    }
    names = list(ctrls)
    payloads = [_sample(names[i % models], i // models + 1, i % 7) for i in range(samples)]
    t0 = time.perf_counter()
    done = 0
    for done, data in enumerate(payloads, 1):
        s = protocol.decode(data, QueueSample)
        ctrls[s.model].on_sample(s, time.time())
        if done % 1000 == 0 and time.perf_counter() - t0 > INGEST_IN_PROCESS_MAX_S:
            break
    return done / (time.perf_counter() - t0)


async def _stand_in_agent(nc, store: KvSlotStore, held: dict[tuple[str, str, str], str]) -> None:  # type: ignore[no-untyped-def]
    """Answers for every node at once, as the holder's agent would: `activating`, then `ready` with the endpoint
    (the autoscaler reads the endpoint from that fenced write), then the reply; `deactivate` gives the slot back.
    `held` maps (node, slot, claim_id) to the slot's key (kept by the run's slot watch), so an activation finds
    its slot in O(1) instead of scanning every record."""

    async def activate(msg) -> None:  # type: ignore[no-untyped-def]
        req = protocol.decode(msg.data, protocol.ActivateRequest)
        node = msg.subject.split(".")[2]
        key = held.get((node, req.slot, req.claim_id))
        for _ in range(100):  # the claim's watch echo may still be on its way to this process
            if key is not None:
                break
            await asyncio.sleep(0.002)
            key = held.get((node, req.slot, req.claim_id))
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
        key = held.get((msg.subject.split(".")[2], req.slot, req.claim_id))
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


class _Floor:
    """Bare nats-py, the decide path's irreducible work: a sample published -> a subscriber on its own connection
    (as the autoscaler has) decodes it and does one kv.update on the revision it last wrote -> our KV watcher sees
    the update. `start` sets it up (a scratch bucket, a key per model), `pulse` times one, `stop` takes it down;
    the run interleaves its pulses with the autoscalers' so both meet the same moments of the machine."""

    def __init__(self, nc, url: str, models: list[str], value: bytes) -> None:  # type: ignore[no-untyped-def]
        self.nc, self.url, self.models, self.value = nc, url, models, value
        self.keys = {m: f"{m}.floor.s0" for m in models}
        self.seen: dict[str, asyncio.Event] = {k: asyncio.Event() for k in self.keys.values()}
        self.seq = 0
        self._stack = contextlib.AsyncExitStack()

    async def start(self) -> _Floor:
        js = self.nc.jetstream(timeout=5.0)
        kv = await scratch_bucket(js, FLOOR_BUCKET)

        async def drop_bucket() -> None:
            with contextlib.suppress(Exception):
                await js.delete_key_value(FLOOR_BUCKET)

        self._stack.push_async_callback(drop_bucket)
        revs = {m: await kv.put(self.keys[m], self.value) for m in self.models}
        responder = await connect.connect(connect.NatsOptions(servers=(self.url,), name="bench-decide-floor"))
        self._stack.push_async_callback(responder.close)
        rkv = await responder.jetstream(timeout=5.0).key_value(FLOOR_BUCKET)
        keys, value = self.keys, self.value

        async def on_sample(msg) -> None:  # type: ignore[no-untyped-def]
            sample = protocol.decode(msg.data, QueueSample)
            revs[sample.model] = await rkv.update(keys[sample.model], value, last=revs[sample.model])

        sub = await responder.subscribe(FLOOR_PREFIX + "*", cb=on_sample)
        self._stack.push_async_callback(sub.unsubscribe)
        await responder.flush()
        watcher = await kv.watchall()
        self._stack.push_async_callback(watcher.stop)

        async def follow() -> None:
            async for entry in watcher:
                if entry is not None and entry.key in self.seen:
                    self.seen[entry.key].set()

        follower = asyncio.create_task(follow())
        self._stack.callback(follower.cancel)
        await asyncio.sleep(0.2)  # the watcher's initial listing goes by
        return self

    async def pulse(self, m: str) -> float | None:
        """One pulse of `m`'s floor; its latency (s), or None when not seen within 2 s."""
        event = self.seen[self.keys[m]]
        event.clear()
        self.seq += 1
        t0 = time.perf_counter()
        await self.nc.publish(FLOOR_PREFIX + m, _sample(m, self.seq, 16))
        try:
            await asyncio.wait_for(event.wait(), 2.0)
        except TimeoutError:
            return None
        return time.perf_counter() - t0

    async def stop(self) -> None:
        await self._stack.aclose()
