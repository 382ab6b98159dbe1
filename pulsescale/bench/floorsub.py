"""The ingest floor's subscriber: bare nats-py in a process of its own, as an autoscaler replica is.

``python -m pulsescale.bench.floorsub URL PREFIX``: subscribe to ``PREFIX.>`` with a callback that decodes each
sample (`protocol.decode`, what our intake does first) and counts it; answer the count on ``PREFIX.count``
(``PREFIX`` itself is not a sample subject). Prints ``ready`` once subscribed. `pulsescale.bench.ingest` runs it.
"""

from __future__ import annotations

import asyncio
import sys

from pulsescale.bench.hog import _die_with_parent
from warmpool import connect, protocol
from warmpool.protocol import QueueSample


async def _serve(url: str, prefix: str) -> None:
    nc = await connect.connect(connect.NatsOptions(servers=(url,), name="bench-ingest-floor"))
    count = 0

    async def on_sample(msg) -> None:  # type: ignore[no-untyped-def]
        nonlocal count
        protocol.decode(msg.data, QueueSample)
        count += 1

    async def on_count(msg) -> None:  # type: ignore[no-untyped-def]
        await msg.respond(str(count).encode())

    await nc.subscribe(f"{prefix}.m.>", cb=on_sample, pending_msgs_limit=1_000_000)
    await nc.subscribe(f"{prefix}.count", cb=on_count)
    await nc.flush()
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the bench closes our stdin
    await nc.close()


def main() -> None:
    _die_with_parent()
    asyncio.run(_serve(sys.argv[1], sys.argv[2]))


if __name__ == "__main__":
    main()
