"""The node agent's subcommands: `pulsescale agent` (the daemon) and `pulsescale model` (model tools)."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import sys
import time
import urllib.parse
from collections.abc import Awaitable
from dataclasses import replace
from pathlib import Path

from nodeagent import fetch, modelformat, progress, served, tinymodel
from nodeagent.engine import ENGINES, loaders, safetensors_check
from nodeagent.engine.zygote import FAULTS
from nodeagent.errors import BadModel, BadWeights, EngineFailed, LoaderUnavailable, StagingFailed
from nodeagent.settings import AgentSettings
from warmpool import connect as nats_connect
from warmpool import daemonstart, durations, protocol
from warmpool import output as out
from warmpool.sizes import parse_size

__all__ = ["model", "run_agent"]


def _agent_parser(prog: str) -> argparse.ArgumentParser:
    d = AgentSettings(node="x", model_dir=Path("."), model_name="x")
    p = argparse.ArgumentParser(
        prog=prog,
        description="Run the node agent: stage a model's weights in shm, keep its slots warm and leased, activate "
        "and deactivate them on request (pulse.agent.<node>.*). SIGTERM stops it cleanly.",
    )
    p.add_argument("--node", default=os.environ.get("PULSESCALE_NODE"), help="this node's name [$PULSESCALE_NODE]")
    p.add_argument(
        "--rack", default=os.environ.get("PULSESCALE_RACK", ""), help="rack, for placement [$PULSESCALE_RACK]"
    )
    p.add_argument("--slots", type=int, default=d.slots, help=f"slots (engines) for the model [{d.slots}]")
    p.add_argument(
        "--model",
        required=True,
        metavar="DIR|URL",
        help="model directory (safetensors + sha256sums.txt), or an http(s) URL serving one (URL/sha256sums.txt, "
        "URL/<file>: a P2P proxy such as Dragonfly, an object store); downloads resume where they stopped",
    )
    p.add_argument(
        "--shm-budget",
        metavar="SIZE",
        help="most shm the staging directory may hold (e.g. 200GiB); a stage beyond it is refused, nothing in "
        "use evicted [no budget: /dev/shm's free space]",
    )
    p.add_argument(
        "--fetch-timeout-s",
        type=durations.duration_arg(),
        default=d.fetch_timeout_s,
        help=f"download connect/read timeout [{d.fetch_timeout_s:g}]",
    )
    p.add_argument(
        "--fetch-retries",
        type=int,
        default=d.fetch_retries,
        help=f"download retries per file, each resuming where the last stopped [{d.fetch_retries}]",
    )
    p.add_argument(
        "--fetch-redirect-host",
        action="append",
        default=[],
        metavar="HOST[:PORT]",
        help="a host the model URL may redirect to besides its own origin (an object store's presigned URLs); "
        "repeat for more [none: same origin only]",
    )
    p.add_argument("--model-name", help="the model's name in the registry [the directory's name]")
    p.add_argument("--engine", default=d.engine, choices=ENGINES, help=f"engine adapter [{d.engine}]")
    p.add_argument(
        "--loader",
        default=d.loader,
        choices=loaders.LOADERS,
        help="how an engine gets the staged weights: host (shm mapping in place or a CPU copy), cuda-pinned "
        "(pinned shm -> GPU over streams), kvikio (CuFile reads, GDS where it runs); auto picks host for an engine "
        "that computes on the CPU or a node without a usable GPU, and says why (agent log, status loader_reason) "
        f"[{d.loader}]",
    )
    p.add_argument("--shm-dir", default=str(d.shm_dir), help=f"where weights are staged [{d.shm_dir}]")
    p.add_argument("--engine-host", default=d.engine_host, help=f"address engines bind [{d.engine_host}]")
    p.add_argument("--advertise-host", help="host put in endpoints (pod/node IP) [the engine host]")
    p.add_argument("--engine-port-base", type=int, default=0, help="slot i serves on this port + i [0: any free port]")
    p.add_argument(
        "--engine-memory",
        default=d.engine_memory,
        choices=("shared", "private"),
        help="shared: engines read the shm mapping in place; private: the loader copies into engine memory",
    )
    p.add_argument(
        "--lease-s", type=durations.duration_arg(), default=d.lease_s, help=f"agent lease (10s, 1m) [{d.lease_s}s]"
    )
    p.add_argument("--metrics-host", default=d.metrics_host, help=f"metrics bind address [{d.metrics_host}]")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=d.metrics_port,
        help=f"Prometheus port, 0 = any free, -1 = off [{d.metrics_port}]",
    )
    p.add_argument("--no-mlock", action="store_true", help="do not lock the staged weights in memory")
    p.add_argument(
        "--engine-user",
        default=d.engine_user,
        help=f"user engines run as when the agent is root (name or uid; root opts out) [{d.engine_user}]",
    )
    p.add_argument(
        "--engine-cmd",
        metavar="CMDLINE",
        help="command engine: the server's command line (no shell), with {port} {host} {model_dir} {staged_dir} "
        "{model_name} {slot} {rootfs} placeholders ({rootfs}: the mounted --image, empty without one); one standby "
        "server per slot",
    )
    p.add_argument(
        "--ready-path",
        default=d.ready_path,
        help="command engine: the server's health path (200 = healthy), asked before warm, at activation and by the "
        f"liveness probe; vllm always uses /health [{d.ready_path}]",
    )
    p.add_argument(
        "--engine-start-timeout-s",
        type=durations.duration_arg(),
        default=d.engine_start_timeout_s,
        help=f"standby server start to healthy, else the slot fails [{d.engine_start_timeout_s:g}]",
    )
    p.add_argument(
        "--engine-probe-s",
        type=durations.duration_arg(allow_zero=True),
        default=d.engine_probe_interval_s,
        help=f"GET the health path (--ready-path; /health) of each serving engine this often; "
        f"{d.engine_probe_failures} failures in a row stop it "
        f"and fail its claim (0 = off) [{d.engine_probe_interval_s:g}]",
    )
    p.add_argument("--vllm-args", default="", metavar="ARGS", help="vllm engine: extra server arguments ['']")
    p.add_argument(
        "--vllm-sleep-mode",
        default=d.vllm_sleep_mode,
        choices=("auto", "on", "off"),
        help="vllm engine: sleep standbys and wake them on activation (auto: where vLLM has sleep mode, a CUDA "
        f"build on an NVIDIA node; resident on CPU) [{d.vllm_sleep_mode}]",
    )
    p.add_argument("--log-dir", help="where standby servers' logs go (0700, agent-owned) [<shm-dir>/.logs]")
    p.add_argument(
        "--image",
        metavar="SRC",
        help="rootfs for the engines: a directory or an image tarball (docker save / OCI layout), built into a "
        "read-only EROFS image (root + erofs-utils; without them the agent says so and runs without it)",
    )
    p.add_argument("--rootfs-dir", default=str(d.rootfs_dir), help=f"built images and their mounts [{d.rootfs_dir}]")
    p.add_argument(
        "--pin-rootfs",
        action=argparse.BooleanOptionalAction,
        default=d.rootfs_pin,
        help="lock the mounted image's pages in memory (mmap + mlock; CAP_IPC_LOCK), so neither memory pressure nor "
        "a kernel's proactive reclaim evicts them between re-checks; --no-pin-rootfs keeps them warm by re-checks "
        "alone [on]",
    )
    p.add_argument(
        "--cleanup",
        action="store_true",
        help="unmount this node's rootfs images (--rootfs-dir) and exit; one in use (a running agent) is left and "
        "said, exit 1, unless --force unmounts it lazily",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="check this node for the configuration given (the same flags as a real run) and exit: one line per "
        "check (OK / WARN / FAIL, what was measured, the fix), exit 1 on any FAIL; starts nothing, writes nothing",
    )
    p.add_argument("--fault", action="append", default=[], metavar="SLOT=KIND", help=argparse.SUPPRESS)
    daemonstart.add_log_level_argument(
        p, default=os.environ.get("PULSESCALE_LOG_LEVEL", "INFO"), choices=None, help="[INFO]"
    )
    nats_connect.add_nats_arguments(p)
    return p


def _settings(args: argparse.Namespace, p: argparse.ArgumentParser) -> AgentSettings:
    if not args.node:
        p.error("--node is required (or set PULSESCALE_NODE)")
    model_url, model_dir, name = _model_source(args, p)
    budget = None
    if args.shm_budget:
        try:
            budget = parse_size(args.shm_budget)
        except ValueError as err:
            p.error(f"--shm-budget: {err}")
    if args.fetch_timeout_s <= 0 or args.fetch_retries < 0:
        p.error("--fetch-timeout-s must be > 0 and --fetch-retries >= 0")
    for kind, value, flag in (("node", args.node, "--node"), ("model", name, "--model-name")):
        if not protocol.is_name(value):
            p.error(f"{kind} name {value!r} must match {protocol.NAME_PATTERN} (set {flag})")
    if not 1 <= args.slots <= protocol.MAX_SLOTS_PER_NODE:
        # Readers refuse a lease that lists more (contract revision 4): none of the node's slots would be offered.
        p.error(f"--slots must be between 1 and {protocol.MAX_SLOTS_PER_NODE}")
    if args.engine == "vllm":
        from nodeagent import vllm  # no vLLM import: its distribution and the node's GPU, looked up

        try:
            vllm.server_spec(
                engine_user=args.engine_user,
                extra_args=args.vllm_args,
                sleep_mode=args.vllm_sleep_mode,
                health_timeout_s=args.engine_start_timeout_s,
                version="",
            )
        except EngineFailed as err:
            p.error(f"--engine vllm: {err.reason}")
    if args.engine == "command":
        if not args.engine_cmd:
            p.error("--engine command needs --engine-cmd 'SERVER COMMAND LINE' (e.g. 'my-server --port {port}')")
        try:
            served.render(args.engine_cmd, dict.fromkeys(served.PLACEHOLDERS, "x"))
        except served.BadCommand as err:
            p.error(f"--engine-cmd: {err}")
    elif args.engine_cmd:
        p.error(f"--engine-cmd is for --engine command, not {args.engine}")
    if not args.ready_path.startswith("/"):
        p.error(f"--ready-path {args.ready_path!r} must start with /")
    if args.image:
        from nodeagent import rootfs  # a typo'd path stops the start, as a wrong --model does

        try:
            rootfs.source_kind(Path(args.image))
        except rootfs.BadImage as err:
            p.error(str(err))
    if args.engine_start_timeout_s <= 0:
        p.error("--engine-start-timeout-s must be > 0")
    if args.engine_probe_s < 0:
        p.error("--engine-probe-s must be >= 0 (0 turns the liveness probe off)")
    try:
        loaders.choose(args.loader, staging_dir=args.shm_dir)
    except LoaderUnavailable as err:
        p.error(str(err))
    if args.loader in loaders.GPU_LOADERS and args.engine == "local":
        p.error(
            f"--loader {args.loader}: the local engine computes on the CPU (numpy) and cannot use weights in GPU "
            "memory; use --loader host or auto (the GPU loaders are measured by `pulsescale bench activate --loader`)"
        )
    faults = {}
    slot_names = AgentSettings(node=args.node, model_dir=model_dir, model_name=name, slots=args.slots).slot_names
    for item in args.fault:
        slot, _, kind = item.partition("=")
        if kind not in FAULTS:
            p.error(f"--fault {item!r}: kind must be one of {', '.join(FAULTS)}")
        if slot not in slot_names:
            p.error(f"--fault {item!r}: no slot {slot!r} on this agent (it has {', '.join(slot_names)})")
        faults[slot] = kind
    if not 0 < args.lease_s <= protocol.MAX_LEASE_S:
        # Readers refuse a longer lease (contract revision 3): the node would never count as alive.
        p.error(f"--lease-s {args.lease_s:g}: must be > 0 and at most {protocol.MAX_LEASE_S:g} s")
    return AgentSettings(
        node=args.node,
        model_dir=model_dir,
        model_name=name,
        nats=nats_connect.options_from_args(args, name=f"pulsescale-agent-{args.node}"),
        rack=args.rack,
        slots=args.slots,
        engine=args.engine,
        loader=args.loader,
        shm_dir=Path(args.shm_dir),
        engine_host=args.engine_host,
        advertise_host=args.advertise_host,
        engine_port_base=args.engine_port_base,
        engine_memory=args.engine_memory,
        lease_s=args.lease_s,
        heartbeat_interval_s=max(0.2, args.lease_s / 3),
        metrics_host=args.metrics_host,
        metrics_port=None if args.metrics_port < 0 else args.metrics_port,
        lock_weights=not args.no_mlock,
        engine_user=args.engine_user,
        engine_cmd=args.engine_cmd,
        ready_path=args.ready_path,
        engine_start_timeout_s=args.engine_start_timeout_s,
        engine_probe_interval_s=args.engine_probe_s,
        vllm_args=args.vllm_args,
        vllm_sleep_mode=args.vllm_sleep_mode,
        log_dir=Path(args.log_dir) if args.log_dir else None,
        image_source=Path(args.image) if args.image else None,
        rootfs_dir=Path(args.rootfs_dir),
        rootfs_pin=args.pin_rootfs,
        faults=faults,
        model_url=model_url,
        shm_budget_bytes=budget,
        fetch_timeout_s=args.fetch_timeout_s,
        fetch_retries=args.fetch_retries,
        fetch_redirect_hosts=frozenset(args.fetch_redirect_host),
    )


def _model_source(args: argparse.Namespace, p: argparse.ArgumentParser) -> tuple[str | None, Path, str]:
    """(URL or None, the model directory, the model's name): a URL's files land in the staged directory."""
    if fetch.is_url(args.model):
        name = args.model_name or urllib.parse.urlsplit(args.model).path.rstrip("/").rsplit("/", 1)[-1]
        if not name:
            p.error(f"--model {fetch.shown(args.model)}: give the model's name with --model-name")
        return args.model, Path(args.shm_dir) / name, name
    if "://" in args.model:
        p.error(f"--model {args.model.split('://')[0]}://...: only http:// and https:// URLs are fetched")
    model_dir = Path(args.model)
    if not model_dir.is_dir():
        p.error(f"--model {model_dir}: not a directory")
    return None, model_dir, args.model_name or model_dir.resolve().name


def _cleanup(argv: list[str], prog: str) -> int:
    """`pulsescale agent --cleanup`: unmount our rootfs images, detach their loop devices, and exit."""
    from nodeagent import rootfs

    p = argparse.ArgumentParser(prog=f"{prog} --cleanup", description="Unmount this node's rootfs images and exit.")
    p.add_argument("--cleanup", action="store_true")
    p.add_argument("--rootfs-dir", default=str(AgentSettings(node="x", model_dir=Path("."), model_name="x").rootfs_dir))
    p.add_argument("--force", action="store_true")
    args, _ = p.parse_known_args(argv)  # the rest of an agent command line may follow: it is not needed here
    done = rootfs.cleanup(Path(args.rootfs_dir), lazy_if_busy=args.force)
    for what, how in done:
        print(f"{what}: {how}")
    counts = {how: sum(h == how for _, h in done) for how in dict.fromkeys(h for _, h in done)}
    said = ", ".join(f"{n} {how}" for how, n in counts.items()) or "nothing mounted"
    if any(how in rootfs.LEFT for _, how in done):
        why = (
            "in use: stop the agent and its engines first (a running agent keeps its image mounted and locked), "
            "or --force to unmount lazily (gone when its last user exits)"
            if not args.force
            else "still in use: released when its last user (the agent, an engine) exits"
        )
        print(f"cleanup of {args.rootfs_dir}: {said}; {why}", file=sys.stderr)
        return 1
    print(f"cleanup of {args.rootfs_dir}: {said}")
    return 0


def run_agent(argv: list[str], prog: str) -> int:
    if "--cleanup" in argv:
        return _cleanup(argv, prog)
    p = _agent_parser(prog)
    args = p.parse_args(argv)
    if args.check:
        from nodeagent import preflight  # the check's imports only when checking

        return preflight.main(args, lambda: _settings(args, preflight.RefusingParser(prog=prog)))
    settings = _settings(args, p)
    daemonstart.configure_logging(args)
    from nodeagent import agent  # the daemon's imports (nats, aiohttp) only when it runs

    def started(a: agent.Agent, port: int | None) -> None:
        where = f", metrics on :{port}" if port is not None else ""
        print(f"agent {settings.node}: serving pulse.agent.{settings.node}.*{where}", file=sys.stderr, flush=True)

    def run(nats: nats_connect.NatsOptions, stop: asyncio.Event, ready: asyncio.Event) -> Awaitable[None]:
        return agent.run(replace(settings, nats=nats), stop=stop, ready=ready, on_started=started)

    # NATS unreachable or refused, a permission denied at start, the metrics port taken: `PulsescaleError`s, which
    # the dispatcher prints as one line.
    daemonstart.run_until_signalled(settings.nats, run)
    return 0


# --- pulsescale model ------------------------------------------------------------------------------------------------


def _make_tiny_hf(args: argparse.Namespace) -> int:
    from nodeagent import hfmodel

    t0 = time.perf_counter()
    cfg = hfmodel.make_tiny_hf(args.dir, seed=args.seed)
    nbytes = Path(args.dir, hfmodel.WEIGHTS_FILE).stat().st_size
    fmt = out.machine(args)
    if fmt is not None:
        made = {"dir": str(args.dir), "format": "hf", "weights_bytes": nbytes, "config": cfg}
        print(out.dump({**made, "seconds": round(time.perf_counter() - t0, 3)}, fmt))
        return 0
    print(
        f"wrote {args.dir}: a {cfg['num_hidden_layers']}-layer Llama (hidden {cfg['hidden_size']}, head_dim "
        f"{cfg['head_dim']}, vocab {cfg['vocab_size']}), {nbytes / 1e6:.1f} MB of F32 weights in "
        f"{hfmodel.WEIGHTS_FILE} + tokenizer + {modelformat.MANIFEST_FILE} in {time.perf_counter() - t0:.1f} s"
    )
    return 0


def _make_tiny(args: argparse.Namespace) -> int:
    if args.format == "hf":
        return _make_tiny_hf(args)
    try:
        size = parse_size(args.size)
        shard = parse_size(args.shard_size)
    except ValueError as err:
        print(f"make-tiny: {err}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    cfg = tinymodel.make_tiny(args.dir, size, shard_bytes=shard, seed=args.seed)
    files = sorted(Path(args.dir).glob("*.safetensors"))
    fmt = out.machine(args)
    if fmt is not None:
        made = {"dir": str(args.dir), "format": "tiny", "weights_bytes": cfg.nbytes, "files": [f.name for f in files]}
        made |= {"dim": cfg.dim, "layers": cfg.layers, "experts": cfg.experts}
        print(out.dump({**made, "seconds": round(time.perf_counter() - t0, 3)}, fmt))
        return 0
    print(
        f"wrote {args.dir}: {cfg.nbytes / 1e6:.1f} MB of F32 weights in {len(files)} file(s) "
        f"(dim {cfg.dim}, {cfg.layers} layers x {cfg.experts} experts) + {modelformat.CONFIG_FILE} + "
        f"{modelformat.MANIFEST_FILE} in {time.perf_counter() - t0:.1f} s"
    )
    return 0


class _Shown:
    """A `progress.Progress` shown on stderr: a bar redrawn in place on a terminal (at most 10 times a second),
    plain lines every 5 s or 10 % otherwise (a log, CI)."""

    def __init__(self, what: str, total_bytes: int) -> None:
        self.tty = sys.stderr.isatty()
        self.last_fraction = 0.0
        gate = progress.Gate(interval_s=0.1, step=1.0) if self.tty else progress.Gate()
        self.p = progress.Progress(
            total_bytes=total_bytes, started_at=time.monotonic(), what=what, on_due=self._show, gate=gate
        )

    def _show(self, p: progress.Progress, now: float) -> None:
        self.last_fraction = p.fraction
        if self.tty:
            sys.stderr.write("\r\033[K" + progress.bar(p, now))
        else:
            sys.stderr.write(progress.describe(p, now) + "\n")
        sys.stderr.flush()

    def clear(self) -> None:
        """Before a line of output, so it does not land on the bar."""
        if self.tty:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()

    def done(self) -> None:
        self.clear()
        if not self.tty and self.last_fraction >= 1.0:
            return  # the last line said it all
        print(progress.describe(self.p, time.monotonic()), file=sys.stderr, flush=True)


def _verify(args: argparse.Namespace, prog: str) -> int:
    """Check a model directory the way staging will, without staging it; errors are prefixed `prog`."""
    bad = 0
    fmt = out.machine(args)
    results: list[dict[str, object]] = []

    def said(name: str, ok: bool, detail: str) -> None:
        results.append({"name": name, "ok": ok, "detail": detail})
        if fmt is None:
            print(f"{'ok  ' if ok else 'BAD '}  {name}{': ' + detail if detail else ''}", flush=True)

    try:
        sums = modelformat.read_manifest(args.dir)
    except BadModel as err:
        print(f"{prog}: {err}", file=sys.stderr)
        return 1
    sizes = {name: Path(args.dir, name).stat().st_size if Path(args.dir, name).is_file() else 0 for name in sums}
    shown = _Shown(f"verifying {args.dir}", sum(sizes.values()))
    for name, want in sorted(sums.items()):
        path = Path(args.dir, name)
        try:
            h = hashlib.sha256()
            with open(path, "rb") as f:
                while chunk := f.read(8 * 2**20):
                    h.update(chunk)
                    shown.p.add(len(chunk))
            shown.clear()
            if h.hexdigest() != want:
                raise BadWeights(name, "sha256 mismatch with the manifest")
            if name.endswith(".safetensors"):
                hdr = safetensors_check.read_header(path)
                said(name, True, f"{len(hdr.tensors)} tensors, {hdr.data_bytes} bytes")
            else:
                said(name, True, "")
        except (BadWeights, OSError) as err:
            bad += 1
            shown.clear()
            # The line already names the file: BadWeights' reason alone, not "name: name: reason".
            said(name, False, err.reason if isinstance(err, BadWeights) else str(err))
    shown.done()
    if fmt is not None:
        print(out.dump({"dir": str(args.dir), "ok": not bad, "files": results}, fmt))
    return 1 if bad else 0


def _stage(args: argparse.Namespace) -> int:
    """Stage a model (directory or URL) into shm as the agent does, with a progress bar: pre-stage a node before
    its agent starts (the agent re-verifies and reuses it), or measure staging GB/s."""
    from nodeagent import staging  # the staging imports only when staging

    budget = None
    try:
        budget = parse_size(args.shm_budget) if args.shm_budget else None
    except ValueError as err:
        print(f"stage: --shm-budget: {err}", file=sys.stderr)
        return 2
    src = args.source
    name = (
        args.model_name or (urllib.parse.urlsplit(src).path if fetch.is_url(src) else src).rstrip("/").rsplit("/")[-1]
    )
    if not protocol.is_name(name):
        print(f"stage: model name {name!r} must match {protocol.NAME_PATTERN} (set --model-name)", file=sys.stderr)
        return 2
    where = fetch.shown(src) if fetch.is_url(src) else src
    shown = _Shown(f"staging {name} from {where}", 0)
    try:
        staged = staging.stage(src, args.shm_dir, name, threads=args.threads, budget_bytes=budget, progress=shown.p)
    except (BadModel, BadWeights, StagingFailed) as err:
        shown.clear()
        print(f"stage: {err}", file=sys.stderr)
        return 1
    shown.clear()
    staged.close()
    how = staged.how
    rate = staged.written_bytes / staged.stage_s / 1e9 if staged.stage_s > 0 else 0.0
    fmt = out.machine(args)
    if fmt is not None:
        done = {"model": name, "dir": str(staged.dir), "files": len(staged.files), "bytes": staged.nbytes, "how": how}
        done |= {"written_bytes": staged.written_bytes, "reused_bytes": staged.reused_bytes}
        done |= {"hashed_bytes": staged.hashed_bytes, "seconds": round(staged.stage_s, 3), "gb_per_s": round(rate, 3)}
        print(out.dump(done, fmt))
        return 0
    print(
        f"staged {name} in {staged.dir}: {len(staged.files)} file(s), {staged.nbytes / 1e9:.3f} GB "
        f"({staged.written_bytes / 1e9:.3f} GB {how} at {rate:.2f} GB/s, {staged.reused_bytes / 1e9:.3f} GB reused, "
        f"{staged.hashed_bytes / 1e9:.3f} GB hashed) in {staged.stage_s:.2f} s"
    )
    return 0


def model(argv: list[str], prog: str) -> int:
    p = argparse.ArgumentParser(prog=prog, description="Model tools for the node agent.")
    sub = p.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser(
        "make-tiny",
        help="write a local-engine model of a given size (safetensors + sha256sums.txt)",
        description="Write a byte-level mixture-of-experts model for the local engine; sizes in SI (MB, GB) or "
        "binary (MiB, GiB) units.",
    )
    mk.add_argument("dir")
    mk.add_argument("--size", default="64MB", help="about this many bytes of weights [64MB]")
    mk.add_argument("--shard-size", default="512MiB", help="largest weights file [512MiB]")
    mk.add_argument("--seed", type=int, default=0)
    out.add_output_argument(mk)
    mk.add_argument(
        "--format",
        choices=("tiny", "hf"),
        default="tiny",
        help="tiny: the local engine's model (--size applies); hf: a tiny Llama in the Hugging Face layout with a "
        "locally trained BPE tokenizer, for the vllm and command engines (nothing downloaded) [tiny]",
    )
    ver = sub.add_parser("verify", help="check every file against sha256sums.txt and every safetensors header")
    ver.add_argument("dir")
    out.add_output_argument(ver)
    st = sub.add_parser(
        "stage",
        help="stage a model (directory or http(s) URL) into shm as the agent does, with a progress bar",
        description="Copy or download, verify and stage a model into shm, all or nothing, as the agent's prewarm "
        "does; the agent then re-verifies and reuses it. Prints the GB/s.",
    )
    st.add_argument("source", metavar="DIR|URL")
    st.add_argument("--shm-dir", default=str(AgentSettings(node="x", model_dir=Path("."), model_name="x").shm_dir))
    st.add_argument("--model-name", help="the model's name (its directory under --shm-dir) [the source's name]")
    st.add_argument("--shm-budget", metavar="SIZE", help="refuse beyond this much shm in --shm-dir [no budget]")
    st.add_argument("--threads", type=int, default=2, help="files copied at once [2]")
    out.add_output_argument(st)
    args = p.parse_args(argv)
    if args.cmd == "make-tiny":
        return _make_tiny(args)
    if args.cmd == "stage":
        return _stage(args)
    return _verify(args, f"{prog} verify")
