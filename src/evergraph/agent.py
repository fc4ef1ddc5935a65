"""Running an agent: the library function behind `evergraph run` (and `evergraph.run`)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from evergraph.cluster import Cluster, ExportItem, exports_of, merge
from evergraph.engine.contract import Registry, Resource, default_registry
from evergraph.engine.engine import Engine
from evergraph.engine.model import CollectSpec, GraphModel
from evergraph.engine.prepare import prepare
from evergraph.engine.settings import Settings, default_state_dir
from evergraph.errors import InputError
from evergraph.frontends.yaml import YamlFrontend
from evergraph.world.exports import Exported
from evergraph.world.kv import WorldError
from evergraph.world.open import OpenWorld, WorldOptions, open_world

GRAPH_SUFFIXES = (".yaml", ".yml")

log = logging.getLogger("evergraph.agent")


def builtin_registry() -> Registry:
    import evergraph.resources  # noqa: F401  (registers the built-in kinds)

    return default_registry


def open_frontend(path: str | Path, registry: Registry) -> YamlFrontend:
    p = Path(path)
    if p.suffix not in GRAPH_SUFFIXES:
        raise InputError(
            f"unsupported graph file type {p.suffix or '(none)'!r}: expected .yaml or .yml", str(p)
        )
    return YamlFrontend(p, registry)


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
    model: GraphModel,
    frontend: YamlFrontend | None = None,
    handle_signals: bool = True,
    flush: tuple[Callable[[], None], float] | None = None,
    world: WorldOptions | None = None,
    exports: list[ExportItem] | None = None,
) -> int:
    """Converge `model`, follow the frontend's changes, stop on signals; the exit status.

    `flush`: (function, seconds) called periodically while running (log buffers).
    `world`: join this World: register as a member, publish `exports` (what the
    unprepared model exports), and collect what other hosts export to us.
    """
    # The graph lives as long as the agent: move it out of the cyclic GC's
    # generations so collections do not keep re-walking 10k+ long-lived objects.
    gc.freeze()
    engine = Engine(settings)
    loop = asyncio.get_running_loop()
    opened: OpenWorld | None = None
    cluster: Cluster | None = None
    found: list[Exported] = []
    if world is not None:
        try:
            opened = await open_world(world, settings.state_dir)
            engine.world = opened.kv
            cluster = Cluster(opened.kv, engine.keys(), engine.hostname, builtin_registry())
            await cluster.start()
            await cluster.publish(exports or [])
            if model.collect and frontend is not None:
                model, found = await _with_collected(cluster, frontend, settings)
        except WorldError as e:
            log.error("world: %s", e)
            if opened is not None:
                await opened.close()
            return 1
        except InputError as e:
            log.error("%s", e)
            return 2
    if handle_signals:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, engine.request_stop)
    try:
        updates = (
            _updates(frontend, engine, settings, cluster, model.collect, found)
            if frontend and settings.watch
            else None
        )
        if flush is None:
            return await engine.run(model, updates)
        flusher = asyncio.create_task(_every(*flush))
        try:
            return await engine.run(model, updates)
        finally:
            flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await flusher
    finally:
        if handle_signals:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
        if cluster is not None:
            await cluster.stop()
        if opened is not None:
            await opened.close()


async def _with_collected(
    cluster: Cluster, frontend: YamlFrontend, settings: Settings
) -> tuple[GraphModel, list[Exported]]:
    """The first graph: the file plus what it collects now (and those exports)."""
    base = frontend.load()
    found, _ = await cluster.collected(base.collect)
    return prepare_model(merge(base, cluster.to_resources(found)), settings), found


async def _updates(
    frontend: YamlFrontend,
    engine: Engine,
    settings: Settings,
    cluster: Cluster | None,
    specs: list[CollectSpec],
    found: list[Exported],
) -> AsyncIterator[GraphModel]:
    """Graphs to swap in: on every saved change of the file, and (with a World) on every
    change of the exports it collects. Each is merged, then prepared.

    `found`: the exports the running graph was built with (the collector reports
    only a difference from them)."""
    queue: asyncio.Queue[tuple[str, object]] = asyncio.Queue()
    collected: list[Resource] = cluster.to_resources(found) if cluster is not None else []
    collector: asyncio.Task[None] | None = None

    def restart_collector(new_specs: list[CollectSpec], known: list[Exported] | None) -> None:
        nonlocal collector, specs
        if collector is not None and new_specs == specs:
            return
        specs = new_specs
        if collector is not None:
            collector.cancel()
            collector = None
        if cluster is not None and specs:
            collector = asyncio.create_task(
                cluster.watch_collected(
                    specs, lambda ex: queue.put_nowait(("collected", ex)), known
                )
            )

    async def pump() -> None:
        async for raw in frontend.updates(engine.watcher):
            await queue.put(("graph", raw))

    restart_collector(list(specs), found)
    pumper = asyncio.create_task(pump())
    try:
        while True:
            what, payload = await queue.get()
            if what == "graph":
                assert isinstance(payload, GraphModel)
                raw = payload
                if cluster is not None:
                    try:
                        await cluster.publish(exports_of(raw))
                    except WorldError as e:
                        log.error("world: cannot publish exports: %s", e)
                    restart_collector(raw.collect, None)  # new specs: report what they find
            else:
                assert cluster is not None
                collected = cluster.to_resources(payload)  # type: ignore[arg-type]
                try:
                    raw = frontend.load()
                except InputError as e:
                    log.error("%s (the running graph is kept)", e)
                    continue
                log.info("collected exports changed: swapping the graph live")
            try:
                yield prepare_model(merge(raw, collected), settings)
            except InputError as e:
                log.error("%s (the running graph is kept)", e)
    finally:
        pumper.cancel()
        if collector is not None:
            collector.cancel()


async def _every(fn: Callable[[], None], seconds: float) -> None:
    while True:
        await asyncio.sleep(seconds)
        fn()
