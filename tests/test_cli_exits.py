"""Issue 25: how commands end when something is wrong, as real processes: Ctrl-C, a busy port, a refused or
mistyped NATS URL, a mistyped duration. One line each, no traceback, and the exit codes `pulsescale.cli` documents
(1 refused, 2 bad input, 3 unreachable, 130 interrupted)."""

from __future__ import annotations

import logging
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from warmpool.embedded import NatsServer, free_port


def pulsescale(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pulsescale", *args], capture_output=True, text=True, timeout=timeout, check=False
    )


@pytest.fixture
def silent() -> Iterator[tuple[socket.socket, int]]:
    """A port that accepts connections and never says a word (a NATS client waits for the server's INFO)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    try:
        yield s, int(s.getsockname()[1])
    finally:
        s.close()


def interrupted(argv: list[str], *, ready: object) -> subprocess.CompletedProcess[str]:
    """Run `pulsescale argv`, send SIGINT (a terminal's Ctrl-C) once `ready()` holds, collect it."""
    p = subprocess.Popen(
        [sys.executable, "-m", "pulsescale", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 20
        while not ready() and time.monotonic() < deadline:  # type: ignore[operator]
            time.sleep(0.05)
        p.send_signal(signal.SIGINT)
        try:
            out, err = p.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
            raise AssertionError(f"still running 20 s after SIGINT: {err}") from None
    finally:
        if p.poll() is None:
            p.kill()
    return subprocess.CompletedProcess(argv, p.returncode, out, err)


def test_ctrl_c_while_connecting_is_one_line_and_exit_130(silent: tuple[socket.socket, int]) -> None:
    sock, port = silent
    sock.settimeout(20)
    accepted: list[socket.socket] = []

    def connecting() -> bool:
        if not accepted:
            accepted.append(sock.accept()[0])  # the client is in its handshake now
            time.sleep(0.5)
        return True

    r = interrupted(["status", "--nats", f"nats://127.0.0.1:{port}", "--nats-connect-timeout", "15s"], ready=connecting)
    for c in accepted:
        c.close()
    assert r.returncode == 130 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr == "pulsescale status: interrupted\n", r.stderr


def test_ctrl_c_mid_sample_and_mid_load_is_one_line_and_exit_130(
    nats_server: NatsServer, silent: tuple[socket.socket, int]
) -> None:
    started = time.monotonic()
    r = interrupted(
        ["sample", "m", "--queue-depth", "1", "--for", "30s", "--nats", nats_server.url],
        ready=lambda: time.monotonic() - started > 2.5,
    )
    assert r.returncode == 130 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.splitlines()[-1] == "pulsescale sample: interrupted", r.stderr

    _, port = silent
    started = time.monotonic()
    r = interrupted(
        ["load", f"http://127.0.0.1:{port}", "--model", "m", "--base-rps", "5", "--pulse-rps", "10", "--base-s", "1s"],
        ready=lambda: time.monotonic() - started > 2.5,
    )
    assert r.returncode == 130 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.splitlines()[-1] == "pulsescale load: interrupted", r.stderr


def test_nats_on_a_busy_port_is_one_line(silent: tuple[socket.socket, int], tmp_path: object) -> None:
    _, port = silent
    r = pulsescale("nats", "--port", str(port), "--store-dir", str(tmp_path))
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.splitlines() == [
        f"pulsescale nats: port {port} is already in use (another nats-server, or `pulsescale nats` already "
        "running?): stop it or pick another --port"
    ], r.stderr


def test_a_refused_connect_fails_at_once_with_exit_3() -> None:
    t0 = time.monotonic()
    # A long deadline: only failing at the refusal, not at the deadline, finishes well within it.
    r = pulsescale("status", "--nats", f"nats://127.0.0.1:{free_port()}", "--nats-connect-timeout", "30s")
    elapsed_s = time.monotonic() - t0
    assert r.returncode == 3, (r.returncode, r.stderr)
    assert r.stderr.count("\n") == 1 and "nothing listens there" in r.stderr, r.stderr
    assert elapsed_s < 10, elapsed_s  # ~0.6 s alone, most of it the interpreter's start; it was the whole deadline


def test_a_url_of_another_scheme_is_named_with_exit_2() -> None:
    t0 = time.monotonic()
    r = pulsescale("status", "--nats", "http://127.0.0.1:4222", "--nats-connect-timeout", "30s")
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stderr.startswith("pulsescale status: --nats http://127.0.0.1:4222: http:// is not a NATS URL scheme")
    assert "Name or service not known" not in r.stderr and r.stderr.count("\n") == 1
    assert time.monotonic() - t0 < 10  # before any attempt


def test_every_time_flag_reads_durations_with_clear_errors() -> None:
    r = pulsescale("scale", "m", "--replicas", "2", "--for", "-5s")
    assert r.returncode == 2 and "argument --for: '-5s' is not a duration" in r.stderr, r.stderr
    assert "cannot be negative" in r.stderr and "expected one argument" not in r.stderr
    r = pulsescale("simulate", "--activation-s", "soon")
    assert r.returncode == 2 and "argument --activation-s: 'soon' is not a duration" in r.stderr, r.stderr
    r = pulsescale("load", "http://127.0.0.1:1", "--model", "m", "--hold-s", "1d")
    assert r.returncode == 2 and "argument --hold-s: '1d' is not a duration" in r.stderr, r.stderr


def test_simulate_takes_a_duration_with_units(tmp_path: object) -> None:
    from simulate import cli

    parsed: list[float] = []
    real = cli.argparse.ArgumentParser.parse_args

    def spy(self, argv=None, namespace=None):  # type: ignore[no-untyped-def]
        args = real(self, argv, namespace)
        parsed.append(args.activation_s)
        raise SystemExit(0)

    cli.argparse.ArgumentParser.parse_args = spy  # type: ignore[method-assign]
    try:
        with pytest.raises(SystemExit):
            cli.main(["--activation-s", "2.55s", "--pulse-s", "10m"], "pulsescale simulate")
    finally:
        cli.argparse.ArgumentParser.parse_args = real  # type: ignore[method-assign]
    assert parsed == [2.55]


def test_a_bare_pulse_number_hints_at_percent() -> None:
    from demo.settings import parse_pulse

    with pytest.raises(ValueError, match=r"did you mean 300% \(3x\)\?"):
        parse_pulse("300")
    assert parse_pulse("300%") == 3.0


def test_sample_for_a_model_without_a_scaledobject_warns(nats_server: NatsServer) -> None:
    r = pulsescale("sample", "nosuchmodel", "--queue-depth", "1", "--nats", nats_server.url)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("published 1 sample(s) for nosuchmodel")
    assert r.stderr.splitlines() == [
        "pulsescale sample: warning: no ScaledObject names model 'nosuchmodel' (KV pulse_scalers): the autoscaler "
        "ignores its samples until one does (`pulsescale apply -f FILE`; `pulsescale get scaledobjects` lists them)"
    ], r.stderr


def test_shard_changes_are_one_line_per_round(caplog: pytest.LogCaptureFixture) -> None:
    from autoscaler.shards.terms import ShardTerms, shard_ranges

    assert shard_ranges([5, 0, 1, 2, 7, 8, 31]) == "0-2,5,7-8,31"

    terms = ShardTerms.__new__(ShardTerms)
    terms.identity, terms.held = "r1", {s: object() for s in range(32)}  # type: ignore[misc]
    terms._took, terms._lost = list(range(32)), {}
    with caplog.at_level(logging.INFO, logger="pulsescale.shards"):
        terms.report()
        terms.report()
    assert [r.getMessage() for r in caplog.records] == ["r1: owns 32 more shard(s) 0-31; owns 32 now"]


# Ctrl-C as the CLI's first import starts: the entry module has taken SIGINT, nothing of the CLI is loaded yet.
_INTERRUPT_WHILE_IMPORTING = """
import builtins, os, signal, sys
from pulsescale import entry
real = builtins.__import__
def interrupting(name, *args, **kw):
    builtins.__import__ = real
    os.kill(os.getpid(), signal.SIGINT)
    return real(name, *args, **kw)
builtins.__import__ = interrupting
sys.argv = ["pulsescale", "status", "--nats", "nats://127.0.0.1:1"]
sys.exit(entry.main())
"""


def test_ctrl_c_while_the_cli_is_still_importing_is_one_line_and_exit_130() -> None:
    """Before `pulsescale.cli.main` runs, Python's own handler would raise KeyboardInterrupt inside an import (a
    20-line traceback); the console script's entry module catches it from its first statement."""
    r = subprocess.run([sys.executable, "-c", _INTERRUPT_WHILE_IMPORTING], capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stderr) == (130, "pulsescale: interrupted\n"), r.stderr
    assert "pulsescale.cli" not in r.stdout


def test_the_console_script_and_python_m_start_at_the_entry_module() -> None:
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    scripts = tomllib.loads((root / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["pulsescale"] == "pulsescale.entry:main"
    assert "from pulsescale.entry import main" in (root / "pulsescale" / "__main__.py").read_text()
    r = pulsescale("--version")
    assert r.returncode == 0 and r.stdout.startswith("pulsescale "), r
