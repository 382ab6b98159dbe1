"""Running the operator: kopf's settings and registry, kopf on its own loop in a thread, bridged to the caller's.

`run_operator` is what `pulsescale operator` (kube/cli.py) runs while it leads: `build_registry` registers the
ScaledObject handlers (`kube.operator.ScaledObjects`) and those of the optional parts (kube.standby, kube.coldpath),
`build_settings` sets kopf up for pulsescale (no peering, no scanning, progress in annotations; the module
docstring of `kube.operator` says why), and `bridge` sends every handler back to the caller's loop, which owns the
NATS connection. Split from `kube.operator` (the ScaledObjects' handlers and their loops).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import importlib
import inspect
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import kopf

from kube.context import OperatorContext, kopf_connection
from kube.operator import (
    BACKGROUND,
    BACKGROUND_STOP_S,
    FINALIZER,
    OPTIONAL_PARTS,
    PROGRESS_PREFIX,
    READY_POLL_S,
    ScaledObjects,
)
from manifests.crdtypes import GROUP, PLURAL, VERSION

__all__ = ["bridge", "build_registry", "build_settings", "run_operator"]

log = logging.getLogger("pulsescale.operator")  # the operator's log, as before the split


def build_settings(ctx: OperatorContext) -> kopf.OperatorSettings:
    """kopf's settings for pulsescale (see the module docstring)."""
    settings = kopf.OperatorSettings()
    settings.peering.standalone = True
    settings.peering.mandatory = False
    settings.scanning.disabled = True
    settings.posting.enabled = False
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=PROGRESS_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=PROGRESS_PREFIX, key="last-handled-configuration"
    )
    settings.watching.server_timeout = 300  # the API server closes a watch after this; kopf re-opens it
    settings.watching.client_timeout = 330
    settings.networking.request_timeout = 30
    settings.networking.error_backoffs = (0.5, 1, 2, 5)  # API errors: retry soon (a lost lease stops it anyway)
    settings.execution.max_workers = 4  # for kopf's own sync work; handlers here are async
    settings.process.ultimate_exiting_timeout = None  # kopf would SIGKILL the process if its shutdown hangs
    return settings


def build_registry(ctx: OperatorContext) -> kopf.OperatorRegistry:
    """The handlers of every part: ScaledObjects here, then ``register(registry, ctx)`` of kube.standby and
    kube.coldpath when those modules exist. The `ScaledObjects` instance is kept in ``ctx.extra["scaledobjects"]``
    (its loops run in `run_operator`).

    Handlers are written as plain async kopf handlers of the caller's event loop (the one that owns ``ctx.nc``):
    `run_operator` runs kopf on its own loop in a thread and `bridge` makes every handler run on the caller's."""
    registry = kopf.OperatorRegistry()
    so = ScaledObjects(ctx)
    ctx.extra["scaledobjects"] = so

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return kopf_connection(ctx.api)

    resource = (GROUP, VERSION, PLURAL)
    kopf.on.resume(*resource, registry=registry)(so.on_change)
    kopf.on.create(*resource, registry=registry)(so.on_change)
    kopf.on.update(*resource, registry=registry)(so.on_change)
    kopf.on.delete(*resource, registry=registry)(so.on_delete)
    kopf.on.event(*resource, registry=registry)(so.on_event)

    for part in OPTIONAL_PARTS:
        try:
            module = importlib.import_module(part)
        except ModuleNotFoundError as err:
            if err.name != part:
                raise
            continue
        module.register(registry, ctx)
    return registry


def bridge(registry: kopf.OperatorRegistry, loop: asyncio.AbstractEventLoop) -> None:
    """Makes every handler of `registry` (but login) run on `loop`, whichever loop kopf calls it from.

    kopf assumes the event loop is its own: when it stops it cancels every task created since it started, which in
    a shared loop means the leader's renewals, the health server's requests, a second operator's handlers (the
    leader test). So kopf runs on a private loop (`run_operator`) and handlers, which use the NATS connection of the
    caller's loop, are sent back there. Exceptions (kopf.TemporaryError, ...) and cancellation cross over as they
    are. A daemon handler (kopf.daemon) should test ``while not stopped:`` rather than await ``stopped.wait()``,
    which belongs to kopf's loop; it is cancelled when kopf stops anyway."""
    groups: list[Any] = [registry._changing, registry._watching, registry._spawning, registry._indexing,
                         registry._webhooks, registry._activities]  # fmt: skip
    for group in groups:
        handlers = group._handlers
        for i, handler in enumerate(handlers):
            if getattr(getattr(handler, "activity", None), "name", "") == "AUTHENTICATION":
                continue
            if getattr(handler.fn, "__pulsescale_bridged__", False):
                continue
            handlers[i] = dataclasses.replace(handler, fn=_bridged(handler.fn, loop))


def _bridged(fn: Callable[..., Any], loop: asyncio.AbstractEventLoop) -> Callable[..., Awaitable[Any]]:
    @functools.wraps(fn)
    async def on_callers_loop(**kwargs: Any) -> Any:
        if asyncio.get_running_loop() is loop:
            result = fn(**kwargs)
            return await result if inspect.isawaitable(result) else result

        async def call() -> Any:
            result = fn(**kwargs)
            return await result if inspect.isawaitable(result) else result

        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(call(), loop))

    on_callers_loop.__pulsescale_bridged__ = True  # type: ignore[attr-defined]
    return on_callers_loop


async def run_operator(
    ctx: OperatorContext, *, stop_flag: asyncio.Event, ready_flag: asyncio.Event | None = None
) -> None:
    """Runs kopf and the operator's loops until `stop_flag` is set (kube/leader.py sets it when leadership ends;
    tests set it), or until kopf fails (then its error is raised). Returns once kopf has stopped: no handler runs
    after that. `ready_flag` is set once kopf has started its watches.

    kopf runs on its own event loop in a thread (see `bridge`); everything else stays on the caller's loop."""
    loop = asyncio.get_running_loop()
    registry = build_registry(ctx)
    bridge(registry, loop)
    settings = build_settings(ctx)
    so: ScaledObjects = ctx.extra["scaledobjects"]
    kopf_stop, kopf_ready = threading.Event(), threading.Event()
    done: asyncio.Future[Any] = loop.create_future()

    def finish(err: BaseException | None) -> None:
        if not done.done():
            done.set_result(None) if err is None else done.set_exception(err)

    def kopf_thread() -> None:
        try:
            asyncio.run(
                kopf.operator(
                    registry=registry,
                    settings=settings,
                    standalone=True,
                    clusterwide=ctx.clusterwide,
                    namespaces=list(ctx.namespaces),
                    stop_flag=kopf_stop,
                    ready_flag=kopf_ready,
                    memo=kopf.Memo(ctx=ctx),
                )
            )
        except BaseException as err:  # noqa: BLE001 - handed to the caller's loop, raised there
            loop.call_soon_threadsafe(finish, err)
        else:
            loop.call_soon_threadsafe(finish, None)

    thread = threading.Thread(target=kopf_thread, name=f"kopf-{ctx.identity}", daemon=True)
    thread.start()
    background = [so.run_loops, *ctx.extra.get(BACKGROUND, [])]
    loops = [
        asyncio.create_task(work(stop_flag), name=f"operator-background-{getattr(work, '__qualname__', work)}")
        for work in background
    ]

    def died(task: asyncio.Task[Any]) -> None:
        # Background work ends only on the stop flag; one that ends otherwise is a bug: said at once, and kept in
        # ctx.died for /healthz (the replica is restarted rather than idle with a dead loop).
        if stop_flag.is_set() or task.cancelled():
            return
        err = task.exception()
        ctx.died.append(f"{task.get_name()}: {err!r}" if err is not None else f"{task.get_name()}: returned")
        log.error("%s ended before the stop flag: %r", task.get_name(), err, exc_info=err)

    for task in loops:
        task.add_done_callback(died)
    stopped: asyncio.Future[Any] = asyncio.ensure_future(stop_flag.wait())

    async def signal_ready() -> None:
        while not kopf_ready.is_set():
            await asyncio.sleep(READY_POLL_S)
        if ready_flag is not None:
            ready_flag.set()

    readiness = asyncio.create_task(signal_ready())
    try:
        await asyncio.wait([done, stopped], return_when=asyncio.FIRST_COMPLETED)
    finally:
        kopf_stop.set()
        stop_flag.set()
        readiness.cancel()
        try:
            await asyncio.shield(done)
        finally:
            await asyncio.gather(stopped, readiness, return_exceptions=True)
            # Background work must end promptly once the stop flag is set (leadership may be moving on); one that
            # does not is logged and left cancelled rather than holding the handover.
            _, stuck = await asyncio.wait(loops, timeout=BACKGROUND_STOP_S)
            for task in stuck:
                log.error("%s did not stop within %.0f s of the stop flag; cancelled", task.get_name(),
                          BACKGROUND_STOP_S)  # fmt: skip
                task.cancel()
            for task in loops:
                if task.done() and not task.cancelled() and task.exception() is not None:
                    log.error("%s failed: %r", task.get_name(), task.exception())
