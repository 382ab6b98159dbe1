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
import json
import math
import mmap
import os
import secrets
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TextIO

import msgspec
import numpy as np

from nodeagent import tinymodel
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


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.array(values), q)) if values else float("nan")


def _finite(x: float) -> float | None:
    """`x`, or None for NaN/inf: JSON has no NaN."""
    return x if math.isfinite(x) else None


def _progress(fmt: str | None) -> TextIO:
    """Where progress lines go: stdout with the text report, stderr when stdout carries the -o json|yaml object."""
    return sys.stdout if fmt is None else sys.stderr


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
        print(f"staged, verified, locked and armed in {staged_s:.1f} s", file=_progress(out.machine(args)))
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
        loader_over_copyto=None if ratio is None else _finite(ratio), targets=targets, activations=each,
    )  # fmt: skip
    fmt = out.machine(args)
    if fmt is not None:
        print(out.dump(report, fmt))
        return 0
    _print_activate(report, args.engine_memory)
    return 0


def _target(name: str, value: float, op: str, target: float) -> Target:
    met = value <= target if op == "<=" else value >= target  # NaN (nothing measured) meets neither
    return Target(name=name, value=_finite(value), op=op, target=target, met=met)


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

NO_GPU_EXIT = 3
"""Exit status of `bench activate --loader cuda-pinned|kvikio` on a node where that loader cannot run: the GPU
check script (tests/gpu/run.sh) tells "no GPU here" from a failed measurement by it."""
_TENSOR_BYTES = 2**30
_FILL_BYTES = 64 * 2**20


def _write_weights(path: Path, size: int, *, seed: int = 7) -> None:
    """A safetensors file of `size` data bytes (F32 tensors of <= 1 GiB) filled with a random 64 MiB pattern:
    fast to write, and a misplaced chunk still shows (the pattern does not repeat on chunk boundaries)."""
    size -= size % 4
    header: dict[str, object] = {}
    at, i = 0, 0
    while at < size:
        n = min(_TENSOR_BYTES, size - at)
        header[f"t{i}"] = {"dtype": "F32", "shape": [n // 4], "data_offsets": [at, at + n]}
        at, i = at + n, i + 1
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    fill = np.random.default_rng(seed).integers(0, 256, _FILL_BYTES + 4093, dtype=np.uint8).tobytes()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, struct.pack("<Q", len(raw)) + raw)
        left, k = size, 0
        while left:
            piece = memoryview(fill)[k % 4093 : k % 4093 + min(left, _FILL_BYTES)]
            done = os.write(fd, piece)
            left, k = left - done, k + 1
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # a disk file is read cold; tmpfs ignores this
    finally:
        os.close(fd)


def _open_verified(path: Path) -> loaders.VerifiedFile:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    st = os.fstat(fd)
    return loaders.VerifiedFile(path.name, fd, st.st_dev, st.st_ino, st.st_size)


def _host_bytes(x: object) -> np.ndarray:
    get = getattr(x, "get", None)  # a cupy array copies itself to the host
    return np.asarray(get() if get is not None else x).reshape(-1).view(np.uint8)


def _verify(weights: loaders.LoadedWeights, vf: loaders.VerifiedFile, full: bool) -> None:
    """The loaded tensors hold the file's bytes: all of them (`full`) or 1 MiB at each tensor's start, middle
    and end (a chunk misplaced by the plan shows in one of them)."""
    hdr = safetensors_check.read_header_fd(vf.fd, vf.name)
    m = mmap.mmap(vf.fd, vf.size, prot=mmap.PROT_READ)
    try:
        for t in hdr.tensors:
            got_t = weights.tensors[t.name]
            if full:
                pairs = [(0, t.nbytes)]
            else:
                w = min(2**20, t.nbytes)
                pairs = [(0, w), ((t.nbytes - w) // 2, (t.nbytes + w) // 2), (t.nbytes - w, t.nbytes)]
            flat = got_t.reshape(-1)
            for lo, hi in pairs:
                item = np.dtype(np.float32).itemsize
                got = _host_bytes(flat[lo // item : hi // item])
                want = np.frombuffer(m, np.uint8, count=hi - lo, offset=t.begin + lo)
                if not np.array_equal(got, want):
                    raise AssertionError(f"{weights.mode}: tensor {t.name} bytes [{lo}, {hi}) differ from the file")
                del want
    finally:
        m.close()


def _pcie_limit() -> tuple[float | None, str]:
    """The GPU's PCIe link (max gen and width, as idle links train down) and its usable GB/s."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=pcie.link.gen.max,pcie.link.width.max", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout.splitlines()  # fmt: skip
        gen, width = cudaplan.parse_pcie(out[0])
        return cudaplan.pcie_limit_gbps(gen, width), f"PCIe Gen{gen} x{width}"
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as err:
        return None, f"PCIe link unknown ({err})"


def _free_gpu() -> None:
    import cupy

    cupy.get_default_memory_pool().free_all_blocks()


def _loader_for(name: str, pin: str) -> loaders.Loader:
    if name == "cuda-pinned":
        return loaders.CudaPinnedLoader(pin=pin)
    if name == "kvikio":
        return loaders.KvikioLoader()
    return loaders.HostLoader()


class LoaderResult(msgspec.Struct, kw_only=True):
    """One size (and pin policy) of `bench activate --loader`: a row of the summary."""

    size_bytes: int
    loader: str
    pin: str | None
    """cuda-pinned's pin policy; None for the other loaders."""
    p50_gbps: float
    best_gbps: float
    loads: int
    """Loads measured (--repeats; the first, verified, is not counted)."""
    link_fraction_p50: float | None
    """p50_gbps / link_limit_gbps; None without a GPU link."""
    detail: str
    note: str | None
    """What the loader said when it was prepared (e.g. why it could not pin)."""


class LoaderSkipped(msgspec.Struct, kw_only=True):
    size_bytes: int
    free_bytes: int
    reason: str


class LoaderReport(msgspec.Struct, kw_only=True):
    """`bench activate --loader ... --json`."""

    bench: str = "activate"
    loader: str
    dir: str
    """Where the weights file was written (--shm-dir, or --disk-dir for kvikio)."""
    link: str
    """``PCIe GenN xW`` (the yardstick), or ``host memory``."""
    link_limit_gbps: float | None
    repeats: int
    sizes_bytes: list[int]
    results: list[LoaderResult]
    skipped: list[LoaderSkipped]


def _loader_row(r: LoaderResult | LoaderSkipped, where: Path) -> str:
    gb = r.size_bytes / 1e9
    if isinstance(r, LoaderSkipped):
        return f"{gb:6.1f} GB  skipped: {where} has {r.free_bytes / 1e9:.1f} GB free, needs {gb:.1f}"
    vs = f"{r.link_fraction_p50:5.0%} of the link" if r.link_fraction_p50 is not None else ""
    return (
        f"{gb:6.1f} GB  {r.loader:<12}{'pin=' + r.pin if r.pin is not None else '':<11}"
        f"{r.p50_gbps:7.2f} GB/s p50 (best {r.best_gbps:.2f}, n={r.loads})  {vs}  [{r.detail}]"
    )


def _bench_loader(args: argparse.Namespace, sizes: list[int]) -> int:
    if args.loader in loaders.GPU_LOADERS:
        why = loaders.probe_gpu().unavailable(args.loader)
        if why:
            print(f"no GPU: loader {args.loader} cannot run here: {why}", file=sys.stderr)
            return NO_GPU_EXIT
    fmt = out.machine(args)
    progress = _progress(fmt)
    limit, link = _pcie_limit() if args.loader in loaders.GPU_LOADERS else (None, "host memory")
    pins = [args.pin] if args.loader == "cuda-pinned" and args.pin != "both" else ["always", "never"]
    if args.loader != "cuda-pinned":
        pins = ["auto"]
    where = Path(args.disk_dir if args.loader == "kvikio" else args.shm_dir)
    print(
        f"loader {args.loader}: weights in {where}; yardstick {link}" + (f" = {limit:.1f} GB/s" if limit else ""),
        file=progress,
    )
    report = LoaderReport(
        loader=args.loader, dir=str(where), link=link, link_limit_gbps=limit, repeats=args.repeats,
        sizes_bytes=sizes, results=[], skipped=[],
    )  # fmt: skip
    rows: list[LoaderResult | LoaderSkipped] = []
    for size in sizes:
        free = loaders.shm_free_bytes(str(where))
        if free < size + 2**28:
            reason = f"{where} has {free / 1e9:.1f} GB free, needs {size / 1e9:.1f} GB"
            skip = LoaderSkipped(size_bytes=size, free_bytes=free, reason=reason)
            rows.append(skip)
            report.skipped.append(skip)
            print(_loader_row(skip, where), file=progress, flush=True)
            continue
        work = Path(tempfile.mkdtemp(prefix="pulsescale-bench-", dir=where))
        vf = None
        try:
            t0 = time.perf_counter()
            _write_weights(work / "w.safetensors", size)
            print(f"wrote {size / 1e9:.1f} GB in {time.perf_counter() - t0:.1f} s", file=progress, flush=True)
            vf = _open_verified(work / "w.safetensors")
            for pin in pins:
                loader = _loader_for(args.loader, pin)
                note = loader.prepare([vf])
                if note:
                    print(note, file=progress)
                rates: list[float] = []
                w = None
                for i in range(args.repeats + 1):  # the first pays the CUDA context and the pool: not counted
                    if args.loader == "kvikio":
                        os.posix_fadvise(vf.fd, 0, 0, os.POSIX_FADV_DONTNEED)  # cold: read from the disk
                    w = loader.load([vf], private=True)
                    if i == 0:
                        _verify(w, vf, full=size <= 2**30)
                    else:
                        rates.append(w.nbytes / w.load_s / 1e9)
                    detail = w.detail
                    w.release()
                    del w
                    if args.loader in loaders.GPU_LOADERS:
                        _free_gpu()
                p50 = _pct(rates, 50)
                result = LoaderResult(
                    size_bytes=size, loader=args.loader, pin=pin if args.loader == "cuda-pinned" else None,
                    p50_gbps=p50, best_gbps=max(rates), loads=len(rates),
                    link_fraction_p50=p50 / limit if limit else None, detail=detail, note=note or None,
                )  # fmt: skip
                rows.append(result)
                report.results.append(result)
                print(_loader_row(result, where), file=progress, flush=True)
        finally:
            if vf is not None:
                os.close(vf.fd)
            shutil.rmtree(work, ignore_errors=True)
    if fmt is not None:
        print(out.dump(report, fmt))
        return 0
    print("\nsummary (" + link + (f", usable {limit:.1f} GB/s" if limit else "") + "):")
    for r in rows:
        print("  " + _loader_row(r, where))
    return 0


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
        return _bench_loader(args, sizes)
    if len(sizes) != 1:
        p.error("--size takes one size for the activation bench (several only with --loader)")
    size = sizes[0]
    progress = _progress(out.machine(args))
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
