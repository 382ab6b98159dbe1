"""Named errors of the node agent. Each says what was wrong and, where a person reads it, what to do.

`code` is a stable string: replies carry it as ``error.code`` and metrics label on it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from warmpool.errors import PulsescaleError

if TYPE_CHECKING:  # the engine process imports this module: no wire contract at run time
    from warmpool.protocol import ErrorCode

__all__ = [
    "ActivationRefused",
    "BadModel",
    "BadWeights",
    "EngineFailed",
    "LoaderUnavailable",
    "NoShmRoom",
    "StagingFailed",
    "UnsafeStagingDir",
    "WeightsChanged",
    "describe",
]


class BadModel(PulsescaleError):
    """The model directory is unusable as a whole (no manifest, no weights, bad config, bad name)."""

    code = "bad_model"


class BadWeights(PulsescaleError):
    """One weights file is unusable; `file` names it and `reason` says why (truncated, checksum, header...)."""

    code = "bad_weights"

    def __init__(self, file: str, reason: str) -> None:
        self.file = file
        self.reason = reason
        super().__init__(f"{file}: {reason}")


class StagingFailed(PulsescaleError):
    """Copying, mapping or locking the staged weights failed for a reason outside the weights themselves."""

    code = "staging_failed"


class NoShmRoom(StagingFailed):
    """Not enough room in shm for the stage now: the filesystem is full (ENOSPC), has less free than the stage
    needs, or the stage would go beyond ``--shm-budget``. Nothing is wrong with the weights, so the agent stages
    again once room appears (`prewarm.Prewarmer`, with a bounded back-off)."""


class UnsafeStagingDir(StagingFailed):
    """The staging directory is not the agent's own (a link, someone else's, or in a directory others can
    rewrite): the agent runs as root and will not stage, map or sweep through it. The message says the fix."""


class WeightsChanged(BadWeights):
    """The weights an engine was handed are not the file staging verified (device, inode or size differ): the
    engine refuses to load them rather than serve unverified bytes."""


class LoaderUnavailable(PulsescaleError):
    """The asked weight loader cannot run on this node (no GPU, library missing, not built yet)."""

    code = "loader_unavailable"


class EngineFailed(PulsescaleError):
    """The engine did not come up: it crashed, reported an error, or missed the deadline. `stage` says where."""

    def __init__(self, stage: str, reason: str, *, code: ErrorCode = "engine_failed") -> None:
        self.stage = stage
        self.reason = reason
        self.code: ErrorCode = code
        super().__init__(f"{stage}: {reason}")


class ActivationRefused(PulsescaleError):
    """An activate/deactivate request the agent will not apply; `code` is the reply's error code."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        self.code: ErrorCode = code
        super().__init__(message)


def describe(err: BaseException) -> str:
    """An error for a reason field: our named errors say it all; anything else also says what it is."""
    if isinstance(err, (PulsescaleError, ValueError)):
        return str(err)
    return f"{type(err).__name__}: {err}"
