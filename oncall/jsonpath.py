"""``-o jsonpath=TEMPLATE`` as kubectl reads it, for `pulsescale get`: the subset scripts use. Pure.

A template is text with ``{...}`` expressions (kubectl's JSONPath, after
https://kubernetes.io/docs/reference/kubectl/jsonpath/):

- ``{.a.b}`` a field (``{.metadata.labels.app\\.kubernetes\\.io/name}``: a dot escaped), ``{.items[0]}`` /
  ``{.items[-1]}`` an index, ``{.items[*]}`` every element, ``{..name}`` every ``name`` at any depth,
  ``{.a['b.c']}`` a key with dots, ``{@}`` the current object;
- ``{.items[?(@.spec.model=="m")]}`` a filter: an element whose path equals (``==``) or differs from (``!=``) a
  quoted string or a number, or whose path exists (``[?(@.status)]``);
- ``{range .items[*]}...{end}`` repeats the inner template for each element, relative to it;
- ``{"\\n"}`` / ``{"\\t"}`` and other quoted literals, and plain text outside braces, printed as they are.

Several results of one expression are joined with a space, strings printed bare, other values as JSON, as kubectl
does. A missing field prints nothing (kubectl says "not found" only with ``--allow-missing-template-keys=false``).
A template this module cannot read is a `JsonPathError` naming where.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final

__all__ = ["JsonPathError", "render"]


class JsonPathError(ValueError):
    """A template that is not kubectl JSONPath this module reads; the message names the part."""


_MISSING: Final = object()
_STEP: Final = re.compile(
    r"""\.\.(?P<deep>[A-Za-z_][\w-]*)              # ..name
      | \.(?P<field>(?:[A-Za-z_$]|\\\.)(?:[\w$/-]|\\\.)*)  # .name, .app\.kubernetes\.io/name
      | \[\s*(?P<index>-?\d+)\s*\]                  # [0], [-1]
      | \[\s*\*\s*\]|\.\*                           # [*], .*
      | \[\s*'(?P<key>[^']*)'\s*\]                  # ['a.b']
      | \[\s*\?\(\s*@(?P<fpath>[^!=)]*?)\s*(?:(?P<op>==|!=)\s*(?P<fval>'[^']*'|"[^"]*"|-?\d+(?:\.\d+)?))?\s*\)\s*\]
    """,
    re.X,
)


@dataclass(frozen=True)
class _Step:
    kind: str  # field, deep, index, all, filter
    arg: Any = None
    op: str | None = None
    value: Any = None


def _parse_path(path: str) -> list[_Step]:
    """`path` (``.a[0].b``; a leading ``@`` or ``$`` is the current object) as steps."""
    rest = path.strip()
    if rest in ("@", "$", ""):
        return []
    if rest[0] in "@$":
        rest = rest[1:]
    steps: list[_Step] = []
    pos = 0
    while pos < len(rest):
        m = _STEP.match(rest, pos)
        if m is None:
            raise JsonPathError(f"cannot read {rest[pos:]!r} in {{{path}}}")
        if m.group("deep"):
            steps.append(_Step("deep", m.group("deep")))
        elif m.group("field"):
            steps.append(_Step("field", m.group("field").replace("\\.", ".")))
        elif m.group("index") is not None:
            steps.append(_Step("index", int(m.group("index"))))
        elif m.group("key") is not None:
            steps.append(_Step("field", m.group("key")))
        elif m.group("fpath") is not None:
            value = m.group("fval")
            if value is not None:
                value = value[1:-1] if value[0] in "'\"" else json.loads(value)
            steps.append(_Step("filter", _parse_path(m.group("fpath")), m.group("op"), value))
        else:
            steps.append(_Step("all"))
        pos = m.end()
    return steps


def _deep(node: Any, name: str) -> Iterator[Any]:
    if isinstance(node, dict):
        for k, v in node.items():
            if k == name:
                yield v
            yield from _deep(v, name)
    elif isinstance(node, list):
        for v in node:
            yield from _deep(v, name)


def _one(node: Any, steps: list[_Step]) -> Any:
    """The single value of `steps` from `node`, or `_MISSING` (for filters: a path with one result)."""
    found = _walk([node], steps)
    return found[0] if len(found) == 1 else _MISSING


def _kept(step: _Step, got: Any) -> bool:
    """A filter's verdict on an element whose path gave `got`: it exists, equals or differs from the value."""
    if step.op is None:
        return got is not _MISSING
    if step.op == "==":
        return got is not _MISSING and bool(got == step.value)
    return got is _MISSING or bool(got != step.value)


def _walk(nodes: list[Any], steps: list[_Step]) -> list[Any]:
    for step in steps:
        nxt: list[Any] = []
        for node in nodes:
            if step.kind == "field":
                if isinstance(node, dict) and step.arg in node:
                    nxt.append(node[step.arg])
            elif step.kind == "deep":
                nxt.extend(_deep(node, step.arg))
            elif step.kind == "index":
                if isinstance(node, list) and -len(node) <= step.arg < len(node):
                    nxt.append(node[step.arg])
            elif step.kind == "all":
                if isinstance(node, list):
                    nxt.extend(node)
                elif isinstance(node, dict):
                    nxt.extend(node.values())
            else:  # filter
                if isinstance(node, list):
                    nxt.extend(item for item in node if _kept(step, _one(item, step.arg)))
        nodes = nxt
    return nodes


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, separators=(",", ":"))


@dataclass(frozen=True)
class _Node:
    kind: str  # text, expr, range
    arg: Any
    body: tuple[_Node, ...] = ()


_BRACE: Final = re.compile(r"\{((?:[^{}\"']|\"(?:[^\"\\]|\\.)*\"|'[^']*')*)\}")


def _tokens(template: str) -> Iterator[tuple[str, str]]:
    pos = 0
    for m in _BRACE.finditer(template):
        if m.start() > pos:
            yield "text", template[pos : m.start()]
        yield "brace", m.group(1).strip()
        pos = m.end()
    tail = template[pos:]
    if "{" in tail or "}" in tail:
        raise JsonPathError(f"unbalanced braces in {tail!r}")
    if tail:
        yield "text", tail


def _parse(template: str) -> tuple[_Node, ...]:
    stack: list[tuple[str | None, list[_Node]]] = [(None, [])]
    for kind, body in _tokens(template):
        if kind == "text":
            stack[-1][1].append(_Node("text", body))
        elif body.startswith("range "):
            stack.append((body[len("range ") :].strip(), []))
        elif body == "end":
            if len(stack) == 1:
                raise JsonPathError("{end} without {range}")
            path, nodes = stack.pop()
            stack[-1][1].append(_Node("range", _parse_path(path or ""), tuple(nodes)))
        elif len(body) >= 2 and body[0] == body[-1] and body[0] in "\"'":
            literal = body[1:-1]
            if body[0] == '"':
                literal = json.loads(body)  # "\n", "\t", escaped quotes: as JSON strings read them
            stack[-1][1].append(_Node("text", literal))
        else:
            stack[-1][1].append(_Node("expr", _parse_path(body)))
    if len(stack) != 1:
        raise JsonPathError(f"{{range {stack[-1][0]}}} without {{end}}")
    return tuple(stack[0][1])


def _render(nodes: tuple[_Node, ...], current: Any, out: list[str]) -> None:
    for node in nodes:
        if node.kind == "text":
            out.append(node.arg)
        elif node.kind == "expr":
            out.append(" ".join(_text(v) for v in _walk([current], node.arg)))
        else:
            for item in _walk([current], node.arg):
                _render(node.body, item, out)


def render(template: str, data: Any) -> str:
    """`template` applied to `data` (builtins: what ``-o json`` prints), as kubectl prints it (no newline added)."""
    out: list[str] = []
    _render(_parse(template), data, out)
    return "".join(out)
