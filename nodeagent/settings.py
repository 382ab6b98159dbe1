"""The node agent's settings: one frozen dataclass, a unit in every name and a reason on every default."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from warmpool.connect import NatsOptions

__all__ = ["AgentSettings"]


@dataclass(frozen=True)
class AgentSettings:
    node: str
    """This node's name: the `<node>` of ``pulse.agent.<node>.*`` and of the slot keys."""
    model_dir: Path
    """The model to stage: safetensors files, ``config.json`` and ``sha256sums.txt`` (see `tinymodel`)."""
    model_name: str
    """The model's name in the registry (the directory's name unless told otherwise)."""
    nats: NatsOptions = field(default_factory=NatsOptions)
    rack: str = ""
    """Placement spreads a model's replicas over racks; empty means unknown."""
    slots: int = 1
    """Slots this node offers for the model (one engine each); named s0, s1, ..."""
    engine: str = "local"
    loader: str = "auto"
    """``auto`` picks the best loader the node and engine allow (`loaders.choose`)."""
    shm_dir: Path = Path("/dev/shm/pulsescale")
    """Where weights are staged: tmpfs, so staged bytes are page-cache pages the engine can map in place."""
    engine_host: str = "127.0.0.1"
    """Address the engines bind. Loopback by default (safe); a node serving a gateway binds 0.0.0.0."""
    advertise_host: str | None = None
    """Host put in endpoints (the pod or node IP); defaults to `engine_host` unless that is 0.0.0.0."""
    engine_port_base: int = 0
    """Slot i serves on this port + i; 0 lets each engine take a free port (reported in its endpoint)."""
    engine_memory: str = "shared"
    """``shared``: the engine reads the shm mapping in place (no copy). ``private``: the loader copies the weights
    into engine-owned memory, what an engine with its own device memory needs (and what `bench` measures)."""
    lease_s: float = 6.0
    """A lease this old is stale: its slots stop being claimable. Three missed heartbeats, not one hiccup."""
    heartbeat_interval_s: float = 2.0
    """A third of the lease."""
    metrics_host: str = "127.0.0.1"
    """Address ``/metrics``, ``/healthz`` and ``/status`` bind. Loopback by default: they are unauthenticated and
    describe the node. In Kubernetes give the pod IP (downward API ``status.podIP``) so Prometheus can scrape it;
    ``0.0.0.0`` only on purpose."""
    metrics_port: int | None = 9464
    """Prometheus ``/metrics`` (and ``/healthz``, ``/status``); None disables it, 0 picks a free port."""
    lock_weights: bool = True
    """``mlock`` the staged weights; refused locks are reported and the agent runs unlocked."""
    stage_threads: int = 2
    """Files copied and hashed at once: hashing runs at ~1.7 GB/s per core, so two saturate most disks."""
    max_consecutive_failures: int = 3
    """Failed activations in a row after which a slot is `failed` (quarantined until a prewarm) rather than
    returned to `warm`: one crash may be bad luck, three is a broken slot that would eat every claim."""
    engine_user: str = "nobody"
    """Who engines run as when the agent is root (a name or a uid): the zygote drops to it, with no_new_privs,
    before it serves, so an engine compromised through a request is not root on a GPU node. ``root`` opts out."""
    # --- requests in flight (issue 8): work started per message is bounded ---
    max_requests_in_flight: int = 64
    """`prewarm`, `activate` and `deactivate` requests handled at once; beyond it a request is answered ``busy``
    at once. A node has a handful of slots, each serialised by its lock, so 64 covers every honest burst (a
    scale-up claims each slot once, retries included) while a flood cannot grow tasks and memory without bound."""
    max_status_in_flight: int = 8
    """`status` requests handled at once, a pool of their own: on-call can still see the agent under a flood of
    the other verbs, and a flood of status calls cannot starve activations."""
    # --- liveness of serving engines (issue 8 review), `agent.Agent.liveness_loop` ---
    engine_probe_interval_s: float = 2.0
    """Every serving engine is asked ``GET`` its health path (`ready_path` for the command engine, ``/health`` for
    the others) this often: a stopped (SIGSTOP) or wedged engine stays `ready`
    in the registry otherwise, since only a process exit is noticed. 0 turns the probe off."""
    engine_probe_timeout_s: float = 1.0
    """One probe's bound: a health path answers in milliseconds on a loaded engine (no model work); a second is a
    hang."""
    engine_probe_failures: int = 3
    """Failed probes in a row after which the engine is stopped, its claim failed and released (the autoscaler
    replaces it): one slow answer under a burst is not a dead engine; three, about 9 s at the defaults, is."""
    # --- standby server engines (issue 9): ``command`` (and ``vllm``), `nodeagent.served` ---
    engine_cmd: str | None = None
    """The ``command`` engine's server command line (shlex-split, no shell) with ``{port}``, ``{host}``,
    ``{model_dir}``, ``{staged_dir}``, ``{model_name}``, ``{slot}`` placeholders (`served.PLACEHOLDERS`)."""
    ready_path: str = "/health"
    """The ``command`` engine's health path: a slot is `warm` only once it answers 200, activation's readiness
    check and the liveness probe ask it too (`Started.health_path`). vLLM's server always answers ``/health``."""
    engine_start_timeout_s: float = 600.0
    """Server start to its first healthy answer, at prewarm: vLLM on CPU takes ~60 s for a tiny model, a large
    model on a GPU node minutes; beyond this the slot is `failed` with the server's last output."""
    log_dir: Path | None = None
    """Where standby servers' output is written (``<slot>.log``, 0600, in a 0700 directory the agent owns);
    None: ``<shm_dir>/.logs`` (tmpfs: the logs never wait on a disk; each is capped, `served.LOG_MAX_BYTES`)."""
    vllm_args: str = ""
    """Extra arguments for each vLLM standby server (shlex-split), e.g. ``--max-model-len 4096``."""
    vllm_sleep_mode: str = "auto"
    """``auto``: sleep/wake standbys where vLLM has sleep mode (a CUDA build on an NVIDIA node), resident
    elsewhere (vLLM's CPU platform refuses it); ``on``/``off`` force it (`nodeagent.vllm`)."""
    # --- the EROFS rootfs (issue 9), `nodeagent.rootfs` ---
    image_source: Path | None = None
    """``--image``: a directory or an image tarball (docker save / OCI layout) the engines' Python and
    site-packages come from, built into a read-only EROFS image; None: engines run from the node's own files."""
    rootfs_dir: Path = Path("/var/lib/pulsescale/rootfs")
    """Built images (``images/<sha256>.erofs``) and their mounts (``mnt/<sha256>``): on disk, not tmpfs, so a
    built image outlives a reboot and costs no RAM beyond the page cache that serves it."""
    rootfs_min_resident_pct: float = 99.0
    """Below this share of the image's pages in the page cache a slot is warmed again before it is offered: at
    99 % an activation's imports read (almost) nothing from disk."""
    rootfs_pin: bool = True
    """``--no-pin-rootfs`` turns it off. Lock the mounted image's pages in memory (mmap + mlock, as ``vmtouch -l``):
    a warm image is evicted between re-checks by memory pressure or, on kernels with proactive reclaim (DAMON
    ``pageout``, as on this project's CI machines), with none, and the next activation reads from disk. Costs the
    image's size in locked memory (shared with the page cache, not a copy); needs CAP_IPC_LOCK, which root has."""
    # --- staging at scale (issue 9): a URL source, the shm budget, progress ---
    model_url: str | None = None
    """Stage from this http(s) URL base (``<url>/sha256sums.txt``, ``<url>/<file>``: a P2P proxy such as Dragonfly,
    an object store) instead of `model_dir`; downloads resume with Range requests (`nodeagent.fetch`). When set,
    `model_dir` is the staged directory (the files land there)."""
    shm_budget_bytes: int | None = None
    """Most shm the staging directory may hold at the peak of a stage (the old version stays until the new one
    verifies, so a changed model counts twice); a stage beyond it is refused, nothing evicted. None: bounded only
    by /dev/shm's free space."""
    staging_retry_first_s: float = 1.0
    """A stage refused for lack of shm room (`errors.NoShmRoom`) is tried again after this long, then after twice
    as long each time: room freed by an operator (a stale model removed) is taken within about a second."""
    staging_retry_max_s: float = 30.0
    """The longest pause between those tries: shm full for hours costs a look at its free space (one ``statvfs``)
    every 30 s, and a stage runs again only when that room grew; room freed late is still taken within 30 s."""
    fetch_timeout_s: float = 30.0
    """Connect and per-read timeout of a download: a stalled proxy counts as a dropped connection (resumed)."""
    fetch_retries: int = 5
    """Attempts after the first per file, each resuming where the last stopped (backoff from 0.5 s to 8 s)."""
    fetch_redirect_hosts: frozenset[str] = frozenset()
    """Hosts a model URL may redirect to besides its own origin (`fetch.FetchOptions.redirect_hosts`)."""
    progress_interval_s: float = 5.0
    """A staging progress line (bytes, MB/s, ETA) at most this often, or every 10 % of the bytes, in the log."""
    faults: Mapping[str, str] = field(default_factory=dict)
    """Test-only failpoints, slot name -> ``crash`` | ``hang`` | ``unhealthy`` | ``fail`` (see `zygote.FAULTS`)."""

    @property
    def slot_names(self) -> list[str]:
        return [f"s{i}" for i in range(self.slots)]

    @property
    def engine_log_dir(self) -> Path:
        return self.log_dir if self.log_dir is not None else self.shm_dir / ".logs"

    @property
    def model_source(self) -> str:
        """What staging reads: the URL base when given, else the model directory."""
        return self.model_url or str(self.model_dir)

    @property
    def endpoint_host(self) -> str:
        if self.advertise_host:
            return self.advertise_host
        return "127.0.0.1" if self.engine_host in ("0.0.0.0", "::", "") else self.engine_host
