"""`pulsescale bench activate`: the activation path, stage by stage, against a real agent and nats-server.

Writes a local-engine model of `--size` (or uses `--model`), starts an embedded nats-server (``sync_interval:
always``, as production) and a real agent process, then repeats: claim the slot (KV compare-and-set), send
`activate`, wait for `ready`, deactivate (untimed). It prints p50/p99 of every stage the agent reports, the
control-plane overhead (total - load: everything that is not moving weights), claim → ready as the claimer sees
it, and the host loader's GB/s next to a plain ``numpy.copyto`` of the same staged bytes, measured in the same
run. Figures are printed, not asserted: these machines are shared and noisy.

``--loader host|cuda-pinned|kvikio`` measures the loader alone instead, in this process, at each ``--size``
(``1GB,8GB,32GB``): a weights file written to shm (``--disk-dir`` for kvikio, read cold), opened and handed over as
a verified descriptor as the agent does; the first load is checked byte for byte (spot checks above 1 GiB) and
not counted; GB/s is printed against the PCIe link's usable rate (nvidia-smi). cuda-pinned runs with the mapping
registered and from pageable memory side by side (``--pin``). A node where the loader cannot run exits 3 with
"no GPU: ..." (tests/gpu/run.sh relies on it).

``--json`` (``-o json|yaml``) prints one object instead, and nothing else on stdout (progress goes to stderr): the
run's parameters and every figure of the text report, named with their units (``p50_ms``, ``p50_gbps``, ...). The
activation bench's ``activations`` lists each measured activation (``claim_to_ready_s``, the agent's stage
timings): ``pulsescale simulate --activations`` reads that file as it reads the text report.
"""

from __future__ import annotations

import argparse
import asyncio
import mmap
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import numpy as np

from nodeagent import bench_loader, tinymodel
from nodeagent.bench_loader import NO_GPU_EXIT, _pct
from nodeagent.engine import cudaplan, loaders, safetensors_check
from warmpool import connect as nats_connect
from warmpool import output as out
from warmpool import protocol
from warmpool.embedded import NatsServer
from warmpool.registry import KvSlotStore
from warmpool.sizes import parse_size

MODEL = "bench"
NODE = "bench-node"
STAGES = ("token", "load", "engine", "readiness", "total")
OVERHEAD_TARGET_MS = 150.0
"""Control-plane overhead (total - load) p99, at most."""
CLAIM_READY_TARGET_MS = 300.0
"""Claim -> ready p99 for a model of at most `CLAIM_READY_TARGET_BYTES`, at most."""
CLAIM_READY_TARGET_BYTES = 100e6
LOADER_COPY_TARGET = 0.7
"""Host loader p50 GB/s over numpy.copyto p50 GB/s (private engine memory), at least."""




class StagePercentiles(msgspec.Struct, kw_only=True):
    """One row of the stage table."""

    p50_ms: float
    p99_ms: float
    max_ms: float

    @classmethod
    def of(cls, values: list[float]) -> StagePercentiles:
        return cls(p50_ms=_pct(values, 50), p99_ms=_pct(values, 99), max_ms=max(values))


class Activation(msgspec.Struct, kw_only=True):
    """One measured activation: claim -> ready as the claimer saw it (seconds, the field `pulsescale simulate
    --activations` reads), the agent's stage timings, and the load's GB/s."""

    claim_to_ready_s: float
    token_ms: float
    load_ms: float
    engine_ms: float
    readiness_ms: float
    total_ms: float
    loaded_bytes: int
    load_gbps: float
    """loaded_bytes / load_ms."""


class CopyRate(msgspec.Struct, kw_only=True):
    p50_gbps: float
    p1_gbps: float
    count: int
    """Loads (the host loader) or copies (numpy.copyto) measured."""


class Target(msgspec.Struct, kw_only=True):
    """A figure against its target, as the text report's ``ok``/``MISSED`` lines."""

    name: str
    value: float | None
    op: str
    """``<=`` or ``>=``: value op target is met."""
    target: float
    met: bool


class ActivateReport(msgspec.Struct, kw_only=True):
    """`bench activate --json`: the run's parameters, the stage table and the loader against numpy.copyto."""

    bench: str = "activate"
    model_dir: str | None
    """`--model`, or None when the bench wrote one of `size_bytes`."""
    size_bytes: int | None
    model_bytes: int
    """Bytes one activation loads."""
    engine_memory: str
    sync_always: bool
    warmup: int
    deadline_s: float
    staged_s: float
    """Agent start -> slot warm (staged, verified, locked and armed)."""
    stages: dict[str, StagePercentiles]
    """token, load, engine, readiness, total (the agent's), overhead (total - load), claim_to_ready."""
    host_loader: CopyRate
    copyto: CopyRate
    loader_over_copyto: float | None
    """host_loader.p50_gbps / copyto.p50_gbps; None with shared engine memory (the loader maps in place)."""
    targets: list[Target]
    activations: list[Activation]


class CopyBaseline:
    """A plain numpy.copyto of the staged weights' bytes into fresh memory: the loader's yardstick. The source
    is mapped once (its page faults paid before the first copy), so this is the copy at its best."""

    def __init__(self, files: list[Path]) -> None:
        self._maps = []
        self._srcs = []
        for path in files:
            hdr = safetensors_check.read_header(path)
            with open(path, "rb") as f:
                m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
            self._maps.append(m)
            self._srcs.append(np.frombuffer(m, np.uint8, count=hdr.data_bytes, offset=hdr.data_offset))
        self.total = sum(s.size for s in self._srcs)
        for s in self._srcs:
            s.sum(dtype=np.uint64)  # fault the source in once
        self.gbps: list[float] = []

    def measure(self) -> None:
        t0 = time.perf_counter()
        dst = np.empty(self.total, np.uint8)
        at = 0
        for s in self._srcs:
            np.copyto(dst[at : at + s.size], s)
            at += s.size
        self.gbps.append(self.total / (time.perf_counter() - t0) / 1e9)

    def close(self) -> None:
        self._srcs.clear()
        for m in self._maps:
            m.close()


async def _wait_warm(store: KvSlotStore, key: str, timeout_s: float, agent: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        hit = store.entry(key)
        if hit is not None and hit[0].state == "warm":
            return
        if hit is not None and hit[0].state == "failed":
            raise RuntimeError(f"slot {key} failed: {hit[0].reason}")
        if agent.poll() is not None:
            raise RuntimeError(f"the agent exited with {agent.returncode}")
        await asyncio.sleep(0.01)
    raise TimeoutError(f"slot {key} not warm after {timeout_s:.0f} s")


async def _request(nc: object, verb: str, req: protocol.Request, timeout_s: float) -> protocol.Reply:
    msg = await nc.request(protocol.agent_subject(NODE, verb), protocol.encode(req), timeout=timeout_s)  # type: ignore[attr-defined]
    return protocol.decode_reply(msg.data)


def _start_agent(args: argparse.Namespace, model_dir: Path, shm: Path, server: NatsServer) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable, "-m", "pulsescale", "agent", "--nats", server.url, "--node", NODE,
        "--model", str(model_dir), "--model-name", MODEL, "--slots", "1", "--shm-dir", str(shm),
        "--engine-memory", args.engine_memory, "--metrics-port", "-1", "--log-level", "WARNING",
    ]  # fmt: skip
    # With -o json|yaml stdout carries the object only: whatever the agent prints goes to stderr.
    return subprocess.Popen(cmd, stdout=None if out.machine(args) is None else sys.stderr.fileno())


async def _bench(
    args: argparse.Namespace, size: int | None, shm: Path, server: NatsServer, agent: subprocess.Popen[bytes]
) -> int:
    try:
        nc = await nats_connect.connect(nats_connect.NatsOptions(servers=(server.url,), name="pulsescale-bench"))
        store = await KvSlotStore.open(nc)
        await store.start()
        key = protocol.slot_key(MODEL, NODE, "s0")
        t0 = time.perf_counter()
        await _wait_warm(store, key, 600, agent)
        staged_s = time.perf_counter() - t0
        print(f"staged, verified, locked and armed in {staged_s:.1f} s", file=out.progress(out.machine(args)))
        base = CopyBaseline(sorted((shm / MODEL).glob("*.safetensors")))
        stages: dict[str, list[float]] = {s: [] for s in STAGES}
        claim_ready: list[float] = []
        gbps: list[float] = []
        each: list[Activation] = []
        loaded = 0
        for i in range(args.warmup + args.activations):
            await _wait_warm(store, key, 30, agent)
            t_claim = time.perf_counter()
            claim = await store.claim_slot(key)
            now = time.time()
            req = protocol.ActivateRequest(
                id=secrets.token_hex(8), expires_at=now + 30, slot="s0", token=claim.token,
                claim_id=claim.claim_id, deadline=now + args.deadline_s,
            )  # fmt: skip
            rep = await _request(nc, "activate", req, args.deadline_s + 5)
            t_ready = time.perf_counter()
            if not rep.ok:
                assert rep.error is not None
                print(f"activation {i} failed: {rep.error.code}: {rep.error.message}", file=sys.stderr)
                return 1
            if i >= args.warmup:
                timings = rep.fields["timings"]
                for s in STAGES:
                    stages[s].append(float(timings[f"{s}_ms"]))
                claim_ready.append((t_ready - t_claim) * 1e3)
                loaded = int(rep.fields["loaded_bytes"])
                gbps.append(loaded / (float(timings["load_ms"]) / 1e3) / 1e9)
                each.append(
                    Activation(
                        claim_to_ready_s=claim_ready[-1] / 1e3,
                        **{f"{s}_ms": stages[s][-1] for s in STAGES},
                        loaded_bytes=loaded,
                        load_gbps=gbps[-1],
                    )
                )
            deact = protocol.DeactivateRequest(
                id=secrets.token_hex(8), expires_at=time.time() + 30, slot="s0", token=claim.token,
                claim_id=claim.claim_id,
            )  # fmt: skip
            rep = await _request(nc, "deactivate", deact, 10)
            if not rep.ok:
                assert rep.error is not None
                print(f"deactivation {i} failed: {rep.error.code}: {rep.error.message}", file=sys.stderr)
                return 1
            if i >= args.warmup:
                base.measure()  # interleaved with the loads, so both see the same machine
        base.close()
        await store.close()
        await nc.close()
    finally:
        agent.terminate()
        try:
            agent.wait(15)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait()
    overhead = [t - ld for t, ld in zip(stages["total"], stages["load"], strict=True)]
    rows = [(s, stages[s]) for s in STAGES] + [("overhead", overhead), ("claim_to_ready", claim_ready)]
    private = args.engine_memory == "private"
    copy_p50, loader_p50 = _pct(base.gbps, 50), _pct(gbps, 50)
    ratio = (loader_p50 / copy_p50 if copy_p50 else float("nan")) if private else None
    targets = [] if ratio is None else [_target("loader_over_copyto", ratio, ">=", LOADER_COPY_TARGET)]
    targets.append(_target("overhead_p99_ms", _pct(overhead, 99), "<=", OVERHEAD_TARGET_MS))
    if loaded <= CLAIM_READY_TARGET_BYTES:  # the claim -> ready target is for a small (64 MB) model
        targets.append(_target("claim_to_ready_p99_ms", _pct(claim_ready, 99), "<=", CLAIM_READY_TARGET_MS))
    report = ActivateReport(
        model_dir=args.model, size_bytes=size, model_bytes=loaded,
        engine_memory=args.engine_memory, sync_always=not args.no_sync_always, warmup=args.warmup,
        deadline_s=args.deadline_s, staged_s=staged_s,
        stages={name: StagePercentiles.of(vals) for name, vals in rows},
        host_loader=CopyRate(p50_gbps=loader_p50, p1_gbps=_pct(gbps, 1), count=len(gbps)),
        copyto=CopyRate(p50_gbps=copy_p50, p1_gbps=_pct(base.gbps, 1), count=len(base.gbps)),
        loader_over_copyto=None if ratio is None else out.finite(ratio), targets=targets, activations=each,
    )  # fmt: skip
    fmt = out.machine(args)
    if fmt is not None:
        print(out.dump(report, fmt))
        return 0
    _print_activate(report, args.engine_memory)
    return 0


def _target(name: str, value: float, op: str, target: float) -> Target:
    met = value <= target if op == "<=" else value >= target  # NaN (nothing measured) meets neither
    return Target(name=name, value=out.finite(value), op=op, target=target, met=met)


_STAGE_LABELS = {"overhead": "overhead (total-load)", "claim_to_ready": "claim->ready"}


def _print_activate(r: ActivateReport, engine_memory: str) -> None:
    """The text report; `pulsescale simulate --activations` reads its ``claim->ready`` row."""
    n, mb = len(r.activations), r.model_bytes / 1e6
    print(
        f"\n{n} activations of a {mb:.1f} MB model, engine memory {engine_memory} "
        f"({'loader copies into engine memory' if engine_memory == 'private' else 'shm mapping used in place'})"
    )
    print(f"{'stage':<24}{'p50 ms':>10}{'p99 ms':>10}{'max ms':>10}")
    for name, row in r.stages.items():
        print(f"{_STAGE_LABELS.get(name, name):<24}{row.p50_ms:>10.2f}{row.p99_ms:>10.2f}{row.max_ms:>10.2f}")
    print(
        f"\nhost loader   {r.host_loader.p50_gbps:6.2f} GB/s p50 ({r.host_loader.p1_gbps:.2f} p1) over "
        f"{r.host_loader.count} loads of {mb:.1f} MB"
        f"\nnumpy.copyto  {r.copyto.p50_gbps:6.2f} GB/s p50 ({r.copyto.p1_gbps:.2f} p1) over {r.copyto.count} copies "
        "of the same staged bytes into fresh memory, interleaved with the loads"
    )
    targets = {t.name: t for t in r.targets}

    def verdict(t: Target) -> str:
        return "ok" if t.met else "MISSED"

    if "loader_over_copyto" in targets:
        t = targets["loader_over_copyto"]
        value = float("nan") if t.value is None else t.value
        print(f"loader / copyto = {value:.2f} (target >= {t.target:g}): {verdict(t)}")
    else:
        print("(shared memory: the loader maps in place, so its GB/s is not a copy rate; use --engine-memory private)")
    t = targets["overhead_p99_ms"]
    print(f"control-plane overhead p99 {r.stages['overhead'].p99_ms:.1f} ms (target <= {t.target:g} ms): {verdict(t)}")
    cr = r.stages["claim_to_ready"].p99_ms
    if "claim_to_ready_p99_ms" in targets:
        t = targets["claim_to_ready_p99_ms"]
        print(f"claim -> ready p99 {cr:.1f} ms (target for a 64 MB model <= {t.target:g} ms): {verdict(t)}")
    else:
        print(f"claim -> ready p99 {cr:.1f} ms (its 300 ms target is for a 64 MB model: run --size 64MB)")


# --- `--loader`: the loader alone, shm (or disk) -> engine memory, at several sizes ---------------------------------

def activate(argv: list[str], prog: str) -> int:
    if "--engine" in argv or any(a.startswith("--engine=") for a in argv):  # --engine vllm: its own bench
        from nodeagent import bench_vllm

        return bench_vllm.activate(argv, prog)
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="1GB", help="model size for make-tiny [1GB]")
    p.add_argument("--model", help="use this model directory instead of writing one")
    p.add_argument("--activations", type=int, default=40, help="measured activations [40]")
    p.add_argument("--warmup", type=int, default=2, help="activations before measuring [2]")
    p.add_argument("--deadline-s", type=float, default=10.0, help="activation deadline [10]")
    p.add_argument("--engine-memory", choices=("private", "shared"), default="private", help="[private]")
    p.add_argument("--shm-dir", default="/dev/shm", help="parent of the bench's staging dir [/dev/shm]")
    p.add_argument("--no-sync-always", action="store_true", help="the nats-server does not fsync every write")
    p.add_argument(
        "--loader",
        choices=("host", *loaders.GPU_LOADERS),
        help="measure this loader alone (staged file -> engine memory) at each --size (comma-separated, e.g. "
        f"1GB,8GB,32GB) instead of the whole activation; on a node where it cannot run: exit {NO_GPU_EXIT}",
    )
    p.add_argument("--repeats", type=int, default=3, help="--loader: measured loads per size [3]")
    p.add_argument(
        "--pin",
        choices=(*cudaplan.PIN_POLICIES, "both"),
        default="both",
        help="--loader cuda-pinned: register the mapping (always), copy from pageable memory (never), decide by "
        "the memlock limit (auto), or measure always and never side by side (both) [both]",
    )
    p.add_argument("--disk-dir", default="/var/tmp", help="--loader kvikio: where the weights file is written")
    out.add_output_argument(p)
    args = p.parse_args(argv)
    try:
        sizes = [parse_size(s) for s in args.size.split(",")]
    except ValueError as err:
        p.error(str(err))
    if args.loader:
        return bench_loader.run(args, sizes)
    if len(sizes) != 1:
        p.error("--size takes one size for the activation bench (several only with --loader)")
    size = sizes[0]
    progress = out.progress(out.machine(args))
    work = Path(tempfile.mkdtemp(prefix="pulsescale-bench-"))
    shm = Path(tempfile.mkdtemp(prefix="pulsescale-bench-", dir=args.shm_dir))
    try:
        if args.model:
            model_dir = Path(args.model)
        else:
            model_dir = work / MODEL
            t0 = time.perf_counter()
            cfg = tinymodel.make_tiny(model_dir, size)
            print(f"wrote a {cfg.nbytes / 1e6:.1f} MB model in {time.perf_counter() - t0:.1f} s", file=progress)
        (work / "nats").mkdir()
        with NatsServer(work / "nats", sync_always=not args.no_sync_always) as server:
            sync = "" if args.no_sync_always else " (sync_interval: always)"
            print(f"embedded nats-server {server.url}{sync}", file=progress)
            agent = _start_agent(args, model_dir, shm, server)
            return asyncio.run(_bench(args, None if args.model else size, shm, server, agent))
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
