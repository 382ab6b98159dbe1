"""The EROFS rootfs (`nodeagent.rootfs`): real images built with mkfs.erofs from a directory and from image tarballs,
loop-mounted read-only, read through, warmed, reused after a restart, unmounted by ``pulsescale agent --cleanup``.

Needs root, erofs-utils and kernel EROFS (CI has all three); without them these tests skip, naming what is missing,
except the one that checks the stage says so. Every test's mounts and loop devices are removed even when it fails.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import secrets
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from nats.aio.client import Client

from nodeagent import pagecache, rootfs
from nodeagent.rootfsstage import RootfsStage
from tests.helpers import can_lock, without_ipc_lock
from tests.nodeagent_helpers import (
    activate,
    completion,
    deactivate,
    key,
    request,
    running_agent,
    settings,
    wait_for,
    wait_state,
)
from warmpool.embedded import NatsServer
from warmpool.registry import KvSlotStore

REASON = rootfs.probe()
IMAGE_LOCK_BYTES = 4 << 20
"""What locking `app_dir`'s image takes at most (its 2 MiB data file and a few small files, page-rounded)."""
LOCK_REFUSED = "no CAP_IPC_LOCK and RLIMIT_MEMLOCK under 4 MiB: locking the image would be refused"
F = TypeVar("F", bound=Any)


def needs_erofs(test: F) -> F:
    """Marked `root`; skipped, with what is missing, where the rootfs stage cannot run."""
    return pytest.mark.root(pytest.mark.skipif(REASON is not None, reason=f"EROFS rootfs: {REASON}")(test))


SERVER = """\
import json, sys
import mymod
print(json.dumps({"answer": mymod.answer(), "mymod": mymod.__file__, "cached": mymod.__cached__}))
"""
MYMOD = "def answer():\n    return 42\n"


def _force_clean(rootfs_dir: Path) -> None:
    """Whatever a failed test left: every mount under our dir (lazily), every loop device on our images."""
    for m in rootfs.mounts():
        if str(m.mountpoint).startswith(str(rootfs_dir) + "/"):
            subprocess.run(["umount", "-l", str(m.mountpoint)], capture_output=True, check=False)
    for dev in rootfs.loops_backed_by(rootfs_dir / "images"):
        subprocess.run(["losetup", "-d", dev], capture_output=True, check=False)


@pytest.fixture(name="rootfs_dir")
def rootfs_dir_fixture(tmp_path: Path) -> Iterator[Path]:
    d = tmp_path / "rootfs"
    try:
        yield d
    finally:
        _force_clean(d)


@pytest.fixture(name="app_dir")
def app_dir_fixture(tmp_path: Path) -> Path:
    """A Python prefix as an engine image holds one: a script, a package in site-packages, a 2 MiB data file."""
    src = tmp_path / "app"
    (src / "app").mkdir(parents=True)
    (src / "app" / "server.py").write_text(SERVER)
    pkg = src / "site-packages" / "mymod"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(MYMOD)
    (src / "app" / "data.bin").write_bytes(os.urandom(2 << 20))
    (src / "bin").mkdir()
    tool = src / "bin" / "hello-tool"
    tool.write_text("#!/bin/sh\necho hello from the image\n")
    tool.chmod(0o755)
    return src


def _tar_bytes(entries: list[tuple[str, bytes | None]], *, compress: bool = False) -> bytes:
    """A layer tar: (name, content) is a file, (name, None) a directory."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, content in entries:
            info = tarfile.TarInfo(name)
            info.mtime = 1_700_000_000
            if content is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            else:
                info.size, info.mode = len(content), 0o644
                tar.addfile(info, io.BytesIO(content))
    raw = buf.getvalue()
    return gzip.compress(raw, mtime=0) if compress else raw


LOWER = [
    ("etc/", None),
    ("etc/removed.conf", b"gone in the upper layer\n"),
    ("etc/kept.conf", b"kept\n"),
    ("opaque/", None),
    ("opaque/old.txt", b"hidden by an opaque whiteout\n"),
    ("site-packages/", None),
    ("site-packages/mymod/", None),
    ("site-packages/mymod/__init__.py", b"def answer():\n    return 1\n"),
]
UPPER = [
    ("etc/.wh.removed.conf", b""),
    ("opaque/", None),
    ("opaque/.wh..wh..opq", b""),
    ("opaque/new.txt", b"this layer's own file survives its opaque whiteout\n"),
    ("site-packages/mymod/__init__.py", MYMOD.encode()),
    ("app/", None),
    ("app/server.py", SERVER.encode()),
]


def _docker_save(path: Path) -> Path:
    """A ``docker save`` tarball: manifest.json and one directory per layer (the upper one gzipped, as pulled)."""
    lower, upper = _tar_bytes(LOWER), _tar_bytes(UPPER, compress=True)
    manifest = [{"Config": "config.json", "RepoTags": ["test:1"], "Layers": ["l1/layer.tar", "l2/layer.tar"]}]
    with tarfile.open(path, "w") as tar:
        for name, data in (
            ("manifest.json", json.dumps(manifest).encode()),
            ("config.json", b"{}"),
            ("l1/layer.tar", lower),
            ("l2/layer.tar", upper),
        ):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def _oci_layout(path: Path) -> Path:
    """An OCI image layout tarball: index.json -> manifest blob -> layer blobs."""
    blobs: dict[str, bytes] = {}

    def blob(data: bytes) -> str:
        d = hashlib.sha256(data).hexdigest()
        blobs[f"blobs/sha256/{d}"] = data
        return f"sha256:{d}"

    layers = [_tar_bytes(LOWER, compress=True), _tar_bytes(UPPER)]
    manifest = {"schemaVersion": 2, "config": {"digest": blob(b"{}")}, "layers": [{"digest": blob(x)} for x in layers]}
    index = {"schemaVersion": 2, "manifests": [{"digest": blob(json.dumps(manifest).encode())}]}
    with tarfile.open(path, "w") as tar:
        for name, data in [("oci-layout", b'{"imageLayoutVersion":"1.0.0"}'), *blobs.items()]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        info = tarfile.TarInfo("index.json")
        raw = json.dumps(index).encode()
        info.size = len(raw)
        tar.addfile(info, io.BytesIO(raw))
    return path


def _run_from(r: rootfs.Rootfs, *argv: str) -> subprocess.CompletedProcess[str]:
    """A Python process run with the rootfs as an engine is (`Rootfs.engine_env`), isolated from the user site."""
    env = r.engine_env({"PATH": os.environ.get("PATH", "")})
    return subprocess.run(
        [sys.executable, "-s", *r.expand(list(argv))], env=env, capture_output=True, text=True, timeout=60, check=True
    )


# --- building ---------------------------------------------------------------------------------------------------------


@needs_erofs
def test_image_from_a_directory_is_named_by_digest_mounted_read_only_and_read_through(
    app_dir: Path, rootfs_dir: Path
) -> None:
    image = rootfs.build(app_dir, rootfs_dir)
    assert image.built
    assert image.path == rootfs_dir / "images" / f"{image.hex}.erofs"
    assert image.digest == "sha256:" + hashlib.sha256(image.path.read_bytes()).hexdigest()
    assert (os.stat(rootfs_dir / "images").st_mode & 0o777) == 0o700

    r = rootfs.mount(image, rootfs_dir)
    assert not r.reused
    m = next(m for m in rootfs.mounts() if m.mountpoint == r.mountpoint)
    assert m.fstype == "erofs" and m.source == r.device and r.device.startswith("/dev/loop")
    assert m.options.split(",")[0] == "ro" and "nosuid" in m.options and "nodev" in m.options
    assert rootfs.backing_file(r.device) == str(image.path)
    assert (os.stat(rootfs_dir / "mnt").st_mode & 0o777) == 0o711  # engines (nobody) traverse, only root writes
    for rel in ("app/server.py", "app/data.bin", "site-packages/mymod/__init__.py"):
        assert (r.mountpoint / rel).read_bytes() == (app_dir / rel).read_bytes()
    with pytest.raises(OSError, match="Read-only file system"):
        (r.mountpoint / "app" / "new").write_text("x")

    # The .pyc is in the image, hash-based: imported from the image without compiling anything.
    tag = sys.implementation.cache_tag
    pyc = r.mountpoint / "site-packages" / "mymod" / "__pycache__" / f"__init__.{tag}.pyc"
    assert pyc.is_file()
    assert int.from_bytes(pyc.read_bytes()[4:8], "little") == 0b01  # flags: hash-based, unchecked
    out = json.loads(_run_from(r, "{rootfs}/app/server.py").stdout)
    assert out == {
        "answer": 42,
        "mymod": str(r.mountpoint / "site-packages/mymod/__init__.py"),
        "cached": str(pyc),
    }
    assert subprocess.run(["hello-tool"], env=r.engine_env(os.environ), capture_output=True, text=True).stdout == (
        "hello from the image\n"
    )


@needs_erofs
def test_an_unchanged_source_is_not_rebuilt_and_a_rebuild_is_byte_identical(app_dir: Path, rootfs_dir: Path) -> None:
    first = rootfs.build(app_dir, rootfs_dir)
    again = rootfs.build(app_dir, rootfs_dir)
    assert (again.built, again.digest) == (False, first.digest)
    for f in (rootfs_dir / "sources").iterdir():
        f.unlink()  # forget the fingerprint: mkfs runs again, and -T0 plus the fixed UUID give the same bytes
    rebuilt = rootfs.build(app_dir, rootfs_dir)
    assert (rebuilt.built, rebuilt.digest) == (True, first.digest)
    (app_dir / "app" / "server.py").write_text(SERVER + "# changed\n")
    changed = rootfs.build(app_dir, rootfs_dir)
    assert changed.built and changed.digest != first.digest


@needs_erofs
@pytest.mark.parametrize("layout", ["docker", "oci"])
def test_image_from_a_tarball_flattens_layers_with_whiteouts(layout: str, tmp_path: Path, rootfs_dir: Path) -> None:
    src = _docker_save(tmp_path / "img.tar") if layout == "docker" else _oci_layout(tmp_path / "img.tar")
    assert rootfs.source_kind(src) == layout
    image = rootfs.build(src, rootfs_dir)
    r = rootfs.mount(image, rootfs_dir)
    mnt = r.mountpoint
    assert not (mnt / "etc" / "removed.conf").exists()  # .wh.removed.conf
    assert (mnt / "etc" / "kept.conf").read_text() == "kept\n"
    assert sorted(p.name for p in (mnt / "opaque").iterdir()) == ["new.txt"]  # .wh..wh..opq, own file kept
    assert not list(mnt.rglob(".wh.*"))
    assert json.loads(_run_from(r, "{rootfs}/app/server.py").stdout)["answer"] == 42  # the upper layer's module
    assert (mnt / "site-packages/mymod/__pycache__" / f"__init__.{sys.implementation.cache_tag}.pyc").is_file()


@needs_erofs
@pytest.mark.parametrize(
    "evil",
    [
        [("../escape.txt", b"x")],
        [("etc/", None), ("etc/.wh...", b"")],
        [("link", None)],  # replaced below by a symlink to / and a file through it
    ],
    ids=["dotdot", "whiteout-dotdot", "through-absolute-link"],
)
def test_a_layer_that_escapes_the_image_is_refused(
    evil: list[tuple[str, bytes | None]], tmp_path: Path, rootfs_dir: Path
) -> None:
    if evil == [("link", None)]:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            ln = tarfile.TarInfo("link")
            ln.type, ln.linkname = tarfile.SYMTYPE, str(tmp_path)
            tar.addfile(ln)
            f = tarfile.TarInfo("link/planted.txt")
            f.size = 1
            tar.addfile(f, io.BytesIO(b"x"))
        layer = buf.getvalue()
    else:
        layer = _tar_bytes(evil)
    src = tmp_path / "evil.tar"
    with tarfile.open(src, "w") as tar:
        for name, data in (
            ("manifest.json", json.dumps([{"Layers": ["l/layer.tar"]}]).encode()),
            ("l/layer.tar", layer),
        ):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with pytest.raises(rootfs.BadImage):
        rootfs.build(src, rootfs_dir)
    assert not (tmp_path / "planted.txt").exists()
    assert not (rootfs_dir / "escape.txt").exists()
    assert not list((rootfs_dir / "staging").iterdir())  # the staging copy is gone


def test_a_source_that_is_no_image_is_refused_by_name(tmp_path: Path) -> None:
    (tmp_path / "plain.txt").write_text("not a tarball")
    with pytest.raises(rootfs.BadImage, match="not a readable tarball"):
        rootfs.source_kind(tmp_path / "plain.txt")
    with pytest.raises(rootfs.BadImage, match="no such directory or file"):
        rootfs.source_kind(tmp_path / "missing")


# --- page cache and the block device ----------------------------------------------------------------------------------


@needs_erofs
def test_after_warming_reading_the_engines_files_reads_nothing_from_the_block_device(
    app_dir: Path, rootfs_dir: Path
) -> None:
    """The article's "0 IOPS": the loop device's read sectors do not move while the engine's files are read and
    its module imported; the control (pages dropped) shows the counter does see reads."""
    stage = RootfsStage(app_dir, rootfs_dir)
    st = stage.prepare()
    assert st is not None and st.mounted and st.reason is None
    assert st.resident_pct is not None and st.resident_pct >= 99.0
    r = stage.rootfs
    assert r is not None
    before = rootfs.loop_read_sectors(r.device)
    for f in pagecache.files_under(r.mountpoint):
        f.read_bytes()
    assert json.loads(_run_from(r, "{rootfs}/app/server.py").stdout)["answer"] == 42
    assert rootfs.loop_read_sectors(r.device) == before

    pagecache.drop(r.mountpoint)
    for f in pagecache.files_under(r.mountpoint):
        f.read_bytes()
    assert rootfs.loop_read_sectors(r.device) > before  # the measurement sees device reads when there are some


@needs_erofs
def test_a_recheck_rewarms_an_image_whose_pages_were_dropped(app_dir: Path, rootfs_dir: Path) -> None:
    stage = RootfsStage(app_dir, rootfs_dir)
    stage.prepare()
    assert stage.rootfs is not None and stage.resident_pct is not None and stage.resident_pct >= 99.0
    assert stage.rewarms == 0
    pagecache.drop(stage.rootfs.mountpoint)
    assert pagecache.residency(stage.rootfs.mountpoint).pct < 50
    res = stage.ensure_resident()
    assert res is not None and res.pct >= 99.0
    assert stage.rewarms == 1
    assert pagecache.residency(stage.rootfs.mountpoint).pct >= 99.0
    stage.ensure_resident()  # resident: nothing to do
    assert stage.rewarms == 1


def _mapped_under(where: Path) -> bool:
    """This process maps a file under `where` (a pin's mappings, /proc/self/maps)."""
    prefix = f"{where}/"
    return any(line.split(maxsplit=5)[-1].startswith(prefix) for line in _maps() if len(line.split()) == 6)


def _maps() -> list[str]:
    return Path("/proc/self/maps").read_text().splitlines()


@needs_erofs
def test_a_pinned_image_stays_resident_through_a_drop_and_is_unlocked_before_it_is_unmounted(
    app_dir: Path, rootfs_dir: Path
) -> None:
    if not can_lock(IMAGE_LOCK_BYTES):
        pytest.skip(LOCK_REFUSED)
    stage = RootfsStage(app_dir, rootfs_dir, pin=True)
    try:
        st = stage.prepare()
        assert stage.rootfs is not None and st is not None
        old = stage.rootfs
        mnt = old.mountpoint
        image_bytes = sum(p.stat().st_size for p in pagecache.files_under(mnt))
        assert st.pinned_bytes == image_bytes > 2 << 20 and st.pin_refused is None
        assert _mapped_under(mnt)
        pagecache.drop(mnt)  # what memory pressure or the kernel's proactive reclaim does to a warm image
        assert pagecache.residency(mnt).pct == 100.0
        stage.ensure_resident()
        assert stage.rewarms == 0

        # A new image: the old one's lock goes first, so its unmount is not left lazy and its loop device goes.
        (app_dir / "app" / "server.py").write_text(SERVER + "# v2\n")
        st = stage.prepare()
        assert stage.rootfs is not None and stage.rootfs.mountpoint != mnt and st is not None
        assert not _mapped_under(mnt) and not mnt.is_mount()
        assert rootfs.backing_file(old.device) != str(old.image.path)
        assert st.pinned_bytes > 2 << 20 and _mapped_under(stage.rootfs.mountpoint)

        new = stage.rootfs.mountpoint
        stage.unmount()  # the pool shrank to no slot
        assert not _mapped_under(new) and rootfs.ours(rootfs_dir) == []
        st = stage.status()
        assert st is not None and st.pinned_bytes == 0
    finally:
        stage.unpin()


@needs_erofs
def test_a_stage_without_ipc_lock_says_why_the_image_is_not_locked_and_keeps_it_warm(
    app_dir: Path, rootfs_dir: Path
) -> None:
    code = (
        "import json, resource, sys; from pathlib import Path; from nodeagent.rootfsstage import RootfsStage\n"
        "resource.setrlimit(resource.RLIMIT_MEMLOCK, (0, 0))\n"
        "st = RootfsStage(Path(sys.argv[1]), Path(sys.argv[2]), pin=True).prepare()\n"
        "print(json.dumps([st.mounted, st.resident_pct, st.pinned_bytes, st.pin_refused]))\n"
    )
    argv = without_ipc_lock([sys.executable, "-c", code, str(app_dir), str(rootfs_dir)])
    if argv is None:
        pytest.skip("CAP_IPC_LOCK held and no setpriv (util-linux) to drop it for the child")
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr
    mounted, pct, pinned, refused = json.loads(done.stdout)
    assert mounted and pct >= 99.0 and pinned == 0
    assert refused.startswith("mlock of ") and "not permitted" in refused
    assert "locking it in memory stopped" in done.stderr and "--no-pin-rootfs" in done.stderr


# --- restart, pool shrink, cleanup ------------------------------------------------------------------------------------


@needs_erofs
def test_a_restarted_stage_reuses_the_mount_and_builds_nothing(app_dir: Path, rootfs_dir: Path) -> None:
    first = RootfsStage(app_dir, rootfs_dir)
    first.prepare()
    assert first.rootfs is not None and not first.rootfs.reused and first.images_built == 1
    again = RootfsStage(app_dir, rootfs_dir)  # what an agent restart makes
    st = again.prepare()
    assert again.rootfs is not None and again.rootfs.reused
    assert (again.mounts_reused, again.images_built) == (1, 0)
    assert again.rootfs.device == first.rootfs.device
    assert st is not None and st.digest == first.digest and st.mounted
    assert sum(1 for m in rootfs.mounts() if m.mountpoint == again.rootfs.mountpoint) == 1  # not mounted twice


@needs_erofs
def test_a_new_image_unmounts_the_old_one_and_its_loop_device(app_dir: Path, rootfs_dir: Path) -> None:
    stage = RootfsStage(app_dir, rootfs_dir)
    stage.prepare()
    old = stage.rootfs
    assert old is not None
    (app_dir / "app" / "server.py").write_text(SERVER + "# v2\n")
    stage.prepare()
    assert stage.rootfs is not None and stage.digest != old.digest
    assert [m.mountpoint for m in rootfs.ours(rootfs_dir)] == [stage.rootfs.mountpoint]
    assert rootfs.backing_file(old.device) != str(old.image.path)  # the old loop device was detached


@needs_erofs
def test_cleanup_cli_unmounts_our_images_and_leaves_no_loop_device(
    app_dir: Path, tmp_path: Path, rootfs_dir: Path
) -> None:
    RootfsStage(app_dir, rootfs_dir).prepare()
    RootfsStage(_docker_save(tmp_path / "img.tar"), rootfs_dir / "other").prepare()
    assert len(rootfs.ours(rootfs_dir)) == 1
    out = _cleanup_cli(rootfs_dir)
    assert out.returncode == 0, out.stderr
    assert ": unmounted" in out.stdout and f"cleanup of {rootfs_dir}: 1 unmounted" in out.stdout, out.stdout
    assert rootfs.ours(rootfs_dir) == []
    losetup = subprocess.run(["losetup", "-a"], capture_output=True, text=True, check=True).stdout
    assert str(rootfs_dir / "images") not in losetup
    assert len(rootfs.ours(rootfs_dir / "other")) == 1  # another rootfs dir is not ours to clean
    assert str(rootfs_dir / "other" / "images") in losetup


@needs_erofs
def test_bench_rootfs_prints_both_images_residency_and_leaves_nothing_behind(tmp_path: Path) -> None:
    if not can_lock(IMAGE_LOCK_BYTES):
        pytest.skip(LOCK_REFUSED)
    argv = ["bench", "rootfs", "--size", "2MiB", "--for", "1s", "--every", "500ms", "--dir", str(tmp_path)]
    out = subprocess.run([sys.executable, "-m", "pulsescale", *argv], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "warm image: 100.0 % resident" in out.stdout and "pinned image: 100.0 % resident" in out.stdout, out.stdout
    assert "bytes locked" in out.stdout and "lock refused" not in out.stdout, out.stdout
    rows = [line for line in out.stdout.splitlines() if line.strip().startswith("t=")]
    assert len(rows) >= 2 and all("warm" in r and "pinned  100.0 %" in r for r in rows), out.stdout
    assert list(tmp_path.iterdir()) == []  # its images unmounted, its directory gone
    assert str(tmp_path) not in Path("/proc/self/mountinfo").read_text()


def _cleanup_cli(rootfs_dir: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "pulsescale", "agent", "--cleanup", "--rootfs-dir", str(rootfs_dir), *flags]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)


@needs_erofs
def test_cleanup_leaves_an_image_in_use_mounted_and_says_so_unless_forced(app_dir: Path, rootfs_dir: Path) -> None:
    if not can_lock(IMAGE_LOCK_BYTES):
        pytest.skip(LOCK_REFUSED)
    stage = RootfsStage(app_dir, rootfs_dir, pin=True)  # in use, as a running agent's image is
    try:
        stage.prepare()
        assert stage.rootfs is not None
        mnt = stage.rootfs.mountpoint
        out = _cleanup_cli(rootfs_dir)
        assert out.returncode == 1 and f"{mnt} " in out.stdout and ": busy" in out.stdout, out
        assert "in use: stop the agent" in out.stderr and "--force" in out.stderr, out.stderr
        assert mnt.is_mount() and rootfs.loops_backed_by(rootfs_dir / "images")  # left as it was, serving
        assert (mnt / "app" / "server.py").read_text() == SERVER
        forced = _cleanup_cli(rootfs_dir, "--force")
        assert forced.returncode == 1 and ": lazy" in forced.stdout and "still in use" in forced.stderr, forced
        assert not mnt.is_mount()
    finally:
        stage.unpin()
    # Its last user gone, the kernel lets the lazily unmounted image and its loop device go.
    for _ in range(50):
        if not rootfs.loops_backed_by(rootfs_dir / "images"):
            break
        time.sleep(0.1)
    assert rootfs.loops_backed_by(rootfs_dir / "images") == []


# --- the agent ------------------------------------------------------------------------------------------------------


@needs_erofs
async def test_the_agent_mounts_the_image_records_it_on_its_slots_and_reuses_it_after_a_restart(
    nats_server: NatsServer,
    nc: Client,
    store: KvSlotStore,
    model_dir: Path,
    shm_dir: Path,
    app_dir: Path,
    rootfs_dir: Path,
) -> None:
    # Not pinned (--no-pin-rootfs): the re-checks alone keep it warm, which is what this test drops pages under.
    cfg = settings(
        model_dir, shm_dir, nats_server.url, slots=2, image_source=app_dir, rootfs_dir=rootfs_dir, rootfs_pin=False
    )
    async with running_agent(cfg) as (agent, _):
        for slot in ("s0", "s1"):
            rec = await wait_state(store, key(slot), "warm")
            assert rec.rootfs_mounted and rec.image_digest is not None and rec.image_digest.startswith("sha256:")
        stage = agent.prewarmer.rootfs
        assert stage.rootfs is not None and not stage.rootfs.reused and stage.images_built == 1
        digest, mnt = stage.digest, stage.rootfs.mountpoint
        st = agent.status().rootfs
        assert st is not None and st.mounted and st.digest == digest and st.mountpoint == str(mnt)
        assert st.resident_pct is not None and st.resident_pct >= 99.0
        assert st.reason is None and (st.pinned_bytes, st.pin_refused) == (0, None)

        # Pages evicted under it: a prewarm re-checks and warms them again before the slots are offered.
        pagecache.drop(mnt)
        assert pagecache.residency(mnt).pct < 50
        reply = await request(nc, "prewarm")
        assert reply.ok, reply.error
        await wait_for(lambda: not agent.prewarmer.running, 30, "the prewarm to finish")
        assert stage.rewarms == 1
        assert pagecache.residency(mnt).pct >= 99.0
        assert (await wait_state(store, key("s0"), "warm")).image_digest == digest

    assert [m.mountpoint for m in rootfs.ours(rootfs_dir)] == [mnt]  # a stop keeps the mount for the restart
    async with running_agent(cfg) as (agent, _):
        rec = await wait_state(store, key("s0"), "warm")
        stage = agent.prewarmer.rootfs
        assert rec.rootfs_mounted and rec.image_digest == digest
        assert stage.rootfs is not None and stage.rootfs.reused
        assert (stage.mounts_reused, stage.images_built) == (1, 0)  # counted, not timed
        st = agent.status().rootfs  # and said on the wire, where an SRE reads it
        assert st is not None and (st.mounts_reused, st.images_built, st.rewarms) == (1, 0, 0)
    assert len(rootfs.ours(rootfs_dir)) == 1


@needs_erofs
async def test_the_agent_locks_its_image_in_memory_says_so_and_unlocks_it_when_it_stops(
    nats_server: NatsServer,
    store: KvSlotStore,
    model_dir: Path,
    shm_dir: Path,
    app_dir: Path,
    rootfs_dir: Path,
) -> None:
    if not can_lock(IMAGE_LOCK_BYTES):
        pytest.skip(LOCK_REFUSED)
    cfg = settings(model_dir, shm_dir, nats_server.url, slots=1, image_source=app_dir, rootfs_dir=rootfs_dir)
    assert cfg.rootfs_pin  # the default
    async with running_agent(cfg) as (agent, _):
        await wait_state(store, key("s0"), "warm")
        stage = agent.prewarmer.rootfs
        assert stage.rootfs is not None
        mnt = stage.rootfs.mountpoint
        st = agent.status().rootfs
        assert st is not None and st.pinned_bytes > 2 << 20 and st.pin_refused is None
        assert _mapped_under(mnt)
        pagecache.drop(mnt)
        assert pagecache.residency(mnt).pct == 100.0
    assert not _mapped_under(mnt)  # unlocked at the stop ...
    assert [m.mountpoint for m in rootfs.ours(rootfs_dir)] == [mnt]  # ... and still mounted for the restart


SERVE = """\
import os, runpy, sys
import mymod  # from the image's site-packages (PYTHONPATH), not from the node
print("mymod", mymod.answer(), mymod.__file__, flush=True)
here = os.path.dirname(os.path.abspath(__file__))
sys.argv[0] = os.path.join(here, "openai_server_double.py")
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _proc(pid: int, what: str) -> list[bytes]:
    """A NUL-separated /proc/<pid> file (cmdline, environ), as the kernel has it."""
    return Path(f"/proc/{pid}/{what}").read_bytes().split(b"\0")


@pytest.fixture(name="open_rootfs_dir")
def open_rootfs_dir_fixture() -> Iterator[Path]:
    """A rootfs dir the engine user (nobody) can reach: tmp_path is under root's 0700 pytest directory."""
    d = Path(tempfile.mkdtemp(prefix="pulsescale-rootfs-test-", dir="/var/tmp"))
    os.chmod(d, 0o755)
    try:
        yield d
    finally:
        _force_clean(d)
        shutil.rmtree(d, ignore_errors=True)


@needs_erofs
async def test_a_command_engine_runs_its_script_and_packages_from_the_image(
    nats_server: NatsServer,
    nc: Client,
    store: KvSlotStore,
    model_dir: Path,
    shm_dir: Path,
    app_dir: Path,
    open_rootfs_dir: Path,
) -> None:
    from tests.autoscaler import test_command_engine as cmd_tests

    shutil.copy(cmd_tests.DOUBLE, app_dir / "app" / "openai_server_double.py")
    (app_dir / "app" / "serve.py").write_text(SERVE)
    marker = f"m{secrets.token_hex(4)}"
    argv = [cmd_tests._python(), "{rootfs}/app/serve.py", "--host", "{host}", "--port", "{port}", "--model", marker]
    cfg = settings(
        model_dir,
        shm_dir,
        nats_server.url,
        engine="command",
        engine_cmd=shlex.join(argv),
        image_source=app_dir,
        rootfs_dir=open_rootfs_dir,
    )
    async with cmd_tests.no_leftovers(marker), running_agent(cfg) as (agent, _):
        rec = await wait_state(store, key("s0"), "warm")
        stage = agent.prewarmer.rootfs
        assert stage.rootfs is not None
        mnt = stage.rootfs.mountpoint
        assert rec.rootfs_mounted and rec.image_digest == stage.digest and rec.engine == "command"
        engine = agent.slots["s0"].engine
        pid = getattr(engine, "pid", None)
        assert pid is not None
        cmdline = _proc(pid, "cmdline")
        assert cmdline[1] == str(mnt / "app/serve.py").encode()  # {rootfs} filled in
        environ = dict(kv.split(b"=", 1) for kv in _proc(pid, "environ") if b"=" in kv)
        assert environ[b"PYTHONPATH"].split(b":")[0] == str(mnt / "site-packages").encode()
        assert environ[b"PATH"].split(b":")[0] == str(mnt / "bin").encode()
        tail = agent.status().slots[0].log_tail
        assert f"mymod 42 {mnt}/site-packages/mymod/__init__.py" in tail, tail

        claim = await store.claim_slot(key("s0"))
        reply = await activate(nc, claim)
        assert reply.ok, reply.error
        out = await completion(reply.fields["endpoint"])
        assert out["choices"][0]["text"] == f" pid{pid}"  # type: ignore[index]
        assert (await deactivate(nc, claim)).ok


async def test_an_agent_that_cannot_mount_says_why_and_its_slots_still_serve(
    nats_server: NatsServer, store: KvSlotStore, model_dir: Path, shm_dir: Path, tmp_path: Path
) -> None:
    """A source that is no image stands for every reason the stage cannot run (no root, no erofs-utils, no
    kernel EROFS): the slots come up `warm` without a rootfs, the status says why."""
    bogus = tmp_path / "not-an-image.txt"
    bogus.write_text("no image here")
    cfg = settings(model_dir, shm_dir, nats_server.url, image_source=bogus, rootfs_dir=tmp_path / "rootfs")
    async with running_agent(cfg) as (agent, _):
        rec = await wait_state(store, key("s0"), "warm")
        assert not rec.rootfs_mounted and rec.image_digest is None
        st = agent.status().rootfs
        assert st is not None and not st.mounted and st.reason
        assert ("not a readable tarball" in st.reason) or (REASON is not None and REASON in st.reason)


# --- without the capability -------------------------------------------------------------------------------------------


def test_without_root_the_stage_says_why_once_and_mounts_nothing(app_dir: Path, tmp_path: Path) -> None:
    """Run as an unprivileged user (the process drops to nobody after its imports when the test runs as root: the
    interpreter lives under root's home): two prepares, one log line, a slot record without a rootfs."""
    script = f"""
import logging, os, sys
from pathlib import Path
from nodeagent.rootfsstage import RootfsStage
if os.geteuid() == 0:
    os.setgroups([]); os.setgid(65534); os.setuid(65534)
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
stage = RootfsStage(Path({str(app_dir)!r}), Path({str(tmp_path / "rfs")!r}))
a, b = stage.prepare(), stage.prepare()
print(a.mounted, b.mounted, stage.record_fields(), b.reason)
"""
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    mounted_a, mounted_b, *_ = out.stdout.split()
    assert (mounted_a, mounted_b) == ("False", "False")
    assert "{'rootfs_mounted': False, 'image_digest': None}" in out.stdout
    assert "not root" in out.stdout
    assert out.stderr.count("not root") == 1, out.stderr
    assert not (tmp_path / "rfs").exists()  # nothing built, nothing made


@needs_erofs
def test_agents_that_start_together_on_one_rootfs_dir_build_once_and_share_one_mount(
    app_dir: Path, rootfs_dir: Path
) -> None:
    """Agents of one host share --rootfs-dir. Three starting at once each missed the image, each built it (the
    last build's file replaced the one the first mount's loop device reads) and two of three then found "something
    else mounted" at the digest's mountpoint and ran without the image."""
    import threading

    stages = [RootfsStage(app_dir, rootfs_dir) for _ in range(3)]
    threads = [threading.Thread(target=s.prepare) for s in stages]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [s.reason for s in stages] == [None] * 3
    assert all(s.rootfs is not None for s in stages)
    assert sum(s.images_built for s in stages) == 1
    assert sum(s.mounts_reused for s in stages) == 2
    assert len({s.rootfs.device for s in stages if s.rootfs is not None}) == 1
    assert len(rootfs.ours(rootfs_dir)) == 1 and len(rootfs.loops_backed_by(rootfs_dir / "images")) == 1
