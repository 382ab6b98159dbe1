"""`pulsescale get|describe|delete`, run through the dispatcher against a real nats-server: ScaledObjects written
by the real `apply`, status and pool answered by a running `CommandService` (its controller is the in-memory
double of test_commands, whose rows carry no `key`: the join falls back to the model)."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
import yaml
from nats.aio.client import Client

from autoscaler.commands.service import CommandService
from pulsescale import cli as dispatcher
from tests.autoscaler.test_commands import ControlPlaneDouble, make_spec, serving
from warmpool.embedded import NatsServer
from warmpool.protocol import DecisionRow
from warmpool.registry import KvSlotStore
from warmpool.seed import seed_pool


def so(name: str, model: str, *, namespace: str = "default", lo: int = 1, hi: int = 8, extra: str = "") -> str:
    return f"""apiVersion: pulsescale.io/v1alpha1
kind: ScaledObject
metadata:
  name: {name}
  namespace: {namespace}
{extra}spec:
  scaleTargetRef: {{name: {model}-server}}
  minReplicaCount: {lo}
  maxReplicaCount: {hi}
  warmPool: {{size: 2}}
  triggers:
    - type: gateway-queue
      metadata: {{model: {model}, targetQueueDepth: 4}}
"""


EXAMPLES = Path(__file__).resolve().parents[2] / "deploy" / "examples"


@pytest.fixture
def control() -> ControlPlaneDouble:
    c = ControlPlaneDouble({"qwen": make_spec("qwen", 1, 8), "llama": make_spec("llama", 0, 4)})
    c.decisions["qwen"] = [DecisionRow(ts=time.time() - 300, desired=2, reason="demand 7.5 / target 4 per replica")]
    return c


@pytest.fixture
async def service(nc: Client, store: KvSlotStore, control: ControlPlaneDouble) -> AsyncIterator[CommandService]:
    await seed_pool(store, "qwen", nodes=2, slots_per_node=1)
    async with serving(nc, control, store) as svc:
        yield svc


@pytest.fixture
def manifests(tmp_path: Path) -> Path:
    """A directory as `apply -f DIR` reads it: one file, one two-document stream, and a file that is skipped."""
    d = tmp_path / "so"
    d.mkdir()
    (d / "qwen.yaml").write_text(so("qwen", "qwen"))
    (d / "more.yml").write_text(so("llama", "llama", lo=0, hi=4) + "---\n" + so("mistral", "mistral", namespace="prod"))
    (d / "README.md").write_text("not a manifest")
    return d


@pytest.fixture
def cli(nats_server: NatsServer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """`pulsescale VERB ARGS` in a thread (its own event loop) while the service answers in the test's loop:
    (exit code, stdout, stderr). `stdin` feeds `-f -`."""
    monkeypatch.setenv("PULSESCALE_USER", "oncall-bob")

    async def run(verb: str, *args: str, stdin: str = "") -> tuple[int, str, str]:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
        try:
            code = await asyncio.to_thread(dispatcher.main, [verb, *args, "--nats", nats_server.url])
        except SystemExit as exc:  # argparse's usage errors
            code = int(exc.code or 0)
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


async def test_apply_a_directory_then_get_scaledobjects(cli, service: CommandService, manifests: Path) -> None:  # type: ignore[no-untyped-def]
    code, out, err = await cli("apply", "-f", str(manifests))
    assert (code, err) == (0, ""), err
    assert [line.split()[:3] for line in out.splitlines()] == [
        ["scaledobject", "default.llama", "created"],
        ["scaledobject", "prod.mistral", "created"],
        ["scaledobject", "default.qwen", "created"],
    ]
    code, out, err = await cli("get", "scaledobjects")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0].split() == ["NAME", "TARGET", "MIN", "MAX", "READY", "ACTIVE", "FALLBACK", "PAUSED", "AGE"]
    # qwen is held at 1 (its min): replicas, but no demand above activation reported, so not active (KEDA's rule,
    # the CR's Active condition too); llama at 0: not active. Ages are seconds old.
    assert lines[1].split()[:8] == ["llama", "Deployment/llama-server", "0", "4", "True", "False", "False", "False"]
    assert lines[2].split()[:8] == ["qwen", "Deployment/qwen-server", "1", "8", "True", "False", "False", "False"]
    assert lines[1].split()[8].endswith("s") and len(lines) == 3  # mistral is in another namespace
    # Columns line up as kubectl's: three spaces apart, every row's READY under the header's.
    col = lines[0].index("READY")
    assert lines[1][col:].startswith("True") and lines[0][col - 3 : col] == "   "

    code, out, _ = await cli("get", "so", "-A", "-o", "wide")
    rows = [line.split() for line in out.splitlines()]
    assert rows[0] == ["NAMESPACE", "NAME", "TARGET", "MIN", "MAX", "READY", "ACTIVE", "FALLBACK", "PAUSED", "AGE",
                       "MODEL", "DESIRED", "WARM", "MODE", "REASON"]  # fmt: skip
    # mistral has no status row: the autoscaler does not run it (no ScaledObject of its model in the double).
    # Sorted by namespace, then name, as kubectl's -A. No operator mirrors these (apply wrote them): READY and its
    # REASON say whether the autoscaler runs the object.
    assert rows[2][:2] == ["default", "qwen"] and rows[2][10:] == ["qwen", "1", "2", "stable", "AutoscalerRunsIt"]
    assert rows[3][:2] == ["prod", "mistral"] and rows[3][5] == "False"
    assert rows[3][10:] == ["mistral", "-", "-", "-", "NotRunning"]

    code, out, _ = await cli("get", "so", "-n", "prod", "-o", "name")
    assert (code, out) == (0, "scaledobject.pulsescale.io/mistral\n")


async def test_get_as_kubectl_pso_no_headers_jsonpath(cli, service: CommandService, manifests: Path) -> None:  # type: ignore[no-untyped-def]
    """The CRD's short name ``pso`` (and ``scaledobjects.pulsescale.io``), ``--no-headers`` and
    ``-o jsonpath=`` as kubectl prints them, for scripts (no newline added, as kubectl's)."""
    assert (await cli("apply", "-f", str(manifests)))[0] == 0
    _, table, _ = await cli("get", "so")
    for kind in ("pso", "scaledobjects.pulsescale.io"):
        assert await cli("get", kind) == (0, table, "")
    code, out, err = await cli("get", "pso", "--no-headers")
    assert (code, err) == (0, "") and out.splitlines() == table.splitlines()[1:]
    code, out, err = await cli("get", "so", "-A", "-o", "jsonpath={.items[*].metadata.name}")
    assert (code, out, err) == (0, "llama qwen mistral", "")
    template = '{range .items[*]}{.metadata.namespace}/{.metadata.name}={.spec.triggers[0].metadata.model}{"\\n"}{end}'
    code, out, _ = await cli("get", "so", "-A", f"-ojsonpath={template}")
    assert out == "default/llama=llama\ndefault/qwen=qwen\nprod/mistral=mistral\n", out
    code, out, _ = await cli("get", "so", "qwen", "-o", "jsonpath={.spec.maxReplicaCount}")  # one named: the object
    assert (code, out) == (0, "8")
    code, out, err = await cli("get", "so", "-o", "jsonpath={range .items[*]}{.metadata.name}")
    assert code == 2 and "without {end}" in err and out == ""
    code, _, err = await cli("get", "so", "-o", "table")
    assert code == 2 and "invalid choice: 'table'" in err and "jsonpath=TEMPLATE" in err


async def test_get_selects_by_label_and_round_trips_them(cli, service: CommandService, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """``-l`` selects ScaledObjects by their ``metadata.labels`` (kept in the record since revision 12), and
    ``-o yaml`` prints them, so apply reads the same object back."""
    f = tmp_path / "so.yaml"
    docs = [so("qwen", "qwen", extra="  labels: {team: a, tier: gold}\n"),
            so("llama", "llama", extra="  labels: {team: b}\n"), so("mistral", "mistral")]  # fmt: skip
    f.write_text("---\n".join(docs))
    assert (await cli("apply", "-f", str(f)))[0] == 0
    names = "jsonpath={.items[*].metadata.name}"
    assert await cli("get", "so", "-l", "team=a", "-o", names) == (0, "qwen", "")
    assert await cli("get", "so", "-l", "team in (a,b),tier!=gold", "-o", names) == (0, "llama", "")
    assert await cli("get", "so", "-l", "!team", "-o", names) == (0, "mistral", "")
    code, out, err = await cli("get", "so", "-l", "team=c")
    assert (code, out) == (0, "") and "No scaledobjects found" in err
    code, out, _ = await cli("get", "so", "qwen", "-o", "yaml")
    assert "labels:\n    team: a\n    tier: gold\n" in out
    code, out, _ = await cli("apply", "-f", "-", stdin=out)
    assert (code, out.split()[:3]) == (0, ["scaledobject", "default.qwen", "unchanged"]), out
    code, _, err = await cli("get", "so", "-l", "team in (a")
    assert code == 2 and "unbalanced" in err
    code, _, err = await cli("get", "slots", "-l", "team=a")
    assert code == 2 and "only ScaledObjects carry labels" in err


async def test_get_so_yaml_round_trips_through_apply(cli, service: CommandService, manifests: Path) -> None:  # type: ignore[no-untyped-def]
    extra = '  annotations: {pulsescale.io/paused-replicas: "3"}\n'
    assert (await cli("apply", "-f", "-", stdin=so("qwen", "qwen", extra=extra)))[0] == 0
    code, out, err = await cli("get", "so", "qwen", "-o", "yaml")
    assert (code, err) == (0, "")
    doc = yaml.safe_load(out)
    assert (doc["apiVersion"], doc["kind"], doc["metadata"]["name"]) == (
        "pulsescale.io/v1alpha1",
        "ScaledObject",
        "qwen",
    )
    assert doc["metadata"]["annotations"] == {"pulsescale.io/paused-replicas": "3"}
    assert doc["metadata"]["creationTimestamp"].endswith("Z") and "T" in doc["metadata"]["creationTimestamp"]
    assert doc["spec"]["maxReplicaCount"] == 8 and doc["spec"]["triggers"][0]["metadata"]["model"] == "qwen"
    conditions = {c["type"]: c["status"] for c in doc["status"]["conditions"]}
    assert conditions == {"Ready": "True", "Active": "False", "Fallback": "False", "Paused": "True"}
    [decision] = doc["status"]["lastDecisions"]
    assert decision["time"].endswith("Z") and decision["desiredReplicas"] == 2
    # What get printed, apply takes back as the same object: nothing to write.
    code, out, err = await cli("apply", "-f", "-", stdin=out)
    assert (code, err) == (0, "") and out.startswith("scaledobject default.qwen unchanged"), out

    code, out, _ = await cli("get", "so", "-o", "json")
    listed = json.loads(out)
    assert listed["kind"] == "List" and [i["metadata"]["name"] for i in listed["items"]] == ["qwen"]


async def test_get_without_an_autoscaler_lists_records_with_unknown_status(cli, nc: Client, manifests: Path) -> None:  # type: ignore[no-untyped-def]
    assert (await cli("apply", "-f", str(manifests / "qwen.yaml")))[0] == 0
    code, out, err = await cli("get", "so", "--timeout", "500ms")
    assert code == 0
    assert out.splitlines()[1].split()[4:8] == ["Unknown", "Unknown", "Unknown", "False"]
    assert err.startswith("warning: status columns unknown: no autoscaler is answering on pulse.cmd.status")
    code, out, err = await cli("get", "so", "nope")
    assert (code, out) == (1, "") and 'scaledobject "nope" not found in namespace default' in err
    code, out, err = await cli("get", "so", "-n", "empty")
    assert (code, out, err) == (0, "", "No scaledobjects found in namespace empty.\n")


async def test_get_slots_and_models(cli, service: CommandService) -> None:  # type: ignore[no-untyped-def]
    code, out, _ = await cli("get", "slots")
    rows = [line.split() for line in out.splitlines()]
    assert rows[0] == ["NAME", "MODEL", "NODE", "STATE", "AGENT", "RESIDENT", "ENDPOINT"]
    assert rows[1] == ["qwen.node-0.s0", "qwen", "node-0", "warm", "fresh", "yes", "-"]
    code, out, _ = await cli("get", "slots", "qwen.node-1.s0", "-o", "json")
    assert code == 0 and json.loads(out)["node"] == "node-1"
    code, out, _ = await cli("get", "models", "-o", "wide")
    rows = [line.split() for line in out.splitlines()]
    assert rows[0][:8] == ["NAME", "SCALEDOBJECT", "DESIRED", "READY", "ACTIVATING", "WARM", "MODE", "LAST-SCALE"]
    assert rows[0][8:] == ["STALE", "COLD", "OVERRIDE", "REASON"] and rows[2][:2] == ["qwen", "default.qwen"]
    code, out, _ = await cli("get", "model", "-o", "name")
    assert out == "model/llama\nmodel/qwen\n"
    code, _, err = await cli("get", "pods")
    assert code == 2 and "'pods' is not a kind pulsescale lists: use scaledobjects (so), slots or models" in err


async def test_describe_shows_pause_conditions_and_decisions(cli, service: CommandService, manifests: Path) -> None:  # type: ignore[no-untyped-def]
    extra = '  annotations: {pulsescale.io/paused: "true"}\n'
    assert (await cli("apply", "-f", "-", stdin=so("qwen", "qwen", extra=extra)))[0] == 0
    code, out, err = await cli("describe", "so", "qwen")
    assert (code, err) == (0, "")
    text = out.splitlines()
    assert "Name:" in text[0] and text[0].split() == ["Name:", "qwen"]
    assert any(line.split() == ["Target:", "Deployment/qwen-server", "(apps/v1)"] for line in text)
    assert any(line.startswith("Paused:") and line.endswith("true, at the current count") for line in text)
    assert any("autoscaling.keda.sh/paused-replicas" in line for line in text)
    assert any(line.split() == ["Paused", "True"] for line in text)  # the condition
    assert any(line.split() == ["Ready", "True"] for line in text)
    i = text.index("Decisions (newest last):")
    assert text[i + 1].split() == ["TIME", "AGE", "DESIRED", "REASON"]
    when, ago, desired, *_ = text[i + 2].split()
    assert when.endswith("Z") and ago == "5m" and desired == "2"

    code, out, _ = await cli("describe", "model", "qwen")
    assert code == 0 and out.splitlines()[0].split() == ["Name:", "qwen"] and "ScaledObject:" in out
    code, out, _ = await cli("describe", "slot", "qwen.node-0.s0")
    assert code == 0 and any(line.split() == ["State:", "warm"] for line in out.splitlines())
    code, _, err = await cli("describe", "so", "nope")
    assert code == 1 and 'scaledobject "nope" not found in namespace default' in err


async def test_describe_prints_json_and_yaml_of_each_kind(cli, service: CommandService) -> None:  # type: ignore[no-untyped-def]
    """`describe KIND NAME -o json|yaml` (and --json) print the one object; describe's own usage has no -A/-w."""
    assert (await cli("apply", "-f", "-", stdin=so("qwen", "qwen")))[0] == 0
    code, out, err = await cli("describe", "so", "qwen", "-o", "json")
    assert (code, err) == (0, ""), err
    obj = json.loads(out)
    assert (obj["kind"], obj["metadata"]["name"], obj["spec"]["maxReplicaCount"]) == ("ScaledObject", "qwen", 8)
    assert obj["metadata"]["creationTimestamp"].endswith("Z")  # a manifest: RFC 3339, as Kubernetes objects
    code, out, _ = await cli("describe", "so", "qwen", "--json")
    assert code == 0 and json.loads(out)["metadata"]["namespace"] == "default"
    code, out, _ = await cli("describe", "slot", "qwen.node-0.s0", "-o", "yaml")
    assert code == 0 and yaml.safe_load(out)["key"] == "qwen.node-0.s0"
    code, out, _ = await cli("describe", "models", "qwen", "-o", "json")
    row = json.loads(out)
    assert code == 0 and row["model"] == "qwen" and isinstance(row["decisions"][0]["ts"], float)  # wire: Unix s
    code, _, err = await cli("describe", "so", "qwen", "-A")
    assert code == 2 and err.startswith("usage: pulsescale describe") and "-w" not in err.splitlines()[0]
    code, _, err = await cli("describe", "so", "nope", "-o", "yaml")
    assert code == 1 and 'scaledobject "nope" not found' in err


async def test_apply_and_delete_skip_documents_of_other_kinds(cli, nc: Client, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """README: `pulsescale apply -f deploy/examples/`; its inference-qwen.yaml holds a Namespace, a Deployment and
    a Service, which kubectl applies: skipped, one stderr line each."""
    examples = EXAMPLES
    code, out, err = await cli("apply", "-f", str(examples), "--dry-run")
    assert code == 0, err
    assert sorted(line.split()[1] for line in out.splitlines()) == ["default.tiny", "inference.qwen-chat"]
    skipped = [line for line in err.splitlines() if line.startswith("skipped ")]
    assert [line.split(" (")[0] for line in skipped] == [
        "skipped Namespace inference",
        "skipped Deployment inference/qwen-chat",
        "skipped Service inference/qwen-chat",
    ]
    assert all(line.endswith(": not a ScaledObject (kubectl applies it)") for line in skipped)
    code, out, err = await cli("apply", "-f", str(examples / "inference-qwen.yaml"))
    assert (code, out) == (1, "") and "no ScaledObject in it (3 document(s) of other kinds skipped)" in err
    both = "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\n---\n" + so("qwen", "qwen")
    code, out, err = await cli("apply", "-f", "-", stdin=both)
    assert code == 0 and out.startswith("scaledobject default.qwen created")
    assert err == "skipped ConfigMap c (<stdin> doc 1): not a ScaledObject (kubectl applies it)\n"
    code, out, err = await cli("delete", "-f", "-", "-o", "json", stdin=both)
    assert code == 0 and json.loads(out) == [{"key": "default.qwen", "action": "deleted"}]


async def test_delete_prints_json_and_yaml(cli, service: CommandService, manifests: Path) -> None:  # type: ignore[no-untyped-def]
    assert (await cli("apply", "-f", str(manifests)))[0] == 0
    code, out, err = await cli("delete", "so", "qwen", "--dry-run", "-o", "yaml")
    assert (code, err) == (0, "") and yaml.safe_load(out) == [{"key": "default.qwen", "action": "exists"}]
    code, out, _ = await cli("delete", "so", "qwen", "llama", "--json")
    assert code == 0 and [d["key"] for d in json.loads(out)] == ["default.qwen", "default.llama"]
    code, out, _ = await cli("delete", "so", "qwen", "--ignore-not-found", "-o", "json")
    assert (code, json.loads(out)) == (0, [])


async def test_delete_by_name_and_by_file(cli, service: CommandService, manifests: Path) -> None:  # type: ignore[no-untyped-def]
    assert (await cli("apply", "-f", str(manifests)))[0] == 0
    code, out, err = await cli("delete", "scaledobject", "qwen")
    assert (code, out, err) == (0, "scaledobject default.qwen deleted\n", "")
    code, out, err = await cli("delete", "so", "qwen")
    assert (code, out) == (1, "") and err.startswith('pulsescale delete: scaledobject "qwen" not found in namespace')
    code, out, err = await cli("delete", "so", "qwen", "--ignore-not-found")
    assert (code, out, err) == (0, "", "")
    code, out, _ = await cli("delete", "-f", str(manifests / "more.yml"))
    assert (code, out) == (0, "scaledobject default.llama deleted\nscaledobject prod.mistral deleted\n")
    code, out, err = await cli("get", "so", "-A")
    assert (code, out) == (0, "") and err.startswith("No scaledobjects found")
    # Deleted, then applied again: created anew (not "configured" from a deleted record).
    code, out, _ = await cli("apply", "-f", str(manifests / "qwen.yaml"))
    assert out.startswith("scaledobject default.qwen created")


async def test_apply_dry_run_notes_and_json(cli, nc: Client, manifests: Path) -> None:  # type: ignore[no-untyped-def]
    code, out, err = await cli("apply", "-f", str(manifests), "--dry-run", "-o", "json")
    assert (code, err) == (0, "")
    assert [(r["key"], r["action"]) for r in json.loads(out)] == [
        ("default.llama", "valid"),
        ("prod.mistral", "valid"),
        ("default.qwen", "valid"),
    ]
    code, out, err = await cli("apply", "-f", str(manifests), "-f", str(manifests / "qwen.yaml"))
    assert code == 1 and "default.qwen is also defined by" in err and out == ""
    empty = manifests / "empty"
    empty.mkdir()
    code, _, err = await cli("apply", "-f", str(empty))
    assert code == 1 and "no ScaledObject in its .yaml, .yml, .json files (add -R for its subdirectories)" in err
    (empty / "deep").mkdir()
    (empty / "deep" / "q.yaml").write_text(so("deep", "deep"))
    code, out, _ = await cli("apply", "-R", "-f", str(empty), "--dry-run")
    assert code == 0 and out.startswith("scaledobject default.deep valid")


def test_get_watch_prints_changes_and_ctrl_c_exits_quietly(nats_server: NatsServer, tmp_path: Path) -> None:
    env = {**os.environ, "PULSESCALE_NATS_URL": nats_server.url}
    first = tmp_path / "q.yaml"
    first.write_text(so("qwen", "qwen"))

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "pulsescale", *args], env=env, capture_output=True, text=True,
                              timeout=60, check=False)  # fmt: skip

    assert run("apply", "-f", str(first)).returncode == 0
    watch = subprocess.Popen(
        [sys.executable, "-m", "pulsescale", "get", "so", "-w", "--watch-every", "200ms", "--timeout", "200ms"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert watch.stdout is not None
        header, row = watch.stdout.readline(), watch.stdout.readline()
        assert header.split()[0] == "NAME" and row.split()[:2] == ["qwen", "Deployment/qwen-server"]
        assert row.split()[7] == "False"
        first.write_text(so("qwen", "qwen", extra='  annotations: {pulsescale.io/paused: "true"}\n'))
        assert run("apply", "-f", str(first)).returncode == 0
        changed = watch.stdout.readline()  # only the changed row, no second header
        assert changed.split()[:2] == ["qwen", "Deployment/qwen-server"] and changed.split()[7] == "True"
        watch.send_signal(signal.SIGINT)
        rest, err = watch.communicate(timeout=20)
        assert watch.returncode == 0 and "Traceback" not in err and rest == ""
    finally:
        if watch.poll() is None:
            watch.kill()
        watch.communicate()  # reaps it and closes the pipes


async def test_apply_refuses_a_model_another_scaledobject_already_scales(cli, nc: Client) -> None:  # type: ignore[no-untyped-def]
    """The autoscaler serves one ScaledObject per model and drops a second silently (daemon.apply_scaler logs
    "already scaled by"): apply refuses it, names the one that scales the model, and writes nothing."""
    assert (await cli("apply", "-f", "-", stdin=so("qwen-a", "qwen")))[0] == 0
    for dry in ([], ["--dry-run"]):
        code, out, err = await cli(
            "apply", "-f", "-", *dry, stdin=so("llama", "llama") + "---\n" + so("qwen-b", "qwen")
        )
        assert (code, out) == (1, ""), err
        assert err == (
            "pulsescale apply: <stdin> doc 2: spec.triggers[0].metadata.model: qwen is already scaled by "
            "default.qwen-a in pulse_scalers; one ScaledObject per model: delete default.qwen-a first "
            "(pulsescale delete so qwen-a -n default), or change this one's model\n"
        )
    code, out, _ = await cli("get", "so", "-A", "-o", "name")
    assert (code, out) == (0, "scaledobject.pulsescale.io/qwen-a\n")  # llama was not written either
    # The same object again is fine, and so is moving the model in one apply (qwen-a leaves it, qwen-b takes it).
    assert (await cli("apply", "-f", "-", stdin=so("qwen-a", "qwen", hi=6)))[1].startswith(
        "scaledobject default.qwen-a configured"
    )
    moved = so("qwen-a", "mistral") + "---\n" + so("qwen-b", "qwen")
    code, out, err = await cli("apply", "-f", "-", stdin=moved)
    assert code == 0, err
    assert [line.split()[1:3] for line in out.splitlines()] == [
        ["default.qwen-a", "configured"],
        ["default.qwen-b", "created"],
    ]
    # Another namespace is no escape: the model is one per autoscaler.
    code, _, err = await cli("apply", "-f", "-", stdin=so("qwen-c", "qwen", namespace="prod"))
    assert code == 1 and "qwen is already scaled by default.qwen-b" in err


def test_active_is_the_crs_rule_demand_above_activation_not_replicas() -> None:
    from kube import status as kube_status
    from oncall import get
    from warmpool.protocol import StatusRow

    now = 1000.0
    scaled_up = StatusRow(model="qwen", scaler="default.qwen", desired=3, ready=3, activating=0, warm=0)
    recent = msgspec.structs.replace(scaled_up, desired=0, last_active_at=now - 2)
    old = msgspec.structs.replace(scaled_up, last_active_at=now - 60)
    verdict = kube_status.Verdict(True, "ScalerPublished", "published")
    for row, expected in ((scaled_up, False), (recent, True), (old, False)):
        assert get._active(row, now) is expected, row
        composed = kube_status.compose({"metadata": {}, "spec": {}}, verdict, row, now)
        active = {c.type: c.status for c in composed.conditions}["Active"]
        assert active == ("True" if expected else "False"), row
