"""What the tests of exports share: one host's publisher, collector and book of
host keys on a shared World, run in process; the parameters of an exported file."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from evergraph.cluster.ca import ClusterCA
from evergraph.cluster.exports import Collector, HostKeyBook, Publisher, publish_hostkeys
from evergraph.cluster.hostkeys import HostKeys
from evergraph.cluster.pins import Pins
from evergraph.world.kv import KV


class Host:
    """One host's publisher, collector and book on a shared World."""

    def __init__(self, kv: KV, state: Path, name: str, ca: ClusterCA | None = None) -> None:
        """With `ca`: a World with a cluster CA; the host holds the CA's certificate
        of its keys, its book the CA's certificate only (and `revoked`, its CRL)."""
        self.kv = kv
        self.name = name
        self.keys = HostKeys(state)
        self.pins = Pins(state)
        self.cert = ca.issue_host(name, self.keys.public, self.keys.verify) if ca else None
        #: the serials this host knows revoked (its CRL)
        self.revoked: set[int] = set()
        self.book = HostKeyBook(
            kv,
            self.pins,
            name,
            own=self.keys if ca else None,
            ca=ClusterCA.from_pem(ca.cert_pem) if ca else None,
            own_cert=self.cert,
            revoked=lambda: self.revoked,
        )
        self.publisher = Publisher(kv, self.keys, name, self.book, lambda: 0)
        self.collector = Collector(kv, self.keys, name, self.book)
        self.changes = asyncio.Queue[list[Any]]()
        self.collector.listen(lambda: self.changes.put_nowait(self.collector.current()))

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Host]:
        await publish_hostkeys(self.kv, self.keys, self.name, cert=self.cert)
        async with asyncio.TaskGroup() as tg:
            tasks = [
                tg.create_task(self.book.run()),
                tg.create_task(self.publisher.run()),
                tg.create_task(self.collector.run()),
            ]
            await self.book.ready.wait()
            await self.collector.ready.wait()
            try:
                yield self
            finally:
                for t in tasks:
                    t.cancel()

    async def next_change(self) -> list[Any]:
        return await asyncio.wait_for(self.changes.get(), 10)


def file_params(content: str) -> dict[str, Any]:
    """The parameters of an exported file holding `content`."""
    return {"path": "/nonexistent/x", "content": content}
