"""The Python frontend: a module defining `def graph(g, world)`, re-run reactively.

`graph()` builds the graph with `g.add(kind, name, **params)` and `g.edge(a, b)`
and may read the World through `world`. Each read is remembered with what it
returned. When the World changes under one of those reads (or the module file
is saved), the reads are evaluated again; only if an answer differs does
`graph()` run again, and the new graph is swapped in live (unchanged
resources are left alone by the engine). Re-runs are debounced, so a burst of
World writes costs one run, and never overlap: one loop does them in turn.

`graph()` runs in a worker thread, so a World read can wait on the agent's
event loop without blocking it. Errors in user code are input errors that
name the user's `file:line`.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import signal
import sys
import threading
import traceback
import types
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from evergraph.cluster.exports import Exported
from evergraph.cluster.members import MEMBERS, Member
from evergraph.cluster.members import members as read_members
from evergraph.cluster.scheduler import chosen, chosen_key, namespace_problem
from evergraph.engine.build import build_resource, known_kinds_hint
from evergraph.engine.contract import Registry, Resource, default_registry
from evergraph.engine.model import Edge, GraphCycleError, GraphModel
from evergraph.errors import InputError
from evergraph.frontends.base import (
    DEBOUNCE,
    Context,
    Frontend,
    file_changes,
    merged,
    read_graph_file,
)
from evergraph.frontends.collect import Built, merge, to_resources
from evergraph.world.follow import SimpleFollower, follow
from evergraph.world.kv import WorldError

log = logging.getLogger("evergraph.frontend.python")

T = TypeVar("T")

_OURS = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _user_frame() -> str:
    """`file:line` of the nearest caller outside evergraph (the user's code)."""
    f = sys._getframe(1)
    while f is not None and f.f_code.co_filename.startswith(_OURS):
        f = f.f_back  # type: ignore[assignment]
    return f"{f.f_code.co_filename}:{f.f_lineno}" if f is not None else ""


#: the longest message of a user's exception shown (it goes on one line)
_MAX_MESSAGE = 500


def _message(e: BaseException) -> str:
    """`Type: message` of a user's exception on one line, even when its `__str__`
    fails (raises anything, or returns a non-string)."""
    name = type(e).__name__
    try:
        text = str(e)
    except BaseException as why:  # user code: anything, even a BaseException
        return f"{name} (its message cannot be shown: str() raised {type(why).__name__})"
    lines = text.strip().splitlines()
    if not lines:
        return name
    first = lines[0] + (" ..." if len(lines) > 1 else "")
    if len(first) > _MAX_MESSAGE:
        first = first[:_MAX_MESSAGE] + " ..."
    return f"{name}: {first}"


def _user_error(e: BaseException, path: Path) -> InputError:
    """An exception from user code as an input error at the user's deepest line."""
    if isinstance(e, InputError):
        return e
    where = str(path)
    home = str(path.parent) + os.sep
    try:
        frames = traceback.extract_tb(e.__traceback__)
    except Exception:  # a frame whose source cannot be read: the module's name will do
        frames = traceback.StackSummary()
    for fs in frames:
        name = os.path.abspath(fs.filename)
        if name.startswith(home) and not name.startswith(_OURS):
            where = f"{fs.filename}:{fs.lineno}"  # the deepest line of the user's own files
    return InputError(_message(e), where)


@contextlib.contextmanager
def _user_code() -> Iterator[list[int]]:
    """Around user code: the SIGINTs received meanwhile, to tell a real Ctrl-C (the
    user stops `check`) from user code raising KeyboardInterrupt (an input error).
    Only the main thread receives one, and only under Python's own handler (the
    agent handles SIGINT itself, and runs graph() in a thread)."""
    seen: list[int] = []
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield seen
        return

    def interrupted(signum: int, frame: object) -> None:
        seen.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupted)
    try:
        yield seen
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _not_plain(fn: Callable[..., Any]) -> str | None:
    """Why `fn` cannot be graph(): it is async or a generator (calling it runs none of
    its body: it would give an empty graph, and a swap to that removes everything)."""
    if inspect.iscoroutinefunction(fn):
        return "graph() is `async def`"
    if inspect.isasyncgenfunction(fn):
        return "graph() is an async generator"
    if inspect.isgeneratorfunction(fn):
        return "graph() is a generator (it yields)"
    return None


def _def_line(fn: Callable[..., Any], path: Path) -> str:
    """`file:line` of graph()'s definition (of its `__call__` for an object)."""
    code = getattr(fn, "__code__", None) or getattr(type(fn).__call__, "__code__", None)
    line = getattr(code, "co_firstlineno", 0)
    return f"{path}:{line}" if line else str(path)


# --------------------------------------------------------------------------- Graph


@dataclass(frozen=True)
class Ref:
    """What `Graph.add` returns: names a resource for `Graph.edge`."""

    kind: str
    name: str

    @property
    def ident(self) -> str:
        return f"{self.kind}[{self.name}]"

    def __str__(self) -> str:
        return self.ident


class Graph:
    """A graph built in Python: `add` resources, connect them with `edge`.

    >>> g = Graph("demo")
    >>> conf = g.add("file", "conf", path="/tmp/demo.conf", content="x\\n")
    >>> reload = g.add("exec", "reload", cmd="echo reloaded")
    >>> g.edge(conf, reload, notify=True)

    Errors (an unknown kind or parameter, a bad value, an edge to nothing) are
    `InputError`s naming the caller's `file:line` and `kind[name].field`.
    """

    def __init__(self, name: str = "", *, registry: Registry | None = None) -> None:
        if registry is None:
            import evergraph.resources  # noqa: F401  (registers the built-in kinds)

            registry = default_registry
        self.name = name
        self.registry = registry
        self._model = GraphModel(name=name)

    def add(self, kind: str, name: str, /, **params: Any) -> Ref:
        """Declare resource `kind[name]` with its parameters (as in YAML, `meta={...}`
        included); returns a reference for `edge`. Adding an equal resource twice is
        fine; a different one under the same name is an error."""
        where = _user_frame()
        if not isinstance(kind, str) or not isinstance(name, str) or not name:
            raise InputError("add(kind, name, ...) needs two non-empty strings", where)
        cls = self.registry.get(kind)
        if cls is None:
            raise InputError(
                f"unknown resource kind {kind!r} {known_kinds_hint(self.registry.kinds(), kind)}",
                where,
            )
        if "name" in params:
            raise InputError(
                f"{kind}[{name}]: give the name once, as add()'s second argument", where
            )
        res = _build(cls, kind, {"name": name, **params}, where)
        try:
            res.validate()
            if res.meta.export:
                res.meta.check(res.ident)
            self._model.add(res, origin=where)
        except InputError as e:
            raise InputError(str(e) if e.where != where else e.message, where) from None
        return Ref(kind, name)

    def edge(
        self,
        a: Ref | str,
        b: Ref | str,
        notify: bool = False,
        send: str | None = None,
        recv: str | None = None,
    ) -> None:
        """`a` before `b`; `notify=True` refreshes `b` when `a` changed something;
        `send`/`recv` pass `a`'s value `send` into `b`'s parameter `recv`."""
        where = _user_frame()
        ends = []
        for end in (a, b):
            if isinstance(end, Ref):
                ends.append(end.ident)
            elif isinstance(end, str):
                ends.append(end)
            else:
                raise InputError(
                    f"edge ends are what add() returned or 'kind[name]' strings, not {end!r}",
                    where,
                )
        if (send is None) != (recv is None):
            raise InputError("an edge that sends a value needs both send= and recv=", where)
        if not isinstance(notify, bool):
            raise InputError("edge notify= must be True or False", where)
        self._model.connect(Edge(ends[0], ends[1], notify=notify, send=send, recv=recv), where)

    def model(self) -> GraphModel:
        """The checked graph (InputError naming where the bad part was declared)."""
        m = self._model
        try:
            m.check()
        except GraphCycleError as e:
            raise InputError(e.message, m.origins.get(e.cycle[0], "")) from None
        except InputError as e:
            ident = e.where.split(".", 1)[0]
            origin = m.origins.get(ident)
            if origin:
                raise InputError(str(e), origin) from None
            raise
        return m


def _build(cls: type[Resource], kind: str, item: dict[str, Any], where: str) -> Resource:
    def fail(msg: str, *_: object, **__: object) -> InputError:
        return InputError(msg, where)

    return build_resource(cls, kind, item, (), fail)


# --------------------------------------------------------------------------- World


@dataclass(frozen=True)
class Collected:
    """A resource another host exported to this one."""

    kind: str
    name: str
    #: the exporting host
    host: str
    params: dict[str, Any]


def _collected(e: Exported) -> Collected:
    return Collected(e.kind, e.name, e.src, e.params)


@dataclass
class _Read:
    kind: str  # "get" | "collect" | "members" | "schedule"
    arg: str
    answer: object


class World:
    """The World as `graph()` sees it: every read is remembered, so that a change
    under it runs `graph()` again. Without a World (`evergraph check`), reads
    give their defaults and empty lists."""

    def __init__(
        self, ctx: Context | None = None, loop: asyncio.AbstractEventLoop | None = None
    ) -> None:
        self._ctx = ctx
        self._loop = loop
        self.reads: list[_Read] = []
        #: collected exports to add to the graph
        self.collected: list[Exported] = []

    @property
    def host(self) -> str:
        """This host's name."""
        return self._ctx.hostname if self._ctx is not None else os.uname().nodename

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=60)

    def get(self, key: str, default: str | None = None) -> str | None:
        """The value at `key` (text), or `default` when there is none."""
        if not isinstance(key, str) or not key:
            raise InputError("world.get(key) needs a non-empty string", _user_frame())
        value: bytes | None = None
        if self._ctx is not None and self._ctx.kv is not None:
            value = self._call(_get(self._ctx, key))
        self.reads.append(_Read("get", key, value))
        return default if value is None else value.decode("utf-8", "replace")

    def collect(
        self,
        kind: str | None = None,
        where: Callable[[Collected], bool] | None = None,
        add: bool = True,
    ) -> list[Collected]:
        """Resources other hosts export to this one (of `kind`, those `where(r)` is
        true for), in (kind, name, host) order. With `add` (the default) they also
        join this graph, as YAML's `collect:` does."""
        found: list[Exported] = []
        if self._ctx is not None and self._ctx.collector is not None:
            found = self._call(_collect(self._ctx))
        self.reads.append(_Read("collect", "", found))
        out = []
        for e in found:
            if kind is not None and e.kind != kind:
                continue
            if where is not None and not where(_collected(e)):
                continue
            out.append(e)
            if add:
                self.collected.append(e)
        return [_collected(e) for e in out]

    def members(self, where: Callable[[Member], bool] | None = None) -> list[Member]:
        """The live cluster members (host, address, capabilities, groups, state, ...)."""
        found: list[Member] = []
        if self._ctx is not None and self._ctx.kv is not None:
            found = self._call(_members(self._ctx))
        self.reads.append(_Read("members", "", found))
        return [m for m in found if where is None or where(m)]

    def schedule(self, ns: str) -> list[str]:
        """The hosts the scheduler chose in namespace `ns` (hosts volunteer with a
        `schedule` resource), in name order; [] until a choice is made."""
        why = namespace_problem(ns)
        if why is not None:
            raise InputError(f"world.schedule(ns): {why}", _user_frame())
        found: list[str] = []
        if self._ctx is not None and self._ctx.kv is not None:
            found = self._call(_schedule(self._ctx, ns))
        self.reads.append(_Read("schedule", ns, found))
        return list(found)


async def _get(ctx: Context, key: str) -> bytes | None:
    assert ctx.kv is not None
    item = await ctx.kv.get(key)
    return None if item is None else item.value


async def _collect(ctx: Context) -> list[Exported]:
    known = set(ctx.registry.kinds())
    return [e for e in await ctx.collected() if e.kind in known]


async def _members(ctx: Context) -> list[Member]:
    assert ctx.kv is not None
    # the timestamp moves on every lease renewal: not a change anyone reads for
    return [msgspec.structs.replace(m, timestamp=0.0) for m in await read_members(ctx.kv)]


async def _schedule(ctx: Context, ns: str) -> list[str]:
    assert ctx.kv is not None
    return await chosen(ctx.kv, ns)


async def _answer(ctx: Context, read: _Read) -> object:
    if read.kind == "get":
        return await _get(ctx, read.arg)
    if read.kind == "collect":
        return await _collect(ctx)
    if read.kind == "schedule":
        return await _schedule(ctx, read.arg)
    return await _members(ctx)


def _prefixes(ctx: Context, reads: list[_Read]) -> set[str]:
    out: set[str] = set()
    for r in reads:
        if r.kind == "get":
            out.add(r.arg)
        elif r.kind == "collect":
            continue  # the collector tells (see updates)
        elif r.kind == "schedule":
            out.add(chosen_key(r.arg))
        else:
            out.add(MEMBERS)
    return out


# --------------------------------------------------------------------------- frontend


@dataclass
class _Module:
    path: Path
    fn: Callable[..., Any]
    text: str = field(repr=False)


def load_module(path: Path) -> _Module:
    """Compile and run the module; its `graph` function (InputError otherwise)."""
    text = read_graph_file(path)
    try:
        code = compile(text, str(path), "exec", dont_inherit=True)
    except SyntaxError as e:
        where = f"{path}:{e.lineno}" + (f":{e.offset}" if e.offset else "")
        raise InputError(f"Python syntax error: {e.msg}", where) from None
    module = types.ModuleType(f"evergraph_graph_{path.stem}")
    module.__file__ = str(path)
    _fresh_imports(str(path.parent))
    with _user_code() as sigints:
        try:
            exec(code, module.__dict__)
        except BaseException as e:  # user code: sys.exit(), GeneratorExit, its own kinds...
            if sigints:
                raise  # a real Ctrl-C
            raise _user_error(e, path) from None
    fn = module.__dict__.get("graph")
    if not callable(fn):
        raise InputError("the module defines no `def graph(g, world)`", str(path))
    why = _not_plain(fn)
    if why:
        raise InputError(f"{why}: write a plain `def graph(g, world)`", _def_line(fn, path))
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError:
        raise InputError(
            "graph() must take two arguments: (g, world)", _def_line(fn, path)
        ) from None
    except ValueError:
        pass  # no signature to check (a builtin): let the call tell
    return _Module(path, fn, text)


#: after this long, say that graph() is still running
SLOW_RUN = 10.0


async def _in_thread(fn: Callable[..., T], *args: Any, what: str) -> T:
    """`fn(*args)` in a daemon thread: user code that never returns must not keep
    the agent from stopping (the default executor's threads are joined at exit)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if fut.done():
            return
        if ok:
            fut.set_result(value)
            return
        try:
            fut.set_exception(value)
        except TypeError:  # StopIteration: a Future cannot hold one
            err = RuntimeError(f"{what} raised {type(value).__name__}")
            err.__cause__ = value
            fut.set_exception(err)

    def body() -> None:
        outcome: tuple[bool, Any]
        try:
            outcome = (True, fn(*args))
        except Exception as e:
            outcome = (False, e)
        except BaseException as e:
            # not an Exception (GeneratorExit, KeyboardInterrupt, a user's own kind):
            # raised in the loop, it would end the agent; a Future refuses some outright
            err = RuntimeError(f"{what} raised {type(e).__name__}")
            err.__cause__ = e
            outcome = (False, err)
        with contextlib.suppress(RuntimeError):  # the agent stopped meanwhile
            loop.call_soon_threadsafe(settle, *outcome)

    threading.Thread(target=body, name="graph()", daemon=True).start()
    while True:
        try:
            return await asyncio.wait_for(asyncio.shield(fut), SLOW_RUN)
        except TimeoutError:
            log.warning("%s has run for %.0f s and has not returned yet", what, SLOW_RUN)


#: the directory put on sys.path for graph modules (a list: at most the current one)
_graph_dirs: list[str] = []
_KEEP = (_OURS, sys.prefix + os.sep, sys.base_prefix + os.sep)


def _fresh_imports(directory: str) -> None:
    """Let a graph module import its neighbours, as they are now: `directory` goes
    on sys.path (replacing an earlier graph's, e.g. a previous deploy), and modules
    imported from graph directories before are forgotten, so that an edited or
    newly deployed helper module is imported afresh rather than from the cache."""
    prefixes = tuple(d.rstrip(os.sep) + os.sep for d in {*_graph_dirs, directory})
    for d in _graph_dirs:
        if d != directory:
            with contextlib.suppress(ValueError):
                sys.path.remove(d)
    _graph_dirs[:] = [directory]
    if directory not in sys.path:
        sys.path.insert(0, directory)
    for name, mod in list(sys.modules.items()):
        f = getattr(mod, "__file__", None)
        if f and f.startswith(prefixes) and not f.startswith(_KEEP):
            del sys.modules[name]


class PythonFrontend(Frontend):
    """A Python graph module, re-run when its World reads or its file change."""

    def __init__(self, path: str | Path, registry: Registry) -> None:
        self.path = Path(path).absolute()
        self.label = str(path)
        self.registry = registry
        self._module: _Module | None = None
        self._reads: list[_Read] = []
        #: how many times graph() has run (tests and logs)
        self.runs = 0
        #: the collected exports as built last time (an unchanged one is not rebuilt)
        self._built = Built()

    def _loaded(self) -> _Module:
        if self._module is None:
            self._module = load_module(self.path)
        return self._module

    def graph_file(self) -> Path:
        return self.path

    def preload(self) -> None:
        self._loaded()

    def render(self, world: World) -> GraphModel:
        """Run graph() once against `world`; the graph with what it collected."""
        mod = self._loaded()
        g = Graph(self.path.stem, registry=self.registry)
        self.runs += 1
        with _user_code() as sigints:
            try:
                result = mod.fn(g, world)
            except WorldError:
                raise  # the World failed, not the user's code
            except BaseException as e:  # sys.exit(), GeneratorExit... in graph() are not ours
                if sigints:
                    raise  # a real Ctrl-C
                raise _user_error(e, self.path) from None
        if inspect.isawaitable(result) or inspect.isgenerator(result) or inspect.isasyncgen(result):
            # an async graph() that _not_plain could not see (a callable object, ...):
            # its body never ran, so this graph is empty, not what the user meant
            if inspect.iscoroutine(result) or inspect.isgenerator(result):
                result.close()  # never started: nothing runs, no "never awaited" warning
            raise InputError(
                f"graph() returned a {type(result).__name__}, so none of it ran (it is async "
                "or a generator): "
                "write a plain `def graph(g, world)`",
                _def_line(mod.fn, self.path),
            )
        model = g.model()
        if world.collected:
            model = merge(model, to_resources(self.registry, world.collected, self._built))
        return model

    def load(self) -> GraphModel:
        return self.render(World())

    async def _render(self, ctx: Context) -> GraphModel:
        world = World(ctx, asyncio.get_running_loop())
        model = await _in_thread(self.render, world, what=f"graph() of {self.path}")
        self._reads = world.reads
        return model

    async def first(self, ctx: Context) -> GraphModel:
        return await self._render(ctx)

    async def _changed_reads(self, ctx: Context) -> bool:
        try:
            for r in self._reads:
                if await _answer(ctx, r) != r.answer:
                    return True
        except WorldError:
            return True  # cannot tell: run graph(), which reports the failure
        return False

    async def updates(self, ctx: Context) -> AsyncIterator[GraphModel]:
        if ctx.watcher is None:
            return
        kv = ctx.kv
        wake: asyncio.Queue[str] = asyncio.Queue()
        #: every watch of a World prefix graph() read, owned by this stream: cancelled
        #: when graph() stops reading it (then kept in `retired`) or the stream ends,
        #: and awaited at its end (a TaskGroup cannot span this generator's `yield`)
        watching: dict[str, asyncio.Task[None]] = {}
        retired: list[asyncio.Task[None]] = []

        async def watch(prefix: str) -> None:
            # follow(): backoff, resume and resync in one place. Its first batch
            # wakes us once, and the answers are compared: a change made between
            # graph()'s reads and this watch is never lost.
            assert kv is not None
            await follow(kv, prefix, SimpleFollower(on_batch_done=lambda: wake.put_nowait("world")))

        unlisten = (
            ctx.collector.listen(lambda: wake.put_nowait("world"))
            if ctx.collector is not None
            else None
        )

        def rewatch() -> None:
            want = _prefixes(ctx, self._reads) if kv is not None else set()
            for p in set(watching) - want:
                t = watching.pop(p)
                t.cancel()
                retired.append(t)  # still ours: awaited when this stream ends
            retired[:] = [t for t in retired if not t.done()]
            for p in want - set(watching):
                watching[p] = asyncio.create_task(watch(p))

        async def texts() -> AsyncIterator[tuple[str, Any]]:
            async for text in file_changes(ctx.watcher, self.path, self._loaded().text):
                yield "file", text

        async def woken() -> AsyncIterator[tuple[str, Any]]:
            while True:
                yield await wake.get(), None

        rewatch()
        try:
            async for what, _ in merged(texts(), woken()):
                # coalesce a burst: whatever else arrives within the debounce joins this run
                await asyncio.sleep(DEBOUNCE)
                kinds = {what}
                while not wake.empty():
                    kinds.add(wake.get_nowait())
                if "file" in kinds:
                    try:
                        self._module = load_module(self.path)
                    except InputError as e:
                        log.error("%s (the running graph is kept)", e)
                        continue
                    log.info("%s changed: running graph() again", self.path)
                elif not await self._changed_reads(ctx):
                    continue
                else:
                    log.info("the World changed under graph(): running it again")
                try:
                    model = await self._render(ctx)
                except (InputError, WorldError) as e:
                    log.error("%s (the running graph is kept)", e)
                    continue
                finally:
                    rewatch()
                yield model
        finally:
            if unlisten is not None:
                unlisten()
            for t in watching.values():
                t.cancel()
            for t in watching.values():
                with contextlib.suppress(asyncio.CancelledError):
                    await t
            # what a watch cancelled before ended with is of no interest (as before)
            await asyncio.gather(*retired, return_exceptions=True)
