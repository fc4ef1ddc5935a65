"""Open the World a command asked for: sqlite (default), memory or etcd."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from evergraph.world.kv import KV, WorldError

BACKENDS = ("sqlite", "memory", "etcd")


@dataclass(frozen=True)
class WorldOptions:
    backend: str = "sqlite"
    #: the sqlite file; default `<state>/world.sqlite` (agents sharing a host may share one)
    db: Path | None = None
    #: etcd client URLs (`--seeds`)
    seeds: tuple[str, ...] = ()
    #: start an etcd server as a child process, data under the state dir
    embedded: bool = False
    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)

    @property
    def is_etcd(self) -> bool:
        """A cluster World (`run FILE` then also publishes FILE as a deploy)."""
        return bool(self.seeds or self.embedded) or self.backend == "etcd"


class OpenWorld:
    """The KV plus what must be stopped with it (an embedded etcd)."""

    def __init__(self, kv: KV, server: Any = None) -> None:
        self.kv = kv
        self.server = server

    async def close(self) -> None:
        await self.kv.close()
        if self.server is not None:
            self.server.stop()


async def open_world(opts: WorldOptions, state_dir: Path) -> OpenWorld:
    """Raises WorldError with a one-line reason when the World cannot be opened."""
    backend = "etcd" if (opts.seeds or opts.embedded) else opts.backend
    if backend == "sqlite":
        from evergraph.world.sqlite import SQLiteKV

        return OpenWorld(SQLiteKV(opts.db or state_dir / "world.sqlite"))
    if backend == "memory":
        from evergraph.world.memory import MemoryKV

        return OpenWorld(MemoryKV())
    if backend != "etcd":
        raise WorldError(f"unknown World backend {backend!r}: pick one of {', '.join(BACKENDS)}")
    from evergraph.world.etcd import EtcdKV

    server = None
    seeds = list(opts.seeds)
    if opts.embedded:
        from evergraph.world.etcd_server import EtcdServer

        server = EtcdServer.embedded(state_dir / "etcd")
        server.start()
        seeds = [server.client_url, *seeds]
    if not seeds:
        raise WorldError("--world etcd needs --seeds URL[,URL...] or --etcd embedded")
    try:
        kv = EtcdKV(
            seeds,
            ca=opts.ca,
            cert=opts.cert,
            key=opts.key,
            user=opts.user,
            password=opts.password,
        )
        await kv.range("members/")  # fail now, with a clear message, if unreachable
    except BaseException:
        if server is not None:
            server.stop()
        raise
    return OpenWorld(kv, server)
