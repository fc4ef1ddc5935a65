"""`evergraph cluster`: the self-forming etcd cluster (SPEC 4.8), seen and steered
from a member's state dir."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from evergraph.cli.world import state_dir_option
from evergraph.errors import InputError
from evergraph.world.kv import WorldError

if TYPE_CHECKING:
    from evergraph.cluster.ca import ClusterCA
    from evergraph.world.etcd import EtcdKV

T = TypeVar("T")

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """`90`, `90s`, `30m`, `24h`, `7d`: seconds; InputError otherwise."""
    t = text.strip().lower()
    unit = t[-1:] if t[-1:] in _UNITS else "s"
    num = t[:-1] if t[-1:] in _UNITS else t
    try:
        value = float(num) * _UNITS[unit]
    except ValueError:
        raise InputError(f"{text!r} is not a duration: e.g. 90s, 30m, 24h, 7d", "--ttl") from None
    if not 60 <= value <= 365 * 86400:
        raise InputError(f"{text!r}: a token lives from 1m to 365d", "--ttl")
    return value


def _with_cluster(state_dir: Path | None, body: Callable[[EtcdKV, ClusterCA], Awaitable[T]]) -> T:
    from evergraph.agent.run import existing_state_dir
    from evergraph.cli.main import _die
    from evergraph.cluster.seat import open_cluster

    async def main() -> T:
        kv, ca = await open_cluster(existing_state_dir(state_dir))
        try:
            return await body(kv, ca)
        finally:
            await kv.close()

    try:
        return asyncio.run(main())
    except InputError as e:
        _die(e)
    except WorldError as e:
        click.echo(f"evergraph: cluster: {e}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)


async def cluster_rows(kv: EtcdKV, ca: ClusterCA) -> list[dict[str, Any]]:
    """One row per member or standby: name, URLs, role, healthy, leader, lag."""
    from evergraph.cluster.revoke import CRL_KEY, read_crl
    from evergraph.cluster.roster import CANDIDATES, decode_candidate
    from evergraph.world.etcd_cluster import member_list, member_status

    members = await member_list(kv)
    statuses = await asyncio.gather(
        *(member_status(kv, m.client_urls[0]) if m.client_urls else _none() for m in members)
    )
    top = max((s.raft_index for s in statuses if s is not None), default=0)
    leader = next((s.leader for s in statuses if s is not None), 0)
    rows: list[dict[str, Any]] = []
    peers: set[str] = set()
    for m, st in zip(members, statuses, strict=True):
        peers.update(m.peer_urls)
        rows.append(
            {
                "name": m.name or "(starting)",
                "client_url": m.client_urls[0] if m.client_urls else "",
                "peer_url": m.peer_urls[0] if m.peer_urls else "",
                "role": "learner" if m.is_learner else "voter",
                "healthy": st is not None,
                "leader": m.id == leader,
                "lag": (top - st.raft_index) if st is not None else None,
            }
        )
    cands, _ = await kv.range(CANDIDATES)
    revoked = read_crl(ca, await kv.get(CRL_KEY)) or set()  # a removed host is none
    for item in cands:
        c = decode_candidate(ca, item, revoked)
        if c is None or c.peer_url in peers:
            continue
        rows.append(
            {
                "name": c.name,
                "client_url": c.client_url,
                "peer_url": c.peer_url,
                "role": "standby",
                "healthy": True,
                "leader": False,
                "lag": None,
            }
        )
    return sorted(
        rows, key=lambda r: ({"voter": 0, "learner": 1, "standby": 2}[r["role"]], r["name"])
    )


def _describe(r: dict[str, Any]) -> str:
    text = str(r["role"])
    if not r["healthy"]:
        text += " (unhealthy)"
    if r["leader"]:
        text += " leader"
    return text


async def _none() -> None:
    return None


def register(cli: click.Group, world_options: Callable[..., Callable[..., None]]) -> None:
    """`evergraph cluster` and its subcommands (the World is the state dir's cluster:
    `world_options` are not used)."""
    ctx = {"help_option_names": ["-h", "--help"], "max_content_width": 100}

    @cli.group(context_settings=ctx, invoke_without_command=True)
    @state_dir_option
    @click.option("--json", "as_json", is_flag=True, help="One JSON array of members.")
    @click.pass_context
    def cluster(click_ctx: click.Context, /, state_dir: Path | None, as_json: bool) -> None:
        """The self-forming etcd cluster of agents run with --etcd embedded.

        Without a subcommand, list its members and standbys: NAME, ROLE (voter,
        learner, standby), HEALTHY, LEADER, LAG (raft entries behind the leader),
        CLIENT and PEER URLs. Run it on a member, with that agent's --state-dir.

        \b
        Examples:
          evergraph cluster                  # who is in it
          evergraph cluster size 5           # grow to five voters
          evergraph cluster token --ttl 1h   # a join token for another host
          evergraph cluster watch            # membership changes as they happen
        """
        click_ctx.ensure_object(dict)
        click_ctx.obj["state_dir"] = state_dir
        if click_ctx.invoked_subcommand is not None:
            return
        rows = _with_cluster(state_dir, cluster_rows)
        if as_json:
            click.echo(json.dumps(rows, indent=1))
            return
        click.echo(
            f"{'NAME':<16} {'ROLE':<8} {'HEALTHY':<7} {'LEADER':<6} {'LAG':>5}  CLIENT  PEER"
        )
        for r in rows:
            lag = "-" if r["lag"] is None else str(r["lag"])
            click.echo(
                f"{r['name']:<16} {r['role']:<8} {'yes' if r['healthy'] else 'NO':<7} "
                f"{'*' if r['leader'] else '':<6} {lag:>5}  {r['client_url']}  {r['peer_url']}"
            )

    def sd(click_ctx: click.Context, state_dir: Path | None) -> Path | None:
        return state_dir or click_ctx.obj.get("state_dir")

    # N is parsed here, not by click: `x` or `-1` is refused with the one line that
    # names the valid sizes (click would print its usage, or call -1 an option)
    @cluster.command(context_settings={**ctx, "ignore_unknown_options": True})
    @state_dir_option
    @click.argument("text", metavar="N", required=False)
    @click.pass_context
    def size(click_ctx: click.Context, /, state_dir: Path | None, text: str | None) -> None:
        """Print the ideal number of voters, or set it to N (1, 3, 5, 7 or 9)."""
        from evergraph.cli.main import _die
        from evergraph.cluster.roster import (
            SIZE_KEY,
            VALID_SIZES,
            decode_size_record,
            encode_size,
            read_size,
            size_problem,
        )

        n: int | None = None
        if text is not None:
            try:
                n = int(text.strip())
            except ValueError:
                valid = ", ".join(map(str, VALID_SIZES))
                _die(
                    InputError(
                        f"{text!r} is not a cluster size: pick one of {valid}", "cluster size"
                    )
                )
            why = size_problem(n)
            if why:
                _die(InputError(why, "cluster size"))

        async def body(kv: EtcdKV, ca: ClusterCA) -> None:
            if n is None:
                click.echo(await read_size(kv, ca))
                return
            # dated after the record there now, whatever this host's clock says:
            # curators ignore a size record older than the newest they have seen
            cur = await kv.get(SIZE_KEY)
            rec = decode_size_record(ca, cur) if cur is not None else None
            at = max(time.time(), rec.set_at + 0.001 if rec is not None else 0.0)
            await kv.put(SIZE_KEY, encode_size(ca, n, at))
            click.echo(f"ideal size set to {n}")

        _with_cluster(sd(click_ctx, state_dir), body)

    @cluster.group(context_settings=ctx, invoke_without_command=True)
    @state_dir_option
    @click.option("--ttl", default="24h", show_default=True, help="How long the token is valid.")
    @click.pass_context
    def token(click_ctx: click.Context, /, state_dir: Path | None, ttl: str) -> None:
        """Print a new join token (give it to `run --etcd embedded --join-token-file`)."""
        from evergraph.cli.main import _die
        from evergraph.cluster.jointokens import create_token

        click_ctx.obj["token_state_dir"] = state_dir
        if click_ctx.invoked_subcommand is not None:
            return
        try:
            seconds = parse_duration(ttl)
        except InputError as e:
            _die(e)

        async def body(kv: EtcdKV, ca: ClusterCA) -> str:
            return (await create_token(kv, ca, seconds)).text()

        click.echo(_with_cluster(sd(click_ctx, state_dir), body))

    @token.command(context_settings=ctx)
    @state_dir_option
    @click.argument("which")
    @click.pass_context
    def revoke(click_ctx: click.Context, /, state_dir: Path | None, which: str) -> None:
        """Revoke a join token (its id, or the whole token)."""
        from evergraph.cli.main import _die
        from evergraph.cluster.jointokens import TokenError, revoke_token

        async def body(kv: EtcdKV, ca: ClusterCA) -> str:
            try:
                return await revoke_token(kv, ca, which)
            except TokenError as e:
                _die(InputError(str(e), "cluster token revoke"))

        d = state_dir or click_ctx.obj.get("token_state_dir") or click_ctx.obj.get("state_dir")
        click.echo(f"revoked token {_with_cluster(d, body)}")

    @cluster.command(context_settings=ctx)
    @state_dir_option
    @click.pass_context
    def watch(click_ctx: click.Context, /, state_dir: Path | None) -> None:
        """Print membership changes as they happen (Ctrl-C ends).

        First each member's role, then a line for each change seen: a member or
        standby new, gone, or in another role; and the curator's own line for
        each change it makes (what, and why)."""
        from evergraph.cluster.roster import LAST_CHANGE, decode_change
        from evergraph.world.follow import Tombstone, watch_one

        def say(line: str) -> None:
            click.echo(f"{time.strftime('%H:%M:%S')} {line}")
            sys.stdout.flush()

        async def roles(kv: EtcdKV, ca: ClusterCA) -> None:
            seen: dict[str, str] = {}
            first = True
            while True:
                try:
                    rows = await cluster_rows(kv, ca)
                except WorldError as e:
                    say(f"cluster unreachable: {e}")
                    await asyncio.sleep(1)
                    continue
                now = {r["name"]: _describe(r) for r in rows}
                for name in sorted(set(now) | set(seen)):
                    a, b = seen.get(name), now.get(name)
                    if a == b:
                        continue
                    if first:
                        say(f"{name}: {b}")
                    elif a is None:
                        say(f"{name}: new, {b}")
                    elif b is None:
                        say(f"{name}: gone (was {a})")
                    else:
                        say(f"{name}: {a} -> {b}")
                seen, first = now, False
                await asyncio.sleep(0.5)

        async def curator_lines(kv: EtcdKV) -> None:
            # every change the curator makes, as it tells it (the first snapshot is
            # an old change: not printed)
            first = True
            async for snap in watch_one(kv, LAST_CHANGE):
                change = None if isinstance(snap, Tombstone) else decode_change(snap)
                if not first and change is not None:
                    say(f"curator {change.by}: {change.line}")
                first = False

        async def body(kv: EtcdKV, ca: ClusterCA) -> None:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(curator_lines(kv))
                tg.create_task(roles(kv, ca))

        _with_cluster(sd(click_ctx, state_dir), body)

    @cluster.command(context_settings=ctx)
    @state_dir_option
    @click.argument("name")
    @click.pass_context
    def remove(click_ctx: click.Context, /, state_dir: Path | None, name: str) -> None:
        """Remove host NAME from the cluster and revoke its certificates."""
        from evergraph.cli.main import _die
        from evergraph.cluster.revoke import remove_host

        async def body(kv: EtcdKV, ca: ClusterCA) -> str:
            try:
                return await remove_host(kv, ca, name)
            except LookupError as e:
                _die(InputError(str(e), "cluster remove"))

        click.echo(_with_cluster(sd(click_ctx, state_dir), body))
