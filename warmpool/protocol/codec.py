"""Encoding and decoding of wire contract v1, and the request freshness check.

`decode` enforces every rule of DESIGN.md ("Wire contract v1") and raises `BadMessage` with one of `REASONS`, so
consumers count rejections by reason and keep going; `encode` refuses to emit what our own consumers would refuse as
too large. One decoder per type is built on first use and kept (`_decoders`). `check_fresh` refuses a request past
its expiry or valid for too long. Pure: no I/O.
"""

from __future__ import annotations

import re
from typing import Any, Final, TypeVar

import msgspec

from warmpool.errors import BadMessage
from warmpool.protocol.base import Message, Request
from warmpool.protocol.names import MAX_MESSAGE_BYTES, MAX_REQUEST_TTL_S

__all__ = ["check_fresh", "decode", "encode"]

# --- encode / decode --------------------------------------------------------------------------------------------------

_encoder: Final = msgspec.json.Encoder()
_decoders: dict[type, msgspec.json.Decoder[Any]] = {}
_object_decoder: Final = msgspec.json.Decoder(dict[str, Any])
M = TypeVar("M", bound=msgspec.Struct)

# msgspec's messages are stable within a major version; this maps them onto our reasons.
_NON_FINITE_TOKEN: Final = re.compile(rb"(?<![\w\"])-?(NaN|Infinity)(?![\w\"])")
_REASON_TAG: Final = re.compile(r"^\[(\w+)\] ")
_NEGATIVE: Final = re.compile(r"^Expected `(int|float)` >= [01](\.0)?( |$)")  # a count's floor; other floors: bad_value


def encode(msg: msgspec.Struct) -> bytes:
    """Encode a message; refuses to emit something our own consumers would reject as too large."""
    data = _encoder.encode(msg)
    if len(data) > MAX_MESSAGE_BYTES:
        raise BadMessage("too_large", f"{type(msg).__name__} encodes to {len(data)} bytes > {MAX_MESSAGE_BYTES}")
    return data


def _reason_for(err: msgspec.ValidationError) -> BadMessage:
    text = str(err)
    tagged = _REASON_TAG.match(text)
    if tagged:
        return BadMessage(tagged.group(1), text[tagged.end() :])
    if text.startswith("Object missing required field `v`"):
        return BadMessage("bad_version", '`v` is missing; send "v": 1')
    if text.startswith("Object missing required field"):
        return BadMessage("missing_field", text)
    if text.startswith("Expected `object`"):
        return BadMessage("not_object", text)
    if "matching regex" in text:
        return BadMessage("bad_name", text + " (names are lowercase letters, digits, '-' and '_', no dots)")
    if text.startswith("Number out of range"):
        return BadMessage("non_finite", text)
    if _NEGATIVE.match(text):
        return BadMessage("negative", text)
    if "at `$.v`" in text:
        return BadMessage("bad_version", text)
    if text.startswith("Expected `") and ", got `" in text:
        return BadMessage("wrong_type", text)
    return BadMessage("bad_value", text)


def _check_size(data: bytes) -> None:
    if len(data) > MAX_MESSAGE_BYTES:
        raise BadMessage("too_large", f"{len(data)} bytes > {MAX_MESSAGE_BYTES}")


def _decode_object(data: bytes) -> dict[str, Any]:
    _check_size(data)
    try:
        return _object_decoder.decode(data)
    except msgspec.ValidationError as err:
        raise BadMessage("not_object", str(err)) from None
    except msgspec.DecodeError as err:
        raise _bad_json(data, err) from None


def _bad_json(data: bytes, err: msgspec.DecodeError) -> BadMessage:
    if _NON_FINITE_TOKEN.search(data):
        return BadMessage("non_finite", "NaN and Infinity are not JSON numbers")
    return BadMessage("bad_json", str(err))


def decode(data: bytes, type_: type[M]) -> M:
    """Decode and validate one v1 message, or raise `BadMessage` with a reason from `REASONS`."""
    _check_size(data)
    dec = _decoders.get(type_)
    if dec is None:
        dec = _decoders[type_] = msgspec.json.Decoder(type_)
    try:
        msg = dec.decode(data)
    except msgspec.ValidationError as err:
        raise _reason_for(err) from None
    except msgspec.DecodeError as err:
        raise _bad_json(data, err) from None
    # `v` has a default so code can build messages without it, but on the wire it is required. A decoded
    # message with no `"v"` token anywhere cannot have carried it (the check costs no second parse).
    if isinstance(msg, Message) and b'"v"' not in data:
        raise BadMessage("bad_version", '`v` is missing; send "v": 1')
    return msg  # type: ignore[no-any-return]


# --- request freshness ---------------------------------------------------------------------------------------------


def check_fresh(req: Request, now: float) -> None:
    """Refuse a request past its expiry (nats-py replays buffered publishes after a reconnect, possibly late), and
    one that would stay valid for more than `MAX_REQUEST_TTL_S`: every admitted request expires soon, so a replay
    is refused and the ledger forgets it in bounded time."""
    if now > req.expires_at:
        raise BadMessage("expired", f"request {req.id} expired {now - req.expires_at:.3f} s ago")
    if req.expires_at > now + MAX_REQUEST_TTL_S:
        raise BadMessage(
            "too_late",
            f"request {req.id} expires {req.expires_at - now:.0f} s from now; at most {MAX_REQUEST_TTL_S:.0f} s "
            "is accepted (check the sender's clock)",
        )
