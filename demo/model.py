"""The model the demo's fleet serves, and how its engines run it: the generated tiny model (a tiny Hugging Face model
for ``--engine vllm``) that every agent stages into /dev/shm, where it is written, and for vLLM the user its servers
run as and the arguments they get.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from demo.settings import MODEL, DemoSettings
from nodeagent import tinymodel
from warmpool.errors import PulsescaleError

__all__ = ["DemoModel"]


def _engine_user() -> tuple[str, str | None]:
    """The user the vLLM servers run as, and why when it is not the agent's default (``nobody``): a root agent
    drops a server to ``nobody`` only when nobody can run this interpreter (every directory up to it searchable);
    a venv under /root (0700) is not, and ``root`` is the agent's explicit opt-out."""
    if os.geteuid() != 0:
        return "nobody", None  # an agent that is not root drops to nobody
    exe = Path(os.path.realpath(sys.executable))
    blocked = [p for p in [exe, *exe.parents] if not os.stat(p).st_mode & 0o001]
    if not blocked:
        return "nobody", None
    return "root", (
        f"vLLM servers run as root: the engine user nobody cannot run {exe} ({blocked[-1]} is not searchable by "
        "others); install the venv outside /root to run them unprivileged"
    )


def _vllm_args(settings: DemoSettings) -> str:
    """`DemoSettings.vllm_args`, plus a share of the GPU per server on a GPU node: every slot of the demo's fleet
    runs its own vLLM on this machine's GPU, and vLLM takes 90 % of it by default (the second server would not
    fit)."""
    from nodeagent import vllm

    args = settings.vllm_args
    try:
        gpu = vllm.detect_platform().gpu
    except PulsescaleError:
        return args
    if gpu and "--gpu-memory-utilization" not in args:
        args += f" --gpu-memory-utilization {max(0.05, 0.85 / settings.fleet_slots):.2f}"
    return args


def _vllm_on_cpu() -> bool:
    from nodeagent import vllm

    try:
        return vllm.detect_platform().cpu
    except PulsescaleError:
        return False


class DemoModel:
    """Makes the model (`make`) and keeps what the agents need with it (`engine_user`, `vllm_args`); `remove` takes
    away a model directory outside the run's work directory. `say` tells the run's view; `in_thread` runs a blocking
    step in a thread the run's clean-up waits for (`Demo._in_thread`)."""

    def __init__(
        self,
        settings: DemoSettings,
        workdir: Path,
        say: Callable[[str], None],
        in_thread: Callable[[Callable[[], Any]], Awaitable[Any]],
    ) -> None:
        self.s = settings
        self.workdir = workdir
        self.say = say
        self._in_thread = in_thread
        self.engine_user: str | None = None
        """``--engine vllm``: the user its servers run as (`_engine_user`)."""
        self.vllm_args = ""
        self.model_root: Path = workdir / "models"
        """Where the generated model goes; for servers that drop to nobody a directory of its own that nobody can
        read (the run's work directory is root's, 0700)."""

    async def make(self) -> Path:
        """The generated tiny model, with `token_ms` in its config (the emulated accelerator time per token) and,
        for ``--source vllm-metrics``, room for the queue its engine holds (`DemoSettings.engine_connections`)."""
        if self.s.engine == "vllm":
            user, why = _engine_user()
            self.engine_user, self.vllm_args = user, _vllm_args(self.s)
            if why:
                self.say(why)
            if _vllm_on_cpu():
                self.say(
                    f"vLLM's CPU build: every replica's requests run on this machine's {os.cpu_count()} cores, so "
                    "replicas past the first add little capacity; a pulse beyond what the cores serve gets 504s "
                    "that are the CPU's, not the scale-out's (on CPU, try --pulse 100%)"
                )
            if os.geteuid() != 0 or user != "root":
                self.model_root = Path(tempfile.mkdtemp(prefix="pulsescale-demo-model-"))
                os.chmod(self.model_root, 0o755)
        out = self.model_root / MODEL

        def make() -> None:
            if self.s.engine == "vllm":
                from nodeagent import hfmodel

                hfmodel.make_tiny_hf(out)
                for d in (out, *out.rglob("*")):  # the server reads --model as its engine user
                    os.chmod(d, 0o755 if d.is_dir() else 0o644)
                return
            extra: dict[str, object] = {"token_ms": self.s.token_ms}
            if self.s.source == "vllm-metrics":  # the engine holds its queue, as vLLM does (`engine_queue`)
                extra["max_connections"] = self.s.engine_connections
            tinymodel.make_tiny(out, self.s.model_bytes, extra_config=extra)

        await self._in_thread(make)
        return out

    def remove(self) -> None:
        """The model's own directory, when it is not in the run's work directory (removed with that)."""
        if self.model_root.parent != self.workdir:
            shutil.rmtree(self.model_root, ignore_errors=True)
