"""The terms every part of the ScaledObject reader shares: the API's names, the limits, the error.

`manifests.scaledobject` is the face (its docstring says what is checked, and why); this module holds what the
conversion (`manifests.conversion`), KEDA's fields (`manifests.keda`) and the YAML reading (`manifests.loading`)
all need: ``apiVersion``/``kind``/trigger type, the annotation names, the per-model replica limit and its
environment variable, the text and nesting bounds, the number patterns, and `ScaledObjectError`. Pure.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Final

from warmpool.errors import PulsescaleError
from warmpool.protocol import DEFAULT_MAX_REPLICAS, MAX_REPLICAS_ENV  # the one replica bound, the contract's

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
    "NUMBER_PATTERN",
    "PAUSED_ANNOTATION",
    "PAUSED_REPLICAS_ANNOTATION",
    "PAUSED_SCALE_IN_ANNOTATION",
    "PAUSED_SCALE_OUT_ANNOTATION",
    "SCALE_TARGETS",
    "TRIGGER_TYPE",
    "ScaledObjectError",
    "max_replicas_from_env",
]

API_VERSION: Final = "pulsescale.io/v1alpha1"
KIND: Final = "ScaledObject"
KEDA_API_GROUP: Final = "keda.sh"
TRIGGER_TYPE: Final = "gateway-queue"
DEFAULT_NAMESPACE: Final = "default"
ANNOTATION_PREFIXES: Final = ("pulsescale.io/", "autoscaling.keda.sh/")
"""Pause annotations are read in both families: ours and KEDA's, so a KEDA user's runbook keeps working."""
PAUSED_ANNOTATION: Final = "pulsescale.io/paused"
PAUSED_REPLICAS_ANNOTATION: Final = "pulsescale.io/paused-replicas"
PAUSED_SCALE_IN_ANNOTATION: Final = "pulsescale.io/paused-scale-in"
PAUSED_SCALE_OUT_ANNOTATION: Final = "pulsescale.io/paused-scale-out"
SCALE_TARGETS: Final = (("apps/v1", "Deployment"), ("apps/v1", "StatefulSet"))
"""The (apiVersion, kind) of the scale targets pulsescale takes: the operator reads their pod template (standby
pods) and writes their scale subresource (the cold path, paused-replicas, the restore), and its RBAC grants exactly
those. KEDA takes anything with a ``/scale`` subresource; every other kind is refused, by the CRD and the validator."""
MANIFEST_SUFFIXES: Final = (".yaml", ".yml", ".json")
"""What `load_path` reads from a directory, as ``kubectl apply -f DIR``."""
MAX_TRIGGERS: Final = 16
"""Most triggers in one ScaledObject, as the CRD's ``maxItems`` (manifests/crdschema.py uses this one): every trigger
names the same model, so more than one is only to name them, and the API server needs a bound for the CEL rule."""
MAX_TEXT_BYTES: Final = 3 * 1024 * 1024
"""Largest file (or stdin) read, in bytes: the API server's own request limit (3 MiB). A ScaledObject is ~1 KiB;
a bigger text is a wrong file, and refusing it before parsing bounds the parser's time and memory."""
MAX_DEPTH: Final = 64
"""Deepest nesting of mappings and lists read. The deepest field is 8 levels down (an HPA policy's ``value``), a
CR body's ``managedFields`` ~15; PyYAML's composer recurses per level and dies with RecursionError near 1000."""
_ASCII_COUNT: Final = re.compile(r"[ \t]*[0-9]+[ \t]*")
"""A whole number as Kubernetes writes one: ASCII digits only (``str.isdigit`` admits "²" and "٣", and ``int``
reads "٣" as 3 and raises on "²")."""
NUMBER_PATTERN: Final = r"^[ \t]*[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+)?[ \t]*$"
_ASCII_NUMBER: Final = re.compile(NUMBER_PATTERN)
"""A metadata number as KEDA's scalers read one (Go's ``strconv.ParseFloat``, decimal form): ASCII digits, an
optional fraction and exponent (``"1e3"``). Not Python's ``float`` extras: ``"1_000"``, non-ASCII digits,
``"nan"``/``"inf"``. The editor schema (``pulsescale crd --schema``) uses the same pattern."""


class ScaledObjectError(PulsescaleError):
    """A ScaledObject manifest that cannot become a `ScalerRecord`; `field` is a path such as ``spec.triggers[0]``."""

    code = "invalid_scaledobject"

    def __init__(self, field: str, detail: str, *, where: str = "") -> None:
        self.field = field
        self.detail = detail
        self.where = where
        head = f"{where}: " if where else ""
        super().__init__(f"{head}{field}: {detail}" if field else f"{head}{detail}")

    def located(self, where: str) -> ScaledObjectError:
        return ScaledObjectError(self.field, self.detail, where=where)


def max_replicas_from_env(env: Mapping[str, str]) -> int:
    """`MAX_REPLICAS_ENV` from `env`, else `DEFAULT_MAX_REPLICAS`; a value that is not a whole number >= 1 is a
    `ScaledObjectError` saying so."""
    text = env.get(MAX_REPLICAS_ENV, "").strip()
    if not text:
        return DEFAULT_MAX_REPLICAS
    if not _ASCII_COUNT.fullmatch(text) or int(text) < 1:
        raise ScaledObjectError("", f"${MAX_REPLICAS_ENV} is {text!r}; it must be a whole number of replicas >= 1")
    return int(text)


def _over(field: str, value: int, max_replicas: int) -> ScaledObjectError:
    return ScaledObjectError(
        field,
        f"{value} is over the limit of {max_replicas} replicas per model; raise it with --max-replicas N or "
        f"${MAX_REPLICAS_ENV} (and the autoscaler's --max-replicas) if you mean it",
    )
