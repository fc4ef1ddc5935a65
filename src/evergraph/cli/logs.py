"""Log output for the CLI: readable text on a terminal, or one JSON object per line.

When stderr is not a terminal (a pipe, a file, the journal) log lines are
written through a 64 KiB buffer that `run` flushes every 100 ms and at exit:
writing 10k "applied" lines one syscall each cost more than the 10k file
writes they report. On a terminal every line appears at once.
"""

from __future__ import annotations

import io
import json
import logging
import os
import sys
import time

FLUSH_INTERVAL = 0.1


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:  # formatted (and masked) at the source
            out["exc"] = record.exc_text
        return json.dumps(out)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__()
        self._second = -1
        self._stamp = ""

    def format(self, record: logging.LogRecord) -> str:
        second = int(record.created)
        if second != self._second:  # strftime once per second, not per line
            self._second = second
            self._stamp = time.strftime("%H:%M:%S", time.localtime(second))
        ms = int(record.msecs)
        level = "" if record.levelno == logging.INFO else f"{record.levelname.lower()}: "
        return f"{self._stamp}.{ms:03d} {level}{record.getMessage()}"


class BufferedHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A StreamHandler that leaves flushing to `flush_now()` (periodic, and at exit)."""

    def flush(self) -> None:
        pass

    def flush_now(self) -> None:
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


_buffered: BufferedHandler | None = None


def setup_logging(fmt: str, verbose: int) -> None:
    global _buffered
    handler: logging.StreamHandler  # type: ignore[type-arg]
    if sys.stderr.isatty():
        handler = logging.StreamHandler(sys.stderr)
        _buffered = None
    else:
        stream = io.TextIOWrapper(
            io.BufferedWriter(io.FileIO(os.dup(sys.stderr.fileno()), "w"), 1 << 16),
            encoding="utf-8",
            errors="replace",
        )
        handler = _buffered = BufferedHandler(stream)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose > 1 else logging.INFO)
    if verbose == 0:
        logging.getLogger("asyncio").setLevel(logging.WARNING)


def flush_logs() -> None:
    if _buffered is not None:
        _buffered.flush_now()
