"""Every manifest under deploy/ validates against the Kubernetes schemas (strict: no unknown fields), and the NATS
cluster's manifests say what DESIGN.md's trust boundaries say.

`K8S_VERSION` is the Kubernetes release the manifests are checked against (the README names it): the oldest we
support; they are checked against the newest schema kubernetes-validate ships too, so a removed API shows up here.
Objects of other projects' CRDs have no schema there: our ScaledObjects are checked by the ScaledObject parser
(tests/manifests/test_scaledobject.py applies every one under deploy/), ServiceMonitors and cert-manager's objects by
the structural checks in tests/kube/test_deploy.py and below. The built kustomizations (base and overlays, patches
applied) are validated in tests/kube/test_deploy.py."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate import utils as kv_utils

from warmpool import natsauth
from warmpool.embedded import find_nats_server

K8S_VERSION = "1.33"
"""The oldest Kubernetes the manifests are for (Pod Security's enforce-version, the kube-scheduler image)."""
K8S_VERSIONS = sorted({K8S_VERSION, kv_utils.major_minor(kv_utils.latest_version())})
"""Checked against the oldest and the newest schema kubernetes-validate has."""
FOREIGN_GROUPS = ("pulsescale.io/", "cert-manager.io/", "monitoring.coreos.com/")
"""API groups whose schemas are CRDs (ours, cert-manager's, the Prometheus Operator's): checked elsewhere."""

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DOCS = [
    (path, i, doc)
    for path in sorted(DEPLOY.rglob("*.yaml"))
    if path.name != "kustomization.yaml"
    for i, doc in enumerate(yaml.safe_load_all(path.read_text()))
    if doc and not str(doc.get("apiVersion", "")).startswith(FOREIGN_GROUPS)
]


def validate(doc: dict[str, Any]) -> None:
    """kubernetes-validate, strict, at every version in K8S_VERSIONS."""
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize(("path", "index", "doc"), DOCS, ids=[f"{p.relative_to(DEPLOY)}#{i}" for p, i, _ in DOCS])
def test_manifest_is_valid(path: Path, index: int, doc: dict) -> None:  # type: ignore[type-arg]
    validate(doc)


def test_the_validator_refuses_an_unknown_field() -> None:
    """Strict mode is on: a misspelt field is an error, not silently dropped as kubectl apply would."""
    bad = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "x"}, "automountToken": False}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(bad)


def test_registry_broker_fsyncs_every_write() -> None:
    conf = (DEPLOY / "base" / "nats" / "configmap.yaml").read_text()
    assert "sync_interval: always" in conf


# --- NATS: users per role, TLS, routes, the monitoring port, the NetworkPolicy -----------------------------------

NATS = DEPLOY / "base" / "nats"


def nats_docs() -> dict[tuple[str, str], dict]:  # type: ignore[type-arg]
    """(kind, name) -> document, over deploy/nats (cert-manager's included)."""
    out = {}
    for path in sorted(NATS.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") != "Kustomization":
                out[(doc["kind"], doc["metadata"]["name"])] = doc
    return out


def nats_config() -> dict[str, str]:
    return nats_docs()[("ConfigMap", "pulse-nats")]["data"]  # type: ignore[no-any-return]


def example_nodes() -> list[str]:
    cm = nats_docs()[("ConfigMap", "pulse-nats")]
    return str(cm["metadata"]["annotations"]["pulsescale.io/agent-nodes"]).split(",")


def test_the_shipped_authorization_is_the_generated_one_for_its_nodes() -> None:
    """auth.conf cannot drift from warmpool/natsauth.py: it is `pulsescale nats --print-authorization` output."""
    nodes = example_nodes()
    assert nats_config()["auth.conf"] == natsauth.render_authorization(natsauth.role_users(nodes))
    users = re.findall(r'\{user: "([^"]+)", password: \$(\w+),', nats_config()["auth.conf"])
    assert [u for u, _ in users] == ["gateway", *(f"agent-{n}" for n in nodes), "autoscaler", "operator", "oncall"]
    assert all(var == natsauth.password_env(u) for u, var in users)  # no password in the ConfigMap


def test_the_nats_config_loads_with_tls_and_the_passwords_from_the_environment(tmp_path: Path) -> None:
    """nats-server itself parses the shipped config (`-t`), with a certificate where the Secret is mounted and the
    passwords in its environment, as the statefulset gives them."""
    tls = natsauth.make_tls(tmp_path / "tls", hosts=["pulse-nats"]) if shutil.which("openssl") else None
    if tls is None:
        pytest.skip("openssl not found: cannot make the TLS files the config names")
    (tmp_path / "tls" / "tls.crt").symlink_to(tls.server_cert)
    (tmp_path / "tls" / "tls.key").symlink_to(tls.server_key)
    conf = tmp_path / "config"
    conf.mkdir()
    for name, text in nats_config().items():
        text = text.replace("/etc/nats/tls/", f"{tmp_path}/tls/").replace("/data/", f"{tmp_path}/data/")
        (conf / name).write_text(text)
    users = natsauth.role_users(example_nodes())
    env = {"POD_NAME": "pulse-nats-0", **{natsauth.password_env(u.name): "secret" for u in users}}
    ok = subprocess.run([find_nats_server(), "-t", "-c", str(conf / "nats.conf")], env=env, capture_output=True,
                        text=True, timeout=30, check=False)  # fmt: skip
    assert ok.returncode == 0, ok.stdout + ok.stderr
    # Without the Secret's variables the server refuses to start, instead of running with empty passwords.
    missing = subprocess.run([find_nats_server(), "-t", "-c", str(conf / "nats.conf")], env={"POD_NAME": "x"},
                             capture_output=True, text=True, timeout=30, check=False)  # fmt: skip
    assert missing.returncode != 0 and "PULSE_NATS_PASSWORD_" in missing.stdout + missing.stderr


def test_clients_and_routes_need_tls_and_routes_verify_each_other() -> None:
    conf = nats_config()["nats.conf"]
    client_tls, cluster = conf.split("cluster {", 1)
    assert "tls {" in client_tls and "cert_file: /etc/nats/tls/tls.crt" in client_tls
    assert "tls {" in cluster and "verify: true" in cluster  # a route must show a certificate from the CA
    assert "include ./auth.conf" in conf and "no_auth_user" not in conf


def test_the_monitoring_port_is_on_no_service() -> None:
    docs = nats_docs()
    for name in ("pulse-nats", "pulse-nats-headless"):
        ports = docs[("Service", name)]["spec"]["ports"]
        assert all(p["port"] != 8222 and p.get("name") != "monitor" for p in ports), (name, ports)
    assert [p["port"] for p in docs[("Service", "pulse-nats")]["spec"]["ports"]] == [4222]


def test_the_network_policy_admits_clients_on_4222_and_peers_on_6222_only() -> None:
    policy = nats_docs()[("NetworkPolicy", "pulse-nats")]["spec"]
    assert policy["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "pulse-nats"}}
    assert policy["policyTypes"] == ["Ingress"]
    by_port = {tuple(p["port"] for p in rule["ports"]): rule["from"] for rule in policy["ingress"]}
    assert set(by_port) == {(4222,), (6222,)}  # nothing admits 8222
    assert {"podSelector": {"matchLabels": {"app.kubernetes.io/part-of": "pulsescale"}}} in by_port[(4222,)]
    assert by_port[(6222,)] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "pulse-nats"}}}]
    assert all(peer for peer in by_port[(4222,)]), "an empty peer would admit everyone"


def test_the_statefulset_mounts_the_tls_secret_and_the_passwords() -> None:
    docs = nats_docs()
    pod = docs[("StatefulSet", "pulse-nats")]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert mounts["tls"] == "/etc/nats/tls" and volumes["tls"]["secret"]["secretName"] == "pulse-nats-tls"
    assert container["args"] == ["-c", f"{mounts['config']}/nats.conf"]
    assert {"secretRef": {"name": "pulse-nats-users"}} in container["envFrom"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    cert = docs[("Certificate", "pulse-nats-tls")]["spec"]
    assert cert["secretName"] == "pulse-nats-tls"
    assert {"server auth", "client auth"} <= set(cert["usages"])  # routes are TLS clients of each other
    assert "*.pulse-nats-headless" in cert["dnsNames"] and "pulse-nats" in cert["dnsNames"]
