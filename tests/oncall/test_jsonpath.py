"""`-o jsonpath=` as kubectl prints it: the examples of kubectl's JSONPath page, on a `pulsescale get` list."""

from __future__ import annotations

import pytest

from oncall.jsonpath import JsonPathError, render

LIST = {
    "apiVersion": "v1",
    "kind": "List",
    "items": [
        {
            "metadata": {
                "name": "chat", "namespace": "default", "labels": {"team": "a", "app.kubernetes.io/name": "x"}
            },
            "spec": {"model": "qwen", "minReplicaCount": 1},
            "status": {"conditions": [{"type": "Ready", "status": "True"}, {"type": "Active", "status": "False"}]},
        },
        {
            "metadata": {"name": "code", "namespace": "ml"},
            "spec": {"model": "coder", "minReplicaCount": 0},
            "status": {"conditions": [{"type": "Ready", "status": "False", "reason": "InvalidSpec"}]},
        },
    ],
}


@pytest.mark.parametrize(
    ("template", "printed"),
    [
        ("{.kind}", "List"),
        ("{.items[*].metadata.name}", "chat code"),
        ("{.items[0].spec.model}", "qwen"),
        ("{.items[-1].metadata.namespace}", "ml"),
        ("{.items[*].spec.minReplicaCount}", "1 0"),
        ("{..model}", "qwen coder"),
        ("{.items[0].metadata.labels}", '{"team":"a","app.kubernetes.io/name":"x"}'),
        ("{.items[0].metadata.labels.app\\.kubernetes\\.io/name}", "x"),
        ("{.items[0].metadata.labels['team']}", "a"),
        ('{.items[?(@.spec.model=="coder")].metadata.name}', "code"),
        ("{.items[?(@.spec.model!='coder')].metadata.name}", "chat"),
        ("{.items[?(@.spec.minReplicaCount==0)].metadata.name}", "code"),
        ("{.items[?(@.metadata.labels)].metadata.name}", "chat"),
        ('{range .items[*]}{.metadata.name}{"\\t"}{.spec.model}{"\\n"}{end}', "chat\tqwen\ncode\tcoder\n"),
        (
            '{range .items[*]}{.metadata.name}={.status.conditions[?(@.type=="Ready")].status};{end}',
            "chat=True;code=False;",
        ),
        ("names: {.items[*].metadata.name}!", "names: chat code!"),
        ("{.items[5].metadata.name}", ""),  # missing: nothing, as kubectl by default
        ("{.nothing.here}", ""),
        ("{@.kind}", "List"),
        ("{.items[*].metadata['name']}", "chat code"),
    ],
)
def test_kubectl_templates(template: str, printed: str) -> None:
    assert render(template, LIST) == printed


@pytest.mark.parametrize(
    ("template", "named"),
    [
        ("{.items[", "unbalanced"),
        ("{.items}}", "unbalanced"),
        ("{range .items[*]}{.metadata.name}", "without {end}"),
        ("{end}", "without {range}"),
        ("{.items[x]}", "cannot read"),
    ],
)
def test_a_template_it_cannot_read_is_named(template: str, named: str) -> None:
    with pytest.raises(JsonPathError, match=named.replace("{", r"\{").replace("}", r"\}")):
        render(template, LIST)
