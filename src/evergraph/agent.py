"""Running an agent: the library function behind `evergraph run` (and `evergraph.run`)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from evergraph.engine.contract import Registry, default_registry
from evergraph.engine.engine import Engine
from evergraph.engine.model import GraphModel
from evergraph.engine.prepare import prepare
from evergraph.engine.settings import Settings, default_state_dir
from evergraph.errors import InputError
from evergraph.frontends.yaml import YamlFrontend

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


async def prepared(
    updates: AsyncIterator[GraphModel], settings: Settings
) -> AsyncIterator[GraphModel]:
    async for model in updates:
        try:
            yield prepare_model(model, settings)
        except InputError as e:
            log.error("%s (the running graph is kept)", e)


async def run_agent(
    settings: Settings,
    model: GraphModel,
    frontend: YamlFrontend | None = None,
    handle_signals: bool = True,
    flush: tuple[Callable[[], None], float] | None = None,
) -> int:
    """Converge `model`, follow the frontend's changes, stop on signals; the exit status.

    `flush`: (function, seconds) called periodically while running (log buffers).
    """
    # The graph lives as long as the agent: move it out of the cyclic GC's
    # generations so collections do not keep re-walking 10k+ long-lived objects.
    gc.freeze()
    engine = Engine(settings)
    loop = asyncio.get_running_loop()
    if handle_signals:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, engine.request_stop)
    try:
        updates = (
            prepared(frontend.updates(engine.watcher), settings)
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


async def _every(fn: Callable[[], None], seconds: float) -> None:
    while True:
        await asyncio.sleep(seconds)
        fn()
