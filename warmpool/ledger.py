"""The idempotency ledger used by the node agent's request handler and the autoscaler's command service.

A request consumer `admit`s each decoded request before applying it: an expired one is refused (`check_fresh`), and
one whose id was already applied raises `DuplicateRequest` with the first reply, answered again but not applied again.
`RequestLedger` remembers the applied ids and their replies. Consumer state, not wire contract: the contract
(`warmpool.protocol`) only says that a request's `id` makes it idempotent and its `expires_at` bounds how late it
may be applied. Pure: no I/O.
"""

from __future__ import annotations

from collections import OrderedDict

from warmpool.errors import DuplicateRequest
from warmpool.protocol import Request, check_fresh

__all__ = ["RequestLedger", "admit"]


class RequestLedger:
    """Remembers applied request ids and their replies, so a repeat is answered but not applied again.

    Bounded (oldest forgotten first) and forgetting ids whose request has expired anyway, since an expired
    repeat is refused by `check_fresh` before the ledger is asked.
    """

    def __init__(self, max_entries: int = 10_000) -> None:
        self._max = max_entries
        self._entries: OrderedDict[str, tuple[float, bytes]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def seen(self, req_id: str) -> bytes | None:
        hit = self._entries.get(req_id)
        return None if hit is None else hit[1]

    def record(self, req: Request, reply: bytes, now: float) -> None:
        self._entries[req.id] = (req.expires_at, reply)
        self._entries.move_to_end(req.id)
        while len(self._entries) > self._max:
            self._entries.popitem(last=False)
        # Expired entries can never match again (the request would be refused first); drop a few per call.
        for _ in range(2):
            oldest = next(iter(self._entries.items()), None)
            if oldest is None or oldest[1][0] >= now:
                break
            self._entries.popitem(last=False)


def admit(req: Request, now: float, ledger: RequestLedger) -> None:
    """Gate for every request consumer: refuse it if expired, and if already applied raise `DuplicateRequest`
    carrying the first reply (answered again, not applied again)."""
    check_fresh(req, now)
    previous = ledger.seen(req.id)
    if previous is not None:
        raise DuplicateRequest(req.id, previous)
