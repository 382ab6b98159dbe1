"""`get -l` as kubectl: Kubernetes label selectors over the labels the reader keeps (contract revision 12)."""

from __future__ import annotations

import pytest
import yaml

from manifests.scaledobject import ScaledObjectError, from_manifest
from oncall.labels import SelectorError, parse_selector
from tests.oncall.test_resources import so

A = {"team": "a", "tier": "gold", "app.kubernetes.io/name": "chat"}
B = {"team": "b"}
NONE: dict[str, str] = {}


@pytest.mark.parametrize(
    ("selector", "matches"),
    [
        ("", (True, True, True)),
        ("team=a", (True, False, False)),
        ("team==a", (True, False, False)),
        ("team!=a", (False, True, True)),  # absent counts as not equal, as Kubernetes
        ("team", (True, True, False)),
        ("!team", (False, False, True)),
        ("team in (a, b)", (True, True, False)),
        ("team notin (a)", (False, True, True)),
        ("team=a,tier=gold", (True, False, False)),
        ("team in (a,b),!tier", (False, True, False)),
        ("app.kubernetes.io/name=chat", (True, False, False)),
        (" team = b ", (False, True, False)),
    ],
)
def test_selectors_as_kubernetes_reads_them(selector: str, matches: tuple[bool, bool, bool]) -> None:
    selected = parse_selector(selector)
    assert (selected(A), selected(B), selected(NONE)) == matches


@pytest.mark.parametrize("selector", ["team=a,", "team in (a", "team in ()", "team notin a", "=a", "team=a b", "a)"])
def test_a_selector_it_cannot_read_is_named(selector: str) -> None:
    with pytest.raises(SelectorError):
        parse_selector(selector)


def test_the_reader_keeps_labels_and_refuses_what_kubernetes_would() -> None:
    doc = yaml.safe_load(so("chat", "chat", extra="  labels: {team: a, app.kubernetes.io/name: chat}\n"))
    assert from_manifest(doc).labels == {"team": "a", "app.kubernetes.io/name": "chat"}
    for bad, field in [
        ("{team: [a]}", "metadata.labels['team']"),
        ("{'bad key!': x}", "metadata.labels['bad key!']"),
        ("{team: " + "x" * 64 + "}", "metadata.labels['team']"),
        ("{" + "x" * 64 + ": a}", "metadata.labels"),
    ]:
        with pytest.raises(ScaledObjectError) as err:
            from_manifest(yaml.safe_load(so("chat", "chat", extra=f"  labels: {bad}\n")))
        assert field in str(err.value), err.value
