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
"""

from __future__ import annotations

import argparse
import asyncio
import json
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

import numpy as np

from nodeagent import tinymodel
from nodeagent.engine import cudaplan, loaders, safetensors_check
from warmpool import connect as nats_connect
from warmpool import protocol
from warmpool.embedded import NatsServer
from warmpool.registry import KvSlotStore
from warmpool.sizes import parse_size

MODEL = "bench"
NODE = "bench-node"
STAGES = ("token", "load", "engine", "readiness", "total")


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.array(values), q)) if values else float("nan")


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
    return subprocess.Popen(cmd)


async def _bench(args: argparse.Namespace, shm: Path, server: NatsServer, agent: subprocess.Popen[bytes]) -> int:
    try:
        nc = await nats_connect.connect(nats_connect.NatsOptions(servers=(server.url,), name="pulsescale-bench"))
        store = await KvSlotStore.open(nc)
        await store.start()
        key = protocol.slot_key(MODEL, NODE, "s0")
        t0 = time.perf_counter()
        await _wait_warm(store, key, 600, agent)
        print(f"staged, verified, locked and armed in {time.perf_counter() - t0:.1f} s")
        base = CopyBaseline(sorted((shm / MODEL).glob("*.safetensors")))
        stages: dict[str, list[float]] = {s: [] for s in STAGES}
        claim_ready: list[float] = []
        gbps: list[float] = []
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
    n = len(claim_ready)
    print(
        f"\n{n} activations of a {loaded / 1e6:.1f} MB model, engine memory {args.engine_memory} "
        f"({'loader copies into engine memory' if args.engine_memory == 'private' else 'shm mapping used in place'})"
    )
    print(f"{'stage':<24}{'p50 ms':>10}{'p99 ms':>10}{'max ms':>10}")
    rows = [(s, stages[s]) for s in STAGES] + [("overhead (total-load)", overhead), ("claim->ready", claim_ready)]
    for name, vals in rows:
        print(f"{name:<24}{_pct(vals, 50):>10.2f}{_pct(vals, 99):>10.2f}{max(vals):>10.2f}")
    copy_p50 = _pct(base.gbps, 50)
    loader_p50 = _pct(gbps, 50)
    print(
        f"\nhost loader   {loader_p50:6.2f} GB/s p50 ({_pct(gbps, 1):.2f} p1) over {n} loads of {loaded / 1e6:.1f} MB"
        f"\nnumpy.copyto  {copy_p50:6.2f} GB/s p50 ({_pct(base.gbps, 1):.2f} p1) over {len(base.gbps)} copies "
        "of the same staged bytes into fresh memory, interleaved with the loads"
    )
    if args.engine_memory == "private":
        ratio = loader_p50 / copy_p50 if copy_p50 else float("nan")
        print(f"loader / copyto = {ratio:.2f} (target >= 0.7): {'ok' if ratio >= 0.7 else 'MISSED'}")
    else:
        print("(shared memory: the loader maps in place, so its GB/s is not a copy rate; use --engine-memory private)")
    p99 = _pct(overhead, 99)
    print(f"control-plane overhead p99 {p99:.1f} ms (target <= 150 ms): {'ok' if p99 <= 150 else 'MISSED'}")
    cr = _pct(claim_ready, 99)
    if loaded <= 100e6:
        print(f"claim -> ready p99 {cr:.1f} ms (target for a 64 MB model <= 300 ms): {'ok' if cr <= 300 else 'MISSED'}")
    else:
        print(f"claim -> ready p99 {cr:.1f} ms (its 300 ms target is for a 64 MB model: run --size 64MB)")
    return 0


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


def _bench_loader(args: argparse.Namespace, sizes: list[int]) -> int:
    if args.loader in loaders.GPU_LOADERS:
        why = loaders.probe_gpu().unavailable(args.loader)
        if why:
            print(f"no GPU: loader {args.loader} cannot run here: {why}", file=sys.stderr)
            return NO_GPU_EXIT
    limit, link = _pcie_limit() if args.loader in loaders.GPU_LOADERS else (None, "host memory")
    pins = [args.pin] if args.loader == "cuda-pinned" and args.pin != "both" else ["always", "never"]
    if args.loader != "cuda-pinned":
        pins = ["auto"]
    where = Path(args.disk_dir if args.loader == "kvikio" else args.shm_dir)
    print(f"loader {args.loader}: weights in {where}; yardstick {link}" + (f" = {limit:.1f} GB/s" if limit else ""))
    rows: list[str] = []
    for size in sizes:
        free = loaders.shm_free_bytes(str(where))
        if free < size + 2**28:
            rows.append(f"{size / 1e9:6.1f} GB  skipped: {where} has {free / 1e9:.1f} GB free, needs {size / 1e9:.1f}")
            print(rows[-1], flush=True)
            continue
        work = Path(tempfile.mkdtemp(prefix="pulsescale-bench-", dir=where))
        vf = None
        try:
            t0 = time.perf_counter()
            _write_weights(work / "w.safetensors", size)
            print(f"wrote {size / 1e9:.1f} GB in {time.perf_counter() - t0:.1f} s", flush=True)
            vf = _open_verified(work / "w.safetensors")
            for pin in pins:
                loader = _loader_for(args.loader, pin)
                note = loader.prepare([vf])
                if note:
                    print(note)
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
                vs = f"{p50 / limit:5.0%} of the link" if limit else ""
                rows.append(
                    f"{size / 1e9:6.1f} GB  {args.loader:<12}{'pin=' + pin if args.loader == 'cuda-pinned' else '':<11}"
                    f"{p50:7.2f} GB/s p50 (best {max(rates):.2f}, n={len(rates)})  {vs}  [{detail}]"
                )
                print(rows[-1], flush=True)
        finally:
            if vf is not None:
                os.close(vf.fd)
            shutil.rmtree(work, ignore_errors=True)
    print("\nsummary (" + link + (f", usable {limit:.1f} GB/s" if limit else "") + "):")
    for r in rows:
        print("  " + r)
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
    work = Path(tempfile.mkdtemp(prefix="pulsescale-bench-"))
    shm = Path(tempfile.mkdtemp(prefix="pulsescale-bench-", dir=args.shm_dir))
    try:
        if args.model:
            model_dir = Path(args.model)
        else:
            model_dir = work / MODEL
            t0 = time.perf_counter()
            cfg = tinymodel.make_tiny(model_dir, size)
            print(f"wrote a {cfg.nbytes / 1e6:.1f} MB model in {time.perf_counter() - t0:.1f} s")
        (work / "nats").mkdir()
        with NatsServer(work / "nats", sync_always=not args.no_sync_always) as server:
            print(f"embedded nats-server {server.url}" + ("" if args.no_sync_always else " (sync_interval: always)"))
            return asyncio.run(_bench(args, shm, server, _start_agent(args, model_dir, shm, server)))
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
