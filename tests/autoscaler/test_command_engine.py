"""The ``command`` engine: a standby OpenAI-compatible server per slot, driven through a real agent, a real
nats-server and real server processes (`tests/openai_server_double.py`, stdlib only)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shlex
import signal
import stat
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
from nats.aio.client import Client

from autoscaler.commands.service import CommandService
from nodeagent import served
from oncall import verbs
from tests.autoscaler.test_commands import ControlPlaneDouble, make_spec, send
from tests.autoscaler.test_commands import request as cmd_request
from tests.helpers import ShiftedClock
from tests.nodeagent_helpers import (
    MODEL,
    NODE,
    activate,
    alive,
    completion,
    deactivate,
    key,
    running_agent,
    settings,
    state,
    wait_for,
    wait_state,
)
from warmpool.embedded import NatsServer
from warmpool.protocol import PoolReply
from warmpool.registry import KvSlotStore

DOUBLE = Path(__file__).resolve().parents[1] / "openai_server_double.py"


def _python() -> str:
    """An interpreter the engine user can run: as root the server drops to `nobody`, who cannot enter a
    pyenv under /root; the system Python runs the stdlib-only double."""
    if os.geteuid() != 0:
        return sys.executable
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(candidate, os.X_OK):
            return candidate
    pytest.skip("running as root and no system python3 that the engine user (nobody) can execute")


def command(*extra: str) -> str:
    return shlex.join([_python(), str(DOUBLE), "--host", "{host}", "--port", "{port}", "--slot", "{slot}", *extra])


def server_pids(marker: str) -> set[int]:
    """Live processes whose command line carries `marker` (from /proc, not from the agent's word)."""
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            if marker.encode() in cmdline and alive(int(entry)):
                found.add(int(entry))
    return found


def read(path: str) -> str:
    return Path(path).read_text()


def uid_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    raise AssertionError(f"no Uid line for {pid}")


@contextlib.asynccontextmanager
async def no_leftovers(marker: str) -> AsyncIterator[None]:
    """Fails the test if a server with `marker` outlives it; kills any such leftover either way."""
    try:
        yield
    finally:
        left = server_pids(marker)
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert not left, f"server processes left behind: {left}"


async def test_a_standby_server_is_warm_only_once_healthy_and_serves_resident_across_activations(
    nats_server: NatsServer, nc: Client, store: KvSlotStore, model_dir: Path, shm_dir: Path
) -> None:
    marker = f"m{secrets.token_hex(4)}"
    cfg = settings(
        model_dir, shm_dir, nats_server.url, engine="command", engine_cmd=command("--behave", "slow", "--model", marker)
    )
    async with no_leftovers(marker), running_agent(cfg) as (agent, _):
        rec = await wait_state(store, key("s0"), "warm")
        assert rec.engine == "command"
        slot = agent.slots["s0"]
        assert isinstance(slot.engine, served.ServedEngine)
        pid = slot.engine.pid
        assert pid is not None and server_pids(marker) == {pid}
        # The slot was announced only after the server's health check said 200, after the 503s of its loading.
        tail = agent.status().slots[0].log_tail
        answers = [line for line in tail if '"GET /health HTTP/1.0"' in line]
        assert [a.split()[-2] for a in answers[:4]] == ["503", "503", "503", "200"], tail
        if os.geteuid() == 0:
            assert uid_of(pid) == 65534  # nobody
            assert os.getsid(pid) == pid  # its own session and process group

        endpoints = []
        for _ in range(2):
            claim = await store.claim_slot(key("s0"))
            reply = await activate(nc, claim)
            assert reply.ok, reply.error
            assert reply.fields["engine_mode"] == "resident"
            endpoint = reply.fields["endpoint"]
            endpoints.append(endpoint)
            rec = await wait_state(store, key("s0"), "ready")
            assert rec.endpoint == endpoint and rec.engine == "command" and rec.engine_mode == "resident"
            out = await completion(endpoint)
            assert out["choices"][0]["text"] == f" pid{pid}"  # type: ignore[index]  # the standby answered
            st = agent.status().slots[0]
            assert st.engine_mode == "resident" and st.endpoint == endpoint
            reply = await deactivate(nc, claim)
            assert reply.ok, reply.error
            await wait_state(store, key("s0"), "warm")
            assert slot.engine.pid == pid and alive(pid)  # resident: the same process, still standing
        assert endpoints[0] == endpoints[1]
        assert (await wait_state(store, key("s0"), "warm")).engine_mode == "resident"  # the last activation's
        # `pulsescale pool` (the autoscaler's command service, reading the registry) shows engine and mode.
        svc = CommandService(nc, ControlPlaneDouble({MODEL: make_spec(MODEL)}), store, clock=ShiftedClock())
        await svc.start()
        try:
            pool = msgspec.convert(await send(nc, "pool", cmd_request("pool")), PoolReply)
        finally:
            await svc.stop()
        (row,) = pool.slots
        assert (row.engine, row.engine_mode) == ("command", "resident")
        table = verbs.format_pool(pool).splitlines()
        assert table[1].split()[6] == "ENGINE" and table[2].split()[6] == "command/resident"

        st = agent.status().slots[0]
        assert st.log_path is not None
        log_file, log_dir = os.stat(st.log_path), os.stat(os.path.dirname(st.log_path))
        assert stat.S_IMODE(log_file.st_mode) == 0o600 and log_file.st_uid == os.geteuid()
        assert stat.S_IMODE(log_dir.st_mode) == 0o700 and log_dir.st_uid == os.geteuid()
        assert "POST /v1/completions" in read(st.log_path)
    assert not alive(pid)  # the agent's stop took its server down


async def test_a_server_that_exits_or_never_gets_healthy_fails_its_slot_with_the_log_tail_others_stay_warm(
    nats_server: NatsServer, nc: Client, store: KvSlotStore, model_dir: Path, shm_dir: Path
) -> None:
    marker = f"m{secrets.token_hex(4)}"
    cfg = settings(
        model_dir,
        shm_dir,
        nats_server.url,
        slots=3,
        engine="command",
        engine_cmd=command("--model", marker, "--behave-for", "s1=exit", "--behave-for", "s2=never-healthy"),
        engine_start_timeout_s=2.0,
    )
    async with no_leftovers(marker), running_agent(cfg) as (agent, _):
        exited = await wait_state(store, key("s1"), "failed")
        assert exited.reason is not None
        assert "exited with code 3 before /health answered 200" in exited.reason
        assert "refusing to start (as asked)" in exited.reason  # the server's last words, from its log
        never = await wait_state(store, key("s2"), "failed")
        assert never.reason is not None
        assert "not healthy after 2 s (/health: answered 503)" in never.reason
        assert '"GET /health HTTP/1.0" 503' in never.reason
        warm = await wait_state(store, key("s0"), "warm")
        assert warm.engine == "command"
        claim = await store.claim_slot(key("s0"))
        reply = await activate(nc, claim)
        assert reply.ok, reply.error
        by_slot = {s.slot: s for s in agent.status().slots}
        assert any("refusing to start" in line for line in by_slot["s1"].log_tail)
        s2 = agent.slots["s2"].engine
        assert isinstance(s2, served.ServedEngine) and s2.pid is None  # the unhealthy one was stopped
        assert len(server_pids(marker)) == 1


async def test_a_standby_server_that_dies_while_idle_is_restarted_and_the_slot_comes_back_warm(
    nats_server: NatsServer, nc: Client, store: KvSlotStore, model_dir: Path, shm_dir: Path
) -> None:
    marker = f"m{secrets.token_hex(4)}"
    cfg = settings(model_dir, shm_dir, nats_server.url, engine="command", engine_cmd=command("--model", marker))
    async with no_leftovers(marker), running_agent(cfg) as (agent, _):
        await wait_state(store, key("s0"), "warm")
        engine = agent.slots["s0"].engine
        assert isinstance(engine, served.ServedEngine)
        first = engine.pid
        assert first is not None
        os.kill(first, signal.SIGKILL)
        await wait_for(lambda: engine.pid not in (None, first) and agent.slots["s0"].idle, 20, "a new server")
        await wait_state(store, key("s0"), "warm")
        assert engine.restarts == 1 and "was killed by SIGKILL" in "\n".join(engine.log_tail())
        claim = await store.claim_slot(key("s0"))
        reply = await activate(nc, claim)
        assert reply.ok, reply.error
        out = await completion(reply.fields["endpoint"])
        assert out["choices"][0]["text"] == f" pid{engine.pid}"  # type: ignore[index]


@pytest.mark.serial  # the servers must go within a bound of the agent's exit: run alone (tests/conftest.py)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
async def test_a_stopped_or_killed_agent_leaves_no_server_process(
    nats_server: NatsServer, store: KvSlotStore, model_dir: Path, shm_dir: Path, sig: signal.Signals
) -> None:
    marker = f"m{secrets.token_hex(4)}"
    agent = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "pulsescale",
        "agent",
        "--node",
        NODE,
        "--model",
        str(model_dir),
        "--shm-dir",
        str(shm_dir),
        "--slots",
        "2",
        "--metrics-port",
        "-1",
        "--nats",
        nats_server.url,
        "--engine",
        "command",
        "--engine-cmd",
        command("--model", marker),
        stderr=asyncio.subprocess.DEVNULL,
    )
    async with no_leftovers(marker):
        try:
            for slot in ("s0", "s1"):
                await wait_state(store, key(slot), "warm", timeout_s=30)
            servers = server_pids(marker) - {agent.pid}  # the agent's own command line names the marker too
            assert len(servers) == 2
            agent.send_signal(sig)
            await asyncio.wait_for(agent.wait(), 30)
            await wait_for(
                lambda: not server_pids(marker) & servers, 10, f"the servers to go with the agent ({sig.name})"
            )
        finally:
            if agent.returncode is None:
                agent.kill()
                await agent.wait()


async def test_processes_a_server_moved_out_of_its_group_are_killed_when_its_slot_restarts(
    nats_server: NatsServer, store: KvSlotStore, model_dir: Path, shm_dir: Path
) -> None:
    """vLLM's workers outlive a killed API server, and a child in its own session escapes the group kill and the
    parent-death signal: after the agent is SIGKILLed, its next start finds them by the marker in their
    environment and kills them before it starts the slot's server again."""
    marker = f"m{secrets.token_hex(4)}"
    argv = [sys.executable, "-m", "pulsescale", "agent", "--node", NODE, "--model", str(model_dir), "--shm-dir",
            str(shm_dir), "--metrics-port", "-1", "--nats", nats_server.url, "--engine", "command",
            "--engine-cmd", command("--model", marker, "--escape-child")]  # fmt: skip
    async with no_leftovers(marker):
        first = await asyncio.create_subprocess_exec(*argv, stderr=asyncio.subprocess.DEVNULL)
        second: asyncio.subprocess.Process | None = None
        try:
            await wait_state(store, key("s0"), "warm", timeout_s=30)
            before = server_pids(marker) - {first.pid}
            assert len(before) == 2  # the server and the child it moved into a session of its own
            first.kill()
            await first.wait()
            await wait_for(lambda: len(server_pids(marker) & before) == 1, 10, "the server to go with the agent")
            [escaped] = server_pids(marker) & before  # what the parent-death signal did not reach
            second = await asyncio.create_subprocess_exec(*argv, stderr=asyncio.subprocess.DEVNULL)
            await wait_for(lambda: not alive(escaped), 30, "the restarted agent to kill the escaped child")
            await wait_state(store, key("s0"), "warm", timeout_s=30)
            second.send_signal(signal.SIGTERM)
            await asyncio.wait_for(second.wait(), 30)
            await wait_for(lambda: not server_pids(marker) - {first.pid, second.pid}, 10, "nothing left after a stop")
        finally:
            for agent in (first, second):
                if agent is not None and agent.returncode is None:
                    agent.kill()
                    await agent.wait()


async def test_the_local_engine_records_fork_mode(
    nats_server: NatsServer, nc: Client, store: KvSlotStore, model_dir: Path, shm_dir: Path
) -> None:
    async with running_agent(settings(model_dir, shm_dir, nats_server.url)) as (agent, _):
        assert (await wait_state(store, key("s0"), "warm")).engine == "local"
        claim = await store.claim_slot(key("s0"))
        reply = await activate(nc, claim)
        assert reply.ok and reply.fields["engine_mode"] == "fork"
        rec = await wait_state(store, key("s0"), "ready")
        assert rec.engine == "local" and rec.engine_mode == "fork"
        assert agent.status().slots[0].engine_mode == "fork"


def test_the_command_line_is_split_without_a_shell_and_placeholders_are_checked() -> None:
    argv = served.render("srv --port {port} --name '{model_name} x' ; rm", {"port": 8, "model_name": "m"})
    assert argv == ("srv", "--port", "8", "--name", "m x", ";", "rm")
    with pytest.raises(served.BadCommand, match=r"unknown placeholder \{prot\}.*\{port\}"):
        served.render("srv --port {prot}", {"port": 8})
    with pytest.raises(served.BadCommand, match="cannot split"):
        served.render("srv 'unclosed", {})


LEAKER = """\
import sys, time
from multiprocessing import shared_memory
seg = shared_memory.SharedMemory(name=sys.argv[1], create=True, size=1 << 16)
print("made", flush=True)
time.sleep(60)
"""


def test_shared_memory_a_killed_server_group_left_is_swept_and_what_is_in_use_stays(tmp_path: Path) -> None:
    """vLLM and torch use multiprocessing segments (/dev/shm/psm_*), unlinked only on a clean exit: a group killed
    with SIGKILL (its resource tracker too) leaves them, 150-250 MB per vLLM server. The sweep removes those, never
    one a live process still maps."""
    from multiprocessing import shared_memory

    t0 = time.time()
    leaked, held = f"psm_pstest_{secrets.token_hex(4)}", f"psm_pstest_{secrets.token_hex(4)}"
    script = tmp_path / "leak.py"
    script.write_text(LEAKER)
    proc = subprocess.Popen([sys.executable, str(script), leaked], stdout=subprocess.PIPE, start_new_session=True)
    keep = shared_memory.SharedMemory(name=held, create=True, size=1 << 12)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"made\n"
        os.killpg(proc.pid, signal.SIGKILL)  # the whole group, its resource tracker with it
        proc.wait()
        assert (Path("/dev/shm") / leaked).exists()  # what the kill leaves behind
        removed = served.sweep_shared_memory(os.geteuid(), t0)
        assert leaked in removed and held not in removed
        assert not (Path("/dev/shm") / leaked).exists() and (Path("/dev/shm") / held).exists()
        assert served.sweep_shared_memory(os.geteuid() + 1, t0) == []  # another user's segments are not ours to judge
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()
        keep.close()
        keep.unlink()
        with contextlib.suppress(FileNotFoundError):
            (Path("/dev/shm") / leaked).unlink()


# --- --ready-path: every health check of a standby server asks it -----------------------------------------------------
# The warm check, activation's readiness check and the liveness probe of a serving engine, against a server that
# answers health only on ``/ready`` and 404 on ``/health``.

PROBE_INTERVAL_S = 0.1


def _gets(log_path: str, path: str, status: str | None = "200") -> int:
    """Answers to ``GET path`` the server logged with `status`, None: any (``"GET /ready HTTP/1.1" 200 -``; the
    warm check speaks HTTP/1.0)."""
    return sum(
        f'"GET {path} HTTP/1.' in line and (status is None or line.endswith(f" {status} -"))
        for line in Path(log_path).read_text().splitlines()
    )


async def test_a_server_healthy_only_on_its_ready_path_activates_and_passes_the_liveness_probe(
    nats_server: NatsServer, nc: Client, store: KvSlotStore, model_dir: Path, shm_dir: Path
) -> None:
    marker = f"m{secrets.token_hex(4)}"
    cfg = settings(
        model_dir,
        shm_dir,
        nats_server.url,
        engine="command",
        engine_cmd=command("--model", marker, "--health-path", "/ready"),
        ready_path="/ready",
        engine_probe_interval_s=PROBE_INTERVAL_S,
        engine_probe_timeout_s=0.5,
    )
    async with no_leftovers(marker), running_agent(cfg) as (agent, registry):
        await wait_state(store, key("s0"), "warm")
        slot = agent.slots["s0"]
        assert isinstance(slot.engine, served.ServedEngine)
        st = agent.status().slots[0]
        assert st.log_path is not None

        claim = await store.claim_slot(key("s0"))
        reply = await activate(nc, claim)
        assert reply.ok, reply.error  # before the fix: "not ready after ... : /health answered 404"
        rec = await wait_state(store, key("s0"), "ready")
        assert rec.endpoint == reply.fields["endpoint"]
        active = slot.active
        assert active is not None and active.started.health_path == "/ready"

        # The liveness probe asks /ready too: over many probe intervals (3 failures in a row would stop the
        # engine) the engine keeps serving under the same claim, and the server saw the probes arrive.
        before = _gets(st.log_path, "/ready")
        await asyncio.sleep(PROBE_INTERVAL_S * 15)
        # before the fix: stopped after 3 probes ("/health answered 404"), the claim failed
        assert not registry.get_sample_value("pulsescale_agent_engines_unresponsive_total")
        assert slot.active is active
        rec = state(store, key("s0"))
        assert rec is not None and rec.state == "ready", rec
        assert rec.claim_id == claim.claim_id and rec.endpoint == reply.fields["endpoint"]
        await wait_for(lambda: _gets(st.log_path, "/ready") >= before + 5, 10, "liveness probes on /ready")
        out = await completion(reply.fields["endpoint"])
        assert out["object"] == "text_completion"
        # Nothing of the agent asked the default path, which this server does not serve.
        assert _gets(st.log_path, "/health", status=None) == 0

        reply = await deactivate(nc, claim)
        assert reply.ok, reply.error
        await wait_state(store, key("s0"), "warm")
