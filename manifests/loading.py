"""Reading ScaledObjects from YAML or JSON: a text's documents, a file, a directory (as ``kubectl apply -f``).

Part of the ScaledObject reader (`manifests.scaledobject` is its face and says what is checked): the strict loader
(a key twice is refused with its line), the nesting bound checked before PyYAML's recursive composer runs, every
loader failure made a located `ScaledObjectError`, ``kind: List`` items, documents of other APIs skipped and said,
one ScaledObject per ``<namespace>.<name>`` and per model (`check_models` against what ``pulse_scalers`` holds).
Each document goes through `manifests.conversion.from_manifest`. Pure apart from `load_path`, which reads files.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import yaml

from manifests.conversion import from_manifest
from manifests.terms import (
    API_VERSION,
    DEFAULT_MAX_REPLICAS,
    KIND,
    MANIFEST_SUFFIXES,
    MAX_DEPTH,
    MAX_TEXT_BYTES,
    ScaledObjectError,
)
from warmpool import protocol
from warmpool.protocol import ScalerRecord

__all__ = ["Manifest", "check_models", "load_documents", "load_path", "other_kind"]


@dataclass(frozen=True)
class Manifest:
    """One document of a file: where it came from and the record it becomes."""

    source: str
    index: int
    """1-based position of the document in its file (empty documents count, so it matches an editor's view)."""
    record: ScalerRecord
    item: int | None = None
    """0-based position in the document's ``items`` when the document is a ``kind: List``."""

    @property
    def where(self) -> str:
        return _where(self.source, self.index, self.item)


def _where(source: str, index: int, item: int | None) -> str:
    return f"{source} doc {index}" + ("" if item is None else f" items[{item}]")


# --- YAML ---------------------------------------------------------------------------------------------------------


class _StrictLoader(yaml.SafeLoader):  # type: ignore[misc]  # PyYAML ships no types
    """SafeLoader that refuses a mapping with the same key twice (PyYAML keeps the last one silently: a pasted
    ``maxReplicaCount`` below an old one would win unseen). Merge keys (``<<``) may still be overridden."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, yaml.Mark] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:
                continue  # an unhashable key: SafeLoader's own error says so
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping",
                    node.start_mark,
                    f"duplicate key {key!r} (first at line {first.line + 1}); YAML would keep only the last one: "
                    "remove one",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark
        mapping: dict[Any, Any] = super().construct_mapping(node, deep=deep)
        return mapping


class _TooDeep(Exception):
    def __init__(self, mark: yaml.Mark) -> None:
        super().__init__(mark)
        self.mark = mark


def _check_depth(text: str) -> None:
    """Raise `_TooDeep` at the first mapping or list nested deeper than `MAX_DEPTH`. PyYAML's parser is a loop
    (its events need no recursion), its composer and constructor recurse once per level: this runs first."""
    depth = 0
    for event in yaml.parse(text, Loader=_StrictLoader):
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_DEPTH:
                raise _TooDeep(event.start_mark)
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1


def _documents(text: str) -> list[Any]:
    _check_depth(text)
    return list(yaml.load_all(text, Loader=_StrictLoader))


def _parse(text: str, source: str) -> list[Any]:
    """`_documents`, every failure a `ScaledObjectError` located in `source` (never a traceback: the operator
    runs this on whatever a CR holds)."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_TEXT_BYTES:
        raise ScaledObjectError(
            "",
            f"{size} bytes: more than a ScaledObject file holds (at most {MAX_TEXT_BYTES}); wrong file?",
            where=source,
        )
    try:
        return _documents(text)
    except _TooDeep as err:
        at = f"line {err.mark.line + 1}, column {err.mark.column + 1}"
        raise ScaledObjectError(
            "", f"{at}: nested too deeply (more than {MAX_DEPTH} levels of mappings and lists)", where=source
        ) from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "YAML"
        problem = getattr(err, "problem", None) or str(err)
        raise ScaledObjectError("", f"{at}: {problem}", where=source) from None
    except RecursionError:
        raise ScaledObjectError("", "YAML: nested too deeply to read", where=source) from None
    except (ValueError, TypeError, OverflowError, MemoryError) as err:  # PyYAML's constructors (int, float, date)
        raise ScaledObjectError("", f"YAML: cannot be read ({type(err).__name__}: {err})", where=source) from None


_GROUP: Final = API_VERSION.partition("/")[0]


def other_kind(doc: Any) -> str | None:
    """``Kind namespace/name`` of a document of another API (not ours to write: kubectl applies it), or None for
    what is checked as a ScaledObject: kind ScaledObject of any apiVersion, any kind of the pulsescale.io group,
    and a document without a string kind and apiVersion (broken, not foreign)."""
    if not isinstance(doc, Mapping):
        return None
    kind, api = doc.get("kind"), doc.get("apiVersion")
    if not isinstance(kind, str) or not kind or kind in (KIND, "List") or not isinstance(api, str):
        return None
    if api.partition("/")[0] == _GROUP:
        return None
    meta = doc.get("metadata")
    meta = meta if isinstance(meta, Mapping) else {}
    name, namespace = meta.get("name"), meta.get("namespace")
    ident = "/".join(str(x) for x in (namespace, name) if isinstance(x, str) and x)
    return f"{kind} {ident}".rstrip()


def _skipped_text(skipped: Sequence[str]) -> str:
    return f" ({len(skipped)} document(s) of other kinds skipped)" if skipped else ""


def _is_list(doc: Any) -> bool:
    return isinstance(doc, Mapping) and doc.get("kind") == "List" and isinstance(doc.get("items"), list)


def load_documents(
    text: str,
    source: str,
    *,
    updated_at: float = 0.0,
    max_replicas: int = DEFAULT_MAX_REPLICAS,
    allow_empty: bool = False,
    skipped: list[str] | None = None,
) -> list[Manifest]:
    """Every ScaledObject in a (multi-document) YAML or JSON text; empty documents are skipped but counted; a
    ``kind: List`` document contributes its ``items``.

    Raises `ScaledObjectError` for the first bad document, located as ``<source> doc <n>`` (``... items[<i>]``),
    or for YAML that does not parse or repeats a key, located by line and column. Two documents with the same
    ``<namespace>.<name>`` are refused: the second would silently win. A text without any ScaledObject is refused
    unless `allow_empty`. Documents of other APIs (`other_kind`) are skipped, each appended to `skipped` as
    ``skipped <Kind> <namespace>/<name> (<source> doc <n>): not a ScaledObject (kubectl applies it)``.
    """
    here: list[str] = []
    out: list[Manifest] = []
    seen: dict[str, str] = {}
    models: dict[str, Manifest] = {}
    docs = _parse(text, source)
    for index, doc in enumerate(docs, start=1):
        if doc is None:
            continue
        entries = list(enumerate(doc["items"])) if _is_list(doc) else [(None, doc)]
        for item, body in entries:
            foreign = other_kind(body)
            if foreign is not None:
                here.append(
                    f"skipped {foreign} ({_where(source, index, item)}): not a ScaledObject (kubectl applies it)"
                )
                continue
            try:
                record = from_manifest(body, updated_at=updated_at, max_replicas=max_replicas)
            except ScaledObjectError as err:
                raise err.located(_where(source, index, item)) from None
            m = Manifest(source, index, record, item)
            if record.key in seen:
                raise ScaledObjectError(
                    "metadata.name", f"{record.key} is also defined by {seen[record.key]}", where=m.where
                )
            seen[record.key] = m.where.removeprefix(f"{source} ")
            _one_per_model(models, m)
            out.append(m)
    if skipped is not None:
        skipped += here
    if not out and not allow_empty:
        why = _skipped_text(here) if here else " (the file is empty)"
        raise ScaledObjectError("", f"no ScaledObject in it{why}", where=source)
    return out


_MODEL_FIELD: Final = "spec.triggers[0].metadata.model"


def _one_per_model(models: dict[str, Manifest], m: Manifest) -> None:
    """Record `m` as its model's ScaledObject in `models`; a second one of the model is refused naming the first
    (the autoscaler serves one ScaledObject per model and would drop the other, `daemon.apply_scaler`)."""
    model = m.record.spec.model
    first = models.setdefault(model, m)
    if first is not m and first.record.key != m.record.key:
        first_where = first.where.removeprefix(f"{m.source} ") if first.source == m.source else first.where
        raise ScaledObjectError(
            _MODEL_FIELD,
            f"{model} is also scaled by {first.record.key} ({first_where}); one ScaledObject per model: merge the "
            "two or give each its own model",
            where=m.where,
        )


def check_models(manifests: Sequence[Manifest], written: Iterable[ScalerRecord]) -> None:
    """Refuse (before anything is written) a manifest whose model is scaled by another ScaledObject already in
    `pulse_scalers` (`written`): the autoscaler serves the first and drops the second. A record that this same
    apply rewrites does not count, so one apply may move a model from one ScaledObject to another."""
    applying = {m.record.key for m in manifests}
    owners = {r.spec.model: r.key for r in written if r.key not in applying}
    for m in manifests:
        owner = owners.get(m.record.spec.model)
        if owner is None:
            continue
        namespace, _, name = owner.partition(".")
        raise ScaledObjectError(
            _MODEL_FIELD,
            f"{m.record.spec.model} is already scaled by {owner} in {protocol.SCALERS_BUCKET}; one ScaledObject per "
            f"model: delete {owner} first (pulsescale delete so {name} -n {namespace}), or change this one's model",
            where=m.where,
        )


def _files(path: Path, *, recursive: bool) -> list[Path]:
    if not path.is_dir():
        return [path]
    found = path.rglob("*") if recursive else path.iterdir()
    return sorted((f for f in found if f.is_file() and f.suffix in MANIFEST_SUFFIXES), key=lambda f: f.parts)


def load_path(
    path: str | os.PathLike[str],
    *,
    recursive: bool = False,
    updated_at: float = 0.0,
    max_replicas: int = DEFAULT_MAX_REPLICAS,
    skipped: list[str] | None = None,
) -> list[Manifest]:
    """The ScaledObjects of ``-f PATH`` as ``kubectl apply -f`` reads it: a file's documents, or a directory's
    `MANIFEST_SUFFIXES` files in name order (with `recursive`, its subdirectories' too), empty files skipped.

    Errors are `ScaledObjectError` located ``<file> doc <n>``; an unreadable file, a directory without any
    ScaledObject and one ``<namespace>.<name>`` in two files are refused. Documents of other APIs are skipped
    and said in `skipped` (`load_documents`).
    """
    here: list[str] = []
    root = Path(path)
    is_dir = root.is_dir()
    out: list[Manifest] = []
    first: dict[str, Manifest] = {}
    models: dict[str, Manifest] = {}
    for file in _files(root, recursive=recursive):
        try:
            if file.stat().st_size > MAX_TEXT_BYTES:  # refused before it is read into memory
                raise ScaledObjectError(
                    "",
                    f"{file.stat().st_size} bytes: more than a ScaledObject file holds (at most "
                    f"{MAX_TEXT_BYTES}); wrong file?",
                    where=str(file),
                )
            text = file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise ScaledObjectError("", f"cannot read it: {err}", where=str(file)) from None
        found = load_documents(
            text, str(file), updated_at=updated_at, max_replicas=max_replicas, allow_empty=is_dir, skipped=here
        )
        for m in found:
            seen = first.setdefault(m.record.key, m)
            if seen is not m:
                raise ScaledObjectError(
                    "metadata.name", f"{m.record.key} is also defined by {seen.where}", where=m.where
                )
            _one_per_model(models, m)
            out.append(m)
    if skipped is not None:
        skipped += here
    if not out:
        more = "" if recursive else " (add -R for its subdirectories)"
        raise ScaledObjectError(
            "",
            f"no ScaledObject in its {', '.join(MANIFEST_SUFFIXES)} files{more}{_skipped_text(here)}",
            where=str(root),
        )
    return out
