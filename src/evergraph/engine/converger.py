"""Converged detection: the engine tells us when it turns idle or busy.

"Converged" means every vertex idle (clean, or failed for good) for
`timeout` seconds. Transitions are appended to a status file (`true`/`false`,
one per line) so that scripts and tests can wait on a file, not on sleeps.
The file is appended to, never followed through a symlink, and must be a
regular file (a FIFO or device there is refused, not blocked on).
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Callable
from pathlib import Path

from evergraph._util.clock import SYSTEM, Clock, Timer

log = logging.getLogger("evergraph.converger")


class Converger:
    def __init__(
        self,
        timeout: float | None,
        status_file: Path | None,
        on_converged: Callable[[], None],
        clock: Clock = SYSTEM,
    ) -> None:
        self.timeout = timeout
        self.status_file = status_file
        self.on_converged = on_converged
        self.clock = clock
        self.converged = False
        self._timer: Timer | None = None
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

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _fire(self) -> None:
        self._timer = None
        self.converged = True
        self._write(True)
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
