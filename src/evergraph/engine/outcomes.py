"""Outcomes: what a finished run leaves, and what happens after a failure.

A success records the vertex clean or changed (with what it changed: changes.py),
writes the refreshes its change owes its notify children (store.py) before
anything else can happen, sends its values (sendrecv.py) and pokes its children.
A failure is retried after meta.delay while meta.retry allows; then the vertex
has failed for good, and its next event or a doubling backoff timer
(`Settings.repair_backoff_max`) revives it with a fresh budget. Every timer
runs on the injected clock and is owned by the engine's TaskGroup.
"""

from __future__ import annotations

import asyncio
import logging
from functools import partial

from evergraph._util.crash import crash_point
from evergraph.engine import changes
from evergraph.engine.recap import took as _took
from evergraph.engine.state import EngineState
from evergraph.engine.status import Change
from evergraph.engine.vertex import MADE_AHEAD, Vertex

log = logging.getLogger("evergraph.engine")

#: a vertex that failed for good is tried again by timer after this many seconds
#: (or its meta.delay if longer), doubling each time it fails again, up to
#: `Settings.repair_backoff_max`
REPAIR_FIRST = 1.0


class Outcomes(EngineState):
    def _record_success(self, v: Vertex, was_clean: bool, applied: bool) -> None:
        intent, v.intent = v.intent, False
        self._record_success_(v, was_clean, applied)
        if intent:
            self.store.intent_done(
                v.res.kind, v.res.name
            )  # the children's flags (if any) are written

    def _record_success_(self, v: Vertex, was_clean: bool, applied: bool) -> None:
        v.ok = True
        v.ever_ok = True
        v.last_error = None
        if v.refresh_now and not v.refresh_flag and applied:
            crash_point("child-applied")
            self.store.refresh_served(v.res.kind, v.res.name)
        v.refresh_now = False
        if v.res.meta.retryreset:
            v.retries_left = v.res.meta.retry
        if v.repair_delay:
            v.repair_delay = 0.0  # repaired: a later failure backs off from the start
        if was_clean:
            if v.reported is not None:
                v.reported = None  # differences reported, yet all was well: none
            v.clean_count += 1
            why = v.unknown_why
            if why is None:
                self._observe(v, "clean")
            else:  # a noop run that could not tell (--noop-no-commands)
                v.unknown_why = None
                v.last_error = why
                self._observe(v, "unknown")
        else:
            v.changed_count += 1
            v.last_changed = self.clock.time()
            diffs = not applied or self.settings.diff
            reported, v.reported = v.reported, None
            v.changes = changes.build(reported, v.secret_fields, v.mask, diffs) if reported else ()
            if applied:
                # (a change a child made ahead is in its journal already: the line
                # need not be written through, see ahead.py)
                self._log_changes(v, "applied", diffs, through=v.ahead != MADE_AHEAD)
                crash_point("parent-changed")
                for c in v.notify_children:
                    # Persist before anything else can happen: a crash between
                    # this change and the child's apply must not lose it.
                    self.store.owe_refresh(c.res.kind, c.res.name)
                    c.refresh_flag = True
                    c.pending = True
                crash_point("refresh-owed")
            else:
                self._log_changes(v, "would change (noop)", diffs)
            self._observe(v, "changed")
        if v.send_edges:
            self._send(v)
        for c in v.children:
            self._poke(c)
        if v.pending:
            self._poke(v)

    def _log_changes(self, v: Vertex, what: str, diffs: bool, through: bool = True) -> None:
        """One log record for a run that changed something (or would): see
        `change_entry`. An applied change's line is written through (`through`)
        unless it is held elsewhere already."""
        noop = what != "applied"
        effect = through and not noop
        notify = [c.ident for c in v.notify_children] if v.notify_children else []
        send = [f"{value} → {c.ident}.{field}" for value, c, field in v.send_edges]
        entry = change_entry(v.ident, what, v.changes, diffs, notify, send)
        held = self._held
        if held is not None and not effect and not v.send_edges:
            held.append(entry)
            return
        if held:
            self._log_held()  # (in order)
        # an applied change is an effect: the log writes it through (cli/logs.py)
        changes.log_data(log, *entry, effect=effect, event="changed")

    def _log_held(self) -> None:
        """Log the lines `_held`, in order, as one batch (`changes.log_batch`)."""
        held = self._held
        if held:
            changes.log_batch(log, held, event="changed")
            held.clear()

    def _record_failure(self, v: Vertex, error: str) -> None:
        if self._held:
            self._log_held()  # (in order)
        error = v.mask(error)
        v.unknown_why = None
        v.ok = False
        v.fail_count += 1
        v.last_error = error
        if v.retries_left == 0 or self.stopping:
            self._fail_permanently(v, error)
            return
        if v.retries_left > 0:
            v.retries_left -= 1
        log.warning(
            "%s: %s (retrying in %d ms, %s left)",
            v.ident,
            error,
            v.res.meta.delay,
            "forever" if v.retries_left < 0 else v.retries_left,
        )
        self._observe(v, "retrying")
        v.retry_wait = True
        self._retrying += 1
        assert self._tg is not None
        t = self._tg.create_task(self._retry_later(v, v.res.meta.delay / 1000))
        self._timers.add(t)
        t.add_done_callback(self._timers.discard)

    async def _retry_later(self, v: Vertex, delay: float) -> None:
        try:
            await self.clock.sleep(delay)
        finally:
            v.retry_wait = False
            self._retrying -= 1
        v.pending = True
        self._poke(v)
        self._check_idle()

    def _fail_permanently(self, v: Vertex, error: str, revive: bool = True) -> None:
        """`v` failed for good (its retries spent). Unless `revive` is False (its init
        or watch failed: nothing to try again), its next event or a backoff timer
        runs it again (`_revive`): a transient cause (a missing parent, a full disk)
        never leaves it failed for good."""
        error = v.mask(error)
        v.ok = False
        v.failed = True
        v.pending = False
        v.last_error = error
        log.error("%s: %s", v.ident, error)
        self._observe(v, "failed")
        if not revive:
            v.repair_delay = -1.0
            return
        cap = self.settings.repair_backoff_max
        # a one-shot run ends at convergence: a timer could only delay it
        if cap <= 0 or self.stopping or self.one_shot or not self.settings.watch:
            return
        first = max(REPAIR_FIRST, v.res.meta.delay / 1000)
        v.repair_delay = delay = min(cap, v.repair_delay * 2 if v.repair_delay > 0 else first)
        log.info("%s: tried again at its next event, or in %s", v.ident, _took(delay))
        assert self._tg is not None
        old = self._repairs.pop(v, None)
        if old is not None:
            old.cancel()
        self._repairs[v] = self._tg.create_task(self._repair_later(v, delay))

    async def _repair_later(self, v: Vertex, delay: float) -> None:
        await self.clock.sleep(delay)
        if self._repairs.get(v) is asyncio.current_task():
            del self._repairs[v]
        if v.failed and not self.stopping and self.vertices.get(v.ident) is v:
            self._revive(v, f"backoff {_took(delay)}")

    def _revive(self, v: Vertex, why: str) -> None:
        """Run a vertex failed for good again, with its retry budget anew: it
        returns to clean when a run succeeds, or fails for good again (and backs off
        longer). Meanwhile observers saw it failed, with its last error."""
        timer = self._repairs.pop(v, None)
        if timer is not None and timer is not asyncio.current_task():
            timer.cancel()
        log.info("%s: failed before; trying again (%s)", v.ident, why)
        v.failed = False
        v.retries_left = v.res.meta.retry
        v.pending = True
        self.converger.busy()
        self._poke(v)


def change_entry(
    ident: str,
    what: str,
    done: tuple[Change, ...],
    diffs: bool,
    notify: list[str] | None = None,
    send: list[str] | None = None,
) -> changes.Entry:
    """The log record (message, arguments, data) of a run of `ident` that changed
    something (`what`: "applied"), or would ("would change (noop)"): the fields
    changed `done`; with `diffs` (noop, `--diff`) a line per change with its diff,
    and whom a change notifies or sends values to. Structured logs get them all from
    the record's `data` (`changes.record_data`), made only for a handler that reads
    it (`changes.log_data`: a text log does not)."""
    notify = notify or []
    send = send or []
    noop = what != "applied"
    data = partial(changes.record_data, ident, noop, done, notify, send)
    if not done and not (diffs and (notify or send)):
        return "%s: %s", (ident, what), data
    head = f"{ident}: {what}: {changes.summary(done)}" if done else f"{ident}: {what}"
    if not diffs:
        return "%s", (head,), data
    out = [head, *changes.lines(done, diffs=True)]
    notifies, sends = ("would notify", "would send") if noop else ("notifies", "sends")
    out.extend(f"  {notifies} {ident}" for ident in notify)
    out.extend(f"  {sends} {line}" for line in send)
    return "%s", ("\n".join(out),), data
