"""What `evergraph remote` prints while its hosts work, in one of three forms:

* `Plain` (stdout is not a terminal): each host's lines prefixed by its label
  (``web1 | ...``), then one recap line per host and the total line.
* `Live` (stdout is a terminal): the same lines, above a live table of one row
  per host (its state: waiting, connecting, installing, running, then how it
  ended; and how long it has taken), redrawn by rich; the table goes when the
  run ends and the recap follows.
* `Json` (``--log-format json``): one JSON object per line: a host's log line as
  ``{"host": LABEL, ...}`` (the agent's own JSON record, its agents run with
  ``--log-format json``; a line that is not one as ``{"host": LABEL, "line": ...}``),
  a recap object per host ``{"host": LABEL, "recap": STATE, "reason": ...}`` and
  last ``{"total": {"hosts": N, STATE: COUNT, ...}, "exit": STATUS}``.

The runner (remote/runner.py) calls `emit` with each line and `report` with each
change of a host's state; `finish` prints the recap.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import IO, TYPE_CHECKING, Any

from evergraph.remote.runner import Outcome, exit_status, total_line

if TYPE_CHECKING:
    from rich.console import Console, ConsoleOptions, RenderResult
    from rich.live import Live as RichLive

#: how a state is shown in the live table (style for rich)
STYLES = {
    "waiting": "dim",
    "connecting": "cyan",
    "installing": "cyan",
    "running": "blue",
    "converged": "green",
    "changes": "yellow",
    "failed": "red",
    "unreachable": "red",
}
#: the states a host ends in
FINAL = ("converged", "changes", "failed", "unreachable")


class Plain:
    """Prefixed lines on `out` (see the module doc). `clean`: makes a host's text
    safe to print (control characters escaped)."""

    def __init__(
        self, labels: Sequence[str], clean: Callable[[str], str], out: IO[str] | None = None
    ) -> None:
        self.width = max((len(label) for label in labels), default=0)
        self.clean = clean
        self.out = out or sys.stdout

    def emit(self, label: str, line: str) -> None:
        self._print(f"{label:<{self.width}} | {self.clean(line)}")

    def report(self, label: str, state: str) -> None:
        del label, state  # the lines say it

    def finish(self, outcomes: Sequence[Outcome]) -> None:
        for o in outcomes:
            self._print(self.clean(o.line))
        self._print(total_line(outcomes))

    def _print(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()


class Json:
    """One JSON object per line on `out` (see the module doc)."""

    def __init__(self, out: IO[str] | None = None) -> None:
        self.out = out or sys.stdout

    def emit(self, label: str, line: str) -> None:
        record: dict[str, Any]
        try:
            parsed = json.loads(line)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            record = {"host": label, **{k: v for k, v in parsed.items() if k != "host"}}
        else:
            record = {"host": label, "line": line}
        self._print(record)

    def report(self, label: str, state: str) -> None:
        del label, state  # the records say it

    def finish(self, outcomes: Sequence[Outcome]) -> None:
        for o in outcomes:
            self._print({"host": o.target.label, "recap": o.state, "reason": o.reason})
        self._print(total_record(outcomes))

    def _print(self, record: dict[str, Any]) -> None:
        self.out.write(json.dumps(record) + "\n")
        self.out.flush()


def total_record(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """The last JSON object: how many hosts ended how, and the exit status."""
    counts: dict[str, int] = {"hosts": len(outcomes)}
    for o in outcomes:
        counts[o.state] = counts.get(o.state, 0) + 1
    return {"total": counts, "exit": exit_status(outcomes)}


class Live:
    """Prefixed lines above a live table of the hosts (see the module doc); a
    context manager: the table shows while it is entered."""

    def __init__(self, labels: Sequence[str], clean: Callable[[str], str]) -> None:
        from rich.console import Console

        self.labels = list(labels)
        self.clean = clean
        self.width = max((len(label) for label in labels), default=0)
        self.console: Console = Console(file=sys.stdout, highlight=False)
        #: label -> state, and when it left "waiting" / reached its end (monotonic)
        self.state = dict.fromkeys(self.labels, "waiting")
        self.started: dict[str, float] = {}
        self.ended: dict[str, float] = {}
        self._live: RichLive | None = None

    def __enter__(self) -> Live:
        from rich.live import Live as RichLive

        self._live = RichLive(
            _Table(self),
            console=self.console,
            refresh_per_second=4,
            transient=True,
            redirect_stdout=False,
            redirect_stderr=False,
        )
        self._live.start(refresh=True)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    def emit(self, label: str, line: str) -> None:
        from rich.text import Text

        self.console.print(Text(f"{label:<{self.width}} | {self.clean(line)}"), soft_wrap=True)

    def report(self, label: str, state: str) -> None:
        now = time.monotonic()
        if state != "waiting":
            self.started.setdefault(label, now)
        if state in FINAL:
            self.ended.setdefault(label, now)
        self.state[label] = state
        if self._live is not None:
            self._live.refresh()

    def finish(self, outcomes: Sequence[Outcome]) -> None:
        from rich.text import Text

        self.__exit__()
        for o in outcomes:
            style = STYLES.get(o.state, "")
            self.console.print(Text(self.clean(o.line), style=style), soft_wrap=True)
        self.console.print(Text(total_line(outcomes)), soft_wrap=True)


class _Table:
    """The live table, rendered from `Live`'s states when rich asks."""

    def __init__(self, live: Live) -> None:
        self.live = live

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        from rich.table import Table
        from rich.text import Text

        live = self.live
        now = time.monotonic()
        grid = Table.grid(padding=(0, 2))
        for label in live.labels:
            state = live.state[label]
            start = live.started.get(label)
            took = "" if start is None else f"{live.ended.get(label, now) - start:.0f} s"
            grid.add_row(
                Text(label), Text(state, style=STYLES.get(state, "")), Text(took, style="dim")
            )
        yield grid
