"""`pulsescale bench activate --loader L`: a loader's GB/s on weights it reads from ``/dev/shm``, against the link.

Writes safetensors files of each ``--size`` under ``/dev/shm`` (skipped, and said, where there is not room), loads
each with the named loaders (``host``, ``cuda-pinned``, ``kvikio``), verifies what reached the device, and prints
the p50 and best GB/s of each next to the PCIe limit it could read (``-o json`` for one object). Split from
`nodeagent.bench` (the activation path, stage by stage), which runs it for ``--loader``.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import numpy as np

from nodeagent.engine import cudaplan, loaders, safetensors_check
from warmpool import output as out


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.array(values), q)) if values else float("nan")




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


def run(args: argparse.Namespace, sizes: list[int]) -> int:
    if args.loader in loaders.GPU_LOADERS:
        why = loaders.probe_gpu().unavailable(args.loader)
        if why:
            print(f"no GPU: loader {args.loader} cannot run here: {why}", file=sys.stderr)
            return NO_GPU_EXIT
    fmt = out.machine(args)
    progress = out.progress(fmt)
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
