"""Rejected messages: counted by reason, logged at a bounded rate, never fatal.

A gateway with a bug can send thousands of bad samples a second; the consumer must keep going, the operator
must see each kind of problem promptly, and the log must not drown. So: the first rejection of each reason is
logged at once, later ones at most once per `interval_s` with how many were suppressed.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable

from warmpool.errors import BadMessage

__all__ = ["Rejections"]


class Rejections:
    def __init__(
        self,
        logger: logging.Logger,
        *,
        interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        on_reject: Callable[[str], None] | None = None,
    ) -> None:
        self.log = logger
        self.interval_s = interval_s
        """Per reason, at most one log line per this many seconds: long enough to keep a flood readable."""
        self.clock = clock
        self.on_reject = on_reject
        """Hook for a metric (`pulsescale_rejected_messages_total{reason}`), bound by the daemon that owns it."""
        self.counts: Counter[str] = Counter()
        self._last_logged: dict[str, float] = {}
        self._suppressed: Counter[str] = Counter()

    def __call__(self, err: BadMessage, *, source: str) -> None:
        reason = err.reason
        self.counts[reason] += 1
        if self.on_reject is not None:
            self.on_reject(reason)
        now = self.clock()
        last = self._last_logged.get(reason)
        if last is not None and now - last < self.interval_s:
            self._suppressed[reason] += 1
            return
        more = self._suppressed.pop(reason, 0)
        self._last_logged[reason] = now
        suffix = f" ({more} more {reason} rejection(s) since the last report)" if more else ""
        self.log.warning("rejected message from %s: %s%s", source, err, suffix)

    def total(self) -> int:
        return sum(self.counts.values())
