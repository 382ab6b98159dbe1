"""What `pulsescale demo` runs, as one frozen dataclass with a unit and a reason on every field.

The defaults are tuned so that on a 2-core machine a default run shows the article's result: 0 timeouts and every
needed replica ready within 3 s of the pulse start. The arithmetic behind them:

- a replica serves one request at a time (the local engine's model lock) for ``max_tokens * token_ms`` of emulated
  accelerator time plus a little CPU: 20 tokens x 2.5 ms = 50 ms, about 20 requests/s per replica;
- the base load is provisioned at `base_utilisation`: 20 requests/s on 2 replicas (40 requests/s of capacity; Poisson
  arrivals queue now and then, and a fuller base makes the autoscaler add replicas before the pulse);
- the pulse offers 300 % of that capacity (120 requests/s), which 6-7 replicas carry; the default fleet has 8;
- the ScaledObject's `targetQueueDepth` of 1 (queued + in flight per replica) matches a replica that serves one
  request at a time, so the autoscaler's demand equals the replicas the load needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

__all__ = ["DemoSettings", "MODEL", "SOURCES", "parse_pulse"]

MODEL: Final = "tiny"
"""The model's name in the registry, on subjects and in the gateway's routes."""
SOURCES: Final = ("gateway", "vllm-metrics")
"""Where the autoscaler's demand comes from (`DemoSettings.source`)."""


def parse_pulse(text: str) -> float:
    """``300%``, ``3x`` or ``3``: the pulse as a multiple of the provisioned capacity."""
    raw = text.strip().lower()
    try:
        value = float(raw[:-1]) / 100 if raw.endswith("%") else float(raw.removesuffix("x"))
    except ValueError:
        raise ValueError(f"--pulse {text!r}: give a multiple of the provisioned capacity, as 300% or 3x") from None
    if not math.isfinite(value) or not 0 < value <= 100:
        hint = ""
        if math.isfinite(value) and value > 100 and not raw.endswith(("%", "x")):
            hint = f"; a bare number is a multiple: did you mean {raw}% ({value / 100:g}x)?"
        raise ValueError(f"--pulse {text!r}: must be above 0 and at most 100x the provisioned capacity{hint}")
    return value


@dataclass(frozen=True)
class DemoSettings:
    nodes: int = 8
    """Node agents in the fleet, one process each (the article's 100 instances, scaled to one machine)."""
    slots_per_node: int = 1
    """Slots (engines) per node agent."""
    pool_size: int | None = None
    """Slots kept warm before the pulse; None: the whole fleet (`nodes` x `slots_per_node`). Below what the pulse
    needs, the nodes outside the pool are started by the cold path when the autoscaler asks for them, and the run
    shows what that costs."""
    duration_s: float = 30.0
    """Seconds of offered load, from the first request to the last (the pulse is inside it)."""
    pulse: float = 3.0
    """The pulse as a multiple of the provisioned capacity (the article's 300 %)."""
    pulse_s: float = 10.0
    """How long the pulse is held; shorter when `duration_s` leaves less room."""
    pulse_at_s: float | None = None
    """Seconds into the load when the pulse starts; None: a third of `duration_s` (the base load runs long enough to
    show the steady state first)."""
    ramp_s: float = 1.0
    """The pulse reaches its rate within this many seconds (the article: within 1 s)."""
    base_rps: float = 20.0
    """Requests per second of the steady load."""
    base_utilisation: float = 0.6
    """The base replicas are provisioned so the base load uses this share of their capacity (headroom as run)."""
    arrivals: str = "uniform"
    """``uniform`` (evenly spaced, as Locust users with a constant wait send them) or ``poisson``. With Poisson
    arrivals a base of one or two replicas queues now and then, and at `targetQueueDepth` 1 the policy's panic mode
    takes two queued requests on one replica for a pulse: the demo would scale out before its pulse."""
    max_tokens: int = 20
    """Tokens each request asks for; with `token_ms` it sets a replica's service time."""
    token_ms: float = 2.5
    """Emulated accelerator time per generated token (the model's config ``token_ms``): the local engine sleeps it
    under its model lock, so a replica's capacity is a GPU's, not a share of this machine's few cores."""
    request_timeout_s: float = 5.0
    """A request still queued at the gateway after this long is answered 504 (the client's patience)."""
    queue_limit: int = 2000
    """Requests the gateway queues per model before it refuses more."""
    target_queue_depth: float = 1.0
    """ScaledObject `targetQueueDepth`: queued + in-flight requests per replica; one, as a replica serves one at a
    time."""
    cold_delay_s: float = 0.0
    """Added before a cold-path node starts, for what a real cluster adds before a pod's process starts (scheduling,
    the image pull: 1.5 + 120 s in the article). 0: only this machine's own cold start (a node agent from nothing)."""
    model_bytes: int = 8_000_000
    """Size of the generated tiny model: staged per node into /dev/shm, so the fleet holds `nodes` copies."""
    engine: str = "local"
    """Engine of every slot: ``local`` (forked numpy engine) or ``vllm`` (needs the vLLM extra)."""
    source: str = "gateway"
    """Where the autoscaler's demand comes from: ``gateway`` (the reference gateway publishes its queue on NATS, the
    push path) or ``vllm-metrics`` (the gateway publishes nothing; ``pulsescale bridge --slots`` reads every ready
    engine's vLLM /metrics and publishes instead, as for a gateway that cannot push). Both engines serve that page."""
    bridge_scrape_every_s: float = 0.25
    """``vllm-metrics``: the bridge's ``--scrape-every``. Its own default, so the run shows what the bridge costs as
    shipped."""
    engine_queue: int = 1000
    """``vllm-metrics``: requests the gateway sends one replica at once (its ``--endpoint-concurrency``). The bridge
    sees only what is in an engine, so the queue must be there, as in front of vLLM, which takes every request it
    is sent and queues it itself. A gateway that holds requests back hides them from the bridge: the autoscaler sizes
    by the arrival rate, and the bridge counts only the arrivals the engines get (at 16 per replica, one run here
    took 2.95 s to capacity against 0.83 s on the push path). 1000: the gateway holds back nothing of the default
    pulse, whose backlog stays in the low hundreds."""
    vllm_args: str = "--max-model-len 256 --enforce-eager"
    """``--engine vllm``: the server's extra arguments. The tiny model's context (512 positions) would make vLLM
    size its KV cache and warm-up for more than a demo asks; eager mode skips CUDA-graph capture (the article's
    manifest runs eager too; on CPU the agent adds it anyway)."""
    vllm_service_s: float = 0.1
    """``--engine vllm``: a first guess at a replica's time per request (the tiny model's 20 tokens on vLLM's CPU
    build: ~100 ms on two cores), which sets the base replicas before anything is measured. The pulse is sized from
    the measured time (`pulse_rps_for`): vLLM's speed depends on the machine, the local engine's is configured."""
    vllm_ready_timeout_s: float = 900.0
    """``--engine vllm``: how long the fleet may take to come up. A vLLM standby takes ~40-60 s to start on two
    idle cores, and a node starts one per slot, all at once."""
    image: str = "auto"
    """The engines' EROFS rootfs (`demo.image`): ``auto`` builds a small real image of the engines' Python packages
    when this machine can mount one (root, erofs-utils, the kernel's EROFS), ``none`` turns the stage off, anything
    else is a directory or image tarball to build. Without the capability the stage is skipped, said once."""
    out_dir: Path = Path("pulsescale-demo")
    """Where report.json and the PNG go."""
    headless: bool = False
    """No live view: one plain line per second instead (CI, logs)."""
    tick_s: float = 0.25
    """How often the live view and the recorded series are refreshed."""
    ready_timeout_s: float = 120.0
    """How long the fleet may take to stage weights and bring the base replicas up before the demo gives up."""
    drain_s: float = 8.0
    """After the last request is sent, how long the demo waits for the answers still outstanding."""
    stop_timeout_s: float = 15.0
    """How long each process gets to stop on SIGTERM before its process group is killed."""
    keep_logs: bool = True
    """Copy the processes' logs into `out_dir`/logs (small; the run's temporary directory is removed)."""
    extra: dict[str, str] = field(default_factory=dict)
    """Free-form notes copied into report.json's config (tests name their run)."""

    def __post_init__(self) -> None:
        for name in ("nodes", "slots_per_node", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        if self.pool_size is not None and not 0 <= self.pool_size <= self.fleet_slots:
            raise ValueError(f"--pool-size must be between 0 and the fleet's {self.fleet_slots} slots")
        if not self.duration_s >= 5:
            raise ValueError("--duration must be at least 5 s (a base load, a pulse and the way back)")
        if not 0 < self.base_rps <= 5000:
            raise ValueError("--base-rps must be above 0 and at most 5000")
        if not 0 < self.base_utilisation <= 1:
            raise ValueError("base_utilisation must be in (0, 1]")
        if not 0 <= self.cold_delay_s <= 600:
            raise ValueError("--cold-delay-s must be between 0 and 600 s")
        if self.arrivals not in ("uniform", "poisson"):
            raise ValueError(f"--arrivals {self.arrivals!r}: uniform or poisson")
        if not self.image:
            raise ValueError("--image: auto, none, or a directory or image tarball")
        if self.engine not in ("local", "vllm"):
            raise ValueError(f"--engine {self.engine!r}: local or vllm")
        if self.source not in SOURCES:
            raise ValueError(f"--source {self.source!r}: {' or '.join(SOURCES)}")
        if not 0 < self.bridge_scrape_every_s <= 1 or not 1 <= self.engine_queue <= 4000:
            raise ValueError("bridge_scrape_every_s must be in (0, 1] s and engine_queue in [1, 4000]")

    # --- derived figures ----------------------------------------------------------------------------------------

    @property
    def engine_connections(self) -> int:
        """``vllm-metrics``: the local engine's connections (its config's ``max_connections``): the gateway's
        `engine_queue` and room for the readiness check, the agent's probes and the bridge's scrapes."""
        return self.engine_queue + 32

    @property
    def fleet_slots(self) -> int:
        return self.nodes * self.slots_per_node

    @property
    def warm_slots(self) -> int:
        return self.fleet_slots if self.pool_size is None else self.pool_size

    @property
    def service_s(self) -> float:
        """A replica's nominal time per request (emulated accelerator time; the CPU part is measured in the run);
        for vLLM a first guess (`vllm_service_s`)."""
        if self.engine == "vllm":
            return self.vllm_service_s
        return self.max_tokens * self.token_ms / 1e3

    @property
    def replica_rps(self) -> float:
        """Nominal requests/s one replica serves."""
        return 1.0 / self.service_s if self.service_s > 0 else math.inf

    @property
    def base_replicas(self) -> int:
        """Replicas provisioned for the base load (the ScaledObject's `minReplicaCount`)."""
        return max(1, min(self.fleet_slots, math.ceil(self.base_rps / (self.replica_rps * self.base_utilisation))))

    @property
    def provisioned_rps(self) -> float:
        return self.base_replicas * self.replica_rps

    @property
    def pulse_rps(self) -> float:
        return self.pulse * self.provisioned_rps

    def pulse_rps_for(self, measured_service_s: float) -> float:
        """The pulse's rate once a replica's service time is measured: the nominal one for the local engine (its
        pace is configured, and the defaults are tuned on it), `pulse` x the base replicas' measured capacity for
        vLLM (whose pace only a measurement tells)."""
        if self.engine != "vllm" or measured_service_s <= 0:
            return self.pulse_rps
        return self.pulse * self.base_replicas / measured_service_s

    @property
    def pulse_start_s(self) -> float:
        return self.duration_s / 3 if self.pulse_at_s is None else self.pulse_at_s

    @property
    def pulse_len_s(self) -> float:
        """The pulse, cut so at least a fifth of the run (and 2 s) is left to show the way back."""
        room = self.duration_s - self.pulse_start_s - max(2.0, self.duration_s / 5)
        return max(1.0, min(self.pulse_s, room))
