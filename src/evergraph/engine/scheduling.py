"""Scheduling: when a vertex runs, and the state machine of one run.

A watch's `ready()` and `event()` (through the vertex, its handle) and a parent's
success poke a vertex; `_poke` queues it if it may run now (engine.py's
docstring has the rule); `_drain` starts queued runs a batch per loop turn;
`_start` runs it (as a task, or inline for an eager kind: guard.py); `_finish`
hands the outcome to outcomes.py. Counters kept here (`_running`, `_queued`,
`_unready`; `_retrying` in outcomes.py) say whether the engine is idle
(`_check_idle`, state.py).

A run that ends once converged (`lane`, state.py) drains through `_drain_lane`
instead: the same batches in the same order, with a plain inline vertex's clean
check and its outcome fused into one step (10k unchanged files: ~10 % of the
engine's work was these layers); anything else it hands to the steps above. A
vertex found in its state by the checks run ahead (ahead.py, `Vertex.ahead`)
is recorded clean there with no check, while nothing it depends on changed in
the run; else it is initialised (`_init_deferred`, guard.py) and runs as usual.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from evergraph._util.crash import crash_point
from evergraph.engine.ahead import CLEAN, CREATED, PENDING
from evergraph.engine.contract import Resource, runs_inline
from evergraph.engine.state import DRAIN_BATCH, SUSPENDED_MAX, EngineState, error_text
from evergraph.engine.vertex import INITIALISED, MADE_AHEAD, VERDICT_USED, Vertex

if TYPE_CHECKING:
    from collections import deque

    from evergraph.engine.ahead import Ahead

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
        if self._draining or self.vertices.get(v.ident) is not v:  # (`stopping`, inlined)
            return False
        for p in v.parents:  # noqa: SIM110 (a loop, `clean` inlined: 3 calls per vertex)
            if not p.ok or p.pending or p.running:
                return False  # held back: p pokes us on success
        return True

    def _drain(self) -> None:
        """Start queued runs; a batch at a time, so the loop stays responsive."""
        self._drain_scheduled = False
        if self.lane:
            self._drain_lane()
            return
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

    def _inline_ok(self, v: Vertex) -> bool:
        """`v` runs inline, with no task of its own: its resource may
        (`_inline_res`) and it has no values to take first."""
        return not v.inbox and self._inline_res(v.res)

    def _inline_res(self, res: Resource) -> bool:
        """What of `_inline_ok` the resource decides, in this engine: an eager kind
        (its check_apply is local syscalls) that waits for nothing (no token,
        semaphore or timeout), with no reversal to capture and no group."""
        return (
            runs_inline(res)
            and self._global_sema is None
            and not getattr(res, "_group_members", None)
        )

    def _takes_verdict(self, res: Resource) -> bool:
        """The lane takes a verdict from the work run ahead for `res` (a new vertex
        with no values waiting): its kind tells ahead, it is not hidden, and it runs
        inline."""
        return (
            type(res).ahead_check is not Resource.ahead_check
            and not res.meta.hidden
            and self._inline_res(res)
        )

    def _drain_lane(self) -> None:
        """The one-shot lane (`lane`): `_drain`'s batch, in the same order (queued
        vertices first come first, then the children each success makes runnable),
        with each due inline vertex run in one fused step (`_lane_run`) and the
        engine's idle check once a batch. Only a clean check is fused; a change, a
        failure, a suspended check, a refresh, an intent or values to send go on
        through the general path's `_finish` from where they are, and so does a
        vertex that must not run inline (`_start`)."""
        ready = self._ready
        debug = log.isEnabledFor(logging.DEBUG)
        # an observer that no one listens to (the agent's hub, with no HTTP view)
        # is not given statuses it would throw away
        observer = self.observer
        observed = debug or (observer is not None and getattr(observer, "listening", True))
        ahead = self._ahead
        if ahead is not None:
            ahead.poll()  # the verdicts come since the last batch
        # the lines of what the children made, held for one write (`_made_ahead`);
        # not with -v, whose lines for each vertex would come before them
        hold = ahead is not None and not debug
        if hold:
            self._held = []
        try:
            waiting = self._lane_batch(ready, ahead, observed)
        finally:
            if hold:
                self._log_held()
                self._held = None
        if ready and not (waiting or self._drain_scheduled) and self._suspended < SUSPENDED_MAX:
            self._drain_scheduled = True
            asyncio.get_running_loop().call_soon(self._drain)  # a loop turn, no time
        self._check_idle()

    def _lane_batch(self, ready: deque[Vertex], ahead: Ahead | None, observed: bool) -> bool:
        """`_drain_lane`'s batch; whether it stopped to wait for the child ahead."""
        clock = self.clock
        noop = self.settings.noop
        waiting = False
        for _ in range(DRAIN_BATCH):
            if not ready or self._suspended >= SUSPENDED_MAX:
                break
            v = ready.popleft()
            v.queued = False
            self._queued -= 1
            if not self._runnable(v):
                continue  # a parent may have turned dirty since
            at = v.ahead
            clean_ahead = False
            if at >= 0 and ahead is not None:
                verdict = ahead.take(at)
                if verdict == PENDING:
                    ahead.poll()
                    verdict = ahead.take(at)
                if verdict == PENDING:
                    # the child may be making it: first in line again once more
                    # verdicts came (ahead.wake), and nothing runs meanwhile
                    ready.appendleft(v)
                    v.queued = True
                    self._queued += 1
                    waiting = True
                    ahead.wake(self._drain)
                    break
                v.ahead = VERDICT_USED  # (not initialised; its verdict taken)
                if verdict == CREATED:
                    self._made_ahead(v, observed)
                    continue
                clean_ahead = (
                    verdict == CLEAN
                    and not (v.refresh_flag or v.inbox or v.secret_fields or v.send_edges)
                    and not (
                        self._upstream_changed(v)
                        if v.upstream_changed is None
                        else v.upstream_changed
                    )
                )
            if self._held:
                self._log_held()  # (the lines held come before this vertex's)
            if clean_ahead:
                # found in its state by the check run ahead (swap.py deferred only
                # vertices that run inline), and nothing it depends on changed since:
                # clean, with no init (VERDICT_USED) and no check. Its first run: the
                # outcome's fields (last_error, retries...) are as they started.
                v.pending = False
                self.ahead_runs += 1
                v.ok = v.ever_ok = True
                if observed:
                    self._observe(v, "running")
                else:
                    v.since = clock.monotonic()  # (its duration: ~0)
            else:
                if v.refresh_flag or not self._inline_ok(v):
                    self._start(v)  # (which initialises a deferred vertex first)
                    continue
                if at != INITIALISED and not self._init_deferred(v):
                    continue  # (it is poked again once its init is done)
                # _start, _check_apply_inline, _finish and _record_success fused, for
                # a vertex that has nothing but its check to do (see the tail below)
                res = v.res
                v.running = True
                v.pending = False
                self._running += 1
                apply = not (noop or res.meta.noop)
                v.refresh_now = False  # (refresh_flag is False: checked above)
                if observed:
                    self._observe(v, "running")
                else:
                    v.state, v.since = "running", clock.monotonic()
                if apply and v.notify_children:
                    self._intend(v, apply)
                coro = res.check_apply(apply)
                try:
                    yielded = coro.send(None)
                except StopIteration as done:
                    result = bool(done.value)
                except Exception as e:
                    self._finish(v, True, error_text(e, res), apply)
                    continue
                else:
                    assert self._tg is not None
                    self._suspended += 1
                    task = self._finish_later(v, coro, yielded, apply)
                    v.apply_task = self._tg.create_task(task)
                    continue
                if not result or v.intent or v.unknown_why is not None or v.send_edges:
                    # changed (its log record, refreshes owed), a noop run that could
                    # not tell, or values to send: the general path records it
                    self._finish(v, result, None, apply)
                    continue
                v.running = False
                self._running -= 1
                v.ok = True
                v.ever_ok = True
                v.last_error = None
                if res.meta.retryreset:
                    v.retries_left = res.meta.retry
                if v.repair_delay:
                    v.repair_delay = 0.0
                v.reported = None  # differences reported, yet all was well: none
            # clean: recorded, and its children poked
            self.lane_runs += 1
            v.clean_count += 1
            if observed:
                self._observe(v, "clean")
            else:
                now = clock.monotonic()
                v.duration = now - v.since
                v.state, v.since = "clean", now
            for c in v.children:  # _poke, inline
                if c.queued or not self._runnable(c):
                    continue
                if c.res.meta.hidden:
                    self._settle_hidden(c)
                    continue
                c.queued = True
                self._queued += 1
                ready.append(c)
            if v.pending:
                self._poke(v)
        return waiting

    def _made_ahead(self, v: Vertex, observed: bool) -> None:
        """`v` was made by the child ahead (CREATED): recorded changed, with what its
        kind says making it changed (its line not written through: the child's
        journal said it already), and neither initialised nor checked. A refresh
        owed to it (a record of an earlier run) keeps it pending: it runs once more,
        initialised then, and serves it."""
        res = v.res
        v.ahead = MADE_AHEAD
        v.pending = v.refresh_flag
        self.ahead_made += 1
        if observed:
            self._observe(v, "running")
        else:
            v.state, v.since = "running", self.clock.monotonic()
        try:
            res.ahead_created(v)
        except Exception as e:
            v.reported = None
            self._record_failure(v, error_text(e, res))
            return
        self._record_success(v, False, True)

    def _upstream_changed(self, v: Vertex) -> bool:
        """Whether anything `v` depends on, however far up, changed something in
        this run (worked out once per vertex: `upstream_changed`; `v` runs, so
        all of them have run)."""
        changed = False
        for p in v.parents:  # (the common case: each parent known already)
            up = p.upstream_changed
            if up is None:
                break
            changed = changed or up or p.changed_count > 0
        else:
            v.upstream_changed = changed
            return changed
        stack = [v]
        while stack:
            u = stack[-1]
            unknown = [p for p in u.parents if p.upstream_changed is None]
            if unknown:
                stack.extend(unknown)
                continue
            stack.pop()
            u.upstream_changed = any(p.changed_count or p.upstream_changed for p in u.parents)
        return bool(v.upstream_changed)

    def _start(self, v: Vertex) -> None:
        if v.ahead != INITIALISED and not self._init_deferred(v):
            return  # (it is poked again once its init is done)
        v.running = True
        v.pending = False
        self._running += 1
        res = v.res
        meta = res.meta
        assert self._tg is not None
        if not self._inline_ok(v):
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
