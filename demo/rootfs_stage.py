"""The rootfs stage as a run drives it (`demo.image` has its parts and says why): the image built and mounted once
before any agent starts, kept in the page cache while the load runs, measured at the pulse, checked against what the
agents say of it, and released after every process of the run is stopped.

What the stage finds goes into one dict, `DemoRootfs.report` (report.json's ``rootfs``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from nats.aio.client import Client

from demo import image as image_mod
from demo.errors import DemoError
from demo.settings import MODEL
from nodeagent import rootfs
from warmpool import protocol
from warmpool.registry import KvSlotStore

__all__ = ["DemoRootfs", "unmount_under"]

log = logging.getLogger("pulsescale.demo")


class DemoRootfs:
    """One image for the fleet (`prepare`), its page-cache keeper, and what the report says of both; `mode` is
    `DemoSettings.image`. `say` tells the run's view; `in_thread` runs a blocking step in a thread the run's clean-up
    waits for (`Demo._in_thread`)."""

    def __init__(
        self,
        mode: str,
        workdir: Path,
        say: Callable[[str], None],
        in_thread: Callable[[Callable[[], Any]], Awaitable[Any]],
    ) -> None:
        self.mode = mode
        self.workdir = workdir
        self.say = say
        self._in_thread = in_thread
        self.rootfs_dir: Path | None = None
        """This run's rootfs directory, once the stage mounts (or tries to): the clean-up releases it."""
        self.image: image_mod.MountedImage | None = None
        self.keeper: image_mod.Keeper | None = None
        self._keeper_stop = asyncio.Event()
        self._keeper_task: asyncio.Task[None] | None = None
        self.report: dict[str, Any] = {"mode": mode, "mounted": False}

    async def prepare(self) -> None:
        """The rootfs stage (`demo.image`): build and mount the image once, before any agent starts, or say once
        why the stage is skipped."""
        mode = self.mode
        if mode == image_mod.NONE:
            self.report["reason"] = "--image none"
            self.say("rootfs stage off (--image none): engines run from this machine's own files")
            return
        why = rootfs.probe()
        if why is not None:
            self.report["reason"] = why
            self.say(f"rootfs stage skipped: {why}; engines run from this machine's own files")
            return
        self.rootfs_dir = image_mod.new_rootfs_dir()
        rootfs_dir = self.rootfs_dir

        def prepare() -> image_mod.MountedImage:
            auto = mode == image_mod.AUTO
            source = image_mod.make_source(self.workdir / "image") if auto else Path(mode).resolve()
            return image_mod.mount_image(source, rootfs_dir)

        try:
            self.image = await self._in_thread(prepare)
        except (rootfs.BadImage, rootfs.RootfsUnavailable, OSError) as err:
            if mode != image_mod.AUTO:
                raise DemoError(str(err) if "--image" in str(err) else f"--image {mode}: {err}") from None
            self.report["reason"] = str(err)
            self.say(f"rootfs stage skipped: {err}")
            return
        img = self.image
        self.report.update(img.as_report())
        self.keeper = image_mod.Keeper(img)
        pinned = await self._in_thread(self.keeper.pin)  # cleanup waits for it, then `stop_keeper` unlocks
        self._keeper_task = asyncio.create_task(self._keep_resident(self.keeper))
        self.say(
            f"rootfs: {img.digest[:19]}... ({img.image_bytes / 1e6:.1f} MB, {img.files} files) "
            f"{'built' if img.built else 'found built'} in {img.build_s:.2f} s, loop-mounted read-only in "
            f"{img.mount_s * 1e3:.0f} ms, {img.resident_pct:.0f} % in the page cache, "
            + (f"locked there ({pinned.files} files)" if pinned.refused is None else f"not locked ({pinned.refused})")
            + "; every agent reuses this mount"
        )

    async def _keep_resident(self, keeper: image_mod.Keeper) -> None:
        """Re-check the image every `KEEP_RESIDENT_EVERY_S` until the run ends (`demo.image`, "Kept resident")."""
        while not self._keeper_stop.is_set():
            try:
                await asyncio.to_thread(keeper.check)
            except OSError as err:  # the image went away under us: said once, the run goes on without the check
                self.say(f"rootfs: cannot check the image's page-cache residency any more: {err}")
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._keeper_stop.wait(), image_mod.KEEP_RESIDENT_EVERY_S)

    async def stop_keeper(self) -> None:
        self._keeper_stop.set()
        if self._keeper_task is not None:
            with contextlib.suppress(BaseException):
                await self._keeper_task  # its thread holds the image's files open for a moment: not cancelled
        if self.keeper is not None:
            self.keeper.release()  # unlocked before the image is unmounted: its mappings hold the files open
            self.report.update(self.keeper.as_report())

    def measure(self, when: str, store: KvSlotStore | None) -> None:
        """The image's page-cache residency and the slots that run from it, at `when` (the pulse's start, its
        end): what keeps the host's disk quiet during the scale-out."""
        if self.image is None or store is None:
            return
        records = [r for r in store.records(MODEL) if r.state not in ("prewarming", "failed")]
        self.report[f"resident_pct_at_{when}"] = round(self.image.residency_pct(), 2)
        self.report[f"slots_at_{when}"] = len(records)
        self.report[f"slots_on_image_at_{when}"] = sum(
            1 for r in records if r.rootfs_mounted and r.image_digest == self.image.digest
        )

    async def ask_agents(self, nc: Client | None, nodes: list[tuple[str, int]]) -> None:
        """What the pool's agents say of the image (`AgentStatusReply.rootfs`): each should run from the demo's
        mount, having built nothing and reused the mount (one image, one mount, one loop device per host)."""
        if self.image is None:
            return
        assert nc is not None
        asked = mounted = built = reused = 0
        reasons: list[str] = []
        for node, _ in nodes:
            asked += 1
            req = protocol.AgentStatusRequest(id=secrets.token_hex(8), expires_at=time.time() + 30)
            try:
                msg = await nc.request(protocol.agent_subject(node, "status"), protocol.encode(req), timeout=2)
                st = protocol.decode(msg.data, protocol.AgentStatusReply).rootfs
            except Exception as err:  # noqa: BLE001 - a figure of the report, not a reason to stop the run
                reasons.append(f"{node}: no status ({type(err).__name__})")
                continue
            if st is None:
                continue
            if st.mounted and st.digest == self.image.digest:
                mounted += 1
            elif st.reason:
                reasons.append(f"{node}: {st.reason}")
            built += st.images_built
            reused += st.mounts_reused
        self.report["agents"] = {
            "asked": asked,
            "mounted": mounted,
            "images_built": built,
            "mounts_reused": reused,
            "reasons": reasons,
        }
        if mounted < asked:
            self.say(f"rootfs: {mounted} of {asked} agents run from the image: {'; '.join(reasons)}")

    async def release(self) -> None:
        """Unmount the image and detach its loop device (`demo.image.release`), then lazily unmount anything left
        under the rootfs directory; the run calls it after every process is stopped."""
        if self.rootfs_dir is not None:  # after every process is stopped: nothing holds the mount any more
            try:
                done = await asyncio.to_thread(image_mod.release, self.rootfs_dir)
                log.info("rootfs released: %s", done)
            except Exception as err:  # noqa: BLE001 - the last resort below still runs
                log.warning("rootfs clean-up of %s failed: %s", self.rootfs_dir, err)
            unmount_under(self.rootfs_dir)


def unmount_under(root: Path) -> None:
    """Last resort: lazily unmount anything still mounted under `root` (a rootfs the agent's cleanup missed)."""
    try:
        mounts = [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()]
    except OSError:
        return
    for mp in sorted((m for m in mounts if m.startswith(str(root) + "/")), key=len, reverse=True):
        subprocess.run(["umount", "-l", mp], check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
