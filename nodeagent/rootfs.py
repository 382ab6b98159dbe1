"""The EROFS rootfs: an engine's Python and site-packages as one read-only image, built once, loop-mounted, kept in
the page cache.

``--image SRC`` names a directory or an image tarball (``docker save`` layout: ``manifest.json`` + layer tars; OCI
layout: ``index.json`` + ``blobs/``). `build` turns it into ``<rootfs_dir>/images/<sha256>.erofs``:

- a directory is copied to a staging directory; a tarball's layers are flattened into one, in order, with the
  whiteouts applied (``.wh.NAME`` deletes NAME of the layers below, ``.wh..wh..opq`` empties its directory of
  them: `nodeagent.imagetar`). erofs-utils 1.5 (what Debian/Ubuntu ship) has no ``--tar``, and flattening
  ourselves is what lets the ``.pyc`` files be compiled into the image either way;
- ``python -m compileall --invalidation-mode unchecked-hash`` on the staging copy, with the agent's interpreter:
  hash-based ``.pyc`` files are used without comparing the source's mtime, so the fixed timestamps below do not
  invalidate them and nothing is recompiled at import (the image is read-only: it could not be cached anyway).
  Files for another Python version in the image are compiled by that version at import, every time (said in
  `Image.note`);
- ``mkfs.erofs -T0 -U<fixed>``: uncompressed (pages map 1:1, no decompression on the activation path),
  reproducible (the same tree gives the same bytes), so the name is the content digest of the image file.

A source is fingerprinted by a stat walk (paths, modes, sizes, mtimes; for a tarball its own stat), and the
fingerprint maps to the digest in ``<rootfs_dir>/sources/``: an unchanged source is not rebuilt, not even re-read.

`mount` loop-mounts an image read-only (``ro,nodev,nosuid``; ``-o loop`` auto-clears the loop device at unmount)
at ``<rootfs_dir>/mnt/<sha256>``, or finds it already mounted there (``/proc/self/mountinfo``: an agent restart
reuses its mounts, and `nodeagent.rootfsstage.RootfsStage.mounts_reused` counts it). `cleanup` (``pulsescale
agent --cleanup``) unmounts every image of ours and detaches any loop device left on one. The agent's state of
all this (the mount in use, its residency and lock) is `nodeagent.rootfsstage`.

Permissions: ``images/``, ``sources/`` and staging are root's, 0700. ``mnt/`` is 0711: root-owned, so nobody else
can plant a mount or a link in it, but traversable, because engines run as ``--engine-user`` (nobody) and must
reach their image; the image's own permissions apply inside (`build` keeps a tarball's owners and makes a
directory's files root's).

How an engine runs "with the rootfs" (`Rootfs.engine_env`, `Rootfs.expand`): the image is a Python prefix
(``lib/python3.X/site-packages``, ``usr/local/...``, ``site-packages/``, ``bin/``...). The engine's environment puts
the image's ``bin`` directories first on ``PATH`` and its site-packages (for the engine's Python version) on
``PYTHONPATH``; ``{rootfs}`` in a command's arguments becomes the mountpoint. A full distribution rootfs run under
``chroot`` (with /proc, /dev and /dev/shm bound in) is not done here.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from nodeagent.imagetar import BadImage, SourceKind, flatten, source_kind
from warmpool.errors import PulsescaleError

__all__ = [
    "BadImage",
    "Image",
    "Mount",
    "Rootfs",
    "RootfsUnavailable",
    "SourceKind",
    "build",
    "cleanup",
    "flatten",
    "host_lock",
    "mount",
    "mounts",
    "probe",
    "source_kind",
    "unmount",
]

log = logging.getLogger("pulsescale.agent")

IMAGE_UUID = "00000000-0000-0000-0000-000000000000"
"""Fixed filesystem UUID: with ``-T0`` it makes an image a function of its tree, so its digest names it."""
MKFS_TIMEOUT_S = 3600.0
"""A 20 GB tree builds in minutes; an hour is a hung tool, not a big image."""
COMPILE_TIMEOUT_S = 3600.0
"""compileall of a large site-packages (vLLM and torch: ~40k files) takes minutes on two cores."""
MOUNT_TIMEOUT_S = 60.0
COMPILE_FLAGS = ("--invalidation-mode", "unchecked-hash")
"""Hash-based .pyc used without checking the source: the image is immutable, and its mtimes are all 0."""
PYTHON_PREFIXES = ("", "usr", "usr/local", "opt/venv", "venv", "opt/conda")
"""Where an image may keep a Python prefix (``<prefix>/lib/python3.X/site-packages``, ``<prefix>/bin``)."""


class RootfsUnavailable(PulsescaleError):
    """The rootfs stage cannot run on this node (no root, no erofs-utils, no kernel EROFS); slots run without it."""

    code = "rootfs_unavailable"


# --- capability -------------------------------------------------------------------------------------------------------


def probe(*, load_module: bool = True) -> str | None:
    """Why the rootfs stage cannot run here, or None when it can: root (a loop mount needs CAP_SYS_ADMIN),
    ``mkfs.erofs`` (erofs-utils) and the kernel's EROFS (``/proc/filesystems``, after ``modprobe erofs``)."""
    if os.geteuid() != 0:
        return "not root: loop-mounting an image needs CAP_SYS_ADMIN (run the agent as root, or without --image)"
    if shutil.which("mkfs.erofs") is None:
        return "mkfs.erofs not found: install erofs-utils (apt-get install erofs-utils)"
    if not _kernel_has_erofs():
        why = "not in /proc/filesystems"
        if load_module and shutil.which("modprobe") is not None:
            r = subprocess.run(["modprobe", "erofs"], capture_output=True, text=True, timeout=30, check=False)
            if _kernel_has_erofs():
                return None
            why += f"; modprobe erofs: {(r.stderr or r.stdout).strip() or f'exit {r.returncode}'}"
        return f"the kernel has no EROFS support ({why}): use a kernel >= 5.4 with CONFIG_EROFS_FS"
    return None


def _kernel_has_erofs() -> bool:
    try:
        text = Path("/proc/filesystems").read_text()
    except OSError:
        return False
    return any(line.split()[-1:] == ["erofs"] for line in text.splitlines())


# --- build ------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Image:
    """A built image: ``<rootfs_dir>/images/<hex>.erofs``."""

    source: str
    digest: str
    """``sha256:<hex>`` of the image file."""
    path: Path
    built: bool
    """False when an unchanged source's image was found already built."""
    note: str | None = None
    """What a person should know (``.pyc`` for another Python version not precompiled, compile errors)."""

    @property
    def hex(self) -> str:
        return self.digest.removeprefix("sha256:")


def _private_dir(path: Path, mode: int = 0o700) -> Path:
    """`path` as a root-owned directory of `mode`, refusing a link or someone else's directory."""
    path.mkdir(parents=True, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise RootfsUnavailable(
            f"{path} is not a directory owned by uid {os.geteuid()}: remove it or pick another --rootfs-dir"
        )
    if stat.S_IMODE(st.st_mode) != mode:
        os.chmod(path, mode)
    return path


def fingerprint(source: Path) -> str:
    """A cheap identity of the source: its tree's names, modes, sizes and mtimes (a tarball: its own stat). A
    change to any file changes it; the image is rebuilt then."""
    h = hashlib.sha256()
    st = os.stat(source)
    h.update(f"{source.resolve()}\0{st.st_mode}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}\0".encode())
    h.update(f"python{sys.version_info.major}.{sys.version_info.minor}\0".encode())  # the .pyc we compile
    if stat.S_ISDIR(st.st_mode):
        for dirpath, dirnames, filenames in os.walk(source):
            dirnames.sort()
            for name in sorted(filenames + dirnames):
                p = os.path.join(dirpath, name)
                with contextlib.suppress(OSError):
                    s = os.lstat(p)
                    link = os.readlink(p) if stat.S_ISLNK(s.st_mode) else ""
                    rel = os.path.relpath(p, source)
                    h.update(f"{rel}\0{s.st_mode}\0{s.st_size}\0{s.st_mtime_ns}\0{link}\0".encode())
    return h.hexdigest()


def build(source: Path, rootfs_dir: Path, *, python: str = sys.executable) -> Image:
    """The image for `source`, built now unless an unchanged source's image exists (`Image.built` says which)."""
    source = Path(source)
    kind = source_kind(source)
    images = _private_dir(rootfs_dir / "images")
    sources = _private_dir(rootfs_dir / "sources")
    fp = fingerprint(source)
    with contextlib.suppress(OSError, ValueError):
        known = (sources / fp).read_text().strip()
        if len(known) == 64 and (images / f"{known}.erofs").is_file():
            return Image(source=str(source), digest=f"sha256:{known}", path=images / f"{known}.erofs", built=False)
    staging = Path(tempfile.mkdtemp(prefix="build-", dir=_private_dir(rootfs_dir / "staging")))
    try:
        tree = staging / "tree"
        if kind == "dir":
            shutil.copytree(source, tree, symlinks=True)
        else:
            tree.mkdir()
            flatten(source, tree, kind)
        note = _compile(tree, python)
        tmp = staging / "image.erofs"
        cmd = ["mkfs.erofs", "--quiet", "-T0", f"-U{IMAGE_UUID}", *(["--all-root"] if kind == "dir" else [])]
        r = subprocess.run(
            [*cmd, str(tmp), str(tree)], capture_output=True, text=True, timeout=MKFS_TIMEOUT_S, check=False
        )
        if r.returncode != 0:
            raise BadImage(f"mkfs.erofs failed for {source} (exit {r.returncode}): {(r.stderr or r.stdout)[-800:]}")
        hexd = _sha256_file(tmp)
        final = images / f"{hexd}.erofs"
        os.chmod(tmp, 0o600)
        os.replace(tmp, final)
        (sources / fp).write_text(hexd + "\n")
        return Image(source=str(source), digest=f"sha256:{hexd}", path=final, built=True, note=note)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@contextlib.contextmanager
def host_lock(rootfs_dir: Path) -> Iterator[None]:
    """One process at a time builds and mounts in `rootfs_dir` (``flock`` on ``images/.lock``, root's, 0600).
    Agents of one host share the directory; two that start together both missed the image, both built it (the
    second file replaced the one the first mount's loop device reads) and the second then found "something else"
    mounted at the digest's mountpoint. Under the lock the second finds the image built and the mount in place."""
    fd = os.open(_private_dir(rootfs_dir / "images") / ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # released when fd closes, also when the process dies
        yield
    finally:
        os.close(fd)


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(4 << 20):
            h.update(chunk)
    return h.hexdigest()


def _compile(tree: Path, python: str) -> str | None:
    """Precompile the tree's ``.py`` files (hash-based, unchecked) with `python`; what a person should know."""
    r = subprocess.run(
        # -s/-p: the .pyc names the file as the image has it (/site-packages/...), not the random staging path,
        # so the image is reproducible (import fixes the name up to where the image is mounted).
        [python, "-m", "compileall", "-q", "-q", "-j0", *COMPILE_FLAGS, "-s", str(tree), "-p", "/", str(tree)],
        capture_output=True,  # never logged: a compile error quotes the file, and the file is the image's
        timeout=COMPILE_TIMEOUT_S,
        check=False,
    )
    notes = []
    if r.returncode != 0:
        notes.append("some .py files did not compile (they are compiled at import, and not cached)")
    ours = f"python{sys.version_info.major}.{sys.version_info.minor}"
    others = sorted({p.name for prefix in PYTHON_PREFIXES for p in (tree / prefix / "lib").glob("python3.*")} - {ours})
    if others:
        notes.append(f".pyc precompiled for {ours} only; the image's {', '.join(others)} compiles at import")
    return "; ".join(notes) or None


# --- mount ------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mount:
    """A line of ``/proc/self/mountinfo``."""

    mountpoint: Path
    fstype: str
    source: str
    """The device (``/dev/loop3``)."""
    options: str


def mounts() -> list[Mount]:
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        f, r = left.split(), right.split()
        if len(f) < 6 or len(r) < 2:
            continue
        out.append(Mount(mountpoint=Path(_unescape(f[4])), fstype=r[0], source=_unescape(r[1]), options=f[5]))
    return out


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal (``\\040``)."""
    if "\\" not in field:
        return field
    return field.encode().decode("unicode_escape").encode("latin-1").decode(errors="replace")


def backing_file(device: str) -> str | None:
    """The file behind a loop device (``/sys/block/loopN/loop/backing_file``), or None."""
    name = Path(device).name
    try:
        return Path(f"/sys/block/{name}/loop/backing_file").read_text().strip()
    except OSError:
        return None


def loop_read_sectors(device: str) -> int:
    """Sectors read from the block device so far (``/sys/block/<dev>/stat``, field 3)."""
    return int(Path(f"/sys/block/{Path(device).name}/stat").read_text().split()[2])


@dataclass(frozen=True)
class Rootfs:
    """A mounted image, and what an engine needs to run from it."""

    image: Image
    mountpoint: Path
    device: str
    """The loop device (``/dev/loopN``)."""
    reused: bool
    """Found already mounted (an agent restart), not mounted now."""

    @property
    def digest(self) -> str:
        return self.image.digest

    def bin_dirs(self) -> list[str]:
        return [
            str(d)
            for prefix in ("usr/local", "usr", "", "opt/venv", "venv", "opt/conda")
            if (d := self.mountpoint / prefix / "bin").is_dir()
        ]

    def site_packages(self, version: tuple[int, int] | None = None) -> list[str]:
        """The image's site-packages for Python `version` (the agent's by default), most specific first;
        ``site-packages/`` at the image's top too."""
        major, minor = version or (sys.version_info.major, sys.version_info.minor)
        found = []
        for prefix in PYTHON_PREFIXES:
            base = self.mountpoint / prefix
            for sub in (f"lib/python{major}.{minor}/site-packages", f"lib/python{major}/dist-packages"):
                if (base / sub).is_dir():
                    found.append(str(base / sub))
        if (self.mountpoint / "site-packages").is_dir():
            found.append(str(self.mountpoint / "site-packages"))
        return found

    def engine_env(self, base: Mapping[str, str], version: tuple[int, int] | None = None) -> dict[str, str]:
        """`base` with the image's ``bin`` directories first on ``PATH``, its site-packages first on
        ``PYTHONPATH``, ``PULSESCALE_ROOTFS`` set to the mountpoint and no ``.pyc`` written (read-only)."""
        env = dict(base)
        env["PATH"] = os.pathsep.join([*self.bin_dirs(), *filter(None, [base.get("PATH")])]) or os.defpath
        pythonpath = [*self.site_packages(version), *filter(None, [base.get("PYTHONPATH")])]
        if pythonpath:
            env["PYTHONPATH"] = os.pathsep.join(pythonpath)
        env["PULSESCALE_ROOTFS"] = str(self.mountpoint)
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        return env

    def engine_env_extra(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """What `engine_env` changes in `base` (the agent's environment by default): the ``env`` of a standby
        server's spec (`served.ServerSpec.env`), added to what it inherits."""
        base = os.environ if base is None else base
        return {k: v for k, v in self.engine_env(base).items() if base.get(k) != v}

    def expand(self, argv: list[str]) -> list[str]:
        """``{rootfs}`` in a command's arguments becomes the mountpoint."""
        return [a.replace("{rootfs}", str(self.mountpoint)) for a in argv]


def mountpoint_for(rootfs_dir: Path, image: Image) -> Path:
    return rootfs_dir / "mnt" / image.hex


def mount(image: Image, rootfs_dir: Path) -> Rootfs:
    """Loop-mount `image` read-only at ``<rootfs_dir>/mnt/<hex>``, or reuse it if it is mounted there already."""
    _private_dir(rootfs_dir / "mnt", 0o711)
    where = mountpoint_for(rootfs_dir, image)
    for m in mounts():
        if m.mountpoint == where:
            if m.fstype == "erofs" and backing_file(m.source) == str(image.path):
                return Rootfs(image=image, mountpoint=where, device=m.source, reused=True)
            raise RootfsUnavailable(
                f"{where} has something else mounted ({m.fstype} from {m.source}): "
                "run `pulsescale agent --cleanup` (or umount it)"
            )
    where.mkdir(mode=0o755, exist_ok=True)
    r = subprocess.run(
        ["mount", "-t", "erofs", "-o", "ro,loop,nodev,nosuid", str(image.path), str(where)],
        capture_output=True,
        text=True,
        timeout=MOUNT_TIMEOUT_S,
        check=False,
    )
    if r.returncode != 0:
        with contextlib.suppress(OSError):
            where.rmdir()
        raise RootfsUnavailable(f"cannot mount {image.path} at {where}: {(r.stderr or r.stdout).strip()}")
    hit = next((m for m in mounts() if m.mountpoint == where), None)
    if hit is None:
        raise RootfsUnavailable(f"mounted {image.path} at {where} but /proc/self/mountinfo does not show it")
    return Rootfs(image=image, mountpoint=where, device=hit.source, reused=False)


def unmount(where: Path, *, lazy_if_busy: bool = True) -> str:
    """Unmount `where` and detach its loop device; returns how (``unmounted``, ``lazy``: still in use, detached
    when its last user exits, or ``not mounted``)."""
    hit = next((m for m in mounts() if m.mountpoint == Path(where)), None)
    if hit is None:
        return "not mounted"
    how = "unmounted"
    r = subprocess.run(["umount", str(where)], capture_output=True, text=True, timeout=MOUNT_TIMEOUT_S, check=False)
    if r.returncode != 0:
        if not lazy_if_busy:
            raise RootfsUnavailable(f"cannot unmount {where}: {(r.stderr or r.stdout).strip()}")
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=MOUNT_TIMEOUT_S, check=False)
        how = "lazy"
    if how == "unmounted":
        _detach(hit.source)  # `-o loop` auto-clears; a device set up another way is detached here
        with contextlib.suppress(OSError):
            Path(where).rmdir()
    return how


def _detach(device: str) -> None:
    if device.startswith("/dev/loop") and backing_file(device) is not None:
        subprocess.run(["losetup", "-d", device], capture_output=True, timeout=MOUNT_TIMEOUT_S, check=False)


def loops_backed_by(images_dir: Path) -> list[str]:
    """Loop devices whose backing file is one of our images."""
    out = []
    prefix = str(images_dir).rstrip("/") + "/"
    for d in sorted(Path("/sys/block").glob("loop*")):
        with contextlib.suppress(OSError):
            if (d / "loop" / "backing_file").read_text().strip().startswith(prefix):
                out.append(f"/dev/{d.name}")
    return out


def ours(rootfs_dir: Path) -> list[Mount]:
    base = rootfs_dir / "mnt"
    return [m for m in mounts() if m.mountpoint.parent == base and m.fstype == "erofs"]


LEFT: Final = ("busy", "lazy", "still attached")
"""`cleanup` outcomes that leave something in place (or in use until its last user exits)."""


def cleanup(rootfs_dir: Path, *, lazy_if_busy: bool = True) -> list[tuple[str, str]]:
    """Unmount every image of ours and detach the loop devices left on them (``pulsescale agent --cleanup``);
    (what, outcome) for each, as found afterwards: ``unmounted``; ``lazy`` (still in use: gone from the tree, the
    mount and its loop device go when the last user exits); ``busy`` (in use and, without `lazy_if_busy`, left
    mounted); ``detached``; ``still attached`` (a loop device in use)."""
    done: list[tuple[str, str]] = []
    for m in ours(rootfs_dir):
        try:
            how = unmount(m.mountpoint, lazy_if_busy=lazy_if_busy)
        except RootfsUnavailable:
            how = "busy"
        done.append((f"{m.mountpoint} ({m.source})", how))
    if any(how == "busy" for _, how in done):
        return done  # its loop device serves the mount left in place
    for dev in loops_backed_by(rootfs_dir / "images"):
        _detach(dev)
        done.append((dev, "detached" if backing_file(dev) is None else "still attached"))
    return done
