"""The running build, as every daemon's ``pulsescale_build_info`` reports it."""

from __future__ import annotations

import importlib.metadata

from prometheus_client import GC_COLLECTOR, CollectorRegistry, Gauge, GCCollector, PlatformCollector, ProcessCollector

__all__ = ["build_version", "register_process"]


def build_version() -> str:
    """The installed package's version ("unknown" when run from a tree that was never installed)."""
    try:
        return importlib.metadata.version("pulsescale")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def register_process(registry: CollectorRegistry, component: str) -> None:
    """What every daemon's registry carries: the process, platform and GC collectors, and
    ``pulsescale_build_info{version,component}`` (deploy/monitoring's alerts and dashboard read these)."""
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    if GC_COLLECTOR is not None:  # None on interpreters without gc statistics
        GCCollector(registry=registry)
    info = Gauge("pulsescale_build_info", "The running build (value 1)", ["version", "component"], registry=registry)
    info.labels(build_version(), component).set(1)
