"""Leases survive a slow World (issue 23 item 3): a sqlite World locked for longer
than the lease TTL (10 s) leaves live workers as they were; a worker FAILED by an
outage it survived (no grace) returns to its state by itself. Real agents, the
World file locked by a real sqlite transaction."""

from __future__ import annotations

import os
import signal
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from evergraph.farm import model
from evergraph.farm.service import ALIVE
from evergraph.world.sqlite import SQLiteKV
from tests.conftest import Agent, host_key, wait_for
from tests.kit.farm import ADMIN, farm_call, worker_uuid

GRAPH = "graph: g\nresources:\n  noop:\n  - name: n\n"
LOCKED_FOR = 11.0  # more than the lease TTL (10 s)


def _farm(tmp_path: Path, agents: Any, *srv_flags: str) -> tuple[Path, str, Agent, Agent]:
    db = tmp_path / "world.sqlite"
    g = tmp_path / "g.yaml"
    g.write_text(GRAPH)
    world = ("--world-db", str(db))
    srv: Agent = agents(
        g, tmp_path / "srv", "--hostname", "srv", *world, "--http", "127.0.0.1:0", *srv_flags
    )
    wk: Agent = agents(
        g,
        tmp_path / "wk1",
        *("--hostname", "wk1", *world, "--worker"),
        *("--farm-server", f"srv={host_key(tmp_path / 'srv')}"),
    )
    srv.wait_converged()
    wk.wait_converged()
    uuid = worker_uuid(tmp_path / "wk1")
    wait_for(lambda: _state(db, uuid) == model.MAINTENANCE, what="the worker registered")
    farm_call(db, lambda f: f.set_state(ADMIN, uuid, model.IDLE))
    wait_for(lambda: _state(db, uuid) == model.IDLE, what="the worker IDLE")
    return db, uuid, srv, wk


def _state(db: Path, uuid: str) -> str:
    try:
        return farm_call(db, lambda f: f.worker(uuid)).state
    except Exception:  # not there yet, or the World busy: ask again
        return ""


def _alive(db: Path, uuid: str) -> tuple[int, int] | None:
    """(lease, mod revision) of the worker's alive key, or None."""
    import asyncio

    async def main() -> tuple[int, int] | None:
        kv = SQLiteKV(db)
        try:
            item = await kv.get(f"{ALIVE}{uuid}")
        finally:
            await kv.close()
        return (item.lease, item.mod_revision) if item is not None else None

    return asyncio.run(main())


def _lock(db: Path, seconds: float) -> None:
    """Hold the World file's write lock for `seconds` (a real exclusive transaction)."""
    con = sqlite3.connect(db, isolation_level=None, timeout=30)
    try:
        con.execute("BEGIN EXCLUSIVE")
        done = threading.Event()
        done.wait(seconds)  # the outage itself: its length is the point of the test
        con.execute("COMMIT")
    finally:
        con.close()


@pytest.mark.slow
def test_a_world_locked_longer_than_the_ttl_leaves_live_workers_as_they_were(
    tmp_path: Path, agents: Any
) -> None:
    db, uuid, srv, _wk = _farm(tmp_path, agents)
    before = _alive(db, uuid)
    assert before is not None
    _lock(db, LOCKED_FOR)
    # the worker's lease could not be kept alive: its alive key comes back under a
    # new lease (or the old one, if it held)
    wait_for(lambda: (a := _alive(db, uuid)) is not None and a != before, 20, "alive again")
    # for as long as the grace and more, the worker is never FAILED
    seen: set[str] = set()
    end = time.monotonic() + 12.0
    while time.monotonic() < end:
        seen.add(_state(db, uuid))
    assert model.FAILED not in seen, seen
    assert _state(db, uuid) == model.IDLE
    assert "stopped heart-beating" not in srv.log.read_text()


@pytest.mark.slow
def test_a_worker_failed_by_an_outage_it_survived_returns_by_itself(
    tmp_path: Path, agents: Any
) -> None:
    """The worker's agent cannot reach the World for longer than its lease (stopped:
    the outage, from its side) and there is no grace: it is FAILED while away, and
    back to IDLE by itself once it is heard from again."""
    db, uuid, srv, wk = _farm(tmp_path, agents, "--farm-alive-grace", "0")
    os.kill(wk.proc.pid, signal.SIGSTOP)
    try:
        # (the API server's own World calls expire the worker's lease after its TTL)
        wait_for(lambda: _state(db, uuid) == model.FAILED, 40, "the worker FAILED")
    finally:
        os.kill(wk.proc.pid, signal.SIGCONT)
    wait_for(lambda: _state(db, uuid) == model.IDLE, 60, "the worker IDLE again")
    wait_for(lambda: "heart-beats again: back from FAILED" in srv.log.read_text())
