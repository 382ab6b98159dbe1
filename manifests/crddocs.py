"""docs/scaledobject.md, the reference of every ScaledObject field, generated from the same types as the CRD.

`docs_markdown` walks msgspec's schema of the spec and of the status (manifests/crdtypes.py) with the same
descriptions as the CRD (manifests/crdnotes.py) and adds the page's own lists: the CEL rules, `NO_EFFECT` (fields
accepted with no effect, and why) and `REFUSED` (what the validator refuses, and why; tests/manifests/test_crd.py checks
each against it). ``pulsescale crd --docs`` prints it (manifests/crd.py). Pure.
"""

from __future__ import annotations

import json
from typing import Any, Final

import msgspec

from manifests import terms
from manifests.crdnotes import _HPA, FIELD_NOTES, PATH_NOTES, _docs_by_struct
from manifests.crdschema import _CRD_BOUNDS, _STRING_OR_NUMBER, CEL_RULES, MAX_TRIGGERS
from manifests.crdtypes import ScaledObjectStatus
from warmpool import protocol
from warmpool.protocol import ScaledObjectSpec

__all__ = ["NO_EFFECT", "REFUSED", "docs_markdown"]

REFUSED: Final[dict[str, str]] = {
    # Field -> why the validator refuses it (docs/scaledobject.md "Refused, with the reason").
    "apiVersion": f"`keda.sh/v1alpha1` with a `{terms.TRIGGER_TYPE}` trigger: change it to "
    f"`{terms.API_VERSION}`; every other field reads as KEDA's.",
    "spec.triggers[].type": f"any type but `{terms.TRIGGER_TYPE}` (`prometheus`, `kafka`, `cpu`...): "
    "pulsescale has one trigger, the queue samples of `metadata.model`; keep those on KEDA. A `prometheus` "
    'trigger\'s query is `metadata.source: prometheus` here (see "Where the demand comes from").',
    "spec.triggers[].metricType": "`Value` and `Utilization`: pulsescale's rule is `AverageValue` (desired replicas = "
    "demand / `targetQueueDepth` per replica).",
    "spec.triggers": f"more than {MAX_TRIGGERS} triggers (the CRD's `maxItems` too): all name the same model.",
    "spec.triggers[].metadata.model": "a second ScaledObject of one model, in one apply or already in "
    "`pulse_scalers`: the autoscaler serves one ScaledObject per model (delete the other first).",
    "spec.advanced.scalingModifiers": "every trigger of a ScaledObject feeds the same model's demand, so there is "
    "no second metric for a formula to combine. The CRD declares it (KEDA's shape), so the API server keeps it and "
    "the operator refuses it (`Ready=False InvalidSpec`) instead of it vanishing.",
    "spec.triggers[].metadata": "a key other than `model`, `targetQueueDepth`, `activationQueueDepth`, `source`, "
    "`metricsURL`, `serverAddress` and `query` (another scaler's key, a typo), naming it: the CRD keeps unknown keys "
    "there (as KEDA's), so the operator refuses it.",
    "spec.triggers[].metadata.threshold": "KEDA's prometheus `threshold` and `activationThreshold`, with the names "
    "they have here: `targetQueueDepth` and `activationQueueDepth`.",
    "spec.triggers[].metadata.source": f"a source other than {', '.join(f'`{x}`' for x in protocol.SOURCES)} "
    "(naming them), by the CRD and the validator; triggers of one ScaledObject that read different sources or "
    "parameters (their demands would add up), by the validator.",
    "spec.triggers[].metadata.serverAddress": "with a source other than `prometheus` (so is `query`), by the CRD "
    "and the validator; missing with `prometheus` (so is `query`, and a blank one), by both; not an "
    "`http(s)://HOST[:PORT][/PATH]` URL, or with credentials, a `#fragment` or a `?query` (the bridge adds "
    "`/api/v1/query`), by the validator.",
    "spec.triggers[].metadata.metricsURL": "with a source other than `vllm-metrics`, by the CRD and the validator; "
    "an entry that is not an `http(s)://HOST[:PORT][/PATH]` URL (credentials and `#fragment` refused), an empty or "
    f"repeated entry, more than {protocol.MAX_METRICS_URLS} entries, by the validator.",
    "spec.scaleTargetRef.kind": "anything but an apps/v1 `Deployment` or `StatefulSet` (an Argo Rollout, a custom "
    "resource with a scale subresource), by the CRD, `pulsescale apply` and the operator: standby pods come from a "
    "Deployment's or StatefulSet's pod template, and the operator writes only their scale subresource.",
    "spec.idleReplicaCount": "a count not below `minReplicaCount` as KEDA's admission webhook counts it (unset: 0; "
    "`0`: 1), in KEDA's words (`IdleReplicaCount=3 must be less than MinReplicaCount=1`), by the CRD, `pulsescale "
    "apply` and the operator: it used to be admitted and then ignored.",
    f"{_HPA}.scaleUp.policies": "scale-up rate limits: pulsescale scales out as fast as the demand asks, from warm "
    "slots. HPA's default (Percent 100 and Pods 4 per 15 s, `Max`) is slower, so removing it loses nothing.",
    f"{_HPA}.scaleUp.stabilizationWindowSeconds": "other than 0: scale-out follows `advanced.stableWindowSeconds` "
    "and panics on bursts.",
    f"{_HPA}.*.tolerance": "HPA's dead band around the target has no counterpart.",
    f"{_HPA}.scaleDown.policies": "different `periodSeconds`, two policies of one type, or `Percent` over 100: the "
    "policy has one `advanced.scaleDownPeriodSeconds` for both limits. Setting a mapped field both here and in "
    "`advanced` is refused too (keep one).",
}

NO_EFFECT: Final[dict[str, str]] = {
    "spec.pollingInterval": "the gateways push a sample every 100 ms; nothing is polled (a `vllm-metrics` or "
    "`prometheus` source is read at the bridge's own `--scrape-every` / `--query-every`).",
    "spec.triggers[].useCachedMetrics": "every sample is used as it arrives; there is no metrics cache.",
    "spec.triggers[].authenticationRef": "a pushed trigger reads no external system, so it needs no credentials; "
    "the bridge reads a `vllm-metrics` or `prometheus` source without credentials (no TriggerAuthentication is "
    "read).",
    "spec.advanced.horizontalPodAutoscalerConfig.name": "no HPA is created; the autoscaler itself scales.",
    "spec.scaleTargetRef.envSourceContainerName": "a pushed trigger reads no container environment; its "
    "parameters are in `metadata`.",
}
"""Fields accepted so a KEDA manifest applies, and why they change nothing (the record's notes say the same)."""


def _rows(schema: dict[str, Any]) -> list[tuple[str, str, str, str, str]]:
    """(path, type, default, meaning, KEDA field) for every field of msgspec's ``spec`` schema, depth first."""
    defs = schema["$defs"]
    docs = _docs_by_struct()
    rows: list[tuple[str, str, str, str, str]] = []

    def resolve(node: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
        if "anyOf" in node:
            options = [o for o in node["anyOf"] if o.get("type") != "null"]
            if len(options) == 1:
                return resolve(options[0])
            return node, None
        if "$ref" in node:
            name = node["$ref"].rsplit("/", 1)[1]
            return defs[name], name
        return node, None

    def type_of(node: dict[str, Any], struct: str | None, field: str) -> str:
        if (struct, field) in _STRING_OR_NUMBER:
            return "number or string"
        target, _ = resolve(node)
        target = {**target, **_CRD_BOUNDS.get((struct or "", field), {})}
        if "anyOf" in target:
            return " or ".join(str(o.get("type")) for o in target["anyOf"] if o.get("type") != "null")
        if "enum" in target:
            return " \\| ".join(f"`{v}`" for v in target["enum"])
        if target.get("type") == "array":
            item, item_struct = resolve(target["items"])
            return f"list of {item_struct or item.get('type')}"
        kind = str(target.get("type", "object"))
        bounds = []
        for key, sign in (("minimum", ">="), ("exclusiveMinimum", ">"), ("maximum", "<=")):
            if key in target:
                bounds.append(f"{sign} {target[key]:g}")
        return f"{kind} ({', '.join(bounds)})" if bounds else kind

    def walk(struct: str, prefix: str) -> None:
        node = defs[struct]
        required = set(node.get("required", []))
        for name, sub in node.get("properties", {}).items():
            path = f"{prefix}.{name}"
            meaning, keda = FIELD_NOTES.get(f"{struct}.{name}", ("", ""))
            meaning = PATH_NOTES.get(path) or docs.get(struct, {}).get(name) or meaning
            if path in NO_EFFECT and "no effect" not in meaning.lower():
                meaning += f" **No effect:** {NO_EFFECT[path]}"
            if "default" in sub and sub["default"] is not None:
                default = f"`{json.dumps(sub['default'])}`"
            elif name in required:
                default = "required"
            else:
                default = "unset"
            rows.append((path, type_of(sub, struct, name), default, meaning.strip(), keda))
            target, child = resolve(sub)
            if child:
                walk(child, path)
            elif target.get("type") == "array":
                _, item_struct = resolve(target["items"])
                if item_struct:
                    walk(item_struct, f"{path}[]")

    walk(schema["$ref"].rsplit("/", 1)[1], "spec")
    return rows


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def docs_markdown() -> str:
    """docs/scaledobject.md: the reference of every field, generated from the same types as the CRD."""
    spec = msgspec.json.schema(ScaledObjectSpec)
    status = msgspec.json.schema(ScaledObjectStatus)
    out = [
        "<!-- Generated by `pulsescale crd --docs > docs/scaledobject.md` from warmpool.protocol.ScaledObjectSpec"
        " and manifests.crdtypes.ScaledObjectStatus; edit those types, not this file. -->",
        "# ScaledObject (`scaledobjects.pulsescale.io/v1alpha1`) reference",
        "",
        "One schema makes the CRD (`deploy/crd/`), what `pulsescale apply` and the operator accept, and this page.",
        "A KEDA ScaledObject applies with two changes: `apiVersion: pulsescale.io/v1alpha1` and a trigger of type",
        "`gateway-queue`; every other field is read as KEDA's, or refused with the reason (see \"Refused, with the",
        'reason" below). Short name: `kubectl get pso` (KEDA owns `so`).',
        "",
        "## Numbers written as strings",
        "",
        'KEDA\'s trigger metadata values are strings (`targetQueueDepth: "4"`); ours may be strings or numbers',
        '(`4`, `0.5`, `"0.5"`). The CRD schema leaves those two fields untyped',
        "(`x-kubernetes-preserve-unknown-fields`): `x-kubernetes-int-or-string` would refuse the number `0.5`, and a",
        'structural schema cannot say "string or number" otherwise. So the API server stores any value there; the',
        "shared validator (in `pulsescale apply` and in the operator, before anything is published) converts it and",
        "refuses a non-number naming the field, and the operator reports that in `status.conditions` (`Ready`) and",
        "an Event. A number is what KEDA's scalers read (Go's `strconv.ParseFloat`, decimal): ASCII digits, a",
        'fraction, an exponent (`"1e3"`); `"1_000"`, `"nan"`, `"inf"` and other digits (`"٣"`) are refused.',
        "",
        "## Where the demand comes from: `metadata.source`",
        "",
        "Every trigger is the model's queue samples (`pulse.queue.<model>`, the autoscaler's one input);",
        "`metadata.source` (wire contract revision 14) says who publishes them:",
        "",
        "- `gateway`, or no `source`: the gateways push them (docs/gateways.md).",
        "- `vllm-metrics`: `pulsescale bridge --scaledobjects` scrapes the engines' vLLM `/metrics` pages, those in",
        "  `metricsURL` (comma-separated; a URL without a path gets `/metrics`), else each ready slot of the model,",
        "  every `--scrape-every` (250 ms), and publishes `vllm:num_requests_waiting` as the queue and",
        "  `vllm:num_requests_running` as in flight.",
        "- `prometheus`: the bridge asks `query` of `serverAddress` (KEDA's prometheus scaler's keys) every",
        "  `--query-every` (1 s); the query's one value is the demand.",
        "",
        "Values are strings, as KEDA writes them. The bridge adds and drops these sources as the ScaledObjects",
        "change; a model that its own flags read (`--query`, a bound `--target`, `--slots`) is read as the flags say.",
        "With no bridge following the ScaledObjects nothing publishes a pulled source's samples, and the",
        "autoscaler holds the model's replicas (missing metrics never scale down). KEDA's `threshold` and",
        "`activationThreshold` are `targetQueueDepth` and `activationQueueDepth` here:",
        "",
        "```yaml",
        "  triggers:",
        "    - type: gateway-queue",
        "      metadata:",
        "        model: qwen",
        '        targetQueueDepth: "4"',
        "        source: prometheus",
        "        serverAddress: http://prometheus.monitoring:9090",
        '        query: sum(vllm:num_requests_waiting{model_name="qwen"}) + '
        'sum(vllm:num_requests_running{model_name="qwen"})',
        "```",
        "",
        "## Rules checked by the API server (CEL) and by the validator",
        "",
    ]
    for path, rules in CEL_RULES.items():
        for rule in rules:
            out.append(f"- `{path or '(root)'}`: {rule['message']}")
    out += [
        f"- `spec.triggers`: at most {MAX_TRIGGERS} (the CRD and the validator; all triggers name the same model).",
        "",
        "## `spec`",
        "",
        "| Field | Type | Default | Meaning | KEDA field |",
        "|---|---|---|---|---|",
    ]
    for path, kind, default, meaning, keda in _rows(spec):
        out.append(f"| `{path}` | {kind} | {default} | {_cell(meaning)} | {keda} |")
    out += ["", "## Accepted, with no effect", ""]
    out += [f"- `{path}`: {why}" for path, why in NO_EFFECT.items()]
    out += ["", "## Refused, with the reason", ""]
    out += [f"- `{path}`: {why}" for path, why in REFUSED.items()]
    out += [
        "",
        "## Pausing",
        "",
        "- Annotations, in KEDA's family (`autoscaling.keda.sh/`) and ours (`pulsescale.io/`), which must agree:",
        '  `paused: "true"` holds the target at its current count (nothing writes its scale subresource while',
        '  paused) and the warm pool at its count; `paused-replicas: "N"` (with or without `paused`; `"0"` parks at',
        "  zero whatever `minReplicaCount` says) sets the target to N through its scale subresource, as KEDA does",
        "  (`status.originalReplicaCount` recorded first, `status.pausedReplicaCount` N, put back to N if changed",
        '  while paused), and holds the pool at N; `paused-scale-in`/`paused-scale-out: "true"` stop one direction.',
        f"- `{_HPA}.scaleUp.selectPolicy: Disabled` pauses scale-out, as the `paused-scale-out` annotation does.",
        f"- `{_HPA}.scaleDown.selectPolicy: Disabled` (or `spec.advanced.scaleDownSelectPolicy: Disabled`) never",
        "  scales down.",
        "- `pulsescale apply` prints each pause in its summary line (`paused at N`, `paused scale-in`, `paused",
        "  scale-out`).",
    ]
    out += [
        "",
        "## Labels",
        "",
        "- `metadata.labels` are copied to the record in `pulse_scalers` for `pulsescale get -l`; nothing acts",
        f"  on them. A record carries at most {protocol.MAX_LABELS}; Kubernetes sets no limit. An object with more",
        f"  is published all the same, without its labels (not the first {protocol.MAX_LABELS}: a cut set would",
        "  match selectors that the object's labels do not), and its notes say so (`status.notes`, the `note:`",
        "  lines of `pulsescale apply`). `pulsescale get -l` then cannot select it; `kubectl get pso -l` still can.",
    ]
    out += [
        "",
        "## `status` (written by the operator)",
        "",
        "| Field | Type | Meaning |",
        "|---|---|---|",
    ]
    for path, kind, _, meaning, _ in _rows(status):
        out.append(f"| `{path.replace('spec', 'status', 1)}` | {kind} | {_cell(meaning)} |")
    out += [
        "",
        "`kubectl get pso` prints Kind, Target, Min, Max, Ready, Active, Fallback, Paused and Age as KEDA's",
        "`kubectl get so` does; `-o wide` adds Model, Desired, Current and Warm.",
        "",
    ]
    return "\n".join(out)
