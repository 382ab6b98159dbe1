"""The node's side of the preflight check (`nodeagent.preflight`): privileges, the model source, the staging
directory, shm space and ``--shm-budget``, and locking the weights in memory.

Each check calls staging's own code (its source, directory walk with ``create=False``, budget and shm accounting),
so the check and the run cannot disagree; nothing is made, changed or hashed.
"""

from __future__ import annotations

import os
import resource
from pathlib import Path
from typing import Final

from nodeagent import fetch, shmbudget, stagedir, stagesource
from nodeagent.engine import cudaplan, loaders
from nodeagent.errors import BadModel, BadWeights, StagingFailed, UnsafeStagingDir
from nodeagent.preflight_base import Check, Node, Status, fmt_size
from warmpool import protocol

__all__ = [
    "SOURCE_TIMEOUT_S",
    "check_budget",
    "check_memlock",
    "check_model",
    "check_privileges",
    "check_shm_dir",
    "check_shm_space",
]

SOURCE_TIMEOUT_S: Final = 5.0
"""A URL source's manifest and sizes (one attempt each, no retry): the check says at once whether it answers."""


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


def check_model(node: Node) -> Check:
    """The manifest answers and lists files that exist (sizes from the directory, or HEAD requests); headers of
    a local directory's safetensors files parse. Nothing is hashed: `pulsescale model verify` does that."""
    a = node.args
    redirects = frozenset(getattr(a, "fetch_redirect_host", None) or ())
    options = fetch.FetchOptions(
        timeout_s=min(a.fetch_timeout_s, SOURCE_TIMEOUT_S), retries=0, redirect_hosts=redirects
    )
    shown = fetch.shown(node.source) if fetch.is_url(node.source) else node.source
    try:
        src = stagesource.source_for(node.source, options)
    except BadModel as err:
        return Check("model", "FAIL", str(err), "give --model an existing model directory or an http(s) URL")
    try:
        sums = src.manifest()
        sizes = {n: src.size(n) for n in sums}
        if isinstance(src, stagesource.DirSource):
            for n in sums:  # each opened the way staging opens it: no link, a regular file
                fd = stagesource.open_file(src.fd, src.path, n)
                try:
                    stagesource.header_of(fd, n)
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
        f"{shown}: manifest of {len(sums)} file(s), {fmt_size(node.total_bytes)} "
        f"({fmt_size(node.weights_bytes)} of safetensors weights){note}",
    )


def check_memlock(node: Node) -> Check:
    """The agent `mlock`s the staged weights: CAP_IPC_LOCK (root) or an RLIMIT_MEMLOCK that covers them, else it
    runs unlocked. A GPU loader pins them in the engine process, which has dropped CAP_IPC_LOCK with its user:
    there the limit itself must cover them."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    limit = None if soft == resource.RLIM_INFINITY else soft
    shown = "unlimited" if limit is None else fmt_size(limit)
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
        lines.append(f"the agent can lock {fmt_size(node.weights_bytes)} of weights ({lock.reason})")
    else:
        status = "WARN"
        lines.append(
            f"RLIMIT_MEMLOCK {shown} < {fmt_size(node.weights_bytes)} of weights and no CAP_IPC_LOCK: the agent "
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


def check_shm_dir(node: Node) -> tuple[Check, dict[str, int]]:
    """Staging's own walk from ``/`` (`stagedir.own_dir`, making and changing nothing): owner, mode, ancestors,
    no link; then the model's directory in it; and what is staged there now (`shmbudget.shm_use`)."""
    shm = node.shm_dir
    try:
        fd = stagedir.own_dir(shm, create=False)
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
                os.close(stagedir.own_subdir(fd, node.model_name, sub, create=False))
            except FileNotFoundError:
                pass  # made at the first stage
            except UnsafeStagingDir as err:
                return Check("shm-dir", "FAIL", str(err), _fix_for_unsafe(sub)), {}
        use = shmbudget.shm_use(fd)
    finally:
        os.close(fd)
    tighten = "" if mode == stagedir.DIR_MODE else " (the agent sets 0700 at start)"
    held = ", ".join(f"{m} {fmt_size(b)}" for m, b in sorted(use.items()) if b) or "nothing staged yet"
    return Check("shm-dir", "OK", f"{shm}: ours (uid {os.geteuid()}), mode {mode:o}{tighten}, not a link; {held}"), use


def _existing(path: Path) -> Path:
    """`path`, or the nearest directory above it, never through a link (the staging directory may be a planted
    link: its target's filesystem says nothing about shm)."""
    while (path.is_symlink() or not path.is_dir()) and path != path.parent:
        path = path.parent
    return path


def check_shm_space(node: Node, use: dict[str, int]) -> Check:
    """The filesystem under --shm-dir against the model: the first stage needs the model's size free; a new
    version is staged beside the old one until it verifies, so a re-stage needs twice the model."""
    where = _existing(node.shm_dir)
    vfs = os.statvfs(where)
    size, free = vfs.f_blocks * vfs.f_frsize, vfs.f_bavail * vfs.f_frsize
    kind = loaders._fs_type(str(where)) or "?"
    fs = f"{where} ({kind}): {fmt_size(free)} free of {fmt_size(size)}"
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
        return Check("shm-space", "FAIL", f"the model ({fmt_size(total)}) is larger than {fs}{note}", fix)
    if need > free:
        return Check("shm-space", "FAIL", f"staging needs {fmt_size(need)} more, {fs}{note}", fix + ", or free shm")
    if free + here < 2 * total:
        return Check(
            "shm-space",
            "WARN",
            f"{fs}; a new version of the model is staged beside this one until it verifies: 2 x {fmt_size(total)} "
            f"needs {fmt_size(2 * total - here - free)} more than there is{note}",
            fix,
        )
    return Check("shm-space", "WARN" if note else "OK", f"{fs}; 2 x {fmt_size(total)} (a re-stage) fits{note}", "")


def check_budget(node: Node, use: dict[str, int]) -> Check:
    """--shm-budget as staging applies it (`shmbudget.check_budget`): the first stage, then a re-stage."""
    budget = node.budget_bytes
    if budget is None:
        return Check("shm-budget", "OK", "no --shm-budget: bounded by the free space of shm")
    if node.total_bytes is None:
        return Check("shm-budget", "WARN", f"--shm-budget {fmt_size(budget)}; the model's size is unknown (see model)")
    total, here = node.total_bytes, use.get(node.model_name, 0)
    try:
        shmbudget.check_budget(use, node.model_name, max(0, total - here), budget, node.shm_dir)
    except shmbudget.ShmBudgetExceeded as err:
        return Check(
            "shm-budget",
            "FAIL",
            str(err),
            f"--shm-budget {fmt_size(sum(use.values()) - here + 2 * total)} (room for a re-stage)",
        )
    after = {**use, node.model_name: max(here, total)}
    try:
        shmbudget.check_budget(after, node.model_name, total, budget, node.shm_dir)
    except shmbudget.ShmBudgetExceeded:
        peak = sum(after.values()) + total
        return Check(
            "shm-budget",
            "WARN",
            f"--shm-budget {fmt_size(budget)}: the first stage fits, but a new version of the model, staged beside "
            f"this one until it verifies ({fmt_size(peak)} at the peak), would be refused",
            f"--shm-budget {fmt_size(peak)}",
        )
    return Check("shm-budget", "OK", f"--shm-budget {fmt_size(budget)} holds the model twice (a re-stage)")
