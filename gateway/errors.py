"""What the gateway refuses, by name: the codes its error bodies carry and `pulsescale_gateway_refused_total{reason}`
counts, and the OpenAI-style error body every refusal is written as. Pure: no I/O.

A refusal is a request (or a connection) the gateway turns down before any upstream sees it. Answers an upstream
gave, waits that ran out (504) and upstreams that broke (502) are not refusals: they are counted by model in
`pulsescale_gateway_responses_total`.
"""

from __future__ import annotations

import json
from typing import Final, Literal

__all__ = ["REASONS", "Reason", "Refused", "error_body", "raw_response"]

Reason = Literal[
    "malformed_request",
    "no_route",
    "bad_request",
    "body_too_large",
    "body_timeout",
    "body_budget_full",
    "unknown_model",
    "models_not_listed",
    "queue_full",
    "too_many_connections",
    "header_timeout",
]
REASONS: Final[tuple[Reason, ...]] = (
    "malformed_request",  # 400, then closed: not HTTP/1.1 aiohttp can parse (a bad request line, huge headers)
    "no_route",  # 404/405: a path or method the gateway does not serve
    "bad_request",  # 400: not JSON, no model, a name that breaks the contract's pattern
    "body_too_large",  # 413: a body over max_body_bytes (told by its Content-Length: refused unread)
    "body_timeout",  # 408: the body did not arrive within body_timeout_s
    "body_budget_full",  # 503: the bodies held by requests being read or waiting would pass body_budget_bytes
    "unknown_model",  # 404: no --models entry, no ScaledObject and no ready slot names it
    "models_not_listed",  # 503: pulse_scalers not read (yet), and nothing else names the model
    "queue_full",  # 429: queue_limit requests of the model already wait
    "too_many_connections",  # 503, then closed: max_connections are open on the listener
    "header_timeout",  # 408, then closed: no complete request head within header_timeout_s of connecting
)

_STATUS_TEXT: Final = {
    400: "Bad Request",
    404: "Not Found",
    408: "Request Timeout",
    413: "Payload Too Large",
    429: "Too Many Requests",
    503: "Service Unavailable",
}


class Refused(Exception):
    """A request turned down before it waits: its HTTP status, its `reason` (the body's ``code`` and the metric's
    label) and what the client is told, with ``Retry-After`` when waiting helps."""

    def __init__(self, status: int, reason: Reason, message: str, *, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message
        self.retry_after_s = retry_after_s

    @property
    def headers(self) -> dict[str, str]:
        return {} if self.retry_after_s is None else {"Retry-After": str(self.retry_after_s)}


def error_body(status: int, code: str, message: str) -> dict[str, object]:
    """An OpenAI-style error body: ``{"error": {"message", "type", "code"}}``."""
    kind = "invalid_request_error" if status < 500 and status != 429 else "server_error"
    return {"error": {"message": message, "type": kind, "code": code}}


def raw_response(refusal: Refused) -> bytes:
    """`refusal` as a whole HTTP/1.1 response that closes the connection, for a listener that answers before
    (or instead of) aiohttp's request handling."""
    body = json.dumps(error_body(refusal.status, refusal.reason, refusal.message)).encode()
    head = [
        f"HTTP/1.1 {refusal.status} {_STATUS_TEXT.get(refusal.status, 'Error')}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        "Connection: close",
        *(f"{k}: {v}" for k, v in refusal.headers.items()),
    ]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body
