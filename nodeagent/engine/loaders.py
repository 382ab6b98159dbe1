"""Weight loaders: how an engine process gets the staged weights into the memory it computes from.

A loader runs inside the engine process, right after the zygote forks it, on files that staging has already
copied, verified and locked. It gets them as open descriptors (`VerifiedFile`: inherited from the agent, which
hashed the bytes through that very descriptor), never by name, and checks each one's device, inode and size
against what staging verified (`WeightsChanged` otherwise): the bytes an engine computes from are the verified
ones. `host` (this part) maps the shm files and either uses the mapping in place (the
engine reads page-cache pages directly: no copy at all) or copies them into memory the engine owns, with a few
threads, when the engine needs its own copy (as a GPU engine does: the copy is the host-side stand-in for the
upload). The GPU loaders put the tensors into one device allocation per model, chunked by `cudaplan.plan_copy`:

- `cuda-pinned`: maps the shm file, registers the mapping (``cudaHostRegister``, portable + read-only) and copies
  it with ``cudaMemcpyAsync`` over several streams; unregisters after. This, not GDS, is the path from
  ``/dev/shm``: GDS cannot read tmpfs. When the memlock limit cannot cover the weights (decided when the slot is
  armed, `cudaplan.pin_decision`) or the driver refuses the registration, it copies from pageable memory instead.
- `kvikio`: ``CuFile.pread`` into device memory, for weights on NVMe; GDS where cuFile runs, POSIX ("compat")
  otherwise: the loaded weights say which ran. kvikio opens by path, so it is given the verified descriptor's
  ``/proc/self/fd`` link (the same open inode, not a name lookup) and its handle is checked against it.

Their libraries are imported inside `prepare`/`load`, never at module import: a CPU node never touches them
(kvikio imports without a GPU but fails at the first read). `choose` explains what it picked and why.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import mmap
import os
import resource
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

import numpy as np

from nodeagent.engine import cudaplan, safetensors_check
from nodeagent.errors import LoaderUnavailable, WeightsChanged

__all__ = [
    "GPU_LOADERS",
    "LOADERS",
    "CudaPinnedLoader",
    "GpuProbe",
    "HostLoader",
    "KvikioLoader",
    "LoadedWeights",
    "Loader",
    "VerifiedFile",
    "choose",
    "gpu_count",
    "pin_decision_for",
    "probe_gpu",
    "verified_files",
]

LOADERS: Final = ("auto", "host", "cuda-pinned", "kvikio")
GPU_LOADERS: Final = ("cuda-pinned", "kvikio")

# numpy has no bfloat16 or float8: those tensors come out as raw unsigned integers of the same width, for an
# engine that knows what to do with them.
_NUMPY_DTYPES: Final[dict[str, Any]] = {
    "BOOL": np.bool_,
    "U8": np.uint8,
    "I8": np.int8,
    "F8_E5M2": np.uint8,
    "F8_E4M3": np.uint8,
    "F8_E8M0": np.uint8,
    "I16": np.int16,
    "U16": np.uint16,
    "F16": np.float16,
    "BF16": np.uint16,
    "I32": np.int32,
    "U32": np.uint32,
    "F32": np.float32,
    "I64": np.int64,
    "U64": np.uint64,
    "F64": np.float64,
}

COPY_CHUNK_BYTES: Final = 32 * 2**20
"""Per-task copy size: large enough that thread hand-off is noise, small enough to spread a file over threads."""
_MAP_POPULATE: Final = getattr(mmap, "MAP_POPULATE", 0)


@dataclass
class LoadedWeights:
    """Tensors in the memory the engine computes from, and what it took to get them there."""

    tensors: dict[str, np.ndarray]
    nbytes: int
    mode: str
    """``mapped`` (the shm pages in place) or ``copied`` (engine-owned memory); on a GPU ``pinned`` or
    ``pageable`` (`CudaPinnedLoader`), ``gds`` or ``compat`` (`KvikioLoader`). GPU tensors are device arrays
    (cupy), views into one device allocation."""
    device: str = "cpu"
    load_s: float = 0.0
    detail: str = ""
    """How the bytes moved, for a person: streams, chunks, registration time, why a fallback ran."""
    _keep: list[Any] = field(default_factory=list, repr=False)

    def release(self) -> None:
        """Drop the tensors and the mappings (the process exiting does the same, faster)."""
        self.tensors.clear()
        for m in self._keep:
            if isinstance(m, mmap.mmap):
                try:
                    m.close()
                except BufferError:
                    pass  # a view is still alive somewhere; the mapping goes when it does
        self._keep.clear()


@dataclass(frozen=True)
class VerifiedFile:
    """A staged weights file as the engine gets it: an open read-only descriptor and what staging verified."""

    name: str
    fd: int
    dev: int
    ino: int
    size: int

    def check(self) -> None:
        """Refuse a descriptor that is not the verified file (one ``fstat``: nothing on the activation path)."""
        try:
            st = os.fstat(self.fd)
        except OSError as err:
            raise WeightsChanged(self.name, f"the verified descriptor {self.fd} is not open: {err.strerror}") from None
        got, want = (st.st_dev, st.st_ino, st.st_size), (self.dev, self.ino, self.size)
        if got != want:
            raise WeightsChanged(
                self.name,
                f"descriptor {self.fd} is device/inode/size {got}, staging verified {want}; refusing to load "
                "weights that were not verified (send prewarm to stage and verify them again)",
            )


def verified_files(entries: Sequence[Mapping[str, Any]]) -> list[VerifiedFile]:
    """The spec's ``weights`` entries (`staging.Staged.engine_weights`) as `VerifiedFile`s."""
    return [VerifiedFile(str(e["name"]), int(e["fd"]), int(e["dev"]), int(e["ino"]), int(e["size"])) for e in entries]


class Loader(Protocol):
    name: str

    def prepare(self, files: Sequence[VerifiedFile]) -> str:
        """Everything that can be decided before an activation, at arm time in the zygote (before it forks, so
        nothing here may start CUDA or threads); returns a note for the log ("" when there is nothing to say)."""
        ...

    def load(self, files: Sequence[VerifiedFile], *, private: bool) -> LoadedWeights:
        """Map or move every tensor of `files` (staged safetensors); `private` asks for engine-owned memory."""
        ...


class HostLoader:
    """CPU: the shm mapping in place, or a multi-threaded copy into engine-owned memory."""

    name = "host"

    def __init__(self, copy_threads: int | None = None) -> None:
        self.copy_threads = copy_threads or max(2, min(8, 2 * (os.cpu_count() or 1)))
        """Copy threads: numpy releases the GIL while copying and the kernel populates mappings in parallel; twice
        the cores, because a thread waiting on page-table work leaves its core to another (measured here)."""

    def prepare(self, files: Sequence[VerifiedFile]) -> str:
        return ""

    def load(self, files: Sequence[VerifiedFile], *, private: bool) -> LoadedWeights:
        t0 = time.perf_counter()
        for vf in files:
            vf.check()
        headers = [safetensors_check.read_header_fd(vf.fd, vf.name) for vf in files]
        total = sum(h.data_bytes for h in headers)
        if not private:
            maps = [mmap.mmap(vf.fd, vf.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) for vf in files]
            tensors = {t.name: _view(m, t) for m, h in zip(maps, headers, strict=True) for t in h.tensors}
            return LoadedWeights(tensors, total, "mapped", load_s=time.perf_counter() - t0, _keep=list(maps))
        dst = np.empty(total, np.uint8)
        tensors = {}
        jobs: list[tuple[int, int, int, int]] = []  # (descriptor, first byte, end byte, where in dst)
        at = 0
        for vf, h in zip(files, headers, strict=True):
            for lo in range(h.data_offset, h.file_bytes, COPY_CHUNK_BYTES):
                hi = min(lo + COPY_CHUNK_BYTES, h.file_bytes)
                jobs.append((vf.fd, lo, hi, at + lo - h.data_offset))
            for t in h.tensors:
                first = at + t.begin - h.data_offset
                tensors[t.name] = dst[first : first + t.nbytes].view(_NUMPY_DTYPES[t.dtype]).reshape(t.shape)
            at += h.data_bytes

        def copy(job: tuple[int, int, int, int]) -> None:
            # Each chunk gets its own populated mapping: the page-table work for the source is done by the
            # kernel in one call per chunk, in parallel across threads, instead of one fault per 4 KiB page.
            fd, lo, hi, into = job
            base = lo - lo % mmap.ALLOCATIONGRANULARITY
            m = mmap.mmap(fd, hi - base, flags=mmap.MAP_SHARED | _MAP_POPULATE, prot=mmap.PROT_READ, offset=base)
            try:
                src = np.frombuffer(m, np.uint8, count=hi - lo, offset=lo - base)
                np.copyto(dst[into : into + hi - lo], src)
                del src
            finally:
                m.close()

        if self.copy_threads > 1 and len(jobs) > 1:
            with ThreadPoolExecutor(min(self.copy_threads, len(jobs)), thread_name_prefix="copy") as pool:
                list(pool.map(copy, jobs))
        else:
            for job in jobs:
                copy(job)
        return LoadedWeights(tensors, total, "copied", load_s=time.perf_counter() - t0, _keep=[dst])


def _view(m: mmap.mmap, t: safetensors_check.TensorInfo) -> np.ndarray:
    dtype = np.dtype(_NUMPY_DTYPES[t.dtype])
    return np.frombuffer(m, dtype, count=t.nbytes // dtype.itemsize, offset=t.begin).reshape(t.shape)


def gpu_count() -> int:
    """NVIDIA GPUs visible to this node, from their device files (no driver library needed)."""
    try:
        return sum(1 for name in os.listdir("/dev") if name.startswith("nvidia") and name[6:].isdigit())
    except OSError:
        return 0


# --- the GPU loaders ------------------------------------------------------------------------------------------

_HOST_REGISTER_PORTABLE: Final = 0x01
_HOST_REGISTER_READ_ONLY: Final = 0x08
"""``cudaHostRegisterPortable`` / ``cudaHostRegisterReadOnly`` (driver_types.h). Read-only is what lets the
driver pin a ``PROT_READ`` mapping of a file we must not write (CUDA 11.1+, `cudaDevAttrHostRegisterReadOnly\
Supported`); where it is refused the loader copies from pageable memory instead."""
_MEMCPY_HOST_TO_DEVICE: Final = 1
_CAP_IPC_LOCK: Final = 14


@dataclass(frozen=True)
class GpuProbe:
    """What this node offers the GPU loaders, found without starting CUDA (a zygote forks after probing)."""

    devices: int
    """``/dev/nvidiaN`` device files."""
    libcuda: str
    """"" when ``libcuda.so.1`` (the driver library) loads, else why not."""
    cupy: bool
    kvikio: bool

    def unavailable(self, loader: str) -> str:
        """Why `loader` cannot run here ("" when it can)."""
        if not self.devices:
            return (
                "no GPU on this node: no /dev/nvidiaN device file (is the NVIDIA driver loaded and the device "
                "given to this container?)"
            )
        if self.libcuda:
            return f"the NVIDIA driver library cannot be loaded: {self.libcuda}"
        if not self.cupy:
            return "cupy is not installed (pip install 'pulsescale[gpu]' for CUDA 13, '[gpu-cu12]' for CUDA 12)"
        if loader == "kvikio" and not self.kvikio:
            return "kvikio is not installed (pip install 'pulsescale[gpu]' for CUDA 13, '[gpu-cu12]' for CUDA 12)"
        return ""


def probe_gpu() -> GpuProbe:
    """Device files, the driver library (loaded, not initialised) and whether cupy/kvikio are installed (found,
    not imported)."""
    devices = gpu_count()
    libcuda = ""
    if devices:
        try:
            ctypes.CDLL("libcuda.so.1")
        except OSError as err:
            libcuda = str(err)
    else:
        libcuda = "not looked for (no device)"
    return GpuProbe(
        devices=devices,
        libcuda=libcuda,
        cupy=importlib.util.find_spec("cupy") is not None,
        kvikio=importlib.util.find_spec("kvikio") is not None,
    )


def _memlock_bytes() -> int | None:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else soft


def _has_cap(bit: int) -> bool:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> bit & 1)
    except (OSError, ValueError):
        pass
    return False


def pin_decision_for(weights_bytes: int, policy: str) -> cudaplan.PinDecision:
    """`cudaplan.pin_decision` with this process's memlock limit and capabilities."""
    return cudaplan.pin_decision(
        weights_bytes, memlock_bytes=_memlock_bytes(), cap_ipc_lock=_has_cap(_CAP_IPC_LOCK), policy=policy
    )


def _plan(files: Sequence[VerifiedFile], chunk_bytes: int, streams: int) -> tuple[Any, cudaplan.CopyPlan]:
    for vf in files:
        vf.check()
    headers = [safetensors_check.read_header_fd(vf.fd, vf.name) for vf in files]
    spans = [cudaplan.Span(h.data_offset, h.file_bytes) for h in headers]
    return headers, cudaplan.plan_copy(spans, chunk_bytes=chunk_bytes, streams=streams)


def _device_buffer(cupy: Any, plan: cudaplan.CopyPlan, loader: str) -> Any:
    free, total = cupy.cuda.runtime.memGetInfo()
    if plan.alloc_bytes > free:
        raise LoaderUnavailable(
            f"{loader}: the weights need {cudaplan.fmt_bytes(plan.alloc_bytes)} of GPU memory, "
            f"{cudaplan.fmt_bytes(free)} of {cudaplan.fmt_bytes(total)} is free (another process on this GPU?)"
        )
    return cupy.empty(max(plan.alloc_bytes, 1), dtype=cupy.uint8)


def _device_tensors(dev: Any, headers: Sequence[Any], plan: cudaplan.CopyPlan) -> dict[str, Any]:
    tensors: dict[str, Any] = {}
    for i, h in enumerate(headers):
        for t in h.tensors:
            at = plan.dst_of(i, t.begin)
            tensors[t.name] = dev[at : at + t.nbytes].view(_NUMPY_DTYPES[t.dtype]).reshape(t.shape)
    return tensors


class CudaPinnedLoader:
    """shm -> GPU: register the mapping, ``cudaMemcpyAsync`` in chunks over streams (module doc)."""

    name = "cuda-pinned"

    def __init__(
        self, *, chunk_bytes: int = cudaplan.CHUNK_BYTES, streams: int = cudaplan.STREAMS, pin: str = "auto"
    ) -> None:
        self.chunk_bytes = chunk_bytes
        self.streams = streams
        self.pin = pin
        """``auto``: pin when the memlock limit allows (`cudaplan.pin_decision`); ``always``/``never``: forced
        (the bench measures both)."""
        self.decision: cudaplan.PinDecision | None = None

    def prepare(self, files: Sequence[VerifiedFile]) -> str:
        # Called after the zygote dropped privileges: the capability check sees what the engine will have.
        self.decision = pin_decision_for(sum(vf.size for vf in files), self.pin)
        import cupy  # noqa: F401 - the import is what a cold engine pays; it does not start CUDA (no fork hazard)

        if self.decision.register:
            return ""
        note = f"cuda-pinned: {self.decision.reason}"
        print(note, file=sys.stderr, flush=True)  # once per armed slot, in the agent's log
        return note

    def load(self, files: Sequence[VerifiedFile], *, private: bool) -> LoadedWeights:
        import cupy

        t0 = time.perf_counter()
        if self.decision is None:
            self.prepare(files)
        assert self.decision is not None
        headers, plan = _plan(files, self.chunk_bytes, self.streams)
        dev = _device_buffer(cupy, plan, self.name)
        rt = cupy.cuda.runtime
        maps = [mmap.mmap(vf.fd, vf.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) for vf in files]
        views = [np.frombuffer(m, np.uint8) for m in maps]  # for the addresses; released before the unmap
        addrs = [v.ctypes.data for v in views]
        registered: list[int] = []
        mode, why = "pinned", self.decision.reason
        try:
            t_reg = time.perf_counter()
            if self.decision.register:
                try:
                    for addr, vf in zip(addrs, files, strict=True):
                        rt.hostRegister(addr, vf.size, _HOST_REGISTER_PORTABLE | _HOST_REGISTER_READ_ONLY)
                        registered.append(addr)
                except rt.CUDARuntimeError as err:
                    for addr in registered:
                        rt.hostUnregister(addr)
                    registered.clear()
                    mode, why = "pageable", f"cudaHostRegister refused ({err}): copied from pageable memory"
            else:
                mode = "pageable"
            reg_s = time.perf_counter() - t_reg
            t_copy = time.perf_counter()
            streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(self.streams)]
            base = dev.data.ptr
            for c in plan.chunks:
                rt.memcpyAsync(
                    base + c.dst, addrs[c.file] + c.src, c.nbytes, _MEMCPY_HOST_TO_DEVICE, streams[c.stream].ptr
                )
            for s in streams:
                s.synchronize()
            copy_s = time.perf_counter() - t_copy
        finally:
            for addr in registered:
                rt.hostUnregister(addr)
            views.clear()
            for m in maps:
                m.close()
        tensors = _device_tensors(dev, headers, plan)
        detail = (
            f"{mode}: {len(plan.chunks)} chunks of <= {cudaplan.fmt_bytes(self.chunk_bytes)} over "
            f"{self.streams} streams; register {reg_s * 1e3:.0f} ms, copy {copy_s * 1e3:.0f} ms "
            f"({plan.nbytes / max(copy_s, 1e-9) / 1e9:.1f} GB/s); {why}"
        )
        return LoadedWeights(
            tensors, plan.nbytes, mode, device=f"cuda:{dev.device.id}", load_s=time.perf_counter() - t0,
            detail=detail, _keep=[dev],
        )  # fmt: skip


class KvikioLoader:
    """file -> GPU with ``kvikio.CuFile.pread``: GDS when cuFile runs, POSIX (compat) otherwise (module doc)."""

    name = "kvikio"

    def __init__(self, *, chunk_bytes: int = cudaplan.CHUNK_BYTES) -> None:
        self.chunk_bytes = chunk_bytes
        """Bytes per ``pread``; kvikio splits each further into its own tasks over its thread pool."""

    def prepare(self, files: Sequence[VerifiedFile]) -> str:
        # kvikio is not imported here: its thread pool would not survive the zygote's fork. What can fail is
        # checked here, as the engine's user: kvikio opens by path, and the magic link is permission-checked.
        for vf in files:
            try:
                fd = os.open(f"/proc/self/fd/{vf.fd}", os.O_RDONLY | os.O_CLOEXEC)
            except OSError as err:
                raise LoaderUnavailable(
                    f"kvikio opens weights by path, and this engine (uid {os.getuid()}) cannot reopen the verified "
                    f"{vf.name} through its descriptor ({err.strerror}: staged files are the agent's, mode 0600); "
                    "use --loader cuda-pinned (it reads the descriptor itself) or run engines as the agent's user"
                ) from None
            os.close(fd)
        return ""

    def load(self, files: Sequence[VerifiedFile], *, private: bool) -> LoadedWeights:
        import cupy
        import kvikio
        import kvikio.defaults

        t0 = time.perf_counter()
        headers, plan = _plan(files, self.chunk_bytes, 1)
        dev = _device_buffer(cupy, plan, self.name)
        handles = []
        try:
            for vf in files:
                # The verified descriptor's magic link reopens that very inode: no name is looked up.
                f = kvikio.CuFile(f"/proc/self/fd/{vf.fd}", "r")
                handles.append(f)
                st = os.fstat(f.fileno())
                if (st.st_dev, st.st_ino, st.st_size) != (vf.dev, vf.ino, vf.size):
                    raise WeightsChanged(vf.name, "kvikio's handle is not the verified file; refusing to load it")
            futures = [handles[c.file].pread(dev[c.dst : c.dst + c.nbytes], c.nbytes, c.src) for c in plan.chunks]
            got = sum(fut.get() for fut in futures)
        finally:
            for f in handles:
                f.close()
        if got != plan.nbytes:
            raise WeightsChanged(files[0].name, f"kvikio read {got} bytes of {plan.nbytes}: the files shrank?")
        compat = _kvikio_compat(kvikio.defaults)
        mode = "compat" if compat else "gds"
        load_s = time.perf_counter() - t0
        detail = f"{mode}: {len(plan.chunks)} preads ({plan.nbytes / max(load_s, 1e-9) / 1e9:.1f} GB/s); " + (
            "POSIX reads through a bounce buffer (no cuFile/GDS on this node)"
            if compat
            else "cuFile (GDS; a file cuFile cannot register, e.g. on tmpfs, is read with POSIX)"
        )
        return LoadedWeights(
            _device_tensors(dev, headers, plan), plan.nbytes, mode, device=f"cuda:{dev.device.id}",
            load_s=load_s, detail=detail, _keep=[dev],
        )  # fmt: skip


def _kvikio_compat(defaults: Any) -> bool:
    """Whether kvikio reads with POSIX (compat) rather than cuFile: ``is_compat_mode_preferred()`` (kvikio 25.x
    and later: AUTO resolved against the node) or, before it, ``compat_mode()`` (a bool)."""
    preferred = getattr(defaults, "is_compat_mode_preferred", None)
    if preferred is not None:
        return bool(preferred())
    return bool(defaults.compat_mode())


def _on_tmpfs(path: str) -> bool:
    try:
        return _fs_type(path) == "tmpfs"
    except (OSError, IndexError):
        return True  # unknown: assume staging's default (/dev/shm)


def _fs_type(path: str) -> str:
    """The filesystem type of the mount holding `path`, from /proc/self/mountinfo (longest mount-point match)."""
    real = os.path.realpath(path)
    best, kind = "", ""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            mount = left.split()[4].replace("\\040", " ")
            if (real == mount or real.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
                best, kind = mount, right.split()[0]
    return kind


def choose(
    name: str,
    *,
    engine_device: str = "cpu",
    probe: GpuProbe | None = None,
    staging_dir: str | None = None,
) -> tuple[Loader, str]:
    """The loader for `name` and why it was picked. ``auto`` picks the best one this node and engine can use:
    ``host`` for an engine that computes on the CPU or a node without a usable GPU; on a GPU engine,
    ``cuda-pinned`` for weights staged on tmpfs (GDS cannot read tmpfs) and ``kvikio`` for weights on a disk.
    A GPU loader asked for by name that cannot run here raises `LoaderUnavailable` with the reason."""
    if name not in LOADERS:
        raise LoaderUnavailable(f"unknown loader {name!r}; known: {', '.join(LOADERS)}")
    if name == "host":
        return HostLoader(), "asked for"
    if name in GPU_LOADERS:
        why = (probe or probe_gpu()).unavailable(name)
        if why:
            raise LoaderUnavailable(f"loader {name!r} cannot run on this node: {why}; use --loader host or auto")
        return (CudaPinnedLoader() if name == "cuda-pinned" else KvikioLoader()), "asked for"
    p = probe or probe_gpu()
    why = p.unavailable("cuda-pinned")
    if why:
        return HostLoader(), why
    if engine_device == "cpu":
        return HostLoader(), (
            f"{p.devices} GPU(s) present but the engine computes on the CPU: the shm mapping is its fastest load"
        )
    if staging_dir is not None and not _on_tmpfs(staging_dir) and not p.unavailable("kvikio"):
        return KvikioLoader(), f"weights staged on a disk ({staging_dir}): CuFile reads, GDS where cuFile runs"
    return CudaPinnedLoader(), "weights staged on tmpfs: pinned shm mapping, chunked copies over streams"


def shm_free_bytes(path: str) -> int:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return 0
