"""The demo's named error, in a module of its own: every part of a run raises it (`demo.run` re-exports it).

A run that cannot go on (a part did not start, the fleet never got warm, an ``--image`` that cannot be mounted) stops
with a `DemoError` whose message says what was wrong and where to look; `pulsescale demo` prints it and exits 1.
"""

from __future__ import annotations

from warmpool.errors import PulsescaleError

__all__ = ["DemoError"]


class DemoError(PulsescaleError):
    """The demo could not run (a part did not start, the fleet never got warm); the message says which and why."""
