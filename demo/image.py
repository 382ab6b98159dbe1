"""The demo's rootfs stage: one real EROFS image, built and mounted once before the agents start, reused by all.

``--image auto`` (the default): as root, with erofs-utils and the kernel's EROFS (`nodeagent.rootfs.probe`), the
demo builds a small image of what a cold engine imports from its site-packages (the project's own ``nodeagent``
and ``warmpool`` packages and ``packaging``, a pure-Python dependency vLLM imports too: about 2 MB), mounts it
read-only through a loop device and reads it into the page cache. ``--image DIR|TARBALL`` does the same with that
source; ``--image none`` turns the stage off. Without the capability the stage is skipped and the demo says why,
once.

Why the demo builds and mounts before the agents start: agents sharing a ``--rootfs-dir`` find an image by its
source's fingerprint and a mount by the image's digest; agents that start together take turns under
`rootfs.host_lock` (without it each built the image and all but one failed to mount it). Built and mounted here
first, under the same lock, the build and mount are timed once, for the report, and every agent finds the image
built (``images_built`` 0) and the mount in place (``mounts_reused`` 1): one image, one mount and one loop device
for the fleet, as on a real node, which the report checks from each agent's status.

Kept resident: a node's page cache is not kept for us. This machine's kernel pages out cold, unmapped file pages
on its own (DAMON's proactive ``pageout``, with no memory pressure at all), and a busy node evicts them under
pressure; the agents re-check the image before they arm a slot. The demo locks the image's pages in memory
(`Keeper.pin`, ``mlock``: as root, or within RLIMIT_MEMLOCK) and unlocks them before it unmounts; it also re-checks
the image every `KEEP_RESIDENT_EVERY_S` while it runs, reading back what was evicted where the lock was refused, and
reports how often it had to. Re-checks alone left 97 % resident at a pulse's start once (CI).

The rootfs directory is a temporary directory of its own (mode 0711, as ``mnt/``): engines that run as the
unprivileged engine user must traverse to their image, and the run's work directory is 0700. `release` unmounts
everything of it and detaches its loop devices; the run calls it after every process is stopped.
"""

from __future__ import annotations

import importlib
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from nodeagent import pagecache, rootfs

__all__ = [
    "AUTO",
    "IMAGE_PACKAGES",
    "NONE",
    "Keeper",
    "MountedImage",
    "make_source",
    "mount_image",
    "new_rootfs_dir",
    "release",
]

AUTO: Final = "auto"
NONE: Final = "none"
IMAGE_PACKAGES: Final = ("nodeagent", "warmpool", "packaging")
"""What the generated image holds under ``site-packages/``: the agent's and engines' own code and a small pure-Python
dependency. Small on purpose (about 2 MB, built and warmed in well under a second): the stage is shown for real, and
the demo stays quick; a real engine's image (vLLM, torch) is a few GB and goes through the same functions."""
MIN_RESIDENT_PCT: Final = 99.0
"""Below this share in the page cache the image is read in again (the agents' ``rootfs_min_resident_pct``)."""
KEEP_RESIDENT_EVERY_S: Final = 1.0
"""How often the demo checks the image's residency: one ``mincore`` per file, well under a millisecond for the
generated image, and often enough that an eviction is read back before a slot would need the pages."""


@dataclass(frozen=True)
class MountedImage:
    """The image the fleet runs from, and what building, mounting and warming it cost."""

    source: Path
    rootfs_dir: Path
    mounted: rootfs.Rootfs
    built: bool
    build_s: float
    mount_s: float
    warm_s: float
    files: int
    image_bytes: int
    resident_pct: float

    @property
    def digest(self) -> str:
        return self.mounted.digest

    @property
    def mountpoint(self) -> Path:
        return self.mounted.mountpoint

    def residency_pct(self) -> float:
        """The image's share in the page cache now (``mincore`` over its files; reads nothing)."""
        return pagecache.residency(self.mountpoint).pct

    def as_report(self) -> dict[str, Any]:
        return {
            "mounted": True,
            "source": str(self.source),
            "digest": self.digest,
            "image_bytes": self.image_bytes,
            "files": self.files,
            "built": self.built,
            "build_s": round(self.build_s, 3),
            "mount_s": round(self.mount_s, 3),
            "warm_s": round(self.warm_s, 3),
            "resident_pct_at_mount": round(self.resident_pct, 2),
        }


def make_source(dest: Path, packages: tuple[str, ...] = IMAGE_PACKAGES) -> Path:
    """A rootfs source directory: `packages` as installed here, under ``dest/site-packages/`` (their own
    ``__pycache__`` left out: the build compiles the image's ``.pyc``)."""
    site = dest / "site-packages"
    site.mkdir(parents=True)
    for name in packages:
        mod = importlib.import_module(name)
        where = Path(mod.__file__ or "").parent
        shutil.copytree(where, site / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest


def new_rootfs_dir() -> Path:
    """A rootfs directory for this run, traversable by the engine user (0711) and listable only by root."""
    path = Path(tempfile.mkdtemp(prefix="pulsescale-demo-rootfs-"))
    os.chmod(path, 0o711)
    return path


def mount_image(source: Path, rootfs_dir: Path) -> MountedImage:
    """Build `source` into an image (or find it built), loop-mount it read-only and warm its pages. Blocking.
    Raises `rootfs.BadImage` (an unusable source) or `rootfs.RootfsUnavailable` (it cannot be mounted here)."""
    with rootfs.host_lock(rootfs_dir):
        t0 = time.perf_counter()
        image = rootfs.build(source, rootfs_dir)
        t1 = time.perf_counter()
        mounted = rootfs.mount(image, rootfs_dir)
        t2 = time.perf_counter()
    pagecache.warm(mounted.mountpoint)
    res = pagecache.residency(mounted.mountpoint)
    t3 = time.perf_counter()
    return MountedImage(
        source=source,
        rootfs_dir=rootfs_dir,
        mounted=mounted,
        built=image.built,
        build_s=t1 - t0,
        mount_s=t2 - t1,
        warm_s=t3 - t2,
        files=res.files,
        image_bytes=image.path.stat().st_size,
        resident_pct=res.pct,
    )


def release(rootfs_dir: Path) -> list[str]:
    """Unmount every image mounted under `rootfs_dir` and detach the loop devices left on its images (what
    ``pulsescale agent --cleanup`` does), then remove the directory. What was done, one line each."""
    done = [f"{what}: {how}" for what, how in rootfs.cleanup(rootfs_dir)]
    if not rootfs.ours(rootfs_dir) and not rootfs.loops_backed_by(rootfs_dir / "images"):
        shutil.rmtree(rootfs_dir, ignore_errors=True)
    else:
        done.append(f"{rootfs_dir}: kept, something is still mounted or attached")
    return done


@dataclass
class Keeper:
    """Keeps a mounted image in the page cache: `pin` locks its pages in (as root), and `check` measures it and
    reads it in again below `min_pct` (what an eviction left, where the lock was refused)."""

    image: MountedImage
    min_pct: float = MIN_RESIDENT_PCT
    checks: int = 0
    rewarms: int = 0
    """Checks that found the image below `min_pct` and read it in again."""
    lowest_pct: float = 100.0
    """The lowest residency a check found (before its re-warm)."""
    pinned: pagecache.Pinned | None = None

    def pin(self) -> pagecache.Pinned:
        """Lock the image's files in memory (`pagecache.pin`): with re-checks every second alone, 97 % of it was
        resident at a pulse's start in one CI run, whose kernel pages out cold file pages on its own. Blocking."""
        if self.pinned is None:
            self.pinned = pagecache.pin(self.image.mountpoint)
        return self.pinned

    def release(self) -> None:
        """Unlock the image (before it is unmounted: the mappings hold its files open)."""
        if self.pinned is not None:
            self.pinned.release()

    def check(self) -> float:
        """The residency found (before any re-warm). Blocking."""
        pct = self.image.residency_pct()
        self.checks += 1
        self.lowest_pct = min(self.lowest_pct, pct)
        if pct < self.min_pct:
            self.rewarms += 1
            pagecache.warm(self.image.mountpoint)
        return pct

    def as_report(self) -> dict[str, Any]:
        return {
            "keep_resident_checks": self.checks,
            "rewarms": self.rewarms,
            "lowest_resident_pct": round(self.lowest_pct, 2),
            "min_resident_pct": self.min_pct,
            "pinned_bytes": self.pinned.bytes if self.pinned is not None else 0,
            "pin_refused": self.pinned.refused if self.pinned is not None else "not pinned",
        }
