"""The `pulsescale` dispatcher, run as a user runs it: a real process."""

from __future__ import annotations

import subprocess
import sys

from warmpool.embedded import NatsServer


def pulsescale(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pulsescale", *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def test_help_lists_every_group() -> None:
    r = pulsescale("--help")
    assert r.returncode == 0
    for word in ("daemons:", "on-call:", "autoscaler", "agent", "scale", "drain", "bench"):
        assert word in r.stdout


def test_unknown_command_fails_with_usage() -> None:
    r = pulsescale("frobnicate")
    assert r.returncode == 2 and "unknown command 'frobnicate'" in r.stderr


def test_help_does_not_import_the_daemons() -> None:
    code = (
        "import sys; from pulsescale import cli; cli.main(['--help']); "
        "print(sorted(m for m in ('autoscaler', 'nodeagent', 'nats', 'kopf') if m in sys.modules))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip().endswith("[]")


def test_bench_claims_prints_figures() -> None:
    r = pulsescale("bench", "claims", "--slots", "40", "--nodes", "4", "--claims", "60", "--concurrency", "1", "4")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "p99 ms" in lines[1] and "claims/s" in lines[1]
    rows = [line.split() for line in lines[2:4]]
    assert [row[0] for row in rows] == ["1", "4"]
    assert all(int(row[1]) == 60 and float(row[5]) > 0 for row in rows)


def test_slots_lists_the_registry(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import asyncio

    from warmpool import connect
    from warmpool.registry import KvSlotStore
    from warmpool.seed import seed_pool

    with NatsServer(tmp_path) as server:

        async def seed() -> None:
            nc = await connect.connect(connect.NatsOptions(servers=(server.url,)))
            async with await KvSlotStore.open(nc) as store:
                await seed_pool(store, "llama", nodes=2, slots_per_node=1)
            await nc.close()

        asyncio.run(seed())
        r = pulsescale("slots", "--nats", server.url)
    assert r.returncode == 0, r.stderr
    assert "llama.node-0.s0" in r.stdout and "warm" in r.stdout and "2 slot(s)" in r.stdout


def test_unreachable_nats_is_one_clear_line() -> None:
    from warmpool.embedded import free_port

    r = pulsescale("slots", "--nats", f"nats://127.0.0.1:{free_port()}", "--nats-connect-timeout", "0.5")
    assert r.returncode == 1
    assert r.stderr.startswith("pulsescale slots: cannot connect to NATS") and r.stderr.count("\n") == 1
