"""Converged detection: the engine tells us when it turns idle or busy.

"Converged" means every vertex idle (clean, or failed for good) for
`timeout` seconds. Transitions are appended to a status file (`true`/`false`,
one per line) so that scripts and tests can wait on a file, not on sleeps.
The file is appended to, never followed through a symlink, and must be a
regular file (a FIFO or device there is refused, not blocked on).

`report` (`run --converged-report`) is told the same transitions (True:
converged, False: no longer), as `REPORT_LINES` on the agent's stdout:
`evergraph remote`'s initiator runs its agents with a timeout of 0 and reads them
to end a session the moment all its hosts are converged.
"""

from __future__ import annotations

import logging
import os
import stat
import sys
from collections.abc import Callable
from pathlib import Path

from evergraph._util.clock import SYSTEM, Clock, Timer

log = logging.getLogger("evergraph.converger")

#: the lines `print_report` writes: (idle state, busy state)
REPORT_LINES = ("evergraph-converged: true", "evergraph-converged: false")


def print_report(idle: bool) -> None:
    """A `report` for the Converger: one of REPORT_LINES on stdout, flushed (the
    agent writes nothing else there: its log goes to stderr)."""
    sys.stdout.write(REPORT_LINES[0 if idle else 1] + "\n")
    sys.stdout.flush()


class Converger:
    def __init__(
        self,
        timeout: float | None,
        status_file: Path | None,
        on_converged: Callable[[], None],
        clock: Clock = SYSTEM,
        report: Callable[[bool], None] | None = None,
    ) -> None:
        self.timeout = timeout
        self.status_file = status_file
        self.on_converged = on_converged
        self.clock = clock
        self.converged = False
        self._timer: Timer | None = None
        self.report = report
        if status_file is not None:
            self._write(False)

    def idle(self) -> None:
        if self.timeout is None or self._timer is not None or self.converged:
            return
        self._timer = self.clock.call_later(self.timeout, self._fire)

    def busy(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.converged:
            self.converged = False
            self._write(False)
            if self.report is not None:
                self.report(False)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _fire(self) -> None:
        self._timer = None
        self.converged = True
        self._write(True)
        if self.report is not None:
            self.report(True)
        self.on_converged()

    def _write(self, state: bool) -> None:
        if self.status_file is None:
            return
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
        try:
            fd = os.open(self.status_file, flags | os.O_CLOEXEC, 0o644)
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise OSError("not a regular file")
                os.write(fd, b"true\n" if state else b"false\n")
            finally:
                os.close(fd)
        except OSError as e:
            log.error("cannot write converged status file %s: %s", self.status_file, e)
