"""Every manifest under deploy/ validates against the Kubernetes schemas (strict: no unknown fields).

Our own custom resources (`pulsescale.io/*`) have no schema there; they are checked by the ScaledObject parser
(tests/test_scaledobject*.py applies every example)."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
DOCS = [
    (path, i, doc)
    for path in sorted(DEPLOY.rglob("*.yaml"))
    if path.name != "kustomization.yaml"
    for i, doc in enumerate(yaml.safe_load_all(path.read_text()))
    if doc and not str(doc.get("apiVersion", "")).startswith("pulsescale.io/")
]


@pytest.mark.parametrize(("path", "index", "doc"), DOCS, ids=[f"{p.relative_to(DEPLOY)}#{i}" for p, i, _ in DOCS])
def test_manifest_is_valid(path: Path, index: int, doc: dict) -> None:  # type: ignore[type-arg]
    kubernetes_validate.validate(doc, "1.33", strict=True)


def test_kustomizations_name_files_that_exist() -> None:
    for kfile in DEPLOY.rglob("kustomization.yaml"):
        for res in yaml.safe_load(kfile.read_text()).get("resources", []):
            assert (kfile.parent / res).exists(), f"{kfile}: {res} does not exist"


def test_registry_broker_fsyncs_every_write() -> None:
    conf = (DEPLOY / "nats" / "configmap.yaml").read_text()
    assert "sync_interval: always" in conf
