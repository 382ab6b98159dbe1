"""`pulsescale agent`, `pulsescale model` and `pulsescale bench activate` as an operator runs them: real processes."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

from nats.aio.client import Client

from tests.nodeagent_helpers import (  # noqa: F401
    MODEL,
    NODE,
    activate,
    alive,
    key,
    listening_addresses,
    model_dir_fixture,
    shm_dir_fixture,
    state,
    tiny_source_fixture,
    wait_for,
    wait_state,
)
from warmpool.embedded import NatsServer
from warmpool.registry import KvSlotStore


def pulsescale(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pulsescale", *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def children_of(pid: int) -> set[int]:
    """Every live descendant of `pid` (zygotes and their engines)."""
    out: set[int] = set()
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            kids = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        for k in map(int, kids):
            out.add(k)
            todo.append(k)
    return out


def start_agent(url: str, model_dir: Path, shm_dir: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable, "-m", "pulsescale", "agent", "--nats", url, "--node", NODE,
            "--model", str(model_dir), "--slots", "2", "--shm-dir", str(shm_dir), "--metrics-port", "0",
            "--lease-s", "3",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip


async def test_agent_process_serves_then_stops_cleanly_on_sigterm(
    nats_server: NatsServer, nc: Client, store: KvSlotStore, model_dir: Path, shm_dir: Path
) -> None:
    proc = start_agent(nats_server.url, model_dir, shm_dir)
    try:
        assert proc.stderr is not None
        line = await asyncio.wait_for(asyncio.to_thread(proc.stderr.readline), 30)
        while "metrics on :" not in line:
            assert line, f"the agent exited early (rc {proc.poll()})"
            line = await asyncio.wait_for(asyncio.to_thread(proc.stderr.readline), 30)
        m = re.search(r"metrics on :(\d+)", line)
        assert m, line
        port = int(m.group(1))
        assert listening_addresses(port) == {"0100007F"}  # the default: loopback only (--metrics-host to widen)
        for slot in ("s0", "s1"):
            await wait_state(store, key(slot), "warm")  # the model's name is its directory's name
        claim = await store.claim_slot(key("s0"))
        reply = await activate(nc, claim)
        assert reply.ok, reply.error
        metrics = await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        )
        assert 'pulsescale_agent_activation_seconds_count{stage="total"} 1.0' in metrics
        assert "pulsescale_agent_weights_locked_bytes" in metrics
        # what deploy/monitoring reads: the build, the NATS connection, the idle standby slot-seconds
        assert re.search(r'pulsescale_build_info\{component="agent",version="[^"]+"\} 1\.0', metrics)
        assert "pulsescale_nats_connected 1.0" in metrics and "process_resident_memory_bytes" in metrics
        warm = re.search(r'pulsescale_agent_warm_slot_seconds_total\{model="[^"]+"\} (\S+)', metrics)
        assert warm and float(warm.group(1)) > 0, "two slots were warm until the activation"
        family = children_of(proc.pid)
        assert len(family) >= 3  # two zygotes and one engine

        proc.send_signal(signal.SIGTERM)
        rc = await asyncio.wait_for(asyncio.to_thread(proc.wait), 30)
        assert rc == 0
        await wait_for(lambda: store.lease(NODE) is None, 5, "the lease to be withdrawn")
        for slot in ("s0", "s1"):
            rec = await wait_state(store, key(slot), "failed")
            assert rec.reason is not None and "stopped" in rec.reason and rec.endpoint is None
        await wait_for(lambda: not any(alive(p) for p in family), 5, "zygotes and engines to be gone")
        assert sorted(p.name for p in (shm_dir / MODEL).iterdir() if p.suffix == ".safetensors")  # staged copy kept
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()


def test_agent_reports_an_unreachable_nats_in_one_line(model_dir: Path, shm_dir: Path) -> None:
    r = pulsescale(
        "agent", "--nats", "nats://127.0.0.1:1", "--node", "n1", "--model", str(model_dir), "--shm-dir", str(shm_dir),
        "--metrics-port", "-1", "--nats-connect-timeout", "0.5",
    )  # fmt: skip
    assert r.returncode == 3  # unreachable
    assert r.stderr.startswith("pulsescale agent: cannot connect to NATS") and r.stderr.count("\n") == 1


def test_agent_refuses_bad_arguments_with_reasons(model_dir: Path, tmp_path: Path) -> None:
    r = pulsescale("agent", "--node", "n1", "--model", str(model_dir), "--loader", "kvikio")
    assert r.returncode == 2 and ("cannot run on this node" in r.stderr or "computes on the CPU" in r.stderr)
    r = pulsescale("agent", "--node", "n1", "--model", str(tmp_path / "nope"))
    assert r.returncode == 2 and "not a directory" in r.stderr
    r = pulsescale("agent", "--node", "n1", "--model", str(model_dir), "--image", str(tmp_path / "no-image"))
    assert r.returncode == 2 and "--image" in r.stderr and "no such directory or file" in r.stderr, r.stderr
    (tmp_path / "notes.txt").write_text("not an image")
    r = pulsescale("agent", "--node", "n1", "--model", str(model_dir), "--image", str(tmp_path / "notes.txt"))
    assert r.returncode == 2 and "not a directory and not a readable tarball" in r.stderr, r.stderr
    r = pulsescale("agent", "--node", "N.1", "--model", str(model_dir))
    assert r.returncode == 2 and "node name" in r.stderr
    bad = tmp_path / "Bad.Name"
    bad.mkdir()
    r = pulsescale("agent", "--node", "n1", "--model", str(bad))
    assert r.returncode == 2 and "--model-name" in r.stderr
    r = pulsescale("agent", "--node", "n1", "--model", str(model_dir), "--slots", "2", "--fault", "s9=crash")
    assert r.returncode == 2 and "no slot 's9'" in r.stderr and "s0, s1" in r.stderr
    # Readers refuse a lease longer than the contract's maximum: the node would never count as alive.
    r = pulsescale("agent", "--node", "n1", "--model", str(model_dir), "--lease-s", "3600")
    assert r.returncode == 2 and "--lease-s 3600: must be > 0 and at most 300 s" in r.stderr
    r = pulsescale("agent", "--node", "n1", "--model", str(model_dir), "--slots", "257")
    assert r.returncode == 2 and "--slots must be between 1 and 256" in r.stderr


def test_model_make_tiny_and_verify(tmp_path: Path) -> None:
    r = pulsescale("model", "make-tiny", str(tmp_path / "m"), "--size", "2MB", "--shard-size", "1MB")
    assert r.returncode == 0, r.stderr
    assert "2.0 MB" in r.stdout or "1.9 MB" in r.stdout
    assert (tmp_path / "m" / "sha256sums.txt").exists()
    # `sha256sum -c` accepts the manifest as written.
    check = subprocess.run(["sha256sum", "-c", "sha256sums.txt"], cwd=tmp_path / "m", capture_output=True, check=False)
    assert check.returncode == 0, check.stdout
    r = pulsescale("model", "verify", str(tmp_path / "m"))
    assert r.returncode == 0 and r.stdout.count("ok ") >= 3
    shard = sorted((tmp_path / "m").glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-4])
    r = pulsescale("model", "verify", str(tmp_path / "m"))
    assert r.returncode == 1 and f"BAD   {shard.name}" in r.stdout


def test_bench_activate_prints_the_stage_breakdown(shm_dir: Path) -> None:
    r = pulsescale(
        "bench", "activate", "--size", "2MB", "--activations", "4", "--warmup", "1", "--shm-dir", str(shm_dir),
        timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    for word in ("token", "load", "engine", "readiness", "total", "overhead (total-load)", "claim->ready"):
        assert re.search(rf"^{re.escape(word)}\s+\d+\.\d+\s+\d+\.\d+", r.stdout, re.M), word
    assert re.search(r"host loader\s+\d+\.\d+ GB/s", r.stdout)
    assert re.search(r"numpy\.copyto\s+\d+\.\d+ GB/s", r.stdout)
    assert "control-plane overhead p99" in r.stdout
    assert list(shm_dir.iterdir()) == []  # the bench removes what it staged
