"""The node agent's Prometheus metrics, bound to an injected registry (tests build a fresh one each).

As the other daemons' registries, it carries the process, platform and GC collectors and
``pulsescale_build_info{version,component}``; deploy/monitoring's alerts and dashboard read these names."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Final

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
)

from warmpool.build import register_process
from warmpool.protocol import SlotState

__all__ = ["ACTIVATION_BUCKETS_S", "AgentMetrics"]

ACTIVATION_BUCKETS_S: Final = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
)
"""From the 1 ms a token check takes to the 2.5 s activation deadline, fine where the targets are (≤ 300 ms)."""


class AgentMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        register_process(registry, "agent")
        self.nats_connected = Gauge(
            "pulsescale_nats_connected", "1 while the connection to NATS is up (the agent binds it)", registry=registry
        )
        self.activation_seconds = Histogram(
            "pulsescale_agent_activation_seconds",
            "Time an activation spent per stage (token, load, engine, readiness, total), successful activations",
            ["stage"],
            buckets=ACTIVATION_BUCKETS_S,
            registry=registry,
        )
        self.activations = Counter(
            "pulsescale_agent_activations_total",
            "Activate requests by outcome: ready, refused (bad token/claim/state), failed, deadline",
            ["outcome"],
            registry=registry,
        )
        self.deactivations = Counter(
            "pulsescale_agent_deactivations_total", "Deactivate requests by outcome", ["outcome"], registry=registry
        )
        self.rejected = Counter(
            "pulsescale_agent_rejected_messages_total",
            "Agent requests rejected for breaking wire contract v1, by reason",
            ["reason"],
            registry=registry,
        )
        self.busy = Counter(
            "pulsescale_agent_busy_requests_total",
            "Agent requests answered busy at once, by verb: too many in flight (max_requests_in_flight)",
            ["verb"],
            registry=registry,
        )
        self.record_corrections = Counter(
            "pulsescale_agent_record_corrections_total",
            "Ready slot records another writer changed under this agent's claim (endpoint or token), by action: "
            "corrected (the true endpoint written back) or fenced (the engine stopped, the slot failed)",
            ["action"],
            registry=registry,
        )
        self.registry_rejected = Counter(
            "pulsescale_registry_rejected_records_total",
            "Registry records (pulse_slots, pulse_agents) that break wire contract v1, skipped, by reason",
            ["reason"],
            registry=registry,
        )
        self.slots = Gauge(
            "pulsescale_agent_slots", "This agent's slots by registry state", ["state"], registry=registry
        )
        self.warm_slot_seconds = Counter(
            "pulsescale_agent_warm_slot_seconds",
            "Seconds this agent's slots spent warm (standby: prewarmed, claimable, serving nobody), summed over its "
            "slots, by model: the warm pool's idle cost (one GPU per slot: idle standby GPU-seconds). Integrated "
            "at every slot state the agent writes or sees and at each heartbeat",
            ["model"],
            registry=registry,
        )
        self._warm: tuple[float, int] | None = None  # (when, warm slots) at the last `set_slots`
        self.staged_bytes = Gauge(
            "pulsescale_agent_weights_staged_bytes", "Bytes of verified weights staged in shm", registry=registry
        )
        self.locked_bytes = Gauge(
            "pulsescale_agent_weights_locked_bytes",
            "Bytes of staged weights locked in memory (mlock)",
            registry=registry,
        )
        self.lock_refused = Gauge(
            "pulsescale_agent_weights_lock_refused",
            "1 when mlock was refused and the weights run unlocked (see the status verb for why)",
            registry=registry,
        )
        self.staging_seconds = Gauge(
            "pulsescale_agent_staging_seconds", "Duration of the last staging (copy, verify, lock)", registry=registry
        )
        self.staged_bytes_total = Counter(
            "pulsescale_agent_staged_bytes_total",
            "Bytes of weights files staged, by how: copied (from the model directory), fetched (downloaded from the "
            "model URL), reused (already staged and verified: kept across a prewarm or an agent restart)",
            ["how"],
            registry=registry,
        )
        self.hashed_bytes_total = Counter(
            "pulsescale_agent_hashed_bytes_total",
            "Bytes read and hashed to verify staged weights (an agent restart re-verifies: hashed, not copied)",
            registry=registry,
        )
        self.staging_refused = Counter(
            "pulsescale_agent_staging_refused_total",
            "Stages refused before writing anything, by reason: shm_budget (beyond --shm-budget)",
            ["reason"],
            registry=registry,
        )
        self.loaded_bytes = Counter(
            "pulsescale_agent_loaded_bytes_total", "Bytes the loader moved into engine memory", registry=registry
        )
        self.zygote_arms = Counter(
            "pulsescale_agent_zygote_arms_total",
            "Zygotes armed (start-up and re-arms after a death)",
            registry=registry,
        )
        self.engine_exits = Counter(
            "pulsescale_agent_engine_unexpected_exits_total",
            "Engine processes or zygotes that died on their own",
            registry=registry,
        )
        self.engines_unresponsive = Counter(
            "pulsescale_agent_engines_unresponsive_total",
            "Serving engines stopped after failing the liveness probe (GET of the health path) engine_probe_failures "
            "times in a row: their claims failed so the autoscaler replaces them",
            registry=registry,
        )
        self.foreign_records = Counter(
            "pulsescale_agent_foreign_records_removed_total",
            "Records under this node's keys for its model that are not its slots, deleted (another writer with "
            "this node's permissions made them: the autoscaler would try them in vain)",
            registry=registry,
        )

    def set_slots(self, model: str, counts: Mapping[SlotState, int], now: float | None = None) -> None:
        """``pulsescale_agent_slots{state}`` from `counts` (slots by registry state), and the time since the last call
        at the warm count that held then into ``pulsescale_agent_warm_slot_seconds_total{model}``: a time-weighted
        sum, exact to within the interval between calls (`now`: monotonic seconds, default now)."""
        now = time.monotonic() if now is None else now
        warm_seconds = self.warm_slot_seconds.labels(model)  # there from the first call, at 0
        if self._warm is not None:
            since, warm = self._warm
            warm_seconds.inc(warm * max(0.0, now - since))
        self._warm = (now, counts.get("warm", 0))
        for state, n in counts.items():
            self.slots.labels(state).set(n)
