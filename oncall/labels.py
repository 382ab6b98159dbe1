"""``-l/--selector`` as kubectl reads it: Kubernetes label selectors, equality- and set-based. Pure.

A selector is requirements joined by commas, all of which must hold (after
https://kubernetes.io/docs/concepts/overview/working-with-objects/labels/#label-selectors):

- ``key=value`` / ``key==value`` the label is there with that value; ``key!=value`` it is not (absent counts);
- ``key in (a,b)`` its value is one of them; ``key notin (a,b)`` it is absent or none of them;
- ``key`` the label is there; ``!key`` it is not.

An empty selector selects everything. One this module cannot read is a `SelectorError` naming the part.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Final

__all__ = ["SelectorError", "parse_selector"]


class SelectorError(ValueError):
    """A selector that is not Kubernetes' syntax; the message names the part."""


_KEY: Final = r"[A-Za-z0-9]([-A-Za-z0-9_./]*[A-Za-z0-9])?"
_VALUE: Final = r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?"
_SET: Final = re.compile(rf"^\s*(?P<key>{_KEY})\s+(?P<op>in|notin)\s*\((?P<values>[^()]*)\)\s*$")
_EQ: Final = re.compile(rf"^\s*(?P<key>{_KEY})\s*(?P<op>==|=|!=)\s*(?P<value>{_VALUE})\s*$")
_EXISTS: Final = re.compile(rf"^\s*(?P<not>!?)\s*(?P<key>{_KEY})\s*$")

Labels = Mapping[str, str]


def _split(selector: str) -> list[str]:
    """Top-level comma-separated requirements (commas inside ``( )`` belong to a set)."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(selector):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth < 0:
                raise SelectorError(f"unbalanced ')' in {selector!r}")
        elif ch == "," and depth == 0:
            parts.append(selector[start:i])
            start = i + 1
    if depth:
        raise SelectorError(f"unbalanced '(' in {selector!r}")
    parts.append(selector[start:])
    return parts


def _requirement(text: str) -> Callable[[Labels], bool]:
    if m := _SET.match(text):
        key = m.group("key")
        values = {v.strip() for v in m.group("values").split(",")}
        if "" in values or not all(re.fullmatch(_VALUE, v) for v in values):
            raise SelectorError(f"{text.strip()!r}: a set needs values, comma-separated")
        if m.group("op") == "in":
            return lambda labels: labels.get(key) in values
        return lambda labels: labels.get(key) not in values
    if m := _EQ.match(text):
        key, value = m.group("key"), m.group("value")
        if m.group("op") == "!=":
            return lambda labels: labels.get(key) != value
        return lambda labels: labels.get(key) == value
    if m := _EXISTS.match(text):
        key = m.group("key")
        if m.group("not"):
            return lambda labels: key not in labels
        return lambda labels: key in labels
    raise SelectorError(f"cannot read {text.strip()!r}: use key=value, key!=value, key in (a,b), key notin (a,b), "
                        "key or !key")  # fmt: skip


def parse_selector(selector: str) -> Callable[[Labels], bool]:
    """A predicate over an object's labels: True when every requirement of `selector` holds."""
    if not selector.strip():
        return lambda labels: True
    checks = [_requirement(part) for part in _split(selector)]
    return lambda labels: all(check(labels) for check in checks)
