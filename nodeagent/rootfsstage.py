"""The node agent's rootfs stage: the prewarm builds (or finds) the `--image`, mounts (or reuses) it, warms its
pages and locks them in memory (`nodeagent.rootfs` does each step; this keeps the agent's state of them: the mount
in use, its residency and lock, the counters its status reports)."""

from __future__ import annotations

import logging
import subprocess
import time
from pathlib import Path

from nodeagent import pagecache, rootfs
from nodeagent.rootfs import Rootfs
from warmpool.errors import PulsescaleError
from warmpool.protocol import RootfsStatus

__all__ = ["RootfsStage"]

log = logging.getLogger("pulsescale.agent")


class RootfsStage:
    """The prewarm's rootfs stage: build (or find) the image, mount (or reuse) it, warm its pages, and keep them
    warm: with `pin`, locked in memory (`pagecache.pin`), and re-checked before a slot is offered either way.
    Blocking: the agent runs it in a thread. Without the capability it says why once and does nothing."""

    def __init__(
        self, source: Path | None, rootfs_dir: Path, *, min_resident_pct: float = 99.0, pin: bool = False
    ) -> None:
        self.source = source
        self.rootfs_dir = rootfs_dir
        self.min_resident_pct = min_resident_pct
        self.pin = pin
        """Lock the mounted image's pages in memory (`AgentSettings.rootfs_pin`)."""
        self.pinned: pagecache.Pinned | None = None
        """The lock on the current image's files; released before that image is unmounted."""
        self._pinned_at: Path | None = None  # the mountpoint `pinned` maps
        self.rootfs: Rootfs | None = None
        self.reason: str | None = None
        self.resident_pct: float | None = None
        self.checked_at: float | None = None
        self.images_built = 0
        self.mounts_reused = 0
        """Mounts found in place at start (an agent restart), not mounted again."""
        self.rewarms = 0
        """Re-checks that found the image's pages below `min_resident_pct` and read them in again."""
        self._said: str | None = None

    @property
    def mounted(self) -> bool:
        return self.rootfs is not None

    @property
    def digest(self) -> str | None:
        return self.rootfs.digest if self.rootfs else None

    def record_fields(self) -> dict[str, object]:
        """What a slot record says about the rootfs its engine runs from."""
        return {"rootfs_mounted": self.mounted, "image_digest": self.digest}

    def status(self) -> RootfsStatus | None:
        if self.source is None:
            return None
        r = self.rootfs
        return RootfsStatus(
            source=str(self.source),
            digest=r.digest if r else None,
            image=str(r.image.path) if r else None,
            mountpoint=str(r.mountpoint) if r else None,
            mounted=r is not None,
            resident_pct=None if self.resident_pct is None else round(self.resident_pct, 2),
            reason=self.reason,
            images_built=self.images_built,
            mounts_reused=self.mounts_reused,
            rewarms=self.rewarms,
            pinned_bytes=self.pinned.bytes if self.pinned is not None else 0,
            pin_refused=self.pinned.refused if self.pinned is not None else None,
        )

    def _say(self, reason: str) -> None:
        self.reason = reason
        if self._said != reason:  # once per reason, however many prewarms run into it
            self._said = reason
            log.warning("rootfs %s: %s; slots run without it", self.source, reason)

    def prepare(self) -> RootfsStatus | None:
        """Build or find the image, mount or reuse it, warm it; unmount our other images (the pool shrank to
        this one: lazily where an engine still runs from one). Never raises: a failure is the status's reason."""
        if self.source is None:
            return None
        why = rootfs.probe()
        if why is not None:
            self._say(why)
            return self.status()
        try:
            with rootfs.host_lock(self.rootfs_dir):  # agents of one host share rootfs_dir: one builds, the rest reuse
                t0 = time.perf_counter()
                image = rootfs.build(self.source, self.rootfs_dir)
                if image.built:
                    self.images_built += 1
                    log.info("rootfs %s: built %s in %.1f s", self.source, image.digest, time.perf_counter() - t0)
                if image.note:
                    log.info("rootfs %s: %s", self.source, image.note)
                mounted = rootfs.mount(image, self.rootfs_dir)
        except (PulsescaleError, OSError, subprocess.SubprocessError) as err:
            self.rootfs = None
            self._say(str(err))
            return self.status()
        if mounted.reused and (self.rootfs is None or self.rootfs.digest != mounted.digest):
            self.mounts_reused += 1
            log.info("rootfs %s: %s already mounted at %s; reused", self.source, image.digest, mounted.mountpoint)
        self.rootfs, self.reason, self._said = mounted, None, None
        if self._pinned_at is not None and self._pinned_at != mounted.mountpoint:
            self.unpin()  # its mappings would hold the old image's files open past the unmount
        for m in rootfs.ours(self.rootfs_dir):
            if m.mountpoint != mounted.mountpoint:
                log.info(
                    "rootfs: unmounting %s, no longer this agent's image: %s",
                    m.mountpoint,
                    rootfs.unmount(m.mountpoint),
                )
        self.ensure_resident()
        if self.pin and self.pinned is None:
            self._pin(mounted)
        return self.status()

    def _pin(self, r: Rootfs) -> None:
        t0 = time.perf_counter()
        pinned = pagecache.pin(r.mountpoint)
        self.pinned, self._pinned_at = pinned, r.mountpoint
        took = time.perf_counter() - t0
        if pinned.refused is None:
            log.info("rootfs %s: %d files (%d bytes) locked in memory in %.2f s", r.digest, pinned.files,
                     pinned.bytes, took)  # fmt: skip
        else:
            # Once per image: the lock is not tried again until the image changes; the re-checks go on.
            log.warning("rootfs %s: locking it in memory stopped (%s); %d bytes locked, the rest is kept warm by "
                        "re-checks before each slot is offered (--no-pin-rootfs does not try)", r.digest,
                        pinned.refused, pinned.bytes)  # fmt: skip

    def unpin(self) -> None:
        """Unlock the image (idempotent): before it is unmounted, since the lock's mappings hold its files open."""
        if self.pinned is not None:
            self.pinned.release()
        self.pinned, self._pinned_at = None, None

    def ensure_resident(self) -> pagecache.Residency | None:
        """Measure the image's residency; re-warm when it is below `min_resident_pct` (what the prewarm does
        before a slot is offered)."""
        r = self.rootfs
        if r is None:
            return None
        res = pagecache.residency(r.mountpoint)
        if res.pct < self.min_resident_pct:
            if self.resident_pct is not None:
                self.rewarms += 1
                log.info(
                    "rootfs %s: %.1f %% resident, below %.0f %%; warming again",
                    r.digest,
                    res.pct,
                    self.min_resident_pct,
                )
            pagecache.warm(r.mountpoint)
            res = pagecache.residency(r.mountpoint)
        self.resident_pct, self.checked_at = res.pct, time.time()
        return res

    def unmount(self) -> None:
        """Give the image up (the pool shrank to no slot)."""
        self.unpin()
        if self.rootfs is not None:
            log.info("rootfs: unmounting %s: %s", self.rootfs.mountpoint, rootfs.unmount(self.rootfs.mountpoint))
            self.rootfs = None
