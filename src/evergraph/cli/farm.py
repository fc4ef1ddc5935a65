"""`evergraph farm ...`: the worker farm (Boruta's request queue) from the shell.

`farm token` manages API tokens directly in the World (stored hashed); the other
subcommands talk to an agent's HTTP API (`--url`, or $EVERGRAPH_URL) with a token
(`--token`, or $EVERGRAPH_TOKEN).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import click

from evergraph.cli.world import state_dir_option, with_world
from evergraph.world.kv import KV

if TYPE_CHECKING:
    from evergraph.http.client import FarmClient


def register(cli: click.Group, world_options: Callable[..., Callable[..., None]]) -> None:
    ctx = {"help_option_names": ["-h", "--help"], "max_content_width": 100}

    @cli.group(context_settings=ctx)
    def farm() -> None:
        """The worker farm: lease hosts to users through a priority request queue.

        \b
        Examples:
          evergraph farm token create alice --group lab       # prints alice's token once
          export EVERGRAPH_URL=http://10.0.0.5:9233 EVERGRAPH_TOKEN=egt_...
          evergraph farm new --priority 4 --cap board=rpi4 --cap 'ram_mb=>=2048'
          evergraph farm acquire 7 --key-file job7.pem      # waits, then prints ssh ...
          evergraph farm requests --state WAITING
          evergraph farm close 7
          evergraph farm workers
          evergraph farm set-state UUID IDLE                  # admin
        """

    register_client(farm)

    @farm.group(context_settings=ctx)
    def token() -> None:
        """API tokens: created here, stored in the World only as a hash."""

    @token.command("create", context_settings=ctx)
    @click.argument("name")
    @click.option("--group", "groups", multiple=True, help="A group of this user (repeatable).")
    @click.option("--admin", is_flag=True, help="May use the admin routes (workers' state).")
    @click.option(
        "--fragment",
        is_flag=True,
        help="May send requests with a graph fragment (which workers apply as root for the "
        "job's lifetime; admins may anyway).",
    )
    @state_dir_option
    @world_options
    def create(
        name: str,
        groups: tuple[str, ...],
        admin: bool,
        fragment: bool,
        state_dir: Path | None,
        **opts: object,
    ) -> None:
        """Create a token for user NAME and print it (it is not shown again).

        The token's record is signed with this state dir's host key: API servers
        accept it if that key is their own or one they pin (`--farm-server
        NAME=KEY`), so run it on an API server's host, with its --state-dir."""
        from evergraph.cluster.hostkeys import HostKeys, KeyError_
        from evergraph.engine.settings import default_state_dir
        from evergraph.farm import tokens

        try:
            tokens.check_names(name, list(groups))
            keys = HostKeys(state_dir or default_state_dir())
        except (ValueError, KeyError_) as e:
            click.echo(f"evergraph: farm token create: {e}", err=True)
            sys.exit(2)

        async def body(kv: KV) -> int:
            click.echo(await tokens.create(kv, name, list(groups), admin, keys, fragment=fragment))
            return 0

        sys.exit(with_world(state_dir, opts, body))

    @token.command("list", context_settings=ctx)
    @state_dir_option
    @world_options
    def list_(state_dir: Path | None, **opts: object) -> None:
        """`HASH  NAME  GROUPS  admin|fragment|-` for every token (never the token
        itself; `fragment`: may send graph fragments, as an admin may)."""
        from evergraph.farm import tokens

        async def body(kv: KV) -> int:
            for prefix, user in await tokens.users(kv):
                admin = "admin" if user.admin else "fragment" if user.fragment else "-"
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


# -- the HTTP client side ------------------------------------------------------------------

_URL = click.option(
    "--url",
    envvar="EVERGRAPH_URL",
    default="http://127.0.0.1:9233",
    show_default=True,
    help="An agent serving the farm API (`run --http`). [env EVERGRAPH_URL]",
)
_TOKEN = click.option(
    "--token",
    envvar="EVERGRAPH_TOKEN",
    default=None,
    help="Your API token (`farm token create`). [env EVERGRAPH_TOKEN]",
)


def _client(url: str, token: str | None) -> FarmClient:
    from evergraph.http.client import FarmClient

    return FarmClient(url, token)


def _fail(e: Exception) -> NoReturn:
    from evergraph.http.client import FarmClientError

    status = e.status if isinstance(e, FarmClientError) else 0
    click.echo(f"evergraph: farm: {e}", err=True)
    sys.exit(2 if 400 <= status < 500 else 1)


def _run(url: str, token: str | None, fn: Callable[[FarmClient], None]) -> None:
    from evergraph.http.client import FarmClientError

    try:
        with _client(url, token) as c:
            fn(c)
    except FarmClientError as e:
        _fail(e)


def register_client(farm: click.Group) -> None:
    ctx = {"help_option_names": ["-h", "--help"], "max_content_width": 100}

    @farm.command("new", context_settings=ctx)
    @click.option(
        "--priority",
        type=click.IntRange(1, 16),
        default=8,
        show_default=True,
        help="1 is the most urgent.",
    )
    @click.option(
        "--cap",
        "caps",
        multiple=True,
        metavar="K=V",
        help="A wanted capability (repeatable): exact, 'a|b', '2.9-3.6', '>=N', '<=N'.",
    )
    @click.option("--valid-after", metavar="RFC3339", help="Not before this time.")
    @click.option("--deadline", metavar="RFC3339", help="Give up at this time (default: a month).")
    @click.option(
        "--fragment",
        type=click.Path(exists=True, dir_okay=False, path_type=Path),
        help="A YAML graph the worker applies for the job's lifetime, reversed at its end "
        "(evergraph servers; needs a token created with --fragment).",
    )
    @_URL
    @_TOKEN
    def new(
        priority: int,
        caps: tuple[str, ...],
        valid_after: str | None,
        deadline: str | None,
        fragment: Path | None,
        url: str,
        token: str | None,
    ) -> None:
        """Ask for a worker; prints the request's id."""
        from evergraph.farm.facts import parse_caps

        try:
            wanted = parse_caps(caps)
        except ValueError as e:
            click.echo(f"evergraph: farm new: --cap: {e}", err=True)
            sys.exit(2)
        text = fragment.read_text() if fragment is not None else None

        def body(c: FarmClient) -> None:
            click.echo(c.new_request(priority, wanted, valid_after, deadline, text))

        _run(url, token, body)

    @farm.command("requests", context_settings=ctx)
    @click.option("--state", "states", multiple=True, help="Only requests in this state.")
    @click.option("--json", "as_json", is_flag=True, help="The list as Boruta's JSON.")
    @_URL
    @_TOKEN
    def requests(states: tuple[str, ...], as_json: bool, url: str, token: str | None) -> None:
        """Your requests (an admin: all): `ID  PRIORITY  STATE  DEADLINE  CAPS`."""

        def body(c: FarmClient) -> None:
            items, _ = c.requests([s.upper() for s in states] or None)
            for r in items:
                if as_json:
                    click.echo(json.dumps(r))
                    continue
                caps = ",".join(f"{k}={v}" for k, v in (r.get("Caps") or {}).items()) or "-"
                click.echo(f"{r['ID']}\t{r['Priority']}\t{r['State']}\t{r['Deadline']}\t{caps}")

        _run(url, token, body)

    @farm.command("request", context_settings=ctx)
    @click.argument("rid", type=int)
    @_URL
    @_TOKEN
    def request(rid: int, url: str, token: str | None) -> None:
        """One request, as JSON."""
        _run(url, token, lambda c: click.echo(json.dumps(c.request(rid), indent=1)))

    @farm.command("update", context_settings=ctx)
    @click.argument("rid", type=int)
    @click.option("--priority", type=click.IntRange(1, 16), default=0)
    @click.option("--valid-after", metavar="RFC3339")
    @click.option("--deadline", metavar="RFC3339")
    @_URL
    @_TOKEN
    def update(
        rid: int,
        priority: int,
        valid_after: str | None,
        deadline: str | None,
        url: str,
        token: str | None,
    ) -> None:
        """Change a WAITING request (a new priority goes to the tail of its queue)."""
        _run(url, token, lambda c: c.update(rid, priority, valid_after, deadline))

    @farm.command("close", context_settings=ctx)
    @click.argument("rid", type=int)
    @_URL
    @_TOKEN
    def close(rid: int, url: str, token: str | None) -> None:
        """Cancel a WAITING request, or end the job of an IN PROGRESS one."""
        _run(url, token, lambda c: c.close_request(rid))

    @farm.command("prolong", context_settings=ctx)
    @click.argument("rid", type=int)
    @_URL
    @_TOKEN
    def prolong(rid: int, url: str, token: str | None) -> None:
        """Extend the job by the farm's period (a limited number of times)."""
        _run(url, token, lambda c: c.prolong(rid))

    @farm.command("acquire", context_settings=ctx)
    @click.argument("rid", type=int)
    @click.option(
        "--wait",
        type=float,
        default=60.0,
        show_default=True,
        help="Seconds to wait while the request is WAITING (0: answer at once).",
    )
    @click.option(
        "--key-file",
        type=click.Path(dir_okay=False, path_type=Path),
        help="Write the job's private key here (0600) and print the ssh command.",
    )
    @_URL
    @_TOKEN
    def acquire(rid: int, wait: float, key_file: Path | None, url: str, token: str | None) -> None:
        """Access to the worker of an IN PROGRESS request."""
        from evergraph._util.atomic import atomic_write

        def body(c: FarmClient) -> None:
            a = c.acquire(rid, wait)
            addr = a["Addr"]
            if key_file is None:
                click.echo(json.dumps(a, indent=1))
                return
            atomic_write(key_file.absolute(), a["Key"].encode(), mode=0o600)
            click.echo(f"ssh -i {key_file} -p {addr['Port']} {a['Username']}@{addr['IP']}")

        _run(url, token, body)

    @farm.command("workers", context_settings=ctx)
    @click.option("--group", "groups", multiple=True, help="Only workers of this group.")
    @_URL
    @_TOKEN
    def workers(groups: tuple[str, ...], url: str, token: str | None) -> None:
        """The workers: `UUID  STATE  GROUPS  CAPS`."""

        def body(c: FarmClient) -> None:
            for w in c.workers(list(groups) or None):
                caps = ",".join(f"{k}={v}" for k, v in (w.get("Caps") or {}).items() if k != "UUID")
                groups_ = ",".join(w.get("Groups") or []) or "-"
                click.echo(f"{w['WorkerUUID']}\t{w['State']}\t{groups_}\t{caps or '-'}")

        _run(url, token, body)

    @farm.command("set-state", context_settings=ctx)
    @click.argument("uuid")
    @click.argument("state", type=click.Choice(["IDLE", "MAINTENANCE"], case_sensitive=False))
    @_URL
    @_TOKEN
    def set_state(uuid: str, state: str, url: str, token: str | None) -> None:
        """Admin: make a worker IDLE (available) or send it to MAINTENANCE."""
        _run(url, token, lambda c: c.set_state(uuid, state.upper()))

    @farm.command("set-groups", context_settings=ctx)
    @click.argument("uuid")
    @click.argument("groups", nargs=-1)
    @_URL
    @_TOKEN
    def set_groups(uuid: str, groups: tuple[str, ...], url: str, token: str | None) -> None:
        """Admin: replace a worker's groups (none: any group's requests)."""
        _run(url, token, lambda c: c.set_groups(uuid, list(groups)))

    @farm.command("deregister", context_settings=ctx)
    @click.argument("uuid")
    @_URL
    @_TOKEN
    def deregister(uuid: str, url: str, token: str | None) -> None:
        """Admin: remove a worker in MAINTENANCE or FAILED."""
        _run(url, token, lambda c: c.deregister(uuid))
