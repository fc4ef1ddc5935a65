"""Log output for the CLI: readable text on a terminal, or one JSON object per line.

When stderr is not a terminal (a pipe, a file, the journal) log lines are
written through a 64 KiB buffer that `run` flushes every 100 ms and at exit:
writing 10k "applied" lines one syscall each cost more than the 10k file
writes they report. On a terminal (text format) lines go through `rich`,
coloured (changed yellow, failed red), and while the live display
(`cli/progress.py`) is shown they are held and printed above it each tick.

Text lines are escaped: resource names, errors and command output come from
users and machines, and a control character in them must not forge a log line
or drive the terminal. Every non-printable character is written as its Python
escape (`\\x1b`, `\\r`, `\\u2028`) except tab and newline; a newline (multi-line
messages: diffs, the recap, tracebacks) starts a continuation line, indented, so
no line of a message can pass for a record of its own (records start with their
time). JSON is safe as it is (json.dumps escapes).
"""

from __future__ import annotations

import io
import logging
import os
import re
import sys
import time
from typing import TYPE_CHECKING, Any

from evergraph._util.crash import crash_point

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from rich.console import Console, ConsoleOptions, RenderResult

FLUSH_INTERVAL = 0.1
#: what starts each continuation line of a multi-line message
INDENT = "  "
#: `-vv`: everything, down to command output (level 5, see resources/_proc.py)
ALL = 1


def _escaped_char(c: str) -> str:
    if c == "\t" or c.isprintable():
        return c
    import unicodedata  # (a control or other unprintable character: rare)

    if unicodedata.category(c) == "Zs":
        return c
    return c.encode("unicode_escape", "backslashreplace").decode("ascii")


def escape(text: str, lines: bool = True) -> str:
    """`text` safe to write to a log or a terminal: non-printable characters escaped
    (`\\x1b`, `\\r`, `\\x00`, `\\u2028`), tab kept. `lines`: each newline starts an
    indented continuation line; else it is escaped too (`\\n`: one line)."""
    if text.isprintable():  # the common case: one C call
        return text
    if lines and "\n" in text:
        return ("\n" + INDENT).join(escape(line, lines=False) for line in text.split("\n"))
    return "".join(c if c.isprintable() else _escaped_char(c) for c in text)


def _data(record: logging.LogRecord) -> dict[str, Any] | None:
    """The structured form a record carries (`extra={"data": {...}}`: the recap)."""
    data = getattr(record, "data", None)
    return data if isinstance(data, dict) else None


def _event(record: logging.LogRecord) -> object:
    """The `event` of a record's structured data (None: it has none). A record that
    makes its data when read (engine/changes.py, `DataRecord`) says it without
    making it: a first apply's recap data names 10k vertices."""
    event = getattr(record, "data_event", None)
    if event is not None:
        return event
    data = _data(record)
    return None if data is None else data.get("event")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        import json  # (`--log-format json` only)

        msg = record.getMessage()
        data = _data(record)
        if data is not None:
            msg = msg.partition("\n")[0]  # the rest is in the data, complete
        out: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": msg,
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:  # formatted (and masked) at the source
            out["exc"] = record.exc_text
        if data is not None:
            for k, v in data.items():
                out.setdefault(k, v)
        return json.dumps(out)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__()
        self._second = -1
        self._stamp = ""

    def _time(self, created: float, ms: int) -> str:
        """`HH:MM:SS.mmm` of a record made at `created` (`ms`: its msecs)."""
        second = int(created)
        if second != self._second:  # strftime once per second, not per line
            self._second = second
            self._stamp = time.strftime("%H:%M:%S", time.localtime(second))
        return f"{self._stamp}.{ms:03d}"

    def format(self, record: logging.LogRecord) -> str:
        no = record.levelno
        level = "" if no == logging.INFO or no < logging.DEBUG else f"{record.levelname.lower()}: "
        msg = escape(record.getMessage())
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            msg += "\n" + INDENT + escape(record.exc_text)
        return f"{self._time(record.created, int(record.msecs))} {level}{msg}"

    def info_lines(self, created: float, entries: Sequence[tuple[str, tuple[object, ...]]]) -> str:
        """What `format` gives INFO records made at `created` from each (msg, args),
        each line ended, with no record made (`BufferedHandler.handle_entries`)."""
        head = self._time(created, int((created - int(created)) * 1000)) + " "
        return "".join([f"{head}{escape(msg % args if args else msg)}\n" for msg, args in entries])


class BufferedHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A StreamHandler that leaves flushing to `flush_now()` (`flusher`, and at exit),
    except for a record of an effect (`extra={"effect": True}`: a change applied, a
    command run), written through at once: it is in the log before the agent goes
    on to its next effect, so a kill -9 never leaves an effect unlogged.

    The first line after a flush calls `waker` (set by `flusher`): an idle agent has
    nothing to flush and so no timer to wake it."""

    waker: Callable[[], None] | None = None
    _pending = False

    def emit(self, record: logging.LogRecord) -> None:
        # StreamHandler.emit without its flush() (a no-op here), and a write-through
        # under the lock `handle` holds: one a changed vertex (10k at a first apply)
        try:
            self.stream.write(self.format(record) + self.terminator)
        except RecursionError:
            raise
        except Exception:
            self.handleError(record)
        if record.__dict__.get("effect"):
            self._pending = False
            try:
                self.stream.flush()
            except (OSError, ValueError):
                pass
            crash_point("effect-logged")
            return
        self._wait_for_flush()

    def _wait_for_flush(self) -> None:
        """Lines wait in the buffer: the first since the last flush wakes the flusher."""
        if not self._pending:
            self._pending = True
            waker = self.waker
            if waker is not None:
                waker()

    def handle_many(self, records: list[logging.LogRecord]) -> None:
        """`handle` of each record, in order, under one lock and with one write
        (engine/changes.log_batch: records of no effect, unfiltered here)."""
        if any(r.__dict__.get("effect") for r in records):
            for record in records:  # (each effect written through: emit's)
                self.handle(record)
            return
        with self.lock or _nolock():
            try:
                text = "".join([self.format(r) + self.terminator for r in records])
            except Exception:  # (the record at fault said by handleError, as emit does)
                for record in records:
                    self.emit(record)
                return
            self._write_buffered(text, records[0])

    def handle_entries(
        self, created: float, entries: Sequence[tuple[str, tuple[object, ...]]]
    ) -> bool:
        """`handle_many` of INFO records of no effect made at `created` from each
        (msg, args), written as `TextFormatter` would with no record made (a first
        apply's 10k lines: a record each was half of their cost); False, nothing
        written, where that formatter, no filter and the terminator are not what
        this handler has."""
        fmt = self.formatter
        if type(fmt) is not TextFormatter or self.filters or self.terminator != "\n":
            return False
        with self.lock or _nolock():
            try:
                text = fmt.info_lines(created, entries)
            except Exception:
                return False  # (the general path says which record is at fault)
            self._write_buffered(text, None)
        return True

    def _write_buffered(self, text: str, first: logging.LogRecord | None) -> None:
        """Lines of no effect to the buffer, under the lock (a write that fails is
        said by handleError, for `first`: the batch's first record, if made)."""
        try:
            self.stream.write(text)
        except RecursionError:
            raise
        except Exception:
            self.handleError(first or logging.makeLogRecord({"msg": "(a batch of lines)"}))
        self._wait_for_flush()

    def flush(self) -> None:
        pass

    def flush_now(self) -> None:
        self._pending = False
        with self.lock or _nolock():
            try:
                self.stream.flush()
            except (OSError, ValueError):
                pass


class _nolock:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


#: first lines that report a change: `kind[name]: applied`, `would change`, `ran ...`
_CHANGED = re.compile(r"\]: (applied|would change|ran )")


def _style(record: logging.LogRecord, first: str) -> str:
    no = record.levelno
    if no >= logging.WARNING:
        return "red"
    if no < logging.INFO:
        return "dim"
    if _CHANGED.search(first):
        return "yellow"
    return ""


#: a recap's lines, by their first word
_RECAP_STYLES = {"changed": "yellow", "would": "yellow", "failed": "red", "…": "dim"}


class TerminalHandler(logging.Handler):
    """Text lines on a terminal through rich: coloured, and held while the live
    display is shown (`hold`), which prints them above itself each tick (`take`)."""

    def __init__(self, console: Console) -> None:
        super().__init__()
        self.console = console
        self.setFormatter(TextFormatter())
        #: (line, style) of each line written while held
        self._held: list[tuple[str, str]] | None = None

    def emit(self, record: logging.LogRecord) -> None:
        try:
            lines = self._styled(record, self.format(record))
            if self._held is not None:
                self._held.extend(lines)
            else:
                self.console.print(Lines(lines), soft_wrap=True)
        except Exception:
            self.handleError(record)

    def _styled(self, record: logging.LogRecord, text: str) -> list[tuple[str, str]]:
        if "\n" not in text:
            return [(text, _style(record, text))]
        first, _, rest = text.partition("\n")
        style = _style(record, first)
        recap = _event(record) == "recap"
        out = [(first, style)]
        for line in rest.split("\n"):
            word = line.split(None, 1)[0] if recap and line.strip() else ""
            out.append((line, _RECAP_STYLES.get(word, style)))
        return out

    def hold(self) -> None:
        """From now on keep lines for `take` (the live display prints them)."""
        with self.lock or _nolock():
            if self._held is None:
                self._held = []

    def take(self) -> Lines | None:
        """The lines held since the last call (None: none)."""
        with self.lock or _nolock():
            held = self._held
            if not held:
                return None
            self._held = []
        return Lines(held)

    def stop_holding(self) -> None:
        """Print what is held and stop holding (the live display is gone)."""
        lines = self.take()
        with self.lock or _nolock():
            self._held = None
        if lines is not None:
            self.console.print(lines, soft_wrap=True)

    def flush(self) -> None:
        if self._held is None:
            with self.lock or _nolock():
                try:
                    self.console.file.flush()
                except (OSError, ValueError):
                    pass


class Lines:
    """Log lines for rich, as they are: one segment each, no wrapping or markup
    (rich's Text would wrap 10k lines at a cost of seconds)."""

    def __init__(self, lines: list[tuple[str, str]]) -> None:
        self.lines = lines

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        from rich.segment import Segment
        from rich.style import Style

        styles: dict[str, Style] = {}
        newline = Segment.line()
        for line, name in self.lines:
            style = styles.get(name)
            if style is None:
                style = styles[name] = Style.parse(name) if name else Style.null()
            yield Segment(line, style)
            yield newline


_buffered: BufferedHandler | None = None
_terminal: TerminalHandler | None = None


def setup_logging(fmt: str, verbose: int) -> None:
    """`verbose`: 0 what changed and failed; 1 (-v) each check with its duration
    (debug); 2 (-vv) everything, with command output."""
    global _buffered, _terminal
    handler: logging.Handler
    # No formatter of ours shows a record's caller, thread or process: do not look
    # them up for each record (logging's documented optimisation; a first apply of
    # 10k files logs 10k records)
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    _buffered = _terminal = None
    if sys.stderr.isatty() and fmt == "text":
        from rich.console import Console

        console = Console(file=sys.stderr, highlight=False, emoji=False, markup=False)
        handler = _terminal = TerminalHandler(console)
    elif sys.stderr.isatty():
        handler = logging.StreamHandler(sys.stderr)
    else:
        stream = io.TextIOWrapper(
            io.BufferedWriter(io.FileIO(os.dup(sys.stderr.fileno()), "w"), 1 << 16),
            encoding="utf-8",
            errors="replace",
        )
        handler = _buffered = BufferedHandler(stream)
    if not isinstance(handler, TerminalHandler):
        handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(ALL if verbose > 1 else logging.DEBUG if verbose else logging.INFO)
    logging.getLogger("asyncio").setLevel(logging.WARNING if verbose < 2 else logging.NOTSET)


def terminal_handler() -> TerminalHandler | None:
    """The handler writing text to a terminal (None: a pipe, a file, or JSON)."""
    return _terminal


async def flusher(_agent: object = None) -> None:
    """An agent service: write buffered lines out `FLUSH_INTERVAL` after the first
    line since the last flush (no periodic timer), and at the end."""
    import asyncio  # (loaded by then: a service runs in the agent's loop)

    handler = _buffered
    if handler is None:
        await asyncio.Event().wait()  # nothing is buffered (a terminal): idle for ever
        return
    loop = asyncio.get_running_loop()
    wanted = asyncio.Event()

    def wake() -> None:
        loop.call_soon_threadsafe(wanted.set)

    handler.waker = wake
    if handler._pending:
        wanted.set()  # lines logged before this service started (`HTTP API on ...`)
    try:
        while True:
            await wanted.wait()
            wanted.clear()
            await asyncio.sleep(FLUSH_INTERVAL)
            handler.flush_now()
    finally:
        handler.waker = None
        handler.flush_now()


def flush_logs() -> None:
    """Write out buffered lines (a pipe's; on a terminal the live display does)."""
    if _buffered is not None:
        _buffered.flush_now()
