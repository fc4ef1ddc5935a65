"""What the tests of the agent on a terminal share: the CLI run on a real
pseudo-terminal (`Pty`, and the `pty` fixture that closes what it started), and
the patterns of an escape sequence and of the start of a log record."""

from __future__ import annotations

import errno
import fcntl
import os
import re
import select
import struct
import subprocess
import termios
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import EVERGRAPH

#: a terminal escape sequence (colour, cursor movement)
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
#: the start of a log record: its time
RECORD = re.compile(r"^\d\d:\d\d:\d\d\.\d{3} ")


class Pty:
    """`evergraph ARGS` with a pseudo-terminal as its stdin, stdout and stderr."""

    def __init__(self, *args: str | Path, cols: int = 120, rows: int = 40) -> None:
        master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        env = {**os.environ, "TERM": "xterm-256color"}
        env.pop("NO_COLOR", None)
        self.proc = subprocess.Popen(
            [*EVERGRAPH, *map(str, args)], stdin=slave, stdout=slave, stderr=slave, env=env
        )
        os.close(slave)
        self.master = master
        self.raw = b""

    @property
    def text(self) -> str:
        """What was written so far, decoded (escape sequences kept)."""
        return self.raw.decode("utf-8", "replace")

    @property
    def plain(self) -> str:
        """What was written so far without escape sequences."""
        return ANSI.sub("", self.text)

    def _read(self, timeout: float) -> bool:
        """Read what is there within `timeout`; False at the end (the child is gone)."""
        ready, _, _ = select.select([self.master], [], [], timeout)
        if not ready:
            return True
        try:
            data = os.read(self.master, 65536)
        except OSError as e:
            if e.errno == errno.EIO:  # every slave end closed: the child exited
                return False
            raise
        self.raw += data
        return bool(data)

    def expect(self, pred: Callable[[], bool], what: str, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while not pred():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}:\n{self.plain}")
            if not self._read(0.05):
                if pred():
                    return
                raise AssertionError(f"exited before {what}:\n{self.plain}")

    def wait(self, timeout: float = 20) -> int:
        """Read to the end; the exit status."""
        deadline = time.monotonic() + timeout
        while self._read(0.05):
            if time.monotonic() > deadline:
                raise AssertionError(f"still running:\n{self.plain}")
        return self.proc.wait(timeout)

    def hang_up(self) -> None:
        """Close our end: the terminal is gone (its writes fail with EIO)."""
        os.close(self.master)
        self.master = -1

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.master >= 0:
            os.close(self.master)


@pytest.fixture
def pty() -> Any:
    """Start `Pty(ARGS...)`s; each is closed (its process killed) when the test ends."""
    started: list[Pty] = []

    def start(*args: str | Path) -> Pty:
        p = Pty(*args)
        started.append(p)
        return p

    yield start
    for p in started:
        p.close()
