"""The LiteLLM hook's settings: each with its unit and why its default is what it is, read from the environment
(`HookSettings.from_env`) because LiteLLM's ``callbacks:`` entry passes the hook no arguments.

NATS is reached as every pulsescale client reaches it (`warmpool.connect`): ``PULSESCALE_NATS_URL``,
``PULSESCALE_NATS_USER`` with ``PULSESCALE_NATS_PASSWORD_FILE`` (or ``PULSESCALE_NATS_PASSWORD``),
``PULSESCALE_NATS_TOKEN``, ``PULSESCALE_NATS_CREDS``, ``PULSESCALE_NATS_TLS_CA``, ``PULSESCALE_NATS_CONNECT_TIMEOUT``.
The hook's own variables are in `ENV`.
"""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

from integrations.errors import BadHookSetting
from warmpool import connect, durations, protocol

__all__ = ["ENV", "HookSettings", "ModelMap", "default_gateway_id"]

ENV: Final = {
    "PULSESCALE_GATEWAY_ID": "this proxy process's gateway id in the samples [<hostname>-<pid>]",
    "PULSESCALE_LITELLM_MODELS": "which model groups to count, and under which pulsescale model name: "
    "'group=model' or 'group' (same name), comma-separated; '*' adds every other group under its own name "
    "[unset: every group under its own name]",
    "PULSESCALE_LITELLM_FORGET_AFTER": "a request LiteLLM never reported the end of leaves the counts after this "
    "long, counted as a timeout [10m]",
}


def default_gateway_id() -> str:
    """``<hostname>-<pid>``: unique per proxy process (each LiteLLM worker process publishes its own samples), and
    the same for the process's whole life, so the autoscaler tells its restarts apart by `seq`."""
    return f"{socket.gethostname()[:100]}-{os.getpid()}"


@dataclass(frozen=True)
class ModelMap:
    """LiteLLM model group (the ``model_name`` of the proxy's ``model_list``, what a client asks for) → pulsescale
    model (the ScaledObject's ``metadata.model``)."""

    names: Mapping[str, str] = field(default_factory=dict)
    """Groups named explicitly; their models are published from the start, traffic or not."""
    others: bool = True
    """Every group not in `names` is counted under its own name (when that is a pulsescale name)."""

    def model_for(self, group: str) -> str | None:
        """The pulsescale model `group` counts for, or None: not counted."""
        if group in self.names:
            return self.names[group]
        return group if self.others and protocol.is_name(group) else None

    @classmethod
    def parse(cls, text: str, *, variable: str = "PULSESCALE_LITELLM_MODELS") -> ModelMap:
        names: dict[str, str] = {}
        others = False
        for raw in text.split(","):
            item = raw.strip()
            if not item:
                continue
            if item == "*":
                others = True
                continue
            group, _, model = item.partition("=")
            group, model = group.strip(), (model.strip() or group.strip())
            if not group or not protocol.is_name(model):
                raise BadHookSetting(
                    variable,
                    text,
                    f"{item!r} does not map a model group to a pulsescale model name (lower-case letters, digits, "
                    "'-' and '_', at most 63 characters): write group=model, group, or *",
                )
            names[group] = model
        if not names and not others:
            raise BadHookSetting(variable, text, "names no model group: write group=model, group, or *")
        return cls(names, others)


@dataclass(frozen=True)
class HookSettings:
    nats: connect.NatsOptions = field(default_factory=lambda: connect.NatsOptions(name="pulsescale-litellm"))
    gateway_id: str = field(default_factory=default_gateway_id)
    models: ModelMap = field(default_factory=ModelMap)
    sample_every_s: float = 0.1
    """The contract's period: a model this proxy counts is published at least this often, or the autoscaler drops
    it from the demand sum after ``staleAfterSeconds`` (1 s)."""
    sample_min_gap_s: float = 0.01
    """Shortest gap between two samples of one model when changes come faster (the gateway's bound too)."""
    forget_after_s: float = 600.0
    """A request whose end LiteLLM never reports (its logging events are best-effort) would hold the demand up
    forever; after this long it leaves the counts as a timeout. Ten minutes: longer than a
    generation a user waits for; set it above your ``request_timeout`` when generations run longer."""
    idle_after_s: float = 300.0
    """A model counted by name (not in `ModelMap.names`) with nothing open and no request this long stops being
    published: a client asking for names that exist nowhere must not grow the table forever. Longer than the
    autoscaler's default stable window (60 s), as the gateway's ``queue_idle_s``, so a scale-in still sees its
    zeros."""
    max_models: int = 256
    """Models counted at once; a request for one more is served as usual and not counted (logged once)."""
    reconnect_max_s: float = 5.0
    """The longest pause between two tries at a first NATS connection that failed (the pauses double from 0.25 s).
    Once connected, the NATS client reconnects by itself every 0.25 s."""

    def __post_init__(self) -> None:
        if not 1 <= len(self.gateway_id) <= 128:
            raise BadHookSetting("PULSESCALE_GATEWAY_ID", self.gateway_id, "must be 1 to 128 characters")
        connect.check_urls(self.nats.servers)  # a http:// URL is a typo to report now, not a retry loop forever

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> HookSettings:
        """The settings `ENV` and ``PULSESCALE_NATS_*`` give; `BadHookSetting` (or `NatsUnavailable` for an
        unreadable password file) names a variable that cannot be used."""
        env = os.environ if env is None else env
        nats = connect.options_from_args(argparse.Namespace(), name="pulsescale-litellm", env=env)
        mapping = env.get("PULSESCALE_LITELLM_MODELS")
        models = ModelMap.parse(mapping) if mapping else ModelMap()
        forget_after_s = 600.0
        if env.get("PULSESCALE_LITELLM_FORGET_AFTER"):
            text = env["PULSESCALE_LITELLM_FORGET_AFTER"]
            try:
                forget_after_s = durations.parse_duration(text)
            except durations.DurationError as err:
                raise BadHookSetting("PULSESCALE_LITELLM_FORGET_AFTER", text, str(err)) from None
        return cls(
            nats=nats,
            gateway_id=env.get("PULSESCALE_GATEWAY_ID") or default_gateway_id(),
            models=models,
            forget_after_s=forget_after_s,
        )
