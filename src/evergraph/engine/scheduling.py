"""Scheduling: when a vertex runs, and the state machine of one run.

A watch's `ready()` and `event()` (through the vertex, its handle) and a parent's
success poke a vertex; `_poke` queues it if it may run now (engine.py's
docstring has the rule); `_drain` starts queued runs a batch per loop turn;
`_start` runs it (as a task, or inline for an eager kind: guard.py); `_finish`
hands the outcome to outcomes.py. Counters kept here (`_running`, `_queued`,
`_unready`; `_retrying` in outcomes.py) say whether the engine is idle
(`_check_idle`, state.py).
"""

from __future__ import annotations

import asyncio
import logging
import math

from evergraph._util.crash import crash_point
from evergraph.engine.state import DRAIN_BATCH, SUSPENDED_MAX, EngineState, error_text
from evergraph.engine.vertex import Vertex

log = logging.getLogger("evergraph.engine")


class Scheduling(EngineState):
    def vertex_ready(self, v: Vertex) -> None:
        if v.watch_ready:
            return
        v.watch_ready = True
        self._unready -= 1
        self._poke(v)
        self._check_idle()

    def vertex_event(self, v: Vertex) -> None:
        if v.failed or v.res.meta.hidden or self.vertices.get(v.ident) is not v:
            # a late event of a vertex already swapped out is dropped; one of a
            # vertex failed for good tries it again (drift is repaired, always)
            if v.failed and v.repair_delay >= 0 and self.vertices.get(v.ident) is v:
                self._revive(v, "an event")
            return
        self.events += 1
        if not v.pending:
            v.pending = True
            self.converger.busy()
            if v.state == "clean" or v.state == "changed":
                self._observe(v, "pending")  # observers time a repair from here
        self._poke(v)

    # -- scheduling ---------------------------------------------------------------
    def _poke(self, v: Vertex) -> None:
        """Queue `v` for a run if it may run now (see the module docstring)."""
        if v.queued or not self._runnable(v):
            return
        if v.res.meta.hidden:
            self._settle_hidden(v)
            return
        v.queued = True
        self._queued += 1
        self._ready.append(v)
        self.converger.busy()
        if not self._drain_scheduled:
            self._drain_scheduled = True
            asyncio.get_running_loop().call_soon(self._drain)  # a loop turn, no time

    def _settle_hidden(self, v: Vertex) -> None:
        """A hidden vertex due to run (it received a value) is never applied: it takes
        the values it received, in the graph's order like a run would, and stays clean."""
        v.pending = False
        if v.inbox:
            v.running = True
            self._running += 1
            assert self._tg is not None
            v.apply_task = self._tg.create_task(self._receive_hidden(v))

    async def _receive_hidden(self, v: Vertex) -> None:
        try:
            while v.inbox:
                await self._receive(v)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.error("%s: (hidden) refused the values it received: %s", v.ident, e)
        finally:
            v.running = False
            v.apply_task = None
            self._running -= 1
        for c in v.children:
            self._poke(c)  # held back while it was taking the values
        self._check_idle()

    def _runnable(self, v: Vertex) -> bool:
        if not v.pending or v.running or v.failed or v.retry_wait or not v.watch_ready:
            return False
        if self.stopping or self.vertices.get(v.ident) is not v:
            return False
        for p in v.parents:  # noqa: SIM110 (a loop, `clean` inlined: 3 calls per vertex)
            if not p.ok or p.pending or p.running:
                return False  # held back: p pokes us on success
        return True

    def _drain(self) -> None:
        """Start queued runs; a batch at a time, so the loop stays responsive."""
        self._drain_scheduled = False
        for _ in range(DRAIN_BATCH):
            if not self._ready or self._suspended >= SUSPENDED_MAX:
                break  # (a suspended check that ends drains again: _finish_later)
            v = self._ready.popleft()
            v.queued = False
            self._queued -= 1
            if self._runnable(v):  # still: a parent may have turned dirty since
                self._start(v)
        if self._ready and self._suspended < SUSPENDED_MAX:
            self._drain_scheduled = True
            asyncio.get_running_loop().call_soon(self._drain)  # a loop turn, no time
        self._check_idle()

    def _start(self, v: Vertex) -> None:
        v.running = True
        v.pending = False
        self._running += 1
        res = v.res
        meta = res.meta
        assert self._tg is not None
        if not (
            res.eager
            and not meta.sema
            and meta.timeout is None
            and meta.limit == math.inf
            and self._global_sema is None
            and not v.inbox
            and not meta.reverse
            and not getattr(res, "_group_members", None)
        ):
            v.apply_task = self._tg.create_task(self._process(v))
            return
        # Eager: a kind whose check_apply is local syscalls runs inline, with
        # no task (guard.py); if it suspends after all, a task drives the rest.
        apply = not (self.settings.noop or meta.noop)
        v.refresh_now, v.refresh_flag = v.refresh_flag, False
        self._observe(v, "running")
        self._intend(v, apply)
        self._check_apply_inline(v, apply)

    async def _process(self, v: Vertex) -> None:
        res = v.res
        apply = not (self.settings.noop or res.meta.noop)
        v.refresh_now, v.refresh_flag = v.refresh_flag, False
        self._observe(v, "running")
        error: str | None = "cancelled"
        result = True
        try:
            if v.inbox:
                res = await self._receive(v)
            if res.meta.reverse and apply and not v.reversal_saved:
                self._capture_reversal(v)
            self._intend(v, apply)
            result = await self._guarded_check_apply(v, res, apply)
            error = None
        except asyncio.CancelledError:
            raise
        except Exception as e:
            error = error_text(e, res)
        finally:
            self._finish(v, result, error, apply)

    def _intend(self, v: Vertex, apply: bool) -> None:
        """Write-ahead: before a vertex with notify children may change anything, say
        whom to refresh (see store.py); removed once their flags are written."""
        if apply and v.notify_children:
            v.intent = self.store.intend(
                v.res.kind, v.res.name, [c.ident for c in v.notify_children]
            )
            crash_point("intent-written")

    def _finish(self, v: Vertex, result: bool, error: str | None, apply: bool) -> None:
        v.running = False
        v.apply_task = None
        self._running -= 1
        if error is not None:
            if v.intent:
                # the apply failed: no refresh is owed (a retry that changes owes it)
                v.intent = False
                self.store.intent_done(v.res.kind, v.res.name)
            v.refresh_flag = v.refresh_flag or v.refresh_now  # not served: keep it
            v.refresh_now = False
            v.reported = None
            self._record_failure(v, error)
        else:
            self._record_success(v, result, apply)
        self._check_idle()
