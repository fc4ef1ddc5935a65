"""Change events from /proc files that signal them with POLLPRI.

A few kernel files say "I changed" through poll(2) rather than inotify:
`/proc/self/mountinfo` (a mount or unmount in this mount namespace) and the
`/proc/sys/kernel/*` UTS strings (`sethostname(2)`, `setdomainname(2)`). They
always poll readable, so asyncio's `add_reader` (EPOLLIN) would spin; the
change is EPOLLPRI|EPOLLERR, which asyncio cannot ask for.

So each watched file gets its own small epoll instance that asks for exactly
those bits, and that epoll's descriptor (readable when the file has news) is
handed to the event loop with `add_reader`: no thread, no timer. The kernel
marks the event seen when the file is polled, which the event loop's own check
of the inner epoll may already do: the callback then finds nothing in the inner
epoll, and calls back all the same (something did change).
"""

from __future__ import annotations

import asyncio
import os
import select
from collections.abc import Callable


def watch_pri(path: str, callback: Callable[[], None]) -> Callable[[], None]:
    """Call `callback()` in the running event loop after each change of `path` (a
    /proc file that signals changes with POLLPRI). Returns the unsubscribe. OSError
    when the file cannot be opened (opening arms it: changes before are not told)."""
    loop = asyncio.get_running_loop()
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        ep = select.epoll(1)
        try:
            ep.register(fd, select.EPOLLPRI | select.EPOLLERR)
        except BaseException:
            ep.close()
            raise
    except BaseException:
        os.close(fd)
        raise

    def ready() -> None:
        ep.poll(0)  # takes the news (if the loop's check has not already)
        callback()

    loop.add_reader(ep.fileno(), ready)
    stopped = False

    def stop() -> None:
        nonlocal stopped
        if stopped:
            return
        stopped = True
        if not loop.is_closed():
            loop.remove_reader(ep.fileno())
        ep.close()
        os.close(fd)

    return stop
