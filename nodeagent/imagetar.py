"""Image sources of the EROFS rootfs (`nodeagent.rootfs`): what ``--image`` names (`source_kind`: a directory, a
``docker save`` tarball or an OCI-layout tarball), and a tarball's layers flattened into one tree (`flatten`).

A ``docker save`` tarball lists its layers in ``manifest.json``; an OCI layout in ``index.json``, through at most a
few nested indexes (the linux manifest for this machine's architecture is picked) down to one image manifest whose
``layers`` are blobs. The layers are applied bottom first, each with its whiteouts (``.wh.NAME`` deletes NAME of the
layers below, ``.wh..wh..opq`` empties its directory of them) before its own files. Every member passes tarfile's
``tar`` filter, and whiteouts (which tarfile does not see) are refused when they climb out of the tree or pass
through a link; device nodes and FIFOs are skipped. Anything unusable is a `BadImage`.
"""

from __future__ import annotations

import contextlib
import json
import platform
import shutil
import tarfile
from pathlib import Path
from typing import IO, Literal

from warmpool.errors import PulsescaleError

__all__ = ["BadImage", "SourceKind", "flatten", "source_kind"]

SourceKind = Literal["dir", "docker", "oci"]


class BadImage(PulsescaleError):
    """The image source is unusable: not a directory or image tarball, a broken manifest, an unsafe member."""

    code = "bad_image"


def source_kind(source: Path) -> SourceKind:
    """What ``--image`` `source` is: a directory, a ``docker save`` tarball or an OCI-layout tarball."""
    if source.is_dir():
        return "dir"
    if not source.is_file():
        raise BadImage(f"--image {source}: no such directory or file")
    try:
        with tarfile.open(source, "r:*") as tar:
            names = set()
            for m in tar:
                names.add(m.name.removeprefix("./"))
                if "manifest.json" in names:
                    return "docker"
            if "index.json" in names:
                return "oci"
    except (tarfile.TarError, OSError) as err:
        raise BadImage(f"--image {source}: not a directory and not a readable tarball ({err})") from None
    raise BadImage(f"--image {source}: a tarball without manifest.json (docker save) or index.json (OCI layout)")


def _layers(outer: tarfile.TarFile, kind: SourceKind) -> list[str]:
    """The layer members of a ``docker save`` or OCI-layout tarball, bottom first."""

    def read_json(name: str) -> object:
        for candidate in (name, f"./{name}"):
            with contextlib.suppress(KeyError):
                f = outer.extractfile(candidate)
                if f is not None:
                    return json.loads(f.read())
        raise BadImage(f"{name} missing from the image tarball")

    try:
        if kind == "docker":
            manifest = read_json("manifest.json")
            if not isinstance(manifest, list) or not manifest or not isinstance(manifest[0], dict):
                raise BadImage("manifest.json: expected a list of images")
            return [str(x) for x in manifest[0].get("Layers", [])]
        doc = read_json("index.json")
        for _ in range(4):  # an index may point to a platform index; follow it down to one image manifest
            if not isinstance(doc, dict):
                raise BadImage("OCI layout: an index or manifest is not an object")
            if "layers" in doc:
                return [_blob(str(x["digest"])) for x in doc["layers"]]
            chosen = _pick_manifest(doc.get("manifests") or [])
            doc = read_json(_blob(str(chosen["digest"])))
        raise BadImage("OCI layout: indexes nested too deep")
    except (KeyError, TypeError, ValueError) as err:
        raise BadImage(f"image tarball: malformed manifest ({err})") from None


def _blob(digest: str) -> str:
    algo, _, hexd = digest.partition(":")
    if algo != "sha256" or not hexd.isalnum():
        raise BadImage(f"OCI layout: unsupported blob digest {digest!r}")
    return f"blobs/sha256/{hexd}"


def _pick_manifest(manifests: list[dict[str, object]]) -> dict[str, object]:
    if not manifests:
        raise BadImage("OCI layout: the index lists no manifest")
    arch = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())
    for m in manifests:
        plat = m.get("platform")
        if isinstance(plat, dict) and plat.get("os") == "linux" and plat.get("architecture") == arch:
            return m
    return manifests[0]


def flatten(source: Path, dest: Path, kind: SourceKind) -> int:
    """Extract the image tarball's layers into `dest`, bottom first, whiteouts applied; the layers flattened."""
    with tarfile.open(source, "r:*") as outer:
        layers = _layers(outer, kind)
        for name in layers:
            f = _member_file(outer, name)
            with f, tarfile.open(fileobj=f, mode="r:*") as layer:
                _apply_layer(layer, dest)
    return len(layers)


def _member_file(outer: tarfile.TarFile, name: str) -> IO[bytes]:
    for candidate in (name, f"./{name}"):
        with contextlib.suppress(KeyError):
            f = outer.extractfile(candidate)
            if f is not None:
                return f
    raise BadImage(f"image tarball: layer {name} missing")


def _apply_layer(layer: tarfile.TarFile, dest: Path) -> None:
    """One layer over the tree below it: its whiteouts first (they hide the layers below, never this one), then
    its files, each replacing what was there (a file never written through a link of a lower layer)."""
    members = layer.getmembers()
    keep: list[tarfile.TarInfo] = []
    for m in members:
        path = Path(m.name.lstrip("/"))
        if path.name == ".wh..wh..opq":
            _empty(dest, path.parent)
        elif path.name.startswith(".wh."):
            _remove(dest, path.parent / path.name.removeprefix(".wh."))
        elif m.isdev() or m.isfifo():
            continue  # an engine's rootfs needs no device nodes; /dev is not ours to ship
        else:
            keep.append(m)
    for m in keep:
        path = Path(m.name.lstrip("/"))
        if not (m.isdir() and (dest / path).is_dir() and not (dest / path).is_symlink()):
            with contextlib.suppress(BadImage):  # under a lower layer's link: tarfile's filter judges it below
                _remove(dest, path)
        try:
            layer.extract(m, dest, set_attrs=True, numeric_owner=True, filter="tar")
        except tarfile.FilterError as err:
            raise BadImage(f"image layer member {m.name!r} refused: {err}") from None


def _inside(dest: Path, rel: Path) -> Path:
    """`dest/rel`, refused if `rel` climbs out (``..``) or passes through a link (whiteouts are not filtered by
    tarfile, so they are checked here)."""
    if rel.is_absolute() or ".." in rel.parts:
        raise BadImage(f"image layer path {str(rel)!r} leaves the image")
    cur = dest
    for part in rel.parts[:-1]:
        cur = cur / part
        if cur.is_symlink():
            raise BadImage(f"image layer path {str(rel)!r} passes through the link {part!r}")
    return dest / rel


def _remove(dest: Path, rel: Path) -> None:
    if not rel.parts:
        return
    target = _inside(dest, rel)
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        target.unlink()
    elif target.is_dir():
        shutil.rmtree(target)


def _empty(dest: Path, rel: Path) -> None:
    target = _inside(dest, rel) if rel.parts else dest
    if target.is_dir() and not target.is_symlink():
        for child in target.iterdir():
            _remove(dest, rel / child.name)
