"""deploy/ as a cluster would get it: the kustomizations built for real, the Pod Security profile each namespace
enforces met by its pods, least-privilege RBAC, the node agent's privileges, the fast-path scheduler's
configuration, the example workload, and every daemon flag in the manifests known to its command.

The build is `kubectl kustomize` (kustomize v5 inside kubectl); where no kubectl is installed, the tests that need
the built output skip and say so, and a small resolver still checks that every path a kustomization names exists.
Objects of other projects' CRDs (ServiceMonitor) get a structural check only: their schemas are not ours to ship.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from kube.records import MODEL_OWNERS_CONFIGMAP
from manifests import scaledobject
from tests.manifests.test_manifests import FOREIGN_GROUPS, validate
from warmpool import natsauth

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
BUILDS = ["base", "overlays/production", "overlays/no-rootfs", "overlays/namespaced", "monitoring"]
"""Every kustomization a user applies directly (the others are parts of these)."""
RESTRICTED = "restricted"
NODE_NAMESPACE = "pulsescale-node"
"""The one namespace whose pods may be privileged: the node agent's."""
BUILD_TIMEOUT_S = 60

Doc = dict[str, Any]


def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        pytest.skip("kubectl not found: the kustomize build is not checked here (the path resolver still is)")
    return path


@cache
def build(target: str) -> tuple[Doc, ...]:
    out = subprocess.run([kubectl(), "kustomize", str(DEPLOY / target)], capture_output=True, text=True,
                         timeout=BUILD_TIMEOUT_S, check=False)  # fmt: skip
    assert out.returncode == 0, f"kubectl kustomize deploy/{target}: {out.stderr}"
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def find(docs: tuple[Doc, ...], kind: str, name: str) -> Doc:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


POD_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "Job", "ReplicaSet"}


def pod_spec(doc: Doc) -> Doc:
    return doc["spec"]["template"]["spec"]  # type: ignore[no-any-return]


# --- kustomizations -------------------------------------------------------------------------------------------------


def test_every_path_a_kustomization_names_exists() -> None:
    """Without kubectl too: resources are files or directories with a kustomization of their own."""
    kfiles = sorted(DEPLOY.rglob("kustomization.yaml"))
    assert kfiles
    for kfile in kfiles:
        for res in yaml.safe_load(kfile.read_text()).get("resources", []):
            target = kfile.parent / res
            assert target.is_file() or (target / "kustomization.yaml").is_file(), f"{kfile}: {res} does not exist"


@pytest.mark.parametrize("target", BUILDS)
def test_the_kustomization_builds_and_every_object_validates(target: str) -> None:
    """The built output, patches applied, against the Kubernetes schemas; every namespaced object has a namespace."""
    docs = build(target)
    assert docs
    cluster_scoped = {"Namespace", "CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding", "PriorityClass"}
    for doc in docs:
        if not str(doc["apiVersion"]).startswith(FOREIGN_GROUPS):
            validate(doc)
        if doc["kind"] not in cluster_scoped:
            assert doc["metadata"].get("namespace"), f"{doc['kind']}/{doc['metadata']['name']} has no namespace"


def test_the_base_installs_everything_and_puts_each_part_in_its_namespace() -> None:
    docs = build("base")
    where = {(d["kind"], d["metadata"]["name"]): d["metadata"].get("namespace") for d in docs}
    assert where[("CustomResourceDefinition", "scaledobjects.pulsescale.io")] is None
    assert where[("StatefulSet", "pulse-nats")] == "pulsescale"
    assert where[("Deployment", "pulsescale-autoscaler")] == "pulsescale"
    assert where[("Deployment", "pulsescale-operator")] == "pulsescale"
    assert where[("Deployment", "pulsescale-fast-scheduler")] == "pulsescale"
    assert where[("DaemonSet", "pulsescale-agent")] == NODE_NAMESPACE
    # A kustomization's `namespace:` moves everything under it: this one must stay where its Role is.
    assert where[("RoleBinding", "pulsescale-fast-scheduler-auth-reader")] == "kube-system"
    assert ("PriorityClass", "pulsescale-serving") in where


def test_the_production_overlay_changes_what_it_says() -> None:
    base, prod = build("base"), build("overlays/production")
    agent = pod_spec(find(prod, "DaemonSet", "pulsescale-agent"))
    args = agent["containers"][0]["args"]
    assert "--slots=4" in args and "--shm-budget=400GiB" in args and "--slots=2" not in args
    assert agent["nodeSelector"]["pulsescale.io/gpu-node"] == "true"  # the base's selector is kept, narrowed
    assert agent["nodeSelector"]["nvidia.com/gpu.product"]
    for kind, name in [("Deployment", "pulsescale-autoscaler"), ("Deployment", "pulsescale-operator")]:
        spec = pod_spec(find(prod, kind, name))
        assert spec["containers"][0]["image"] == "registry.example.com/platform/pulsescale:0.1.0"
        assert spec["nodeSelector"] == {"node-pool": "system"}
    kinds = {d["kind"] for d in prod} - {d["kind"] for d in base}
    assert {"ServiceMonitor", "Certificate", "Issuer"} <= kinds


def test_without_the_rootfs_the_agent_is_not_privileged() -> None:
    spec = pod_spec(find(build("overlays/no-rootfs"), "DaemonSet", "pulsescale-agent"))
    (c,) = spec["containers"]
    assert not any(a.startswith("--image") for a in c["args"])
    assert c["securityContext"]["privileged"] is False
    assert c["securityContext"]["capabilities"] == {
        "drop": ["ALL"],
        "add": ["IPC_LOCK", "SETUID", "SETGID", "CHOWN", "FOWNER", "KILL"],
    }
    assert all("mountPropagation" not in m for m in c["volumeMounts"])


# --- Pod Security ---------------------------------------------------------------------------------------------------

RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}  # fmt: skip
"""The volume types the restricted profile admits (Pod Security Standards)."""


def restricted_violations(spec: Doc) -> list[str]:
    """What keeps a pod spec out of the `restricted` Pod Security profile (the checks of the Pod Security admission
    that a manifest can fail: host namespaces, privileged, capabilities, volume types, host ports, privilege
    escalation, running as non-root, seccomp). Empty: admitted."""
    out = []
    pod_sc = spec.get("securityContext", {})
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(field):
            out.append(f"{field}: true")
    for v in spec.get("volumes", []):
        kinds = set(v) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            out.append(f"volume {v['name']}: {sorted(kinds)}")
    if pod_sc.get("runAsUser") == 0:
        out.append("pod runAsUser: 0")
    for c in spec.get("initContainers", []) + spec["containers"]:
        sc, name = c.get("securityContext", {}), c["name"]
        if sc.get("privileged"):
            out.append(f"{name}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{name}: allowPrivilegeEscalation is not false")
        caps = sc.get("capabilities", {})
        if "ALL" not in caps.get("drop", []):
            out.append(f"{name}: capabilities do not drop ALL")
        if set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            out.append(f"{name}: adds {caps['add']}")
        if sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is not True:
            out.append(f"{name}: runAsNonRoot is not true")
        if sc.get("runAsUser") == 0:
            out.append(f"{name}: runAsUser: 0")
        seccomp = sc.get("seccompProfile", pod_sc.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{name}: seccompProfile {seccomp}")
        if any("hostPort" in p for p in c.get("ports", [])):
            out.append(f"{name}: hostPort")
    return out


def test_the_restricted_check_refuses_what_the_profile_refuses() -> None:
    """The checker is not vacuous: each rule it knows catches a pod that breaks it."""
    good = pod_spec(find(build("base"), "Deployment", "pulsescale-autoscaler"))
    assert restricted_violations(good) == []
    breaks: list[Callable[[Doc], object]] = [
        lambda s: s.update(hostIPC=True),
        lambda s: s["volumes"].append({"name": "h", "hostPath": {"path": "/"}}),
        lambda s: s["containers"][0]["securityContext"].update(privileged=True),
        lambda s: s["containers"][0]["securityContext"].pop("allowPrivilegeEscalation"),
        lambda s: s["containers"][0]["securityContext"].update(capabilities={"drop": ["NET_RAW"]}),
        lambda s: s["containers"][0]["securityContext"].update(capabilities={"drop": ["ALL"], "add": ["SYS_ADMIN"]}),
        lambda s: s["securityContext"].pop("runAsNonRoot"),
        lambda s: s["securityContext"].pop("seccompProfile"),
        lambda s: s["containers"][0]["securityContext"].update(runAsUser=0),
    ]
    for i, breaker in enumerate(breaks):
        spec = yaml.safe_load(yaml.safe_dump(good))
        breaker(spec)
        assert restricted_violations(spec), f"break #{i} went unnoticed"


@pytest.mark.parametrize("target", ["base", "overlays/production", "overlays/no-rootfs", "overlays/namespaced"])
def test_pods_meet_the_profile_their_namespace_enforces(target: str) -> None:
    docs = build(target)
    levels = {
        d["metadata"]["name"]: d["metadata"]["labels"]["pod-security.kubernetes.io/enforce"]
        for d in docs
        if d["kind"] == "Namespace"
    }
    assert levels == {"pulsescale": RESTRICTED, NODE_NAMESPACE: "privileged"}
    for d in docs:
        if d["kind"] in POD_KINDS:
            ns = d["metadata"]["namespace"]
            assert ns in levels, f"{d['kind']}/{d['metadata']['name']} in {ns}, whose profile this install sets not"
            if levels[ns] == RESTRICTED:
                assert restricted_violations(pod_spec(d)) == [], d["metadata"]["name"]
            else:
                assert d["metadata"]["name"] == "pulsescale-agent", "only the agent runs in the privileged namespace"


# --- RBAC -----------------------------------------------------------------------------------------------------------

OPERATOR_RULES = {
    ("pulsescale.io", "scaledobjects"): {"get", "list", "watch", "patch"},
    ("pulsescale.io", "scaledobjects/status"): {"patch"},
    ("pulsescale.io", "scaledobjects/finalizers"): {"update"},
    ("", "pods"): {"list", "watch", "create", "delete", "patch"},
    ("apps", "deployments"): {"get"},
    ("apps", "statefulsets"): {"get"},
    ("apps", "deployments/scale"): {"get", "patch"},
    ("apps", "statefulsets/scale"): {"get", "patch"},
    ("autoscaling", "horizontalpodautoscalers"): {"list"},
    ("", "events"): {"create", "patch"},
}
"""The operator's permissions where it serves ScaledObjects (cluster-wide in the base, a Role per watched namespace
in overlays/namespaced), exactly: what kube/ calls. A change here is a reviewed widening."""
OPERATOR_HOME_RULES = {
    ("coordination.k8s.io", "leases"): {"get", "create", "update"},
    ("", "configmaps"): {"get", "create", "update"},
}
"""In its own namespace only: the leader-election Lease and the ConfigMap of model owners, each by name."""
OPERATOR_HOME_ROLES = ("pulsescale-operator-leader", "pulsescale-operator-model-owners")
OPERATOR_HOME_OBJECTS = {
    ("coordination.k8s.io", "leases"): "--lease-name",
    ("", "configmaps"): MODEL_OWNERS_CONFIGMAP,
}
"""What each home rule's resourceNames must name: the flag that names the Lease, the ConfigMap's fixed name."""


def flatten(role: Doc) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for res in rule["resources"]:
                out.setdefault((group, res), set()).update(rule["verbs"])
    return out


def home_rules(docs: tuple[Doc, ...]) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for name in OPERATOR_HOME_ROLES:
        role = find(docs, "Role", name)
        assert role["metadata"]["namespace"] == "pulsescale", name
        for key, verbs in flatten(role).items():
            out.setdefault(key, set()).update(verbs)
    return out


def test_the_operator_has_exactly_the_verbs_it_uses() -> None:
    docs = build("base")
    assert flatten(find(docs, "ClusterRole", "pulsescale-operator")) == OPERATOR_RULES
    assert home_rules(docs) == OPERATOR_HOME_RULES


@pytest.mark.parametrize("target", ["base", "overlays/namespaced"])
def test_the_lease_and_the_model_owners_are_granted_by_name_and_create_is_a_rule_of_its_own(target: str) -> None:
    """Kubernetes cannot limit create by resourceNames: create is a rule alone (create only), and every other verb
    on the Lease and the ConfigMap is limited to the one the operator uses."""
    docs = build(target)
    (c,) = pod_spec(find(docs, "Deployment", "pulsescale-operator"))["containers"]
    for name in OPERATOR_HOME_ROLES:
        for rule in find(docs, "Role", name)["rules"]:
            ((group, resource),) = {(g, r) for g in rule["apiGroups"] for r in rule["resources"]}
            named = OPERATOR_HOME_OBJECTS[(group, resource)]
            named = flag(c["args"], named) if named.startswith("--") else named
            if rule.get("resourceNames"):
                assert rule["resourceNames"] == [named] and "create" not in rule["verbs"], (name, rule)
            else:
                assert rule["verbs"] == ["create"], f"{name}: {rule['verbs']} on every {resource} of the namespace"


def test_the_namespaced_overlay_has_a_role_in_each_watched_namespace_and_nothing_cluster_wide() -> None:
    docs = build("overlays/namespaced")
    (c,) = pod_spec(find(docs, "Deployment", "pulsescale-operator"))["containers"]
    watched = {a.split("=", 1)[1] for a in c["args"] if a.startswith("--namespace=")}
    assert watched and not any(a in ("-A", "--all-namespaces") for a in c["args"])
    operator_sa = ("pulsescale", "pulsescale-operator")
    bound = [d for d in docs if d["kind"] in ("RoleBinding", "ClusterRoleBinding")
             and any((s.get("namespace"), s["name"]) == operator_sa for s in d["subjects"])]  # fmt: skip
    assert not [b for b in bound if b["kind"] == "ClusterRoleBinding"], "a cluster-wide binding of the operator"
    assert not [d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"].startswith("pulsescale-op")]
    served = {b["metadata"]["namespace"] for b in bound if b["roleRef"]["name"] == "pulsescale-operator"}
    assert served == watched, f"Roles in {sorted(served)}, but the operator watches {sorted(watched)}"
    for ns in watched:
        binding = find(tuple(d for d in docs if d["metadata"].get("namespace") == ns), "RoleBinding",
                       "pulsescale-operator")  # fmt: skip
        assert binding["roleRef"]["kind"] == "Role"
        role = find(tuple(d for d in docs if d["metadata"].get("namespace") == ns), "Role", "pulsescale-operator")
        assert flatten(role) == OPERATOR_RULES, ns  # what the base's ClusterRole grants, in this namespace only
    assert home_rules(docs) == OPERATOR_HOME_RULES  # the Lease and the model owners as in the base


KUBE = Path(__file__).resolve().parents[2] / "kube"
_CLIENT_CALL = re.compile(r"\b(read|get|list|create|patch|replace|delete)_namespaced_([a-z_]+?)(_status|_scale)?\b")
_CLIENT_VERB = {"read": "get", "get": "get", "list": "list", "create": "create", "patch": "patch",
                "replace": "update", "delete": "delete"}  # fmt: skip
_CLIENT_RESOURCE = {
    # kubernetes client name -> (API group, resource). Custom objects are always ours (kube/ passes GROUP, PLURAL).
    "custom_object": ("pulsescale.io", "scaledobjects"),
    "pod": ("", "pods"),
    "event": ("", "events"),
    "deployment": ("apps", "deployments"),
    "stateful_set": ("apps", "statefulsets"),
    "horizontal_pod_autoscaler": ("autoscaling", "horizontalpodautoscalers"),
    "lease": ("coordination.k8s.io", "leases"),
    "config_map": ("", "configmaps"),
}
NOT_IN_THE_CODE = {
    # What no kubernetes-client call in kube/ shows, with the reason.
    ("pulsescale.io", "scaledobjects"): {"list", "watch", "patch"},  # kopf watches them, patches finalizer/progress
    ("", "pods"): {"list", "watch"},  # kopf watches standby pods (kube/standby.py `kopf.on.event`)
    ("pulsescale.io", "scaledobjects/finalizers"): {"update"},  # ownerReference with blockOwnerDeletion
}


def calls_in_kube() -> dict[tuple[str, str], set[str]]:
    """(group, resource[/subresource]) -> verbs, from every kubernetes-client call written in kube/*.py."""
    out: dict[tuple[str, str], set[str]] = {}
    for source in sorted(KUBE.glob("*.py")):
        for verb, name, sub in _CLIENT_CALL.findall(source.read_text()):
            assert name in _CLIENT_RESOURCE, f"{source.name}: {verb}_namespaced_{name}: add it to _CLIENT_RESOURCE"
            group, resource = _CLIENT_RESOURCE[name]
            out.setdefault((group, resource + sub.replace("_", "/")), set()).add(_CLIENT_VERB[verb])
    return out


def test_the_operator_s_roles_grant_what_kube_calls_and_nothing_more() -> None:
    """Derived from the code (not from the list above): a call added to or removed from kube/ changes this."""
    needed = calls_in_kube()
    for key, verbs in NOT_IN_THE_CODE.items():
        needed.setdefault(key, set()).update(verbs)
    docs = build("base")
    cluster = flatten(find(docs, "ClusterRole", "pulsescale-operator"))
    home = home_rules(docs)
    assert set(cluster) & set(home) == set(), "a resource in both roles"
    granted = {**cluster, **home}
    missing = {k: sorted(v - granted.get(k, set())) for k, v in needed.items() if v - granted.get(k, set())}
    extra = {k: sorted(v - needed.get(k, set())) for k, v in granted.items() if v - needed.get(k, set())}
    assert not missing, f"kube/ calls what its roles do not grant: {missing}"
    assert not extra, f"the roles grant what kube/ never calls: {extra}"
    assert set(home) == set(OPERATOR_HOME_RULES)  # the Lease and the model owners only in the operator's namespace


def test_the_operator_leads_through_a_lease_in_its_namespace_and_is_probed_on_its_pod_ip() -> None:
    docs = build("base")
    deployment = find(docs, "Deployment", "pulsescale-operator")
    (c,) = pod_spec(deployment)["containers"]
    env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in c["env"]}
    assert env["POD_NAME"] == "metadata.name" and env["POD_NAMESPACE"] == "metadata.namespace"
    assert env["POD_IP"] == "status.podIP"
    assert flag(c["args"], "--lease-namespace") == "$(POD_NAMESPACE)"
    assert flag(c["args"], "--identity") == "$(POD_NAME)"
    assert flag(c["args"], "--health-host") == "$(POD_IP)"  # loopback by default: the kubelet could not reach it
    # the Roles of the Lease and the model owners are bound in the namespace the pod runs in ($(POD_NAMESPACE))
    for name in OPERATOR_HOME_ROLES:
        role, binding = find(docs, "Role", name), find(docs, "RoleBinding", name)
        assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == deployment["metadata"]["namespace"]
    port = int(flag(c["args"], "--health-port"))
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz" and c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    for probe in (c["livenessProbe"], c["readinessProbe"]):
        named = probe["httpGet"]["port"]
        assert ports.get(named, named) == port


def test_no_wildcards_no_secrets_no_cluster_admin() -> None:
    docs = build("overlays/production")
    for role in (d for d in docs if d["kind"] in ("Role", "ClusterRole")):
        for rule in role["rules"]:
            for field in ("apiGroups", "resources", "verbs"):
                assert "*" not in rule.get(field, []), (role["metadata"]["name"], rule)
            assert "secrets" not in rule["resources"], role["metadata"]["name"]
            assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"]), role["metadata"]["name"]
    for binding in (d for d in docs if d["kind"] in ("RoleBinding", "ClusterRoleBinding")):
        assert binding["roleRef"]["name"] not in ("cluster-admin", "admin", "edit"), binding["metadata"]["name"]


def test_the_autoscaler_and_the_agent_have_no_kubernetes_token() -> None:
    docs = build("overlays/production")
    subjects = {
        (s.get("namespace"), s["name"])
        for d in docs
        if d["kind"] in ("RoleBinding", "ClusterRoleBinding")
        for s in d["subjects"]
    }
    for kind, name, ns in [("Deployment", "pulsescale-autoscaler", "pulsescale"),
                           ("DaemonSet", "pulsescale-agent", NODE_NAMESPACE),
                           ("StatefulSet", "pulse-nats", "pulsescale")]:  # fmt: skip
        spec = pod_spec(find(docs, kind, name))
        assert spec["automountServiceAccountToken"] is False, name
        sa = spec.get("serviceAccountName", "default")
        assert (ns, sa) not in subjects, f"{name}'s ServiceAccount is bound to a role"
        if sa != "default":
            assert find(docs, "ServiceAccount", sa)["automountServiceAccountToken"] is False


# --- the daemons' pods ----------------------------------------------------------------------------------------------


def flag(args: list[str], name: str) -> str:
    values = [a.split("=", 1)[1] for a in args if a.startswith(f"{name}=")]
    assert len(values) == 1, f"{name} in {args}"
    return values[0]


def secret_key_mounted_at(spec: Doc, container: Doc, path: str) -> tuple[str, str]:
    """(Secret name, key) of the file at `path`: a Secret volume with one item, mounted at the file's directory."""
    directory, filename = path.rsplit("/", 1)
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == directory]
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    (item,) = volume["secret"]["items"]
    assert item["path"] == filename
    return volume["secret"]["secretName"], item["key"]


@pytest.mark.parametrize(
    ("name", "role"), [("pulsescale-autoscaler", "autoscaler"), ("pulsescale-operator", "operator")]
)
def test_a_daemon_gets_its_own_nats_password_and_only_the_ca(name: str, role: str) -> None:
    spec = pod_spec(find(build("base"), "Deployment", name))
    (c,) = spec["containers"]
    assert flag(c["args"], "--nats-user") == role
    secret, key = secret_key_mounted_at(spec, c, flag(c["args"], "--nats-password-file"))
    assert (secret, key) == ("pulse-nats-users", natsauth.password_env(role))  # the variable the server reads
    assert secret_key_mounted_at(spec, c, flag(c["args"], "--nats-tls-ca")) == ("pulse-nats-tls", "ca.crt")
    assert not any(e["name"].startswith("PULSESCALE_NATS_PASSWORD") for e in c.get("env", []))
    assert find(build("base"), "Deployment", name)["spec"]["replicas"] == 2


@pytest.mark.parametrize("target", ["base", "overlays/production", "overlays/namespaced", "overlays/no-rootfs"])
def test_nodes_are_bound_to_their_models_by_default(target: str) -> None:
    """The security review's M3 on a default install: the operator assigns each node the models of its standby
    pods (it is not told --no-assignments) and the autoscaler claims nothing of a node without an assignment."""
    docs = build(target)
    (autoscaler,) = pod_spec(find(docs, "Deployment", "pulsescale-autoscaler"))["containers"]
    (operator,) = pod_spec(find(docs, "Deployment", "pulsescale-operator"))["containers"]
    assert "--require-assignment" in autoscaler["args"]
    assert "--no-assignments" not in operator["args"]


def test_the_autoscaler_probes_its_health_endpoints_on_its_metrics_port() -> None:
    (c,) = pod_spec(find(build("base"), "Deployment", "pulsescale-autoscaler"))["containers"]
    port = int(flag(c["args"], "--metrics-port"))
    assert flag(c["args"], "--metrics-host") == "$(POD_IP)"  # loopback by default: the kubelet could not reach it
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"metrics": port}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]


def test_the_agent_daemonset_has_what_the_node_needs_and_says_why() -> None:
    ds = find(build("base"), "DaemonSet", "pulsescale-agent")
    spec = pod_spec(ds)
    (c,) = spec["containers"]
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    shm = flag(c["args"], "--shm-dir")
    assert volumes[mounts[shm]["name"]]["hostPath"]["path"] == shm  # staged weights outlive the pod
    rootfs = flag(c["args"], "--rootfs-dir")
    assert mounts[rootfs]["mountPropagation"] == "Bidirectional"
    # The API server admits Bidirectional propagation only in a privileged container.
    assert c["securityContext"]["privileged"] is True
    assert spec["hostIPC"] is False and spec["hostNetwork"] is False
    assert spec["nodeSelector"] == {"pulsescale.io/gpu-node": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    assert "limits" not in c["resources"]  # tmpfs pages of the staged weights are charged to this cgroup
    # Each node's own user and password file, never a shared Secret (every agent would have every password).
    assert flag(c["args"], "--nats-user") == "agent-$(NODE_NAME)"
    password_dir = flag(c["args"], "--nats-password-file").rsplit("/", 1)[0]
    assert "hostPath" in volumes[mounts[password_dir]["name"]]
    assert not any("secret" in v for v in spec["volumes"])
    text = (DEPLOY / "base" / "node-agent" / "daemonset.yaml").read_text()
    for why in ("SYS_ADMIN", "IPC_LOCK", "SETUID", "/dev/loop", "hostIPC stays false"):
        assert why in text, f"the DaemonSet does not say why: {why}"


def test_the_agents_can_reach_nats_through_its_network_policy() -> None:
    docs = build("base")
    policy = find(docs, "NetworkPolicy", "pulse-nats")["spec"]
    (client_rule,) = [r for r in policy["ingress"] if r["ports"] == [{"port": 4222, "protocol": "TCP"}]]
    agent_labels = find(docs, "DaemonSet", "pulsescale-agent")["spec"]["template"]["metadata"]["labels"]
    ns_labels = find(docs, "Namespace", NODE_NAMESPACE)["metadata"]["labels"]
    admitted = [
        peer
        for peer in client_rule["from"]
        if peer.get("namespaceSelector")
        and peer["namespaceSelector"]["matchLabels"].items() <= ns_labels.items()
        and peer["podSelector"]["matchLabels"].items() <= agent_labels.items()
    ]
    assert admitted, "no NetworkPolicy peer admits the agents' pods from their namespace"


HELP_TIMEOUT_S = 60


@cache
def command_flags(command: str) -> frozenset[str]:
    out = subprocess.run([sys.executable, "-m", "pulsescale", command, "--help"], capture_output=True, text=True,
                         timeout=HELP_TIMEOUT_S, check=False)  # fmt: skip
    if "not available yet" in out.stdout + out.stderr:
        pytest.skip(f"`pulsescale {command}` is not in this version yet")
    assert out.returncode == 0, out.stderr
    return frozenset(re.findall(r"(--[a-z][a-z0-9-]*)", out.stdout))


@pytest.mark.parametrize(
    ("kind", "name"),
    [("Deployment", "pulsescale-autoscaler"), ("Deployment", "pulsescale-operator"), ("DaemonSet", "pulsescale-agent")],
)
def test_every_flag_in_a_manifest_is_one_its_command_takes(kind: str, name: str) -> None:
    for target in ("base", "overlays/production", "overlays/namespaced"):
        (c,) = pod_spec(find(build(target), kind, name))["containers"]
        command, *args = c["args"]
        assert c["command"] == ["pulsescale"]
        unknown = {a.split("=", 1)[0] for a in args} - command_flags(command)
        assert not unknown, f"{target} {name}: `pulsescale {command}` has no {sorted(unknown)}"


# --- the fast-path scheduler ----------------------------------------------------------------------------------------

SCHEDULER_FIELDS = {"apiVersion", "kind", "parallelism", "leaderElection", "clientConnection", "enableProfiling",
                    "enableContentionProfiling", "percentageOfNodesToScore", "podInitialBackoffSeconds",
                    "podMaxBackoffSeconds", "profiles", "extenders", "delayCacheUntilActive"}  # fmt: skip
"""KubeSchedulerConfiguration (kubescheduler.config.k8s.io/v1) top-level fields."""
PROFILE_FIELDS = {"schedulerName", "percentageOfNodesToScore", "plugins", "pluginConfig"}
EXTENSION_POINTS = {"preEnqueue", "queueSort", "preFilter", "filter", "postFilter", "preScore", "score", "reserve",
                    "permit", "preBind", "bind", "postBind", "multiPoint"}  # fmt: skip
SCORE_PLUGINS = {"ImageLocality", "InterPodAffinity", "NodeAffinity", "NodeResourcesBalancedAllocation",
                 "NodeResourcesFit", "PodTopologySpread", "TaintToleration", "VolumeBinding"}  # fmt: skip
"""The in-tree plugins with a score extension (kube-scheduler 1.33's default registry)."""
LEADER_ELECTION_FIELDS = {"leaderElect", "leaseDuration", "renewDeadline", "retryPeriod", "resourceLock",
                          "resourceName", "resourceNamespace"}  # fmt: skip
SCORING_STRATEGIES = {"LeastAllocated", "MostAllocated", "RequestedToCapacityRatio"}
MAX_SCORE_WEIGHT = 100


def scheduler_config_problems(cfg: Doc) -> list[str]:
    """What kube-scheduler would refuse in this configuration, for the parts we use: unknown fields (it decodes
    strictly), ranges (percentage 0..100, weights 1..100), unknown plugins and extension points, duplicate profiles,
    and NodeResourcesFit's scoring strategy."""
    out = []
    if (cfg.get("apiVersion"), cfg.get("kind")) != ("kubescheduler.config.k8s.io/v1", "KubeSchedulerConfiguration"):
        out.append(f"apiVersion/kind: {cfg.get('apiVersion')}/{cfg.get('kind')}")
    out += [f"unknown field {f}" for f in set(cfg) - SCHEDULER_FIELDS]
    out += [f"leaderElection: unknown field {f}" for f in set(cfg.get("leaderElection", {})) - LEADER_ELECTION_FIELDS]
    names = [p.get("schedulerName") for p in cfg.get("profiles", [])]
    if not names or len(set(names)) != len(names) or None in names:
        out.append(f"profiles need unique schedulerNames: {names}")
    for prof in cfg.get("profiles", []):
        where = f"profile {prof.get('schedulerName')}"
        out += [f"{where}: unknown field {f}" for f in set(prof) - PROFILE_FIELDS]
        pct = prof.get("percentageOfNodesToScore", 0)
        if not 0 <= pct <= 100:
            out.append(f"{where}: percentageOfNodesToScore {pct} not in 0..100")
        for point, sets in prof.get("plugins", {}).items():
            if point not in EXTENSION_POINTS:
                out.append(f"{where}: unknown extension point {point}")
                continue
            for plugin in sets.get("enabled", []) + sets.get("disabled", []):
                if point == "score" and plugin["name"] not in SCORE_PLUGINS | {"*"}:
                    out.append(f"{where}: {plugin['name']} has no score extension")
        for pc in prof.get("pluginConfig", []):
            if pc["name"] != "NodeResourcesFit":
                continue
            strategy = pc["args"].get("scoringStrategy", {})
            if strategy.get("type") not in SCORING_STRATEGIES:
                out.append(f"{where}: NodeResourcesFit scoringStrategy type {strategy.get('type')}")
            for res in strategy.get("resources", []):
                if not 1 <= res.get("weight", 0) <= MAX_SCORE_WEIGHT:
                    out.append(f"{where}: weight of {res.get('name')} not in 1..{MAX_SCORE_WEIGHT}")
    return out


def scheduler_config() -> Doc:
    cm = find(build("base"), "ConfigMap", "pulsescale-fast-scheduler")
    return yaml.safe_load(cm["data"]["config.yaml"])  # type: ignore[no-any-return]


def test_the_scheduler_profile_is_a_valid_configuration_that_bin_packs_gpus() -> None:
    cfg = scheduler_config()
    assert scheduler_config_problems(cfg) == []
    (profile,) = cfg["profiles"]
    assert profile["schedulerName"] == "pulsescale-fast"
    (fit,) = [pc for pc in profile["pluginConfig"] if pc["name"] == "NodeResourcesFit"]
    assert fit["args"]["scoringStrategy"]["type"] == "MostAllocated"
    assert {"name": "nvidia.com/gpu", "weight": 5} in fit["args"]["scoringStrategy"]["resources"]
    disabled = {p["name"] for p in profile["plugins"]["score"]["disabled"]}
    assert "NodeResourcesBalancedAllocation" in disabled  # it would undo the bin-packing
    # The scheduler's lease is the one its Role names.
    role = find(build("base"), "Role", "pulsescale-fast-scheduler-leader")
    assert [cfg["leaderElection"]["resourceName"]] in [r.get("resourceNames") for r in role["rules"]]


def test_the_scheduler_check_refuses_a_broken_configuration() -> None:
    cfg = scheduler_config()
    cfg["percentageOfNodeToScore"] = 10  # misspelt: kube-scheduler's strict decoding refuses it
    cfg["profiles"][0]["percentageOfNodesToScore"] = 150
    cfg["profiles"][0]["plugins"]["score"]["disabled"].append({"name": "NodeResourceFit"})
    cfg["profiles"][0]["pluginConfig"][0]["args"]["scoringStrategy"]["type"] = "MostAlocated"
    cfg["profiles"].append({"schedulerName": "pulsescale-fast"})
    assert len(scheduler_config_problems(cfg)) == 5, scheduler_config_problems(cfg)


# --- examples and monitoring ----------------------------------------------------------------------------------------


def example_docs() -> list[Doc]:
    return [d for p in sorted((DEPLOY / "examples").glob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]


def test_the_example_scaledobject_targets_the_example_deployment_and_the_service_selects_serving_pods() -> None:
    docs = example_docs()
    so = next(d for d in docs if d["kind"] == "ScaledObject" and d["metadata"]["name"] == "qwen-chat")
    record = scaledobject.from_manifest(so)
    target = so["spec"]["scaleTargetRef"]
    deployment = next(d for d in docs if d["kind"] == target["kind"] and d["metadata"]["name"] == target["name"])
    assert deployment["metadata"]["namespace"] == record.namespace
    template = deployment["spec"]["template"]
    spec = template["spec"]
    assert spec["schedulerName"] == "pulsescale-fast" and spec["priorityClassName"] == "pulsescale-serving"
    service = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == target["name"])
    assert service["spec"]["selector"]["pulsescale.io/serving"] == "true"
    assert service["spec"]["selector"].items() <= template["metadata"]["labels"].items()
    # A flip of serving must not move a pod in or out of the ReplicaSet.
    assert "pulsescale.io/serving" not in deployment["spec"]["selector"]["matchLabels"]
    # Everything restricted asks, but the one read-only hostPath of the staged weights.
    problems = restricted_violations(spec)
    assert problems == ["volume weights: ['hostPath']"], problems
    (weights,) = spec["volumes"]
    assert weights["hostPath"]["path"].startswith("/dev/shm/pulsescale/")
    assert all(m.get("readOnly") for m in spec["containers"][0]["volumeMounts"])


def test_the_service_monitors_point_at_services_and_ports_that_exist() -> None:
    """Structural check only (monitoring.coreos.com/v1 is the Prometheus Operator's CRD): each selects a Service of
    the build, in the namespace it names, by a port name that Service has; the gateway's selects the Services users
    make for their gateways (in any namespace: deploy/ ships no gateway), by the label and port name it documents."""
    docs = build("overlays/production")
    monitors = [d for d in docs if d["kind"] == "ServiceMonitor"]
    assert {m["metadata"]["name"] for m in monitors} == {
        "pulsescale-autoscaler",
        "pulsescale-agent",
        "pulsescale-operator",
        "pulsescale-gateway",
    }
    for m in monitors:
        assert m["apiVersion"] == "monitoring.coreos.com/v1"
        spec = m["spec"]
        assert set(spec) <= {"selector", "namespaceSelector", "endpoints", "jobLabel"}
        if m["metadata"]["name"] == "pulsescale-gateway":
            assert spec["namespaceSelector"] == {"any": True}
            assert [(ep["port"], ep["path"]) for ep in spec["endpoints"]] == [("metrics", "/metrics")]
            continue
        services = [
            s
            for s in docs
            if s["kind"] == "Service"
            and s["metadata"]["namespace"] in spec["namespaceSelector"]["matchNames"]
            and spec["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()
        ]
        assert services, m["metadata"]["name"]
        for service in services:  # ...whose ports lead to a port of the pods it selects
            ns, selector = service["metadata"]["namespace"], service["spec"]["selector"].items()
            pods = [d for d in docs if d["kind"] in POD_KINDS and d["metadata"]["namespace"] == ns
                    and selector <= d["spec"]["template"]["metadata"]["labels"].items()]  # fmt: skip
            assert pods, service["metadata"]["name"]
            named = {p.get("name") for d in pods for c in pod_spec(d)["containers"] for p in c.get("ports", [])}
            assert {p["targetPort"] for p in service["spec"]["ports"]} <= named, service["metadata"]["name"]
        for ep in spec["endpoints"]:
            assert set(ep) <= {"port", "path", "interval", "scrapeTimeout", "relabelings", "metricRelabelings"}
            assert all(ep["port"] in {p["name"] for p in s["spec"]["ports"]} for s in services)
            assert re.fullmatch(r"\d+s", ep["interval"])
