"""`evergraph farm ...`: the worker farm (Boruta's request queue) from the shell.

`farm token` manages API tokens directly in the World (stored hashed); the other
subcommands talk to an agent's HTTP API (`--url`, or $EVERGRAPH_URL) with a token
(`--token`, or $EVERGRAPH_TOKEN).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import click

from evergraph.cli.world import state_dir_option, with_world
from evergraph.world.kv import KV


def register(cli: click.Group, world_options: Callable[..., Callable[..., None]]) -> None:
    ctx = {"help_option_names": ["-h", "--help"], "max_content_width": 100}

    @cli.group(context_settings=ctx)
    def farm() -> None:
        """The worker farm: lease hosts to users through a priority request queue.

        \b
        Examples:
          evergraph farm token create alice --group lab       # prints alice's token once
          evergraph farm token create ops --admin
          evergraph farm token list
          evergraph farm token revoke 3f2a9c01
        """

    @farm.group(context_settings=ctx)
    def token() -> None:
        """API tokens: created here, stored in the World only as a hash."""

    @token.command("create", context_settings=ctx)
    @click.argument("name")
    @click.option("--group", "groups", multiple=True, help="A group of this user (repeatable).")
    @click.option("--admin", is_flag=True, help="May use the admin routes (workers' state).")
    @state_dir_option
    @world_options
    def create(
        name: str, groups: tuple[str, ...], admin: bool, state_dir: Path | None, **opts: object
    ) -> None:
        """Create a token for user NAME and print it (it is not shown again)."""
        from evergraph.farm import tokens

        try:
            tokens.check_names(name, list(groups))
        except ValueError as e:
            click.echo(f"evergraph: farm token create: {e}", err=True)
            sys.exit(2)

        async def body(kv: KV) -> int:
            click.echo(await tokens.create(kv, name, list(groups), admin))
            return 0

        sys.exit(with_world(state_dir, opts, body))

    @token.command("list", context_settings=ctx)
    @state_dir_option
    @world_options
    def list_(state_dir: Path | None, **opts: object) -> None:
        """`HASH  NAME  GROUPS  admin|-` for every token (never the token itself)."""
        from evergraph.farm import tokens

        async def body(kv: KV) -> int:
            for prefix, user in await tokens.users(kv):
                admin = "admin" if user.admin else "-"
                click.echo(f"{prefix}\t{user.name}\t{','.join(user.groups) or '-'}\t{admin}")
            return 0

        sys.exit(with_world(state_dir, opts, body, read_only=True))

    @token.command(context_settings=ctx)
    @click.argument("hash_prefix")
    @state_dir_option
    @world_options
    def revoke(hash_prefix: str, state_dir: Path | None, **opts: object) -> None:
        """Revoke the token whose hash starts with HASH_PREFIX (see `farm token list`)."""
        from evergraph.farm import tokens

        async def body(kv: KV) -> int:
            try:
                n = await tokens.revoke(kv, hash_prefix)
            except ValueError as e:
                click.echo(f"evergraph: farm token revoke: {e}", err=True)
                return 2
            if n == 0:
                click.echo(f"evergraph: farm token revoke: no token {hash_prefix}...", err=True)
                return 1
            click.echo(f"revoked {n} token(s)", err=True)
            return 0

        sys.exit(with_world(state_dir, opts, body, read_only=True))
