"""`pulsescale bridge --scaledobjects`: read what the ScaledObjects' triggers name, followed in KV `pulse_scalers`.

Contract revision 14: a trigger's ``metadata.source`` says who publishes its model's demand. ``gateway`` (or none):
the gateways push it, and the bridge reads nothing for it. ``vllm-metrics``: the engines' pages, those of
``metricsURL`` (every series counted for the trigger's model), else each ready slot of the model (its endpoint plus
``--slot-metrics-path``, found by the bridge's `gateway.routes.Routes`). ``prometheus``: ``query`` asked of
``serverAddress``. `ScalerSources` follows the bucket read only, as the gateway does (`warmpool.buckets.follow_bucket`
and a `BucketView`: a snapshot, then changes, re-listed after a reconnect), and keeps the bridge's `Sources` in line:
a model's sources are added when a record asks for them and removed when it changes to ``gateway``, names other
sources, or is deleted. Each source carries its ScaledObject (`Source.scaler`), so ``/healthz`` says where every
model's demand comes from.

The flags (and --config) win: a model that a flag reads (`BridgeSettings.flagged`: a ``--query``, a bound
``--target``, ``--slots``) or that ``--models`` leaves out is not read for its ScaledObject; the bridge logs that
and shows it (`health`). Two sources of one model would add up.

A record whose source block breaks the rules (`protocol.TriggerMetadata.source_problem`: an unknown source, a
parameter of another source, ``prometheus`` without ``serverAddress`` or ``query``, a URL that is not http(s); a
writer that skipped the validator, or a later revision's source) is counted ``bad_source`` (`Rejections`, so
``pulsescale_bridge_rejected_records_total``) and logged naming the key; that ScaledObject's last good block stands,
as a record that does not decode at all leaves the last good one (`BucketView` ``keep_bad``). A second ScaledObject
of a model already read is counted ``bad_value`` once and not read (the autoscaler serves one per model too).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

from nats.aio.client import Client

from bridge.settings import BridgeSettings, metrics_page
from bridge.sources import Source, Sources
from warmpool import buckets, protocol
from warmpool.bucketview import BucketView, Changed, Removed, Snapshot, ViewEvent
from warmpool.errors import BadMessage
from warmpool.protocol import ScalerRecord
from warmpool.rejects import Rejections

__all__ = ["ScalerSources", "ScalersState", "Wanted", "wanted"]

log = logging.getLogger("pulsescale.bridge")

ScalersState = Literal["listing", "listed", "absent", "unreadable"]
"""How far `pulse_scalers` has been read: not yet, followed, no bucket (no ScaledObject anywhere), no answer (this
NATS user may not read it, or JetStream is down)."""


@dataclass(frozen=True)
class Wanted:
    """What one ScaledObject's trigger asks the bridge to read for its model."""

    scaler: str
    """The ScaledObject, ``<namespace>.<name>``."""
    model: str
    source: Literal["vllm-metrics", "prometheus"]
    pages: tuple[str, ...] = ()
    """``vllm-metrics``: the pages of ``metricsURL`` (a URL without a path: ``/metrics``); empty: the ready slots."""
    server: str = ""
    """``prometheus``: ``serverAddress``."""
    promql: str = ""
    """``prometheus``: ``query``."""

    @property
    def slots(self) -> bool:
        """The model's ready slots are its pages."""
        return self.source == "vllm-metrics" and not self.pages

    def describe(self) -> str:
        if self.source == "prometheus":
            return f"{self.server}'s answer to {self.promql!r}"
        return ", ".join(self.pages) if self.pages else "the model's ready slots"


def wanted(record: ScalerRecord) -> Wanted | None:
    """What `record` asks the bridge to read; None when the gateways push its demand (``source: gateway``, or
    none). A source block that breaks revision 14's rules raises `BadMessage` ``bad_source``, naming the key."""
    problem = record.spec.source_problem()
    if problem is not None:
        path, detail = problem
        raise BadMessage("bad_source", f"spec.{path}: {detail}")
    meta = record.spec.triggers[0].metadata  # every trigger reads the same source (`source_problem`)
    kind, model = meta.source_kind, record.spec.model
    if kind == "prometheus":
        given = meta.parameters()
        return Wanted(record.key, model, "prometheus", server=given["serverAddress"], promql=given["query"].strip())
    if kind == "vllm-metrics":
        return Wanted(record.key, model, "vllm-metrics", pages=tuple(metrics_page(u) for u in meta.metrics_urls()))
    return None


class ScalerSources:
    """The sources the ScaledObjects name (module doc), kept in `sources`. `slot_ready`/`slot_gone` are the
    bridge's `Routes` callbacks for the models whose ready slots no flag reads; `ready_slots(model)` gives the
    model's ready slots now (slot key -> endpoint)."""

    def __init__(
        self,
        nc: Client,
        settings: BridgeSettings,
        sources: Sources,
        rejected: Rejections,
        *,
        ready_slots: Callable[[str], Mapping[str, str]],
        retry_s: float = 2.0,
        open_timeout_s: float = 2.0,
    ) -> None:
        self._nc = nc
        self._settings = settings
        self._sources = sources
        self._rejected = rejected
        self._ready_slots = ready_slots
        self._retry_s = retry_s
        self._open_timeout_s = open_timeout_s
        self.state: ScalersState = "listing"
        self.listed = asyncio.Event()
        """Set once the first listing of the bucket is applied."""
        self.view: BucketView[ScalerRecord] | None = None
        self.asked: dict[str, Wanted | None] = {}
        """Per ScaledObject key, what its trigger asks (None: the gateways push its demand). A key whose latest
        record broke the rules keeps what its last good one asked."""
        self.in_force: dict[str, Wanted] = {}
        """Per model, the ScaledObject's source the bridge answers: one per model, the first it saw."""
        self.held: dict[str, str] = {}
        """Per model of `in_force`, why its source is not read (a flag reads the model; --models leaves it out)."""
        self._owned: dict[str, set[str]] = {}
        """Per model, the ids of the sources added for its ScaledObject; the flags' own are never removed here."""
        self._judged: dict[str, ScalerRecord] = {}
        """Per key, the record last judged: a re-list brings the same records again, judged (and counted) once."""
        self._told: set[tuple[str, str]] = set()
        """(key, the key whose source is read for its model): a second ScaledObject of a model, counted once."""

    # --- following the bucket --------------------------------------------------------------------------------------

    def _state(self, state: buckets.OpenState, why: str = "") -> None:
        if state == self.state:
            return
        if state == "unreadable":
            log.warning(
                "cannot read %s (%s): no ScaledObject's source is read until it is; give this bridge's NATS user KV "
                "reads of %s (the gateway role has them)",
                protocol.SCALERS_BUCKET,
                why,
                protocol.SCALERS_BUCKET,
            )
        elif state == "absent":
            log.info("bucket %s does not exist (yet): no ScaledObject names a source", protocol.SCALERS_BUCKET)
        self.state = state

    async def run(self, stop: asyncio.Event) -> None:
        def on_view(view: BucketView[ScalerRecord]) -> None:
            self.view = view

        def on_event(_: BucketView[ScalerRecord], event: ViewEvent[ScalerRecord]) -> None:
            try:
                self.apply(event)
            except Exception:  # a bug here must not stop the bridge: the sources read now stand
                log.exception("%s: a change could not be applied", protocol.SCALERS_BUCKET)

        await buckets.follow_view(
            self._nc, protocol.SCALERS_BUCKET, ScalerRecord, self._rejected, stop,
            on_state=self._state, on_view=on_view, on_event=on_event, keep_bad=True, name="bridge-scaledobjects-view",
            retry_s=self._retry_s, open_timeout_s=self._open_timeout_s,
        )  # fmt: skip

    def apply(self, event: Snapshot[ScalerRecord] | Changed[ScalerRecord] | Removed) -> None:
        """One event of the view: a `Snapshot` is every record (replace, don't merge)."""
        if isinstance(event, Snapshot):
            for key in self.asked.keys() - event.records.keys():
                self._forget(key)
            for key, record in event.records.items():
                self._judge(key, record)
            if self.state != "listed":
                self.state = "listed"
                log.info(
                    "following %s: %d ScaledObject(s), %d naming a source the bridge reads",
                    protocol.SCALERS_BUCKET,
                    len(event.records),
                    sum(w is not None for w in self.asked.values()),
                )
            self.listed.set()
        elif isinstance(event, Changed):
            self._judge(event.key, event.record)
        else:
            self._forget(event.key)
        self._reconcile()

    def _judge(self, key: str, record: ScalerRecord) -> None:
        if self._judged.get(key) == record:
            return
        self._judged[key] = record
        try:
            self.asked[key] = wanted(record)
        except BadMessage as err:
            self._rejected(err, source=f"{protocol.SCALERS_BUCKET}/{key}")  # its last good block stands

    def _forget(self, key: str) -> None:
        self.asked.pop(key, None)
        self._judged.pop(key, None)
        self._told = {told for told in self._told if key not in told}

    # --- the sources -----------------------------------------------------------------------------------------------

    def _reconcile(self) -> None:
        """Make the sources read for the ScaledObjects what `asked` says: one ScaledObject per model, the one already
        read first (as the autoscaler serves the first it saw), then in the order they came."""
        desired: dict[str, Wanted] = {}

        def reading(key: str) -> bool:
            w = self.asked[key]
            return w is not None and (cur := self.in_force.get(w.model)) is not None and cur.scaler == key

        for key in sorted(self.asked, key=lambda k: not reading(k)):
            w = self.asked[key]
            if w is None:
                continue
            first = desired.setdefault(w.model, w)
            if first is not w and (key, first.scaler) not in self._told:
                self._told.add((key, first.scaler))
                self._rejected(
                    BadMessage("bad_value", f"{key} names model {w.model}, whose source is read for {first.scaler}"),
                    source=f"{protocol.SCALERS_BUCKET}/{key}",
                )
        for model in sorted(self.in_force.keys() | desired.keys()):
            old, new = self.in_force.get(model), desired.get(model)
            if old == new:
                continue
            if old is not None:
                self._stop(old)
            if new is not None:
                self._start(new)

    def _why_held(self, model: str) -> str | None:
        flag = self._settings.flagged(model)
        if flag is not None:
            return f"{flag} reads it (the flags win over pulse_scalers)"
        if self._settings.models is not None and model not in self._settings.models:
            return "--models leaves it out"
        return None

    def _start(self, w: Wanted) -> None:
        self.in_force[w.model] = w
        why = self._why_held(w.model)
        if why is not None:
            self.held[w.model] = why
            log.warning("ScaledObject %s: %s for %s is not read: %s", w.scaler, w.describe(), w.model, why)
            return
        log.info("ScaledObject %s: reading %s for %s", w.scaler, w.describe(), w.model)
        s = self._settings
        if w.source == "prometheus":
            every, stale = s.query_every_s, s.query_stale_after_s
            self._add(Source(f"query:{w.model}", "query", w.server, w.model, every, stale, w.promql, scaler=w.scaler))
        elif w.pages:
            for page in w.pages:
                self._add(Source(page, "target", page, w.model, s.scrape_every_s, s.stale_after_s, scaler=w.scaler))
        else:
            for key, endpoint in sorted(self._ready_slots(w.model).items()):
                self.slot_ready(w.model, key, endpoint)

    def _stop(self, w: Wanted) -> None:
        del self.in_force[w.model]
        if self.held.pop(w.model, None) is not None:
            return
        for source_id in sorted(self._owned.pop(w.model, set())):
            self._sources.remove(source_id)
        log.info("ScaledObject %s: no longer reading %s for %s", w.scaler, w.describe(), w.model)

    def _add(self, source: Source) -> None:
        assert source.model is not None
        if self._sources.add(source):
            self._owned.setdefault(source.model, set()).add(source.id)
        else:
            log.info("ScaledObject %s: %s is read already (a flag names it); read once", source.scaler, source.url)

    def slot_ready(self, model: str, key: str, endpoint: str) -> None:
        """The slot `key` of `model` is ready at `endpoint`: read its page if the model's ScaledObject asks for its
        ready slots (a slot at a new endpoint is read there from now on)."""
        w = self.in_force.get(model)
        if w is None or not w.slots or model in self.held:
            return
        s = self._settings
        page = endpoint + s.slot_metrics_path
        old = self._sources.by_id.get(key)
        if old is not None and old.url == page:
            return
        self.slot_gone(model, key)
        self._add(Source(key, "slot", page, model, s.scrape_every_s, s.stale_after_s, scaler=w.scaler))

    def slot_gone(self, model: str, key: str) -> None:
        owned = self._owned.get(model)
        if owned is not None and key in owned:
            owned.discard(key)
            self._sources.remove(key)

    # --- views -------------------------------------------------------------------------------------------------------

    def health(self) -> dict[str, object]:
        """The bucket's state and, per model a ScaledObject names a source for, what is read for it, or why not."""
        return {
            "bucket": self.state,
            "models": {
                model: {
                    "scaledobject": w.scaler,
                    "source": w.source,
                    "reads": w.describe(),
                    "held": self.held.get(model),
                    "sources": sorted(self._owned.get(model, ())),
                }
                for model, w in sorted(self.in_force.items())
            },
        }
