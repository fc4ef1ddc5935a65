"""`evergraph hosts`: which host keys this agent trusts (pins), and what the World says."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import click

from evergraph.cli.world import state_dir_option, with_world
from evergraph.errors import InputError
from evergraph.world.kv import KV

if TYPE_CHECKING:
    from evergraph.cluster.pins import Pins


def _pins(state_dir: Path | None, create: bool = False) -> Pins:
    from evergraph.agent.run import existing_state_dir, prepare_state_dir
    from evergraph.cli.main import _die
    from evergraph.cluster.pins import Pins, PinsError

    try:
        sd = prepare_state_dir(state_dir) if create else existing_state_dir(state_dir)
        return Pins(sd)
    except InputError as e:
        _die(e)
    except PinsError as e:
        click.echo(f"evergraph: {e}", err=True)
        sys.exit(2)


def register(cli: click.Group, world_options: Callable[..., Callable[..., None]]) -> None:
    ctx = {"help_option_names": ["-h", "--help"], "max_content_width": 100}

    @cli.group(context_settings=ctx, invoke_without_command=True)
    @state_dir_option
    @world_options
    @click.pass_context
    def hosts(click_ctx: click.Context, /, state_dir: Path | None, **opts: object) -> None:
        """Host keys: pinned here (trusted) and seen in the World.

        The first key seen for a host is pinned; exports signed by, or sealed for,
        any other key are refused. Without a subcommand, list every host:
        `NAME  PINNED  SEEN  STATUS` (fingerprints; STATUS ok, MISMATCH: the World
        names another key than the pinned one, unpinned, not-seen, bad-record: the
        World's record is not a host key record). Exit 1 if any is MISMATCH or
        bad-record. `trust` and `forget` reach a running agent of this state dir
        within a second.

        \b
        Examples:
          evergraph hosts                          # what is trusted, what the World says
          evergraph hosts key                      # this host's key, to pin elsewhere
          evergraph hosts trust web1 'PUBLIC:VERIFY'
          evergraph hosts forget web1              # re-trust the next key seen
        """
        if click_ctx.invoked_subcommand is not None:
            return
        from evergraph.cluster.exports import HOSTKEYS, decode_hostkeys
        from evergraph.cluster.pins import fingerprint_of

        pins = _pins(state_dir)

        async def body(kv: KV) -> int:
            items, _ = await kv.range(HOSTKEYS)
            seen: dict[str, str] = {}
            bad: set[str] = set()
            for item in items:
                try:
                    rec = decode_hostkeys(item)
                except ValueError as e:
                    click.echo(f"evergraph: {e}", err=True)
                    bad.add(item.key[len(HOSTKEYS) :])
                    continue
                seen[rec.host] = f"{rec.public}:{rec.verify}"
            mismatch = 0
            for host in sorted(set(seen) | set(pins.hosts) | bad):
                pin = pins.hosts.get(host)
                shown = seen.get(host)
                if host in bad:
                    status, mismatch = "bad-record", mismatch + 1
                elif pin is None:
                    status = "unpinned"
                elif shown is None:
                    status = "not-seen"
                elif shown == pin.identity:
                    status = "ok"
                else:
                    status, mismatch = "MISMATCH", mismatch + 1
                pinned = f"{fingerprint_of(pin.identity)} ({pin.how})" if pin else "-"
                click.echo(f"{host}\t{pinned}\t{fingerprint_of(shown) if shown else '-'}\t{status}")
            return 1 if mismatch else 0

        sys.exit(with_world(state_dir, opts, body, read_only=True))

    @hosts.command(context_settings=ctx)
    @state_dir_option
    def key(state_dir: Path | None) -> None:
        """Print this host's key (`PUBLIC:VERIFY`) and its fingerprint."""
        from evergraph.agent.run import prepare_state_dir
        from evergraph.cli.main import _die
        from evergraph.cluster.hostkeys import HostKeys, KeyError_, identity
        from evergraph.cluster.pins import fingerprint_of

        try:
            keys = HostKeys(prepare_state_dir(state_dir))
        except InputError as e:
            _die(e)
        except KeyError_ as e:
            click.echo(f"evergraph: {e}", err=True)
            sys.exit(2)
        ident = identity(keys.public, keys.verify)
        click.echo(ident)
        click.echo(fingerprint_of(ident), err=True)

    @hosts.command(context_settings=ctx)
    @click.argument("name")
    @click.argument("key")
    @state_dir_option
    def trust(name: str, key: str, state_dir: Path | None) -> None:
        """Pin KEY (`PUBLIC:VERIFY`, from `evergraph hosts key` on NAME) for host NAME."""
        from evergraph.cli.main import _die
        from evergraph.cluster.pins import fingerprint_of
        from evergraph.world.names import hostname_problem

        why = hostname_problem(name)
        if why:
            _die(InputError(why, "NAME"))
        pins = _pins(state_dir, create=True)
        try:
            pin = pins.trust(name, key)
        except ValueError as e:
            _die(InputError(str(e), "KEY"))
        click.echo(f"pinned {name}: {fingerprint_of(pin.identity)}")

    @hosts.command(context_settings=ctx)
    @state_dir_option
    def deployers(state_dir: Path | None) -> None:
        """List the deployers whose signed deploys this host runs (pinned in pins.json)."""
        from evergraph.cluster.hostkeys import fingerprint

        for k in _pins(state_dir).trusted_deployers():
            click.echo(f"{k}\t{fingerprint(k)}")

    @hosts.command("trust-deployer", context_settings=ctx)
    @click.argument("key")
    @state_dir_option
    def trust_deployer(key: str, state_dir: Path | None) -> None:
        """Trust the deploys signed by KEY (a verify key, as `evergraph deploy` prints it);
        a running agent follows them within a second."""
        from evergraph.cli.main import _die
        from evergraph.cluster.hostkeys import fingerprint

        try:
            _pins(state_dir, create=True).add_deployer(key)
        except ValueError as e:
            _die(InputError(f"not a verify key: {e}", "KEY"))
        click.echo(f"trusted deployer {fingerprint(key.strip())}")

    @hosts.command("forget-deployer", context_settings=ctx)
    @click.argument("key")
    @state_dir_option
    def forget_deployer(key: str, state_dir: Path | None) -> None:
        """Stop trusting KEY's deploys (exit 1 if it was not trusted); a running agent
        stops following them within a second."""
        from evergraph.cli.main import _die

        try:
            removed = _pins(state_dir).remove_deployer(key)
        except ValueError as e:
            _die(InputError(f"not a verify key: {e}", "KEY"))
        if not removed:
            click.echo("evergraph: hosts: that deployer is not trusted", err=True)
            sys.exit(1)
        click.echo("forgot the deployer")

    @hosts.command(context_settings=ctx)
    @click.argument("name")
    @state_dir_option
    def forget(name: str, state_dir: Path | None) -> None:
        """Unpin NAME: the next key seen for it is trusted (exit 1 if none was pinned)."""
        pins = _pins(state_dir)
        if not pins.forget(name):
            click.echo(f"evergraph: hosts: {name!r} is not pinned", err=True)
            sys.exit(1)
        click.echo(f"forgot {name}")
