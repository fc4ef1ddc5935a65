"""What `run` shows while it works, as an agent service fed by the engine's observer.

On a terminal (text logs): a live display under the log lines — during the first
convergence a bar (done/total) and the vertices running, each with how long it
has been; then one status line updated in place (`watching N resources, last
repair file[x] 3 s ago`), with any apply running for over a second. In a pipe,
or with JSON logs, plain log lines only: an apply running for long says so every
`STILL_RUNNING` seconds (`exec[x]: still running (20 s)`).

The live display is fed by the engine's observer (`Tracker`, on the engine's hot
path, twice per check_apply: it only stores; the display reads on its own ticks).
The plain lines need no observer: once a second they ask the engine what runs,
so a run in a pipe pays nothing per check for them.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import time
from typing import TYPE_CHECKING, Any

from evergraph.cli.logs import TerminalHandler, escape
from evergraph.engine.recap import took
from evergraph.engine.status import VertexStatus

if TYPE_CHECKING:
    from rich.console import Console, ConsoleOptions, RenderResult

    from evergraph.agent.run import Agent, Service

log = logging.getLogger("evergraph.progress")

#: seconds between "still running" lines in a pipe
STILL_RUNNING = 10.0
#: seconds between ticks of the live display (held log lines are printed each tick)
TICK = 0.1
#: after the first convergence, an apply is shown once it has run this long (seconds)
SHOW_AFTER = 1.0
#: running vertices listed at most (the longest-running first)
SHOWN = 8


class Tracker:
    """The engine's observer for the display: what runs since when, what finished."""

    __slots__ = ("changes", "done", "failed", "last_change", "running")

    def __init__(self) -> None:
        #: ident -> when its run started (the engine's clock)
        self.running: dict[str, float] = {}
        #: idents that finished a run (clean, changed or failed)
        self.done: set[str] = set()
        self.failed: set[str] = set()
        #: runs that changed something, and the last one: (ident, wall clock)
        self.changes = 0
        self.last_change: tuple[str, float] | None = None

    def __call__(self, st: VertexStatus) -> None:
        state = st.state
        ident = st.ident
        if state == "running":
            self.running[ident] = st.since
            return
        self.running.pop(ident, None)
        if state == "removed":
            self.done.discard(ident)
            self.failed.discard(ident)
        elif state == "clean" or state == "unknown":
            self.done.add(ident)
            self.failed.discard(ident)
        elif state == "changed":
            self.done.add(ident)
            self.failed.discard(ident)
            self.changes += 1
            self.last_change = (ident, st.last_changed or time.time())
        elif state == "failed":
            self.done.add(ident)
            self.failed.add(ident)
        elif state == "retrying":
            self.failed.add(ident)

    def longest(self, n: int) -> list[tuple[str, float]]:
        """The `n` runs going on longest: (ident, started)."""
        return heapq.nsmallest(n, self.running.items(), key=lambda kv: kv[1])


class Display:
    """The display as an agent service: live on `terminal`, else plain "still
    running" lines. `observes`: whether it subscribes to the engine's observer (the
    agent feeds the observer only if a service does)."""

    def __init__(self, terminal: TerminalHandler | None) -> None:
        self.terminal = terminal
        self.observes = terminal is not None

    async def __call__(self, agent: Agent) -> None:
        if self.terminal is not None:
            tracker = Tracker()
            agent.observers.subscribe(tracker)
            try:
                await _live(agent, tracker, self.terminal)
            except OSError:  # the terminal went away: go on without the display
                with contextlib.suppress(OSError):
                    self.terminal.stop_holding()
            finally:
                agent.observers.unsubscribe(tracker)
        await _still_running(agent)


def service(terminal: TerminalHandler | None) -> Service:
    """`run`'s display (see `Display`)."""
    return Display(terminal)


async def _still_running(agent: Agent) -> None:
    """Say which applies run long, every STILL_RUNNING seconds of each."""
    said: dict[str, tuple[float, int]] = {}
    while True:
        await asyncio.sleep(1.0)
        engine = agent.engine
        if engine is None:
            continue
        now = engine.clock.monotonic()
        running = {st.ident: st.since for st in engine.running()}
        for ident, since in running.items():
            n = int((now - since) // STILL_RUNNING)
            if n and said.get(ident) != (since, n):
                said[ident] = (since, n)
                log.info("%s: still running (%d s)", ident, n * STILL_RUNNING)
        for ident in [i for i in said if i not in running]:
            del said[ident]


async def _live(agent: Agent, tracker: Tracker, terminal: TerminalHandler) -> None:
    from rich.live import Live

    view = _View(agent, tracker)
    console = terminal.console
    terminal.hold()
    try:
        with Live(
            view,
            console=console,
            auto_refresh=False,
            transient=True,
            redirect_stdout=False,
            redirect_stderr=True,
        ) as live:
            try:
                while True:
                    await asyncio.sleep(TICK)
                    text = terminal.take()
                    if text is not None:
                        console.print(text, soft_wrap=True)  # redraws the display under it
                    elif view.due():
                        live.refresh()
            finally:
                text = terminal.take()
                if text is not None:
                    with contextlib.suppress(OSError):
                        console.print(text, soft_wrap=True)
    finally:
        terminal.stop_holding()


class _View:
    """The live display's content, rendered from the tracker when rich asks."""

    def __init__(self, agent: Agent, tracker: Tracker) -> None:
        self.agent = agent
        self.tracker = tracker
        #: tracker.changes at the first convergence (later changes are repairs)
        self.converged_changes: int | None = None
        self._drawn = 0.0

    def due(self) -> bool:
        """Whether it is time to redraw: at every tick while converging or while
        something runs, else once a second (the "ago" moves)."""
        now = time.monotonic()
        every = TICK if self.converged_changes is None or self.tracker.running else 1.0
        return now - self._drawn >= every - 0.01

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        from rich.progress_bar import ProgressBar
        from rich.table import Table
        from rich.text import Text

        self._drawn = time.monotonic()
        engine = self.agent.engine
        tracker = self.tracker
        if engine is None or not engine.vertices:
            yield _line("waiting for a graph …", "dim")
            return
        if self.converged_changes is None and (engine.converger.converged or not engine.busy()):
            # the first convergence is over (also without --converged-timeout)
            self.converged_changes = tracker.changes
        total = len(engine.vertices)
        now = engine.clock.monotonic()
        if self.converged_changes is None:
            done = min(len(tracker.done), total)
            grid = Table.grid(padding=(0, 1))
            grid.add_row(
                Text("converging"),
                ProgressBar(total=max(total, 1), completed=done, width=30),
                Text(f"{done}/{total}"),
                Text(f"{len(tracker.failed)} failed", style="red") if tracker.failed else "",
            )
            yield grid
            shown_after = 0.0
        else:
            yield _line(self._status(total))
            shown_after = SHOW_AFTER
        longest = tracker.longest(SHOWN + 1)
        listed = [(i, s) for i, s in longest[:SHOWN] if now - s >= shown_after]
        for ident, since in listed:
            yield _line(f"  running {escape(ident, lines=False)} ({took(now - since)})", "cyan")
        more = len(tracker.running) - len(listed)
        if listed and more > 0:
            yield _line(f"  … and {more} more running", "dim")

    def _status(self, total: int) -> str:
        tracker = self.tracker
        noop = self.agent.settings.noop
        text = f"watching {total} resources"
        if tracker.failed:
            text += f", {len(tracker.failed)} failed"
        assert self.converged_changes is not None
        if tracker.changes > self.converged_changes and tracker.last_change is not None:
            ident, when = tracker.last_change
            ago = _ago(time.time() - when)
            what = "last drift" if noop else "last repair"
            text += f", {what} {escape(ident, lines=False)} {ago} ago"
        else:
            text += ", no drift since" if noop else ", no repair yet"
        return text


def _ago(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds} s" if seconds < 60 else took(seconds)


def _line(text: str, style: str = "") -> Any:
    from rich.text import Text

    return Text(text, style=style, no_wrap=True, overflow="ellipsis")
