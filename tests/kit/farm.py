"""What the farm tests share: the API server's trust, the farm library as that
server sees it, a worker's UUID, a user token, the admin user."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from evergraph.cluster.hostkeys import HostKeys
from evergraph.cluster.pins import Pins
from evergraph.farm.service import Farm
from evergraph.farm.signed import FarmTrust
from evergraph.farm.tokens import User
from evergraph.world.kv import KV
from evergraph.world.sqlite import SQLiteKV
from tests.conftest import run_cli, wait_for

T = TypeVar("T")
ADMIN = User(name="root", admin=True)


def srv_trust(state: Path, name: str = "srv", servers: tuple[str, ...] = ()) -> FarmTrust:
    """The farm trust of the API server whose state dir is `state`: its key, the
    worker hosts' keys it pinned, and `servers`, the farm servers it pinned
    (`--farm-server NAME=KEY`)."""
    pins = Pins(state)

    def host_key(host: str) -> str | None:
        pin = pins.get(host)
        return pin.verify if pin is not None else None

    pinned = {s: pin.verify for s in servers if (pin := pins.get(s)) is not None}
    return FarmTrust(HostKeys(state), name, pinned, host_key=host_key)


def farm_call(
    db: Path, fn: Callable[[Farm], Awaitable[T]], world: Callable[[], KV] | None = None
) -> T:
    """`fn` on the farm as the API server "srv" (its state dir beside the World
    file `db`) sees and signs it; `world`: another World than that file."""

    async def main() -> T:
        kv = world() if world is not None else SQLiteKV(db)
        try:
            return await fn(Farm(kv, trust=srv_trust(db.parent / "srv")))
        finally:
            await kv.close()

    return asyncio.run(main())


def worker_uuid(state: Path) -> str:
    """The UUID of the worker agent whose state dir is `state` (once it has one)."""
    wait_for(lambda: (state / "worker.uuid").exists(), what="the worker's UUID")
    return (state / "worker.uuid").read_text().strip()


def farm_token(state: Path, world: tuple[str, ...], name: str, *extra: str) -> str:
    """A new user token `name` (`evergraph farm token create`), made on `world`."""
    r = run_cli("farm", "token", "create", name, *extra, *world, "--state-dir", state)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()
