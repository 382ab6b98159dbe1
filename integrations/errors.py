"""The hook's named errors. Pure: no I/O."""

from __future__ import annotations

from warmpool.errors import BadInput

__all__ = ["BadHookSetting"]


class BadHookSetting(BadInput):
    """An environment variable (or a `HookSettings` field) the hook cannot use; the message names it, what it
    holds and what it takes. Raised when the proxy loads the hook, so a typo stops the deploy that made it rather
    than leaving a proxy that silently publishes nothing."""

    code = "bad_hook_setting"

    def __init__(self, name: str, value: str, wanted: str) -> None:
        self.name = name
        self.value = value
        super().__init__(f"{name}={value!r}: {wanted}")
