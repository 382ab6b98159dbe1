"""The ``pulsescale`` console script's first module: Ctrl-C while the CLI is still importing ends as it does later.

Python's own SIGINT handler raises KeyboardInterrupt wherever it lands, and before `pulsescale.cli.main` runs that is
inside an import (``typing``, ``asyncio``, ``nats``): a 20-line traceback for a Ctrl-C typed within the first few
hundred milliseconds. This module imports nothing of ours and takes SIGINT as its first statement (it is only ever
imported as the console script's or ``python -m pulsescale``'s entry); once the CLI is imported it hands SIGINT back
to Python, and `pulsescale.cli.main` turns it into its one line and exit 130 from there on. What Python does before
any module of ours runs (its start-up and ``site``, ~0.1 s) is not ours to catch.
"""

import _signal  # the C module under `signal`: `signal` itself builds enums, a first import of 50 ms to be Ctrl-C'd in
import os


def _interrupted_while_starting(signum: int, frame: object) -> None:
    # Nothing has started yet (no connection, no file, no child): leave at once, without unwinding an import.
    os.write(2, b"pulsescale: interrupted\n")
    os._exit(130)  # `pulsescale.cli.EXIT_INTERRUPTED`, which is not imported yet


_signal.signal(_signal.SIGINT, _interrupted_while_starting)

import signal  # noqa: E402  (after the handler: every import from here on is covered)
import sys  # noqa: E402


def main() -> int:
    try:
        from pulsescale import cli

        signal.signal(signal.SIGINT, signal.default_int_handler)
        return cli.main(sys.argv[1:])
    except KeyboardInterrupt:  # between the hand-back and `cli.main`'s own handler
        print("pulsescale: interrupted", file=sys.stderr)
        return 130
