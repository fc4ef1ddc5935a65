"""Pinning many hosts at once: the host-key book's first read of `hostkeys/` pins every
host with ONE write of pins.json (a write per host cost O(N²): ~4 minutes of a
blocked event loop at 10,000 hosts, see BENCHMARKS.md, issue 15), and still refuses
a key other than the pinned one."""

from __future__ import annotations

import asyncio
import base64
import logging
from pathlib import Path

import msgspec
import pytest

from evergraph.cluster.exports import HostKeyBook, HostKeyRecord
from evergraph.cluster.hostkeys import identity
from evergraph.cluster.pins import Pins, fingerprint_of
from evergraph.world.memory import MemoryKV, MemoryStore


def _key(i: int, salt: bytes = b"") -> str:
    return base64.b64encode(i.to_bytes(4, "big") + salt.ljust(28, b"k")).decode()


def _record(host: str, i: int, salt: bytes = b"") -> bytes:
    return msgspec.json.encode(HostKeyRecord(host=host, public=_key(i, salt), verify=_key(i, salt)))


def test_first_read_of_many_hosts_pins_them_with_one_write(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    n = 300
    state = tmp_path / "me"
    state.mkdir()
    pins = Pins(state)
    # one host already pinned with another key: refused, the pin kept
    pins.trust("h00007", identity(_key(7, b"old"), _key(7, b"old")))
    writes_before = pins.saves
    told: list[tuple[str, bool]] = []

    async def main() -> None:
        kv = MemoryKV(MemoryStore())
        for i in range(n):
            await kv.put(f"hostkeys/h{i:05d}", _record(f"h{i:05d}", i))
        await kv.put("hostkeys/me", _record("me", 99999))
        book = HostKeyBook(kv, pins, "me")
        # a listener is told after the host is pinned (it may seal or verify at once)
        book.listen(lambda host: told.append((host, pins.get(host) is not None)))
        task = asyncio.create_task(book.run())
        try:
            await asyncio.wait_for(book.ready.wait(), 30)
            assert pins.saves - writes_before == 1
            # a host joining later: pinned (one more write), then told
            await kv.put("hostkeys/late", _record("late", 123456))
            async with asyncio.timeout(10):
                while ("late", True) not in told:
                    await asyncio.sleep(0.005)
            assert pins.saves - writes_before == 2
            assert book.trusted("late") == (_key(123456), _key(123456))
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await kv.close()

    with caplog.at_level(logging.ERROR, logger="evergraph.exports"):
        asyncio.run(main())
    on_disk = Pins(state).hosts  # another process's view: all on disk
    assert len(on_disk) == n + 1  # every host but "me", plus "late"
    assert "me" not in on_disk
    assert on_disk["h00123"].public == _key(123)
    assert on_disk["h00123"].how == "first-use"
    assert on_disk["h00007"].public == _key(7, b"old")
    assert on_disk["h00007"].how == "explicit"
    refused = [r.getMessage() for r in caplog.records if "h00007" in r.getMessage()]
    assert len(refused) == 1
    assert fingerprint_of(identity(_key(7), _key(7))) in refused[0]
    assert all(pinned for host, pinned in told if host != "me")
    assert {h for h, _ in told} == {f"h{i:05d}" for i in range(n)} | {"me", "late"}


def test_check_many_pins_in_order_and_writes_once(tmp_path: Path) -> None:
    pins = Pins(tmp_path)
    a, b = _key(1), _key(2)
    # the same host twice with two keys: the first is pinned, the second refused
    bad = pins.check_many([("x", a, a), ("y", b, b), ("x", b, b)])
    assert [(e.host, e.pinned, e.seen) for e in bad] == [("x", identity(a, a), identity(b, b))]
    assert pins.saves == 1
    assert pins.check_many([("x", a, a), ("y", b, b)]) == []
    assert pins.saves == 1  # nothing new: nothing written
