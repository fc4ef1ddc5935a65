"""The engine: runs a graph of vertices in parallel, in dependency order, forever.

Scheduling rule (SPEC §2.1). A vertex runs check_apply only when it is
*pending* (startup, watch event, refresh, retry), its watch reported ready,
and every parent is *clean* (its last check_apply succeeded and it has no run
pending or in flight). A parent that finishes successfully pokes its
children; a child with nothing pending ignores the poke — its cached clean
state answers without a call to check_apply. A failed parent therefore holds
every descendant back until it succeeds. Events during a run only set
`pending`, so any number of them cause exactly one more run.

This module keeps the run, the stop and the queries; the rest is split by
subject (see state.py): scheduling.py, swap.py, outcomes.py, guard.py,
sendrecv.py, reverse.py; store.py keeps what must survive a crash.

Ownership: every task (watches, applies, retry timers, the graph-update
follower) lives in one TaskGroup. One stop signal (stop.py) says how far
stopping went; the tasks end by cancellation. Resource code is never trusted:
every call into it goes through guard.py, and an exception becomes a recorded
failure of `kind[name]`, never an engine crash.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from evergraph.engine.changes import log_data
from evergraph.engine.contract import Resource
from evergraph.engine.express import Express
from evergraph.engine.guard import Guard
from evergraph.engine.model import Edge, GraphModel
from evergraph.engine.outcomes import Outcomes
from evergraph.engine.reverse import Reversal
from evergraph.engine.scheduling import Scheduling
from evergraph.engine.sendrecv import SendRecv
from evergraph.engine.state import YIELD_EVERY, yield_now
from evergraph.engine.status import VertexStatus, masked_params
from evergraph.engine.stop import GRACEFUL, HARD
from evergraph.engine.swap import Swap
from evergraph.errors import ResourceError

if TYPE_CHECKING:
    from evergraph.cluster.hostkeys import HostKeys

__all__ = ["EXIT_WOULD_CHANGE", "YIELD_EVERY", "Engine"]

log = logging.getLogger("evergraph.engine")

#: exit status of a noop run that exits once converged (`--noop --converged-exit`, or
#: `--no-watch`) when something would change; 0: nothing would, 1: a resource failed
EXIT_WOULD_CHANGE = 3


class Engine(Express, Scheduling, Outcomes, Guard, Swap, SendRecv, Reversal):
    """One running graph. Built with everything the resources may use, handed in
    by the owner (the agent): see `EngineState.__init__`."""

    # -- public -------------------------------------------------------------
    async def run(self, model: GraphModel, updates: AsyncIterator[GraphModel] | None = None) -> int:
        """Run `model` (then each graph `updates` yields) until stopped; returns the exit status."""
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                aux: list[asyncio.Task[Any]] = []
                if self.settings.max_runtime is not None:
                    # counted from the engine's creation (the wait for a first graph too)
                    aux.append(tg.create_task(self._max_runtime(self.settings.max_runtime)))
                if not await self._express(model):
                    await self.swap(model)
                if updates is not None:
                    aux.append(tg.create_task(self._follow(updates)))
                self._check_idle()
                await self.stop.wait(GRACEFUL)
                await self._shutdown(aux)
                self._recap_at_exit()
        finally:
            self.converger.close()
            self._tg = None
            if self._own_services:
                await self.services.aclose()
        return self.exit_status()

    def keys(self) -> HostKeys:
        """The host's key pairs (ResourceError if the owner gave none)."""
        if self._keys is None:
            raise ResourceError("this run has no host keys")
        return self._keys()

    def status(self) -> tuple[VertexStatus, ...]:
        """A snapshot of every vertex, for observers."""
        return tuple(v.status() for v in self.vertices.values())

    def running(self) -> tuple[VertexStatus, ...]:
        """A snapshot of each vertex running now (cheap to poll: only those are built)."""
        return tuple(v.status() for v in self.vertices.values() if v.running)

    # read-only views for observers (HTTP, metrics): tuples and plain values
    def edges(self) -> tuple[Edge, ...]:
        return tuple(self._edges)

    def state_counts(self) -> collections.Counter[str]:
        return collections.Counter(v.state for v in self.vertices.values())

    def busy(self) -> bool:
        """A run is in flight, queued or due (retry), or a watch is not ready yet."""
        return bool(self._running or self._retrying or self._unready or self._queued)

    def params(self, ident: str) -> dict[str, object] | None:
        """`ident`'s parameters with its secrets masked (None: no such vertex)."""
        v = self.vertices.get(ident)
        return None if v is None else masked_params(v.res, v.secret_fields, v.mask)

    def request_stop(self) -> None:
        """First call: graceful (finish in-flight applies, for at most
        `settings.stop_grace` seconds; runs still waiting for a semaphore or a token
        end at once). Second: cancel them too (a command gets SIGTERM, then SIGKILL)."""
        if self.stop.level >= GRACEFUL:
            log.warning("second stop request: cancelling in-flight applies")
            self.stop.raise_to(HARD)
        else:
            log.info("stopping: finishing in-flight applies (again to cancel them)")
            self.stop.raise_to(GRACEFUL)

    def request_exit(self, code: int, by: str) -> None:
        """A resource (`exit`) ends the run with status `code`: stopped as on a first
        SIGTERM; the first code asked for is the exit status."""
        if self._exit_code is None:
            self._exit_code = code
            log.info("%s: asks to exit with status %d: stopping", by, code)
        self.stop.raise_to(GRACEFUL)

    def exit_status(self) -> int:
        """0 all clean, 1 a resource failed; a noop run that exits once converged (or
        is ended by its reader, `converged_report`): `EXIT_WOULD_CHANGE` if any
        resource would change; the status a resource asked
        for (`request_exit`) before all of these."""
        if self._exit_code is not None:
            return self._exit_code
        if self._cut_short:
            return 1
        vertices = self.vertices.values()
        if not all(v.ok and not v.failed for v in vertices):
            return 1
        s = self.settings
        # something would change, or may (a check that could not tell: unknown)
        if (
            s.noop
            and (s.converged_exit or s.converged_report or not s.watch)
            and any(v.changed_count or v.state == "unknown" for v in vertices)
        ):
            return EXIT_WOULD_CHANGE
        return 0

    # -- convergence and stopping ------------------------------------------------------
    def _on_converged(self) -> None:
        # one walk of the vertices (at 1M vertices each walk holds the loop ~0.1 s)
        failed: list[str] = []
        named, others = self._recap_parts(failed)
        total = others[0] + len(named)
        changed = sum(1 for s in named if s.changed_count)
        took = self.clock.monotonic() - self.started
        if failed:
            log.error(
                "converged with %d of %d vertices not clean (%s) after %.2fs",
                len(failed),
                total,
                ", ".join(failed[:5]) + (", ..." if len(failed) > 5 else ""),
                took,
            )
        else:
            log.info(
                "converged: %d vertices clean, %d changed, after %.2fs",
                total,
                changed,
                took,
            )
        text, data = self.recaps.take_text(named, "converged", self.settings.noop, others)
        log_data(log, "%s", (text,), data, event="recap")  # (data: made if a handler reads it)
        if self.settings.converged_exit or not self.settings.watch:
            self.stop.raise_to(GRACEFUL)  # without watches, nothing would ever run again

    def _recap_statuses(
        self, failed: list[str] | None = None
    ) -> tuple[list[VertexStatus], tuple[int, int]]:
        """Snapshots of the vertices a recap may name (ever changed, or failing), and
        (how many others, how many of those are clean): no snapshot per clean vertex.
        `failed` gets the idents of the vertices not clean."""
        named: list[VertexStatus] = []
        others = clean = 0
        for v in self.vertices.values():
            state = v.state
            if failed is not None and not v.ok:
                failed.append(v.ident)
            if v.changed_count or state == "failed" or state == "retrying" or state == "unknown":
                named.append(v.status())
            else:
                others += 1
                if state == "clean" or state == "changed":
                    clean += 1
        return named, (others, clean)

    def _recap_parts(
        self, failed: list[str] | None = None
    ) -> tuple[list[VertexStatus], tuple[int, int]]:
        """`_recap_statuses`, with what an express run decided without a vertex (all
        of it, or all but the part left to the lane: express.py)."""
        express = self.expressed
        if express is None:
            return self._recap_statuses(failed)
        if not self.vertices:  # (the common case: no vertex at all)
            return express.made, (express.clean, express.clean)
        named, (others, clean) = self._recap_statuses(failed)
        return [*express.made, *named], (others + express.clean, clean + express.clean)

    def _recap_at_exit(self) -> None:
        """At exit, a last recap if it has news (the run never converged, or changed
        or failed something since the last recap)."""
        if not self.vertices or not self.recaps.news(self.vertices.values()):
            return
        named, others = self._recap_parts()
        text, data = self.recaps.take_text(named, "exit", self.settings.noop, others)
        log_data(log, "%s", (text,), data, event="recap")

    async def _max_runtime(self, seconds: float) -> None:
        """A hard bound: in-flight applies are cancelled (their commands get SIGTERM,
        then SIGKILL after a grace)."""
        await self.clock.sleep(max(0.0, self.started + seconds - self.clock.monotonic()))
        if self.busy() or not self.vertices:
            # work left undone (a check pending or running, a watch not ready, no
            # graph yet): the run was cut short, which is no success (exit 1)
            self._cut_short = True
            log.error(
                "max runtime of %ss reached with work undone: stopping, cancelling "
                "in-flight applies (exit status 1)",
                seconds,
            )
        else:
            log.info("max runtime of %ss reached: stopping", seconds)
        self.stop.raise_to(HARD)

    async def _shutdown(self, aux: list[asyncio.Task[Any]]) -> None:
        self.stop.raise_to(GRACEFUL)
        self._draining = True
        self.converger.close()
        ahead = self._ahead
        if ahead is not None:
            # what the children made that was not taken (below a failure, or a run
            # stopped early) is a change all the same. With every verdict come, the
            # child at the chore (the parse cache entry) finishes it while the agent
            # stops, and the run's end waits for it (cli/runner.py); a child still at
            # work is of no use now: stopped
            made = ahead.told()
            for i in ahead.stop() if made is None else made:
                res = ahead.resources[i]
                v = self.vertices.get(res.ident)
                if v is not None and v.res is res:
                    self._made_ahead(v, observed=True)
                else:  # pragma: no cover (every resource of the first graph has one)
                    log.info("%s: applied (made ahead)", res.ident)
            log.debug(
                "%d vertices found in their state ahead, %d made: no init, no check",
                self.ahead_runs,
                self.ahead_made,
            )
        for t in [*aux, *self._timers, *self._repairs.values()]:
            t.cancel()
        # by slices of YIELD_EVERY, a turn of the loop after each full one (a 1M graph:
        # keep the loop and leases turning); no counter per vertex (10k: ~1 ms a walk)
        every = list(self.vertices.values())
        for start in range(0, len(every), YIELD_EVERY):
            for v in every[start : start + YIELD_EVERY]:
                if v.unsubscribe is not None:  # (a one-shot run has none: no call per vertex)
                    self._unsubscribe(v)
                if v.watch_task is not None:
                    v.watch_task.cancel()
            if start + YIELD_EVERY <= len(every):
                await yield_now()
        for v in self._waiting:  # changed nothing yet: nothing to finish
            if v.apply_task is not None:
                v.apply_task.cancel()
        applies = {v.apply_task for v in self.vertices.values() if v.apply_task is not None}
        if applies:
            await self._end_applies(applies)
        nothing = Resource.cleanup  # (most kinds take nothing in init: no await for them)
        every = list(self.vertices.values())
        for start in range(0, len(every), YIELD_EVERY):
            for v in [
                v
                for v in every[start : start + YIELD_EVERY]
                if type(v.res).cleanup is not nothing or getattr(v.res, "_group_members", None)
            ]:
                await self._call_cleanup(v)
            if start + YIELD_EVERY <= len(every):
                await yield_now()

    async def _end_applies(self, applies: set[asyncio.Task[None]]) -> None:
        """Let in-flight applies finish, for `settings.stop_grace` seconds at most, or
        until a hard stop; then cancel what still runs and wait for it to end."""
        assert self._tg is not None
        ender = self._tg.create_task(self._grace_over(self.settings.stop_grace))
        try:
            while applies and not ender.done():
                done, _ = await asyncio.wait([*applies, ender], return_when=asyncio.FIRST_COMPLETED)
                applies -= done
            for t in applies:
                t.cancel()
            if applies:
                await asyncio.wait(applies)
        finally:
            ender.cancel()

    async def _grace_over(self, grace: float) -> None:
        """Ends at a hard stop, or once the stop grace has passed."""
        with contextlib.suppress(TimeoutError):
            async with self.clock.timeout(grace):
                await self.stop.wait(HARD)
                return
        log.warning("applies still running %ss after the stop: cancelling them", grace)
