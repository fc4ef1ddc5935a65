"""`evergraph schedule NS [--watch]`: which hosts the scheduler chose (read-only)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import click

from evergraph.cli.world import state_dir_option, with_world
from evergraph.errors import InputError
from evergraph.world.kv import KV


def register(cli: click.Group, world_options: Callable[..., Callable[..., None]]) -> None:
    ctx = {"help_option_names": ["-h", "--help"], "max_content_width": 100}

    @cli.command(context_settings=ctx)
    @click.argument("namespace", metavar="NS")
    @click.option(
        "--watch",
        is_flag=True,
        help="Keep printing: the choice now, then one line per change (hosts joined by spaces).",
    )
    @state_dir_option
    @world_options
    def schedule(namespace: str, watch: bool, state_dir: Path | None, **opts: object) -> None:
        """Print the hosts chosen in namespace NS, one per line (exit 1: no choice yet).

        Hosts volunteer with a `schedule` resource; the elected leader among them
        writes the choice to the World (`scheduler/NS/chosen`).

        \b
        Examples:
          evergraph schedule web
          evergraph schedule web --watch --world-db /srv/world.sqlite
        """
        from evergraph.cli.main import _die
        from evergraph.cluster.scheduler import namespace_problem, read_chosen, watch_chosen

        why = namespace_problem(namespace)
        if why is not None:
            _die(InputError(why, "NS"))

        async def body(kv: KV) -> int:
            if watch:
                async for hosts in watch_chosen(kv, namespace):
                    click.echo(" ".join(hosts))
                return 0
            c = await read_chosen(kv, namespace)
            if c is None:
                click.echo(f"evergraph: schedule: nothing chosen in {namespace!r} yet", err=True)
                return 1
            for h in c.hosts:
                click.echo(h)
            return 0

        sys.exit(with_world(state_dir, opts, body, read_only=True))
