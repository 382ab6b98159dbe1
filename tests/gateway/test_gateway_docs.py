"""docs/gateways.md stays true: its minimal publisher, run as the page prints it, speaks the sample contract and
its pulse gets slots claimed by a real autoscaler (on a real nats-server, with protocol-level agents)."""

from __future__ import annotations

import asyncio
import os
import re
import sys
from pathlib import Path

from nats.aio.client import Client

from tests.agent_double import AgentDouble
from tests.autoscaler.test_autoscaler import autoscaler_in_process, held, put_scaler
from tests.helpers import wait_for
from warmpool import protocol
from warmpool.embedded import NatsServer
from warmpool.errors import BadMessage
from warmpool.protocol import QueueSample
from warmpool.registry import KvSlotStore

PAGE = Path(__file__).resolve().parents[2] / "docs" / "gateways.md"


def publisher_source() -> str:
    """The page's one Python block, under "A minimal publisher"."""
    section = PAGE.read_text().split("## A minimal publisher", 1)[1]
    found = re.search(r"```python\n(.*?)```", section, re.S)
    assert found is not None, "docs/gateways.md lost its publisher"
    return found.group(1)


def test_the_publisher_is_about_thirty_lines_and_imports_nothing_of_ours() -> None:
    code = publisher_source()
    assert len(code.strip().splitlines()) <= 40  # the README and the page say 37
    imported = set(re.findall(r"^(?:import|from) (\w+)", code, re.M))
    assert imported <= {"asyncio", "json", "os", "socket", "time", "nats"}, imported


async def test_the_documented_publisher_speaks_the_contract_and_its_pulse_is_claimed(
    nats_server: NatsServer, nc: Client, store: KvSlotStore, tmp_path: Path
) -> None:
    script = tmp_path / "publisher.py"
    script.write_text(publisher_source())
    seen: list[QueueSample] = []
    bad: list[BadMessage] = []

    async def heard(msg: object) -> None:
        try:
            seen.append(protocol.decode(msg.data, QueueSample))  # type: ignore[attr-defined]
        except BadMessage as err:
            bad.append(err)

    sub = await nc.subscribe("pulse.queue.chat", cb=heard)
    agents = [await AgentDouble(nc, store, f"node-{i}", "chat", slots=4, rack=f"r{i}").start() for i in range(2)]
    await put_scaler(nc, "chat")
    proc = None
    try:
        async with autoscaler_in_process(nats_server.url):
            env = {**os.environ, "NATS_URL": nats_server.url, "MODEL": "chat", "PULSE": "40", "HOLD_S": "2"}
            proc = await asyncio.create_subprocess_exec(sys.executable, str(script), env=env,
                                                        stderr=asyncio.subprocess.PIPE)  # fmt: skip
            await wait_for(lambda: held(store, "chat", ("claimed", "activating", "ready")), 10, "a claim for the pulse")
            _, err = await asyncio.wait_for(proc.communicate(), 30)
            assert proc.returncode == 0, err.decode()
    finally:
        if proc is not None and proc.returncode is None:
            proc.kill()
            await proc.wait()
        await sub.unsubscribe()
        for a in agents:
            await a.stop()
    assert not bad, bad
    assert len(seen) >= 40  # one per arrival, and the 100 ms ticks
    assert [s.seq for s in seen] == sorted(s.seq for s in seen) and len({s.seq for s in seen}) == len(seen)
    assert max(s.queue_depth for s in seen) == 40 and seen[-1].arrivals_total == 40
    assert {s.gateway for s in seen} == {seen[0].gateway} and seen[0].model == "chat"
