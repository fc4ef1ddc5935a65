"""Backends for the World contract tests: each yields a factory of KV clients that
share one World (as several hosts or processes would)."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

from evergraph.world.kv import KV

BACKENDS = ["memory", "sqlite", "etcd"]

Factory = Callable[[], KV]


@contextlib.contextmanager
def world_factory(backend: str, tmp_path: Path) -> Iterator[tuple[Factory, object]]:
    """(factory, server): `factory()` opens a new client inside the running loop;
    `server` is the etcd server (for restart tests) or None."""
    if backend == "memory":
        from evergraph.world.memory import MemoryKV, MemoryStore

        store: list[MemoryStore] = []

        def memory() -> KV:
            if not store:  # the store's asyncio objects belong to the test's loop
                store.append(MemoryStore())
            return MemoryKV(store[0])

        yield memory, None
    elif backend == "sqlite":
        from evergraph.world.sqlite import SQLiteKV

        path = tmp_path / "world.sqlite"
        yield (lambda: SQLiteKV(path)), None
    elif backend == "etcd":
        from evergraph.world.etcd import EtcdKV
        from evergraph.world.etcd_server import EtcdServer

        data = Path(tempfile.mkdtemp(prefix="evergraph-etcd-", dir="/dev/shm"))
        server = EtcdServer.single(data)
        try:
            server.start()
            yield (lambda: EtcdKV([server.client_url])), server
        finally:
            server.stop()
            shutil.rmtree(data, ignore_errors=True)
    else:
        raise ValueError(backend)


def run_pair(factory: Factory, body: Callable[[KV, KV], Awaitable[None]]) -> None:
    """Run `body(a, b)` with two clients of one World (as two hosts), then close both."""

    async def main() -> None:
        a, b = factory(), factory()
        try:
            await asyncio.wait_for(body(a, b), 30)
        finally:
            await a.close()
            await b.close()

    asyncio.run(main())
