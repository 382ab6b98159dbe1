"""The ScaledObject CRD (``scaledobjects.pulsescale.io``, ``v1alpha1``), generated from the one schema.

``pulsescale crd`` (`main`) prints it, or the editors' JSON Schema of ``spec``, or the reference page.

The spec's schema is `msgspec.json.schema(protocol.ScaledObjectSpec)` made structural, so the CRD, ``pulsescale
apply``'s validation (manifests/conversion.py decodes into the same type) and docs/scaledobject.md cannot drift
apart; the status is `ScaledObjectStatus`, the struct the operator patches. The parts, each a module of this
package: `manifests.crdtypes` (the CRD's identity, the status types, `scaler_active`), `manifests.crdnotes` (the
field descriptions: docstrings, `FIELD_NOTES`, `PATH_NOTES`), `manifests.crdschema` (the structural schema, the
CEL rules, the CRD object and `render`; its docstring says what the conversion decides, and why) and
`manifests.crddocs` (the reference page). This module is their face: callers import every name from here.

Pure: no I/O libraries. `main` (``pulsescale crd``) prints; it writes nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from manifests.crddocs import NO_EFFECT, REFUSED, docs_markdown
from manifests.crdnotes import FIELD_NOTES, PATH_NOTES
from manifests.crdschema import (
    CEL_RULES,
    MAX_NAME_LENGTH,
    MAX_TRIGGERS,
    crd,
    render,
    spec_json_schema,
    spec_schema,
    status_schema,
    structural,
)
from manifests.crdtypes import (
    ACTIVE_WINDOW_S,
    CONDITION_TYPES,
    CRD_NAME,
    GROUP,
    MAX_LAST_DECISIONS,
    PLURAL,
    SHORT_NAMES,
    VERSION,
    ColdPathStatus,
    Condition,
    ConditionStatus,
    ConditionType,
    LastDecision,
    Rfc3339,
    ScaledObjectStatus,
    scaler_active,
)

__all__ = [
    "ACTIVE_WINDOW_S",
    "CEL_RULES",
    "CONDITION_TYPES",
    "CRD_NAME",
    "FIELD_NOTES",
    "GROUP",
    "MAX_LAST_DECISIONS",
    "MAX_NAME_LENGTH",
    "MAX_TRIGGERS",
    "NO_EFFECT",
    "PATH_NOTES",
    "PLURAL",
    "REFUSED",
    "SHORT_NAMES",
    "VERSION",
    "ColdPathStatus",
    "Condition",
    "ConditionStatus",
    "ConditionType",
    "LastDecision",
    "Rfc3339",
    "ScaledObjectStatus",
    "crd",
    "docs_markdown",
    "main",
    "render",
    "scaler_active",
    "spec_json_schema",
    "status_schema",
    "spec_schema",
    "structural",
]


# --- pulsescale crd ---------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None, prog: str = "pulsescale crd") -> int:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Print the ScaledObject CustomResourceDefinition (kubectl apply -f -), generated from the "
        "same types that pulsescale apply and the operator validate with.",
    )
    from warmpool import output as out  # -o/--json as every printing command has them (issue 11)

    what = parser.add_mutually_exclusive_group()
    what.add_argument("--schema", action="store_true", help="print the JSON Schema of spec instead (for editors)")
    what.add_argument("--docs", action="store_true", help="print the Markdown reference (docs/scaledobject.md)")
    out.add_output_argument(parser)
    args = parser.parse_args(argv)
    fmt = out.machine(args)
    if fmt is not None and (args.schema or args.docs):
        parser.error("-o/--json print the CRD object; --schema and --docs print something else (JSON, Markdown)")
    if fmt is not None:
        # The CRD object alone, without render()'s comment header: `-o json` for jq, `-o yaml` for kubectl.
        sys.stdout.write(out.dump(crd(), fmt) + "\n")
    elif args.schema:
        sys.stdout.write(json.dumps(spec_json_schema(), indent=2) + "\n")
    elif args.docs:
        sys.stdout.write(docs_markdown())
    else:
        sys.stdout.write(render())
    return 0
