"""One call of the official `kubernetes` client, off the event loop, answered as the API server's JSON.

The client is synchronous (urllib3) and deserialises into pydantic models with snake_case attributes; the parts of
the operator (standby pods, the cold path, the Lease) reason about objects as Kubernetes writes them, camelCase
dicts, which is also what they send back in patches. `call` runs the call on a worker thread and turns the model
back into that JSON (`ApiClient.sanitize_for_serialization`: camelCase keys, RFC 3339 times).

Errors: the API server's answers stay `ApiException` (``.status``: 404, 409, ...); a server that cannot be reached
is `ApiUnreachable` (urllib3's errors, which are not `OSError`).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any

import urllib3.exceptions
from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException

__all__ = ["ApiException", "ApiUnreachable", "MERGE_PATCH", "call", "status_of"]

ApiUnreachable = urllib3.exceptions.HTTPError
"""Connection refused, timed out, reset: the API server did not answer at all."""

MERGE_PATCH = "application/merge-patch+json"
"""RFC 7386, what ``kubectl patch --type merge`` sends: maps merge, null deletes. Used for every patch here."""

_SERIALIZER = ApiClient()


async def call(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """Run `fn(*args, **kwargs)` (a `kubernetes` client method) on a worker thread; its result as a JSON dict."""
    result = await asyncio.to_thread(functools.partial(fn, *args, **kwargs))
    out = _SERIALIZER.sanitize_for_serialization(result)  # type: ignore[no-untyped-call]
    return out if isinstance(out, dict) else {}


def status_of(err: BaseException) -> int | None:
    """The HTTP status of an API server's refusal, None for anything else."""
    return err.status if isinstance(err, ApiException) else None
