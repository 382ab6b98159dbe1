"""deploy/monitoring, the operations kit: the PrometheusRule, the Grafana dashboard and the ServiceMonitors, against
what the components export.

- Every metric a rule or a dashboard panel names is one a component registers (its prometheus_client registry, as
  built by `AutoscalerMetrics`, `AgentMetrics`, `GatewayMetrics`, `OperatorMetrics`), or a recording rule of the
  PrometheusRule; every label a selector matches on is one that metric has (or one Prometheus adds to a target).
- ``promtool check rules`` on the rules, and on every dashboard query as a rule (syntax, templates); ``promtool test
  rules`` on the alerts that read several series together (the owner's gauges, pool exhaustion, NATS, shards).
  Debian's ``prometheus`` package has promtool; without it those tests skip, naming it.
- The metrics the kit added: ``pulsescale_build_info{version,component}`` in every component, the activation
  histogram's ``model`` label (children dropped with the model), the agents' warm slot-seconds, the operator's
  ``/metrics``.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import urllib.request
from functools import cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from nats.aio.client import Client
from prometheus_client import CollectorRegistry

from autoscaler.metrics import ACTIVATION_STAGES, AutoscalerMetrics
from gateway.metrics import GatewayMetrics
from kube.metrics import OperatorMetrics
from nodeagent.metrics import AgentMetrics
from tests.agent_double import AgentDouble
from tests.autoscaler.test_autoscaler import (  # noqa: F401 - cancel_gateways is an autouse fixture
    Gateway,
    cancel_gateways,
    put_scaler,
    running_autoscaler,
)
from tests.helpers import wait_for
from warmpool import protocol
from warmpool.embedded import NatsServer
from warmpool.registry import KvSlotStore

MONITORING = Path(__file__).resolve().parents[2] / "deploy" / "monitoring"
RULES = MONITORING / "prometheusrule.yaml"
DASHBOARD = MONITORING / "dashboards" / "pulsescale.json"
PROMTOOL_TIMEOUT_S = 60

TARGET_LABELS = {"job", "instance", "namespace", "pod", "service", "endpoint", "container", "node"}
"""Labels Prometheus puts on every series of a ServiceMonitor's target (``node``: the agents' relabeling)."""
SEVERITIES = {"critical", "warning"}
COMPONENTS = ("autoscaler", "agent", "gateway", "operator")


# --- what the components export -------------------------------------------------------------------------------------


def registries() -> dict[str, CollectorRegistry]:
    return {
        "autoscaler": AutoscalerMetrics().registry,
        "agent": AgentMetrics(CollectorRegistry()).registry,
        "gateway": GatewayMetrics().registry,
        "operator": OperatorMetrics().registry,
    }


_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "summary": ("", "_count", "_sum", "_created"),
    "info": ("_info",),
}


@cache
def exported() -> dict[str, frozenset[str]]:
    """Every series name any component can export -> its label names (a histogram's ``_bucket`` with ``le``)."""
    out: dict[str, set[str]] = {}
    for registry in registries().values():
        for collector in list(registry._collector_to_names):  # all of them (the process collector names none)
            families = list(collector.describe()) if hasattr(collector, "describe") else []
            for family in [*families, *collector.collect()]:
                labels = set(getattr(collector, "_labelnames", ())) | set(getattr(family, "_labelnames", ()))
                labels |= {k for s in family.samples for k in s.labels}
                for suffix in _SUFFIXES.get(family.type, ("",)):
                    extra = {"le"} if suffix == "_bucket" else set()
                    out.setdefault(family.name + suffix, set()).update(labels - {"le"} | extra)
    return {name: frozenset(labels) for name, labels in out.items()}


def test_the_exported_names_are_read_from_the_registries() -> None:
    """Not vacuous: names of each kind and their labels are there, and a made-up one is not."""
    names = exported()
    assert names["pulsescale_slots"] == {"model", "state"}
    assert names["pulsescale_cold_path_total"] == {"model"}
    assert names["pulsescale_autoscaler_activation_seconds_bucket"] == {"model", "stage", "le"}
    assert names["pulsescale_gateway_responses_total"] == {"model", "code"}
    assert names["pulsescale_agent_warm_slot_seconds_total"] == {"model"}
    assert names["pulsescale_operator_failures_total"] == {"where"}
    assert names["pulsescale_agent_clock_skew_seconds"] == {"node"}  # a collector's, read at scrape time
    assert "process_resident_memory_bytes" in names
    assert "pulsescale_no_such_thing" not in names


# --- PromQL: the metric names and matched labels an expression reads ------------------------------------------------

_TOKEN = re.compile(
    r"""(?P<string>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|`[^`]*`)
      | (?P<range>\[[^\]]*\])
      | (?P<number>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
      | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
      | (?P<open>[({])
      | (?P<close>[)}])
      | (?P<op>=~|!~|!=|==|<=|>=|[=<>+\-*/%^,])
      | (?P<space>\s+)""",
    re.VERBOSE,
)
_AGGREGATIONS = {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk",
                 "quantile", "limitk", "limit_ratio"}  # fmt: skip
_LABEL_LISTS = {"by", "without", "on", "ignoring", "group_left", "group_right"}
_KEYWORDS = {"and", "or", "unless", "bool", "inf", "nan", "offset"} | _AGGREGATIONS | _LABEL_LISTS


def selectors(expr: str) -> list[tuple[str, frozenset[str]]]:
    """(metric name, label names matched on it) for each vector selector in `expr`. Grafana's variables are
    allowed where Grafana puts them (in strings and ranges)."""
    tokens = []
    pos = 0
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        assert m is not None, f"cannot read {expr[pos : pos + 20]!r} in {expr!r}"
        pos = m.end()
        if m.lastgroup != "space":
            tokens.append((m.lastgroup, m.group()))
    out: list[tuple[str, frozenset[str]]] = []
    i = 0
    while i < len(tokens):
        kind, text = tokens[i]
        following = tokens[i + 1] if i + 1 < len(tokens) else (None, "")
        if kind == "ident" and text in _LABEL_LISTS and following[1] == "(":
            i = next(j for j in range(i, len(tokens)) if tokens[j][1] == ")") + 1  # a list of label names
            continue
        if kind == "ident" and text not in _KEYWORDS and following[1] != "(":
            labels: set[str] = set()
            i += 1
            if i < len(tokens) and tokens[i][1] == "{":
                end = next(j for j in range(i, len(tokens)) if tokens[j][1] == "}")
                labels = {t for k, t in tokens[i + 1 : end] if k == "ident"}
                i = end + 1
            out.append((text, frozenset(labels)))
            continue
        assert not (kind == "open" and text == "{"), f"a selector without a metric name in {expr!r}"
        i += 1
    return out


def test_the_promql_reader_finds_names_and_matchers_not_functions_or_label_lists() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (model, le) (rate(a_bucket{model=~"$model", stage!="x"}'
        "[$__rate_interval]))) > 0.1 and on (instance) b == 0 or vector(1) unless sum without (x) "
        "(c:rec:max)"
    )
    assert selectors(expr) == [("a_bucket", frozenset({"model", "stage"})), ("b", frozenset()),
                               ("c:rec:max", frozenset())]  # fmt: skip
    assert selectors("(sum(x) or vector(0)) < 32") == [("x", frozenset())]
    assert selectors('absent(up{job="pulsescale-autoscaler"} == 1)') == [("up", frozenset({"job"}))]


# --- the PrometheusRule ---------------------------------------------------------------------------------------------


@cache
def rule_doc() -> dict[str, Any]:
    doc = yaml.safe_load(RULES.read_text())
    assert doc["apiVersion"] == "monitoring.coreos.com/v1" and doc["kind"] == "PrometheusRule"
    return doc  # type: ignore[no-any-return]


def rules() -> list[dict[str, Any]]:
    return [r for g in rule_doc()["spec"]["groups"] for r in g["rules"]]


def recorded() -> dict[str, frozenset[str]]:
    """Recording rules -> the labels their series keep (those of the aggregation's ``by``)."""
    out = {}
    for r in rules():
        if "record" in r:
            by = re.findall(r"\bby\s*\(([^)]*)\)", r["expr"])
            out[r["record"]] = frozenset(x.strip() for x in by[0].split(",")) if by else frozenset()
    return out


def unknown_names(expr: str) -> list[str]:
    """Names `expr` reads that nothing exports or records, and labels it matches that the series lack."""
    problems = []
    known, recs = exported(), recorded()
    for name, labels in selectors(expr):
        if name == "up":
            has: frozenset[str] | None = frozenset(TARGET_LABELS)
        else:
            has = recs.get(name, known.get(name))
            has = has | TARGET_LABELS if name in known and has is not None else has
        if has is None:
            problems.append(f"{name}: exported by no component and recorded by no rule")
        elif labels - has:
            problems.append(f"{name}: has no label {sorted(labels - has)} (it has {sorted(has)})")
    return problems


def test_every_metric_a_rule_reads_is_exported_by_a_component() -> None:
    problems = {r.get("alert", r.get("record")): unknown_names(r["expr"]) for r in rules()}
    assert not {k: v for k, v in problems.items() if v}
    read = {name for r in rules() for name, _ in selectors(r["expr"])}
    assert {"pulsescale_nats_connected", "pulsescale_agent_leases_lapsed", "pulsescale_model_owned"} <= read


def test_the_check_refuses_a_name_nobody_exports_and_a_label_a_metric_lacks() -> None:
    assert unknown_names("rate(pulsescale_cold_paths_total[5m])")  # misspelt
    assert unknown_names('pulsescale_decision_seconds_bucket{model="m"}')  # that histogram has no model
    assert unknown_names('model:pulsescale_warm_slots:max{state="warm"}')  # the recording keeps model only
    assert not unknown_names('sum by (model) (rate(pulsescale_autoscaler_activation_seconds_bucket{model="m"}[5m]))')


def test_every_alert_has_a_severity_a_summary_a_description_and_a_runbook() -> None:
    alerts = [r for r in rules() if "alert" in r]
    names = [a["alert"] for a in alerts]
    assert len(names) == len(set(names))
    for a in alerts:
        assert a["labels"]["severity"] in SEVERITIES, a["alert"]
        notes = a["annotations"]
        assert {"summary", "description", "runbook", "runbook_url"} <= set(notes), a["alert"]
        assert all(str(notes[k]).strip() for k in ("summary", "description", "runbook")), a["alert"]
    # what issue 26 asked for, each under its name
    asked = {"PulsescalePoolExhausted", "PulsescaleColdPathScaleUps", "PulsescaleWarmSlotsLow",
             "PulsescaleShardLeaseLost", "PulsescaleShardLeaseFlapping", "PulsescaleDecisionLatencyHigh",
             "PulsescaleAgentsStale", "PulsescaleActivationFailures", "PulsescaleNatsUnreachable"}  # fmt: skip
    assert asked <= set(names)


def test_the_shard_count_in_the_alert_is_the_protocol_s() -> None:
    (unheld,) = [r for r in rules() if r.get("alert") == "PulsescaleShardsUnheld"]
    assert unheld["expr"].strip().endswith(f"< {protocol.SHARDS}")


def test_the_alerts_name_the_jobs_the_service_monitors_make() -> None:
    """`job` is each monitored Service's app.kubernetes.io/name (jobLabel): the alerts' `up{job=...}` match them."""
    monitors = [d for d in yaml.safe_load_all((MONITORING / "servicemonitors.yaml").read_text()) if d]
    jobs = set()
    for m in monitors:
        assert m["spec"]["jobLabel"] == "app.kubernetes.io/name"
        jobs.add(m["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"])
    named = {v for r in rules() for v in re.findall(r'job="([^"]+)"', r["expr"])}
    assert named and named <= jobs


# --- the dashboard --------------------------------------------------------------------------------------------------


@cache
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())  # type: ignore[no-any-return]


def panel_queries() -> list[tuple[str, str]]:
    out = []
    for p in dashboard()["panels"]:
        for t in p.get("targets", []):
            out.append((p["title"], t["expr"]))
    return out


def test_every_metric_a_panel_reads_is_exported_by_a_component() -> None:
    problems = {f"{title}: {expr}": unknown_names(expr) for title, expr in panel_queries()}
    assert not {k: v for k, v in problems.items() if v}


def test_the_dashboard_shows_the_pulse() -> None:
    """Issue 26's pulse view: offered load, queue, ready/activating/warm, decision and activation latency, 504s and
    idle standby GPU-seconds, each on a panel; the model variable and the datasource are Grafana's."""
    d = dashboard()
    assert d["uid"] and d["title"] and d["schemaVersion"] >= 36
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["model"]["includeAll"]
    read = {name for _, expr in panel_queries() for name, _ in selectors(expr)}
    assert {"model:pulsescale_arrival_rate:owned", "model:pulsescale_demand_requests:owned",
            "model:pulsescale_ready_replicas:owned", "model:pulsescale_activating_replicas:owned",
            "model:pulsescale_warm_slots:max", "pulsescale_decision_seconds_bucket",
            "pulsescale_autoscaler_activation_seconds_bucket", "pulsescale_gateway_responses_total",
            "pulsescale_agent_warm_slot_seconds_total"} <= read  # fmt: skip
    assert any('code="504"' in expr for _, expr in panel_queries())
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    for p in d["panels"]:
        pos = p["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24, p["title"]
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}", p["title"]


def test_the_dashboard_is_shipped_as_a_configmap_for_grafana_s_sidecar() -> None:
    kustomization = yaml.safe_load((MONITORING / "kustomization.yaml").read_text())
    (gen,) = kustomization["configMapGenerator"]
    assert gen["files"] == ["dashboards/pulsescale.json"]
    assert gen["options"]["labels"]["grafana_dashboard"] == "1" and gen["options"]["disableNameSuffixHash"]
    assert len(DASHBOARD.read_bytes()) < 200_000, "kubectl apply keeps a copy in an annotation (256 KiB at most)"


# --- promtool -------------------------------------------------------------------------------------------------------


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool not found (Debian: apt-get install prometheus): the rules are not checked by it here")
    return path


def run_promtool(*args: str) -> str:
    out = subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=PROMTOOL_TIMEOUT_S,
                         check=False)  # fmt: skip
    assert out.returncode == 0, f"promtool {' '.join(args)}:\n{out.stdout}\n{out.stderr}"
    return out.stdout


def test_promtool_checks_the_rules(tmp_path: Path) -> None:
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule_doc()["spec"]["groups"]}))
    assert f"SUCCESS: {len(rules())} rules found" in run_promtool("check", "rules", str(path))


_GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__range": "1h", "$__interval": "15s", "$model": ".*"}


def test_promtool_checks_every_dashboard_query(tmp_path: Path) -> None:
    """Each panel's query, Grafana's variables put in, as a recording rule: promtool parses it as Prometheus would."""
    queries = []
    for _, expr in panel_queries():
        for var, value in _GRAFANA_VARIABLES.items():
            expr = expr.replace(var, value)
        assert "$" not in expr, expr
        queries.append({"record": f"dashboard:query{len(queries)}", "expr": expr})
    path = tmp_path / "dashboard.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": queries}]}))
    assert f"SUCCESS: {len(queries)} rules found" in run_promtool("check", "rules", str(path))


def _series(name: str, values: str, **labels: str) -> dict[str, str]:
    inner = ", ".join(f'{k}="{v}"' for k, v in labels.items())
    return {"series": f"{name}{{{inner}}}", "values": values}


A = {"instance": "a:9100", "job": "pulsescale-autoscaler", "pod": "a"}
B = {"instance": "b:9100", "job": "pulsescale-autoscaler", "pod": "b"}


def _replicas(model: str, owner: dict[str, str], other: dict[str, str], *, desired: str, ready: str,
              stale_desired: str, warm: str) -> list[dict[str, str]]:  # fmt: skip
    """Two autoscaler replicas' series of `model`: `owner` acts for it, `other` keeps what it had (`stale_desired`)."""
    out = []
    for who, owned, want in ((owner, "1", desired), (other, "0", stale_desired)):
        out += [
            _series("pulsescale_model_owned", f"{owned}x40", model=model, **who),
            _series("pulsescale_desired_replicas", want, model=model, **who),
            _series("pulsescale_ready_replicas", ready if who is owner else "0x40", model=model, **who),
            _series("pulsescale_activating_replicas", "0x40", model=model, **who),
            _series("pulsescale_slots", warm, model=model, state="warm", **who),
        ]
    return out


def test_promtool_unit_tests_of_the_alerts(tmp_path: Path) -> None:
    """The alerts that join several series, on series as the components export them (annotations left out here:
    `check rules` above parses their templates)."""
    groups = []
    for g in rule_doc()["spec"]["groups"]:
        groups.append({**g, "rules": [{k: v for k, v in r.items() if k != "annotations"} for r in g["rules"]]})
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}))
    series = [
        # m1: the owner wants 5 with 2 ready and no warm slot: exhausted (after its 2 minutes).
        *_replicas("m1", A, B, desired="5x40", ready="2x40", stale_desired="0x40", warm="0x40"),
        # m2: the other replica's stale 9 (from before a hand-over) must not count: the owner's 3 are all ready.
        *_replicas("m2", B, A, desired="3x40", ready="3x40", stale_desired="9x40", warm="0x40"),
        _series("pulsescale_shards_held", "16x40", **A),
        _series("pulsescale_shards_held", "16x10 15x30", **B),  # one shard lost at 2.5 min, not taken
        _series("pulsescale_nats_connected", "1x40", **A),
        _series(
            "pulsescale_nats_connected",
            "1x4 0x36",
            job="pulsescale-agent",
            instance="n1:9464",
            pod="agent-x",
            node="n1",
        ),
        _series("up", "1x40", **A),
        _series("pulsescale_activations_total", "0+1x40", model="m1", outcome="ready", **A),
        _series("pulsescale_activations_total", "0+1x40", model="m1", outcome="failed", **A),
        _series("pulsescale_cold_path_total", "0x20 1x5 2x5 3x10", model="m1", **A),
    ]
    tests = {
        "rule_files": ["rules.yaml"],
        "evaluation_interval": "15s",
        "tests": [{
            "interval": "15s",
            "input_series": series,
            "promql_expr_test": [{
                "expr": "model:pulsescale_desired_replicas:owned",
                "eval_time": "1m",
                "exp_samples": [{"labels": 'model:pulsescale_desired_replicas:owned{model="m1"}', "value": 5},
                                {"labels": 'model:pulsescale_desired_replicas:owned{model="m2"}', "value": 3}],
            }],
            "alert_rule_test": [
                {"eval_time": "1m", "alertname": "PulsescalePoolExhausted", "exp_alerts": []},  # not for 2m yet
                {"eval_time": "3m", "alertname": "PulsescalePoolExhausted",
                 "exp_alerts": [{"exp_labels": {"severity": "critical", "model": "m1"}}]},
                {"eval_time": "3m", "alertname": "PulsescaleWarmSlotsLow", "exp_alerts": []},  # for 10m
                {"eval_time": "2m", "alertname": "PulsescaleShardsUnheld", "exp_alerts": []},
                {"eval_time": "4m", "alertname": "PulsescaleShardsUnheld",
                 "exp_alerts": [{"exp_labels": {"severity": "critical"}}]},
                {"eval_time": "3m", "alertname": "PulsescaleNatsUnreachable",
                 "exp_alerts": [{"exp_labels": {"severity": "critical", "job": "pulsescale-agent",
                                                "instance": "n1:9464", "pod": "agent-x", "node": "n1"}}]},
                {"eval_time": "5m", "alertname": "PulsescaleActivationFailures",
                 "exp_alerts": [{"exp_labels": {"severity": "warning", "model": "m1"}}]},
                {"eval_time": "9m", "alertname": "PulsescaleColdPathScaleUps",
                 "exp_alerts": [{"exp_labels": {"severity": "warning", "model": "m1"}}]},
                {"eval_time": "3m", "alertname": "PulsescaleAutoscalerDown", "exp_alerts": []},
                {"eval_time": "5m", "alertname": "PulsescaleOperatorNotLeading",
                 "exp_alerts": [{"exp_labels": {"severity": "warning"}}]},  # no operator series at all
            ],
        }],
    }  # fmt: skip
    path = tmp_path / "alerts_test.yaml"
    path.write_text(yaml.safe_dump(tests))
    assert "SUCCESS" in run_promtool("test", "rules", str(path))


# --- the metrics the kit added --------------------------------------------------------------------------------------


@pytest.mark.parametrize("component", COMPONENTS)
def test_every_component_exports_its_build_and_what_it_costs(component: str) -> None:
    registry = registries()[component]
    info = [s for fam in registry.collect() for s in fam.samples if s.name == "pulsescale_build_info"]
    assert [s.labels["component"] for s in info] == [component]
    assert info[0].labels["version"] and info[0].value == 1
    names = {s.name for fam in registry.collect() for s in fam.samples}
    assert {"process_cpu_seconds_total", "python_info"} <= names


def test_the_activation_histogram_has_the_model_and_goes_with_it() -> None:
    m = AutoscalerMetrics()
    series = m.model("llama")
    assert set(series.activation) == set(ACTIVATION_STAGES)
    series.activation["claim_to_ready"].observe(0.2)
    series.arrival_rate.set(12.5)
    series.owned.set(1)
    get = m.registry.get_sample_value
    name = "pulsescale_autoscaler_activation_seconds"
    assert get(f"{name}_count", {"model": "llama", "stage": "claim_to_ready"}) == 1
    assert get(f"{name}_count", {"model": "llama", "stage": "total"}) == 0  # every stage from the start
    assert get("pulsescale_arrival_rate", {"model": "llama"}) == 12.5
    m.forget("llama")
    assert get(f"{name}_count", {"model": "llama", "stage": "claim_to_ready"}) is None
    assert get("pulsescale_arrival_rate", {"model": "llama"}) is None
    assert get("pulsescale_model_owned", {"model": "llama"}) is None
    assert not [s for fam in m.registry.collect() for s in fam.samples if s.labels.get("model") == "llama"]


def test_the_agent_integrates_its_warm_slot_seconds() -> None:
    """Each call adds the time since the previous one at the warm count that held since: a time-weighted sum."""
    m = AgentMetrics(CollectorRegistry())
    get = m.registry.get_sample_value

    def counts(warm: int, ready: int = 0) -> dict[protocol.SlotState, int]:
        c = dict.fromkeys(protocol.SLOT_STATES, 0)
        c.update(warm=warm, ready=ready)
        return c

    m.set_slots("llama", counts(2), now=100.0)
    assert get("pulsescale_agent_warm_slot_seconds_total", {"model": "llama"}) == 0  # there from the start
    m.set_slots("llama", counts(2), now=110.0)  # 2 warm for 10 s
    m.set_slots("llama", counts(1, ready=1), now=115.0)  # 2 more for 5 s, then 1
    m.set_slots("llama", counts(1, ready=1), now=125.0)  # 1 for 10 s
    m.set_slots("llama", counts(1), now=124.0)  # a clock that went back adds nothing
    assert get("pulsescale_agent_warm_slot_seconds_total", {"model": "llama"}) == 20 + 10 + 10
    assert get("pulsescale_agent_slots", {"state": "warm"}) == 1
    assert get("pulsescale_agent_slots", {"state": "ready"}) == 0


async def test_the_operator_serves_its_metrics_on_the_health_port() -> None:
    """`pulsescale operator --health-port`: /metrics beside /healthz and /readyz, read from the live replica."""
    from kube import cli

    nc = SimpleNamespace(is_connected=True)
    leading = {"now": False}
    elector = SimpleNamespace(leading=lambda: leading["now"], holder="other", reached=True,
                              settings=SimpleNamespace(identity="op-a"))  # fmt: skip
    ctx = SimpleNamespace(died=[], failures={"standby": 2}, mirror_swept=0)
    settings = SimpleNamespace(health_port=0, health_host="127.0.0.1")
    runner = await cli._health(settings, nc, elector, ctx)  # type: ignore[arg-type]
    assert runner is not None
    try:
        port = runner.addresses[0][1]

        def scrape() -> str:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                assert r.status == 200
                return r.read().decode()

        text = await asyncio.to_thread(scrape)
        assert re.search(r'pulsescale_build_info\{component="operator",version="[^"]+"\} 1\.0', text)
        assert "pulsescale_operator_leading 0.0" in text and "pulsescale_nats_connected 1.0" in text
        assert 'pulsescale_operator_failures_total{where="standby"} 2.0' in text
        leading["now"], nc.is_connected = True, False
        ctx.died.append("standby-loop")
        text = await asyncio.to_thread(scrape)
        assert "pulsescale_operator_leading 1.0" in text and "pulsescale_nats_connected 0.0" in text
        assert "pulsescale_operator_background_died 1.0" in text
        assert "pulsescale_operator_mirror_swept_total 0.0" in text
        ctx.mirror_swept = 3  # kube/records.py MirrorSweep counts each record it deletes
        text = await asyncio.to_thread(scrape)
        assert "pulsescale_operator_mirror_swept_total 3.0" in text
    finally:
        await runner.cleanup()


async def test_a_running_autoscaler_sets_what_the_rules_read(
    nats_server: NatsServer, nc: Client, store: KvSlotStore
) -> None:
    """The series the recording rules and alerts join, from the real daemon: the model's owner, the offered load,
    the NATS connection, the agents' leases and a lapsed one."""
    agent = await AgentDouble(nc, store, "node-0", "m", slots=1, lease_s=1.0).start()
    await put_scaler(nc, "m")
    try:
        async with running_autoscaler(nats_server.url) as scaler:
            value = scaler.metrics.registry.get_sample_value
            await Gateway(nc, "m").steady(0, 1.0)  # 10 arrivals a second, nothing queued
            await wait_for(lambda: value("pulsescale_model_owned", {"model": "m"}) == 1, 3, "the owner's mark")
            rate = value("pulsescale_arrival_rate", {"model": "m"})
            assert rate is not None and 5 < rate < 20, rate
            assert value("pulsescale_nats_connected") == 1
            assert value("pulsescale_agent_leases") == 1 and value("pulsescale_agent_leases_lapsed") == 0
            agent.stop_heartbeat()
            await wait_for(lambda: value("pulsescale_agent_leases_lapsed") == 1, 5, "the lapsed lease counted")
    finally:
        await agent.stop()
