"""`pulsescale bench decide`: decision latency, ownership over replicas, takeover and ingest throughput.

1. In-process ingest: decode + fold + (debounced) decide for samples spread over `--models` models, one core.
2. End to end, against an embedded nats-server and `--replicas` real `pulsescale autoscaler` processes
   (identities ``bench-r<i>``, each its own metrics port, stderr captured): `--models` models have ScaledObjects
   and 4 warm slots each (seeded concurrently, `SEED_BATCH` models at a time) and get steady background samples
   (10/s per model, from a process of their own, `pulsescale.bench.gateways`, the gateways spread over
   `GATEWAY_PHASES` phases of each 100 ms, or all in one burst with `--gateways-in-step`); then `--pulses` models
   spread over all of them (so every replica's share is exercised) get a pulse one at a time, and we time *sample
   published -> first claim written* by watching `pulse_slots`. A
   stand-in agent in this process answers `activate` at once (writing `activating` and `ready` as a holder's
   agent does), so the figure is the autoscaler's own and not an engine's.
   Next to it, the floor measured in the same run and conditions (the background samples flowing): bare nats-py
   doing the path's irreducible work, *sample published -> a subscriber on its own connection does one
   kv.update(key, value, last=rev) -> a KV watcher sees it*, one pulse after each of ours; and the ratio.
   By default the pulses wait for the windows to settle (~10 s of steady traffic); with `--pulses-after S` the
   background samples flow from the replicas' start and the pulses begin S seconds after every model first had a
   live owner (the first seconds after the shards were taken). `--cpu-hog` keeps one core busy throughout
   (`pulsescale.bench.hog`).
3. Ownership, read from KV `pulse_leases`: a model's owner is the live holder of its shard's lease (``shard.<n>``,
   protocol revision 6) or, while no shard lease exists, of the one leader lease. Checked before, during and
   after the pulses and after a takeover; "every model has exactly one owner" means every check found each
   model's lease fresh and held by a replica still running, and so did every 250 ms sample once the shards had
   settled (the warm-up's samples, while the replicas join one after another and shards are handed over, are
   printed but not counted: a handed-over shard has no lease until the taker's next round).
4. With `--replicas` >= 2 and `--kill` (the default then): SIGKILL the replica owning the most models, pulse up to
   `TAKEOVER_SAMPLE` of its models with rising demand every 100 ms until each is claimed again, and print the
   takeover time (kill -> first claim) next to the bar ``lease_s + 1 s`` (lease_s read from the leases).
   Throughout, the slot watch counts double claims (see `_SlotWatch`).
5. Ingest throughput through NATS: samples published as fast as one publisher can, counted by each autoscaler's
   `pulsescale_samples_total` metric, then as many to a bare nats-py subscriber (`pulsescale.bench.ingest`: the
   floor), each with its CPU per sample. Then leases lost (``pulsescale_lease_lost_total`` where exported, else the
   "no longer the leader" lines in stderr), CPU seconds per replica (/proc/<pid>/stat), and the run's length,
   which every phase bounds.
Figures are printed, not asserted: these machines are shared and noisy.

``--json`` (``-o json|yaml``) prints one object instead, and nothing else on stdout (the text report goes to stderr,
as progress): the run's parameters and every figure of the text report, named with their units (``p50_ms``,
``samples_per_s``, ``cpu_s``), null where one cannot be computed (`pulsescale.bench.report.DecideReport`):
``decision`` and ``floor`` (answered, p50_ms, p99_ms, max_ms) with ``ratio_to_floor_p50``/``_p99``,
``own_decision_time``, ``ownership`` (each named check's models per replica, the samples, ``one_owner_per_model``),
``takeover`` (null without a kill), ``ingest_in_process_samples_per_s`` and ``ingest_through_nats``,
``per_replica`` (cpu_s, leases_lost, loop stalls, lease slack, warnings), ``each_pulse`` (with the floor's),
``pulses_after_s``, ``cpu_hog``, ``leases_lost``, ``double_claims`` and ``run_s``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import time

from autoscaler.decide.policyspec import PolicySpec
from pulsescale.bench.hog import cpu_hog
from pulsescale.bench.run import GATEWAY_PHASES, READY_TIMEOUT_S, WARM_UP_S, _Run
from pulsescale.bench.traffic import _Floor, _ingest_in_process, _spec, _stand_in_agent
from pulsescale.bench.watch import _follow_leases
from warmpool import connect, protocol
from warmpool import output as out
from warmpool.embedded import NatsServer
from warmpool.registry import KvSlotStore, ensure_buckets

# The docstring above is `--help`. The parts: pulsescale.bench.traffic (the spec and samples sent, the in-process
# ingest, the stand-in agent, the floor), pulsescale.bench.watch (the replicas' metrics and CPU, the leases, the
# slot writes) and pulsescale.bench.run (`_Run`: one method per phase, and the report); this module runs the phases.


async def _end_to_end(args: argparse.Namespace) -> None:
    t_start = time.perf_counter()
    server = NatsServer().start()
    tasks: list[asyncio.Task[None]] = []
    run: _Run | None = None
    try:
        nc = await connect.connect(connect.NatsOptions(servers=(server.url,), name="bench-decide"))
        store = await KvSlotStore.open(nc)
        await store.start()
        buckets = await ensure_buckets(nc.jetstream())
        run = _Run(args, server, nc, store)
        run.leases_kv = buckets[protocol.LEASES_BUCKET]
        await run.seed(buckets[protocol.SCALERS_BUCKET])
        slots = run.slots

        async def watch_slots() -> None:
            async for ev in store.watch():
                slots.on(ev)

        tasks.append(asyncio.create_task(watch_slots()))
        tasks.append(asyncio.create_task(_follow_leases(buckets[protocol.LEASES_BUCKET], run.leases)))
        await _stand_in_agent(nc, store, slots.held)
        t_seeded = time.perf_counter()
        res = run.result
        res.setup_s = setup_s = t_seeded - t_start
        run.say(f"setup: {args.models} models x 4 warm slots seeded in {setup_s:.1f} s")
        rate = await _ingest_in_process(nc, store, args.models, args.samples)
        res.ingest_in_process_samples_per_s = out.finite(rate)
        run.say(f"ingest in process (decode + fold + debounced decide, one core): {rate:,.0f} samples/s")
        n_pulses = min(args.pulses, args.models)
        floor_models = [run.models[i * args.models // n_pulses] for i in range(n_pulses)]
        run.floor = await _Floor(nc, server.url, floor_models, protocol.encode(store.records()[0])).start()
        stop = asyncio.Event()
        bg: asyncio.Task[None] | None = None
        if args.pulses_after is not None:
            # A fleet's gateways speak whether or not a replica is up: the samples flow from the start.
            bg = asyncio.create_task(run.background(stop))
        # This process times every pulse (the first claim seen on its watch): its own collector must not stop it
        # for tens of ms among them (seen with a `gc.callbacks` hook: 30-70 ms over the seeded pool's records). Frozen
        # objects are still freed by reference counting.
        gc.collect()
        gc.freeze()
        t_started = time.perf_counter()
        run.start_replicas()
        await run.wait_ready()
        res.replicas_ready_s = ready_s = time.perf_counter() - t_started
        run.say(f"replicas: {args.replicas} autoscaler processes ready in {ready_s:.1f} s")
        owners = asyncio.create_task(run.watch_ownership(stop))
        if args.pulses_after is None:
            bg = asyncio.create_task(run.background(stop))
            # Steady traffic until the models' windows settle (`PolicySpec.trend_settle_s`): a fleet's models are
            # timed as they run, not in their first seconds, when housekeeping still re-decides every one of them.
            await asyncio.sleep(WARM_UP_S + PolicySpec.of(_spec("m0")).trend_settle_s)
            res.ownership_settled_s = settled = await run.settle(READY_TIMEOUT_S)
            run.say(f"ownership settled {settled:.1f} s after the pulses' warm-up")
        else:
            # The first seconds after the shards were taken: as fast as the steady state is the bar.
            owned_at = run.owned_at if run.owned_at is not None else time.perf_counter()
            await asyncio.sleep(max(0.0, owned_at + args.pulses_after - time.perf_counter()))
        run.phase = "pulses"
        gc.freeze()  # what the warm-up made (ownership samples, the watch's records), as above
        # And no collection at all while it times: the young ones it made among the pulses still stopped it for
        # 4-6 ms at a time (a minute's garbage of this process is a few MB, collected after).
        gc.disable()
        try:
            await run.check_owners("before the pulses")
            per = await run.timed_pulses()
            if args.kill and args.replicas >= 2:
                await run.takeover(per)
        finally:
            gc.enable()
        run.phase = "time after the takeover"
        stop.set()
        if bg is not None:
            await bg
        await owners
        await run.floor.stop()
        run.floor = None
        await run.ingest()
        run.report(t_start)
        # The replicas go before our connection: the stand-in agent must outlive their last activations.
        run.stop_replicas()
        for t in tasks:
            t.cancel()
        await store.close()
        await nc.close()
    finally:
        for t in tasks:
            t.cancel()
        if run is not None:
            run.stop_replicas()
            if run.floor is not None:
                with contextlib.suppress(Exception):
                    await run.floor.stop()
        server.stop()
    if run is not None and run.fmt is not None:  # the object, alone on stdout
        print(out.dump(run.result, run.fmt))


def decide(argv: list[str], prog: str) -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", type=int, default=100, help="models active at once [100]")
    p.add_argument("--replicas", type=int, default=1, help="autoscaler processes sharing the models [1]")
    p.add_argument("--pulses", type=int, default=100, help="pulses timed, spread over the models [100]")
    p.add_argument("--samples", type=int, default=50_000, help="samples for the throughput runs [50000]")
    p.add_argument(
        "--kill",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with --replicas >= 2, SIGKILL the replica owning the most models mid-run and time the takeover "
        "[on with --replicas >= 2]",
    )
    p.add_argument(
        "--gateways-in-step",
        action="store_true",
        help="every model's background sample at the same instant of each 100 ms, in one burst (the worst case: "
        f"a pulse waits behind all of them) [off: spread over {GATEWAY_PHASES} phases, as independent gateways]",
    )
    p.add_argument(
        "--replicas-from",
        metavar="DIR",
        help="run the autoscaler replicas from the checkout in DIR (PYTHONPATH), the bench from this one: the same "
        "bench and load for a before and an after [off]",
    )
    p.add_argument("--logs", metavar="DIR", help="keep each replica's stderr in DIR/<identity>.log")
    p.add_argument(
        "--log-level",
        default="WARNING",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="the replicas' log level (INFO shows shards taken and handed over, with --logs) [WARNING]",
    )
    p.add_argument(
        "--pulse-budget-s", type=float, default=300.0, help="the timed pulses stop after this many seconds [300]"
    )
    p.add_argument(
        "--pulses-after",
        type=float,
        metavar="S",
        help="time the pulses from S seconds after every model first had a live owner, the background samples "
        "flowing from the replicas' start (the first seconds after taking the shards) [off: after ~10 s of "
        "steady traffic, once the windows settled]",
    )
    p.add_argument(
        "--cpu-hog",
        action="store_true",
        help="run a busy loop on one core for the whole run (a child process, always stopped), the competing "
        "load of a shared machine [off]",
    )
    out.add_output_argument(p)
    args = p.parse_args(argv)
    if args.models < 1 or args.replicas < 1 or args.pulses < 1:
        p.error("--models, --replicas and --pulses must be >= 1")
    if args.pulses_after is not None and args.pulses_after < 0:
        p.error("--pulses-after must be >= 0")
    if args.kill is None:
        args.kill = args.replicas >= 2
    with cpu_hog(args.cpu_hog):
        asyncio.run(_end_to_end(args))
    return 0
