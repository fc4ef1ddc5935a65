"""The deploy frontend: `evergraph run` without FILE follows the newest deploy.

Only deploys signed by a trusted deployer run: the keys given with `run
--deployer KEY` (and no other), or else the deployers pinned in the state
dir's pins.json, the first signer seen being pinned (trust on first use). An
unsigned, wrongly signed, malformed or untrusted deploy is logged once and
refused; the running graph stays.

Each deploy (`evergraph deploy FILE`) is materialised under
`STATE/deploys/<n>/` (checked against its hashes, written to a temporary
directory and renamed, so a directory that exists is complete) and run by the
frontend its entry file calls for (YAML or Python). A newer deploy swaps in
live; until it does, the current one keeps running with its own live updates
(a Python graph's World reads, collected exports). A deploy that fails to
fetch or load is logged and skipped: the running graph stays.

A follower never goes back: the newest deploy it ran is kept in
`STATE/deploy-high-water.json` (its signed record), and a deploy older
than it (a record deleted and the head pointed back, an old World put back)
is refused, logged once, across restarts. At start the mark's deploy runs
again from its materialised copy (or fetched again), so a World that lost
its newest deploy cannot take this host back to an older one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import msgspec

from evergraph._util.atomic import atomic_write
from evergraph.cluster import deploys
from evergraph.cluster.hostkeys import fingerprint
from evergraph.cluster.pins import Pins, PinsError
from evergraph.engine.contract import Registry
from evergraph.engine.model import GraphModel
from evergraph.errors import InputError
from evergraph.frontends.base import Context, Frontend
from evergraph.frontends.open import open_frontend
from evergraph.world.kv import WorldError

log = logging.getLogger("evergraph.frontend.deploy")

#: materialised deploys kept on disk (the running one and a few before it)
KEEP = 3
#: the newest deploy run here (its record), under the state dir
MARK = "deploy-high-water.json"


class DeployFrontend(Frontend):
    label = "deploys"
    needs_shared_world = True

    def __init__(self, registry: Registry, deployers: Sequence[str] = ()) -> None:
        self.registry = registry
        #: the trusted deployers' verify keys (base64); empty: the pinned ones
        self.deployers = check_deployers(deployers)
        self._stream: AsyncIterator[deploys.Deploy] | None = None
        self._inner: Frontend | None = None
        #: the deploy running now
        self.current: deploys.Deploy | None = None
        #: what `follow` is given: the trust, and the high-water mark it started from
        self._trust_now: deploys.Trust | None = None
        self._after: deploys.Deploy | None = None
        #: set when pins.json's trusted deployers changed (the follow starts again)
        self._retrust: asyncio.Event | None = None

    def load(self) -> GraphModel:
        raise InputError("give a graph FILE: without one, `run` follows deploys from the World")

    async def _open(self, ctx: Context, d: deploys.Deploy) -> tuple[Frontend, GraphModel]:
        assert ctx.kv is not None
        root = ctx.state_dir / "deploys"
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        # named by number and hash: a World started afresh reuses numbers
        dest = root / f"{d.n}-{d.hash[:16]}"
        if not dest.is_dir():
            await deploys.fetch(ctx.kv, d, dest)
        inner = open_frontend(dest / d.entry, self.registry)
        inner.preload()
        model = await inner.first(ctx)
        _prune(root, keep=d.n)
        return inner, model

    async def _next_live(self, ctx: Context) -> tuple[Frontend, GraphModel]:
        """`_next`, started again whenever the trusted deployers change in pins.json
        (another process edited it: a deployer pinned or dropped reaches a running
        follower within a second, and its newest deploy is looked for at once)."""
        while True:
            retrust = self._retrust
            if retrust is None:
                return await self._next(ctx)
            retrust.clear()
            found = await self._next_unless(ctx, retrust)
            if found is not None:
                return found
            assert ctx.kv is not None
            assert self._trust_now is not None
            old, self._stream = self._stream, None
            if old is not None and hasattr(old, "aclose"):
                await old.aclose()
            log.info("the trusted deployers changed (pins.json): following their deploys")
            self._stream = deploys.follow(ctx.kv, self._trust_now, after=self._after)

    async def _next_unless(
        self, ctx: Context, retrust: asyncio.Event
    ) -> tuple[Frontend, GraphModel] | None:
        """`_next`, or None if `retrust` is set first: the first of two, both owned by
        a TaskGroup (neither outlives the call)."""
        found: list[tuple[Frontend, GraphModel]] = []
        failed: list[Exception] = []

        async def next_deploy() -> None:
            try:
                found.append(await self._next(ctx))
            except Exception as e:  # raised to the caller as it is, not in a group
                failed.append(e)

        async with asyncio.TaskGroup() as tg:
            nxt = tg.create_task(next_deploy())
            changed = tg.create_task(retrust.wait())
            await asyncio.wait({nxt, changed}, return_when=asyncio.FIRST_COMPLETED)
            nxt.cancel()
            changed.cancel()
        if failed:
            raise failed[0]
        return found[0] if found else None

    async def _next(self, ctx: Context) -> tuple[Frontend, GraphModel]:
        """The next deploy that loads (waiting for one to be published)."""
        assert self._stream is not None
        async for d in self._stream:
            try:
                inner, model = await self._open(ctx, d)
            except (deploys.DeployError, InputError) as e:
                log.error("deploy %d: %s (skipped; waiting for the next deploy)", d.n, e)
                continue
            self._ran(ctx, d)
            return inner, model
        raise WorldError("the deploys watch ended")

    def _ran(self, ctx: Context, d: deploys.Deploy) -> None:
        """`d` runs now: it is the high-water mark (on disk before anything else runs)."""
        self.current = self._after = d
        try:
            atomic_write(ctx.state_dir / MARK, msgspec.json.encode(d))
        except OSError as e:
            log.error("%s: cannot keep the high-water mark: %s", ctx.state_dir / MARK, e)
        log.info("running deploy %d (%s, entry %s)", d.n, d.hash[:12], d.entry)

    def _mark(self, ctx: Context) -> deploys.Deploy | None:
        """The newest deploy run here before (verified again), or None; InputError
        naming the file if it is damaged."""
        path = ctx.state_dir / MARK
        try:
            value = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise InputError(f"{path}: {e.strerror}") from None
        try:
            return deploys.decode_record(value, str(path))
        except deploys.DeployError as e:
            raise InputError(
                f"{e} (the newest deploy run here; remove the file to accept any deploy)"
            ) from None

    async def _resume(
        self, ctx: Context, trust: deploys.Trust, mark: deploys.Deploy
    ) -> tuple[Frontend, GraphModel] | None:
        """Run the high-water mark's deploy again, if its signer is still trusted and
        it loads (from its materialised copy, or fetched again); None, said why,
        otherwise."""
        log.info(
            "high-water mark: deploy %d (%s) ran here last (%s): no older deploy runs",
            mark.n,
            mark.hash[:12],
            ctx.state_dir / MARK,
        )
        try:
            # trusted now (never pinned from this file: after `hosts forget` the next
            # deploy seen is what pins a deployer)
            if mark.signer not in trust.trusted():
                raise deploys.DeployError(
                    f"it is signed by {fingerprint(mark.signer)}, not a trusted deployer now"
                )
            inner, model = await self._open(ctx, mark)
        except (deploys.DeployError, InputError, WorldError, PinsError, ValueError) as e:
            log.warning(
                "deploy %d (the high-water mark) cannot run again: %s; waiting for a newer deploy",
                mark.n,
                e,
            )
            return None
        self._ran(ctx, mark)
        return inner, model

    async def first(self, ctx: Context) -> GraphModel:
        if ctx.kv is None:
            raise InputError("without FILE, `run` follows deploys, and that needs a World")
        trust = self._trust_now = self._trust(ctx)
        mark = self._after = self._mark(ctx)
        resumed = await self._resume(ctx, trust, mark) if mark is not None else None
        self._stream = deploys.follow(ctx.kv, trust, after=self._after)
        if resumed is not None:
            self._inner, model = resumed
            return model
        with contextlib.suppress(deploys.DeployError):  # follow() skips a bad one, warning
            if await deploys.latest(ctx.kv) is None:
                log.info("no deploy in the World yet: waiting for `evergraph deploy FILE`")
        self._inner, model = await self._next_live(ctx)
        return model

    def _trust(self, ctx: Context) -> deploys.Trust:
        if self.deployers:
            names = ", ".join(fingerprint(k) for k in self.deployers)
            log.info("following deploys signed by %s (--deployer)", names)
            return deploys.Trust(keys=self.deployers)
        try:
            pins = Pins(ctx.state_dir)
            pinned = pins.trusted_deployers()
        except PinsError as e:
            raise InputError(str(e)) from None
        if ctx.watcher is not None:  # pins are live: an edit of the deployers reaches us
            retrust = self._retrust = asyncio.Event()

            def changed(_hosts: frozenset[str], deployers: bool) -> None:
                if deployers:
                    retrust.set()

            pins.listen(changed)
            ctx.watcher.subscribe(str(pins.path), lambda _mask: pins.poll())
        if pinned:
            names = ", ".join(fingerprint(k) for k in pinned)
            log.info("following deploys signed by %s (pinned in %s)", names, pins.path)
        else:
            log.info(
                "no deployer pinned yet: the first deploy's signer will be "
                "(`run --deployer KEY` names deployers instead)"
            )
        return deploys.Trust(pins=pins)

    async def updates(self, ctx: Context) -> AsyncIterator[GraphModel]:
        assert self._inner is not None
        queue: asyncio.Queue[tuple[int, str, Any]] = asyncio.Queue()
        generation = 0

        async def pump_inner(fe: Frontend, gen: int) -> None:
            try:
                async for m in fe.updates(ctx):
                    await queue.put((gen, "graph", m))
            except Exception as e:
                await queue.put((gen, "error", e))

        async def pump_deploys() -> None:
            try:
                while True:
                    await queue.put((-1, "deploy", await self._next_live(ctx)))
            except Exception as e:
                await queue.put((-1, "error", e))

        inner_task = asyncio.create_task(pump_inner(self._inner, generation))
        deploy_task = asyncio.create_task(pump_deploys())
        try:
            while True:
                gen, what, payload = await queue.get()
                if what == "error":
                    raise payload
                if what == "graph":
                    if gen == generation:  # not a late graph of a replaced deploy
                        yield payload
                    continue
                inner, model = payload
                inner_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await inner_task
                generation += 1
                self._inner = inner
                inner_task = asyncio.create_task(pump_inner(inner, generation))
                yield model
        finally:
            for t in (inner_task, deploy_task):
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await t


def _prune(root: Path, keep: int) -> None:
    """Remove materialised deploys older than the last KEEP up to `keep`, and what an
    interrupted fetch left behind."""
    for d in root.iterdir():
        n = d.name.split("-", 1)[0]
        if (n.isdigit() and int(n) <= keep - KEEP) or d.name.endswith(".tmp"):
            shutil.rmtree(d, ignore_errors=True)


def check_deployers(keys: Sequence[str]) -> list[str]:
    """The deployer keys, each a base64 Ed25519 verify key in canonical form;
    InputError naming --deployer for a bad one."""
    out: list[str] = []
    for k in keys:
        try:
            key = deploys.canonical_key(k)
        except ValueError as e:
            raise InputError(
                f"{k!r} is not a deployer's verify key ({e}; `evergraph deploy` prints the key "
                "that signed a deploy)",
                "--deployer",
            ) from None
        if key not in out:
            out.append(key)
    return out


def trust_deployers(frontend: Frontend, keys: Sequence[str]) -> None:
    """Make an agent following deploys run only those signed by `keys` (`run
    --deployer`); InputError for a bad key or a frontend that does not follow deploys."""
    checked = check_deployers(keys)
    if not checked:
        return
    if not isinstance(frontend, DeployFrontend):
        raise InputError(
            "names who may deploy to an agent following deploys: give no FILE with it",
            "--deployer",
        )
    frontend.deployers = checked
