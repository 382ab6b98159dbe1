"""The running build, as every daemon's ``pulsescale_build_info`` reports it."""

from __future__ import annotations

import importlib.metadata

__all__ = ["build_version"]


def build_version() -> str:
    """The installed package's version ("unknown" when run from a tree that was never installed)."""
    try:
        return importlib.metadata.version("pulsescale")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
