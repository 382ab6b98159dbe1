"""The code that runs inside the engine process, and what the agent learns from it.

The agent arms a zygote per slot while the slot is warm (off the activation path), starts an engine from it on
activation and stops it on deactivation, keeping the zygote armed (`nodeagent.forked` is the agent's side).
Modules: `zygote` (the pre-forked process), `pipe` (the typed commands and events between it and the agent),
`local` (a numpy model behind an OpenAI-shaped HTTP server), `loaders` (weights into engine memory),
`safetensors_check` (pure header validation). An import contract keeps NATS, aiohttp, prometheus_client and the
registry out of this package. Readiness (``GET`` of the engine's `Started.health_path` and one real completion) is
checked by the agent for every engine alike (`nodeagent.readiness`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

__all__ = ["ENGINES", "Started"]

ENGINES: Final = ("local", "command", "vllm")
"""Engine adapters a node can be asked for: ``local`` (a zygote forks this package's numpy engine on activation,
`nodeagent.forked`), ``command`` and ``vllm`` (a standby server per slot, `nodeagent.served`)."""


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
    """How the weights reached the engine (the loader's mode: ``mmap``, ``copy``...; a standby server's mode)."""
    engine_mode: str = "fork"
    """How the engine was taken into service (`warmpool.protocol.EngineMode`): ``fork`` (a zygote forked it),
    ``wake`` (a sleeping standby server was woken), ``resident`` (a standby server already held its weights)."""
    health_path: str = "/health"
    """The path the agent's readiness check and liveness probe ``GET`` (200 = healthy): a standby server's
    `ServerSpec.ready_path` (``--ready-path`` for the ``command`` engine, /health for vLLM); the local engine
    serves /health."""
