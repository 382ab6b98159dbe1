"""Issue 25: an agent that comes back finds its slots as they should be; staging waits for space; a dead agent's
slots are not offered again; an engine that cannot start says why and fails its slot.

All real: nats-server, agent processes (SIGSTOP / SIGKILL), real /dev/shm staging and real engine processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from nats.aio.client import Client
from prometheus_client import CollectorRegistry

from autoscaler.controller import ControllerSettings
from nodeagent import modelformat
from tests.autoscaler.test_autoscaler import (  # noqa: F401 - cancel_gateways is an autouse fixture
    Gateway,
    autoscaler_in_process,
    cancel_gateways,
    put_scaler,
)
from tests.autoscaler.test_command_engine import command, no_leftovers
from tests.helpers import wait_for
from tests.nodeagent_helpers import (
    MODEL,
    activate,
    key,
    request,
    running_agent,
    settings,
    state,
    wait_state,
)
from warmpool.embedded import NatsServer
from warmpool.protocol import SlotRecord
from warmpool.registry import Changed, KvSlotStore

LEASE_S = 2.0
HEARTBEAT_S = LEASE_S / 3  # the CLI heartbeats three times a lease


def agent_process(url: str, node: str, model_dir: Path, shm_dir: Path, *extra: str) -> subprocess.Popen[bytes]:
    """A real agent process (`extra` flags come last: a repeated flag wins)."""
    return subprocess.Popen(
        [sys.executable, "-m", "pulsescale", "agent", "--nats", url, "--node", node, "--slots", "1",
         "--model", str(model_dir), "--model-name", MODEL, "--shm-dir", str(shm_dir), "--metrics-port", "-1",
         "--lease-s", str(LEASE_S), "--log-level", "INFO", *extra],
    )  # fmt: skip


@contextlib.contextmanager
def reaped(proc: subprocess.Popen[bytes]) -> Iterator[subprocess.Popen[bytes]]:
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def test_a_slot_released_while_its_agent_was_away_is_warm_within_a_heartbeat_of_its_return(
    nats_server: NatsServer, nc: Client, store: KvSlotStore, model_dir: Path, shm_dir: Path
) -> None:
    key = f"{MODEL}.away.s0"
    with reaped(agent_process(nats_server.url, "away", model_dir, shm_dir)) as proc:
        await wait_state(store, key, "warm", timeout_s=30)
        claim = await store.claim_slot(key)
        reply = await activate(nc, claim, node="away")
        assert reply.ok, reply
        await wait_state(store, key, "ready")
        os.kill(proc.pid, signal.SIGSTOP)  # serving when it froze: the autoscaler replaces it once the lease lapses
        await wait_for(lambda: store.index.lease_lapsed("away", time.time()), 10, "the lease lapsed")
        await store.release(claim, reason="activation timed out")
        rec = await wait_state(store, key, "failed")
        assert rec.reason is not None and "was away" in rec.reason
        os.kill(proc.pid, signal.SIGCONT)
        t0 = time.monotonic()
        await wait_state(store, key, "warm", timeout_s=10)
        assert time.monotonic() - t0 <= HEARTBEAT_S + 1.5, f"warm again after {time.monotonic() - t0:.1f} s"


async def test_a_dead_agents_slots_are_not_offered_again_before_its_lease_lapses(
    nats_server: NatsServer, nc: Client, store: KvSlotStore, model_dir: Path, shm_dir: Path
) -> None:
    """An agent SIGKILLed while an activation of one of its slots is in flight (its engine hangs): the activation
    times out, the deactivate finds nobody subscribed, and no slot of that node is claimed again while its lease
    (6 s) is still fresh."""
    claims: list[tuple[float, str]] = []

    async def watch() -> None:
        async for ev in store.watch():
            if isinstance(ev, Changed) and ev.record.state == "claimed":
                claims.append((time.monotonic(), ev.key))

    watcher = asyncio.create_task(watch())
    faults = ("--fault", "s0=hang", "--fault", "s1=hang")
    proc = agent_process(nats_server.url, "dead", model_dir, shm_dir, "--slots", "2", "--lease-s", "6", *faults)
    try:
        with reaped(proc):
            await wait_for(lambda: sum(r.state == "warm" for r in store.records(MODEL)) == 2, 30, "2 warm")
            await put_scaler(nc, MODEL, maxReplicaCount=2)
            async with autoscaler_in_process(nats_server.url, controller=ControllerSettings(activation_deadline_s=1.0)):
                Gateway(nc, MODEL).background(4, 8.0)
                await wait_for(lambda: bool(claims), 10, "a claim")
                await asyncio.sleep(0.2)  # the activation is in flight: the engine hangs
                proc.kill()
                killed = time.monotonic()
                # Until the lease lapses (at least 4 s from now: renewed every 2 s, 6 s long).
                await asyncio.sleep(3.5)
                again = [k for t, k in claims if t > killed]
                assert not again, f"claimed again {len(again)} time(s) while the dead agent's lease was fresh: {again}"
    finally:
        watcher.cancel()


# --- staging waits for shm room -----------------------------------------------------------------------------------

BLOB_BYTES = 2**20


def _need_bytes(model_dir: Path) -> int:
    """What staging the model writes: every file its manifest names."""
    return sum((model_dir / name).stat().st_size for name in modelformat.read_manifest(model_dir))


def _blob(path: Path, nbytes: int) -> None:
    """A file whose every block is allocated (written, not sparse): what counts against shm."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(b"\1" * nbytes)


def _weights_file(model_dir: Path) -> Path:
    return next(p for p in sorted(model_dir.iterdir()) if p.suffix == ".safetensors")


def _corrupt_a_shard(model_dir: Path) -> None:
    """One byte of a weights file flipped: the manifest's sha256 no longer matches."""
    shard = _weights_file(model_dir)
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))


def _refused(registry: CollectorRegistry) -> float:
    return registry.get_sample_value("pulsescale_agent_staging_refused_total", {"reason": "shm_budget"}) or 0.0


def _records(caplog: pytest.LogCaptureFixture, text: str, level: int) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno == level and text in r.getMessage()]


async def test_a_stage_refused_for_the_shm_budget_is_staged_once_a_stale_model_is_removed(
    nats_server: NatsServer, store: KvSlotStore, model_dir: Path, shm_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two stale models fill the budget: the slot is `failed` with the reason, logged once; removing one is not
    enough (a quiet retry, refused again, still one log line); removing the other brings the slot `warm` on the
    next look at the room (the back-off is at 2 s by then), with no prewarm and no restart."""
    caplog.set_level(logging.DEBUG, logger="pulsescale")
    for stale in ("old-a", "old-b"):
        _blob(shm_dir / stale / "model.safetensors", BLOB_BYTES)
    cfg = settings(model_dir, shm_dir, nats_server.url, shm_budget_bytes=_need_bytes(model_dir) + BLOB_BYTES // 2)
    async with running_agent(cfg) as (agent, registry):
        rec = await wait_state(store, key("s0"), "failed")
        assert (
            rec.reason is not None and "--shm-budget" in rec.reason and "staged again once room appears" in rec.reason
        )
        shutil.rmtree(shm_dir / "old-a")  # room grows, but not enough: one more try, refused as the first
        await wait_for(lambda: _refused(registry) >= 2, 10, "a second, refused, try")
        rec = await wait_state(store, key("s0"), "failed")
        assert "--shm-budget" in (rec.reason or "")
        shutil.rmtree(shm_dir / "old-b")
        freed = time.monotonic()
        await wait_state(store, key("s0"), "warm", timeout_s=10)
        assert time.monotonic() - freed < 5, f"warm {time.monotonic() - freed:.1f} s after the room was freed"
        assert agent.staged is not None and _refused(registry) == 2
    errors = _records(caplog, "staging failed", logging.ERROR)
    assert len(errors) == 1, [r.getMessage() for r in errors]  # once per episode, not once per try
    assert len(_records(caplog, "shm has room again: staged tiny after 2 tries", logging.INFO)) == 1


async def test_an_agent_stopped_while_a_stage_waits_for_room_stops_at_once_leaving_no_task(
    nats_server: NatsServer, store: KvSlotStore, model_dir: Path, shm_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="asyncio")
    _blob(shm_dir / "old" / "model.safetensors", BLOB_BYTES)
    cfg = settings(model_dir, shm_dir, nats_server.url, shm_budget_bytes=_need_bytes(model_dir) + BLOB_BYTES // 2)
    async with running_agent(cfg) as (agent, _):
        await wait_state(store, key("s0"), "failed")
        await wait_for(lambda: any(t.get_name() == "staging-room-wait" for t in asyncio.all_tasks()), 5, "the wait")
        stopping = time.monotonic()
    assert time.monotonic() - stopping < 5  # the wait is cancelled, not waited out
    assert agent.keeper.task_count == 0
    assert not any(t.get_name() == "staging-room-wait" for t in asyncio.all_tasks())
    assert not [r for r in caplog.records if r.name == "asyncio"], [r.getMessage() for r in caplog.records]
    await wait_for(
        lambda: (r := state(store, key("s0"))) is not None and "stopped at" in (r.reason or ""), 5, "its last word"
    )


async def test_a_stage_that_is_not_short_of_room_is_not_retried(
    nats_server: NatsServer, store: KvSlotStore, model_dir: Path, shm_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Corrupt weights are not a lack of room: failed once, with the reason, and left so (no retry, however long
    the back-off would have been)."""
    caplog.set_level(logging.DEBUG, logger="pulsescale")
    _corrupt_a_shard(model_dir)
    cfg = settings(model_dir, shm_dir, nats_server.url, staging_retry_first_s=0.1, staging_retry_max_s=0.1)
    async with running_agent(cfg) as (agent, _):
        rec = await wait_state(store, key("s0"), "failed")
        assert rec.reason is not None and "sha256 mismatch" in rec.reason and "room" not in rec.reason
        _, revision = store.entry(key("s0")) or (None, 0)
        await asyncio.sleep(1.0)  # ten back-offs' worth: nothing is written again
        assert store.entry(key("s0")) == (rec, revision)
        assert agent.staged is None
    assert len(_records(caplog, "staging failed", logging.ERROR)) == 1


@contextlib.contextmanager
def small_tmpfs(where: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` mounted at `where` (a filesystem of /dev/shm's kind that the test can fill); unmounted at
    exit, even on failure."""
    where.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)],
                       capture_output=True, text=True, check=False)  # fmt: skip
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root and CAP_SYS_ADMIN): {r.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, check=False)


@pytest.mark.root
async def test_a_stage_refused_because_shm_is_full_is_staged_once_space_is_freed(
    nats_server: NatsServer, store: KvSlotStore, model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No budget: the filesystem itself is full (a 4 MiB tmpfs with 3.5 MiB taken by another file). The slot
    fails with the free space it found; the file removed, the slot comes `warm`."""
    if os.geteuid() != 0:
        pytest.skip("needs root: mounting a tmpfs")
    caplog.set_level(logging.DEBUG, logger="pulsescale")
    with small_tmpfs(tmp_path / "shm", "4m") as shm:
        _blob(shm / "filler", 7 * 2**19)
        cfg = settings(model_dir, shm / "agent", nats_server.url, lock_weights=False)
        async with running_agent(cfg):
            rec = await wait_state(store, key("s0"), "failed")
            assert (
                rec.reason is not None and "MiB free" in rec.reason and "staged again once room appears" in rec.reason
            )
            await asyncio.sleep(1.5)  # a look at the room found none freed: still failed, nothing logged again
            assert (state(store, key("s0")) or rec).state == "failed"
            (shm / "filler").unlink()
            await wait_state(store, key("s0"), "warm", timeout_s=10)
    assert len(_records(caplog, "staging failed", logging.ERROR)) == 1


# --- an engine that cannot start says why, once, and fails its slot -------------------------------------------------


def _engine_python() -> str:
    """An interpreter the engine user can run: as root the server drops to `nobody`, who cannot enter this
    venv's pyenv under /root (0700); the system Python runs these one-line servers."""
    if os.geteuid() != 0:
        return sys.executable
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(candidate, os.X_OK):
            return candidate
    pytest.skip("running as root and no system python3 that the engine user (nobody) can execute")


def _server(code: str, *args: str) -> str:
    """An ``--engine-cmd``: `code` run by `_engine_python`, its port and a marker (to find leftovers) after it."""
    return shlex.join([_engine_python(), "-c", code, *args, "{port}"])


def _arm_errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.ERROR and "cannot arm its engine" in r.getMessage()
    ]


async def _failed_once(
    store: KvSlotStore, caplog: pytest.LogCaptureFixture, within_s: float, *, said: str
) -> tuple[SlotRecord, str]:
    """The slot's `failed` record within `within_s` of the agent's start, and the one log line that said why."""
    t0 = time.monotonic()
    rec = await wait_state(store, key("s0"), "failed", "warm", timeout_s=within_s + 10)
    took = time.monotonic() - t0
    assert rec.state == "failed", rec
    assert took < within_s, f"failed after {took:.1f} s"
    assert rec.reason is not None and said in rec.reason, rec.reason
    await asyncio.sleep(0.5)  # nothing more is said about it
    lines = _arm_errors(caplog)
    assert len(lines) == 1, lines
    assert f"slot {key('s0')}: cannot arm its engine: " in lines[0] and said in lines[0], lines[0]
    return rec, lines[0]


async def test_an_engine_that_crashes_at_import_fails_its_slot_with_the_reason_logged_once(
    nats_server: NatsServer, store: KvSlotStore, model_dir: Path, shm_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pulsescale")
    marker = f"m{secrets.token_hex(4)}"
    cmd = _server("import pulsescale_no_such_engine", marker)
    cfg = settings(model_dir, shm_dir, nats_server.url, engine="command", engine_cmd=cmd, engine_start_timeout_s=30)
    async with no_leftovers(marker), running_agent(cfg):
        rec, line = await _failed_once(store, caplog, 30, said="exited with code 1 before /health answered 200")
        assert "No module named 'pulsescale_no_such_engine'" in (rec.reason or "")  # its last words, in the record
        assert "pulsescale_no_such_engine" not in line  # ...never on the agent's own log
        started = [m for r in caplog.records if "server" in (m := r.getMessage()) and "starting" in m]
        assert started and "up to 30 s for /health" in started[0]


async def test_an_engine_whose_health_never_passes_fails_its_slot_at_the_health_timeout(
    nats_server: NatsServer, store: KvSlotStore, model_dir: Path, shm_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pulsescale")
    marker = f"m{secrets.token_hex(4)}"
    cmd = _server("import time; time.sleep(600)", marker)  # never listens
    cfg = settings(model_dir, shm_dir, nats_server.url, engine="command", engine_cmd=cmd, engine_start_timeout_s=3)
    async with no_leftovers(marker), running_agent(cfg) as (agent, _):
        await _failed_once(store, caplog, 3 + 5, said="not healthy after 3 s (/health: ")
        assert agent.slots["s0"].engine is not None and agent.slots["s0"].engine.status()["server_pid"] is None


def _closed_above(path: Path) -> tuple[str, Path | None]:
    """`path` as the agent names it (resolved) and the first directory on the way that others may not enter."""
    real = Path(os.path.realpath(path))
    return str(real), next((d for d in [*reversed(real.parents), real] if not d.stat().st_mode & 0o001), None)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the engine user (nobody) is dropped to only by a root agent")
async def test_a_model_dir_the_engine_user_cannot_read_fails_its_slot_naming_the_closed_directory(
    nats_server: NatsServer, store: KvSlotStore, model_dir: Path, shm_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The model is under pytest's root-only (0700) directory, as the review's DIR was: the server, as nobody,
    would fail on its own (vLLM after ~15 s, with a Hugging Face message about repo ids); the agent says why first."""
    real, closed = _closed_above(model_dir)
    assert closed is not None, f"{model_dir} is open to everyone: nothing to test"
    caplog.set_level(logging.INFO, logger="pulsescale")
    marker = f"m{secrets.token_hex(4)}"
    cmd = _server("import os, sys, time; os.listdir(sys.argv[1]); time.sleep(600)", "{model_dir}", marker)
    cfg = settings(model_dir, shm_dir, nats_server.url, engine="command", engine_cmd=cmd, engine_start_timeout_s=30)
    async with no_leftovers(marker), running_agent(cfg):
        said = f"cannot read the model directory {real} ({closed} is closed to it)"
        rec, line = await _failed_once(store, caplog, 30, said=said)
        assert "the engine user (uid 65534)" in line and "pulsescale agent --check" in line
        assert "stopped before it ran" in (rec.reason or "")


@pytest.fixture(name="open_model")
def open_model_fixture(model_dir: Path) -> Iterator[Path]:
    """A copy of the model that everyone may read (0755 directories, 0644 files), outside pytest's 0700 tree."""
    root = Path("/dev/shm") / f"pulsescale-open-model-{os.getpid()}-{secrets.token_hex(4)}"
    root.mkdir(mode=0o755)
    root.chmod(0o755)
    try:
        shutil.copytree(model_dir, root / MODEL)
        for p in [root / MODEL, *(root / MODEL).iterdir()]:
            p.chmod(0o755 if p.is_dir() else 0o644)
        yield root / MODEL
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the engine user (nobody) is dropped to only by a root agent")
async def test_a_model_file_the_engine_user_cannot_read_fails_its_slot_and_a_prewarm_after_the_fix_brings_it_warm(
    nats_server: NatsServer, nc: Client, store: KvSlotStore, open_model: Path, shm_dir: Path
) -> None:
    """The check passes a model the engine user can read (the server comes `warm`), and names the one file it
    cannot."""
    weights = _weights_file(open_model)
    weights.chmod(0o600)
    cmd = command("--model", "{model_dir}")  # the stdlib server double, as nobody: it answers /health
    cfg = settings(open_model, shm_dir, nats_server.url, engine="command", engine_cmd=cmd, engine_start_timeout_s=30)
    async with no_leftovers(str(open_model)), running_agent(cfg):
        rec = await wait_state(store, key("s0"), "failed", timeout_s=30)
        assert f"cannot read {weights.name} in the model directory {open_model}" in (rec.reason or ""), rec.reason
        weights.chmod(0o644)
        assert (await request(nc, "prewarm")).ok
        await wait_state(store, key("s0"), "warm", timeout_s=30)
