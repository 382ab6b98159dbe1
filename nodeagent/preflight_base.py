"""The terms the preflight checks share (`nodeagent.preflight`): one line of the report (`Check`), the summary, what
the checks know of the node (`Node`, read once from the flags, filled in by earlier checks), and running a probe
as the engine user (`as_user`: a forked child that drops to that user the way engines do, so the checking process
never changes its own identity).
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import socket
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

from nodeagent import fetch
from nodeagent.engine import cudaplan
from nodeagent.engine.zygote import drop_privileges
from warmpool.sizes import parse_size

__all__ = ["ALL_INTERFACES", "Check", "Node", "Status", "as_user", "fmt_size", "port_free", "summary", "user_name"]

Status = Literal["OK", "WARN", "FAIL"]

ALL_INTERFACES: Final = ("0.0.0.0", "::", "")
"""Bind addresses that listen on every interface."""


@dataclass(frozen=True)
class Check:
    """One line of the report: what was checked, the verdict, what was measured, and the fix (WARN, FAIL)."""

    name: str
    status: Status
    value: str
    fix: str = ""

    def line(self) -> str:
        text = f"{self.status:<4} {self.name:<12} {self.value}"
        return f"{text}; fix: {self.fix}" if self.fix and self.status != "OK" else text


def summary(checks: Sequence[Check]) -> tuple[str, int]:
    """The last line and the exit code: 1 when any check FAILed."""
    n = {s: sum(c.status == s for c in checks) for s in ("OK", "WARN", "FAIL")}
    verdict = "not ready, fix the FAIL lines first" if n["FAIL"] else "ready for this configuration"
    if not n["FAIL"] and n["WARN"]:
        verdict += " (the WARN lines run degraded or less safe)"
    return f"check: {n['OK']} OK, {n['WARN']} WARN, {n['FAIL']} FAIL: {verdict}", 1 if n["FAIL"] else 0


def fmt_size(n: float) -> str:
    """`n` bytes for a line of the report."""
    return cudaplan.fmt_bytes(int(n))


@dataclass
class Node:
    """What the checks share: the flags, read once, and what earlier checks measured."""

    args: argparse.Namespace
    shm_dir: Path
    source: str
    model_name: str
    model_dir: Path
    """Where a server started as the engine user reads the model (``{model_dir}``): the staged directory when the
    source is a URL."""
    budget_bytes: int | None
    total_bytes: int | None = None
    weights_bytes: int | None = None
    files: list[str] = field(default_factory=list)
    run_as: tuple[int, int] | None = None
    """(uid, gid) engines drop to; None: they run as the agent's user."""
    drops: bool = False
    """Engines change user (a root agent, an engine user other than root), whether or not that user exists:
    they lose root's capabilities (low ports, CAP_IPC_LOCK)."""
    engine_user_ok: bool = True

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Node:
        shm = Path(args.shm_dir)
        src = str(args.model)
        if fetch.is_url(src):
            name = args.model_name or urllib.parse.urlsplit(src).path.rstrip("/").rsplit("/", 1)[-1] or "model"
            model_dir = shm / name
        else:
            name = args.model_name or Path(src).resolve().name
            model_dir = Path(src)
        try:
            budget = parse_size(args.shm_budget) if args.shm_budget else None
        except ValueError:
            budget = None  # the flags check says why
        return cls(args=args, shm_dir=shm, source=src, model_name=name, model_dir=model_dir, budget_bytes=budget)


# --- in a child, as the engine user ---------------------------------------------------------------------------------


def as_user(run_as: tuple[int, int] | None, probe: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """`probe()` run in a forked child that first drops to `run_as` exactly as an engine does (no_new_privs, no
    groups, then group and user); its result comes back as JSON over a pipe. This process keeps its identity."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the caller's code
        code = 0
        try:
            os.close(r)
            if run_as is not None:
                drop_privileges(*run_as)
            out = probe()
        except BaseException as err:  # noqa: BLE001 - reported to the parent as the probe's answer
            out, code = {"error": f"{type(err).__name__}: {err}"}, 1
        try:
            data = json.dumps(out).encode()
            while data:
                data = data[os.write(w, data) :]
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    return dict(json.loads(data)) if data else {"error": "the probe process died without an answer"}


def user_name(run_as: tuple[int, int] | None) -> str:
    uid = os.geteuid() if run_as is None else run_as[0]
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def port_free(host: str, port: int) -> bool:
    """`port` on `host` can be bound now (what a server sets, ``SO_REUSEADDR``, set too)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # what a server sets: TIME_WAIT is not "in use"
        try:
            s.bind((host or "0.0.0.0", port))
        except OSError:
            return False
    return True
