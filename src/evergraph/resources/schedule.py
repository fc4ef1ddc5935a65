"""schedule: volunteer this host for a role; one elected leader chooses who holds it.

Every host whose graph has `schedule[NS]` volunteers for namespace NS (the
name, or `namespace`); the volunteers elect a leader, which chooses up to
`max` of them (`strategy`) and publishes the choice. `world.schedule(NS)` in a
Python graph and `evergraph schedule NS` read it; this resource sends it as
`hosts` (one per line). Semantics of ttl, persist and withdraw:
cluster/scheduler.py.

The watch volunteers (as soon as the first check_apply applies: never under
noop), runs the election and, while this host leads, the decisions; it stops
with the vertex (the election lease is revoked: another volunteer leads at
once). check_apply only checks that our volunteer record is in place.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Annotated, Any, ClassVar

from evergraph.cluster.scheduler import (
    DEFAULT_MAX,
    DEFAULT_TTL,
    Options,
    Volunteer,
    chosen,
    namespace_problem,
    watch_chosen,
)
from evergraph.engine.contract import Handle, Resource, doc, register, watch_snapshots
from evergraph.errors import ResourceError
from evergraph.world.kv import WorldError

#: how long check_apply waits for our volunteer record to be written (seconds)
_VOLUNTEER_TIMEOUT = 30.0


@register("schedule")
class Schedule(Resource, kw_only=True, dict=True, forbid_unknown_fields=True):
    """Volunteers this host for a namespace; an elected leader chooses `max` hosts (World)."""

    sends: ClassVar[dict[str, Any]] = {"hosts": str}

    namespace: Annotated[str, doc("the namespace to volunteer for; default the name")] = ""
    strategy: Annotated[
        str, doc("rr: keep who is chosen, fill by name (stable); alpha: first max by name")
    ] = "rr"
    max: Annotated[int, doc("how many hosts to choose (>= 1)")] = DEFAULT_MAX
    ttl: Annotated[int, doc("seconds the volunteer record outlives this agent (lease, >= 1)")] = (
        DEFAULT_TTL
    )
    persist: Annotated[
        bool, doc("a chosen host stays chosen when its record vanishes, until it withdraws")
    ] = False
    withdraw: Annotated[
        bool, doc("leaving the graph deletes the volunteer record at once (not after ttl)")
    ] = False

    def _ns(self) -> str:
        return self.namespace or self.name

    def _options(self) -> Options:
        return Options(
            strategy=self.strategy,
            max=self.max,
            ttl=self.ttl,
            persist=self.persist,
            withdraw=self.withdraw,
        )

    def validate(self) -> None:
        why = namespace_problem(self._ns())
        if why is not None:
            raise self.bad("namespace" if self.namespace else "name", why)
        bad = self._options().problem()
        if bad is not None:
            raise self.bad(*bad)
        if self.meta.poll != 0:
            raise self.bad(
                "meta.poll", "a schedule must watch: its watch keeps the volunteer record alive"
            )

    async def init(self, handle: Handle) -> None:
        await super().init(handle)
        self._volunteer: Volunteer | None = None
        self._start = asyncio.Event()
        self._hosts: list[str] | None = None

    def sent(self) -> dict[str, object]:
        if self._hosts is None:
            return {}
        return {"hosts": "".join(f"{h}\n" for h in self._hosts)}

    async def watch(self) -> None:
        kv = self.handle.world
        vol = Volunteer(kv, self._ns(), self.handle.hostname, self._options(), self.handle.event)
        self._volunteer = vol

        async def volunteer() -> None:
            await self._start.wait()  # (set already if a restarted watch volunteered before)
            await vol.run()

        async with asyncio.TaskGroup() as tg:
            tg.create_task(volunteer(), name=f"schedule-{self._ns()}")
            await watch_snapshots(self.handle, watch_chosen(kv, self._ns()))

    async def check_apply(self, apply: bool) -> bool:
        kv = self.handle.world
        vol = self._volunteer
        try:
            self._hosts = await chosen(kv, self._ns())
            if vol is not None and self._start.is_set() and await vol.record_ok():
                return True
        except WorldError as e:
            raise ResourceError(f"world: {e}") from None
        self.handle.changed("volunteer", None, f"{self.handle.hostname} for {self._ns()}")
        if not apply:
            return False
        if vol is None:
            raise ResourceError("cannot volunteer: the watch is not running")
        self._start.set()
        try:
            async with asyncio.timeout(_VOLUNTEER_TIMEOUT):
                await vol.volunteered.wait()
        except TimeoutError:
            raise ResourceError(
                f"could not volunteer within {_VOLUNTEER_TIMEOUT:g} s (is the World reachable?)"
            ) from None
        with contextlib.suppress(WorldError):
            self._hosts = await chosen(kv, self._ns())
        return False

    async def cleanup(self) -> None:
        vol = self._volunteer
        if vol is None:
            return
        self._volunteer = None
        await vol.leave(withdraw=self.withdraw and self._start.is_set())
