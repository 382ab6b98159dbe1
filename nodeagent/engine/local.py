"""The `local` engine: a small numpy language model behind an OpenAI-shaped HTTP server.

It exists so that readiness and first tokens are real on every machine: `/v1/completions` runs a forward pass
over the staged weights for every token it returns.

The model (written by `pulsescale model make-tiny`) reads bytes. Its context is a decayed sum of the byte
embeddings (``h = decay * h + tok_emb[byte]``); each layer RMS-normalises, lets a router pick one expert and
adds ``tanh(expert @ x)``; the head maps back to byte logits, and greedy decoding takes the best printable byte.
Only the chosen experts are read per token (a mixture of experts, as in real MoE models), so a token costs the
same for a 1 MB and a 10 GB model.

This module is imported by the zygote before it forks (numpy and the HTTP server are the heavy imports) and
runs in the forked engine process; the agent never imports it.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Final

import numpy as np

from nodeagent import modelformat

__all__ = ["EngineServer", "LocalBoot", "TinyMoE", "check_model", "prepare", "read_config"]

MAX_BODY_BYTES: Final = 1 * 2**20
MAX_TOKENS_LIMIT: Final = 4096
CONTEXT_BYTES: Final = 512  # decay**512 underflows any float32 contribution: older bytes cannot matter
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


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: the readiness check sends two requests on one connection
    server: EngineServer

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
        if self.path == "/health":
            if self.server.unhealthy:
                self._error(503, "engine is not healthy (fault injected)", "server_error")
            else:
                self._send(200, {"status": "ok"})
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
        try:
            req = json.loads(self.rfile.read(length))
            prompt, max_tokens, stop = _parse(req)
        except ValueError as err:
            self._error(400, str(err))
            return
        if self.server.bad_reply:
            data = b"[]"  # fault injected: valid JSON, wrong shape
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        with self.server.lock:  # one forward pass at a time: numpy already uses the cores for each
            text, finish = self.server.model.generate(prompt, max_tokens, stop)
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

    def __init__(
        self, model: TinyMoE, model_name: str, host: str, port: int, *, unhealthy: bool = False, bad_reply: bool = False
    ) -> None:
        self.model = model
        self.model_name = model_name
        self.unhealthy = unhealthy
        self.bad_reply = bad_reply
        self.lock = threading.Lock()
        super().__init__((host, port), _Handler)

    @property
    def port(self) -> int:
        return int(self.server_address[1])


class LocalBoot:
    """What the zygote holds for the local engine: the config, read once before any fork."""

    def __init__(self, cfg: Mapping[str, Any], model_name: str) -> None:
        self.cfg = cfg
        self.model_name = model_name

    def boot(self, weights: Any, host: str, port: int, fault: str | None) -> EngineServer:
        model = TinyMoE(self.cfg, weights.tensors)
        return EngineServer(
            model, self.model_name, host, port, unhealthy=fault == "unhealthy", bad_reply=fault == "badreply"
        )


def prepare(spec: Mapping[str, Any]) -> LocalBoot:
    """Called in the zygote before it forks anything."""
    return LocalBoot(read_config(spec["model_dir"]), spec["model_name"])
