"""`pulsescale agent`, `pulsescale model` and `pulsescale bench activate` as an operator runs them: real processes."""

from __future__ import annotations

import asyncio
import json
import math
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from nats.aio.client import Client

from simulate.cli import load_activations
from tests.nodeagent_helpers import (
    MODEL,
    NODE,
    activate,
    alive,
    key,
    listening_addresses,
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
        await wait_for(lambda: store.index.lease(NODE) is None, 5, "the lease to be withdrawn")
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


def _finite_positive(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and x > 0


@pytest.mark.parametrize("engine_memory", ["private", "shared"])
def test_bench_activate_json_has_each_activation_and_the_stage_breakdown_of_them(
    shm_dir: Path, tmp_path: Path, engine_memory: str
) -> None:
    r = pulsescale(
        "bench", "activate", "--size", "2MB", "--activations", "4", "--warmup", "1", "--shm-dir", str(shm_dir),
        "--engine-memory", engine_memory, "--json", timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(r.stdout)  # stdout is the one object: progress and the agent's output went to stderr
    assert list(shm_dir.iterdir()) == []  # the bench removes what it staged
    assert doc["bench"] == "activate" and doc["engine_memory"] == engine_memory and doc["sync_always"] is True
    assert (doc["model_dir"], doc["size_bytes"], doc["warmup"], doc["deadline_s"]) == (None, 2_000_000, 1, 10.0)
    assert 0 < doc["model_bytes"] <= doc["size_bytes"] and _finite_positive(doc["staged_s"])
    each = doc["activations"]
    assert len(each) == 4 and all(a["loaded_bytes"] == doc["model_bytes"] for a in each)
    for a in each:
        assert all(_finite_positive(v) for v in a.values()), a
        assert a["load_ms"] <= a["total_ms"] < a["claim_to_ready_s"] * 1e3  # the claimer waits for the agent
        assert a["load_gbps"] == pytest.approx(a["loaded_bytes"] / a["load_ms"] / 1e6)
    # The stage table is the percentiles of the activations listed.
    samples = {s: [a[f"{s}_ms"] for a in each] for s in ("token", "load", "engine", "readiness", "total")}
    samples["overhead"] = [a["total_ms"] - a["load_ms"] for a in each]
    samples["claim_to_ready"] = [a["claim_to_ready_s"] * 1e3 for a in each]
    assert list(doc["stages"]) == list(samples)
    for name, row in doc["stages"].items():
        assert all(_finite_positive(v) for v in row.values()), name
        assert row["p50_ms"] <= row["p99_ms"] <= row["max_ms"], name
        assert row["p50_ms"] == pytest.approx(np.percentile(samples[name], 50)), name
        assert row["p99_ms"] == pytest.approx(np.percentile(samples[name], 99)), name
        assert row["max_ms"] == pytest.approx(max(samples[name])), name
    loader, copy = doc["host_loader"], doc["copyto"]
    assert loader["count"] == copy["count"] == 4
    for rate in (loader, copy):
        assert _finite_positive(rate["p1_gbps"]) and rate["p1_gbps"] <= rate["p50_gbps"]
    assert loader["p50_gbps"] == pytest.approx(np.percentile([a["load_gbps"] for a in each], 50))
    targets = {t["name"]: t for t in doc["targets"]}
    if engine_memory == "private":
        assert doc["loader_over_copyto"] == pytest.approx(loader["p50_gbps"] / copy["p50_gbps"])
        assert targets["loader_over_copyto"]["value"] == doc["loader_over_copyto"]
    else:  # the loader maps shm in place: its GB/s is no copy rate, so no ratio and no target for it
        assert doc["loader_over_copyto"] is None and "loader_over_copyto" not in targets
    assert targets["overhead_p99_ms"]["value"] == doc["stages"]["overhead"]["p99_ms"]
    assert targets["claim_to_ready_p99_ms"]["value"] == doc["stages"]["claim_to_ready"]["p99_ms"]  # a small model
    for t in targets.values():
        assert t["met"] == (t["value"] <= t["target"] if t["op"] == "<=" else t["value"] >= t["target"]), t
    # `pulsescale simulate --activations` reads the object as it reads the text report's claim->ready row.
    (tmp_path / "bench.json").write_text(r.stdout)
    assert load_activations(tmp_path / "bench.json").seconds == pytest.approx([a["claim_to_ready_s"] for a in each])


def test_bench_activate_text_report_prints_the_stage_breakdown(shm_dir: Path) -> None:
    r = pulsescale(
        "bench", "activate", "--size", "2MB", "--activations", "2", "--warmup", "1", "--shm-dir", str(shm_dir),
        timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    for word in ("token", "load", "engine", "readiness", "total", "overhead (total-load)", "claim->ready"):
        assert re.search(rf"^{re.escape(word)}\s+\d+\.\d+\s+\d+\.\d+\s+\d+\.\d+$", r.stdout, re.M), word
    assert "2 activations of a 2.0 MB model, engine memory private" in r.stdout
    assert re.search(r"^host loader\s+\d+\.\d+ GB/s p50", r.stdout, re.M)
    assert re.search(r"^numpy\.copyto\s+\d+\.\d+ GB/s p50", r.stdout, re.M)
    assert re.search(r"^loader / copyto = \d+\.\d+ \(target >= 0\.7\): (ok|MISSED)$", r.stdout, re.M)
    assert re.search(r"^control-plane overhead p99 \d+\.\d ms \(target <= 150 ms\): (ok|MISSED)$", r.stdout, re.M)
    assert list(shm_dir.iterdir()) == []  # the bench removes what it staged
