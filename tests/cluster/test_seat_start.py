"""A member's etcd started by its seat (cluster/seat.py `Seat._start`) waits a moment
for a port another process holds: the node's etcd of before, killed with its agent
(pdeathsig) and still exiting when the agent is restarted at once after a kill -9.
A port held for longer fails the start with the reason."""

from __future__ import annotations

import asyncio
import socket
import threading
import types
from pathlib import Path

import pytest

from evergraph._util.clock import SYSTEM
from evergraph.cluster import seat
from evergraph.cluster.seat import Seat
from evergraph.world.etcd_server import FAST_TIMING, EtcdServer, PortInUse, free_port


def _held_port() -> tuple[socket.socket, int]:
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    return held, held.getsockname()[1]


def _start(server: EtcdServer) -> None:
    asyncio.run(Seat._start(types.SimpleNamespace(clock=SYSTEM), server))  # type: ignore[arg-type]


def test_a_peer_port_freed_a_moment_later_is_waited_for(
    shm: Path, servers: list[EtcdServer]
) -> None:
    held, port = _held_port()
    server = EtcdServer.embedded(
        shm / "m", client_port=free_port(), peer_port=port, timing=FAST_TIMING
    )
    servers.append(server)
    release = threading.Timer(1.0, held.close)  # (the etcd of before, exiting)
    release.start()
    try:
        _start(server)
    finally:
        release.cancel()
        held.close()
    assert server.running


def test_a_port_held_for_longer_fails_the_start_with_the_reason(
    shm: Path, servers: list[EtcdServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(seat, "PORT_WAIT_S", 0.5)
    held, port = _held_port()
    with held:
        server = EtcdServer.embedded(
            shm / "m", client_port=free_port(), peer_port=port, timing=FAST_TIMING
        )
        servers.append(server)
        with pytest.raises(PortInUse, match=f"peer port 127.0.0.1:{port} is already in use"):
            _start(server)
    assert not server.running
