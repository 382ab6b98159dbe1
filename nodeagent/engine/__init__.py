"""Engine adapters, as the agent drives them: one `Engine` per slot.

An adapter arms a standby engine while the slot is warm (off the activation path), starts it serving on
activation and stops it on deactivation, keeping the standby armed. `local` is a pre-forked numpy model
(`forked.ForkedEngine` driving a `zygote`); part 2 adds `command` (any server command plus a readiness URL) and
`vllm` (a standby engine in sleep mode: activation wakes it) behind the same protocol. Readiness (``GET /health``
and one real completion) is checked by the agent for every adapter alike (`readiness`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Protocol

__all__ = ["ENGINES", "Engine", "EngineInfo", "Started"]

ENGINES: Final = ("local", "command", "vllm")


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


@dataclass(frozen=True)
class EngineInfo:
    name: str
    device: str
    """Where the engine computes (``cpu`` for local): the loader choice depends on it."""


class Engine(Protocol):
    info: EngineInfo

    @property
    def armed(self) -> bool: ...

    @property
    def serving(self) -> Started | None: ...

    async def arm(self) -> None:
        """Bring the standby up (idempotent); raises `EngineFailed` when it cannot."""
        ...

    async def start(self, *, timeout_s: float) -> Started:
        """Load the staged weights and listen; raises `EngineFailed` (its `stage` says where)."""
        ...

    async def stop(self) -> None:
        """Stop serving and free the engine's memory; the standby stays armed."""
        ...

    async def close(self) -> None: ...

    def status(self) -> Mapping[str, Any]: ...
