"""Running an agent: the library function behind `evergraph run` (and `evergraph.run`)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from evergraph.cluster import Cluster, exports_of
from evergraph.engine.contract import Registry, default_registry
from evergraph.engine.engine import Engine
from evergraph.engine.model import GraphModel
from evergraph.engine.prepare import prepare
from evergraph.engine.settings import Settings, default_state_dir
from evergraph.errors import InputError
from evergraph.frontends.base import Context, Frontend
from evergraph.world.kv import WorldError
from evergraph.world.open import OpenWorld, WorldOptions, open_world

log = logging.getLogger("evergraph.agent")

T = TypeVar("T")


def builtin_registry() -> Registry:
    import evergraph.resources  # noqa: F401  (registers the built-in kinds)

    return default_registry


def prepare_state_dir(state_dir: Path | None) -> Path:
    d = state_dir or default_state_dir()
    try:
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as e:
        raise InputError(f"cannot create the state directory: {e.strerror}", str(d)) from None
    return d


def prepare_model(model: GraphModel, settings: Settings) -> GraphModel:
    """Automatic edges and grouping, as the settings say; InputError on a cycle."""
    return prepare(model, autoedges=settings.autoedges, autogroup=settings.autogroup)


async def run_agent(
    settings: Settings,
    frontend: Frontend,
    handle_signals: bool = True,
    flush: tuple[Callable[[], None], float] | None = None,
    world: WorldOptions | None = None,
) -> int:
    """Converge the frontend's first graph, swap in each later one, stop on signals;
    the exit status.

    `flush`: (function, seconds) called periodically while running (log buffers).
    `world`: join this World: register as a member, publish what each graph
    exports, and let the frontend collect what other hosts export to us.
    """
    # The graph lives as long as the agent: move it out of the cyclic GC's
    # generations so collections do not keep re-walking 10k+ long-lived objects.
    gc.freeze()
    engine = Engine(settings)
    # from the start: a deploy follower may wait long for its first graph
    flusher = asyncio.create_task(_every(*flush)) if flush is not None else None
    try:
        return await _run(engine, settings, frontend, handle_signals, world)
    finally:
        if flusher is not None:
            flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await flusher


async def _run(
    engine: Engine,
    settings: Settings,
    frontend: Frontend,
    handle_signals: bool,
    world: WorldOptions | None,
) -> int:
    loop = asyncio.get_running_loop()
    opened: OpenWorld | None = None
    cluster: Cluster | None = None
    stop = asyncio.Event()

    def on_signal() -> None:
        stop.set()
        engine.request_stop()

    if handle_signals:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
    try:
        try:
            if world is not None:
                opened = await open_world(world, settings.state_dir)
                engine.world = opened.kv
                cluster = Cluster(opened.kv, engine.keys(), engine.hostname, builtin_registry())
                await cluster.start()
            ctx = Context(
                registry=builtin_registry(),
                hostname=engine.hostname,
                state_dir=settings.state_dir,
                watcher=engine.watcher if settings.watch else None,
                cluster=cluster,
            )
            raw = await _unless_stopped(frontend.first(ctx), stop, settings.max_runtime)
            if raw is None:
                return 0  # stopped while waiting for a first graph (a deploy)
            if cluster is not None:
                await cluster.publish(exports_of(raw))
            model = prepare_model(raw, settings)
        except WorldError as e:
            log.error("world: %s", e)
            return 1
        except InputError as e:
            log.error("%s", e)
            return 2
        updates = _prepared(frontend.updates(ctx), cluster, settings) if settings.watch else None
        return await engine.run(model, updates)
    finally:
        if handle_signals:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
        await _close(cluster, opened)


async def _unless_stopped(
    work: Awaitable[T], stop: asyncio.Event, timeout: float | None
) -> T | None:
    """`work`'s result, or None (work cancelled) if `stop` is set or `timeout`
    passes first."""
    task = asyncio.ensure_future(work)
    stopper = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({task, stopper}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopper.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return None if task.cancelled() else task.result()


async def _close(cluster: Cluster | None, opened: OpenWorld | None) -> None:
    if cluster is not None:
        await cluster.stop()
    if opened is not None:
        await opened.close()


async def _prepared(
    graphs: AsyncIterator[GraphModel],
    cluster: Cluster | None,
    settings: Settings,
) -> AsyncIterator[GraphModel]:
    """The frontend's later graphs, their exports published, prepared for the engine."""
    async for raw in graphs:
        if cluster is not None:
            try:
                await cluster.publish(exports_of(raw))
            except WorldError as e:
                log.error("world: cannot publish exports: %s", e)
        try:
            yield prepare_model(raw, settings)
        except InputError as e:
            log.error("%s (the running graph is kept)", e)


async def _every(fn: Callable[[], None], seconds: float) -> None:
    while True:
        await asyncio.sleep(seconds)
        fn()
