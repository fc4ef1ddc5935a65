"""Open the World a command asked for: sqlite (default), memory or etcd."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from evergraph.errors import InputError
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
    #: `--etcd embedded`: what this member listens on and advertises
    client_url: str = "http://127.0.0.1:2379"
    peer_url: str = "http://127.0.0.1:2380"
    #: `--join-token-file` (else EVERGRAPH_JOIN_TOKEN): joining a cluster
    join_token_file: Path | None = None
    #: `--etcd-member-timeout`: a dead voter is replaced after this many seconds
    member_timeout: float = 15.0
    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    #: the client ends soon (a run that exits once converged: sqlite's notifier of
    #: other processes' commits arms later, see world/_sqlite_notify.py)
    short_lived: bool = False

    @property
    def is_etcd(self) -> bool:
        """A cluster World (`run FILE` then also publishes FILE as a deploy)."""
        return bool(self.seeds or self.embedded) or self.backend == "etcd"


def seed_problem(url: str) -> str | None:
    """Why `url` is not an etcd client URL, `http(s)://host[:port]`; None if it is."""
    if any(c.isspace() or not c.isprintable() for c in url):
        return f"{url!r} contains a space or a control character"
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        return f"{url!r} is not a URL ({e})"
    if parts.scheme not in ("http", "https") or not url.startswith(parts.scheme + "://"):
        return f"{url!r} is not an http:// or https:// URL"
    if not parts.hostname:
        return f"{url!r} names no host: expected http(s)://host:port"
    if port == 0:
        return f"{url!r}: a port is 1-65535"
    if parts.username is not None or parts.password is not None:
        # not echoed: it may hold a password
        return "a seed URL holds no user or password: give --etcd-user and --etcd-password"
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        return f"{url!r}: expected http(s)://host:port, with no path, query or fragment"
    return None


def is_loopback_url(url: str) -> bool:
    """Whether `url`'s host is a loopback address (or `localhost`)."""
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def member_urls_problem(client_url: str, peer_url: str) -> InputError | None:
    """Why `--etcd-client-url`/`--etcd-peer-url` cannot be a member's URLs; None if
    they can: http(s)://host:port each, one scheme, https unless on loopback."""
    for url, flag in ((client_url, "--etcd-client-url"), (peer_url, "--etcd-peer-url")):
        why = seed_problem(url)
        if why:
            return InputError(why, flag)
        if urlsplit(url).port is None:
            return InputError(f"{url!r} names no port", flag)
        if urlsplit(url).scheme == "http" and not is_loopback_url(url):
            return InputError(
                f"{url}: etcd traffic between hosts is TLS: use an https:// URL "
                "(plain http is for loopback only)",
                flag,
            )
    if urlsplit(client_url).scheme != urlsplit(peer_url).scheme:
        return InputError(
            "the client and peer URLs use one scheme (both https, or both http on loopback)",
            "--etcd-peer-url",
        )
    return None


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
    """Raises WorldError with a one-line reason when the World cannot be opened
    (InputError for a malformed seed URL)."""
    for url in opts.seeds:
        why = seed_problem(url)
        if why:
            raise InputError(why, "--seeds")
    backend = "etcd" if (opts.seeds or opts.embedded) else opts.backend
    if backend == "sqlite":
        from evergraph.world.sqlite import SQLiteKV

        return OpenWorld(SQLiteKV(opts.db or state_dir / "world.sqlite", opts.short_lived))
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
