"""gateway — the reference gateway: a reverse proxy in front of each model's ready slots, with a bounded FIFO queue
per model and least-loaded routing, that publishes the contract's queue samples (`gateway.proxy`); and a load
generator for the article's pulse (`gateway.loadgen`).

Internal code imports modules (``from gateway import proxy``); the names below are the public face, loaded when
asked so that the load generator does not pull in NATS.
"""

from __future__ import annotations

__all__ = ["Gateway", "GatewaySettings", "LoadResult", "PulseShape", "run", "run_load"]


def __getattr__(name: str) -> object:
    if name in ("Gateway", "GatewaySettings", "run"):
        from gateway import proxy

        return getattr(proxy, name)
    if name in ("LoadResult", "PulseShape", "run_load"):
        from gateway import loadgen

        return getattr(loadgen, name)
    raise AttributeError(f"module 'gateway' has no attribute {name!r}")
