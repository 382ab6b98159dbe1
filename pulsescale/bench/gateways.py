"""The background gateways of `pulsescale bench decide`, in a process of their own, as a fleet's gateways are.

``python -m pulsescale.bench.gateways URL MODELS PHASES T0``: every one of ``m0 .. m<MODELS-1>`` speaks every
`SAMPLE_EVERY_S` at phase ``i % PHASES`` of it, its sample numbered by the period since ``T0`` (wall clock, the
bench's too: the bench's own pulses number theirs past it, `cycle`). A request on `QUIET_SUBJECT` (model names,
space-separated) silences those models before it is answered: a pulsed model's last word is the pulse's. Prints
``ready`` once subscribed; stops when its stdin closes.

Run in the bench's own process (before), 30,000 samples a second at 3,000 models took that process's loop, which
also times the claims, answers the activations as the stand-in agent and watches the slots: its delays were
counted as the autoscalers'.
"""

from __future__ import annotations

import asyncio
import sys
import time

from pulsescale.bench.hog import _die_with_parent
from pulsescale.bench.traffic import _sample
from warmpool import connect, protocol

__all__ = ["QUIET_SUBJECT", "SAMPLE_EVERY_S", "cycle"]

QUIET_SUBJECT = "bench.decide.gateways.quiet"
SAMPLE_EVERY_S = 0.1
"""Each gateway's sample interval (the contract's pace)."""
YIELD_EVERY = 200
"""The samples yield to the event loop after this many publishes (a publish rarely yields itself)."""


def cycle(t0: float, now: float | None = None) -> int:
    """The sample period since `t0` (wall clock), from 1: the background's sequence number now."""
    return int(((time.time() if now is None else now) - t0) / SAMPLE_EVERY_S) + 1


async def _serve(url: str, models: list[str], phases: int, t0: float) -> None:
    nc = await connect.connect(connect.NatsOptions(servers=(url,), name="bench-decide-gateways"))
    quiet: set[str] = set()

    async def on_quiet(msg) -> None:  # type: ignore[no-untyped-def]
        quiet.update(msg.data.decode().split())
        await msg.respond(b"")

    await nc.subscribe(QUIET_SUBJECT, cb=on_quiet)
    await nc.flush()
    print("ready", flush=True)
    closed = asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the bench closes our stdin
    try:
        while not closed.done():
            start = time.perf_counter()
            seq = cycle(t0)
            for phase in range(phases):
                for i, m in enumerate(models[phase::phases], 1):
                    if m not in quiet:
                        await nc.publish(protocol.queue_subject(m), _sample(m, seq, 0))
                    if i % YIELD_EVERY == 0:
                        await asyncio.sleep(0)  # the quiet requests are answered in between
                await asyncio.sleep(max(0.0, start + SAMPLE_EVERY_S * (phase + 1) / phases - time.perf_counter()))
    finally:
        await nc.close()


def main() -> None:
    _die_with_parent()
    url, n, phases, t0 = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    asyncio.run(_serve(url, [f"m{i}" for i in range(n)], phases, t0))


if __name__ == "__main__":
    main()
