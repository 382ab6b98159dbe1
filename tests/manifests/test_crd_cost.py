"""The CRD's CEL rules cost what a real API server accepts (tests/cel_cost.py: its estimator, cited there).

An outside review computed ~80 M for the rule that compares every trigger's model with every other's, against the
10 M per-rule limit: `metadata.model` had a pattern but no `maxLength`, so the estimator took it as 3 MiB long. Every
string and list of the schema is now bounded; these tests pin the limits and that the estimator sees the old cost.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml

from manifests import crd
from tests import cel_cost
from tests.cel_cost import STATIC_ESTIMATED_COST_LIMIT, STATIC_ESTIMATED_CRD_COST_LIMIT, Estimator, rule_costs


def schema() -> dict[str, Any]:
    return crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_every_rule_costs_less_than_the_api_servers_limits() -> None:
    costs = rule_costs(schema())
    assert len(costs) >= 8  # every rule was read (the estimator refuses what it cannot cost)
    over = [c for c in costs if c.cost > STATIC_ESTIMATED_COST_LIMIT]
    assert not over, over
    assert sum(c.cost for c in costs) <= STATIC_ESTIMATED_CRD_COST_LIMIT


def test_the_shipped_crd_is_the_one_costed() -> None:
    with open(crd.__file__.replace("manifests/crd.py", "deploy/crd/scaledobjects.pulsescale.io.yaml")) as f:
        shipped = yaml.safe_load(f)
    assert shipped["spec"]["versions"][0]["schema"]["openAPIV3Schema"] == schema()


def test_every_string_and_list_is_bounded() -> None:
    unbounded: list[str] = []

    def walk(node: dict[str, Any], path: str) -> None:
        kind = node.get("type")
        # A date-time's length is known to the estimator by its format (`estimateMaxStringLengthPerRequest`).
        sized = "maxLength" in node or "enum" in node or node.get("format") in ("date-time", "date", "duration")
        if kind == "string" and not sized:
            unbounded.append(path)
        if kind == "array" and "maxItems" not in node:
            unbounded.append(path)
        for name, child in node.get("properties", {}).items():
            walk(child, f"{path}.{name}")
        if "items" in node:
            walk(node["items"], f"{path}[]")

    walk(schema(), "")
    assert unbounded == []


def test_the_model_rule_without_a_max_length_costs_what_the_review_found() -> None:
    """The estimator reproduces the finding: ~80 M with `metadata.model` unbounded, a few thousand bounded."""
    unbounded = copy.deepcopy(schema())
    trigger = unbounded["properties"]["spec"]["properties"]["triggers"]["items"]
    del trigger["properties"]["metadata"]["properties"]["model"]["maxLength"]
    rule = "self.triggers.all(t, self.triggers.all(u, u.metadata.model == t.metadata.model))"
    before = Estimator(rule, unbounded["properties"]["spec"]).cost()
    after = Estimator(rule, schema()["properties"]["spec"]).cost()
    assert 75_000_000 < before < 85_000_000
    assert after < 10_000


@pytest.mark.parametrize(
    ("rule", "node", "cost"),
    [
        # `self.a` 2 (ident 1, select 1), `== 1` ceil(0.1 x 1) = 1, the literal 0
        ("self.a == 1", {"type": "object", "properties": {"a": {"type": "integer"}}}, 3),
        # `has` 1 + its operand's 1; `||` adds nothing of its own
        ("!has(self.a) || self.a <= 2", {"type": "object", "properties": {"a": {"type": "integer"}}}, 1 + 2 + 2 + 1),
        # a string of 10 against 20: ceil(0.1 x 10) = 1
        (
            "self.s == self.t",
            {
                "type": "object",
                "properties": {"s": {"type": "string", "maxLength": 10}, "t": {"type": "string", "maxLength": 20}},
            },
            2 + 2 + 1,
        ),
        # matches: ceil(0.1 x (64 + 1)) = 7 times ceil(0.25 x 4) = 1
        ("self.s.matches('^a$')", {"type": "object", "properties": {"s": {"type": "string", "maxLength": 64}}}, 2 + 7),
        # all over 3 items: range 2, result 1, per item 2 + 1 + (x 1, == 1)
        (
            "self.l.all(x, x == 1)",
            {"type": "object", "properties": {"l": {"type": "array", "maxItems": 3, "items": {"type": "integer"}}}},
            3 + 3 * 5,
        ),
        # exists_one over 3: range 2, result 2, per item (x == 1: 2) + 2
        (
            "self.l.exists_one(x, x == 1)",
            {"type": "object", "properties": {"l": {"type": "array", "maxItems": 3, "items": {"type": "integer"}}}},
            4 + 3 * 4,
        ),
        # a list without maxItems: (3 MiB - 2) / (1 + 1) integers
        (
            "self.l.size() >= 1",
            {"type": "object", "properties": {"l": {"type": "array", "items": {"type": "integer"}}}},
            2 + 1 + 1,
        ),
    ],
)
def test_the_estimator_on_small_rules(rule: str, node: dict[str, Any], cost: int) -> None:
    assert Estimator(rule, node).cost() == cost


def test_an_unbounded_list_is_as_long_as_a_request_allows() -> None:
    assert cel_cost.max_size({"type": "array", "items": {"type": "integer"}}) == (3 * 1024 * 1024 - 2) // 2
    assert cel_cost.max_size({"type": "string"}) == 3 * 1024 * 1024 - 2
