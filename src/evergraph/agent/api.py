"""`evergraph.run`: the engine as a function, the one `evergraph run` calls."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from evergraph.engine.settings import one_shot
from evergraph.errors import InputError
from evergraph.frontends.base import Frontend
from evergraph.frontends.open import frontend_for, trust_deployers
from evergraph.world.open import BACKENDS, WorldOptions

if TYPE_CHECKING:
    from evergraph.agent.run import FarmOptions, Service
    from evergraph.frontends.open import Graph

log = logging.getLogger("evergraph")


def _world(world: WorldOptions | str | None) -> WorldOptions | None:
    if world is None or isinstance(world, WorldOptions):
        return world
    if world not in BACKENDS:
        raise InputError(
            f"unknown World {world!r}: give one of {', '.join(BACKENDS)}, a WorldOptions or None",
            "world",
        )
    if world == "etcd":
        raise InputError("an etcd World needs WorldOptions(seeds=...) or embedded=True", "world")
    return WorldOptions(backend=world)


def run(
    graph: Graph | str | os.PathLike[str] | Frontend | None,
    *,
    state_dir: str | os.PathLike[str] | None = None,
    world: WorldOptions | str | None = "sqlite",
    handle_signals: bool = True,
    replace: bool = False,
    services: Sequence[Service] = (),
    farm: FarmOptions | None = None,
    deployers: list[str] | None = None,
    _flush: tuple[Callable[[], None], float] | None = None,
    _started: float | None = None,
    **settings: Any,
) -> int:
    """Converge `graph` and keep it converged; returns the CLI's exit status
    (0 clean, 1 a resource failed, 2 bad input; 3: `noop` with `converged_exit`
    or `watch=False`, and something would change).

    `graph`: an `evergraph.Graph`, the path of a .yaml/.yml/.py graph file, or
    None to follow the newest deploy in the World (or a `Frontend`).
    `converged_exit=True`
    returns once every vertex is clean and idle for `converged_timeout`
    seconds (default 0). `diff=True` logs each change with its diff (noop always
    does). `world`: "sqlite" (default: the state dir's
    world.sqlite), "memory", a `WorldOptions`, or None (no World: no exports,
    no collect). Input errors are logged (logger "evergraph") and give 2.
    `replace=True` takes the hostname over from another live agent in the World.
    `services`: more long-running services for the agent to own (the CLI's HTTP
    server): each is called with the agent once its engine exists. `farm`: be a farm
    worker and/or run the farm's matcher when elected (see `FarmOptions`).
    `repair_backoff_max`: a resource failed for good is tried again at its next
    event, or by a timer doubling from 1 s up to this (0: events only).
    `settings`: the fields of `engine.settings.Settings` (`hostname`, `noop`,
    `noop_commands`, `diff`, `sema`, `watch`, `autoedges`, `autogroup`,
    `converged_timeout`, `converged_exit`, `converged_status_file`, `max_runtime`,
    `repair_backoff_max`, `graphviz`, `stop_grace`), each documented there with the
    flag of `evergraph run` that sets it; another keyword is a TypeError naming it.
    Runs its own event loop: call it from synchronous code. (`_started`, the CLI's:
    the `time.monotonic()` its command began at, which `max_runtime` counts from.)
    """
    from evergraph.agent.run import prepare_state_dir, run_agent
    from evergraph.engine.settings import Settings, run_keywords
    from evergraph.world.names import hostname_problem

    known = run_keywords()
    for name in settings:
        if name not in known:
            raise TypeError(f"run() got an unexpected keyword argument {name!r}")
    for name in ("converged_status_file", "graphviz"):  # paths given as str
        value = settings.get(name)
        settings[name] = Path(value) if value else None
    if settings.get("converged_exit") and settings.get("converged_timeout") is None:
        settings["converged_timeout"] = 0.0
    hostname: str = settings.get("hostname", "")
    try:
        frontend = frontend_for(graph)
        if deployers:  # following deploys: only these keys' (base64 verify keys)
            trust_deployers(frontend, deployers)
        frontend.cache_parses(Path(state_dir) if state_dir is not None else None)
        if one_shot(settings):
            frontend.one_shot()
        frontend.preload()
        opts = _world(world)
        private = opts is None or (opts.backend == "memory" and not opts.is_etcd)
        if frontend.needs_shared_world and private:
            raise InputError(
                "without FILE, `run` follows deploys from a shared World "
                "(sqlite or etcd), not from a private one",
                "--world",
            )
        if opts is not None and hostname:
            # before anything is created: the hostname is part of World keys
            why = hostname_problem(hostname)
            if why:
                raise InputError(why, "--hostname")
        prepared = Settings(
            state_dir=prepare_state_dir(Path(state_dir) if state_dir is not None else None),
            **settings,
        )
    except InputError as e:
        log.error("%s", e)
        return 2
    return asyncio.run(
        run_agent(
            prepared,
            frontend,
            handle_signals=handle_signals,
            flush=_flush,
            world=opts,
            started=_started,
            replace=replace,
            services=services,
            farm=farm,
        )
    )
