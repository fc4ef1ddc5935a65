"""Checks run ahead: a run that ends once converged checks its plain resources in a
forked child while the parent loads the rest.

A one-shot run of a big graph of unchanged files spends most of its time on two
things that do not depend on each other: loading (imports, the engine, 10k
vertices) and reading the files. With two cores they overlap: right after the
graph is parsed, `Ahead.start` forks a child that asks each resource whose kind
can tell (`Resource.ahead_check`: a pure, read-only check from its parameters)
whether it is already in its state, from the graph's last resource back, and
writes a byte per resource to a pipe as it goes. The engine does not initialise
those vertices when it starts them (swap.py, `Vertex.ahead`); the one-shot lane
(scheduling.py), going from the first, takes the verdicts come so far: a vertex
found in its state is recorded clean with no init and no check, unless
something it depends on changed in the run; any other (not in its state, no
verdict yet, upstream changed) is initialised then and checked as usual. Where
the two meet, the child's work is left: no one waits for the other, and a busy
core only moves the meeting point.

Why that is the same run: a run that ends once converged promises that each
resource was found or put in its state after everything it depends on was. A
verdict read before the run changed anything upstream of it is as good as one
read later, while nothing upstream changed; once something did, the verdict is
dropped. A change made meanwhile by someone else is one the run could as well
have missed by checking a moment earlier.

The child only reads (lstat, open with O_NOFOLLOW|O_NONBLOCK, read, a listing):
no write, no lock, no log, so a fork from the loading process is safe. It is
killed once the run has no more use for it, and a verdict that never came (a
child that died, a short pipe) is no verdict: that resource is checked as
usual. Below
`MIN_RESOURCES` candidates the fork costs more than it saves and none is made.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import sys
from collections.abc import Iterable
from typing import Any

from evergraph.engine.contract import Resource

#: fewer candidate resources than this: no child (a fork and its copy-on-write
#: faults cost about a millisecond; a check about ten microseconds)
MIN_RESOURCES = 256
#: verdict bytes the child writes at a time (the parent takes them as they come)
CHUNK = 128
#: the bytes: found in its state; anything else (not, or the kind cannot tell)
CLEAN = 1
OTHER = 0


class Ahead:
    """A child checking `resources` ahead (`start`), and its verdicts so far."""

    def __init__(self, pid: int, fd: int, resources: list[Resource], asked: bytearray) -> None:
        self.pid = pid
        self._fd = fd
        #: in the graph's order; the child answers from the last one back
        self.resources = resources
        self._got = bytearray()
        #: 1 where a verdict was taken (or none will be: a kind that cannot tell)
        self._asked = asked
        #: the first place not asked yet
        self._low = 0

    @classmethod
    def start(cls, resources: Iterable[Resource], at_least: int = MIN_RESOURCES) -> Ahead | None:
        """Fork the child for `resources`; None when fewer than `at_least` of their
        kinds can tell, or the fork fails."""
        listed = list(resources)
        nothing = Resource.ahead_check
        asked = bytearray(type(r).ahead_check is nothing for r in listed)
        if len(listed) - sum(asked) < max(at_least, 1):
            return None
        read_end, write_end = os.pipe2(os.O_CLOEXEC)
        for stream in (sys.stdout, sys.stderr):  # (a child never writes them, nor flushes)
            with contextlib.suppress(Exception):
                stream.flush()
        try:
            pid = os.fork()
        except OSError:
            os.close(read_end)
            os.close(write_end)
            return None
        if pid == 0:  # pragma: no cover (the child: measured through its verdicts)
            _child(read_end, write_end, listed)
        os.close(write_end)
        os.set_blocking(read_end, False)
        return cls(pid, read_end, listed, asked)

    def poll(self) -> None:
        """Take the verdicts come so far, without waiting."""
        fd = self._fd
        while fd >= 0:
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                return
            except OSError:
                chunk = b""
            if not chunk:
                self.stop()  # all said (or the child died: no verdict for the rest)
                return
            self._got += chunk

    def take(self, i: int) -> bool:
        """Whether `resources[i]` was found in its state (False: not, its kind
        cannot tell, or no verdict yet as of the last `poll`), asked once per
        resource. Once every resource not asked yet has its verdict, the child has
        nothing left to do: it is stopped."""
        got = self._got
        back = len(self.resources) - 1 - i
        asked = self._asked
        asked[i] = 1
        if i == self._low:  # (the lane goes mostly in order: the scan is short)
            n = len(asked)
            low = i + 1
            while low < n and asked[low]:
                low += 1
            self._low = low
            if low >= n - len(got):
                self.stop()
        return back < len(got) and got[back] == CLEAN

    def stop(self) -> None:
        """No more verdicts wanted (or all came): end the child and reap it."""
        fd, self._fd = self._fd, -1
        if fd < 0:
            return
        os.close(fd)
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)  # (ended already, unless the run was quicker)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)

    def __deepcopy__(self, memo: dict[int, Any]) -> Ahead:
        return self  # (a copied graph's resources are other objects: none is matched)


def _child(read_end: int, write_end: int, resources: list[Resource]) -> None:  # pragma: no cover
    """The forked child: a verdict byte per resource to `write_end`, then exit at
    once (no atexit, no flush: the parent's buffers are the parent's)."""
    status = 0
    try:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        gc.disable()  # (a collection would touch every object: copies of shared pages)
        os.close(read_end)
        nothing = Resource.ahead_check
        seen: dict[str, Any] = {}
        out = bytearray()
        for res in reversed(resources):  # (the parent starts from the first)
            verdict = OTHER
            if type(res).ahead_check is not nothing:
                try:
                    verdict = CLEAN if res.ahead_check(seen) is True else OTHER
                except Exception:
                    verdict = OTHER
            out.append(verdict)
            if len(out) >= CHUNK:
                _write_all(write_end, out)
                out.clear()
        _write_all(write_end, out)
    except BaseException:
        status = 1  # (the parent sees a short answer: no verdict for the rest)
    finally:
        os._exit(status)


def _write_all(fd: int, data: bytearray) -> None:  # pragma: no cover (the child's)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
