"""A static CEL cost estimator for a CRD's ``x-kubernetes-validations``, as the API server computes it at create.

No API server runs here, so this follows its two sources for the subset of CEL our rules use (identifiers, field
selection, ``has()``, ``size()``, ``!``, ``&&``, ``||``, comparisons, ``+``, ``matches``, and the ``all``,
``exists`` and ``exists_one`` macros):

- the cost of an expression: cel-go's ``checker/cost.go`` (``coster``): an identifier costs 1, a field selected from
  an object 1 more, a presence test 1; ``&&``/``||`` cost their operands (no more); a comparison or equality costs
  ``ceil(0.1 x the smaller operand's largest size)`` (``StringTraversalCostFactor``; a scalar's size is 1);
  ``matches`` costs ``ceil(0.1 x (size + 1)) x ceil(0.25 x regex length)`` (``RegexStringLengthCostFactor``); other
  calls 1; a comprehension costs its range, its initial accumulator and its result once, and its loop condition and
  step once per element of the range, whose count is the list's largest size. The macros expand as cel-go's parser
  expands them (``all``: condition ``@not_strictly_false(__result__)``, step ``__result__ && p``; ``exists``:
  condition ``@not_strictly_false(!__result__)``, step ``__result__ || p``; ``exists_one``: condition ``true``, step
  ``p ? __result__ + 1 : __result__``, result ``__result__ == 1``);
- the largest sizes: apiextensions-apiserver's schema model (``estimateMaxStringLengthPerRequest``,
  ``estimateMaxArrayItemsFromMinSize``): a string's ``maxLength``, else the 3 MiB request limit less 2; a list's
  ``maxItems``, else ``(3 MiB - 2) / (its items' least JSON size + 1)``;

and the limits of ``apiextensions/validation``: ``StaticEstimatedCostLimit`` (10,000,000) per rule, multiplied by
how many times the rule's node can occur (the ``maxItems`` of the lists above it), and
``StaticEstimatedCRDCostLimit`` (100,000,000) for all of a CRD's rules. The API server also replaces ``metadata`` by
``name`` and ``generateName``, two strings without ``maxLength`` (``WithTypeAndObjectMeta``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

MAX_REQUEST_BYTES = 3 * 1024 * 1024
STATIC_ESTIMATED_COST_LIMIT = 10_000_000
STATIC_ESTIMATED_CRD_COST_LIMIT = 100_000_000
STRING_TRAVERSAL = 0.1
REGEX_LENGTH = 0.25

Schema = dict[str, Any]

_TOKEN = re.compile(
    r"\s*(?:(\d+)|('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")|([A-Za-z_][A-Za-z0-9_]*)|(==|!=|<=|>=|&&|\|\||[<>!().,+?:-]))"
)


class CelSyntaxError(ValueError):
    pass


def tokens(text: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    text = text.rstrip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise CelSyntaxError(f"cannot read {text[pos:]!r}")
        number, string, ident, op = m.groups()
        out.append(
            ("int", number) if number else ("str", string[1:-1]) if string else ("id", ident) if ident else ("op", op)
        )
        pos = m.end()
    return out


@dataclass
class Value:
    """What an expression evaluates to, for sizes: its schema node (None: a scalar or a computed value), and its
    largest size (a string's characters, a list's items; 1 for a scalar)."""

    schema: Schema | None
    size: int


def max_size(schema: Schema | None) -> int:
    if schema is None:
        return 1
    kind = schema.get("type")
    if kind == "string":
        if "maxLength" in schema:
            return int(schema["maxLength"])
        if "enum" in schema:
            return max(len(str(v)) for v in schema["enum"])
        return MAX_REQUEST_BYTES - 2
    if kind == "array":
        if "maxItems" in schema:
            return int(schema["maxItems"])
        return (MAX_REQUEST_BYTES - 2) // (min_json_size(schema.get("items", {})) + 1)
    return 1


def min_json_size(schema: Schema) -> int:
    """apiextensions' ``estimateMinSizeJSON``: the least bytes a value of `schema` serialises to."""
    kind = schema.get("type")
    if kind == "string":
        return 2 + int(schema.get("minLength", 0))
    if kind in ("integer", "number"):
        return 1
    if kind == "boolean":
        return 4
    if kind == "array":
        return 2
    if kind == "object":
        size = 2
        for name in schema.get("required", []):
            size += len(name) + min_json_size(schema.get("properties", {}).get(name, {})) + 4
        return size
    return 1


class Estimator:
    """The cost of one rule on the schema node it is attached to (``self``)."""

    def __init__(self, rule: str, node: Schema) -> None:
        self.toks = tokens(rule)
        self.i = 0
        self.scopes: dict[str, Value] = {"self": Value(node, max_size(node))}

    # --- parsing, with the cost computed on the way (each parse returns (cost, value)) ------------------------

    def peek(self, *ops: str) -> bool:
        return self.i < len(self.toks) and self.toks[self.i][1] in ops and self.toks[self.i][0] == "op"

    def take(self, op: str) -> None:
        if not self.peek(op):
            raise CelSyntaxError(f"expected {op!r} at token {self.i}: {self.toks[self.i :][:3]}")
        self.i += 1

    def cost(self) -> int:
        total, _ = self.conditional()
        if self.i != len(self.toks):
            raise CelSyntaxError(f"unread tokens: {self.toks[self.i :]}")
        return total

    def conditional(self) -> tuple[int, Value]:
        cond, value = self.logical_or()
        if not self.peek("?"):
            return cond, value
        self.take("?")
        yes, a = self.conditional()
        self.take(":")
        no, b = self.conditional()
        return cond + max(yes, no), Value(None, max(a.size, b.size))

    def logical_or(self) -> tuple[int, Value]:
        total, value = self.logical_and()
        while self.peek("||"):
            self.take("||")
            rhs, _ = self.logical_and()
            total, value = total + rhs, Value(None, 1)
        return total, value

    def logical_and(self) -> tuple[int, Value]:
        total, value = self.relation()
        while self.peek("&&"):
            self.take("&&")
            rhs, _ = self.relation()
            total, value = total + rhs, Value(None, 1)
        return total, value

    def relation(self) -> tuple[int, Value]:
        total, lhs = self.additive()
        if self.peek("==", "!=", "<", "<=", ">", ">="):
            self.i += 1
            rhs_cost, rhs = self.additive()
            compare = math.ceil(min(lhs.size, rhs.size) * STRING_TRAVERSAL)
            return total + rhs_cost + compare, Value(None, 1)
        return total, lhs

    def additive(self) -> tuple[int, Value]:
        total, value = self.unary()
        while self.peek("+", "-"):
            self.i += 1
            rhs_cost, rhs = self.unary()
            total, value = total + rhs_cost + 1, Value(None, value.size + rhs.size)
        return total, value

    def unary(self) -> tuple[int, Value]:
        if self.peek("!", "-"):
            self.i += 1
            total, _ = self.unary()
            return total + 1, Value(None, 1)
        return self.member()

    def member(self) -> tuple[int, Value]:
        total, value = self.primary()
        while self.peek("."):
            self.take(".")
            name = self.toks[self.i][1]
            self.i += 1
            if self.peek("("):
                total, value = self.method(name, total, value)
                continue
            props = (value.schema or {}).get("properties", {})
            if value.schema is None or name not in props:
                raise CelSyntaxError(f"no field {name!r} here")
            total += 1  # a select on an object
            value = Value(props[name], max_size(props[name]))
        return total, value

    def method(self, name: str, target_cost: int, target: Value) -> tuple[int, Value]:
        self.take("(")
        if name in ("all", "exists", "exists_one"):
            var = self.toks[self.i][1]
            self.i += 1
            self.take(",")
            items = (target.schema or {}).get("items")
            outer = self.scopes.get(var)
            self.scopes[var] = Value(items, max_size(items))
            pred, _ = self.conditional()
            self.take(")")
            if outer is None:
                del self.scopes[var]
            else:
                self.scopes[var] = outer
            n = target.size
            if name == "all":  # init `true` 0, result `__result__` 1, per item: condition 2, step 1 + p
                return target_cost + 1 + n * (2 + 1 + pred), Value(None, 1)
            if name == "exists":  # per item: condition 3 (`!__result__` inside), step 1 + p
                return target_cost + 1 + n * (3 + 1 + pred), Value(None, 1)
            # exists_one: condition `true` 0, step p + max(`__result__ + 1` 2, `__result__` 1), result 2
            return target_cost + 2 + n * (pred + 2), Value(None, 1)
        args = []
        while not self.peek(")"):
            args.append(self.conditional())
            if self.peek(","):
                self.take(",")
        self.take(")")
        arg_cost = sum(c for c, _ in args)
        if name == "matches":
            ((_, regex),) = args
            string = math.ceil((target.size + 1) * STRING_TRAVERSAL)
            return target_cost + arg_cost + string * math.ceil(regex.size * REGEX_LENGTH), Value(None, 1)
        if name in ("startsWith", "endsWith"):
            ((_, arg),) = args
            return target_cost + arg_cost + math.ceil(arg.size * STRING_TRAVERSAL), Value(None, 1)
        if name == "size":
            return target_cost + arg_cost + 1, Value(None, 1)
        raise CelSyntaxError(f"no cost rule for method {name!r}")

    def primary(self) -> tuple[int, Value]:
        kind, text = self.toks[self.i]
        self.i += 1
        if kind == "int":
            return 0, Value(None, 1)
        if kind == "str":
            return 0, Value(None, len(text))
        if kind == "op" and text == "(":
            value = self.conditional()
            self.take(")")
            return value
        if kind != "id":
            raise CelSyntaxError(f"unexpected {text!r}")
        if text in ("true", "false", "null"):
            return 0, Value(None, 1)
        if self.peek("(") and text in ("has", "size"):
            self.take("(")
            if text == "has":
                # A presence test costs its operand plus 1, the select itself nothing: `member` counted the select's
                # 1, which stands for the test's.
                inner, _ = self.member()
                self.take(")")
                return inner, Value(None, 1)
            inner, _ = self.conditional()
            self.take(")")
            return inner + 1, Value(None, 1)
        if text not in self.scopes:
            raise CelSyntaxError(f"unknown identifier {text!r}")
        return 1, self.scopes[text]


@dataclass(frozen=True)
class RuleCost:
    path: str
    rule: str
    cost: int
    """Its expression's cost times how many times its node can occur."""


def with_object_meta(root: Schema) -> Schema:
    """The schema as the API server types ``self`` at the root: ``metadata`` is ``name`` and ``generateName``."""
    meta = {"type": "object", "properties": {"name": {"type": "string"}, "generateName": {"type": "string"}}}
    return {**root, "properties": {**root.get("properties", {}), "metadata": meta}}


def rule_costs(root: Schema) -> list[RuleCost]:
    """Every rule of the schema with its cost, walking the schema as the API server does."""
    out: list[RuleCost] = []

    def walk(node: Schema, path: str, cardinality: int) -> None:
        for rule in node.get("x-kubernetes-validations", []):
            out.append(RuleCost(path or "(root)", rule["rule"], Estimator(rule["rule"], node).cost() * cardinality))
        for name, child in node.get("properties", {}).items():
            walk(child, f"{path}.{name}", cardinality)
        if "items" in node:
            walk(node["items"], f"{path}[]", cardinality * max_size(node))

    walk(with_object_meta(root), "", 1)
    return out
