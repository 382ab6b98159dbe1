"""ScaledObject manifests (``pulsescale.io/v1alpha1``) to `ScalerRecord`s for KV `pulse_scalers`.

One conversion for both writers of that bucket: `pulsescale apply -f` (no Kubernetes) and the kopf operator (a
CR's body is the same mapping). Pure apart from `load_path` (which reads files); `updated_at` is passed in.

The spec reads as KEDA's (``keda.sh/v1alpha1`` ScaledObject, KEDA 2.17 reference): a KEDA user changes the
``apiVersion`` and the trigger ``type``, and every other field means what it meant there, or is refused with the
reason. What is checked, and why it is stricter than the wire decoder:

- ``apiVersion``/``kind`` must be ours. A ``keda.sh/v1alpha1`` manifest with our trigger type gets the one-line
  fix; one with KEDA's own triggers is told pulsescale has one trigger type.
- ``metadata.name`` and ``metadata.namespace`` become the KV key ``<namespace>.<name>``: they must be names
  (`protocol.NAME_PATTERN`: no dots, since the key's parts are split on them). ``namespace`` defaults to
  ``default`` as with kubectl. ``metadata.creationTimestamp`` (RFC 3339) becomes `ScalerRecord.created_at`;
  ``metadata.labels`` become `ScalerRecord.labels` (``pulsescale get -l``), none where they are more than
  `protocol.MAX_LABELS`, which Kubernetes allows (the object is published, with `NOTE_LABELS_DROPPED`).
  Everything else in ``metadata`` (uid, resourceVersion, managedFields, finalizers, ownerReferences...) and a
  ``status`` block are ignored, so a CR body from the API server reads.
- ``spec`` decodes into `protocol.ScaledObjectSpec` (camelCase keys). Unknown keys are an error here, not
  ignored: the CRD's structural schema and ``kubectl apply`` (strict field validation) refuse them too, and an
  on-call engineer's ``maxReplica: 4`` typo must not be silently dropped.
- Triggers: ``type`` is ``gateway-queue`` (the one trigger: demand pushed by the gateways; a ``prometheus`` or
  ``kafka`` trigger has nothing to read here). ``metadata`` values may be strings as in KEDA (``"4"``) or
  numbers; where the wire type is a number they are converted, and a non-number is refused naming the key.
  A number string is what Go's ``strconv.ParseFloat`` (KEDA's scalers) reads in decimal: ASCII digits, a
  fraction, an exponent (``"1e3"``); not Python's extras (``"1_000"``, ``"٣"``, ``"nan"``). Every whole number
  read from a string (paused-replicas, ``$PULSESCALE_MAX_REPLICAS``) is ASCII digits only: ``str.isdigit``
  admits ``"²"``, which ``int`` then refuses with a ValueError (a traceback; a crashed operator handler).
  At most `MAX_TRIGGERS` triggers, as the CRD.
  Trigger names are unique within the ScaledObject. ``metricType`` is ``AverageValue`` (our rule divides demand by
  the per-replica target); ``Value`` and ``Utilization`` are refused with that reason.
- Accepted with no effect, each adding one line to `ScalerRecord.notes` (printed by ``apply``, shown in the
  status): ``pollingInterval``, ``useCachedMetrics`` (a pushed trigger is read as samples arrive, never polled),
  ``authenticationRef`` (nothing to authenticate to), ``horizontalPodAutoscalerConfig.name`` (no HPA is made),
  ``scaleTargetRef.envSourceContainerName`` (a pushed trigger reads no container environment).
- ``idleReplicaCount``: KEDA's admission webhook rule and words (``IdleReplicaCount=3 must be less than
  MinReplicaCount=1``): an unset ``minReplicaCount`` counts 0, a ``minReplicaCount`` of 0 counts 1, so
  ``minReplicaCount: 0`` admits only ``idleReplicaCount: 0`` (``manifests.keda.check_replica_bounds``).
- ``scaleTargetRef``: an apps/v1 Deployment or StatefulSet (`SCALE_TARGETS`); any other kind (an Argo Rollout)
  is refused naming it, since the operator reads only their pod template and scale subresource.
- ``fallback.failureThreshold``: KEDA's meaning, in the policy too (falls back when failures > threshold; a
  failure is a missed interval of ``advanced.staleAfterSeconds``); ``0`` falls back at the first, as KEDA's.
- One ScaledObject per model: the autoscaler serves the first and drops a second (``daemon.apply_scaler``), so
  two of one model in one apply are refused naming both (`load_documents`, `load_path`), and `check_models`
  refuses one whose model another key of ``pulse_scalers`` already scales (``apply`` runs it before writing).
- ``advanced.horizontalPodAutoscalerConfig.behavior`` is mapped onto the policy's scale-down fields (`_map_hpa`);
  what cannot map is refused with the reason, and so is setting a field both ways. ``scaleUp.selectPolicy:
  Disabled`` is what KEDA's ``paused-scale-out`` annotation does to its HPA, so it pauses scale-out here.
  ``advanced.scalingModifiers`` is refused: all triggers of one ScaledObject feed one model's demand, so there
  is no second metric for a formula to combine.
- Annotations, in both families, ``pulsescale.io/`` and KEDA's ``autoscaling.keda.sh/`` (the same value in both
  is fine; different values are refused naming both): ``paused: "true"`` pauses at the current count;
  ``paused-replicas: "N"`` pauses at N, with or without ``paused`` (KEDA), any N from 0 to the per-model limit
  (KEDA: "any arbitrary number"; ``"0"`` parks at zero whatever ``minReplicaCount`` says; the policy does not
  clamp a pause); ``paused-scale-in``/``paused-scale-out: "true"`` stop one direction. Values are strings, as
  Kubernetes requires, and ``"true"``/``"false"`` only (KEDA reads any other ``paused`` value as true: a typo
  here is refused instead of pausing).
- Replica counts (``minReplicaCount``, ``maxReplicaCount``, paused-replicas; idle is below min) are at most
  `max_replicas` (`DEFAULT_MAX_REPLICAS`, or ``$PULSESCALE_MAX_REPLICAS``): the wire allows 100000, but one
  ScaledObject asking for that much is a typo or an attack, and the autoscaler caps what it acts on at its own
  ``--max-replicas`` (`capped`).
- YAML: a mapping with the same key twice is refused with its line (PyYAML would keep the last one silently);
  multi-document streams and a ``kind: List`` with ``items`` read as with kubectl; `load_path` reads a
  directory's ``*.yaml``/``*.yml``/``*.json`` in name order (``-R``: recursively), as ``kubectl apply -f DIR``.
  Documents of other APIs (a Namespace, Deployment or Service beside the ScaledObject, as deploy/examples/ has)
  are skipped, each said in `skipped` (kubectl applies them, `pulsescale apply` writes only ScaledObjects); a
  ScaledObject of any apiVersion, and any kind of the pulsescale.io group, is still checked (a keda.sh one is
  refused with its hint), and a text or directory where nothing is left is refused.
  A text over `MAX_TEXT_BYTES` is refused before parsing, nesting deeper than `MAX_DEPTH` before composing
  (PyYAML's composer recurses per level: 3,000 levels were a RecursionError traceback), and any other failure of
  the loader is a `ScaledObjectError` too: the operator must never see another exception from here.

Every error is a `ScaledObjectError` naming the field (``spec.maxReplicaCount``); `load_documents` prefixes
the source and the 1-based document index (``qwen.yaml doc 1: spec.maxReplicaCount: Expected `int` >= 1``).

The reader's parts, each a module of this package: `manifests.terms` (the API's names, the limits,
`ScaledObjectError`), `manifests.keda` (KEDA's fields: triggers, HPA behavior, pause annotations),
`manifests.conversion` (`from_manifest`, `capped`, `same_content`) and `manifests.loading` (YAML and files:
`load_documents`, `load_path`, `check_models`). This module is their face: callers import every name from here.
"""

from __future__ import annotations

from manifests.conversion import NOTE_LABELS_DROPPED, capped, from_manifest, same_content
from manifests.keda import NOTE_ENV_SOURCE
from manifests.loading import Manifest, check_models, load_documents, load_path, other_kind
from manifests.terms import (
    ANNOTATION_PREFIXES,
    API_VERSION,
    DEFAULT_MAX_REPLICAS,
    DEFAULT_NAMESPACE,
    KEDA_API_GROUP,
    KIND,
    MANIFEST_SUFFIXES,
    MAX_DEPTH,
    MAX_REPLICAS_ENV,
    MAX_TEXT_BYTES,
    MAX_TRIGGERS,
    NUMBER_PATTERN,
    PAUSED_ANNOTATION,
    PAUSED_REPLICAS_ANNOTATION,
    PAUSED_SCALE_IN_ANNOTATION,
    PAUSED_SCALE_OUT_ANNOTATION,
    SCALE_TARGETS,
    TRIGGER_TYPE,
    ScaledObjectError,
    max_replicas_from_env,
)

__all__ = [
    "ANNOTATION_PREFIXES",
    "API_VERSION",
    "DEFAULT_MAX_REPLICAS",
    "DEFAULT_NAMESPACE",
    "KEDA_API_GROUP",
    "KIND",
    "MANIFEST_SUFFIXES",
    "MAX_DEPTH",
    "MAX_REPLICAS_ENV",
    "MAX_TEXT_BYTES",
    "MAX_TRIGGERS",
    "NOTE_ENV_SOURCE",
    "NOTE_LABELS_DROPPED",
    "NUMBER_PATTERN",
    "PAUSED_ANNOTATION",
    "PAUSED_REPLICAS_ANNOTATION",
    "PAUSED_SCALE_IN_ANNOTATION",
    "PAUSED_SCALE_OUT_ANNOTATION",
    "SCALE_TARGETS",
    "TRIGGER_TYPE",
    "Manifest",
    "ScaledObjectError",
    "capped",
    "check_models",
    "from_manifest",
    "load_documents",
    "other_kind",
    "load_path",
    "max_replicas_from_env",
    "same_content",
]
