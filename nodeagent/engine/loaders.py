"""Weight loaders: how an engine process gets the staged weights into the memory it computes from.

A loader runs inside the engine process, right after the zygote forks it, on files that staging has already
copied, verified and locked. It gets them as open descriptors (`VerifiedFile`: inherited from the agent, which
hashed the bytes through that very descriptor), never by name, and checks each one's device, inode and size
against what staging verified (`WeightsChanged` otherwise): the bytes an engine computes from are the verified
ones. `host` (this part) maps the shm files and either uses the mapping in place (the
engine reads page-cache pages directly: no copy at all) or copies them into memory the engine owns, with a few
threads, when the engine needs its own copy (as a GPU engine does: the copy is the host-side stand-in for the
upload). Part 2 adds `cuda-pinned` (``cudaHostRegister`` the mapping, chunked ``cudaMemcpyAsync`` over streams)
and `kvikio` behind the same `Loader` protocol; their GPU libraries are imported inside their `load`, never here.
"""

from __future__ import annotations

import mmap
import os
import shutil
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

import numpy as np

from nodeagent.engine import safetensors_check
from nodeagent.errors import LoaderUnavailable, WeightsChanged

__all__ = [
    "GPU_LOADERS",
    "LOADERS",
    "HostLoader",
    "LoadedWeights",
    "Loader",
    "VerifiedFile",
    "choose",
    "gpu_count",
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
    """``mapped`` (the shm pages in place) or ``copied`` (engine-owned memory)."""
    device: str = "cpu"
    load_s: float = 0.0
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


def choose(name: str, *, engine_device: str = "cpu") -> tuple[Loader, str]:
    """The loader for `name` and why it was picked. ``auto`` picks the best one this node and engine can use."""
    if name not in LOADERS:
        raise LoaderUnavailable(f"unknown loader {name!r}; known: {', '.join(LOADERS)}")
    if name in GPU_LOADERS:
        raise LoaderUnavailable(
            f"loader {name!r} is not built yet in this version (GPU loaders come later); use --loader host or auto"
        )
    if name == "host":
        return HostLoader(), "asked for"
    gpus = gpu_count()
    if engine_device == "cpu":
        return HostLoader(), "the engine computes on the CPU"
    if gpus:
        return HostLoader(), f"{gpus} GPU(s) present but the GPU loaders are not built yet in this version"
    return HostLoader(), "no GPU on this node"


def shm_free_bytes(path: str) -> int:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return 0
