"""`free_port`: a port for a server started next (embedded etcd's client and peer
ports), picked below the kernel's ephemeral ports, which any outgoing connection
may take between the pick and the bind (two full test suites side by side lost
etcd members to "address already in use" with ports from bind(0))."""

from __future__ import annotations

import socket

import pytest

from evergraph.world import etcd_server
from evergraph.world.etcd_server import free_port


def test_a_port_is_picked_below_the_ephemeral_ports_and_is_free() -> None:
    low = etcd_server._ephemeral_low()
    ports = {free_port() for _ in range(20)}
    assert all(etcd_server.PICK_LOW <= p < min(etcd_server.PICK_HIGH, low) for p in ports)
    assert len(ports) > 10  # (at random: two pickers rarely meet)
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # free


def test_a_taken_port_is_not_picked_and_with_none_free_the_kernel_picks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        held.listen()
        monkeypatch.setattr(etcd_server, "PICK_LOW", taken)
        monkeypatch.setattr(etcd_server, "PICK_HIGH", taken + 1)
        monkeypatch.setattr(etcd_server, "_ephemeral_low", lambda: 65536)
        p = free_port()
        assert p != taken
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def _three_free() -> int:
    """The first of three ports in a row that nothing listens on."""
    for base in range(21000, 32000, 97):
        try:
            for p in range(base, base + 3):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return base
    raise AssertionError("no three free ports in a row")


def test_a_port_given_out_is_not_given_again_before_its_server_may_listen(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A cluster's members pick all their ports before any of them listens: two
    members that drew the same peer port failed to start (etcd: "initial cluster
    ... has duplicate url"). What was given out lately is not given again."""
    monkeypatch.setattr(etcd_server, "_handed", {})
    base = _three_free()
    monkeypatch.setattr(etcd_server, "PICK_LOW", base)
    monkeypatch.setattr(etcd_server, "PICK_HIGH", base + 3)
    monkeypatch.setattr(etcd_server, "_ephemeral_low", lambda: 65536)
    got = [free_port() for _ in range(3)]
    assert sorted(got) == [base, base + 1, base + 2]
    assert free_port() not in got  # (none left in the range: the kernel's pick)
