"""``/metrics`` without stalling the loop: the per-model series rendered once per change, on the loop, in slices.

At 1,000 models the registry holds ~110,000 series (the activation histogram alone is models x 6 stages x 15 lines),
and prometheus_client renders them all on every scrape: 1.5-2.5 s of CPU here (9 MB), most of a core at one scrape
a second. Rendered in a thread it still held the GIL for most of that, so the loop (samples, claims, lease
renewals) ran in the gaps the interpreter's switch interval left it.

Almost none of those series change from one scrape to the next. The families labelled by model are made of
`TrackedGauge`, `TrackedCounter` and `TrackedHistogram`: prometheus_client's own classes, whose children note
their labels in a `Changed` set when written (a gauge set to the value it holds is no change). `Exposition.render`
renders only the children noted since the last scrape, keeps each child's lines, and joins them; everything else
in the registry (process, GC, build info, the unlabelled and few-labelled series, the agents' clock skew) goes
through prometheus_client as before. The work yields to the loop every `slice_s`, so a scrape costs the loop at
most about that much at a time. The text is what `generate_latest` gives for the same registry (a test compares
them), children in the order they were first rendered.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from typing import Any, Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

__all__ = [
    "RENDER_SLICE_S",
    "Changed",
    "Exposition",
    "TrackedCounter",
    "TrackedGauge",
    "TrackedHistogram",
    "go_float",
]

RENDER_SLICE_S: Final = 0.0005
"""The longest a scrape's render runs without yielding to the loop: the daemon's `slice_s`, for the same reason
(a lease renewal or a claim waits at most about this long behind it)."""

_Key = tuple[str, tuple[str, ...]]  # (family name, the child's label values)


class Changed:
    """The children written since the last render, as (family name, label values). One event loop writes and
    renders; the set is swapped out whole by `take`, so a write during a render lands in the next one."""

    __slots__ = ("keys",)

    def __init__(self) -> None:
        self.keys: set[_Key] = set()

    def add(self, name: str, labelvalues: tuple[str, ...]) -> None:
        self.keys.add((name, labelvalues))

    def take(self) -> set[_Key]:
        keys, self.keys = self.keys, set()
        return keys


class _Tracked(MetricWrapperBase):
    """What the three tracked kinds share: the `Changed` set travels to each child through prometheus_client's
    ``_kwargs`` (which `labels()` passes on), a new child is a change, and so is a removed one."""

    _changed: Changed

    def _track(self, changed: Changed) -> None:
        self._kwargs["changed"] = changed
        self._changed = changed
        if self._labelvalues:
            changed.add(self._name, tuple(self._labelvalues))

    def _note(self) -> None:
        self._changed.add(self._name, tuple(self._labelvalues))

    def remove(self, *labelvalues: Any) -> None:
        super().remove(*labelvalues)
        self._changed.add(self._name, tuple(str(v) for v in labelvalues))

    def clear(self) -> None:
        for labelvalues in list(self._metrics):
            self._changed.add(self._name, tuple(labelvalues))
        super().clear()


class TrackedGauge(_Tracked, Gauge):
    def __init__(self, *args: Any, changed: Changed, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._track(changed)

    def set(self, value: float) -> None:
        # Most writes repeat the value (a decision that changes nothing, the owned flag every second).
        if self._value.get() != float(value):
            super().set(value)
            self._note()

    def inc(self, amount: float = 1) -> None:
        super().inc(amount)
        self._note()

    def dec(self, amount: float = 1) -> None:
        super().dec(amount)
        self._note()


class TrackedCounter(_Tracked, Counter):
    def __init__(self, *args: Any, changed: Changed, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._track(changed)

    def inc(self, amount: float = 1, exemplar: dict[str, str] | None = None) -> None:
        super().inc(amount, exemplar)
        self._note()

    def reset(self) -> None:
        super().reset()
        self._note()


class TrackedHistogram(_Tracked, Histogram):
    def __init__(self, *args: Any, changed: Changed, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._track(changed)

    def observe(self, amount: float, exemplar: dict[str, str] | None = None) -> None:
        super().observe(amount, exemplar)
        self._note()


def go_float(value: float) -> str:
    """A sample's value as the text format writes it (prometheus_client's own, untyped, function)."""
    return floatToGoString(value)  # type: ignore[no-untyped-call,no-any-return]


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _header(name: str, kind: str, documentation: str) -> bytes:
    doc = documentation.replace("\\", r"\\").replace("\n", r"\n")
    return f"# HELP {name} {doc}\n# TYPE {name} {kind}\n".encode()


_CREATED: Final = "_created"
BLOCKS: Final = 64
"""Each tracked family's children are kept in this many blocks (by model), each joined once per change: a scrape
joins only the blocks written since the last, not the whole family (the activation histogram is ~8 MB at 1,000
models, and joining it afresh cost ~10 ms a scrape here, most of it page faults on the new buffer)."""


class _Family:
    """One tracked family's rendered children, in `BLOCKS` blocks: their main lines, and their ``_created`` lines
    (which `generate_latest` puts in a gauge family of their own after the main one)."""

    __slots__ = ("blobs", "created", "created_blobs", "created_header", "header", "lines", "metric")

    def __init__(self, metric: _Tracked) -> None:
        self.metric = metric
        exposed = metric._name + "_total" if metric._type == "counter" else metric._name
        kind: str = metric._type or "untyped"
        self.header = _header(exposed, kind, metric._documentation or "")
        self.created_header = _header(metric._name + _CREATED, "gauge", metric._documentation or "")
        self.lines: list[dict[tuple[str, ...], bytes]] = [{} for _ in range(BLOCKS)]
        self.created: list[dict[tuple[str, ...], bytes]] = [{} for _ in range(BLOCKS)]
        self.blobs: list[bytes | None] = [b""] * BLOCKS  # each block joined; None: to join again
        self.created_blobs: list[bytes | None] = [b""] * BLOCKS

    def render(self, labelvalues: tuple[str, ...]) -> None:
        """(Re-)render one child's lines, or drop them when the child is gone."""
        block = hash(labelvalues[0]) % BLOCKS  # by model: str hashes are fixed for the process's life
        self.blobs[block] = self.created_blobs[block] = None
        child = self.metric._metrics.get(labelvalues)
        if child is None:
            self.lines[block].pop(labelvalues, None)
            self.created[block].pop(labelvalues, None)
            return
        base = list(zip(self.metric._labelnames, labelvalues, strict=True))
        main: list[str] = []
        created: list[str] = []
        for sample in child._child_samples():
            labels = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(base + list(sample.labels.items())))
            line = f"{self.metric._name}{sample.name}{{{labels}}} {go_float(sample.value)}\n"
            (created if sample.name == _CREATED else main).append(line)
        self.lines[block][labelvalues] = "".join(main).encode()
        if created:
            self.created[block][labelvalues] = "".join(created).encode()

    def parts(self) -> list[bytes]:
        """The family's text, as the header and the blocks (joined again where they changed)."""
        out = [self.header]
        for block, blob in enumerate(self.blobs):
            if blob is None:
                blob = self.blobs[block] = b"".join(self.lines[block].values())
            out.append(blob)
        if any(self.created):
            out.append(self.created_header)
            for block, blob in enumerate(self.created_blobs):
                if blob is None:
                    blob = self.created_blobs[block] = b"".join(self.created[block].values())
                out.append(blob)
        return [part for part in out if part]


class Exposition:
    """The registry's text exposition, its `tracked` families rendered from what changed (see the module doc)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        tracked: Iterable[_Tracked],
        changed: Changed,
        *,
        slice_s: float = RENDER_SLICE_S,
    ) -> None:
        self.registry = registry
        self.changed = changed
        self.slice_s = slice_s
        self._families = {m._name: _Family(m) for m in tracked}
        self._rendering = asyncio.Lock()
        self.children_rendered = 0
        """Children (re-)rendered since start: the work scrapes did beyond joining what was kept (tests read it)."""

    def _untracked(self, names: frozenset[str] | None = None) -> list[Collector]:
        """The registry's other collectors (those exposing one of `names`, when given). prometheus_client has no
        public list of them; its private one has kept its name for years, and without it every collector is
        rendered the slow way (nothing is skipped)."""
        with self.registry._lock:
            collectors = dict(getattr(self.registry, "_collector_to_names", {}))
        tracked = {id(f.metric) for f in self._families.values()}
        return [
            c
            for c, exposed in collectors.items()
            if id(c) not in tracked and (names is None or not names.isdisjoint(exposed))
        ]

    def _render_changed(self, name: str, labelvalues: tuple[str, ...]) -> None:
        family = self._families.get(name)
        if family is not None:
            family.render(labelvalues)
            self.children_rendered += 1

    def _named(self, names: frozenset[str]) -> list[bytes]:
        """A few families by name (a bench polling a counter): untracked ones rendered as prometheus_client would,
        tracked ones from what is kept (their changed children rendered first; other families' stay pending)."""
        parts = [chunk for collector in self._untracked(names) for chunk in _text(collector)]
        with self.registry._lock:
            exposes = dict(getattr(self.registry, "_collector_to_names", {}))
        wanted = {
            name for name, family in self._families.items() if not names.isdisjoint(exposes.get(family.metric, ()))
        }
        if wanted:
            pending = self.changed.take()
            for name, labelvalues in pending:
                if name in wanted:
                    self._render_changed(name, labelvalues)
            self.changed.keys.update(key for key in pending if key[0] not in wanted)
            for name in wanted:
                parts += self._families[name].parts()
        return parts

    def render_now(self) -> bytes:
        """The whole text in one go (no yielding): for callers outside a loop, and tests."""
        parts = [chunk for collector in self._untracked() for chunk in _text(collector)]
        for name, labelvalues in self.changed.take():
            self._render_changed(name, labelvalues)
        for family in self._families.values():
            parts += family.parts()
        return b"".join(parts)

    async def render(self, names: frozenset[str] | None = None) -> list[bytes]:
        """The whole text as parts to send one after another (not joined: at 1,000 models that is a 9 MB copy),
        yielding to the loop every `slice_s` of work. One render at a time: a second scrape waits for the first,
        then renders what changed meanwhile. `names` (a scrape's ``name[]``, as prometheus_client's own handler
        takes them): only the families exposing one of these sample names."""
        if names is not None:
            return self._named(names)
        async with self._rendering:
            parts: list[bytes] = []
            until = time.perf_counter() + self.slice_s

            async def pace() -> None:
                nonlocal until
                if time.perf_counter() >= until:
                    await asyncio.sleep(0)
                    until = time.perf_counter() + self.slice_s

            for collector in self._untracked():
                for chunk in _text(collector):
                    parts.append(chunk)
                    await pace()
            pending = list(self.changed.take())
            try:
                while pending:
                    name, labelvalues = pending.pop()
                    self._render_changed(name, labelvalues)
                    await pace()
            finally:
                # A render cancelled half way (a scrape given up) puts back what it had not rendered yet: taken out
                # of the set, those children would stay stale until written again.
                self.changed.keys.update(pending)
            for family in self._families.values():
                parts += family.parts()
                await pace()
            return parts


def _text(collector: Collector) -> Iterable[bytes]:
    """One untracked collector's text: its own `render_text` (chunks) where it has one (`metrics.AgentClockSkew`),
    else prometheus_client's."""
    render = getattr(collector, "render_text", None)
    if render is not None:
        return render()  # type: ignore[no-any-return]
    return (generate_latest(_One(collector)),)


class _One:
    """One collector as `generate_latest` takes a registry."""

    __slots__ = ("collector",)

    def __init__(self, collector: Collector) -> None:
        self.collector = collector

    def collect(self) -> Iterable[Any]:
        return self.collector.collect()
