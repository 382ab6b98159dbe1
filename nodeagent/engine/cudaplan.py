"""Pure planning for the GPU loaders: which bytes go where, on which stream, and whether to pin.

Nothing here touches a GPU, a file or the clock: the loaders (`loaders.CudaPinnedLoader`, `loaders.KvikioLoader`)
call these with what they read from the node, and the tests call them with made-up nodes.

- `plan_copy`: the staged files' data sections -> chunks for ``cudaMemcpyAsync`` (or ``CuFile.pread``) into one
  device allocation. Every data byte is copied exactly once; no chunk crosses a file's end; interior chunk
  boundaries fall on multiples of `chunk_bytes` in the file (each file's data is placed in device memory so
  that a device address and its file offset agree modulo `align`, so those boundaries are aligned there too:
  page-aligned DMA and ``O_DIRECT``-friendly reads);
  chunks go to the least-loaded stream, so streams differ by at most one chunk.
- `pin_decision`: register (pin) the shm mapping, or copy from pageable memory, given the memlock limit.
- `pcie_limit_gbps`: the link's usable bandwidth, the yardstick for a loader's GB/s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

__all__ = [
    "ALIGN_BYTES",
    "CHUNK_BYTES",
    "STREAMS",
    "Chunk",
    "CopyPlan",
    "PinDecision",
    "Span",
    "fmt_bytes",
    "parse_pcie",
    "pcie_limit_gbps",
    "pin_decision",
    "plan_copy",
]

ALIGN_BYTES: Final = 4096
"""Chunk boundaries and the device placement of each file agree modulo this: page-aligned DMA sources and the
alignment ``O_DIRECT``/GDS reads need."""
CHUNK_BYTES: Final = 64 * 2**20
"""Bytes per ``cudaMemcpyAsync``: large enough that the per-call cost (~10 us) is under 1 % at PCIe Gen5 speed,
small enough that a 1 GB model spreads over every stream."""
STREAMS: Final = 4
"""Copy streams: H2D copies share one copy engine per direction, so more streams mostly hide per-call gaps;
four keeps it busy (more buys nothing measurable on the cards we know)."""

PCIE_LANE_GBPS: Final = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}
"""Usable GB/s per lane and direction after line encoding (8b/10b to Gen2, 128b/130b from Gen3, FLIT at Gen6)."""


@dataclass(frozen=True)
class Span:
    """One staged file's data section: file offsets [begin, end) (after the safetensors header)."""

    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class Chunk:
    """Copy `nbytes` from file `file` at offset `src` to the device allocation at offset `dst`, on `stream`."""

    file: int
    src: int
    dst: int
    nbytes: int
    stream: int


@dataclass(frozen=True)
class CopyPlan:
    chunks: tuple[Chunk, ...]
    dst_base: tuple[int, ...]
    """Where file i's first data byte lands in the device allocation."""
    spans: tuple[Span, ...]
    alloc_bytes: int
    """Size of the one device allocation the chunks land in (data plus alignment gaps)."""
    stream_bytes: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.spans)

    def dst_of(self, file: int, offset: int) -> int:
        """Device offset of file `file`'s byte at file offset `offset` (a tensor's begin, say)."""
        span = self.spans[file]
        if not span.begin <= offset <= span.end:
            raise ValueError(f"offset {offset} is outside file {file}'s data [{span.begin}, {span.end})")
        return self.dst_base[file] + offset - span.begin


def plan_copy(
    spans: Sequence[Span], *, chunk_bytes: int = CHUNK_BYTES, streams: int = STREAMS, align: int = ALIGN_BYTES
) -> CopyPlan:
    """Chunks that copy every byte of `spans` once into one allocation, balanced over `streams` (module doc)."""
    if align <= 0 or align & (align - 1):
        raise ValueError(f"align must be a power of two, got {align}")
    if chunk_bytes <= 0 or chunk_bytes % align:
        raise ValueError(f"chunk_bytes must be a positive multiple of align ({align}), got {chunk_bytes}")
    if streams < 1:
        raise ValueError(f"streams must be >= 1, got {streams}")
    loads = [0] * streams
    chunks: list[Chunk] = []
    bases: list[int] = []
    end_of_alloc = 0
    for i, span in enumerate(spans):
        if not 0 <= span.begin <= span.end:
            raise ValueError(f"file {i}: bad data span [{span.begin}, {span.end})")
        # Smallest base >= end_of_alloc with base == span.begin (mod align).
        base = end_of_alloc + (span.begin - end_of_alloc) % align
        bases.append(base)
        lo = span.begin
        while lo < span.end:
            hi = min((lo // chunk_bytes + 1) * chunk_bytes, span.end)  # next multiple of chunk_bytes, or the end
            stream = min(range(streams), key=loads.__getitem__)
            chunks.append(Chunk(i, lo, base + lo - span.begin, hi - lo, stream))
            loads[stream] += hi - lo
            lo = hi
        if span.nbytes:
            end_of_alloc = base + span.nbytes
    return CopyPlan(tuple(chunks), tuple(bases), tuple(spans), end_of_alloc, tuple(loads))


@dataclass(frozen=True)
class PinDecision:
    register: bool
    """True: ``cudaHostRegister`` the mapping and DMA from it; False: copy from pageable memory."""
    reason: str


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


PIN_POLICIES: Final = ("auto", "always", "never")


def pin_decision(
    weights_bytes: int, *, memlock_bytes: int | None, cap_ipc_lock: bool, policy: str = "auto"
) -> PinDecision:
    """Pin (register) `weights_bytes` of shm mapping, or copy from pageable memory.

    `memlock_bytes` is the soft ``RLIMIT_MEMLOCK`` (None: unlimited); `cap_ipc_lock` whether the process may lock
    beyond it. Decided when the slot is armed, so a limit too low is said once there, not found mid-activation.
    """
    if policy not in PIN_POLICIES:
        raise ValueError(f"pin policy must be one of {', '.join(PIN_POLICIES)}, got {policy!r}")
    if policy == "never":
        return PinDecision(False, "pinning turned off: copying from pageable memory")
    if policy == "always":
        return PinDecision(True, "pinning forced on, whatever the memlock limit")
    if memlock_bytes is None:
        return PinDecision(True, "memlock limit unlimited")
    if cap_ipc_lock:
        return PinDecision(True, "CAP_IPC_LOCK: the memlock limit does not apply")
    if memlock_bytes >= weights_bytes:
        return PinDecision(True, f"memlock limit {fmt_bytes(memlock_bytes)} covers {fmt_bytes(weights_bytes)}")
    return PinDecision(
        False,
        f"RLIMIT_MEMLOCK is {fmt_bytes(memlock_bytes)} but pinning the weights locks {fmt_bytes(weights_bytes)}: "
        "copying from pageable memory instead (the driver stages every byte: slower); for pinned copies raise "
        "it (`ulimit -l unlimited`, LimitMEMLOCK=infinity under systemd) or give the pod the IPC_LOCK capability",
    )


def pcie_limit_gbps(gen: int, width: int) -> float:
    """Usable one-direction GB/s of a PCIe link (encoding overhead out, protocol overhead in: ~85-90 % of it is
    what a good H2D copy reaches)."""
    if gen not in PCIE_LANE_GBPS or width < 1:
        raise ValueError(f"unknown PCIe link gen {gen} x{width}")
    return PCIE_LANE_GBPS[gen] * width


def parse_pcie(line: str) -> tuple[int, int]:
    """``nvidia-smi --query-gpu=pcie.link.gen.max,pcie.link.width.max --format=csv,noheader`` -> (gen, width)."""
    parts = [p.strip() for p in line.strip().split(",")]
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise ValueError(f"cannot read a PCIe gen,width from {line!r}")
    return int(parts[0]), int(parts[1])
