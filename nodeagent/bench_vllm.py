"""`pulsescale bench activate --engine vllm`: the article's headline with a real engine, in one run.

Two figures, side by side, for the same model on the same machine:

- **vLLM cold start**: ``python -m vllm.entrypoints.openai.api_server`` started from nothing, to the first token
  (``/health`` answers, then a 1-token completion comes back). What a scale-up costs without a warm pool.
- **our activation**: a real agent (``--engine vllm``, one slot) on a real nats-server has its standby up (prewarm,
  off the clock); then claim -> activate -> the first token from the endpoint the activation returned. Repeated
  ``--activations`` times (deactivating in between); the median is compared.

The model is the tiny Llama of ``make-tiny --format hf`` unless ``--model`` names one (a Hugging Face directory
with a ``sha256sums.txt``). Both sides use the same server arguments (``--vllm-args``) and environment.

``--json`` (``-o json|yaml``) prints one object instead, and nothing else on stdout (progress goes to stderr): the
run's parameters, ``cold_start_s``, ``prewarm_s``, ``activation_p50_s``/``activation_min_s``/``activation_max_s``,
``ratio_cold_over_p50`` and each activation's ``claim_to_first_token_s``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import msgspec

from nodeagent import hfmodel, vllm
from warmpool import connect as nats_connect
from warmpool import output as out
from warmpool import protocol
from warmpool.embedded import NatsServer
from warmpool.registry import KvSlotStore

__all__ = ["activate"]

MODEL = "tiny-llama"
NODE = "bench"
START_TIMEOUT_S = 900.0
"""A cold start on a busy CPU node takes a minute or two; a GPU node with a large model several."""


class VllmActivation(msgspec.Struct, kw_only=True):
    claim_to_first_token_s: float


class VllmReport(msgspec.Struct, kw_only=True):
    """`bench activate --engine vllm --json`: vLLM's cold start next to our activations of a standby."""

    bench: str = "activate"
    engine: str = "vllm"
    model_dir: str | None
    """`--model`, or None for the tiny Llama the bench wrote."""
    vllm_args: str
    engine_user: str
    cold_start_s: float
    """vLLM's server process start -> first token."""
    prewarm_s: float
    """Agent start -> slot warm (off the clock)."""
    activation_p50_s: float
    """Claim -> first token, the median over `activations`."""
    activation_min_s: float
    activation_max_s: float
    ratio_cold_over_p50: float
    """cold_start_s / activation_p50_s: how many times faster a warm standby gets to the first token."""
    activations: list[VllmActivation]


def _first_token(endpoint: str, timeout_s: float = 60.0) -> str:
    body = json.dumps({"model": MODEL, "prompt": "The warm pool says", "max_tokens": 1, "temperature": 0}).encode()
    req = urllib.request.Request(f"{endpoint}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        out = json.loads(r.read())
    text: str = out["choices"][0]["text"]
    return text


def _healthy(endpoint: str) -> bool:
    try:
        with urllib.request.urlopen(f"{endpoint}/health", timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cold_start(model_dir: Path, extra_args: str, log_path: Path) -> float:
    """Seconds from spawning vLLM's server to its first token; the server is stopped afterwards."""
    platform = vllm.detect_platform()
    port = _free_port()
    argv = vllm.server_argv(platform, sleep_mode=False, extra=tuple(extra_args.split()))
    values = {"model_path": str(model_dir), "model_name": MODEL, "host": "127.0.0.1", "port": str(port)}
    argv = tuple(a.format_map(values) for a in argv)
    env = {**os.environ, **vllm.server_env(platform, sleep_mode=False)}
    endpoint = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            while not _healthy(endpoint):
                if proc.poll() is not None:
                    raise RuntimeError(f"vLLM exited with {proc.returncode} before /health (log: {log_path})")
                if time.perf_counter() - t0 > START_TIMEOUT_S:
                    raise TimeoutError(f"vLLM not healthy after {START_TIMEOUT_S:.0f} s (log: {log_path})")
                time.sleep(0.05)
            _first_token(endpoint)
            return time.perf_counter() - t0
        finally:
            os.killpg(proc.pid, 15)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()


def _start(
    args: argparse.Namespace, model_dir: Path, shm: Path, work: Path
) -> tuple[NatsServer, subprocess.Popen[bytes]]:
    server = NatsServer(work / "nats", sync_always=True)
    server.start()
    agent = subprocess.Popen(
        [sys.executable, "-m", "pulsescale", "agent", "--nats", server.url, "--node", NODE, "--model", str(model_dir),
         "--model-name", MODEL, "--slots", "1", "--shm-dir", str(shm), "--engine", "vllm", "--engine-user",
         args.engine_user, "--vllm-args", args.vllm_args, "--metrics-port", "-1", "--log-level", "WARNING",
         "--log-dir", str(work / "logs")],
        stdout=None if out.machine(args) is None else sys.stderr.fileno(),  # -o json: stdout has the object only
    )  # fmt: skip
    return server, agent


async def _activations(
    args: argparse.Namespace, server: NatsServer, agent: subprocess.Popen[bytes]
) -> tuple[list[float], float]:
    """(claim -> first token seconds per activation, agent start -> warm seconds)."""
    try:
        nc = await nats_connect.connect(nats_connect.NatsOptions(servers=(server.url,), name="pulsescale-bench"))
        store = await KvSlotStore.open(nc)
        await store.start()
        key = protocol.slot_key(MODEL, NODE, "s0")
        t0 = time.perf_counter()
        await _wait_state(store, key, "warm", START_TIMEOUT_S, agent)
        warm_s = time.perf_counter() - t0
        out: list[float] = []
        for _ in range(args.activations):
            await _wait_state(store, key, "warm", 60, agent)
            t_claim = time.perf_counter()
            claim = await store.claim_slot(key)
            now = time.time()
            req = protocol.ActivateRequest(
                id=secrets.token_hex(8), expires_at=now + 30, slot="s0", token=claim.token,
                claim_id=claim.claim_id, deadline=now + 30,
            )  # fmt: skip
            msg = await nc.request(protocol.agent_subject(NODE, "activate"), protocol.encode(req), timeout=35)
            rep = protocol.decode_reply(msg.data)
            if not rep.ok:
                raise RuntimeError(f"activation failed: {rep.error}")
            await asyncio.to_thread(_first_token, rep.fields["endpoint"])
            out.append(time.perf_counter() - t_claim)
            deact = protocol.DeactivateRequest(
                id=secrets.token_hex(8), expires_at=time.time() + 30, slot="s0", token=claim.token,
                claim_id=claim.claim_id,
            )  # fmt: skip
            msg = await nc.request(protocol.agent_subject(NODE, "deactivate"), protocol.encode(deact), timeout=70)
            if not protocol.decode_reply(msg.data).ok:
                raise RuntimeError("deactivation failed")
        await store.close()
        await nc.close()
        return out, warm_s
    finally:
        await asyncio.to_thread(_stop, server, agent)


def _stop(server: NatsServer, agent: subprocess.Popen[bytes]) -> None:
    agent.terminate()
    try:
        agent.wait(30)
    except subprocess.TimeoutExpired:
        agent.kill()
        agent.wait()
    server.kill()


async def _wait_state(
    store: KvSlotStore, key: str, want: str, timeout_s: float, agent: subprocess.Popen[bytes]
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        hit = store.entry(key)
        if hit is not None and hit[0].state == want:
            return
        if hit is not None and hit[0].state == "failed":
            raise RuntimeError(f"slot {key} failed: {hit[0].reason}")
        if agent.poll() is not None:
            raise RuntimeError(f"the agent exited with {agent.returncode}")
        await asyncio.sleep(0.01)
    raise TimeoutError(f"slot {key} not {want} after {timeout_s:.0f} s")


def activate(argv: list[str], prog: str) -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=("vllm",), default="vllm")
    p.add_argument("--model", help="a Hugging Face model directory with sha256sums.txt [make-tiny --format hf]")
    p.add_argument("--activations", type=int, default=5, help="measured activations [5]")
    p.add_argument("--vllm-args", default="--max-model-len 256", help="server arguments for both sides")
    p.add_argument(
        "--engine-user", default="nobody", help="the agent's engine user (root: the venv is not readable) [nobody]"
    )
    p.add_argument("--shm-dir", default="/dev/shm", help="parent of the bench's staging dir [/dev/shm]")
    out.add_output_argument(p)
    args = p.parse_args(argv)
    fmt = out.machine(args)
    progress = out.progress(fmt)
    try:
        vllm.detect_platform()
    except Exception as err:  # noqa: BLE001 - EngineFailed: vLLM missing, said how to install it
        print(f"{prog}: {err}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="pulsescale-bench-vllm-"))
    shm = Path(args.shm_dir) / f"pulsescale-bench-vllm-{os.getpid()}"
    try:
        model_dir = Path(args.model) if args.model else work / MODEL
        if not args.model:
            hfmodel.make_tiny_hf(model_dir)
        print(f"vLLM cold start (process start -> first token), model {model_dir} ...", file=progress, flush=True)
        cold = cold_start(model_dir, args.vllm_args, work / "cold.log")
        print(f"  {cold:.2f} s", file=progress, flush=True)
        print(
            f"our activation of a vLLM standby (claim -> first token), {args.activations} times ...",
            file=progress,
            flush=True,
        )
        server, agent = _start(args, model_dir, shm, work)
        warm, warm_s = asyncio.run(_activations(args, server, agent))
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    med = statistics.median(warm)
    if fmt is not None:
        report = VllmReport(
            model_dir=args.model, vllm_args=args.vllm_args, engine_user=args.engine_user, cold_start_s=cold,
            prewarm_s=warm_s, activation_p50_s=med, activation_min_s=min(warm), activation_max_s=max(warm),
            ratio_cold_over_p50=cold / med,
            activations=[VllmActivation(claim_to_first_token_s=s) for s in warm],
        )  # fmt: skip
        print(out.dump(report, fmt))
        return 0
    print(f"  prewarm (agent start -> slot warm, off the clock): {warm_s:.1f} s")
    print(f"\n{'':<42}{'seconds':>10}")
    print(f"{'vLLM cold start: process start -> 1st token':<42}{cold:>10.3f}")
    print(f"{'standby activation: claim -> 1st token p50':<42}{med:>10.3f}")
    print(f"{'  (min / max over ' + str(len(warm)) + ')':<42}{min(warm):>10.3f} / {max(warm):.3f}")
    print(f"\ncold start / activation = {cold / med:.0f}x faster to the first token from a warm standby")
    return 0
