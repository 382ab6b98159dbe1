"""An HTTP double of the Kubernetes API server: protocol level, not a Kubernetes.

The operator tests run the real kopf and the real `kubernetes` client; the one thing they cannot have in a test
run is an API server, so this module speaks its HTTP protocol on 127.0.0.1 over a generic in-memory object store.
What it does, as the API server does:

- discovery: ``/version``, ``/api``, ``/apis``, ``/api/v1`` and ``/apis/<group>/<version>`` list `RESOURCES` with
  their verbs, kind, namespaced flag and subresources (kopf scans these to resolve its handlers' resources);
- per resource, namespaced (``/namespaces/<ns>/<plural>``) and cluster-wide (``/<plural>``) list and watch, and
  get, create (POST, ``generateName``, 409 AlreadyExists), replace (PUT; a stale ``resourceVersion`` is 409
  Conflict), patch (``merge-patch+json``; ``strategic-merge-patch+json`` is treated as a merge patch, which is what
  it is for maps; ``json-patch+json`` with ``test`` failing as 422, as kopf's finalizer patches expect) and delete
  (with finalizers: ``deletionTimestamp`` is set and the object goes when its finalizers are emptied);
- list filters: ``labelSelector`` (``a=b``, ``a==b``, ``a!=b``, ``a in (x,y)``, ``a notin (x)``, ``a``, ``!a``) and
  ``fieldSelector`` on dotted paths (``metadata.name=x``, ``spec.nodeName=n``, ``status.phase!=Failed``);
- watch (``?watch=true``): JSON lines ADDED/MODIFIED/DELETED replayed from the given ``resourceVersion`` (or the
  current objects as ADDED when none is given), BOOKMARK lines when ``allowWatchBookmarks`` is set, closed after
  ``timeoutSeconds``; a ``resourceVersion`` older than the kept history is answered with an ERROR 410 line;
- subresources: ``status`` (a write there changes only ``.status``; a write to the object ignores ``.status``
  for resources that have the subresource) and ``scale`` for deployments and statefulsets (GET/PUT/PATCH as an
  ``autoscaling/v1`` Scale that reads and writes the workload's ``spec.replicas``);
- with ``prune_with_crds``, custom resources lose the fields their CRD (deploy/crd/) does not declare, as the API
  server prunes them (off by default): a node with ``x-kubernetes-preserve-unknown-fields`` keeps its unknown
  fields (the ScaledObject's trigger metadata), its declared ones pruned by their schemas;
- one global, monotonic ``resourceVersion``; ``metadata.uid``, ``creationTimestamp`` and ``generation`` (bumped by
  a change of anything but metadata and status); errors are ``v1`` Status objects with ``reason`` and ``code``.

What it does not: authentication, authorization, admission, defaulting, validation against schemas, controllers
(no pods appear for a Deployment; nothing garbage-collects owned objects), field managers, server-side apply. The
tests that need one of those (RBAC) read `K8sApiDouble.requests` — every request as (method, path, query, user
agent, bearer token, verb, resource) — and check it against the deploy/ manifests instead.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import json
import re
import socket
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import pytest
import yaml
from aiohttp import web

__all__ = ["RESOURCES", "ApiRequest", "K8sApiDouble", "ResourceDef", "k8s_api"]

WATCH_HISTORY: Final = 10_000  # events kept for watches resuming from a resourceVersion; older ones get 410 Gone
DEFAULT_WATCH_TIMEOUT_S: Final = 300.0  # how long a watch stays open when the client gives no timeoutSeconds
BOOKMARK_EVERY_S: Final = 1.0  # how often an idle watch that allows bookmarks receives one


@dataclass(frozen=True)
class ResourceDef:
    group: str  # "" for the core group
    version: str
    kind: str
    plural: str
    namespaced: bool = True
    subresources: tuple[str, ...] = ()
    short_names: tuple[str, ...] = ()
    verbs: tuple[str, ...] = ("create", "delete", "get", "list", "patch", "update", "watch")

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def singular(self) -> str:
        return self.kind.lower()


RESOURCES: Final[tuple[ResourceDef, ...]] = (
    ResourceDef(
        "pulsescale.io", "v1alpha1", "ScaledObject", "scaledobjects", subresources=("status",), short_names=("pso",)
    ),
    ResourceDef("", "v1", "Pod", "pods", subresources=("status",)),
    ResourceDef("", "v1", "Event", "events"),
    ResourceDef("", "v1", "ConfigMap", "configmaps", short_names=("cm",)),
    ResourceDef("", "v1", "Namespace", "namespaces", namespaced=False, subresources=("status",)),
    ResourceDef("events.k8s.io", "v1", "Event", "events"),
    ResourceDef("apps", "v1", "Deployment", "deployments", subresources=("status", "scale"), short_names=("deploy",)),
    ResourceDef("apps", "v1", "StatefulSet", "statefulsets", subresources=("status", "scale"), short_names=("sts",)),
    ResourceDef(
        "autoscaling",
        "v2",
        "HorizontalPodAutoscaler",
        "horizontalpodautoscalers",
        subresources=("status",),
        short_names=("hpa",),
    ),
    ResourceDef("coordination.k8s.io", "v1", "Lease", "leases"),
)

Key = tuple[str, str, str]  # (group, plural, namespace or "") -> then name
Obj = dict[str, Any]


@dataclass(frozen=True)
class ApiRequest:
    """One request the double served, for RBAC and leader tests: who asked for what."""

    method: str
    path: str
    query: dict[str, str]
    user_agent: str
    token: str  # the bearer token, "" when none
    verb: str  # the RBAC verb: get list watch create update patch delete ("" for discovery)
    group: str
    resource: str  # plural
    subresource: str
    namespace: str
    name: str
    body: Any = None


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str, *, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code, self.reason, self.message, self.details = code, reason, message, details or {}

    def status(self) -> Obj:
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "details": self.details,
            "code": self.code,
        }


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _get_path(obj: Obj, dotted: str) -> Any:
    cur: Any = obj
    for part in dotted.split("."):
        if not isinstance(cur, dict):
            return None
        cur = cur.get(part)
    return cur


_SET_RE = re.compile(r"^\s*([^\s!=]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")


def _split_selector(selector: str) -> list[str]:
    """Splits at commas outside parentheses (``a in (x,y),b=c``)."""
    parts, depth, cur = [], 0, ""
    for ch in selector:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if cur.strip():
        parts.append(cur)
    return [p.strip() for p in parts if p.strip()]


def label_matcher(selector: str) -> Callable[[dict[str, str]], bool]:
    """A labelSelector as the API server reads it (equality- and set-based)."""
    tests: list[Callable[[dict[str, str]], bool]] = []
    for term in _split_selector(selector):
        if m := _SET_RE.match(term):
            key, op, values = m.group(1), m.group(2), {v.strip() for v in m.group(3).split(",") if v.strip()}
            if op == "in":
                tests.append(lambda lb, k=key, vs=values: lb.get(k) in vs)
            else:
                tests.append(lambda lb, k=key, vs=values: lb.get(k) not in vs)
        elif "!=" in term:
            key, value = (s.strip() for s in term.split("!=", 1))
            tests.append(lambda lb, k=key, v=value: lb.get(k) != v)
        elif "=" in term:
            key, value = (s.strip() for s in term.replace("==", "=").split("=", 1))
            tests.append(lambda lb, k=key, v=value: lb.get(k) == v)
        elif term.startswith("!"):
            absent = term[1:].strip()
            tests.append(lambda lb, k=absent: k not in lb)
        else:
            tests.append(lambda lb, k=term: k in lb)
    return lambda labels: all(t(labels) for t in tests)


def field_matcher(selector: str) -> Callable[[Obj], bool]:
    tests: list[Callable[[Obj], bool]] = []
    for term in _split_selector(selector):
        if "!=" in term:
            path, value = term.split("!=", 1)
            tests.append(lambda o, p=path, v=value: str(_get_path(o, p) or "") != v)
        else:
            path, value = term.replace("==", "=").split("=", 1)
            tests.append(lambda o, p=path, v=value: str(_get_path(o, p) or "") == v)
    return lambda obj: all(t(obj) for t in tests)


CRD_DIR: Final = Path(__file__).resolve().parent.parent / "deploy" / "crd"


def load_crd_schemas(directory: Path = CRD_DIR) -> dict[tuple[str, str], Obj]:
    """(group, plural) -> the openAPIV3Schema of the storage version, for every CRD in `directory`."""
    out: dict[tuple[str, str], Obj] = {}
    for path in sorted(directory.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc or doc.get("kind") != "CustomResourceDefinition":
                continue
            spec = doc["spec"]
            for version in spec["versions"]:
                if version.get("storage"):
                    out[(spec["group"], spec["names"]["plural"])] = version["schema"]["openAPIV3Schema"]
    return out


def prune(value: Any, schema: Obj) -> Any:
    """What the API server keeps of `value` under a structural schema: unknown object fields are dropped, unless
    ``x-kubernetes-preserve-unknown-fields`` (then they are kept, and the declared ones still pruned by their own
    schemas, as the API server does); ``additionalProperties`` and ``items`` apply to every entry."""
    keep_unknown = bool(schema.get("x-kubernetes-preserve-unknown-fields"))
    if isinstance(value, dict):
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        if props is None and not isinstance(extra, dict):
            return value if keep_unknown or schema.get("type") != "object" else {}
        out = {}
        for key, item in value.items():
            if props is not None and key in props:
                out[key] = prune(item, props[key])
            elif isinstance(extra, dict):
                out[key] = prune(item, extra)
            elif keep_unknown:
                out[key] = item
        return out
    if keep_unknown:
        return value
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [prune(item, schema["items"]) for item in value]
    return value


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: maps merge, null deletes, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    return [p.replace("~1", "/").replace("~0", "~") for p in path.lstrip("/").split("/")]


def json_patch(doc: Obj, ops: list[dict[str, Any]]) -> Obj:
    """RFC 6902 JSON patch (add, remove, replace, test, move, copy); a failed test or a bad path is 422."""
    doc = copy.deepcopy(doc)

    def parent(parts: list[str]) -> tuple[Any, str]:
        cur: Any = doc
        for p in parts[:-1]:
            cur = cur[int(p)] if isinstance(cur, list) else cur[p]
        return cur, parts[-1]

    def get(parts: list[str]) -> Any:
        cur: Any = doc
        for p in parts:
            cur = cur[int(p)] if isinstance(cur, list) else cur[p]
        return cur

    def add(parts: list[str], value: Any) -> None:
        container, last = parent(parts)
        if isinstance(container, list):
            container.insert(len(container) if last == "-" else int(last), value)
        else:
            container[last] = value

    def remove(parts: list[str]) -> Any:
        container, last = parent(parts)
        return container.pop(int(last)) if isinstance(container, list) else container.pop(last)

    for op in ops:
        try:
            parts, kind = _pointer(op["path"]), op["op"]
            if kind == "test":
                if get(parts) != op.get("value"):
                    raise ApiError(422, "Invalid", f"the test of {op['path']} failed")
            elif kind == "add":
                add(parts, copy.deepcopy(op["value"]))
            elif kind == "remove":
                remove(parts)
            elif kind == "replace":
                get(parts)  # must exist
                container, last = parent(parts)
                container[int(last) if isinstance(container, list) else last] = copy.deepcopy(op["value"])
            elif kind in ("move", "copy"):
                source = _pointer(op["from"])
                value = remove(source) if kind == "move" else copy.deepcopy(get(source))
                add(parts, value)
            else:
                raise ApiError(422, "Invalid", f"unknown json-patch op {kind!r}")
        except (KeyError, IndexError, ValueError, TypeError) as e:
            raise ApiError(422, "Invalid", f"json-patch {op!r} does not apply: {e!r}") from e
    return doc


@dataclass(eq=False)  # hashed by identity: kept in a set of open watches
class _Watch:
    resource: ResourceDef
    namespace: str  # "" = all namespaces
    matches: Callable[[Obj], bool]
    queue: asyncio.Queue[tuple[str, Obj] | None] = field(default_factory=asyncio.Queue)


class K8sApiDouble:
    """The store and the server. Direct helpers (`create`, `get`, `list`, `patch`, `delete`) go through the same
    code as HTTP requests, so watches see them; they do not appear in `requests` (that log is the clients')."""

    def __init__(self, resources: Iterable[ResourceDef] = RESOURCES, *, prune_with_crds: bool = False) -> None:
        """`prune_with_crds`: custom resources are pruned by their CRD's structural schema from deploy/crd/, as
        the API server drops fields a CRD does not declare (a status field missing from the schema is lost)."""
        self.resources = tuple(resources)
        self._schemas: dict[tuple[str, str], Obj] = load_crd_schemas() if prune_with_crds else {}
        self._objects: dict[Key, dict[str, Obj]] = {}
        self._rv = 0
        self._history: list[tuple[int, ResourceDef, str, Obj]] = []  # (rv, resource, type, object)
        self._watches: set[_Watch] = set()
        self.requests: list[ApiRequest] = []
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._changed = asyncio.Event()

    # --- lookup -------------------------------------------------------------------------------------------

    def resource(self, plural_or_kind: str, group: str | None = None) -> ResourceDef:
        for r in self.resources:
            if plural_or_kind in (r.plural, r.kind, r.singular) and (group is None or r.group == group):
                return r
        raise KeyError(f"the double serves no resource {plural_or_kind!r} (group {group!r})")

    def _key(self, r: ResourceDef, namespace: str) -> Key:
        return (r.group, r.plural, namespace if r.namespaced else "")

    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    def _emit(self, r: ResourceDef, kind: str, obj: Obj) -> None:
        rv = int(obj["metadata"]["resourceVersion"])
        self._history.append((rv, r, kind, copy.deepcopy(obj)))
        del self._history[:-WATCH_HISTORY]
        for w in list(self._watches):
            in_scope = not w.namespace or w.namespace == obj["metadata"].get("namespace")
            if w.resource == r and in_scope and w.matches(obj):
                w.queue.put_nowait((kind, copy.deepcopy(obj)))
        self._changed.set()
        self._changed = asyncio.Event()

    # --- store operations (shared by HTTP and the helpers) ---------------------------------------------------

    def get(self, r: ResourceDef | str, namespace: str, name: str) -> Obj:
        r = self.resource(r) if isinstance(r, str) else r
        obj = self._objects.get(self._key(r, namespace), {}).get(name)
        if obj is None:
            raise ApiError(
                404,
                "NotFound",
                f'{r.plural}{"." + r.group if r.group else ""} "{name}" not found',
                details={"name": name, "group": r.group, "kind": r.plural},
            )
        return copy.deepcopy(obj)

    def try_get(self, r: ResourceDef | str, namespace: str, name: str) -> Obj | None:
        try:
            return self.get(r, namespace, name)
        except ApiError:
            return None

    def list(
        self, r: ResourceDef | str, namespace: str = "", *, label_selector: str = "", field_selector: str = ""
    ) -> list[Obj]:
        r = self.resource(r) if isinstance(r, str) else r
        matches = self._matcher(label_selector, field_selector)
        out = []
        for (group, plural, ns), objs in self._objects.items():
            if (group, plural) == (r.group, r.plural) and (not namespace or not r.namespaced or ns == namespace):
                out.extend(copy.deepcopy(o) for o in objs.values() if matches(o))
        return sorted(out, key=lambda o: (o["metadata"].get("namespace", ""), o["metadata"]["name"]))

    @staticmethod
    def _matcher(label_selector: str, field_selector: str) -> Callable[[Obj], bool]:
        labels = label_matcher(label_selector)
        fields = field_matcher(field_selector)
        return lambda o: labels(o.get("metadata", {}).get("labels") or {}) and fields(o)

    def create(self, r: ResourceDef | str, namespace: str, body: Obj) -> Obj:
        r = self.resource(r) if isinstance(r, str) else r
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise ApiError(422, "Invalid", f"{r.kind}: metadata.name or metadata.generateName is required")
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        if r.namespaced:
            if not namespace:
                raise ApiError(400, "BadRequest", f"{r.kind} is namespaced: the request needs a namespace")
            if meta.get("namespace", namespace) != namespace:
                raise ApiError(400, "BadRequest", "the namespace of the object does not match the request's")
            meta["namespace"] = namespace
        store = self._objects.setdefault(self._key(r, namespace), {})
        if meta["name"] in store:
            raise ApiError(
                409,
                "AlreadyExists",
                f'{r.plural} "{meta["name"]}" already exists',
                details={"name": meta["name"], "group": r.group, "kind": r.plural},
            )
        obj["apiVersion"], obj["kind"] = r.api_version, r.kind
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=_now(), resourceVersion=self._next_rv(), generation=1)
        meta.pop("deletionTimestamp", None)
        if "status" in r.subresources and r.group == "pulsescale.io":
            obj.pop("status", None)  # as a CRD with the status subresource: create ignores .status
        obj = self._prune(r, obj)
        store[meta["name"]] = obj
        self._emit(r, "ADDED", obj)
        return copy.deepcopy(obj)

    def _write(self, r: ResourceDef, namespace: str, name: str, new: Obj, *, subresource: str = "") -> Obj:
        """Stores `new` as the next version of the object (already checked for existence and conflicts)."""
        old = self.get(r, namespace, name)
        if subresource == "status":
            result = copy.deepcopy(old)
            if "status" in new:
                result["status"] = new["status"]
            else:
                result.pop("status", None)
        else:
            result = copy.deepcopy(new)
            result["apiVersion"], result["kind"] = r.api_version, r.kind
            if "status" in r.subresources:
                if "status" in old:
                    result["status"] = old["status"]
                else:
                    result.pop("status", None)
            meta = result.setdefault("metadata", {})
            for fixed in ("uid", "creationTimestamp", "namespace", "name", "generation", "deletionTimestamp"):
                if fixed in old["metadata"]:
                    meta[fixed] = old["metadata"][fixed]
                else:
                    meta.pop(fixed, None)
            strip = lambda o: {k: v for k, v in o.items() if k not in ("metadata", "status")}  # noqa: E731
            if strip(result) != strip(old):
                meta["generation"] = old["metadata"].get("generation", 1) + 1
        result = self._prune(r, result)
        if result == {**old}:
            return old  # a no-op write changes nothing, not even the resourceVersion (as the API server)
        result["metadata"]["resourceVersion"] = self._next_rv()
        store = self._objects[self._key(r, namespace)]
        meta = result["metadata"]
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            del store[name]
            self._emit(r, "DELETED", result)
        else:
            store[name] = result
            self._emit(r, "MODIFIED", result)
        return copy.deepcopy(result)

    def replace(self, r: ResourceDef | str, namespace: str, name: str, body: Obj, *, subresource: str = "") -> Obj:
        r = self.resource(r) if isinstance(r, str) else r
        old = self.get(r, namespace, name)
        rv = (body.get("metadata") or {}).get("resourceVersion")
        if rv and rv != old["metadata"]["resourceVersion"]:
            raise ApiError(
                409,
                "Conflict",
                f'Operation cannot be fulfilled on {r.plural} "{name}": the object has '
                "been modified; please apply your changes to the latest version and try again",
                details={"name": name, "group": r.group, "kind": r.plural},
            )
        return self._write(r, namespace, name, body, subresource=subresource)

    def patch(
        self,
        r: ResourceDef | str,
        namespace: str,
        name: str,
        patch: Any,
        *,
        subresource: str = "",
        json_patch_ops: bool = False,
    ) -> Obj:
        r = self.resource(r) if isinstance(r, str) else r
        old = self.get(r, namespace, name)
        if json_patch_ops or isinstance(patch, list):
            new = json_patch(old, patch)
        else:
            new = merge_patch(old, patch)
            rv = (patch.get("metadata") or {}).get("resourceVersion") if isinstance(patch, dict) else None
            if rv and rv != old["metadata"]["resourceVersion"]:
                raise ApiError(
                    409,
                    "Conflict",
                    f'Operation cannot be fulfilled on {r.plural} "{name}": the object has been modified',
                    details={"name": name, "group": r.group, "kind": r.plural},
                )
        return self._write(r, namespace, name, new, subresource=subresource)

    def delete(self, r: ResourceDef | str, namespace: str, name: str) -> Obj:
        r = self.resource(r) if isinstance(r, str) else r
        old = self.get(r, namespace, name)
        if old["metadata"].get("finalizers"):
            if old["metadata"].get("deletionTimestamp"):
                return old
            old["metadata"]["deletionTimestamp"] = _now()
            old["metadata"]["resourceVersion"] = self._next_rv()
            self._objects[self._key(r, namespace)][name] = old
            self._emit(r, "MODIFIED", old)
            return copy.deepcopy(old)
        del self._objects[self._key(r, namespace)][name]
        old["metadata"]["resourceVersion"] = self._next_rv()
        self._emit(r, "DELETED", old)
        return old

    async def wait_for(self, predicate: Callable[[], Any], timeout_s: float = 10.0, what: str = "") -> Any:
        """Waits until `predicate()` is truthy (re-checked on every change of the store) and returns its value."""

        async def loop() -> Any:
            while True:
                changed = self._changed
                if value := predicate():
                    return value
                try:
                    await asyncio.wait_for(changed.wait(), 0.2)  # also polls: predicates may read other state
                except TimeoutError:
                    pass

        try:
            return await asyncio.wait_for(loop(), timeout_s)
        except TimeoutError:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what or predicate}") from None

    def prune_with_crds(self) -> None:
        """From now on, prune custom resources by their CRD in deploy/crd/ (see `__init__`)."""
        self._schemas = load_crd_schemas()

    def _prune(self, r: ResourceDef, obj: Obj) -> Obj:
        schema = self._schemas.get((r.group, r.plural))
        if schema is None:
            return obj
        kept = {k: obj[k] for k in ("apiVersion", "kind", "metadata") if k in obj}
        pruned = prune(obj, schema)
        return {**pruned, **kept}

    # --- scale subresource ------------------------------------------------------------------------------------

    def _scale_of(self, obj: Obj) -> Obj:
        meta = obj["metadata"]
        selector = (obj.get("spec", {}).get("selector") or {}).get("matchLabels") or {}
        return {
            "apiVersion": "autoscaling/v1",
            "kind": "Scale",
            "metadata": {
                k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp") if k in meta
            },
            "spec": {"replicas": obj.get("spec", {}).get("replicas", 1)},
            "status": {
                "replicas": (obj.get("status") or {}).get("replicas", 0),
                "selector": ",".join(f"{k}={v}" for k, v in sorted(selector.items())),
            },
        }

    # --- HTTP --------------------------------------------------------------------------------------------------

    def _discovery_groups(self) -> Obj:
        groups: dict[str, list[str]] = {}
        for r in self.resources:
            if r.group:
                groups.setdefault(r.group, [])
                if r.version not in groups[r.group]:
                    groups[r.group].append(r.version)
        return {
            "kind": "APIGroupList",
            "apiVersion": "v1",
            "groups": [
                {
                    "name": g,
                    "versions": [{"groupVersion": f"{g}/{v}", "version": v} for v in vs],
                    "preferredVersion": {"groupVersion": f"{g}/{vs[0]}", "version": vs[0]},
                }
                for g, vs in groups.items()
            ],
        }

    def _resource_list(self, group: str, version: str) -> Obj | None:
        rs = [r for r in self.resources if (r.group, r.version) == (group, version)]
        if not rs:
            return None
        out = []
        for r in rs:
            out.append(
                {
                    "name": r.plural,
                    "singularName": r.singular,
                    "namespaced": r.namespaced,
                    "kind": r.kind,
                    "verbs": list(r.verbs),
                    "shortNames": list(r.short_names),
                }
            )
            for sub in r.subresources:
                kind = "Scale" if sub == "scale" else r.kind
                out.append(
                    {
                        "name": f"{r.plural}/{sub}",
                        "singularName": "",
                        "namespaced": r.namespaced,
                        "kind": kind,
                        "verbs": ["get", "patch", "update"],
                    }
                    | ({"group": "autoscaling", "version": "v1"} if sub == "scale" else {})
                )
        return {
            "kind": "APIResourceList",
            "apiVersion": "v1",
            "groupVersion": f"{group}/{version}" if group else version,
            "resources": out,
        }

    _PATH = re.compile(
        r"^/(?:api/(?P<cv>v1)|apis/(?P<g>[^/]+)/(?P<v>[^/]+))"
        r"(?:/namespaces/(?P<ns>[^/]+)(?=/))?/(?P<plural>[^/]+)(?:/(?P<name>[^/]+))?(?:/(?P<sub>[^/]+))?$"
    )

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        path, method, query = request.path, request.method, dict(request.query)
        body: Any = None
        if request.can_read_body:
            raw = await request.read()
            try:
                body = json.loads(raw) if raw else None
            except ValueError:
                return self._error(ApiError(400, "BadRequest", "the body is not JSON"))
        auth = request.headers.get("Authorization", "")
        token = auth[len("Bearer ") :] if auth.startswith("Bearer ") else ""
        m = self._PATH.match(path)
        # /api/v1/namespaces/<name> is the namespace object itself, not a namespace prefix
        if m is None and (nm := re.match(r"^/api/v1/namespaces/([^/]+)(?:/(status))?$", path)):
            m_ns = {
                "cv": "v1",
                "g": None,
                "v": None,
                "ns": None,
                "plural": "namespaces",
                "name": nm.group(1),
                "sub": nm.group(2),
            }
        elif m is not None:
            m_ns = m.groupdict()
        else:
            m_ns = None
        group = (m_ns or {}).get("g") or ""
        verb = ""
        if m_ns is not None:
            name = m_ns["name"] or ""
            verb = {
                "GET": "get" if name else ("watch" if query.get("watch") in ("true", "1") else "list"),
                "POST": "create",
                "PUT": "update",
                "PATCH": "patch",
                "DELETE": "delete",
            }.get(method, method)
        self.requests.append(
            ApiRequest(
                method,
                path,
                query,
                request.headers.get("User-Agent", ""),
                token,
                verb,
                group,
                (m_ns or {}).get("plural") or "",
                (m_ns or {}).get("sub") or "",
                (m_ns or {}).get("ns") or "",
                (m_ns or {}).get("name") or "",
                body,
            )
        )
        try:
            if m_ns is None:
                return self._discovery(path)
            return await self._serve(request, m_ns, method, query, body)
        except ApiError as e:
            return self._error(e)

    def _discovery(self, path: str) -> web.Response:
        if path == "/version":
            return web.json_response(
                {"major": "1", "minor": "31", "gitVersion": "v1.31.0-pulsescale-double", "platform": "linux/amd64"}
            )
        if path == "/api":
            return web.json_response({"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []})
        if path == "/apis":
            return web.json_response(self._discovery_groups())
        if path == "/api/v1":
            listing = self._resource_list("", "v1")
        elif m := re.match(r"^/apis/([^/]+)/([^/]+)$", path):
            listing = self._resource_list(m.group(1), m.group(2))
        elif m := re.match(r"^/apis/([^/]+)$", path):
            groups = [g for g in self._discovery_groups()["groups"] if g["name"] == m.group(1)]
            if groups:
                return web.json_response({"kind": "APIGroup", "apiVersion": "v1", **groups[0]})
            listing = None
        else:
            listing = None
        if listing is None:
            raise_404 = ApiError(404, "NotFound", f"the server could not find the requested resource ({path})")
            return self._error(raise_404)
        return web.json_response(listing)

    def _find(self, group: str, version: str, plural: str) -> ResourceDef:
        for r in self.resources:
            if (r.group, r.version, r.plural) == (group, version, plural):
                return r
        raise ApiError(
            404, "NotFound", f"the server could not find the requested resource ({group}/{version}, {plural})"
        )

    async def _serve(
        self, request: web.Request, m: dict[str, Any], method: str, query: dict[str, str], body: Any
    ) -> web.StreamResponse:
        group, version = (m["g"] or "", m["v"]) if m["g"] else ("", m["cv"])
        r = self._find(group, version, m["plural"])
        namespace, name, sub = m["ns"] or "", m["name"] or "", m["sub"] or ""
        if r.namespaced and name and not namespace:
            raise ApiError(404, "NotFound", f"{r.kind} is namespaced: name it under /namespaces/<ns>/")
        if sub and sub not in r.subresources:
            raise ApiError(404, "NotFound", f"{r.plural} has no subresource {sub!r}")
        if not name:
            if method == "GET":
                if query.get("watch") in ("true", "1"):
                    return await self._watch(request, r, namespace, query)
                items = self.list(
                    r,
                    namespace,
                    label_selector=query.get("labelSelector", ""),
                    field_selector=query.get("fieldSelector", ""),
                )
                return web.json_response(
                    {
                        "kind": f"{r.kind}List",
                        "apiVersion": r.api_version,
                        "metadata": {"resourceVersion": str(self._rv), "continue": ""},
                        "items": items,
                    }
                )
            if method == "POST":
                if not isinstance(body, dict):
                    raise ApiError(400, "BadRequest", "the body must be an object")
                return web.json_response(self.create(r, namespace, body), status=201)
            raise ApiError(405, "MethodNotAllowed", f"{method} on a collection is not served by the double")
        if sub == "scale":
            return self._serve_scale(r, namespace, name, method, body)
        if method == "GET":
            return web.json_response(self.get(r, namespace, name))
        if method == "PUT":
            if not isinstance(body, dict):
                raise ApiError(400, "BadRequest", "the body must be an object")
            return web.json_response(self.replace(r, namespace, name, body, subresource=sub))
        if method == "PATCH":
            ctype = request.headers.get("Content-Type", "")
            if "apply-patch" in ctype:
                raise ApiError(415, "UnsupportedMediaType", "server-side apply is not served by the double")
            is_json_patch = "json-patch" in ctype or isinstance(body, list)
            return web.json_response(
                self.patch(r, namespace, name, body, subresource=sub, json_patch_ops=is_json_patch)
            )
        if method == "DELETE":
            obj = self.delete(r, namespace, name)
            return web.json_response(obj)
        raise ApiError(405, "MethodNotAllowed", f"{method} is not served by the double")

    def _serve_scale(self, r: ResourceDef, namespace: str, name: str, method: str, body: Any) -> web.Response:
        obj = self.get(r, namespace, name)
        if method == "GET":
            return web.json_response(self._scale_of(obj))
        if method == "PUT":
            new_scale = body
        elif method == "PATCH":
            scale = self._scale_of(obj)
            new_scale = json_patch(scale, body) if isinstance(body, list) else merge_patch(scale, body)
        else:
            raise ApiError(405, "MethodNotAllowed", f"{method} on scale is not served by the double")
        rv = (new_scale.get("metadata") or {}).get("resourceVersion")
        if method == "PUT" and rv and rv != obj["metadata"]["resourceVersion"]:
            raise ApiError(409, "Conflict", f'Operation cannot be fulfilled on {r.plural} "{name}"')
        replicas = (new_scale.get("spec") or {}).get("replicas")
        if not isinstance(replicas, int) or replicas < 0:
            raise ApiError(422, "Invalid", f"Scale.spec.replicas must be a non-negative integer, got {replicas!r}")
        updated = self.patch(r, namespace, name, {"spec": {"replicas": replicas}})
        return web.json_response(self._scale_of(updated))

    async def _watch(
        self, request: web.Request, r: ResourceDef, namespace: str, query: dict[str, str]
    ) -> web.StreamResponse:
        matches = self._matcher(query.get("labelSelector", ""), query.get("fieldSelector", ""))
        since = query.get("resourceVersion", "")
        timeout_s = float(query.get("timeoutSeconds") or DEFAULT_WATCH_TIMEOUT_S)
        bookmarks = query.get("allowWatchBookmarks") in ("true", "1")
        watch = _Watch(r, namespace if r.namespaced else "", matches)
        backlog: list[tuple[str, Obj]] = []
        gone = False
        if since and since != "0":
            rv = int(since)
            oldest = self._history[0][0] if self._history else self._rv + 1
            if rv < oldest - 1 and rv < self._rv:
                gone = True
            for hrv, hr, kind, obj in self._history:
                if (
                    hrv > rv
                    and hr == r
                    and (not watch.namespace or obj["metadata"].get("namespace") == watch.namespace)
                    and matches(obj)
                ):
                    backlog.append((kind, copy.deepcopy(obj)))
        else:
            backlog = [("ADDED", o) for o in self.list(r, watch.namespace) if matches(o)]
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        if gone:
            await response.write(
                self._line("ERROR", ApiError(410, "Expired", f"too old resource version: {since}").status())
            )
            return response
        self._watches.add(watch)
        try:
            for kind, obj in backlog:
                await response.write(self._line(kind, obj))
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout_s
            while (left := deadline - loop.time()) > 0:
                try:
                    item = await asyncio.wait_for(watch.queue.get(), min(left, BOOKMARK_EVERY_S))
                except TimeoutError:
                    if bookmarks:
                        await response.write(
                            self._line(
                                "BOOKMARK",
                                {
                                    "kind": r.kind,
                                    "apiVersion": r.api_version,
                                    "metadata": {"resourceVersion": str(self._rv)},
                                },
                            )
                        )
                    continue
                if item is None:
                    break
                await response.write(self._line(*item))
        except (ConnectionResetError, RuntimeError):
            pass  # the client went away
        finally:
            self._watches.discard(watch)
        return response

    @staticmethod
    def _line(kind: str, obj: Obj) -> bytes:
        return json.dumps({"type": kind, "object": obj}).encode() + b"\n"

    @staticmethod
    def _error(e: ApiError) -> web.Response:
        return web.json_response(e.status(), status=e.code)

    # --- lifecycle ---------------------------------------------------------------------------------------------

    async def start(self) -> None:
        app = web.Application(client_max_size=16 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.5)
        await self._runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        site = web.SockSite(self._runner, sock)
        await site.start()
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        for w in list(self._watches):
            w.queue.put_nowait(None)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def end_watches(self) -> None:
        """Closes every open watch stream (as an API server restart would); clients reconnect."""
        for w in list(self._watches):
            w.queue.put_nowait(None)

    def kubeconfig(self, path: Any, *, namespace: str = "default", token: str = "test-token") -> Any:
        """Writes a kubeconfig for this server to `path` (for processes and `--kubeconfig`) and returns it."""
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "current-context": "double",
            "clusters": [{"name": "double", "cluster": {"server": self.url}}],
            "users": [{"name": "double", "user": {"token": token}}],
            "contexts": [
                {"name": "double", "context": {"cluster": "double", "user": "double", "namespace": namespace}}
            ],
        }
        path.write_text(json.dumps(config))
        return path


@pytest.fixture
async def k8s_api() -> AsyncIterator[K8sApiDouble]:
    """A running `K8sApiDouble` on 127.0.0.1 (`.url`), stopped after the test."""
    api = K8sApiDouble()
    await api.start()
    try:
        yield api
    finally:
        await api.stop()
