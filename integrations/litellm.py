"""pulsescale's LiteLLM proxy hook: publishes each model's queue depth and in-flight requests, as seen from inside
the proxy, as the contract's `QueueSample` (docs/litellm.md). In the proxy's ``config.yaml``::

    litellm_settings:
      callbacks: integrations.litellm.handler

`handler` is made from the environment (`integrations.settings`) when LiteLLM first asks for it. What each of
LiteLLM's hooks means here:

- ``async_pre_call_hook``: the request entered the proxy (after authentication): an arrival, queued.
- ``async_pre_call_deployment_hook``: LiteLLM picked a backend and is sending the request there: in flight. Until
  then it waited in LiteLLM (its routing, its parallel-request limits and its scheduler's queue).
- ``async_post_call_success_hook``, ``async_log_success_event``: answered (a stream, when it ended).
- ``async_post_call_failure_hook``, ``async_log_failure_event``: failed; a timeout when LiteLLM says so (408/504).

LiteLLM may report an end twice; the first report counts. Each hook only counts (no await, nothing raised) and
returns None, so the request goes on unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from litellm.integrations.custom_logger import CustomLogger

from integrations.demand import Outcome
from integrations.hook import DemandHook
from integrations.settings import HookSettings

__all__ = ["PulsescaleCallback"]  # and `handler`, made on first use (`__getattr__`)

_TIMEOUT_STATUS: Final = frozenset({408, 504})


class PulsescaleCallback(CustomLogger):  # type: ignore[misc]  # litellm is untyped where mypy runs
    """The hook (module doc). `settings` default to the environment's; `demand` is the engine, for tests."""

    def __init__(self, settings: HookSettings | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.demand = DemandHook(settings or HookSettings.from_env())
        self.demand.start()  # inside LiteLLM's loop when it loads the config; else at the first request

    # LiteLLM calls a proxy pre-call hook only when the class itself defines it, hence no mixin.
    async def async_pre_call_hook(self, user_api_key_dict: Any, cache: Any, data: Any, call_type: Any) -> None:
        if isinstance(data, Mapping):
            self.demand.arrived(data.get("litellm_call_id"), data.get("model"))

    async def async_pre_call_deployment_hook(self, kwargs: Any, call_type: Any) -> None:
        self.demand.dispatched(_call_id(kwargs))

    async def async_post_call_success_hook(self, data: Any, user_api_key_dict: Any, response: Any) -> None:
        self.demand.ended(_call_id(data), "completed")

    async def async_post_call_failure_hook(
        self, request_data: Any, original_exception: Any, user_api_key_dict: Any, traceback_str: Any = None
    ) -> None:
        self.demand.ended(_call_id(request_data), _outcome(original_exception))

    async def async_log_success_event(self, kwargs: Any, response_obj: Any, start_time: Any, end_time: Any) -> None:
        self.demand.ended(_call_id(kwargs), "completed")

    async def async_log_failure_event(self, kwargs: Any, response_obj: Any, start_time: Any, end_time: Any) -> None:
        exception = kwargs.get("exception") if isinstance(kwargs, Mapping) else None
        self.demand.ended(_call_id(kwargs), _outcome(exception))


def _call_id(data: object) -> object:
    return data.get("litellm_call_id") if isinstance(data, Mapping) else None


def _outcome(err: object) -> Outcome:
    """A timeout when LiteLLM's exception says so (``litellm.Timeout`` is a 408; a gateway timeout a 504)."""
    if isinstance(err, TimeoutError) or getattr(err, "status_code", None) in _TIMEOUT_STATUS:
        return "timeout"
    return "failed"


_handler: PulsescaleCallback | None = None


def __getattr__(name: str) -> object:
    # Made on first use, not at import: reading the environment and starting tasks belong to the proxy's start.
    global _handler
    if name == "handler":
        if _handler is None:
            _handler = PulsescaleCallback()
        return _handler
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
