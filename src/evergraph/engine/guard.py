"""The guard: the one place the engine calls resource code.

Every call into a resource (init, subscribe, watch, check_apply, cleanup) goes
through here, and resource code is never trusted: an exception becomes a
recorded failure of `kind[name]` (outcomes.py), never an engine crash. A
check_apply first takes its tokens (meta.limit/burst), then the global and its
own semaphores (always in one order: no deadlock), under its timeout; every
wait and timer goes through the injected clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import types
from collections.abc import Awaitable, Callable, Coroutine, Generator, Iterator
from typing import Any, TypeVar

from evergraph.engine.contract import Resource, semaphores
from evergraph.engine.state import SUSPENDED_LOW, EngineState, error_text, members, yield_now
from evergraph.engine.vertex import INITIALISED, Vertex

log = logging.getLogger("evergraph.engine")

T = TypeVar("T")


class Guard(EngineState):
    async def _start_vertex(self, v: Vertex) -> None:
        v.ahead = INITIALISED
        res = v.res
        try:
            await res.init(v)
            grouped = members(res)
            for member in grouped:
                await member.init(v)
        except Exception as e:
            self._fail_permanently(v, f"init failed: {e}", revive=False)
            return
        meta = res.meta
        if meta.hidden:
            return
        poll = meta.poll
        if not self.settings.watch or poll < 0:
            return
        if self.one_shot and (poll > 0 or not res.watches()):
            return  # see `one_shot`: ready at once, as under --no-watch
        if poll == 0:
            try:
                v.unsubscribe = res.subscribe()
                if v.unsubscribe is not None and grouped:
                    # members of a group watch passively too; one unsubscribe for all
                    subs = [v.unsubscribe, *(m.subscribe() for m in grouped)]

                    def unsubscribe_all() -> None:
                        for u in subs:
                            if u is not None:
                                u()

                    v.unsubscribe = unsubscribe_all
            except Exception as e:
                self._fail_permanently(v, f"watch failed: {e}", revive=False)
                return
            if v.unsubscribe is not None:
                self.subscriptions += 1
                return
        if poll > 0:
            self.subscriptions += 1
        if poll > 0 or res.watches():
            v.watch_ready = False
            self._unready += 1
            assert self._tg is not None
            v.watch_task = self._tg.create_task(self._watch(v))

    def _init_deferred(self, v: Vertex) -> bool:
        """Initialise now a vertex whose init waited for a verdict from ahead
        (swap.py) that has to run, its verdict taken: inline (the kinds that check
        ahead do not wait in init). True if it may run now; False if it failed, or if its init
        waited after all: a task ends it, then pokes `v` again."""
        coro = self._start_vertex(v)
        try:
            yielded = coro.send(None)
        except StopIteration:
            return not v.failed
        v.running = True  # held back until its init is done
        self._running += 1
        assert self._tg is not None
        self._tg.create_task(self._init_then_poke(v, coro, yielded))
        return False

    async def _init_then_poke(
        self, v: Vertex, coro: Coroutine[Any, Any, None], yielded: Any
    ) -> None:
        try:
            await _resume(coro, yielded)
        finally:
            v.running = False
            self._running -= 1
        self._poke(v)
        self._check_idle()

    def _unsubscribe(self, v: Vertex) -> None:
        if v.unsubscribe is not None:
            unsubscribe, v.unsubscribe = v.unsubscribe, None
            try:
                unsubscribe()
            except Exception as e:
                log.error("%s: unsubscribing its watch failed: %s", v.ident, e)

    async def _call_cleanup(self, v: Vertex) -> None:
        if v.ahead != INITIALISED:
            return  # never initialised (ahead.py): nothing taken
        for res in (v.res, *members(v.res)):
            try:
                await res.cleanup()
            except Exception as e:
                log.error("%s: cleanup failed: %s", res.ident, v.mask(str(e)))

    async def _watch(self, v: Vertex) -> None:
        poll = v.res.meta.poll
        if poll > 0:
            v.ready()
            while True:
                await self.clock.sleep(poll)
                v.event()
        retries = v.res.meta.retry
        while True:
            try:
                await v.res.watch()
                return
            except asyncio.CancelledError:
                raise
            except Exception as e:
                if retries == 0:
                    self._fail_permanently(v, f"watch failed: {e}", revive=False)
                    if not v.watch_ready:
                        v.watch_ready = True
                        self._unready -= 1
                    self._check_idle()
                    return
                if retries > 0:
                    retries -= 1
                log.warning("%s: watch failed (%s); restarting it", v.ident, v.mask(str(e)))
                await self.clock.sleep(v.res.meta.delay / 1000)

    def _check_apply_inline(self, v: Vertex, apply: bool) -> None:
        """An eager kind's check_apply (local syscalls), run inline without a task
        of its own; if it suspends after all, a task drives the rest. Ends with
        `_finish` either way."""
        coro = v.res.check_apply(apply)
        try:
            yielded = coro.send(None)
        except StopIteration as done:
            self._finish(v, bool(done.value), None, apply)
            return
        except Exception as e:
            self._finish(v, True, error_text(e, v.res), apply)
            return
        assert self._tg is not None
        self._suspended += 1
        v.apply_task = self._tg.create_task(self._finish_later(v, coro, yielded, apply))

    async def _finish_later(
        self, v: Vertex, coro: Coroutine[Any, Any, bool], yielded: Any, apply: bool
    ) -> None:
        error: str | None = "cancelled"
        result = True
        try:
            result = bool(await _resume(coro, yielded))
            error = None
        except asyncio.CancelledError:
            raise
        except Exception as e:
            error = error_text(e, v.res)
        finally:
            self._suspended -= 1
            self._finish(v, result, error, apply)
            if self._ready and not self._drain_scheduled and self._suspended <= SUSPENDED_LOW:
                # the drain stopped at SUSPENDED_MAX: room for a batch again
                self._drain_scheduled = True
                asyncio.get_running_loop().call_soon(self._drain)

    async def _guarded_check_apply(self, v: Vertex, res: Resource, apply: bool) -> bool:
        meta = res.meta
        if meta.limit != math.inf:
            with self._waiting_for(v):
                await self._take_token(v, meta.limit, meta.burst)
        grouped = getattr(res, "_group_members", None)
        if grouped:
            # a group holds the semaphores of all its members
            semas = semaphores(s for r in (res, *grouped) for s in r.meta.sema)
            return await self._guarded(v, lambda: res.check_apply_group(apply), semas, meta.timeout)
        if not meta.sema and meta.timeout is None and self._global_sema is None:
            return bool(await res.check_apply(apply))  # the common case, kept lean
        return await self._guarded(
            v, lambda: res.check_apply(apply), semaphores(meta.sema), meta.timeout
        )

    async def _guarded(
        self,
        v: Vertex,
        call: Callable[[], Awaitable[bool]],
        sema: list[tuple[str, int]],
        timeout: float | None,
    ) -> bool:
        """`call()` holding the semaphores `sema` (normalised and ordered by id, as
        `semaphores` gives them: every holder takes shared ones in one order, so
        they cannot deadlock), after the global one."""
        semas = [self._sema(sid, n) for sid, n in sema]
        if self._global_sema is not None:
            semas.insert(0, self._global_sema)
        async with contextlib.AsyncExitStack() as stack:
            with self._waiting_for(v):
                for s in semas:
                    await stack.enter_async_context(s)
            if timeout is not None:
                async with self.clock.timeout(timeout):
                    return bool(await call())
            return bool(await call())
        raise AssertionError("unreachable")  # pragma: no cover

    @contextlib.contextmanager
    def _waiting_for(self, v: Vertex) -> Iterator[None]:
        """While `v`'s run waits for a token or a semaphore: a stop cancels it at once."""
        mine = v.apply_task is not None and v.apply_task is asyncio.current_task()
        if mine:
            self._waiting.add(v)
        try:
            yield
        finally:
            if mine:
                self._waiting.discard(v)

    async def _take_token(self, v: Vertex, limit: float, burst: int) -> None:
        """Token bucket: `burst` starts at once, then `limit` per second."""
        now = self.clock.monotonic()
        if v.bucket_at is None:
            v.tokens, v.bucket_at = float(burst), now
        v.tokens = min(float(burst), v.tokens + (now - v.bucket_at) * limit)
        v.bucket_at = now
        if v.tokens < 1.0:
            wait = (1.0 - v.tokens) / limit
            await self.clock.sleep(wait)
            v.tokens, v.bucket_at = 1.0, self.clock.monotonic()
        v.tokens -= 1.0

    def _sema(self, sid: str, n: int) -> asyncio.Semaphore:
        key = f"{sid}:{n}"
        s = self._semas.get(key)
        if s is None:
            s = self._semas[key] = asyncio.Semaphore(n)
        return s


async def _resume(coro: Coroutine[Any, Any, T], yielded: Any) -> T:
    """Drive a coroutine that was started outside a task and then suspended.

    Does what a Task's step does: wait for what it yielded (a future, or a
    bare yield), then send into it; an exception of the wait (the future's
    own, or our cancellation) is thrown into it.
    """
    while True:
        try:
            if yielded is None:
                await yield_now()
            else:
                await _wait(yielded)
        except BaseException as exc:
            try:
                yielded = coro.throw(exc)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
            continue
        try:
            yielded = coro.send(None)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]


@types.coroutine
def _wait(fut: Any) -> Generator[Any, None, None]:
    """Wait until `fut` is done, leaving its result for the coroutine that awaits it."""
    while not fut.done():
        fut._asyncio_future_blocking = True
        yield fut
