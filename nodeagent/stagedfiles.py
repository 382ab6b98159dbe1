"""What a stage produced: the staged set of a model (`Staged`) and each of its files (`StagedFile`).

`nodeagent.staging` makes them (copy, hash, verify, rename); the agent keeps the set it serves from, maps and locks
its weights (`nodeagent.weightlock`) and hands the engines its descriptors (`Staged.engine_weights`). A staged file is
held open read-only (`StagedFile.fd`) from the moment its bytes are hashed, so the descriptor stays the verified
file whatever later happens to its name; `Staged.close` lets go of the descriptors a newer set does not carry over.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nodeagent.engine import safetensors_check

__all__ = ["Staged", "StagedFile", "close_fd", "ident"]


@dataclass(frozen=True)
class StagedFile:
    name: str
    path: Path
    nbytes: int
    sha256: str
    copied: bool
    """False when an already staged copy matched the manifest and was kept."""
    header: safetensors_check.Header | None = None
    fd: int = -1
    """A read-only descriptor of the verified file, held by the agent for as long as this file is staged."""
    ident: tuple[int, int, int, int] = (0, 0, 0, 0)
    """(device, inode, size, mtime ns) when it verified: unchanged since means not read again."""
    written: int = 0
    """Bytes this stage wrote into shm for it (copied or downloaded; less than `nbytes` for a resumed download)."""
    hashed: int = 0
    """Bytes this stage read and hashed for it (0 when carried over unchanged)."""


@dataclass
class Staged:
    model: str
    source: str
    """The model directory, or the URL base (shown without credentials or query)."""
    dir: Path
    files: list[StagedFile]
    stage_s: float
    staged_at: float
    version: str = ""
    """A digest of the manifest: engines armed for another version must be re-armed before they serve."""
    hashed_bytes: int = 0
    """Bytes read and hashed by this stage (0 when every file was kept unchanged from the previous one)."""
    fetched: bool = False
    """The source is a URL: `written_bytes` were downloaded rather than copied."""

    @property
    def how(self) -> str:
        """How the written bytes came: ``fetched`` or ``copied`` (the label of the staged-bytes counter)."""
        return "fetched" if self.fetched else "copied"

    @property
    def weights(self) -> list[StagedFile]:
        return [f for f in self.files if f.header is not None]

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.files)

    @property
    def weights_bytes(self) -> int:
        return sum(f.nbytes for f in self.weights)

    @property
    def copied_bytes(self) -> int:
        return sum(f.nbytes for f in self.files if f.copied)

    @property
    def written_bytes(self) -> int:
        """Bytes this stage wrote into shm (copied from the directory or downloaded from the URL)."""
        return sum(f.written for f in self.files)

    @property
    def reused_bytes(self) -> int:
        """Bytes of files already staged and kept (carried over, or re-verified after a restart)."""
        return sum(f.nbytes for f in self.files if not f.copied)

    def path_of(self, name: str) -> Path:
        """Where the bytes of manifest entry `name` are (the staged file, or a ``.partial`` being vetted)."""
        return next((f.path for f in self.files if f.name == name), self.dir / name)

    def shapes(self) -> dict[str, tuple[tuple[int, ...], str]]:
        return {t.name: (t.shape, t.dtype) for f in self.weights for t in f.header.tensors}  # type: ignore[union-attr]

    def engine_weights(self) -> list[dict[str, Any]]:
        """What the zygote's spec carries: each weights file's descriptor (passed to it) and its identity."""
        return [
            {"name": f.name, "fd": f.fd, "dev": f.ident[0], "ino": f.ident[1], "size": f.nbytes} for f in self.weights
        ]

    def close(self, keep: Staged | None = None) -> None:
        """Close the descriptors of files that `keep` (the set that replaced this one) does not carry over."""
        kept = {f.fd for f in keep.files} if keep is not None else set()
        for f in self.files:
            if f.fd >= 0 and f.fd not in kept:
                close_fd(f.fd)


def close_fd(fd: int) -> None:
    """Close `fd`, once: a `Staged` closed twice is no error."""
    try:
        os.close(fd)
    except OSError:
        pass  # already closed (a Staged closed twice): nothing to do


def ident(st: os.stat_result) -> tuple[int, int, int, int]:
    """(device, inode, size, mtime ns): what `StagedFile.ident` records."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
