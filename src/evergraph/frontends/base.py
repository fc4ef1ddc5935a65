"""The frontend interface: a frontend is a stream of graphs the engine runs.

`first(ctx)` returns the first graph (an `InputError` there is an input error:
exit 2); `updates(ctx)` then yields each later graph, for as long as the agent
runs. A later input error is logged by the frontend, which keeps quiet until
its input changes again: the running graph stays. Graphs are *unprepared*:
the agent adds automatic edges and grouping, and publishes what they export.

YAML files, Python modules, deploys and embedded `Graph` objects are all
frontends; `frontends.open.open_frontend` picks one for a path.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import os
import stat
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from evergraph.engine.contract import Registry
from evergraph.engine.model import GraphModel
from evergraph.errors import InputError

if TYPE_CHECKING:
    from evergraph.cluster.exports import Collector, Exported
    from evergraph.engine.ahead import Ahead
    from evergraph.world.kv import KV

log = logging.getLogger("evergraph.frontend")

#: graph file types, by suffix
SUFFIXES = (".yaml", ".yml", ".py")


class Context(msgspec.Struct):
    """What a frontend may use while it runs. (A Struct: a dataclass's generated
    methods are compiled at import, ~0.7 ms of every run.)"""

    registry: Registry
    hostname: str
    state_dir: Path
    #: the agent's file watcher (`subscribe(path, cb)`); None with --no-watch
    watcher: Any = None
    #: the World; None when the agent runs without one
    kv: KV | None = None
    #: what other hosts export to this one (checked); None without a World
    collector: Collector | None = None

    async def collected(self) -> list[Exported]:
        """The exports collected now (after the collector's first full read)."""
        if self.collector is None:
            return []
        await self.collector.ready.wait()
        return self.collector.current()


class Frontend(abc.ABC):
    #: what to call this frontend in messages (a file name, "deploys", ...)
    label: str = ""
    #: reads its graphs from a World other processes write (deploys)
    needs_shared_world = False

    def graph_file(self) -> Path | None:
        """The graph file, for frontends that read one."""
        return None

    def cache_parses(self, state_dir: Path | None) -> None:  # noqa: B027  (optional hook)
        """Keep parsed graphs under `state_dir` (None: the user's cache directory)
        for the next run, if this frontend can (frontends/cache.py)."""

    def one_shot(self) -> None:  # noqa: B027  (optional hook)
        """Called before the first load when the run takes the first graph only
        (`updates` is never asked for): keep nothing only a later graph would read
        (the text, the validated resources and their claims kept for a live edit)."""

    def preload(self) -> None:  # noqa: B027  (optional hook)
        """Check the input before anything is started (a syntax error exits at once)."""

    def check_ahead(self, creates: bool, journal: Path | None = None) -> Ahead | None:
        """After `preload`, in a run that ends once converged: start checking the
        preloaded graph's resources in a child (engine/ahead.py; `creates`: making
        the missing ones too, said in `journal`), if this frontend keeps one; the
        first graph carries it (`GraphModel.ahead`)."""
        return None

    @abc.abstractmethod
    def load(self) -> GraphModel:
        """The graph as it is now, without a World (for `check` and `graph`)."""

    @abc.abstractmethod
    async def first(self, ctx: Context) -> GraphModel:
        """The first graph; raises InputError."""

    def updates(self, ctx: Context) -> AsyncIterator[GraphModel]:
        """Later graphs. The default: none (a graph that never changes)."""
        return _nothing()


async def _nothing() -> AsyncIterator[GraphModel]:
    return
    yield  # pragma: no cover  (makes this an async generator)


class Static(Frontend):
    """One graph, built in code (`evergraph.Graph`)."""

    def __init__(self, model: GraphModel, label: str = "graph") -> None:
        self.model = model
        self.label = label

    def load(self) -> GraphModel:
        return self.model

    async def first(self, ctx: Context) -> GraphModel:
        return self.model


async def merged(*streams: AsyncIterator[tuple[str, Any]]) -> AsyncIterator[tuple[str, Any]]:
    """Items of several async iterators as they come; ends when all have ended."""
    import asyncio  # here: `check` reads a graph without an event loop

    queue: asyncio.Queue[tuple[str, Any] | None] = asyncio.Queue()

    async def pump(it: AsyncIterator[tuple[str, Any]]) -> None:
        try:
            async for item in it:
                await queue.put(item)
        except Exception as e:  # handed to the consumer, which raises it
            await queue.put(("!error", e))
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        live = len(tasks)
        while live:
            item = await queue.get()
            if item is None:
                live -= 1
                continue
            if item[0] == "!error":
                raise item[1]
            yield item
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t


#: the largest graph file read (a graph of 100,000 resources is a few MiB): a file
#: that never ends (a symlink to /dev/zero) must not fill the memory
MAX_GRAPH_FILE = 16 * 1024 * 1024


def _file_type(mode: int) -> str:
    for test, what in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a directory"),
    ):
        if test(mode):
            return what
    return "a special file"


def read_graph_file(path: Path) -> str:
    """The text of a graph file (InputError naming the file if it cannot be one):
    a regular file (symlinks followed) of at most MAX_GRAPH_FILE bytes of UTF-8.
    Opened without blocking, so a FIFO is refused rather than waited on."""
    return graph_text(read_graph_bytes(path), path)


def read_graph_bytes(path: Path) -> bytes:
    """The bytes of a graph file, read as `read_graph_file` reads them (the parse
    cache hashes the very bytes it parses; `graph_text` decodes them)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise InputError("no such file", str(path)) from None
    except OSError as e:
        raise InputError(f"cannot read: {e.strerror}", str(path)) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InputError(
                f"{_file_type(st.st_mode)}, not a regular file: a graph file must be a "
                "regular file",
                str(path),
            )
        cap = MAX_GRAPH_FILE
        if st.st_size > cap:
            raise InputError(_too_large(st.st_size), str(path))
        chunks: list[bytes] = []
        size = 0
        # the whole file in one read, a byte more to see it grew (one buffer: no
        # join's copy, half the page faults of a 2.7 MB graph), then by 1 MiB
        step = st.st_size + 1
        while True:  # the size can grow while we read: never more than the cap
            chunk = os.read(fd, min(step, cap + 1 - size))
            step = 1 << 20
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
            if size > cap:
                raise InputError(_too_large(None), str(path))
    except OSError as e:
        raise InputError(f"cannot read: {e.strerror}", str(path)) from None
    finally:
        os.close(fd)
    return b"".join(chunks)


def graph_text(data: bytes, path: Path) -> str:
    """A graph file's bytes as text (InputError naming the file if not UTF-8)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(
            f"not UTF-8 text (byte {e.start} is {e.object[e.start]:#04x})", str(path)
        ) from None


def _too_large(size: int | None) -> str:
    """`size`: the file's size, or None if it grew past the cap while being read."""
    limit = f"{MAX_GRAPH_FILE // 1024 // 1024} MiB"
    shown = f"{size / 1024 / 1024:.1f} MiB" if size is not None else f"more than {limit}"
    return f"too large ({shown}): a graph file may be at most {limit}"


#: wait this long after the last event of a watched file before reading it:
#: editors save in several steps (write, rename, chmod)
DEBOUNCE = 0.05
#: ... or only this long when the last event ends a save: a file closed after
#: writing, or renamed into place (a later step of the same save still lands
#: within it, and an event after the read is read again anyway)
SETTLE = 0.01
#: the end of a save, as inotify reports it (IN_CLOSE_WRITE, IN_MOVED_TO)
_SAVED = 0x8 | 0x80


async def file_changes(watcher: Any, path: Path, text: str) -> AsyncIterator[str]:
    """The file's new text after each saved change (`text`: what was read last).

    The file is read once no event came for DEBOUNCE (SETTLE after the end of
    a save), so the steps of one save make one change.
    The file was read before this watch existed: a save in between would be
    lost, so it is read once more as soon as the watch is armed."""
    import asyncio

    loop = asyncio.get_running_loop()
    changed = asyncio.Event()
    last_at, last_mask = 0.0, 0  # when the last event came, and its mask

    def on_event(mask: int) -> None:
        nonlocal last_at, last_mask
        last_at, last_mask = loop.time(), mask
        changed.set()

    unsubscribe = watcher.subscribe(str(path), on_event)
    changed.set()  # the re-read after arming
    try:
        while True:
            await changed.wait()
            while True:  # until quiet: each event restarts the wait
                quiet = SETTLE if last_mask & _SAVED else DEBOUNCE
                left = last_at + quiet - loop.time()
                if left <= 0:
                    break
                # woken by the next event too: the save's end shortens the wait
                changed.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(left):
                        await changed.wait()
            changed.clear()
            try:
                new = read_graph_file(path)
            except InputError as e:
                if path.exists():  # else mid-save (removed before rename): an event follows
                    log.error("%s (the running graph is kept)", e)
                continue
            if new != text:
                text = new
                yield new
    finally:
        unsubscribe()
