"""Shared pieces of the identity and replay attack tests: a World (sqlite file or a
real etcd) that real agents join and the test, as the attacker, writes directly."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from evergraph.cluster.hostkeys import HostKeys
from evergraph.world.etcd_server import EtcdServer
from evergraph.world.kv import KV, Put

T = TypeVar("T")


class AttackWorld:
    """The World the agents share; `args` are their options, `call(fn)` runs
    `fn(kv)` on a fresh client of it (the attacker holds no host key)."""

    def __init__(self, kind: str, tmp_path: Path, servers: list[EtcdServer], shm: Path) -> None:
        self.kind = kind
        if kind == "sqlite":
            db = tmp_path / "world.sqlite"
            self.args: tuple[str, ...] = ("--world-db", str(db))
            self._make: Callable[[], KV] = lambda: _sqlite(db)
        else:
            server = EtcdServer.single(shm)
            servers.append(server)
            server.start()
            url = server.client_url
            self.args = ("--seeds", url)
            self._make = lambda: _etcd(url)

    def call(self, fn: Callable[[KV], Awaitable[T]]) -> T:
        async def main() -> T:
            kv = self._make()
            try:
                return await asyncio.wait_for(fn(kv), 30)
            finally:
                await kv.close()

        return asyncio.run(main())

    def get(self, key: str) -> bytes | None:
        async def fn(kv: KV) -> bytes | None:
            item = await kv.get(key)
            return item.value if item is not None else None

        return self.call(fn)

    def put(self, key: str, value: bytes) -> None:
        async def fn(kv: KV) -> None:
            await kv.put(key, value)

        self.call(fn)

    def delete(self, key: str) -> None:
        async def fn(kv: KV) -> None:
            await kv.delete(key)

        self.call(fn)


def _sqlite(db: Path) -> KV:
    from evergraph.world.sqlite import SQLiteKV

    return SQLiteKV(db)


def _etcd(url: str) -> KV:
    from evergraph.world.etcd import EtcdKV

    return EtcdKV([url])


def host_key_record(host: str, keys: HostKeys) -> bytes:
    return json.dumps({"host": host, "public": keys.public, "verify": keys.verify}).encode()


def forged_export(
    mallory: HostKeys,
    src: str,
    to: str,
    path: Path,
    content: str,
    seq: int = 1 << 60,
    public: str | None = None,
) -> list[Put]:
    """A `file` export "from `src`" and its index, both signed by Mallory's key
    (`public`: the target's key, to seal a directed one)."""
    from evergraph.cluster.exports import (
        entry_name,
        export_key,
        index_key,
        make_index,
        make_record,
        record_digest,
    )

    name = str(path)
    key = export_key(to, src, "file", name)
    params: dict[str, Any] = {"path": name, "content": content}
    rec = make_record(mallory, src, to, "file", name, params, public, seq)
    index = make_index(mallory, src, to, seq + 1, {entry_name(key): (seq, record_digest(rec))})
    return [Put(key, rec), Put(index_key(to, src), index)]


def file_export_graph(graph: str, path: Path, content: str, to: str = "*") -> str:
    return (
        f"graph: {graph}\nresources:\n  file:\n"
        f"  - name: {path}\n    content: {json.dumps(content)}\n"
        f'    meta: {{export: ["{to}"], hidden: true}}\n'
    )


COLLECT_FILES = "graph: b\nresources:\n  noop:\n  - name: b\ncollect:\n- {kind: file}\n"
