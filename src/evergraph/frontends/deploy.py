"""The deploy frontend: `evergraph run` without FILE follows the newest deploy.

Each deploy (`evergraph deploy FILE`) is materialised under
`STATE/deploys/<n>/` (checked against its hashes, written to a temporary
directory and renamed, so a directory that exists is complete) and run by the
frontend its entry file calls for (YAML or Python). A newer deploy swaps in
live; until it does, the current one keeps running with its own live updates
(a Python graph's World reads, collected exports). A deploy that fails to
fetch or load is logged and skipped: the running graph stays.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from evergraph.engine.contract import Registry
from evergraph.engine.model import GraphModel
from evergraph.errors import InputError
from evergraph.frontends.base import Context, Frontend, open_frontend
from evergraph.world import deploys
from evergraph.world.kv import KV, WorldError

log = logging.getLogger("evergraph.frontend.deploy")

#: materialised deploys kept on disk (the running one and a few before it)
KEEP = 3


class DeployFrontend(Frontend):
    label = "deploys"
    needs_shared_world = True

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self._stream: AsyncIterator[deploys.Deploy] | None = None
        self._inner: Frontend | None = None
        #: the deploy running now
        self.current: deploys.Deploy | None = None

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

    async def _next(self, ctx: Context) -> tuple[Frontend, GraphModel]:
        """The next deploy that loads (waiting for one to be published)."""
        assert self._stream is not None
        async for d in self._stream:
            try:
                inner, model = await self._open(ctx, d)
            except (deploys.DeployError, InputError) as e:
                log.error("deploy %d: %s (skipped; waiting for the next deploy)", d.n, e)
                continue
            self.current = d
            log.info("running deploy %d (%s, entry %s)", d.n, d.hash[:12], d.entry)
            return inner, model
        raise WorldError("the deploys watch ended")

    async def first(self, ctx: Context) -> GraphModel:
        if ctx.kv is None:
            raise InputError("without FILE, `run` follows deploys, and that needs a World")
        self._stream = deploys.follow(ctx.kv)
        with contextlib.suppress(deploys.DeployError):  # follow() skips a bad one, warning
            if await deploys.latest(ctx.kv) is None:
                log.info("no deploy in the World yet: waiting for `evergraph deploy FILE`")
        self._inner, model = await self._next(ctx)
        return model

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
                    await queue.put((-1, "deploy", await self._next(ctx)))
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


async def publish_file(kv: KV, path: Path) -> deploys.Deploy | None:
    """`run FILE` on a cluster: publish FILE (and its directory) as the next deploy,
    so agents following deploys run it too; unless the newest deploy already holds
    exactly these files (a restart with nothing edited).
    Problems are logged, not fatal: this agent runs FILE either way."""
    try:
        entry, files = deploys.collect(path)
        shas = {p: hashlib.sha256(b).hexdigest() for p, b in files.items()}
        with contextlib.suppress(deploys.DeployError):  # a bad newest record: publish past it
            newest = await deploys.latest(kv)
            if newest is not None and newest.entry == entry and newest.files == shas:
                return newest
        d = await deploys.publish(
            kv, entry, files, git=None, force=True, by=deploys.whoami(), repo=None
        )
    except (deploys.DeployError, WorldError) as e:
        log.error("could not publish %s as a deploy: %s", path, e)
        return None
    log.info("published %s as deploy %d (%s)", path, d.n, d.hash[:12])
    return d


class Publisher:
    """`run FILE` on a cluster: publish FILE at start, and again after each save of
    it. A graph re-run for other reasons (a World change under a Python graph) costs
    one stat, not a read and hash of the whole directory."""

    def __init__(self, kv: KV, path: Path) -> None:
        self.kv = kv
        self.path = path
        self._seen: tuple[int, int] | None = None

    async def __call__(self) -> None:
        try:
            st = self.path.stat()
        except OSError:
            return  # mid-save; the graph that follows the save publishes
        seen = (st.st_mtime_ns, st.st_size)
        if seen != self._seen:
            self._seen = seen
            await publish_file(self.kv, self.path)
