"""bridge — `pulsescale bridge`: the contract's queue samples from engines' Prometheus metrics or PromQL queries,
for teams whose gateway does not publish on NATS (`bridge.daemon`).

Internal code imports modules (``from bridge import readings``); the names below are the public face, loaded when
asked so that the pure parts (`readings`, `parse`) do not pull in NATS or aiohttp.
"""

from __future__ import annotations

__all__ = ["Bridge", "BridgeSettings", "Query", "Target", "run"]


def __getattr__(name: str) -> object:
    if name in ("Bridge", "run"):
        from bridge import daemon

        return getattr(daemon, name)
    if name in ("BridgeSettings", "Query", "Target"):
        from bridge import settings

        return getattr(settings, name)
    raise AttributeError(f"module 'bridge' has no attribute {name!r}")
