"""The OpenAI-style request as the gateway reads it, and the error it answers with.

`parse_request` takes the body of ``POST /v1/completions`` (or ``/<model>/v1/completions``) and says which model it
names and whether the answer is streamed, or why the request is refused (ValueError, its message the answer's);
`error_response` is the JSON error every refusal of the gateway's is (`gateway.errors.error_body`). The body is
read, bounded and counted by `gateway.proxy` before it gets here.
"""

from __future__ import annotations

import json

from aiohttp import web

from gateway.errors import error_body
from warmpool import protocol


def parse_request(body: bytearray, path_model: str | None) -> tuple[str, bool]:
    """The model and whether the answer is streamed; ValueError says what is wrong with the request."""
    try:
        req = json.loads(body)
    except (ValueError, RecursionError):
        raise ValueError("the body is not JSON") from None
    if not isinstance(req, dict):
        raise ValueError("the body must be a JSON object")
    model = req.get("model")
    if model is not None and not isinstance(model, str):
        raise ValueError("`model` must be a string")
    if path_model is not None and model is not None and model != path_model:
        raise ValueError(f"the path names model {path_model!r} but the body names {model!r}")
    model = path_model or model
    if not model:
        raise ValueError("name the model: `model` in the body, or POST /<model>/v1/completions")
    if not protocol.is_name(model):
        raise ValueError(f"model {model!r} is not a valid name ({protocol.NAME_PATTERN})")
    return model, req.get("stream") is True


def error_response(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> web.Response:
    """An OpenAI-style error answer (`gateway.errors.error_body`)."""
    return web.json_response(error_body(status, code, message), status=status, headers=headers)
