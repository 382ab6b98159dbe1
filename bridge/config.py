"""The bridge's config file (``pulsescale bridge --config FILE``): the sources and names that are easier to keep in
a file (a ConfigMap) than in flags. YAML, every key optional::

    targets:                       # engine pages: "[MODEL=]URL" or {url: URL, model: MODEL}
      - http://10.0.0.5:8000/metrics
      - {url: http://10.0.0.6:8000, model: qwen}
    model_names:                   # an engine's model_name -> the pulsescale model
      Qwen/Qwen2.5-0.5B-Instruct: qwen
    slots: true                    # also scrape the ready slots of pulse_slots
    scaledobjects: true            # also read what the ScaledObjects' triggers name (metadata.source)
    require_assignment: true       # read a node's ready slots only of the models pulse_assignments lists for it
    models: [qwen]                 # publish only these
    prometheus: http://prometheus:9090
    queries:                       # model -> PromQL whose one value is the demand
      llama: sum(vllm:num_requests_waiting{model_name="llama"}) + sum(vllm:num_requests_running{model_name="llama"})

Flags add to the lists and win over the rest. A file that breaks these rules is a `ConfigError` naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import yaml

from bridge.settings import Query, Target
from warmpool.errors import BadInput

__all__ = ["ConfigError", "ConfigFile", "load"]

_KEYS: Final = (
    "targets",
    "model_names",
    "slots",
    "scaledobjects",
    "require_assignment",
    "models",
    "prometheus",
    "queries",
)


class ConfigError(BadInput):
    """A config file that cannot be read or breaks its rules; the message names the file and the key."""


@dataclass(frozen=True)
class ConfigFile:
    targets: tuple[Target, ...] = ()
    model_names: tuple[tuple[str, str], ...] = ()
    slots: bool | None = None
    scaledobjects: bool | None = None
    require_assignment: bool | None = None
    models: frozenset[str] | None = None
    prometheus_url: str | None = None
    queries: tuple[Query, ...] = ()


def _target(item: Any) -> Target:
    if isinstance(item, str):
        return Target.parse(item)
    if isinstance(item, dict) and isinstance(item.get("url"), str) and set(item) <= {"url", "model"}:
        model = item.get("model")
        if model is not None and not isinstance(model, str):
            raise ValueError(f"target {item!r}: model is a name")
        return Target.parse(f"{model}={item['url']}" if model else item["url"])
    raise ValueError(f"target {item!r}: give a URL, MODEL=URL or {{url: URL, model: MODEL}}")


def _str_map(doc: dict[str, Any], key: str) -> dict[str, str]:
    value = doc.get(key) or {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise ValueError(f"{key}: a mapping of names to strings")
    return value


def parse(doc: Any) -> ConfigFile:
    if doc is None:
        return ConfigFile()
    if not isinstance(doc, dict):
        raise ValueError("the file is not a mapping of the keys " + ", ".join(_KEYS))
    unknown = sorted(set(doc) - set(_KEYS))
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(map(str, unknown))}; known: {', '.join(_KEYS)}")
    targets = doc.get("targets") or []
    if not isinstance(targets, list):
        raise ValueError("targets: a list")
    models = doc.get("models")
    if models is not None and not (isinstance(models, list) and all(isinstance(m, str) for m in models)):
        raise ValueError("models: a list of model names")
    slots = doc.get("slots")
    if slots is not None and not isinstance(slots, bool):
        raise ValueError("slots: true or false")
    scaledobjects = doc.get("scaledobjects")
    if scaledobjects is not None and not isinstance(scaledobjects, bool):
        raise ValueError("scaledobjects: true or false")
    require_assignment = doc.get("require_assignment")
    if require_assignment is not None and not isinstance(require_assignment, bool):
        raise ValueError("require_assignment: true or false")
    prometheus = doc.get("prometheus")
    if prometheus is not None and not isinstance(prometheus, str):
        raise ValueError("prometheus: a URL")
    return ConfigFile(
        targets=tuple(_target(t) for t in targets),
        model_names=tuple(_str_map(doc, "model_names").items()),
        slots=slots,
        scaledobjects=scaledobjects,
        require_assignment=require_assignment,
        models=frozenset(models) if models is not None else None,
        prometheus_url=prometheus,
        queries=tuple(Query.parse(f"{m}={q}") for m, q in _str_map(doc, "queries").items()),
    )


def load(path: str | Path) -> ConfigFile:
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise ConfigError(f"cannot read the config file {path}: {err.strerror or err}") from None
    try:
        return parse(yaml.safe_load(text))
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"{path}: not YAML{where}: {getattr(err, 'problem', None) or err}") from None
    except ValueError as err:
        raise ConfigError(f"{path}: {err}") from None
