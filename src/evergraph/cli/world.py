"""`evergraph world|members|exports`: read and write the same World as `run`."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import click

from evergraph.errors import InputError
from evergraph.world.kv import KV, WorldError

T = TypeVar("T")


def state_dir_option(f: Callable[..., None]) -> Callable[..., None]:
    return click.option(
        "--state-dir",
        type=click.Path(file_okay=False, path_type=Path),
        help="The agent's state dir (holds the sqlite World). [default: as for run]",
    )(f)


def with_world(
    state_dir: Path | None,
    world: dict[str, object],
    body: Callable[[KV], Awaitable[T]],
    read_only: bool = False,
) -> T:
    """Open the World the options name, run `body(kv)`, close it; errors exit 1 or 2.
    `read_only`: a sqlite World must exist already (never create an empty one)."""
    from evergraph.agent.run import existing_state_dir, prepare_state_dir
    from evergraph.cli.main import _die, _world_opts
    from evergraph.engine.settings import default_state_dir
    from evergraph.world.open import open_world

    try:
        opts = _world_opts(world)
        if opts.embedded:
            raise InputError("only `run` starts an embedded etcd; use --seeds", "--etcd")
        if read_only and not opts.is_etcd and opts.backend == "sqlite":
            # never create an empty World just to answer "nothing"
            if opts.db is not None:
                sd = state_dir or default_state_dir()
                if not opts.db.is_file():
                    raise InputError("no such World file", str(opts.db))
            else:
                sd = existing_state_dir(state_dir)
                if not (sd / "world.sqlite").is_file():
                    raise InputError(
                        "no World here (no agent has run with this state dir)",
                        str(sd / "world.sqlite"),
                    )
        else:
            sd = prepare_state_dir(state_dir)
    except InputError as e:
        _die(e)

    async def main() -> T:
        opened = await open_world(opts, sd)
        try:
            return await body(opened.kv)
        finally:
            await opened.close()

    try:
        return asyncio.run(main())
    except WorldError as e:
        click.echo(f"evergraph: world: {e}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)


def _show(value: bytes) -> str:
    try:
        return value.decode()
    except UnicodeDecodeError:
        return value.hex()


def register(cli: click.Group, world_options: Callable[..., Callable[..., None]]) -> None:
    ctx = {"help_option_names": ["-h", "--help"], "max_content_width": 100}

    @cli.group(context_settings=ctx)
    def world() -> None:
        """Read and write keys of the World (the same one `run` uses).

        \b
        Examples:
          evergraph world put kv/motd "hello"
          evergraph world get kv/motd
          evergraph world watch kv/                 # print changes as they happen
          evergraph world get --prefix members/ --seeds http://10.0.0.1:2379
        """

    @world.command(context_settings=ctx)
    @click.argument("key")
    @click.option("--prefix", is_flag=True, help="Every key starting with KEY.")
    @state_dir_option
    @world_options
    def get(key: str, prefix: bool, state_dir: Path | None, **opts: object) -> None:
        """Print KEY's value (exit 1 if absent), or with --prefix `key<TAB>value` lines."""

        async def body(kv: KV) -> int:
            if prefix:
                items, _ = await kv.range(key)
                for item in items:
                    click.echo(f"{item.key}\t{_show(item.value)}")
                return 0
            one = await kv.get(key)
            if one is None:
                click.echo(f"evergraph: world: no key {key!r}", err=True)
                return 1
            click.echo(_show(one.value))
            return 0

        sys.exit(with_world(state_dir, opts, body, read_only=True))

    @world.command(context_settings=ctx)
    @click.argument("key")
    @click.argument("value")
    @state_dir_option
    @world_options
    def put(key: str, value: str, state_dir: Path | None, **opts: object) -> None:
        """Set KEY to VALUE."""
        if not key:
            click.echo("evergraph: world put: KEY must not be empty", err=True)
            sys.exit(2)

        async def body(kv: KV) -> int:
            rev = await kv.put(key, value.encode())
            click.echo(f"revision {rev}", err=True)
            return 0

        sys.exit(with_world(state_dir, opts, body))

    @world.command("del", context_settings=ctx)
    @click.argument("key")
    @click.option("--prefix", is_flag=True, help="Every key starting with KEY.")
    @state_dir_option
    @world_options
    def delete(key: str, prefix: bool, state_dir: Path | None, **opts: object) -> None:
        """Delete KEY (exit 1 if absent), or with --prefix every key under it."""

        async def body(kv: KV) -> int:
            if prefix:
                n = await kv.delete_prefix(key)
                click.echo(f"deleted {n} keys", err=True)
                return 0
            return 0 if await kv.delete(key) else 1

        sys.exit(with_world(state_dir, opts, body))

    @world.command(context_settings=ctx)
    @click.argument("prefix")
    @state_dir_option
    @world_options
    def watch(prefix: str, state_dir: Path | None, **opts: object) -> None:
        """Print every change under PREFIX as it happens (`put key value` / `delete key`)."""

        async def body(kv: KV) -> int:
            _, rev = await kv.range(prefix)
            async for batch in kv.watch(prefix, rev + 1):
                for ev in batch:
                    line = (
                        f"put {ev.key} {_show(ev.value)}"
                        if ev.type == "put"
                        else f"delete {ev.key}"
                    )
                    click.echo(line)
            return 0

        sys.exit(with_world(state_dir, opts, body, read_only=True))

    @cli.command(context_settings=ctx)
    @click.option("--json", "as_json", is_flag=True, help="One JSON object per member.")
    @state_dir_option
    @world_options
    def members(as_json: bool, state_dir: Path | None, **opts: object) -> None:
        """List the live cluster members (agents whose lease is alive): host, state,
        version, groups, address, capabilities (a farm worker's)."""
        from evergraph.cluster.members import members as list_members

        async def body(kv: KV) -> int:
            import msgspec

            for m in await list_members(kv):
                if as_json:
                    click.echo(msgspec.json.encode(m).decode())
                else:
                    caps = ",".join(f"{k}={v}" for k, v in sorted(m.capabilities.items()))
                    click.echo(
                        f"{m.host}\t{m.state}\t{m.version}\t{','.join(m.groups) or '-'}\t"
                        f"{m.address or '-'}\t{caps or '-'}"
                    )
            return 0

        sys.exit(with_world(state_dir, opts, body, read_only=True))

    @cli.command(context_settings=ctx)
    @state_dir_option
    @world_options
    def exports(state_dir: Path | None, **opts: object) -> None:
        """List exported resources: `to  from  kind[name]  sealed|signed  STATUS` (never
        the content).

        Each record is verified as a collector would: its signature against the
        exporter's key pinned in this state dir (or, not pinned here, the key the
        World names, or this host's own), and its sequence against the exporter's
        signed index. STATUS: `ok`; `ok-unpinned` (checked only against the key the
        World names); `unverified` (no key known for the exporter); `FORGED` (not
        signed by the exporter's key, or moved); `STALE` (a replayed or withdrawn
        record: its exporter's index names another sequence, or not it);
        `bad-record`. Exit 1 if any record is FORGED, STALE or bad.
        """
        from evergraph.cluster.exports import (
            EXPORTED,
            HOSTKEYS,
            decode_hostkeys,
            entry_name,
            is_index_key,
            open_record_seq,
            parse_key,
            record_digest,
            verified_entries,
        )
        from evergraph.cluster.hostkeys import HostKeys, KeyError_
        from evergraph.cluster.pins import Pins, PinsError
        from evergraph.engine.settings import default_state_dir

        sd = state_dir or default_state_dir()
        try:
            pins = Pins(sd)
            own = HostKeys(sd).verify if (sd / "keys" / "sign.key").is_file() else None
        except (PinsError, KeyError_) as e:
            click.echo(f"evergraph: {e}", err=True)
            sys.exit(2)

        async def body(kv: KV) -> int:
            items, _ = await kv.range(EXPORTED)
            keyrecs, _ = await kv.range(HOSTKEYS)
            world_keys: dict[str, str] = {}
            for k in keyrecs:
                try:
                    rec = decode_hostkeys(k)
                except ValueError:
                    continue
                world_keys[rec.host] = rec.verify

            def key_of(src: str) -> tuple[str, str] | None:
                pin = pins.hosts.get(src)
                if pin is not None:
                    return pin.verify, "ok"
                seen = world_keys.get(src)
                if seen is None:
                    return None
                return seen, "ok" if seen == own else "ok-unpinned"

            verify: dict[str, str | None] = {}
            for item in items:
                if is_index_key(item.key):
                    src = item.key.split("/")[2]
                    found = key_of(src)
                    verify[src] = found[0] if found else None
            indexes = verified_entries(items, verify)
            bad = 0
            for item in items:
                if is_index_key(item.key):
                    continue
                where = parse_key(item.key)
                if where is None:
                    click.echo(f"?\t?\t{item.key}\tnot an export key", err=True)
                    continue
                to, src, kind, name = where
                try:
                    sealed = bool(json.loads(item.value).get("sealed"))
                    how = "sealed" if sealed else "signed"
                except (ValueError, AttributeError):
                    how = "?"
                found = key_of(src)
                if found is None:
                    status = "unverified"
                else:
                    try:
                        _exp, seq = open_record_seq(None, None, item, found[0])
                    except ValueError as e:
                        forged = "signature" in str(e) or "does not match" in str(e)
                        status = "FORGED" if forged else "bad-record"
                    else:
                        listed = (indexes.get((to, src)) or {}).get(entry_name(item.key))
                        current = listed == (seq, record_digest(item.value))
                        status = found[1] if current else "STALE"
                if status in ("FORGED", "STALE", "bad-record"):
                    bad += 1
                click.echo(f"{to}\t{src}\t{kind}[{name}]\t{how}\t{status}")
            return 1 if bad else 0

        sys.exit(with_world(state_dir, opts, body, read_only=True))
