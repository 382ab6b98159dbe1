"""What can be wrong with a source, by name: each reason is a label of ``pulsescale_bridge_errors_total`` and is
counted per source; none of them stops the daemon.

Most reasons fail the whole scrape or query (nothing from it is used, so the models it feeds age towards their
staleness bound). Two do not (`KEPT`): a ``counter_reset`` is noted and the reading used (the bridge's own
counters stay monotonic), and a ``bad_model_name`` drops only the series that carry such a name. Pure: no I/O.
"""

from __future__ import annotations

from typing import Final, Literal, get_args

from warmpool.errors import PulsescaleError

__all__ = ["KEPT", "REASONS", "Reason", "SourceError"]

Reason = Literal[
    "unreachable",  # connection refused or reset, no such host
    "timeout",  # no full answer within the scrape timeout
    "http_status",  # an HTTP status other than 200
    "too_large",  # a body over the size bound (a wrong URL serving a file)
    "bad_body",  # not Prometheus text, not the query API's JSON, not UTF-8
    "query_error",  # the Prometheus server answered the query with an error (bad PromQL, its own timeout)
    "no_series",  # the page or query has none of the series the model needs
    "several_series",  # a query returned more than one series: which is the demand is ambiguous
    "not_finite",  # NaN or +-Inf
    "bad_value",  # a negative count, or one beyond 2**53
    "bad_model_name",  # a model_name that is not a pulsescale name and that no --model-name maps
    "counter_reset",  # a finished-requests counter went down (the engine restarted): noted, the reading used
    "internal",  # a bug, caught and survived; the log has the exception
]
REASONS: Final[tuple[str, ...]] = get_args(Reason)
KEPT: Final = frozenset({"counter_reset", "bad_model_name"})
"""Reasons that do not fail the scrape they were found in."""


class SourceError(PulsescaleError):
    """A scrape or query whose answer cannot be used (or, for `KEPT` reasons, a part of it); `reason` is one of
    `REASONS`."""

    code = "bad_source"

    def __init__(self, reason: Reason, detail: str = "") -> None:
        self.reason: Reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}" if detail else reason)
