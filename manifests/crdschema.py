"""The ScaledObject CRD object (``scaledobjects.pulsescale.io``, ``v1alpha1``): its structural schema, CEL rules.

The spec's OpenAPI schema is `msgspec.json.schema(protocol.ScaledObjectSpec)` made *structural* (every ``$ref``
inlined, every node typed), so the CRD, ``pulsescale apply``'s validation (manifests/conversion.py decodes
into the same type) and docs/scaledobject.md cannot drift apart. The status is `ScaledObjectStatus`, the struct
the operator builds and patches, so its schema cannot drift from what the operator writes either. Descriptions
are the field docstrings of those types (read from their source with `ast`), else `FIELD_NOTES` (manifests/crdnotes.py).

What the conversion decides, and why:

- ``X | None`` fields are emitted as ``X`` without ``nullable``: the API server prunes a ``null`` of a field
  that is not nullable (then applies its default), which is what the wire does with ``None`` (absent == null ==
  the default). A nullable field would keep the ``null`` and every CEL rule over it would have to guard it.
- ``default: null`` is dropped (nothing to default); every other default is the type's, so the stored object
  shows the values the autoscaler uses.
- Trigger metadata numbers (``targetQueueDepth``, ``activationQueueDepth``) are strings in KEDA (``"4"``) and
  numbers in our examples (``4``, ``0.5``). ``x-kubernetes-int-or-string`` refuses the number ``0.5`` and
  ``type: number`` refuses ``"4"``, and a structural schema may not put types under ``anyOf``. What admits both
  is an untyped node with ``x-kubernetes-preserve-unknown-fields: true``; the shared validator (run by
  ``apply`` and by the operator before anything is published) converts the value and refuses a non-number with
  the field's name. The cost: the API server itself does not check those two values (CEL cannot read an
  untyped node), so ``kubectl apply`` of ``targetQueueDepth: "four"`` is stored and then reported by the
  operator in ``status.conditions[Ready]`` and an Event. HPA's ``tolerance`` (a quantity: string or number) is
  emitted the same way.
- ``exclusiveMinimum: X`` (JSON Schema 2020-12) becomes ``minimum: X, exclusiveMinimum: true`` (OpenAPI v3.0,
  what apiextensions.k8s.io/v1 reads); enums get ``type: string``.
- CEL ``x-kubernetes-validations`` repeat the cross-field rules of `ScaledObjectSpec.__post_init__` and the
  validator with the same wording: min <= max, idle below min as KEDA's admission webhook reads it (an unset min
  counts 0, a min of 0 counts 1; ``minReplicaCount`` therefore has no CRD default, `_UNSET_DEFAULTS`), unique
  trigger names, one model, a pulsescale name in ``metadata.name``. ``metadata.namespace`` needs no rule: a
  namespace is a DNS label, always a pulsescale name. ``spec.triggers`` gets ``maxItems`` (`MAX_TRIGGERS`, the
  validator's bound too), because the API server refuses a CEL rule whose worst-case cost over an unbounded list is
  too high.
- ``spec.schedules`` (revision 8): CEL repeats the floor <= ``maxReplicaCount`` and unique names; whether two
  windows overlap needs the zone database (DST), so the validator alone refuses it (the operator reports it).
- `_CRD_BOUNDS` adds bounds the CRD needs beyond the wire's: ``scaleTargetRef`` is an apps/v1 Deployment or
  StatefulSet (`terms.SCALE_TARGETS`; KEDA takes any ``/scale`` target, pulsescale refuses the others), and a
  trigger's ``metadata.source`` is one of `protocol.SOURCES` (revision 14; the wire keeps it a string, so that
  readers that act on nothing of it read a record of a later source).
- Revision 14's source parameters: CEL says which source each belongs to and that ``prometheus`` needs both of its
  own; the URLs' form and one source per ScaledObject are the validator's alone (a URL pattern in the CRD would be
  a second, subtly different parser of what `protocol.http_url_problem` decides).
- What KEDA's CRD keeps, ours keeps, so the operator sees it and refuses it with the reason instead of the API
  server pruning it unseen (a non-strict client, or an older kubectl, sends unknown fields without complaint):
  unknown trigger ``metadata`` keys (``x-kubernetes-preserve-unknown-fields`` on the metadata object: KEDA's is a
  string map) and ``advanced.scalingModifiers`` (declared with KEDA's shape, `_SCALING_MODIFIERS`).
- The HPA ``behavior`` rules are one struct for ``scaleUp`` and ``scaleDown``, mapped differently (scale-down onto
  the policy, scale-up mostly refused): `PATH_NOTES` describes each by its path, in the CRD and the docs, and
  `REFUSED` (manifests/crddocs.py) lists what the validator refuses with the reason (tests/manifests/test_crd.py checks
  each against it).

Pure: no I/O libraries. `render` is the CRD as ``pulsescale crd`` prints it (manifests/crd.py).
"""

from __future__ import annotations

import copy
from typing import Any, Final

import msgspec
import yaml

from manifests import terms
from manifests.crdnotes import PATH_NOTES, _description, _docs_by_struct
from manifests.crdtypes import CONDITION_TYPES, CRD_NAME, GROUP, PLURAL, SHORT_NAMES, VERSION, ScaledObjectStatus
from warmpool.protocol import NAME_PATTERN, SOURCES, ScaledObjectSpec

__all__ = [
    "CEL_RULES",
    "MAX_NAME_LENGTH",
    "MAX_TRIGGERS",
    "crd",
    "render",
    "spec_json_schema",
    "spec_schema",
    "status_schema",
    "structural",
]

MAX_TRIGGERS: Final = terms.MAX_TRIGGERS
"""``spec.triggers`` maxItems, the validator's bound: every trigger names the same model, so more than a few is a
mistake, and the API server refuses a CEL rule (unique names) whose cost over an unbounded list is too high."""
MAX_NAME_LENGTH: Final = 63
"""Trigger names and the like are bounded so the CEL cost estimate stays small."""

# Fields whose JSON number may also be written as a string (KEDA writes every trigger metadata value as one).
_STRING_OR_NUMBER: Final = frozenset(
    {("TriggerMetadata", "targetQueueDepth"), ("TriggerMetadata", "activationQueueDepth")}
)

_NAME_HINT: Final = "a name: lowercase letters, digits, '-' and '_'; no dots"

CEL_RULES: Final[dict[str, list[dict[str, str]]]] = {
    # JSON pointer-ish path of the node (``""`` is the root, ``spec``) -> its rules.
    "": [
        {
            "rule": f"self.metadata.name.matches('{NAME_PATTERN}')",
            "message": f"metadata.name must be a pulsescale name ({_NAME_HINT}, at most 63 characters): it is "
            "half of the pulse_scalers key <namespace>.<name>",
        },
    ],
    "spec": [
        {
            "rule": "!has(self.minReplicaCount) || !has(self.maxReplicaCount) || "
            "self.minReplicaCount <= self.maxReplicaCount",
            "message": "`minReplicaCount` must be <= `maxReplicaCount`",
        },
        {
            # KEDA's webhook (CheckReplicaCountBoundsAreValid): an unset minimum counts 0, a minimum of 0 counts 1.
            "rule": "!has(self.idleReplicaCount) || (has(self.minReplicaCount) && "
            "(self.idleReplicaCount < self.minReplicaCount || "
            "(self.minReplicaCount == 0 && self.idleReplicaCount == 0)))",
            "message": "IdleReplicaCount must be less than MinReplicaCount, as KEDA's admission webhook says (an unset "
            "minReplicaCount counts 0, a minReplicaCount of 0 counts 1)",
        },
        {
            "rule": "self.triggers.size() >= 1",
            "message": "at least one trigger is required (type: gateway-queue)",
        },
        {
            "rule": "self.triggers.all(t, self.triggers.all(u, u.metadata.model == t.metadata.model))",
            "message": "all triggers of one ScaledObject must name the same model",
        },
        {
            "rule": "self.triggers.all(t, !has(t.name) || "
            "self.triggers.exists_one(u, has(u.name) && u.name == t.name))",
            "message": "trigger names must be unique within the ScaledObject",
        },
        {
            "rule": "!has(self.schedules) || !has(self.maxReplicaCount) || "
            "self.schedules.all(s, s.replicas <= self.maxReplicaCount)",
            "message": "a schedule's `replicas` must be <= `maxReplicaCount`",
        },
        {
            "rule": "!has(self.schedules) || self.schedules.all(s, self.schedules.exists_one(u, u.name == s.name))",
            "message": "schedule names must be unique within the ScaledObject",
        },
        {
            # Revision 14: each source's own parameters (`protocol.SOURCE_PARAMETERS`), as the validator says.
            "rule": "self.triggers.all(t, !has(t.metadata.source) || t.metadata.source != 'prometheus' || "
            "(has(t.metadata.serverAddress) && has(t.metadata.query)))",
            "message": "a trigger with `source: prometheus` needs `serverAddress` and `query`",
        },
        {
            "rule": "self.triggers.all(t, (!has(t.metadata.serverAddress) && !has(t.metadata.query)) || "
            "(has(t.metadata.source) && t.metadata.source == 'prometheus'))",
            "message": "`serverAddress` and `query` belong to `source: prometheus`",
        },
        {
            "rule": "self.triggers.all(t, !has(t.metadata.metricsURL) || "
            "(has(t.metadata.source) && t.metadata.source == 'vllm-metrics'))",
            "message": "`metricsURL` belongs to `source: vllm-metrics`",
        },
    ],
}

_CRD_BOUNDS: Final[dict[tuple[str, str], dict[str, Any]]] = {
    # The scale targets pulsescale takes (`terms.SCALE_TARGETS`): the API server refuses others, as the validator.
    ("ScaleTargetRef", "kind"): {"enum": sorted({kind for _, kind in terms.SCALE_TARGETS})},
    ("ScaleTargetRef", "apiVersion"): {"enum": sorted({api for api, _ in terms.SCALE_TARGETS})},
    # Revision 14: the sources this revision reads (the validator names the allowed ones too).
    ("TriggerMetadata", "source"): {"enum": list(SOURCES)},
}

_SCALING_MODIFIERS: Final[dict[str, Any]] = {
    # KEDA's ``advanced.scalingModifiers`` (its CRD's shape, strings bounded for the CEL cost estimate): declared so
    # the API server keeps it for the operator to refuse with the reason, instead of pruning it unseen.
    "type": "object",
    "description": "KEDA's scalingModifiers (a formula over several triggers' metrics). Refused by the validator, "
    "with the reason: every trigger of a ScaledObject feeds the same model's demand.",
    "properties": {
        "formula": {"type": "string", "maxLength": 4096},
        "target": {"type": "string", "maxLength": 64},
        "activationTarget": {"type": "string", "maxLength": 64},
        "metricType": {"type": "string", "enum": ["AverageValue", "Value"]},
    },
}
_UNSET_DEFAULTS: Final = ("minReplicaCount",)
"""Spec fields whose wire default stays out of the CRD: KEDA's webhook tells an unset ``minReplicaCount`` from 0
(`manifests.keda.check_replica_bounds`), so the API server must store it unset, as KEDA's CRD does."""


def structural(schema: dict[str, Any]) -> dict[str, Any]:
    """A msgspec JSON Schema (2020-12, ``$defs``) as an apiextensions.k8s.io/v1 structural OpenAPI v3 schema."""
    defs = schema.get("$defs", {})
    docs = _docs_by_struct()

    def walk(node: dict[str, Any], owner: str | None, field: str | None) -> dict[str, Any]:
        if "$ref" in node:
            name = node["$ref"].rsplit("/", 1)[1]
            resolved = walk(defs[name], name, None)
            if node.get("default") is not None:
                resolved["default"] = node["default"]
            return resolved
        if (owner, field) in _STRING_OR_NUMBER:
            return _untyped(node)
        if "anyOf" in node:
            options = [o for o in node["anyOf"] if o.get("type") != "null"]
            rest = {k: v for k, v in node.items() if k != "anyOf"}
            if len(options) == 1:
                return walk({**options[0], **rest}, owner, field)
            return _untyped(rest)  # string-or-number (HPA tolerance): see the module docstring
        out: dict[str, Any] = {}
        kind = node.get("type")
        if kind is None and "enum" in node:
            kind = "string"
        if kind is None:
            raise ValueError(f"schema node without a type at {owner}.{field}: {node}")
        out["type"] = kind
        if node.get("description"):
            out["description"] = " ".join(node["description"].split())
        for key in (
            "enum",
            "format",
            "pattern",
            "minLength",
            "maxLength",
            "minItems",
            "maxItems",
            "minimum",
            "maximum",
        ):
            if key in node:
                out[key] = node[key]
        if "exclusiveMinimum" in node:
            out["minimum"] = node["exclusiveMinimum"]
            out["exclusiveMinimum"] = True
        if "exclusiveMaximum" in node:
            out["maximum"] = node["exclusiveMaximum"]
            out["exclusiveMaximum"] = True
        if node.get("default") is not None:
            out["default"] = node["default"]
        if out.get("pattern") == NAME_PATTERN and "maxLength" not in out:
            # The pattern allows 63 characters; the API server's cost estimator reads only maxLength (without it, a
            # model name counts as a 3 MiB string: ~80 M for the rule that compares the triggers' models).
            out["maxLength"] = MAX_NAME_LENGTH
        out.update(_CRD_BOUNDS.get((owner or "", field or ""), {}))
        if kind == "object":
            struct = owner if owner in defs else None
            props: dict[str, Any] = {}
            for name, sub in node.get("properties", {}).items():
                child = walk(sub, struct, name)
                desc = _description(struct, name, docs) if struct else ""
                if desc and "description" not in child:
                    child = {"description": desc, **child}
                props[name] = child
            if props:
                out["properties"] = props
            if node.get("required"):
                out["required"] = list(node["required"])
            if node.get("additionalProperties") not in (None, False, True):
                out["additionalProperties"] = walk(node["additionalProperties"], None, None)
        if kind == "array":
            out["items"] = walk(node["items"], None, None)
        return out

    return walk(schema, None, None)


def _untyped(node: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"x-kubernetes-preserve-unknown-fields": True}
    if node.get("default") is not None:
        out["default"] = node["default"]
    return out


def spec_schema() -> dict[str, Any]:
    """``spec``'s structural schema, with the CRD-only bounds and the CEL rules."""
    out = structural(msgspec.json.schema(ScaledObjectSpec))
    out.pop("description", None)
    out["properties"]["triggers"]["maxItems"] = MAX_TRIGGERS
    trigger = out["properties"]["triggers"]["items"]
    trigger["properties"]["name"]["maxLength"] = MAX_NAME_LENGTH
    # Unknown metadata keys are kept (KEDA's CRD has a string map there), so a typo reaches the operator, which
    # refuses it naming the key; pruned, it would vanish and the object would look Ready.
    trigger["properties"]["metadata"]["x-kubernetes-preserve-unknown-fields"] = True
    out["properties"]["advanced"]["properties"]["scalingModifiers"] = copy.deepcopy(_SCALING_MODIFIERS)
    for name in _UNSET_DEFAULTS:
        out["properties"][name].pop("default", None)
    out["x-kubernetes-validations"] = copy.deepcopy(CEL_RULES["spec"])
    _path_descriptions(out, "spec")
    return out


def _path_descriptions(node: dict[str, Any], path: str) -> None:
    """`PATH_NOTES` as the descriptions of the structural schema's nodes at those paths."""
    if path in PATH_NOTES:
        node["description"] = _plain_markdown(PATH_NOTES[path])
    for name, sub in node.get("properties", {}).items():
        _path_descriptions(sub, f"{path}.{name}")
    if "items" in node:
        _path_descriptions(node["items"], f"{path}[]")


def _plain_markdown(text: str) -> str:
    return text.replace("**", "")  # bold is the page's; backticks stay, as in the other descriptions


def status_schema() -> dict[str, Any]:
    out = structural(msgspec.json.schema(ScaledObjectStatus))
    conditions = out["properties"]["conditions"]
    conditions["x-kubernetes-list-type"] = "map"  # one entry per type, merged by type (as metav1.Condition)
    conditions["x-kubernetes-list-map-keys"] = ["type"]
    conditions["maxItems"] = len(CONDITION_TYPES)
    return out


def _columns() -> list[dict[str, Any]]:
    def cond(kind: str) -> str:
        return f'.status.conditions[?(@.type=="{kind}")].status'

    return [
        {"name": "Kind", "type": "string", "jsonPath": ".spec.scaleTargetRef.kind"},
        {"name": "Target", "type": "string", "jsonPath": ".spec.scaleTargetRef.name"},
        {"name": "Min", "type": "integer", "jsonPath": ".spec.minReplicaCount"},
        {"name": "Max", "type": "integer", "jsonPath": ".spec.maxReplicaCount"},
        {"name": "Ready", "type": "string", "jsonPath": cond("Ready")},
        {"name": "Active", "type": "string", "jsonPath": cond("Active")},
        {"name": "Fallback", "type": "string", "jsonPath": cond("Fallback")},
        {"name": "Paused", "type": "string", "jsonPath": cond("Paused")},
        {"name": "Model", "type": "string", "jsonPath": ".spec.triggers[0].metadata.model", "priority": 1},
        {"name": "Desired", "type": "integer", "jsonPath": ".status.desiredReplicas", "priority": 1},
        {"name": "Current", "type": "integer", "jsonPath": ".status.currentReplicas", "priority": 1},
        {"name": "Warm", "type": "integer", "jsonPath": ".status.warmSlots", "priority": 1},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]


def crd() -> dict[str, Any]:
    """The CustomResourceDefinition object."""
    root = {
        "type": "object",
        "description": "A pulsescale ScaledObject: KEDA's ScaledObject fields with the gateway-queue trigger, "
        "scaled from the warm pool.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string", "maxLength": 317},
            "kind": {"type": "string", "maxLength": 63},
            "metadata": {"type": "object"},
            "spec": spec_schema(),
            "status": status_schema(),
        },
        "x-kubernetes-validations": copy.deepcopy(CEL_RULES[""]),
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": CRD_NAME,
            "labels": {"app.kubernetes.io/name": "pulsescale", "app.kubernetes.io/component": "crd"},
        },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": "ScaledObject",
                "listKind": "ScaledObjectList",
                "plural": PLURAL,
                "singular": "scaledobject",
                "shortNames": list(SHORT_NAMES),
                "categories": ["pulsescale"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": _columns(),
                    "schema": {"openAPIV3Schema": root},
                }
            ],
        },
    }


_HEADER: Final = (
    "# Generated by `pulsescale crd > deploy/crd/scaledobjects.pulsescale.io.yaml` from warmpool.protocol"
    ".ScaledObjectSpec\n# and manifests.crdtypes.ScaledObjectStatus: edit those types, not this file.\n"
)


def render() -> str:
    """The CRD as YAML, with a header that says how it is made."""
    return _HEADER + str(yaml.safe_dump(crd(), sort_keys=False, width=120, allow_unicode=True))


def spec_json_schema() -> dict[str, Any]:
    """JSON Schema (2020-12) of ``spec`` for editors: msgspec's, with KEDA's string numbers admitted."""
    schema = msgspec.json.schema(ScaledObjectSpec)
    meta = schema["$defs"]["TriggerMetadata"]["properties"]
    meta["source"]["enum"] = list(SOURCES)  # as the CRD (`_CRD_BOUNDS`)
    for struct, name in _STRING_OR_NUMBER:
        node = schema["$defs"][struct]["properties"][name]
        default = node.pop("default", None)
        schema["$defs"][struct]["properties"][name] = {
            "anyOf": [node, {"type": "string", "pattern": terms.NUMBER_PATTERN}],
            **({"default": default} if default is not None else {}),
        }
    del meta
    return schema
