"""This host in the World: its member record, the resources it exports, and the
live query (`collect`) for resources other hosts export to it.

Sits above the engine and the World and joins them; the engine knows nothing
of exports, the World nothing of resources.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import msgspec

from evergraph import __version__
from evergraph.engine.contract import Registry, Resource
from evergraph.engine.model import CollectSpec, GraphModel
from evergraph.errors import InputError
from evergraph.world.exports import (
    EVERYONE,
    EXPORTED,
    Exported,
    export_key,
    make_record,
    open_record,
    parse_key,
)
from evergraph.world.hostkeys import HostKeys, KeyError_
from evergraph.world.kv import KV, Compacted, WorldError
from evergraph.world.members import HOSTKEYS, Member, Membership, host_keys

log = logging.getLogger("evergraph.cluster")

#: (to, kind, name, params) of one export
ExportItem = tuple[str, str, str, dict[str, Any]]


def exports_of(model: GraphModel) -> list[ExportItem]:
    """What `model` exports: one item per resource and target host (before grouping)."""
    out: list[ExportItem] = []
    for res in model.resources.values():
        targets = res.meta.export
        if not targets:
            continue
        params = msgspec.to_builtins(res)
        params.pop("meta", None)  # the collecting host decides its own meta
        for to in targets:
            out.append((to, res.kind, res.name, params))
    return out


class Cluster:
    def __init__(
        self, kv: KV, keys: HostKeys, host: str, registry: Registry, ttl: float = 10.0
    ) -> None:
        self.kv = kv
        self.keys = keys
        self.host = host
        self.registry = registry
        self.membership = Membership(
            kv,
            Member(host=host, public=keys.public, verify=keys.verify, version=__version__),
            ttl,
        )
        self._exports: list[ExportItem] = []
        #: key -> params last written, so an unchanged export is not re-sealed
        self._published: dict[str, dict[str, Any]] = {}
        self._verify: dict[str, str] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._reconcile_lock = asyncio.Lock()

    async def start(self) -> None:
        await self.membership.start()
        self._tasks.append(asyncio.create_task(self._follow_hostkeys(), name="hostkeys"))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks.clear()
        with contextlib.suppress(WorldError):
            await self.membership.stop()

    # -- exports ------------------------------------------------------------------
    async def publish(self, exports: list[ExportItem]) -> None:
        """Make this host's records in the World match `exports` (put new and changed
        ones, withdraw the rest)."""
        self._exports = exports
        await self._reconcile()

    async def _reconcile(self) -> None:
        async with self._reconcile_lock:
            want = {
                export_key(to, self.host, kind, name): (to, kind, name, params)
                for to, kind, name, params in self._exports
            }
            items, _ = await self.kv.range(EXPORTED)
            mine = {
                i.key for i in items if (w := parse_key(i.key)) is not None and w[1] == self.host
            }
            for key in sorted(mine - want.keys()):
                log.info("export withdrawn: %s", key)
                await self.kv.delete(key)
                self._published.pop(key, None)
            for key, (to, kind, name, params) in sorted(want.items()):
                if key in mine and self._published.get(key) == params:
                    continue
                public = None
                if to != EVERYONE:
                    rec = await host_keys(self.kv, to)
                    if rec is None:
                        log.warning(
                            "export %s[%s] to %s waits for that host's keys", kind, name, to
                        )
                        continue
                    public = rec.public
                try:
                    value = make_record(self.keys, self.host, to, kind, name, params, public)
                except KeyError_ as e:
                    log.warning("export %s[%s] to %s: %s", kind, name, to, e)
                    continue
                await self.kv.put(key, value)
                self._published[key] = params
                log.info("exported %s[%s] to %s", kind, name, to)

    async def _follow_hostkeys(self) -> None:
        """New host keys: retry exports waiting for them; forget cached verify keys."""
        rev = 0
        while True:
            try:
                if rev == 0:
                    _, rev = await self.kv.range(HOSTKEYS)
                async for batch in self.kv.watch(HOSTKEYS, rev + 1):
                    rev = batch[-1].revision
                    for ev in batch:
                        self._verify.pop(ev.key[len(HOSTKEYS) :], None)
                    await self._reconcile()
                return
            except (WorldError, Compacted) as e:
                log.warning("world: host keys watch broke (%s); resyncing", e)
                rev = 0
                await asyncio.sleep(0.5)

    # -- collect --------------------------------------------------------------------
    async def _verify_key(self, host: str) -> str | None:
        if host not in self._verify:
            rec = await host_keys(self.kv, host)
            if rec is None:
                return None
            self._verify[host] = rec.verify
        return self._verify[host]

    async def collected(self, specs: list[CollectSpec]) -> tuple[list[Exported], int]:
        """The exports meant for this host that match `specs`, and the revision read."""
        out: list[Exported] = []
        rev = 0
        for to in (self.host, EVERYONE):
            items, r = await self.kv.range(f"{EXPORTED}{to}/")
            rev = max(rev, r)
            for item in items:
                where = parse_key(item.key)
                if where is None or where[1] == self.host:
                    continue
                if not any(s.kind == where[2] for s in specs):
                    continue
                try:
                    exp = open_record(self.keys, self.host, item, await self._verify_key(where[1]))
                except ValueError as e:
                    log.warning("rejected export: %s", e)
                    continue
                if any(s.matches(exp.kind, exp.src, exp.name, exp.params) for s in specs):
                    out.append(exp)
        return out, rev

    async def watch_collected(
        self,
        specs: list[CollectSpec],
        on_change: Callable[[list[Exported]], None],
        known: list[Exported] | None = None,
    ) -> None:
        """Call `on_change(exports)` whenever the collected set differs from the last one
        reported (`known`: what the caller has already; None = report the first read).
        Runs until cancelled."""
        last = known
        while True:
            try:
                current, rev = await self.collected(specs)
                if current != last:
                    last = current
                    on_change(current)
                async for _batch in self.kv.watch(EXPORTED, rev + 1):
                    current, _ = await self.collected(specs)
                    if current != last:
                        last = current
                        on_change(current)
                return
            except (WorldError, Compacted) as e:
                log.warning("world: exports watch broke (%s); resyncing", e)
                await asyncio.sleep(0.5)

    def to_resources(self, exports: list[Exported]) -> list[Resource]:
        """Collected exports as resources of this host's graph; bad ones are skipped."""
        out = []
        for exp in exports:
            cls = self.registry.get(exp.kind)
            where = f"{exp.kind}[{exp.name}] exported by {exp.src}"
            if cls is None:
                log.warning("rejected export %s: unknown kind here", where)
                continue
            try:
                res = msgspec.convert({**exp.params, "name": exp.name}, cls)
                res.validate()
            except (msgspec.ValidationError, InputError) as e:
                log.warning("rejected export %s: %s", where, e)
                continue
            out.append(res)
        return out


def merge(model: GraphModel, collected: list[Resource]) -> GraphModel:
    """`model` plus the collected resources; a local resource wins over a collected one."""
    for res in collected:
        if res.ident in model.resources:
            if not model.resources[res.ident].cmp(res):
                log.warning("collected %s conflicts with a local resource: skipped", res.ident)
            continue
        model.add(res, origin="collected")
    return model
