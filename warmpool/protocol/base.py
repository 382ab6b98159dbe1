"""Field types of wire contract v1 and the bases every message is built on.

`Name`, `Count`, `Id`, `Text` and `Token` carry msgspec constraints that `warmpool.protocol.codec.decode` maps onto
rejection reasons; `Message` checks ``"v"`` and runs each type's `_validate`, `Request` adds the idempotency id and
the expiry. `_finite` and `_not_negative` are the checks msgspec's constraints cannot express. Pure: no I/O.
"""

from __future__ import annotations

import math
from typing import Annotated

import msgspec

from warmpool.protocol.names import NAME_PATTERN, VERSION

__all__ = ["Count", "Id", "Message", "Name", "Request", "Text", "Token"]

Name = Annotated[str, msgspec.Meta(pattern=NAME_PATTERN)]
Count = Annotated[int, msgspec.Meta(ge=0)]
Id = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
Text = Annotated[str, msgspec.Meta(max_length=4096)]
Token = Annotated[int, msgspec.Meta(ge=1, le=2**63 - 1)]  # a JetStream sequence number


def _finite(owner: msgspec.Struct, *fields: str) -> None:
    for f in fields:
        value = getattr(owner, f)
        if value is not None and not math.isfinite(value):
            raise ValueError(f"[non_finite] `{f}` must be a finite number")


def _not_negative(owner: msgspec.Struct, *fields: str) -> None:
    for f in fields:
        value = getattr(owner, f)
        if value is not None and value < 0:
            raise ValueError(f"[negative] `{f}` must be >= 0")


class Message(msgspec.Struct, kw_only=True, omit_defaults=False):
    """Base of every v1 message; `v` is checked on decode."""

    v: int = VERSION

    def _validate(self) -> None:
        """Subclasses add checks msgspec's constraints cannot express."""

    def __post_init__(self) -> None:
        if self.v != VERSION:
            raise ValueError(f"[bad_version] `v` is {self.v}, this consumer speaks v{VERSION}")
        self._validate()


class Request(Message, kw_only=True):
    """A request: `id` makes it idempotent, `expires_at` (Unix s) bounds how late it may be applied."""

    id: Id
    expires_at: float

    def _validate(self) -> None:
        _finite(self, "expires_at")
