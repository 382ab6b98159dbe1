"""`pulsescale bench rootfs`: how much of an idle rootfs image stays in the page cache, warm alone or locked.

Two images of the same size are built from generated files and mounted side by side, each by the agent's own stage
(`nodeagent.rootfsstage.RootfsStage`): one with ``--no-pin-rootfs`` (warmed, then left alone), one pinned (mmap +
mlock). Nothing reads either while the bench waits; every `--every` it prints the share of each image's pages in the
page cache (``mincore``, which reads nothing). A kernel that reclaims idle file pages on its own (DAMON ``pageout``),
or memory pressure, shows in the first column; the second is what the agent's default keeps. Both are unmounted and
their files removed at the end, also on Ctrl-C. Needs root, erofs-utils and kernel EROFS, like ``--image``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from nodeagent import pagecache, rootfs
from nodeagent.rootfsstage import RootfsStage
from warmpool import durations
from warmpool.sizes import parse_size

__all__ = ["bench"]


def bench(argv: list[str], prog: str) -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="64MiB", help="bytes of each image's files (64MiB, 1GB) [64MiB]")
    p.add_argument("--for", dest="for_s", type=durations.duration_arg(), default=210.0, help="how long [210s]")
    p.add_argument("--every", dest="every_s", type=durations.duration_arg(), default=30.0, help="[30s]")
    p.add_argument("--dir", default="/var/tmp", help="parent of the bench's directory (on disk, not tmpfs) [/var/tmp]")
    args = p.parse_args(argv)
    try:
        size = parse_size(args.size)
    except ValueError as err:
        p.error(f"--size: {err}")
    why = rootfs.probe()
    if why is not None:
        print(f"{prog}: cannot mount an EROFS image here: {why}", file=sys.stderr)
        return 1
    base = Path(tempfile.mkdtemp(prefix="pulsescale-bench-rootfs-", dir=args.dir))
    stages: dict[str, RootfsStage] = {}
    try:
        for name, pin in (("warm", False), ("pinned", True)):
            src = base / f"src-{name}"
            (src / "app").mkdir(parents=True)
            (src / "app" / "data.bin").write_bytes(os.urandom(size))
            (src / "app" / "name").write_text(name)  # two images, two digests
            stage = stages[name] = RootfsStage(src, base / f"rootfs-{name}", pin=pin)
            st = stage.prepare()
            if st is None or not st.mounted:
                print(f"{prog}: the {name} image did not mount: {st.reason if st else 'no source'}", file=sys.stderr)
                return 1
            locked = f", {st.pinned_bytes} bytes locked" if pin else ""
            refused = f" (lock refused: {st.pin_refused})" if st.pin_refused else ""
            print(f"{name} image: {st.resident_pct} % resident after the prewarm{locked}{refused}", flush=True)
        print(
            f"idle, {args.size} each; page-cache residency (mincore) every {durations.format_duration(args.every_s)}:"
        )
        t0 = time.monotonic()
        while True:
            cells = []
            for name, stage in stages.items():
                assert stage.rootfs is not None
                cells.append(f"{name} {pagecache.residency(stage.rootfs.mountpoint).pct:6.1f} %")
            print(f"  t={time.monotonic() - t0:5.0f} s   " + "   ".join(cells), flush=True)
            if time.monotonic() - t0 + args.every_s > args.for_s + 0.5:
                return 0
            time.sleep(args.every_s)
    except KeyboardInterrupt:
        return 130
    finally:
        for stage in stages.values():
            stage.unmount()
        for name in ("warm", "pinned"):
            rootfs.cleanup(base / f"rootfs-{name}")
        shutil.rmtree(base, ignore_errors=True)
