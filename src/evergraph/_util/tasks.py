"""Owned concurrency in two shapes the code needs again and again: a race ("wait for
whichever comes first: the work, or the signal to stop it") and a bounded fan-in
("do this for each item, at most N at once, and give me every answer").

Both own every task they start: when they return or raise, nothing they started is
still running, and a cancel of the caller cancels (and awaits) them all. Nothing
here imports anything of ours."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Sequence, Sized
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")


async def first_of(*aws: Awaitable[T]) -> T:
    """The result of the first of `aws` to finish; the others are cancelled and
    awaited before this returns.

    If the first to finish raised, its exception is raised here (the others are
    cancelled all the same). When several finish in the same turn of the loop, an
    exception among them wins over a result, then the order of `aws` decides. A
    loser that raises while it is being cancelled is not reported: it lost.
    Cancelling the caller cancels and awaits every one of `aws`."""
    if not aws:
        raise ValueError("first_of() needs at least one awaitable")
    tasks = [asyncio.ensure_future(aw) for aw in aws]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        await _cancel_and_wait(tasks)
    finished = [t for t in tasks if t in done]
    for t in finished:
        if not t.cancelled() and t.exception() is not None:
            raise _exception(t)
    for t in finished:
        if not t.cancelled():
            return t.result()
    # every finished one was cancelled from elsewhere: so are we, in effect
    raise asyncio.CancelledError


async def fan_in(items: Iterable[T], limit: int, fn: Callable[[T], Awaitable[R]]) -> list[R]:
    """`[await fn(item) for item in items]`, with at most `limit` calls running at
    once; the answers in the order of `items`.

    `items` is read lazily, one item per free slot, so a long iterable does not
    become a long list of tasks. The first call to fail stops the fan-in: the
    calls still running are cancelled and awaited, and that exception is raised
    (itself, not in a group)."""
    if limit < 1:
        raise ValueError(f"fan_in() needs a limit of at least 1, not {limit}")
    results: dict[int, R] = {}
    numbered = enumerate(items)  # shared by the workers: each takes the next item

    async def worker() -> None:
        for i, item in numbered:
            results[i] = await fn(item)

    if isinstance(items, Sized):
        limit = min(limit, len(items))  # no idle workers for a short list
    try:
        async with asyncio.TaskGroup() as tg:
            for _ in range(limit):
                tg.create_task(worker())
    except BaseExceptionGroup as group:
        raise _first_leaf(group) from None
    return [results[i] for i in range(len(results))]


async def _cancel_and_wait(tasks: Sequence[asyncio.Future[Any]]) -> None:
    """Cancel `tasks` and wait until each has ended. A cancel of the caller while
    waiting is held until they have ended, then raised: nothing is left running."""
    pending = [t for t in tasks if not t.done()]
    for t in pending:
        t.cancel()
    cancelled = False
    while pending:
        try:
            await asyncio.wait(pending)
        except asyncio.CancelledError:
            cancelled = True
        pending = [t for t in pending if not t.done()]
    # retrieve every outcome, so none is logged as "never retrieved"
    for t in tasks:
        if t.done() and not t.cancelled():
            t.exception()
    if cancelled:
        raise asyncio.CancelledError


def _exception(task: asyncio.Future[Any]) -> BaseException:
    exc = task.exception()
    assert exc is not None
    return exc


def _first_leaf(group: BaseExceptionGroup[BaseException]) -> BaseException:
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc
