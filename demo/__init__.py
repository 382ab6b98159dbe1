"""`pulsescale demo`: the article's surge end to end on one machine, live, with a report of what it measured.

`run_demo(settings, view)` runs it (`demo.run`, which composes the parts: `fleet` starts and stops the processes and
the cold path, `rootfs_stage` the EROFS image and its page-cache keeper, `model` the generated weights, `recorder` what
the run measures); `DemoSettings` says what runs (`demo.settings`); `report` turns what a run recorded into
report.json (with `measures`: what the pulse cost, from every request and the autoscaler's events); `table` prints
the article's table and that cost; `plot` draws the PNG; `view` is the live terminal view.
"""

from demo.run import DemoError, DemoResult, run_demo
from demo.settings import DemoSettings

__all__ = ["DemoError", "DemoResult", "DemoSettings", "run_demo"]
