"""The `local` engine: a small numpy language model behind an OpenAI-shaped HTTP server.

It exists so that readiness and first tokens are real on every machine: `/v1/completions` runs a forward pass
over the staged weights for every token it returns.

The model (written by `pulsescale model make-tiny`) reads bytes. Its context is a decayed sum of the byte
embeddings (``h = decay * h + tok_emb[byte]``); each layer RMS-normalises, lets a router pick one expert and
adds ``tanh(expert @ x)``; the head maps back to byte logits, and greedy decoding takes the best printable byte.
Only the chosen experts are read per token (a mixture of experts, as in real MoE models), so a token costs the
same for a 1 MB and a 10 GB model.

``GET /metrics`` is a Prometheus page in vLLM's format with vLLM's three scheduler series (`RequestBook`), so the
local engine stands in for vLLM wherever its metrics are read (``pulsescale bridge --slots``): a request is
*waiting* from when its body is read until it holds the model lock, *running* while it holds it (its text made and
the emulated accelerator time slept), and counted in ``vllm:request_success_total{finished_reason}`` as it lets go.

This module is imported by the zygote before it forks (numpy and the HTTP server are the heavy imports) and
runs in the forked engine process; the agent never imports it.
"""

from __future__ import annotations

import json
import secrets
import socket
import socketserver
import sys
import threading
import time
import traceback
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Final

import numpy as np

from nodeagent import modelformat

__all__ = ["EngineServer", "LocalBoot", "RequestBook", "TinyMoE", "check_model", "prepare", "read_config"]

MAX_BODY_BYTES: Final = 1 * 2**20
MAX_CONNECTIONS: Final = 32
"""Connections an engine serves at once, one thread each. Forward passes run one at a time (the model lock), so
more threads would only queue; beyond it the oldest connection still waiting for its request is closed to make
room, and with none waiting the new one is answered 503 and closed. A model's config may raise it
(``max_connections``, up to `MAX_CONNECTIONS_LIMIT`) for an engine that is to hold its queue itself, as vLLM does
(the demo's ``--source vllm-metrics``)."""
MAX_CONNECTIONS_LIMIT: Final = 4096
"""Bound of ``max_connections`` in a model's config: a thread each, well inside a process's limits."""
READ_TIMEOUT_S: Final = 10.0
"""A connection silent this long (reading a request, between keep-alive requests, or not reading our reply) is
closed: a client that connects and sends nothing cannot hold a thread. The readiness check and the gateway send
their requests at once."""
DROP_LOG_EVERY_S: Final = 10.0
"""Clients that go away (reset, broken pipe, timeout) are summed into at most one short line per interval: the
engine writes into the agent's log, which a client must not be able to flood."""
MAX_TOKENS_LIMIT: Final = 4096
MAX_TOKEN_MS: Final = 1000
"""Bound of `token_ms` in a model's config: a second per token is already no model anyone serves."""
CONTEXT_BYTES: Final = 512  # decay**512 underflows any float32 contribution: older bytes cannot matter
METRICS_CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"
"""The Prometheus text format's content type, as vLLM's /metrics (prometheus_client) answers it."""
FINISH_REASONS: Final = ("stop", "length", "abort", "error", "repetition")
"""vLLM's ``finished_reason`` label values (its ``FinishReason``), each present from the start as vLLM's are. This
engine finishes requests with ``stop`` or ``length`` only: it does not notice a client that went away before its
answer (the text is generated and counted, the write then fails), so it never counts ``abort``."""
_PRINTABLE: Final = np.arange(256)
_MASK: Final = np.where((_PRINTABLE >= 32) & (_PRINTABLE < 127), 0.0, -np.inf).astype(np.float32)


def read_config(model_dir: str | Path) -> dict[str, Any]:
    return read_config_file(Path(model_dir, modelformat.CONFIG_FILE))


def read_config_file(path: Path) -> dict[str, Any]:
    """`read_config` of a config file by its path (staging vets a ``.partial`` copy before it is renamed)."""
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot read the local engine's {modelformat.CONFIG_FILE}: {err}") from None
    if not isinstance(cfg, dict) or cfg.get("format") != modelformat.FORMAT:
        raise ValueError(
            f"{modelformat.CONFIG_FILE} is not a {modelformat.FORMAT} model "
            "(make one with `pulsescale model make-tiny`)"
        )
    for key in ("vocab", "dim", "layers", "experts"):
        if not isinstance(cfg.get(key), int) or cfg[key] <= 0:
            raise ValueError(f"{modelformat.CONFIG_FILE}: `{key}` must be a positive integer")
    token_ms = cfg.get("token_ms", 0)
    if isinstance(token_ms, bool) or not isinstance(token_ms, int | float) or not 0 <= token_ms <= MAX_TOKEN_MS:
        raise ValueError(f"{modelformat.CONFIG_FILE}: `token_ms` must be a number of ms in [0, {MAX_TOKEN_MS}]")
    conns = cfg.get("max_connections", MAX_CONNECTIONS)
    if isinstance(conns, bool) or not isinstance(conns, int) or not 1 <= conns <= MAX_CONNECTIONS_LIMIT:
        raise ValueError(
            f"{modelformat.CONFIG_FILE}: `max_connections` must be an integer in [1, {MAX_CONNECTIONS_LIMIT}]"
        )
    return cfg


def expected_shapes(cfg: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    tc = modelformat.TinyConfig(
        dim=cfg["dim"], layers=cfg["layers"], experts=cfg["experts"], vocab=cfg["vocab"], decay=cfg.get("decay", 0.8)
    )
    return dict(tc.tensors())


def check_model(cfg: Mapping[str, Any], shapes: Mapping[str, tuple[tuple[int, ...], str]]) -> None:
    """Refuse a model whose tensors do not match its config (checked at staging, not at activation)."""
    for name, shape in expected_shapes(cfg).items():
        got = shapes.get(name)
        if got is None:
            raise ValueError(f"tensor {name!r} is missing from the weights")
        if got != (shape, "F32"):
            raise ValueError(f"tensor {name!r} is {got[1]}{list(got[0])}, the config needs F32{list(shape)}")


class TinyMoE:
    def __init__(self, cfg: Mapping[str, Any], tensors: Mapping[str, np.ndarray]) -> None:
        check_model(
            cfg, {k: (tuple(v.shape), "F32" if v.dtype == np.float32 else str(v.dtype)) for k, v in tensors.items()}
        )
        self.decay = np.float32(cfg.get("decay", 0.8))
        self.emb = tensors["tok_emb"]
        self.layers = [
            (tensors[f"layers.{i}.norm"], tensors[f"layers.{i}.router"], tensors[f"layers.{i}.experts"])
            for i in range(cfg["layers"])
        ]
        self.final_norm = tensors["final_norm"]
        self.head = tensors["lm_head"]
        self._weights = np.power(self.decay, np.arange(CONTEXT_BYTES, dtype=np.float32)[::-1])
        self.token_s = float(cfg.get("token_ms", 0)) / 1e3
        """Accelerator time per generated token to emulate (config `token_ms`, 0 = none): slept, not computed, so
        a CPU machine's engines have a GPU's service time (the demo's replica capacity) without burning a core."""

    @staticmethod
    def _rms(x: np.ndarray, gain: np.ndarray) -> np.ndarray:
        out: np.ndarray = x * gain / np.sqrt(np.mean(x * x) + np.float32(1e-6))
        return out

    def state(self, prompt: bytes) -> np.ndarray:
        ctx = np.frombuffer(prompt[-CONTEXT_BYTES:], np.uint8)
        if ctx.size == 0:
            return np.zeros(self.emb.shape[1], np.float32)
        return np.asarray(self._weights[-ctx.size :] @ self.emb[ctx], np.float32)

    def next_byte(self, h: np.ndarray) -> int:
        x = h
        for norm, router, experts in self.layers:
            xn = self._rms(x, norm)
            e = int(np.argmax(router @ xn))
            x = x + np.tanh(experts[e] @ xn)
        logits = self.head @ self._rms(x, self.final_norm)
        return int(np.argmax(logits + _MASK))

    def generate(self, prompt: bytes, max_tokens: int, stop: list[bytes]) -> tuple[bytes, str]:
        h = self.state(prompt)
        out = bytearray()
        for _ in range(max_tokens):
            b = self.next_byte(h)
            out.append(b)
            h = self.decay * h + self.emb[b]
            for s in stop:
                if s and out.endswith(s):
                    return bytes(out[: -len(s)]), "stop"
        return bytes(out), "length"


class RequestBook:
    """The engine's requests as vLLM's scheduler counts them (module doc), thread-safe: each connection has its
    thread. `page` renders them as vLLM's /metrics does (prometheus_client's text format, labels sorted)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.waiting = 0
        self.running = 0
        self.finished: dict[str, int] = dict.fromkeys(FINISH_REASONS, 0)

    def arrived(self) -> None:
        with self._lock:
            self.waiting += 1

    def started(self) -> None:
        """It holds the model lock (was waiting)."""
        with self._lock:
            self.waiting -= 1
            self.running += 1

    def finished_one(self, finish: str | None) -> None:
        """It is done with the model: `finish`ed (its reason), or None, failed before its text was made (not a
        success: vLLM counts ``error`` only for its own retryable failures)."""
        with self._lock:
            self.running -= 1
            if finish is not None:
                self.finished[finish] = self.finished.get(finish, 0) + 1

    def page(self, model_name: str) -> bytes:
        with self._lock:
            waiting, running, finished = self.waiting, self.running, dict(self.finished)
        name = model_name.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        labels = f'engine="0",model_name="{name}"'
        lines = [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{labels}}} {float(running)}",
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{labels}}} {float(waiting)}",
            "# HELP vllm:request_success_total Count of successfully processed requests.",
            "# TYPE vllm:request_success_total counter",
        ]
        for reason, n in finished.items():
            lines.append(f'vllm:request_success_total{{engine="0",finished_reason="{reason}",model_name="{name}"}} '
                         f"{float(n)}")  # fmt: skip
        return ("\n".join(lines) + "\n").encode()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: the readiness check sends two requests on one connection
    server: EngineServer

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.server.read_timeout_s)  # reads and writes alike
        # Headers and body leave in two writes: with Nagle, the body waits for the client's delayed ACK of the
        # headers (40 ms on Linux), on every keep-alive request after the first.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def handle_one_request(self) -> None:
        self.server.waiting(self.request)  # reading a request: the connection may be closed to make room
        super().handle_one_request()

    def _serving(self) -> bool:
        """The request is read: from now on the connection is not closed to make room. False if it already was."""
        if self.server.serving(self.request):
            return True
        self.close_connection = True
        return False

    def log_message(self, format: str, *args: Any) -> None:
        pass  # per-request lines would drown the agent's log; the gateway logs requests

    def _send(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        self._send(status, {"error": {"message": message, "type": kind, "param": None, "code": None}})

    def do_GET(self) -> None:
        if not self._serving():
            return
        if self.path == "/health":
            if self.server.unhealthy:
                self._error(503, "engine is not healthy (fault injected)", "server_error")
            else:
                self._send(200, {"status": "ok"})
        elif self.path == "/metrics":
            data = self.server.book.page(self.server.model_name)
            self.send_response(200)
            self.send_header("Content-Type", METRICS_CONTENT_TYPE)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        elif self.path == "/v1/models":
            model = {"id": self.server.model_name, "object": "model", "created": 0, "owned_by": "pulsescale"}
            self._send(200, {"object": "list", "data": [model]})
        else:
            self._error(404, f"no route {self.path}")

    def do_POST(self) -> None:
        if self.path != "/v1/completions":
            self._error(404, f"no route {self.path}")
            return
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if not 0 < length <= MAX_BODY_BYTES:
            self.close_connection = True
            self._error(400 if length <= 0 else 413, f"send a JSON body of 1..{MAX_BODY_BYTES} bytes")
            return
        body = self.rfile.read(length)
        if not self._serving():
            return
        try:
            prompt, max_tokens, stop = _parse(json.loads(body))
        except ValueError as err:
            self._error(400, str(err))
            return
        except RecursionError:  # a deeply nested body: refused like any other bad body, not a crash
            self._error(400, "the body nests too deeply")
            return
        if self.server.bad_reply:
            data = b"[]"  # fault injected: valid JSON, wrong shape
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        book = self.server.book
        book.arrived()
        with self.server.lock:  # one forward pass at a time: numpy already uses the cores for each
            book.started()
            finish: str | None = None
            try:
                text, finish = self.server.model.generate(prompt, max_tokens, stop)
                if self.server.model.token_s:
                    time.sleep(len(text) * self.server.model.token_s)  # the emulated accelerator is busy meanwhile
            finally:
                book.finished_one(finish)  # under the lock: never two running at once, even for a moment
        out = text.decode("ascii", errors="replace")
        self._send(
            200,
            {
                "id": "cmpl-" + secrets.token_hex(12),
                "object": "text_completion",
                "created": int(time.time()),
                "model": self.server.model_name,
                "choices": [{"text": out, "index": 0, "logprobs": None, "finish_reason": finish}],
                "usage": {
                    "prompt_tokens": len(prompt),
                    "completion_tokens": len(text),
                    "total_tokens": len(prompt) + len(text),
                },
            },
        )


def _parse(req: object) -> tuple[bytes, int, list[bytes]]:
    if not isinstance(req, dict):
        raise ValueError("the body must be a JSON object")
    prompt = req.get("prompt", "")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise ValueError("`prompt` must be a string (batches of prompts are not supported)")
    max_tokens = req.get("max_tokens", 16)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or not 0 <= max_tokens <= MAX_TOKENS_LIMIT:
        raise ValueError(f"`max_tokens` must be an integer in 0..{MAX_TOKENS_LIMIT}")
    stop = req.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise ValueError("`stop` must be a string or a list of strings")
    return prompt.encode("utf-8"), max_tokens, [s.encode("utf-8") for s in stop]


class EngineServer(ThreadingHTTPServer):
    """Bound and listening once constructed; `serve_forever` answers."""

    daemon_threads = True
    allow_reuse_address = True  # a re-activation binds the port its predecessor left in TIME_WAIT
    request_queue_size = 64  # the accept loop only hands sockets to threads (or refuses them): a burst waits here

    def __init__(
        self,
        model: TinyMoE,
        model_name: str,
        host: str,
        port: int,
        *,
        unhealthy: bool = False,
        bad_reply: bool = False,
        max_connections: int = MAX_CONNECTIONS,
        read_timeout_s: float = READ_TIMEOUT_S,
    ) -> None:
        self.model = model
        self.model_name = model_name
        self.unhealthy = unhealthy
        self.bad_reply = bad_reply
        self.lock = threading.Lock()
        self.book = RequestBook()
        """Its requests, as vLLM counts them (``GET /metrics``)."""
        self.max_connections = max_connections
        self.read_timeout_s = read_timeout_s
        self._conns: dict[socket.socket, bool] = {}
        """Open connections, oldest first -> True while waiting for a request (may be closed to make room)."""
        self._conns_lock = threading.Lock()
        self.refused = 0
        self.dropped = 0
        self._drop_note: tuple[float, int] = (0.0, 0)  # (when the last line was written, drops since)
        super().__init__((host, port), _Handler)

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def server_bind(self) -> None:
        # `HTTPServer.server_bind` also asks `socket.getfqdn` for a name nothing here uses: a reverse DNS lookup on
        # the activation path (and a lazy codec import an engine that dropped privileges may not be able to read).
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), int(self.server_address[1])

    # --- connections: bounded, the waiting ones closed first ----------------------------------------------------

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._conns_lock:
            if len(self._conns) >= self.max_connections:
                oldest = next((c for c, waiting in self._conns.items() if waiting), None)
                if oldest is not None:
                    del self._conns[oldest]
                    _hang_up(oldest)  # its thread sees end of input and closes it
            admitted = len(self._conns) < self.max_connections
            if admitted:
                self._conns[request] = True
        if not admitted:
            self.refused += 1
            _refuse(request)
            return
        super().process_request(request, client_address)  # one thread for the connection

    def shutdown_request(self, request: Any) -> None:
        with self._conns_lock:
            self._conns.pop(request, None)
        super().shutdown_request(request)

    def waiting(self, conn: socket.socket) -> None:
        with self._conns_lock:
            if conn in self._conns:
                self._conns[conn] = True

    def serving(self, conn: socket.socket) -> bool:
        with self._conns_lock:
            if conn not in self._conns:
                return False  # closed to make room while its request was read
            self._conns[conn] = False
            return True

    @property
    def connections(self) -> int:
        with self._conns_lock:
            return len(self._conns)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that went away is summed into one short line per `DROP_LOG_EVERY_S`, never a traceback."""
        err = sys.exc_info()[1]
        if not isinstance(err, OSError):  # a bug in the engine, not a client: a short traceback, rate-limited
            if self._note_drop() is not None:
                traceback.print_exc(limit=3, file=sys.stderr)
            return
        self.dropped += 1
        if (n := self._note_drop()) is not None:
            print(f"engine :{self.port}: {n} client(s) dropped, last {err!r:.120}", file=sys.stderr)

    def _note_drop(self) -> int | None:
        """Count one drop; the drops since the last line when one may be written now, else None."""
        last, count = self._drop_note
        now = time.monotonic()
        if now - last >= DROP_LOG_EVERY_S:
            self._drop_note = (now, 0)
            return count + 1
        self._drop_note = (last, count + 1)
        return None


def _hang_up(conn: socket.socket) -> None:
    """End a connection's input and output so its thread, blocked reading, finishes and closes it."""
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already gone


def _refuse(conn: socket.socket) -> None:
    """Answer 503 without waiting (the accept loop must not block on a client) and close."""
    try:
        conn.setblocking(False)
        conn.send(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
    except OSError:
        pass
    finally:
        conn.close()


class LocalBoot:
    """What the zygote holds for the local engine: the config, read once before any fork."""

    def __init__(self, cfg: Mapping[str, Any], model_name: str) -> None:
        self.cfg = cfg
        self.model_name = model_name

    def boot(self, weights: Any, host: str, port: int, fault: str | None) -> EngineServer:
        model = TinyMoE(self.cfg, weights.tensors)
        return EngineServer(
            model,
            self.model_name,
            host,
            port,
            unhealthy=fault == "unhealthy",
            bad_reply=fault == "badreply",
            max_connections=int(self.cfg.get("max_connections", MAX_CONNECTIONS)),
        )


def prepare(spec: Mapping[str, Any]) -> LocalBoot:
    """Called in the zygote before it forks anything."""
    return LocalBoot(read_config(spec["model_dir"]), spec["model_name"])
