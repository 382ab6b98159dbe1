"""The code that runs inside the engine process, and what the agent learns from it.

The agent arms a zygote per slot while the slot is warm (off the activation path), starts an engine from it on
activation and stops it on deactivation, keeping the zygote armed (`nodeagent.forked` is the agent's side).
Modules: `zygote` (the pre-forked process), `local` (a numpy model behind an OpenAI-shaped HTTP server),
`loaders` (weights into engine memory), `safetensors_check` (pure header validation). An import contract keeps
NATS, aiohttp, prometheus_client and the registry out of this package. Readiness (``GET /health`` and one real
completion) is checked by the agent for every engine alike (`nodeagent.readiness`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

__all__ = ["ENGINES", "Started"]

ENGINES: Final = ("local", "command", "vllm")
"""Engine adapters a node can be asked for; only `local` is built in this version (the CLI says so)."""


@dataclass(frozen=True)
class Started:
    """An engine that is loaded and listening (not yet checked for readiness)."""

    endpoint: str
    pid: int
    load_ms: float
    """Weights into engine memory, measured inside the engine process by the loader."""
    engine_ms: float
    """Everything else from the start command to listening: fork, model build, bind."""
    loaded_bytes: int
    mode: str
