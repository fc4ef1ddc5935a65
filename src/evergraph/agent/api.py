"""`evergraph.run`: the engine as a function, the one `evergraph run` calls."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from evergraph.errors import InputError
from evergraph.frontends.base import Frontend
from evergraph.world.open import BACKENDS, WorldOptions

if TYPE_CHECKING:
    from evergraph.agent.run import FarmOptions, Service
    from evergraph.frontends.python import Graph

log = logging.getLogger("evergraph")


def frontend_for(target: Frontend | Graph | str | os.PathLike[str] | None) -> Frontend:
    """The frontend for what `run` was given: a Graph, a .yaml/.yml/.py path, or
    None (follow the newest deploy in the World)."""
    from evergraph.frontends.base import Static
    from evergraph.frontends.open import builtin_registry, open_frontend

    if isinstance(target, Frontend):
        return target
    if target is None:
        from evergraph.frontends.deploy import DeployFrontend

        return DeployFrontend(builtin_registry())
    if isinstance(target, str | os.PathLike):
        return open_frontend(target, builtin_registry())
    # imported here: the Python frontend (and the World's exports under it) is
    # not needed for a graph file of another kind
    from evergraph.frontends.python import Graph

    if isinstance(target, Graph):
        return Static(target.model(), label=target.name or "graph")
    raise InputError(f"run() takes a Graph or a path to a graph file, not {type(target).__name__}")


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
    hostname: str = "",
    converged_timeout: float | None = None,
    converged_exit: bool = False,
    converged_status_file: str | os.PathLike[str] | None = None,
    max_runtime: float | None = None,
    repair_backoff_max: float = 300.0,
    world: WorldOptions | str | None = "sqlite",
    noop: bool = False,
    noop_commands: bool = True,
    diff: bool = False,
    watch: bool = True,
    sema: int = 0,
    autoedges: bool = True,
    autogroup: bool = True,
    graphviz: str | os.PathLike[str] | None = None,
    handle_signals: bool = True,
    replace: bool = False,
    services: Sequence[Service] = (),
    farm: FarmOptions | None = None,
    deployers: list[str] | None = None,
    _flush: tuple[Callable[[], None], float] | None = None,
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
    Runs its own event loop: call it from synchronous code.
    """
    from evergraph.agent.run import prepare_state_dir, run_agent
    from evergraph.engine.settings import Settings
    from evergraph.world.names import hostname_problem

    if converged_exit and converged_timeout is None:
        converged_timeout = 0.0
    try:
        frontend = frontend_for(graph)
        if deployers:  # following deploys: only these keys' (base64 verify keys)
            from evergraph.frontends.deploy import trust_deployers

            trust_deployers(frontend, deployers)
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
        settings = Settings(
            state_dir=prepare_state_dir(Path(state_dir) if state_dir is not None else None),
            hostname=hostname,
            noop=noop,
            noop_commands=noop_commands,
            diff=diff,
            sema=sema,
            watch=watch,
            autoedges=autoedges,
            autogroup=autogroup,
            converged_timeout=converged_timeout,
            converged_exit=converged_exit,
            converged_status_file=Path(converged_status_file) if converged_status_file else None,
            max_runtime=max_runtime,
            repair_backoff_max=repair_backoff_max,
            graphviz=Path(graphviz) if graphviz else None,
        )
    except InputError as e:
        log.error("%s", e)
        return 2
    return asyncio.run(
        run_agent(
            settings,
            frontend,
            handle_signals=handle_signals,
            flush=_flush,
            world=opts,
            replace=replace,
            services=services,
            farm=farm,
        )
    )
