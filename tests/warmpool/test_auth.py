"""Every command against a real nats-server that has users: a refused password fails at the first refusal with
one line and exit 1 (daemons included), and a permission the user lacks is named, not waited out as a timeout.

Users (DESIGN.md, "Trust boundaries"): ``admin`` may do anything; ``oncall`` may publish only ``pulse.cmd.>``, as
the on-call role; ``viewer`` may do anything but publish ``pulse.cmd.>``.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from nats.aio.client import Client

from autoscaler.commands.service import CommandService
from pulsescale import cli as dispatcher
from tests.autoscaler.test_commands import ControlPlaneDouble, make_spec
from warmpool import connect
from warmpool.embedded import NatsServer
from warmpool.registry import KvSlotStore
from warmpool.seed import seed_pool

USERS = """
authorization {
  users = [
    {user: admin, password: adm1n}
    {user: oncall, password: 0ncall, permissions: {publish: {allow: ["pulse.cmd.>"]}}}
    {user: viewer, password: v1ewer, permissions: {publish: {deny: ["pulse.cmd.>"]}}}
  ]
}
"""
EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "examples" / "scaledobject-qwen.yaml"
SLOW_DEADLINE_S = 30.0
"""The connect deadline the wrong-password runs are given: a refusal must not wait for it."""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    with NatsServer(tmp_path_factory.mktemp("nats-auth"), extra_config=USERS) as s:
        yield s


@pytest.fixture
async def admin(server: NatsServer) -> AsyncIterator[Client]:
    nc = await connect.connect(connect.NatsOptions(servers=(server.url,), user="admin", password="adm1n"))
    try:
        yield nc
    finally:
        await nc.close()


@pytest.fixture
async def service(admin: Client) -> AsyncIterator[CommandService]:
    """An autoscaler's command plane that would answer, had the request been let through."""
    store = await KvSlotStore.open(admin)
    await store.start()
    await seed_pool(store, "qwen", nodes=1, slots_per_node=2)
    svc = CommandService(admin, ControlPlaneDouble({"qwen": make_spec("qwen")}), store)
    await svc.start()
    try:
        yield svc
    finally:
        await svc.stop()
        await store.close()


def as_user(server: NatsServer, user: str, password: str) -> list[str]:
    return ["--nats", server.url, "--nats-user", user, "--nats-password", password]


# --- a refused password ---------------------------------------------------------------------------------------


def every_command(tmp_path: Path) -> dict[str, list[str]]:
    return {
        "scale": ["scale", "qwen", "--replicas", "2"],
        "status": ["status"],
        "pool": ["pool"],
        "drain": ["drain", "node-0"],
        "apply": ["apply", "-f", str(EXAMPLE)],
        "sample": ["sample", "qwen", "--queue-depth", "1"],
        "slots": ["slots"],
        "assign": ["assign"],
        "agent": ["agent", "--node", "n1", "--model", str(tmp_path), "--shm-dir", str(tmp_path / "shm"),
                  "--metrics-port", "-1"],
        "autoscaler": ["autoscaler"],
    }  # fmt: skip


def test_a_wrong_password_is_one_line_and_exit_1_for_every_command(server: NatsServer, tmp_path: Path) -> None:
    """Real processes, as an operator runs them; the connect deadline is long, so only failing at the first
    refusal finishes in time. Daemons configure logging, so a retry logged per attempt would show here."""
    env = {**os.environ, "PULSESCALE_NATS_CONNECT_TIMEOUT": str(SLOW_DEADLINE_S)}

    def run(argv: list[str]) -> tuple[subprocess.CompletedProcess[str], float]:
        t0 = time.monotonic()
        r = subprocess.run(
            [sys.executable, "-m", "pulsescale", *argv, *as_user(server, "admin", "wrong")],
            capture_output=True,
            text=True,
            env=env,
            timeout=SLOW_DEADLINE_S * 2,
            check=False,
        )
        return r, time.monotonic() - t0

    commands = every_command(tmp_path)
    with ThreadPoolExecutor(max_workers=3) as pool:
        results = dict(zip(commands, pool.map(run, commands.values()), strict=True))
    for name, (r, elapsed_s) in results.items():
        lines = r.stderr.splitlines()
        assert r.returncode == 1, (name, r.returncode, r.stderr)
        assert len(lines) == 1, (name, r.stderr)
        assert lines[0].startswith(f"pulsescale {name}: cannot connect to NATS at {server.url}: "), (name, lines)
        assert "Authorization Violation" in lines[0] and "refused our credentials" in lines[0], (name, lines)
        assert elapsed_s < SLOW_DEADLINE_S / 2, (name, elapsed_s)  # generous: a process start is most of it
        assert r.stdout == "", (name, r.stdout)


@pytest.mark.parametrize("command", ["scale", "status", "pool", "drain", "apply", "sample", "slots"])
async def test_a_wrong_password_does_not_wait_for_the_connect_deadline(
    server: NatsServer, tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    """In process, where nothing but the connection takes time: with the default 5 s deadline, well under it."""
    argv = [*every_command(tmp_path)[command], *as_user(server, "admin", "wrong")]
    t0 = time.monotonic()
    code = await asyncio.to_thread(dispatcher.main, argv)
    elapsed_s = time.monotonic() - t0
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and "refused our credentials" in err
    assert elapsed_s < connect.DEFAULT_CONNECT_DEADLINE_S / 2


# --- a permission the user lacks --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "subject"),
    [
        (["scale", "qwen", "--replicas", "2"], "pulse.cmd.scale"),
        (["status"], "pulse.cmd.status"),
        (["pool", "qwen"], "pulse.cmd.pool"),
        (["drain", "node-0"], "pulse.cmd.drain"),
    ],
)
async def test_a_denied_command_is_named_not_timed_out(
    server: NatsServer, service: CommandService, capsys: pytest.CaptureFixture[str], argv: list[str], subject: str
) -> None:
    t0 = time.monotonic()
    code = await asyncio.to_thread(dispatcher.main, [*argv, "--timeout", "30", *as_user(server, "viewer", "v1ewer")])
    elapsed_s = time.monotonic() - t0
    err = capsys.readouterr().err
    assert code == 1
    assert err.startswith(f"pulsescale {argv[0]}: refused: permission denied on {subject} ("), err
    assert err.count("\n") == 1 and "publish" in err
    assert elapsed_s < 15  # generous; a timeout would take the full 30 s
    assert service.outcomes.total() == 0  # nothing reached the autoscaler


@pytest.mark.parametrize(
    ("argv", "subject"),
    [
        (["sample", "qwen", "--queue-depth", "3"], "pulse.queue.qwen"),
        (["slots"], "$JS.API."),
        (["apply", "-f", str(EXAMPLE)], "$JS.API."),
    ],
)
async def test_the_oncall_role_may_only_send_commands(
    server: NatsServer, service: CommandService, capsys: pytest.CaptureFixture[str], argv: list[str], subject: str
) -> None:
    """A gateway's samples and the registry's buckets are other roles' business: refused, and said so."""
    code = await asyncio.to_thread(dispatcher.main, [*argv, *as_user(server, "oncall", "0ncall")])
    out = capsys.readouterr()
    assert code == 1 and out.out == "", out
    assert out.err.startswith(f"pulsescale {argv[0]}: refused: permission denied on {subject}"), out.err
    assert out.err.count("\n") == 1
    # ... while the verbs of its role work.
    code = await asyncio.to_thread(dispatcher.main, ["status", *as_user(server, "oncall", "0ncall")])
    assert code == 0 and "qwen" in capsys.readouterr().out


def test_a_denied_permission_is_one_line_in_a_real_process(server: NatsServer) -> None:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pulsescale",
            "sample",
            "qwen",
            "--queue-depth",
            "1",
            *as_user(server, "oncall", "0ncall"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.splitlines() == [
        "pulsescale sample: refused: permission denied on pulse.queue.qwen (this NATS user may not publish to it: "
        "use the user of the right role, or grant it in the server's authorization)"
    ]


def test_a_daemon_without_its_roles_rights_stops_at_start_saying_which(server: NatsServer, tmp_path: Path) -> None:
    """The on-call user may not touch the registry: a daemon started with it ends at once, naming the subject,
    instead of timing out on the registry with a traceback."""
    commands = {name: every_command(tmp_path)[name] for name in ("autoscaler", "agent")}

    def run(argv: list[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "pulsescale", *argv, *as_user(server, "oncall", "0ncall")],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = dict(zip(commands, pool.map(run, commands.values()), strict=True))
    for name, r in results.items():
        assert r.returncode == 1 and "Traceback" not in r.stderr, (name, r.stderr)
        assert r.stderr.splitlines()[-1].startswith(
            f"pulsescale {name}: refused: permission denied on $JS.API.STREAM.INFO.KV_pulse_slots (this NATS user "
            "may not publish to it"
        ), (name, r.stderr)
