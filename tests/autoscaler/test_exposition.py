"""``/metrics`` from what changed (`autoscaler.exposition`): the same text prometheus_client renders, only the series
written since the last scrape rendered again, and at 1,000 models' series a scrape neither stalls the loop nor
costs what a full render does (1.5-2.5 s of CPU here before: the bounds below only catch that pathology)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from autoscaler.endpoints import serve_http
from autoscaler.metrics import ACTIVATION_STAGES, AutoscalerMetrics

_PROCESS = ("process_", "python_")  # read afresh on every scrape: not compared


def _samples(text: bytes) -> set[tuple[str, tuple[tuple[str, str], ...], float]]:
    return {
        (s.name, tuple(sorted(s.labels.items())), s.value)
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
        if not s.name.startswith(_PROCESS)
    }


def _fleet(models: int, nodes: int = 0) -> AutoscalerMetrics:
    m = AutoscalerMetrics()
    m.agent_clock_skew.source = lambda: {f"n{i}": 0.001 * i for i in range(nodes)}
    for i in range(models):
        series = m.model(f"m{i}")
        series.desired.set(i % 3)
        series.slots["warm"].set(4)
        if i % 2:
            series.activations_ready.inc()
            for stage in ACTIVATION_STAGES:
                series.activation[stage].observe(0.01 * i)
    m.sample("accepted").inc(7)
    return m


def test_the_text_is_what_prometheus_client_renders_before_and_after_changes() -> None:
    m = _fleet(40, nodes=30)
    assert _samples(m.exposition.render_now()) == _samples(generate_latest(m.registry))
    m.model("m3").desired.set(9)
    m.model("m4").activation["load"].observe(2.0)
    m.model("m5").cold_starts.inc()
    m.forget("m6")
    m.model("new").owned.set(1)
    text = m.exposition.render_now()
    assert _samples(text) == _samples(generate_latest(m.registry))
    assert b'model="m6"' not in text and b'pulsescale_model_owned{model="new"} 1.0' in text
    # Every family once, each with its HELP and TYPE (the format wants a family's lines together).
    types = [line for line in text.decode().splitlines() if line.startswith("# TYPE ")]
    assert len(types) == len(set(types))


def test_only_what_was_written_is_rendered_again() -> None:
    m = _fleet(20)
    m.exposition.render_now()
    before = m.exposition.children_rendered
    m.exposition.render_now()
    assert m.exposition.children_rendered == before, "nothing written: nothing rendered"
    m.model("m1").desired.set(1)  # the value it holds (m1 % 3): not a change
    m.model("m2").owned.set(1)
    m.model("m2").activation["total"].observe(0.5)
    m.exposition.render_now()
    assert m.exposition.children_rendered == before + 2


async def test_a_render_cancelled_half_way_loses_no_change() -> None:
    """A scrape given up mid-render (its task cancelled) puts back the children it had not rendered: the next
    render shows every one of them (taken and dropped, 1,994 of 2,000 stayed stale until written again)."""
    m = _fleet(20)
    m.exposition.render_now()
    rendered = m.exposition.children_rendered
    m.exposition.slice_s = 0.0  # yield after every child, so the cancel lands among them
    for i in range(20):
        m.model(f"m{i}").desired.set(100 + i)
    task = asyncio.create_task(m.exposition.render())
    while m.exposition.changed.keys:  # the untracked collectors first; then the changed children are taken
        await asyncio.sleep(0)
    for _ in range(5):
        await asyncio.sleep(0)
    assert 0 < m.exposition.children_rendered - rendered < 20, "the cancel lands among the children"
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert task.cancelled()
    text = m.exposition.render_now()
    assert _samples(text) == _samples(generate_latest(m.registry))
    for i in range(20):
        assert f'pulsescale_desired_replicas{{model="m{i}"}} {100 + i}.0'.encode() in text


async def test_a_tracked_family_asked_for_by_name_is_rendered() -> None:
    """``/metrics?name[]=...`` of a per-model family gives that family, as prometheus_client's handler does (it
    gave an empty body), and leaves the other families' changes for the next full render."""
    m = _fleet(10)
    m.exposition.render_now()
    m.model("m1").desired.set(7)
    m.model("m2").owned.set(1)
    text = b"".join(await m.exposition.render(frozenset({"pulsescale_desired_replicas"})))
    assert b'pulsescale_desired_replicas{model="m1"} 7.0' in text
    assert _samples(text) == {s for s in _samples(generate_latest(m.registry)) if s[0] == "pulsescale_desired_replicas"}
    assert b'pulsescale_model_owned{model="m2"} 1.0' in m.exposition.render_now()


async def _scrape(session: aiohttp.ClientSession, port: int) -> bytes:
    async with session.get(f"http://127.0.0.1:{port}/metrics") as r:
        assert r.status == 200
        return await r.read()


class _Port:
    def __init__(self, metrics: AutoscalerMetrics) -> None:
        self.metrics = metrics

    def health(self) -> dict[str, Any]:
        return {}

    def healthy(self) -> bool:
        return True

    def ready(self) -> bool:
        return True


async def test_a_scrape_of_a_thousand_models_neither_stalls_the_loop_nor_renders_everything_again() -> None:
    m = _fleet(1000, nodes=2000)
    runner, port = await serve_http(_Port(m), "127.0.0.1", 0)
    gaps: list[float] = []
    done = asyncio.Event()

    async def probe() -> None:
        while not done.is_set():
            t0 = time.perf_counter()
            await asyncio.sleep(0.001)
            gaps.append(time.perf_counter() - t0)

    probing = asyncio.create_task(probe())
    try:
        async with aiohttp.ClientSession() as session:
            first = await _scrape(session, port)  # every series rendered: seconds of CPU, in slices
            assert b'pulsescale_desired_replicas{model="m999"} 0.0' in first
            m.model("m7").desired.set(5)
            cpu = time.process_time()
            second = await _scrape(session, port)
            cpu = time.process_time() - cpu  # the render, the send and this client's read of ~9 MB
        assert b'pulsescale_desired_replicas{model="m7"} 5.0' in second
        assert len(second) > 5_000_000
        assert cpu < 0.5, f"a scrape that changed one series took {cpu:.2f} s of CPU"
        assert max(gaps) < 0.25, f"the loop stalled {max(gaps) * 1e3:.0f} ms during the scrapes"
    finally:
        done.set()
        await probing
        await runner.cleanup()
