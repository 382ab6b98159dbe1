"""Issue 9, staging at scale: weights from an HTTP(S) URL (resumable), the shm budget, progress, restart reuse.

Everything is real: a threaded HTTP server on loopback that speaks Range (and, on demand, drops a connection
mid-file or ignores Range, as a flaky proxy would), tiny models written by `make_tiny`, files in /dev/shm, agents
as in-process tasks or as real processes where a restart is the point.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import http.server
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from nats.aio.client import Client
from nats.errors import NoRespondersError
from prometheus_client.parser import text_string_to_metric_families

from nodeagent import fetch, modelformat, progress, staging
from nodeagent.errors import BadModel
from tests.nodeagent_helpers import (
    MODEL,
    NODE,
    activate,
    completion,
    key,
    request,
    running_agent,
    settings,
    wait_for,
    wait_state,
)
from warmpool.embedded import NatsServer
from warmpool.registry import KvSlotStore

NO_WAIT = fetch.FetchOptions(timeout_s=5.0, retries=3, backoff_s=0.0)


# --- a model served over HTTP ------------------------------------------------------------------------------------


@dataclass
class Served:
    """What the server saw and how it misbehaves: `drop_after[name]` bytes of the next GET of `name`, then the
    connection is cut (once); `no_range` ignores Range headers (200, the whole file); `status[name]` answers it."""

    root: Path
    drop_after: dict[str, int] = field(default_factory=dict)
    no_range: bool = False
    status: dict[str, int] = field(default_factory=dict)
    hold: dict[str, tuple[int, threading.Event]] = field(default_factory=dict)
    """`name` -> (bytes, event): send that many bytes of the next GET, then wait for the event to send the rest."""
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)
    sent: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    url: str = ""

    def ranges(self, name: str) -> list[str | None]:
        return [r for m, p, r in self.requests if m == "GET" and p.endswith("/" + name)]


def _handler(served: Served) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def do_HEAD(self) -> None:
            self._serve(body=False)

        def do_GET(self) -> None:
            self._serve(body=True)

        def _serve(self, *, body: bool) -> None:
            rng = self.headers.get("Range")
            with served.lock:
                served.requests.append((self.command, self.path, rng))
            name = urllib.request.url2pathname(self.path.split("?")[0]).rsplit("/", 1)[-1]
            path = served.root / name
            if name in served.status:
                self.send_response(served.status[name])
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            if not path.is_file():
                self.send_error(404)
                return
            data = path.read_bytes()
            start = 0
            if rng and not served.no_range:
                m = re.fullmatch(r"bytes=(\d+)-", rng)
                assert m, rng
                start = int(m.group(1))
                if start >= len(data):
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{len(data)}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            else:
                self.send_response(200)
            part = data[start:]
            self.send_header("Content-Length", str(len(part)))
            self.end_headers()
            if not body:
                return
            with served.lock:
                cut = served.drop_after.pop(name, None) if self.command == "GET" else None
                held = served.hold.pop(name, None) if self.command == "GET" else None
            if held is not None:
                self.wfile.write(part[: held[0]])
                self.wfile.flush()
                held[1].wait(30)
                self.wfile.write(part[held[0] :])
                served.sent[name] = served.sent.get(name, 0) + len(part)
                return
            if cut is not None:
                self.wfile.write(part[:cut])
                self.wfile.flush()
                served.sent[name] = served.sent.get(name, 0) + cut
                self.close_connection = True
                self.connection.shutdown(2)  # the peer sees the file end early: a dropped connection
                return
            self.wfile.write(part)
            served.sent[name] = served.sent.get(name, 0) + len(part)

    return Handler


@contextlib.contextmanager
def serving(root: Path) -> Iterator[Served]:
    served = Served(root)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(served))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    served.url = f"http://127.0.0.1:{server.server_address[1]}/models/{root.name}"
    try:
        yield served
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.fixture
def http_model(model_dir: Path) -> Iterator[Served]:
    with serving(model_dir) as served:
        yield served


def _model_bytes(model_dir: Path) -> int:
    """Bytes staging writes: every file the manifest lists."""
    return sum((model_dir / name).stat().st_size for name in modelformat.read_manifest(model_dir))


def _shards(model_dir: Path) -> list[str]:
    return sorted(p.name for p in model_dir.glob("*.safetensors"))


def _same_files(staged: staging.Staged, model_dir: Path) -> None:
    sums = modelformat.read_manifest(model_dir)
    assert sorted(p.name for p in staged.dir.iterdir()) == sorted(sums)
    for name, want in sums.items():
        assert hashlib.sha256((staged.dir / name).read_bytes()).hexdigest() == want


# --- the URL source ----------------------------------------------------------------------------------------------


def test_a_model_is_staged_from_a_url_verified_and_reused(http_model: Served, model_dir: Path, shm_dir: Path) -> None:
    staged = staging.stage(http_model.url, shm_dir, MODEL, fetch_options=NO_WAIT)
    try:
        _same_files(staged, model_dir)
        assert staged.fetched and staged.written_bytes == staged.nbytes and staged.reused_bytes == 0
        assert staged.source == http_model.url
        got = len(http_model.requests)
        again = staging.stage(http_model.url, shm_dir, MODEL, fetch_options=NO_WAIT, previous=staged)
        # Nothing changed: only the manifest is asked for, no file fetched, nothing read to verify.
        assert [r[1].rsplit("/", 1)[-1] for r in http_model.requests[got:]] == [modelformat.MANIFEST_FILE]
        assert again.written_bytes == 0 and again.reused_bytes == again.nbytes and again.hashed_bytes == 0
        staged.close(keep=again)
        again.close()
    except BaseException:
        staged.close()
        raise


@pytest.mark.serial  # a stalled read's 5 s timeout decides the resume: run alone (tests/conftest.py)
def test_a_dropped_connection_resumes_with_a_range_request(http_model: Served, model_dir: Path, shm_dir: Path) -> None:
    shard = _shards(model_dir)[0]
    size = (model_dir / shard).stat().st_size
    http_model.drop_after[shard] = size // 3
    staged = staging.stage(http_model.url, shm_dir, MODEL, fetch_options=NO_WAIT)
    staged.close()
    _same_files(staged, model_dir)
    assert http_model.ranges(shard) == [None, f"bytes={size // 3}-"]
    assert http_model.sent[shard] == size  # every byte sent once: continued, not started again


@pytest.mark.serial  # a stalled read's 5 s timeout decides the resume: run alone (tests/conftest.py)
def test_a_download_cut_off_by_an_agent_restart_continues_from_its_partial_file(
    http_model: Served, model_dir: Path, shm_dir: Path
) -> None:
    shard = _shards(model_dir)[0]
    size = (model_dir / shard).stat().st_size
    http_model.drop_after[shard] = size // 2
    once = fetch.FetchOptions(timeout_s=5.0, retries=0, backoff_s=0.0)
    with pytest.raises(fetch.FetchFailed, match=rf"{shard}: connection closed .* bytes kept in the partial file"):
        staging.stage(http_model.url, shm_dir, MODEL, fetch_options=once)
    partial = shm_dir / MODEL / f".{shard}.partial"
    assert partial.stat().st_size == size // 2
    assert not (shm_dir / MODEL / shard).exists()  # nothing unverified under a staged name
    # The next stage (a new agent process does the same: it only has the files) continues from there.
    staged = staging.stage(http_model.url, shm_dir, MODEL, fetch_options=once)
    staged.close()
    _same_files(staged, model_dir)
    assert http_model.ranges(shard)[-1] == f"bytes={size // 2}-"
    assert next(f for f in staged.files if f.name == shard).written == size - size // 2
    assert not partial.exists()


def test_a_server_without_range_support_sends_the_file_again(
    http_model: Served, model_dir: Path, shm_dir: Path
) -> None:
    shard = _shards(model_dir)[0]
    size = (model_dir / shard).stat().st_size
    http_model.no_range = True
    http_model.drop_after[shard] = size // 4
    staged = staging.stage(http_model.url, shm_dir, MODEL, fetch_options=NO_WAIT)
    staged.close()
    _same_files(staged, model_dir)
    assert http_model.sent[shard] == size + size // 4
    assert next(f for f in staged.files if f.name == shard).written == size + size // 4


def test_a_partial_file_of_another_version_is_fetched_again_from_the_start(
    http_model: Served, model_dir: Path, shm_dir: Path
) -> None:
    shard = _shards(model_dir)[0]
    (shm_dir / MODEL).mkdir(mode=0o700)
    stale = shm_dir / MODEL / f".{shard}.partial"
    stale.write_bytes(b"\0" * 1000)  # bytes of some other file, left by a killed download
    staged = staging.stage(http_model.url, shm_dir, MODEL, fetch_options=NO_WAIT)
    staged.close()
    _same_files(staged, model_dir)
    assert http_model.ranges(shard) == ["bytes=1000-", None]


@pytest.mark.parametrize(
    "line",
    [
        "../../etc/passwd",
        "sub/model.safetensors",
        ".hidden.safetensors",
        "..",
        "a\\b.safetensors",
        "tab\there.safetensors",
    ],
)
def test_manifest_names_from_a_url_must_be_plain_file_names(tmp_path: Path, shm_dir: Path, line: str) -> None:
    root = tmp_path / "evil"
    root.mkdir()
    (root / modelformat.MANIFEST_FILE).write_text(f"{'0' * 64}  ok.safetensors\n{'0' * 64}  {line}\n")
    with serving(root) as served, pytest.raises(BadModel, match="must be a plain name"):
        staging.stage(served.url, shm_dir, MODEL, fetch_options=NO_WAIT)
    assert [r for r in served.requests if r[0] == "GET"] == [
        ("GET", f"/models/evil/{modelformat.MANIFEST_FILE}", None)
    ]  # refused before any file is asked for
    assert list(shm_dir.iterdir()) == []


def test_http_errors_name_the_url_and_the_fix_and_keep_no_bytes(
    http_model: Served, model_dir: Path, shm_dir: Path
) -> None:
    shard = _shards(model_dir)[0]
    http_model.status[shard] = 404
    with pytest.raises(fetch.FetchFailed, match=rf"HEAD http://127\.0\.0\.1:\d+/models/tiny/{shard}: HTTP 404.*check"):
        staging.stage(http_model.url, shm_dir, MODEL, fetch_options=NO_WAIT)
    assert [r for r in http_model.requests if r[1].endswith(shard)] == [("HEAD", f"/models/tiny/{shard}", None)]
    http_model.status[shard] = 503  # retried (a proxy restarting), then given up with the count
    with pytest.raises(fetch.FetchFailed, match=r"HTTP 503 .*\(4 attempts\)"):
        staging.stage(http_model.url, shm_dir, MODEL, fetch_options=NO_WAIT)
    assert not any(p.name.endswith(shard) for p in (shm_dir / MODEL).iterdir())


def test_an_unreachable_url_says_so_after_its_retries(shm_dir: Path) -> None:
    with contextlib.closing(__import__("socket").socket()) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connection refused
        with pytest.raises(fetch.FetchFailed, match=r"cannot connect: .*refused.*\(4 attempts\)"):
            staging.stage(f"http://127.0.0.1:{port}/m", shm_dir, MODEL, fetch_options=NO_WAIT)


def test_credentials_and_signatures_in_the_url_are_never_shown(
    http_model: Served, model_dir: Path, shm_dir: Path
) -> None:
    secret_url = http_model.url.replace("http://", "http://user:hunter2@") + "?X-Amz-Signature=s3cr3t"
    assert fetch.shown(secret_url) == http_model.url
    http_model.status[_shards(model_dir)[0]] = 403
    with pytest.raises(fetch.FetchFailed) as err:
        staging.stage(secret_url, shm_dir, MODEL, fetch_options=NO_WAIT)
    assert "hunter2" not in str(err.value) and "s3cr3t" not in str(err.value)


def test_a_redirect_to_a_file_url_is_refused(tmp_path: Path, shm_dir: Path) -> None:
    class Redirect(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            self.send_response(302)
            self.send_header("Location", "ftp://127.0.0.1/etc/passwd")  # urllib would follow ftp by default
            self.end_headers()

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Redirect)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        with pytest.raises(fetch.FetchFailed, match="redirect to a non-HTTP URL refused"):
            staging.stage(f"http://127.0.0.1:{server.server_address[1]}/m", shm_dir, MODEL, fetch_options=NO_WAIT)
    finally:
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def redirecting(to: str) -> Iterator[str]:
    """A server that answers every GET with a 302 to `to` + its path's last part; yields its own URL."""

    class Redirect(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            self.send_response(302)
            self.send_header("Location", f"{to}/{self.path.rsplit('/', 1)[-1]}")
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_HEAD = do_GET

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Redirect)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/m"
    finally:
        server.shutdown()
        server.server_close()


def test_a_redirect_to_another_origin_is_refused_unless_its_host_is_allowed(
    http_model: Served, model_dir: Path, shm_dir: Path
) -> None:
    """The agent is root on a GPU node: a model URL's server must not send it to any address it reaches (a 302 to
    a loopback metadata-style service was followed with a GET). Another port is another origin."""
    other = urllib.parse.urlsplit(http_model.url).netloc
    with redirecting(http_model.url) as url:
        with pytest.raises(
            fetch.FetchFailed, match=f"redirect to another host refused: .*--fetch-redirect-host {other}"
        ):
            staging.stage(url, shm_dir, MODEL, fetch_options=NO_WAIT)
        assert http_model.requests == []  # nothing was asked of the other host
        allowed = dataclasses.replace(NO_WAIT, redirect_hosts=frozenset({other}))
        _same_files(staging.stage(url, shm_dir, MODEL, fetch_options=allowed), model_dir)


@pytest.mark.parametrize(
    ("base", "allowed", "target", "followed"),
    [
        ("http://store:8080/m", (), "http://store:8080/elsewhere/f", True),  # the same origin
        ("http://store:8080/m", (), "http://store:8081/f", False),  # another port is another origin
        ("http://store/m", (), "https://store/f", True),  # the same host, upgraded to TLS
        ("https://store/m", (), "http://store/f", False),  # never downgraded
        ("http://store/m", (), "http://169.254.169.254/latest", False),
        ("http://a/m", ("b",), "https://b:8443/x", True),  # an allowed host, any port
        ("http://a/m", ("b:80",), "http://b:81/x", False),  # an allowed host:port, that port only
        ("http://a/m", ("B",), "http://b/x", True),  # host names in any case
    ],
)
def test_which_redirects_are_followed(base: str, allowed: tuple[str, ...], target: str, followed: bool) -> None:
    assert fetch._NoUnsafeRedirects(base, frozenset(allowed)).allows(target) is followed


# --- the shm budget ----------------------------------------------------------------------------------------------


def _rewrite(model_dir: Path, seed: int) -> None:
    from nodeagent import tinymodel

    shutil.rmtree(model_dir)
    tinymodel.make_tiny(model_dir, 1_000_000, shard_bytes=600_000, seed=seed)


def test_a_stage_beyond_the_budget_is_refused_with_what_is_staged_needed_and_the_fix(
    model_dir: Path, shm_dir: Path
) -> None:
    need = _model_bytes(model_dir)
    with pytest.raises(staging.ShmBudgetExceeded) as err:
        staging.stage(model_dir, shm_dir, MODEL, budget_bytes=need // 2)
    msg = str(err.value)
    assert f"staging {MODEL} needs" in msg and "--shm-budget" in msg and "Fix: raise --shm-budget" in msg
    assert list((shm_dir / MODEL).iterdir()) == []  # refused before writing anything
    staged = staging.stage(model_dir, shm_dir, MODEL, budget_bytes=2 * need)
    staged.close()


def test_a_download_without_a_length_stops_at_the_budget_and_leaves_nothing(tmp_path: Path, shm_dir: Path) -> None:
    """No Content-Length (nor a HEAD that says one): the need reads 0 and the budget check before the stage passes;
    the bytes are counted as they come (80 MiB were written with a 16 MiB budget before)."""
    budget, sent = 2 * 2**20, 16 * 2**20
    streamed: list[int] = []

    class Endless(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"  # close-delimited: no length anywhere

        def log_message(self, *args: object) -> None:
            pass

        def do_HEAD(self) -> None:
            self.send_response(200)
            self.end_headers()

        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            if self.path.endswith("sha256sums.txt"):
                self.wfile.write(f"{'0' * 64}  model.safetensors\n".encode())
                return
            block = b"\0" * 2**18
            try:
                for _ in range(sent // len(block)):
                    self.wfile.write(block)
                    streamed.append(len(block))
            except OSError:
                pass  # the agent stopped reading

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Endless)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        with pytest.raises(staging.ShmBudgetExceeded, match=r"went beyond --shm-budget 2\.0 MiB while downloading"):
            staging.stage(f"http://127.0.0.1:{server.server_address[1]}/m", shm_dir, MODEL, budget_bytes=budget,
                          fetch_options=NO_WAIT)  # fmt: skip
    finally:
        server.shutdown()
        server.server_close()
    left = [p for p in (shm_dir / MODEL).iterdir()] if (shm_dir / MODEL).exists() else []
    assert left == []  # its partial file removed
    assert sum(streamed) < sent  # the agent stopped reading long before the end


def test_a_new_version_over_budget_never_evicts_the_staged_one(model_dir: Path, shm_dir: Path) -> None:
    first = staging.stage(model_dir, shm_dir, MODEL)
    try:
        before = {f.name: (shm_dir / MODEL / f.name).read_bytes() for f in first.files}
        other = shm_dir / "other-model"
        other.mkdir(mode=0o700)
        (other / "w.safetensors").write_bytes(b"\0" * 300_000)
        _rewrite(model_dir, seed=7)  # every file changes: old and new would be staged side by side
        budget = sum(staging.shm_use(os.open(shm_dir, os.O_RDONLY)).values()) + first.nbytes // 2
        with pytest.raises(staging.ShmBudgetExceeded) as err:
            staging.stage(model_dir, shm_dir, MODEL, previous=first, budget_bytes=budget)
        msg = str(err.value)
        assert "the version staged now: kept until the new one verifies" in msg
        assert "Nothing was evicted" in msg and f"rm -rf {other}" in msg
        assert {f.name: (shm_dir / MODEL / f.name).read_bytes() for f in first.files} == before
        staging.check_staged(first)  # the descriptors engines hold are still the verified files
    finally:
        first.close()


def test_a_restart_over_budget_reuses_what_is_staged(model_dir: Path, shm_dir: Path) -> None:
    """Nothing to add: a budget lowered below what is staged does not take a restarted node's weights away."""
    staging.stage(model_dir, shm_dir, MODEL).close()
    again = staging.stage(model_dir, shm_dir, MODEL, budget_bytes=1000)
    again.close()
    assert again.written_bytes == 0 and again.reused_bytes == again.nbytes


# --- progress ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("steps", "due"),
    [
        # (seconds since start, fraction) -> a line due?  Every 5 s or every 10 %, whichever first.
        ([(0.0, 0.0), (1.0, 0.05), (2.0, 0.09), (3.0, 0.11)], [False, False, False, True]),
        ([(0.0, 0.0), (4.9, 0.01), (5.0, 0.02), (9.9, 0.03), (10.1, 0.04)], [False, False, True, False, True]),
        ([(0.0, 0.0), (0.1, 0.5), (0.2, 0.55), (0.3, 0.61)], [False, True, False, True]),
    ],
)
def test_progress_lines_come_every_5_s_or_10_percent(steps: list[tuple[float, float]], due: list[bool]) -> None:
    gate = progress.Gate(interval_s=5.0, step=0.1)
    assert [gate.due(t, f) for t, f in steps] == due


def test_progress_says_bytes_rate_and_eta() -> None:
    p = progress.Progress(total_bytes=10_000_000_000, started_at=100.0, what="staging big")
    p.add(2_000_000_000)
    assert progress.describe(p, 102.0) == "staging big: 2.0 GB of 10.0 GB (20 %), 1.0 GB/s, ETA 8 s"
    assert progress.bar(p, 102.0, width=10) == "[##........]  20 %  2.0 GB of 10.0 GB  1.0 GB/s  ETA 8 s"


def test_a_stage_reports_its_progress_at_a_bounded_rate(http_model: Served, model_dir: Path, shm_dir: Path) -> None:
    lines: list[float] = []
    p = progress.Progress(
        total_bytes=0,
        started_at=0.0,
        on_due=lambda p, now: lines.append(p.fraction),
        gate=progress.Gate(interval_s=3600.0, step=0.25),
    )
    staged = staging.stage(http_model.url, shm_dir, MODEL, fetch_options=NO_WAIT, progress=p)
    staged.close()
    assert p.total_bytes == staged.nbytes and p.done_bytes == staged.nbytes
    assert 1 <= len(lines) <= 4 and lines == sorted(lines)  # every quarter at most, not every block


def test_model_verify_prints_progress_lines_when_not_on_a_terminal(model_dir: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pulsescale", "model", "verify", str(model_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "\r" not in out.stderr and re.search(
        r"verifying .*: ([\d.]+ kB) of \1 \(100 %\), [\d.]+ [kMG]B/s\n", out.stderr
    )
    assert out.stdout.count("ok    ") == len(modelformat.read_manifest(model_dir))


# --- the agent: status, budget with a slot serving, restart reuse by counters ---------------------------------------


async def test_the_agent_stages_from_a_url_and_reports_budget_and_bytes(
    nats_server: NatsServer, nc: Client, store: KvSlotStore, http_model: Served, model_dir: Path, shm_dir: Path
) -> None:
    cfg = settings(shm_dir / MODEL, shm_dir, nats_server.url, model_url=http_model.url, shm_budget_bytes=50 * 2**20)
    async with running_agent(cfg) as (agent, registry):
        await wait_state(store, key("s0"), "warm")
        status = (await request(nc, "status")).fields["weights"]
        assert status["source"] == http_model.url and status["budget_bytes"] == 50 * 2**20
        assert status["hashed_bytes"] == agent.staged.nbytes  # type: ignore[union-attr]
        assert status["progress"] is None  # not staging now
        fetched = registry.get_sample_value("pulsescale_agent_staged_bytes_total", {"how": "fetched"})
        assert fetched == agent.staged.nbytes  # type: ignore[union-attr]


async def test_the_status_shows_the_progress_of_a_stage_while_it_runs(
    nats_server: NatsServer, nc: Client, store: KvSlotStore, http_model: Served, model_dir: Path, shm_dir: Path
) -> None:
    shard = _shards(model_dir)[0]
    release = threading.Event()
    http_model.hold[shard] = (100_000, release)  # the proxy stalls a while after 100 kB of the first shard
    cfg = settings(shm_dir / MODEL, shm_dir, nats_server.url, model_url=http_model.url)
    try:
        async with running_agent(cfg):
            seen: list[float] = []

            async def midway() -> bool:
                try:
                    reply = await request(nc, "status", timeout_s=2)
                except NoRespondersError:
                    return False  # not subscribed yet
                fraction = reply.fields["weights"]["progress"]
                if fraction is not None:
                    seen.append(fraction)
                return fraction is not None and fraction > 0

            await wait_for(midway, 20, "a stage in progress in the status")
            assert 0 < seen[-1] < 1
            release.set()
            await wait_state(store, key("s0"), "warm")
            assert (await request(nc, "status")).fields["weights"]["progress"] is None
    finally:
        release.set()


async def test_a_prewarm_over_budget_is_refused_and_the_serving_slot_keeps_serving(
    nats_server: NatsServer, nc: Client, store: KvSlotStore, model_dir: Path, shm_dir: Path
) -> None:
    nbytes = _model_bytes(model_dir)
    cfg = settings(model_dir, shm_dir, nats_server.url, slots=2, shm_budget_bytes=nbytes + nbytes // 2)
    async with running_agent(cfg) as (_, registry):
        for slot in ("s0", "s1"):
            await wait_state(store, key(slot), "warm")
        claim = await store.claim_slot(key("s0"))
        reply = await activate(nc, claim)
        assert reply.ok, reply
        endpoint = reply.fields["endpoint"]
        _rewrite(model_dir, seed=3)  # a new version: old + new will not fit the budget
        assert (await request(nc, "prewarm")).ok
        rec = await wait_state(store, key("s1"), "failed")
        assert rec.reason is not None and "--shm-budget" in rec.reason and "Nothing was evicted" in rec.reason
        assert registry.get_sample_value("pulsescale_agent_staging_refused_total", {"reason": "shm_budget"}) == 1
        await completion(endpoint)  # the slot in use still serves, from the version it was given
        assert (await request(nc, "status")).fields["weights"]["error"].startswith("staging failed")


def _metrics(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in ("pulsescale_agent_staged_bytes_total", "pulsescale_agent_hashed_bytes_total"):
                out[s.labels.get("how", "hashed")] = s.value
    return out


def _spawn_agent(source: str, shm_dir: Path, nats_url: str, log: Path) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable, "-m", "pulsescale", "agent", "--nats", nats_url, "--node", NODE, "--model", source,
        "--model-name", MODEL, "--slots", "1", "--shm-dir", str(shm_dir), "--metrics-port", "0", "--no-mlock",
    ]  # fmt: skip
    with open(log, "wb") as f:
        return subprocess.Popen(cmd, stderr=f, start_new_session=True)


def _tail(log: Path) -> str:
    return log.read_bytes().decode(errors="replace")[-2000:]


def _metrics_port(log: Path) -> int | None:
    m = re.search(rb"metrics on :(\d+)", log.read_bytes())
    return int(m.group(1)) if m else None


async def _agent_process(source: str, shm_dir: Path, nats_url: str, log: Path) -> tuple[subprocess.Popen[bytes], int]:
    """A real agent process (`pulsescale agent`) and the port of its /metrics."""
    proc = _spawn_agent(source, shm_dir, nats_url, log)
    await wait_for(lambda: _metrics_port(log) is not None or proc.poll() is not None, 60, "the agent process")
    port = _metrics_port(log)
    if port is None:
        raise AssertionError(f"the agent exited with {proc.returncode}: {_tail(log)}")
    return proc, port


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.parametrize("via", ["path", "url"])
async def test_an_agent_restart_reuses_staged_weights_by_counters(
    nats_server: NatsServer, store: KvSlotStore, model_dir: Path, shm_dir: Path, tmp_path: Path, via: str
) -> None:
    """Proven by counters, not timing: the second process copies and fetches nothing; it re-verifies (hashes)
    what the first staged, because the verified descriptors went with the first process."""
    nbytes = _model_bytes(model_dir)
    with serving(model_dir) as served:
        source = served.url if via == "url" else str(model_dir)
        how = "fetched" if via == "url" else "copied"
        seen = []
        for run in range(2):
            proc, port = await _agent_process(source, shm_dir, nats_server.url, tmp_path / f"agent{run}.log")
            try:
                await wait_for(
                    lambda: (r := store.entry(key("s0"))) is not None and r[0].state == "warm" and r[0].updated_at,
                    60,
                    "s0 warm",
                )
                await wait_for(lambda port=port: _metrics(port).get("reused") is not None, 10, "the stage counters")
                seen.append(_metrics(port))
            finally:
                _stop(proc)
            assert proc.returncode == 0, _tail(tmp_path / f"agent{run}.log")
            await wait_state(store, key("s0"), "failed")  # the stopped agent's record, before the next one starts
        files_requested = [r for r in served.requests if not r[1].endswith(modelformat.MANIFEST_FILE)]
    first, second = seen
    assert first[how] == nbytes and first["reused"] == 0 and first["hashed"] == nbytes
    assert second.get("copied", 0) == 0 and second.get("fetched", 0) == 0
    assert second["reused"] == nbytes and second["hashed"] == nbytes  # re-verified, not re-staged
    if via == "url":
        assert len([r for r in files_requested if r[0] == "GET"]) == len(modelformat.read_manifest(model_dir))
