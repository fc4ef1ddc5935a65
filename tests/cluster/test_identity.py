"""Pinned identities and the export publisher/collector: whoever can write the World
can neither read nor forge exports (SPEC §4.3), and collecting misses nothing."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from pathlib import Path
from typing import Any

import msgspec
import pytest

from evergraph.cluster.exports import (
    entry_name,
    export_key,
    index_key,
    make_index,
    make_record,
    publish_hostkeys,
    record_digest,
)
from evergraph.cluster.hostkeys import HostKeys, KeyError_, identity
from evergraph.cluster.pins import IdentityMismatch, Pins, PinsError, fingerprint_of
from evergraph.world.kv import KV, KeyValue, Put
from evergraph.world.memory import MemoryKV, MemoryStore
from tests.conftest import Agent, run_cli, wait_for
from tests.kit.exports import Host, file_params

# -- pins -----------------------------------------------------------------------------


def test_first_key_is_pinned_and_another_is_refused_naming_both(tmp_path: Path) -> None:
    a, b = HostKeys(tmp_path / "a"), HostKeys(tmp_path / "b")
    pins = Pins(tmp_path / "me")
    pins.check("web1", a.public, a.verify)
    assert pins.get("web1") is not None
    with pytest.raises(IdentityMismatch) as e:
        pins.check("web1", b.public, b.verify)
    msg = str(e.value)
    assert fingerprint_of(identity(a.public, a.verify)) in msg
    assert fingerprint_of(identity(b.public, b.verify)) in msg
    assert "web1" in msg
    # another process's view (a fresh Pins) holds the pin: it is on disk
    assert Pins(tmp_path / "me").get("web1") == pins.get("web1")
    assert oct((tmp_path / "me" / "pins.json").stat().st_mode & 0o777) == "0o600"
    # explicit trust replaces it; forget removes it
    pins.trust("web1", identity(b.public, b.verify))
    pins.check("web1", b.public, b.verify)
    assert pins.forget("web1")
    assert not pins.forget("web1")


@pytest.mark.parametrize(
    "text",
    [
        b"garbage {",
        b"[]",
        b'{"hosts": {"x": 3}}',
        b'{"hosts": {"x": {"public": "AA", "verify": "AA"}}}',
    ],
    ids=["not-json", "not-object", "not-a-record", "short-keys"],
)
def test_a_garbage_pins_file_is_an_error_never_replaced(tmp_path: Path, text: bytes) -> None:
    (tmp_path / "pins.json").write_bytes(text)
    with pytest.raises(PinsError, match=r"pins\.json: not a pins file"):
        Pins(tmp_path)
    assert (tmp_path / "pins.json").read_bytes() == text


@pytest.mark.parametrize(
    "key",
    ["nocolon", "AAAA:BBBB", "!!!:???", ":"],
)
def test_hosts_trust_refuses_malformed_keys(tmp_path: Path, key: str) -> None:
    r = run_cli("hosts", "trust", "web1", key, "--state-dir", tmp_path / "s")
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1
    assert "KEY" in r.stderr
    assert not (tmp_path / "s" / "pins.json").exists()


def test_hosts_cli_key_trust_list_forget(tmp_path: Path) -> None:
    other = tmp_path / "other"
    r = run_cli("hosts", "key", "--state-dir", other)
    assert r.returncode == 0, r.stderr
    ident = r.stdout.strip()
    me = tmp_path / "me"
    r = run_cli("hosts", "trust", "Web/1", ident, "--state-dir", me)
    assert r.returncode == 2
    assert "not a valid hostname" in r.stderr
    r = run_cli("hosts", "trust", "web1", ident, "--state-dir", me)
    assert r.returncode == 0, r.stderr
    assert fingerprint_of(ident) in r.stdout
    # the World says another key for web1: listed as a MISMATCH (exit 1)
    impostor = HostKeys(tmp_path / "impostor")
    rec = json.dumps({"host": "web1", "public": impostor.public, "verify": impostor.verify})
    r = run_cli("world", "put", "hostkeys/web1", rec, "--state-dir", me)
    assert r.returncode == 0, r.stderr
    r = run_cli("hosts", "--state-dir", me)
    assert r.returncode == 1
    assert r.stdout.split("\t")[0] == "web1"
    assert "MISMATCH" in r.stdout
    r = run_cli("hosts", "forget", "web1", "--state-dir", me)
    assert r.returncode == 0
    r = run_cli("hosts", "--state-dir", me)
    assert r.returncode == 0
    assert "unpinned" in r.stdout
    (me / "pins.json").write_text("{")
    r = run_cli("hosts", "--state-dir", me)
    assert r.returncode == 2
    assert "not a pins file" in r.stderr


# -- publisher and collector, in process on the shipped memory World ---------------------


async def put_export(
    kv: KV, keys: HostKeys, src: str, to: str, name: str, params: dict[str, Any], public: str
) -> None:
    """Write one export as an exporter's publisher does: the record and the index
    naming its sequence, in one txn."""
    seq = 1000
    key = export_key(to, src, "file", name)
    rec = make_record(keys, src, to, "file", name, params, public, seq)
    index = make_index(keys, src, to, seq + 1, {entry_name(key): (seq, record_digest(rec))})
    await kv.txn([], [Put(key, rec), Put(index_key(to, src), index)])


def test_collector_sees_a_record_written_between_its_read_and_its_watch(tmp_path: Path) -> None:
    """Driven deterministically: the World writes a new export right after the
    collector's first read of its prefix returns, before any watch exists."""
    store: list[MemoryStore] = []

    class GapKV(MemoryKV):
        injected = False

        async def range(self, prefix: str) -> tuple[list[KeyValue], int]:
            got = await super().range(prefix)
            if prefix == "exported/hostb/" and not GapKV.injected:
                GapKV.injected = True
                await a_keys_publish()
            return got

    async def a_keys_publish() -> None:
        await put_export(other, a_keys, "hosta", "hostb", "gap", file_params("gap\n"), b_public)

    a_keys = HostKeys(tmp_path / "a")
    b_public = ""
    other: KV

    async def main() -> None:
        nonlocal b_public, other
        store.append(MemoryStore())
        other = MemoryKV(store[0])
        await publish_hostkeys(other, a_keys, "hosta")
        b = Host(GapKV(store[0]), tmp_path / "b", "hostb")
        b_public = b.keys.public
        async with b.running():
            found = b.collector.current()
            if not found:
                found = await b.next_change()
            assert [(e.src, e.name, e.params["content"]) for e in found] == [
                ("hosta", "gap", "gap\n")
            ]
        assert GapKV.injected

    asyncio.run(main())


def test_one_change_among_100_costs_one_verification(tmp_path: Path) -> None:
    async def main() -> None:
        store = MemoryStore()
        a = Host(MemoryKV(store), tmp_path / "a", "hosta")
        b = Host(MemoryKV(store), tmp_path / "b", "hostb")
        async with a.running(), b.running():
            a.publisher.set([("hostb", "file", f"f{i}", file_params(f"{i}\n")) for i in range(100)])
            while len(b.collector.current()) < 100:
                await b.next_change()
            before = b.collector.verified
            indexes = b.collector.verified_indexes
            a.publisher.set(
                [
                    ("hostb", "file", f"f{i}", file_params("new\n" if i == 42 else f"{i}\n"))
                    for i in range(100)
                ]
            )
            while b.collector.verified == before:
                await b.next_change()
            await a.publisher.acknowledged.wait()
            assert b.collector.verified - before == 1
            # and no index: the record's own signature and its sequence above the
            # applied one's settle it (its bucket is verified when a decision needs it)
            assert b.collector.verified_indexes - indexes == 0
            assert [e.params["content"] for e in b.collector.current() if e.name == "f42"] == [
                "new\n"
            ]

    asyncio.run(main())


def test_a_host_joining_reverifies_its_own_records_only(tmp_path: Path) -> None:
    """A new exporter's key re-verifies that exporter's records, never the others';
    one that arrived before its key is verified once when the key comes (the
    collector now finds them through an index by exporter, not a scan of all)."""

    async def main() -> None:
        store = MemoryStore()
        a = Host(MemoryKV(store), tmp_path / "a", "hosta")
        b = Host(MemoryKV(store), tmp_path / "b", "hostb")
        joined: dict[str, asyncio.Event] = {"hostc": asyncio.Event(), "hostd": asyncio.Event()}
        b.book.listen(lambda h: joined[h].set() if h in joined else None)
        async with a.running(), b.running():
            a.publisher.set([("hostb", "file", f"f{i}", file_params(f"{i}\n")) for i in range(50)])
            while len(b.collector.current()) < 50:
                await b.next_change()
            before = b.collector.verified
            c = Host(MemoryKV(store), tmp_path / "c", "hostc")
            async with c.running():
                await asyncio.wait_for(joined["hostc"].wait(), 10)
                assert b.collector.verified == before  # none of hosta's 50 again
                # a record whose exporter's key is not there yet waits, and is
                # verified (once) when the key arrives
                d_keys = HostKeys(tmp_path / "d")
                await put_export(
                    c.kv, d_keys, "hostd", "hostb", "late", file_params("x\n"), b.keys.public
                )
                while b.collector._pending.get("hostd") is None:
                    await asyncio.sleep(0)
                assert b.collector.verified == before
                await publish_hostkeys(c.kv, d_keys, "hostd")
                await asyncio.wait_for(joined["hostd"].wait(), 10)
                assert b.collector.verified == before + 1
                assert [e.src for e in b.collector.current() if e.name == "late"] == ["hostd"]

    asyncio.run(main())


def test_a_key_swap_in_the_world_changes_nothing_sealed_or_applied(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Mallory writes her keys as hostb's and as hosta's: hosta keeps sealing to
    hostb's pinned key (Mallory cannot open it), hostb keeps verifying with hosta's
    pinned key (Mallory's forged record is refused), each refusal names both keys."""
    caplog.set_level(logging.INFO)

    async def main() -> None:
        store = MemoryStore()
        a = Host(MemoryKV(store), tmp_path / "a", "hosta")
        b = Host(MemoryKV(store), tmp_path / "b", "hostb")
        mallory = HostKeys(tmp_path / "m")
        kv = MemoryKV(store)
        async with a.running(), b.running():
            a.publisher.set([("hostb", "file", "conf", file_params("v1\n"))])
            assert [e.params["content"] for e in await b.next_change()] == ["v1\n"]
            # the swap: both hosts' key records now name Mallory's keys
            for host in ("hosta", "hostb"):
                rec = {"host": host, "public": mallory.public, "verify": mallory.verify}
                await kv.put(f"hostkeys/{host}", msgspec.json.encode(rec))
            # hosta publishes a change: still sealed to hostb's pinned key
            a.publisher.set([("hostb", "file", "conf", file_params("v2\n"))])
            assert [e.params["content"] for e in await b.next_change()] == ["v2\n"]
            item = await kv.get(export_key("hostb", "hosta", "file", "conf"))
            assert item is not None
            sealed = json.loads(item.value)["payload"]
            with pytest.raises(KeyError_, match="not sealed to this host"):
                mallory.unseal(base64.b64decode(sealed))
            # Mallory forges a record "from hosta", signed with her key: refused
            forged = make_record(
                mallory, "hosta", "hostb", "file", "evil", file_params("pwn\n"), b.keys.public, 1
            )
            await kv.put(export_key("hostb", "hosta", "file", "evil"), forged)
            # and a record "to hostb" is sealed to her key by nobody; collect stays as it was
            await a.publisher.acknowledged.wait()
            a.publisher.set([("hostb", "file", "conf", file_params("v3\n"))])
            assert [e.params["content"] for e in await b.next_change()] == ["v3\n"]
            assert [e.name for e in b.collector.current()] == ["conf"]

    asyncio.run(main())
    text = caplog.text
    assert "bad signature: not signed by 'hosta'" in text
    mismatches = [r.getMessage() for r in caplog.records if "is pinned: refused" in r.getMessage()]
    # once per change of each record (hostb about hosta's, hosta about hostb's)
    assert len(mismatches) == 2
    m = HostKeys(tmp_path / "m")
    assert all(fingerprint_of(identity(m.public, m.verify)) in x for x in mismatches)


# -- impostor, end to end ----------------------------------------------------------------


@pytest.mark.slow
def test_an_impostor_with_the_pinned_hosts_name_cannot_get_its_exports_applied(
    tmp_path: Path, agents: Any
) -> None:
    db = tmp_path / "world.sqlite"
    target = tmp_path / "out" / "upstream"

    def exporter(content: str) -> Path:
        g = tmp_path / f"a-{content}.yaml"
        g.write_text(
            "graph: a\nresources:\n  file:\n"
            f'  - {{name: {target}, content: "{content}\\n", '
            "meta: {export: [hostb], hidden: true}}\n"
        )
        return g

    gb = tmp_path / "b.yaml"
    gb.write_text("graph: b\nresources:\n  noop:\n  - name: b\ncollect:\n- {kind: file}\n")
    b: Agent = agents(gb, tmp_path / "sb", "--hostname", "hostb", "--world-db", str(db))
    a: Agent = agents(
        exporter("legit"), tmp_path / "sa", "--hostname", "hosta", "--world-db", str(db)
    )
    wait_for(lambda: target.exists() and target.read_text() == "legit\n", what="legit export")
    assert a.stop() == 0
    # the impostor: hosta's name, its own keys (its own state dir), taking the name over
    m: Agent = agents(
        exporter("evil"), tmp_path / "sm", "--hostname", "hosta", "--world-db", str(db), "--replace"
    )
    wait_for(lambda: "is pinned: refused" in b.log.read_text(), what="b refuses the new key")
    wait_for(lambda: "rejected export" in b.log.read_text(), what="b refuses the record")
    assert target.read_text() == "legit\n"
    line = next(x for x in b.log.read_text().splitlines() if "is pinned: refused" in x)
    assert "hosta" in line
    assert line.count("SHA256:") == 2
    assert m.stop() == 0
    assert b.proc.poll() is None


def test_the_periodic_check_reads_our_own_records_by_key_and_repairs_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every 30 s a publisher checks that the World still holds its records: by key,
    never by reading all of exported/ (with 10,000 agents that was ~1.5 GiB/s out of
    etcd). A record deleted behind its back is put again."""
    import evergraph.cluster.exports.publisher as exports

    monkeypatch.setattr(exports, "RECHECK", 0.05)
    ranges: list[str] = []

    class CountingKV(MemoryKV):
        async def range(self, prefix: str) -> tuple[list[KeyValue], int]:
            ranges.append(prefix)
            return await super().range(prefix)

    async def main() -> None:
        async with CountingKV() as kv:
            a = Host(kv, tmp_path / "a", "hosta")
            a.publisher.set([("*", "file", "/x", file_params("v1"))])
            async with a.running():
                await asyncio.wait_for(a.publisher.acknowledged.wait(), 10)
                key = export_key("*", "hosta", "file", "/x")
                assert await kv.get(key) is not None
                full = ranges.count("exported/")
                await kv.delete(key)  # behind the publisher's back: no event for it
                deadline = asyncio.get_running_loop().time() + 10
                while await kv.get(key) is None:
                    assert asyncio.get_running_loop().time() < deadline, "not repaired"
                    await asyncio.sleep(0.01)
                assert ranges.count("exported/") == full  # no full read since the first

    asyncio.run(main())


def test_a_publisher_cancelled_as_it_is_woken_ends(tmp_path: Path) -> None:
    """The agent's stop can come in the same step as the graph's exports (an empty
    one-shot run): 3.11's wait_for swallowed that cancellation, and the publisher
    waited its 30 s recheck more, holding the agent's exit."""

    async def main() -> None:
        a = Host(MemoryKV(MemoryStore()), tmp_path / "a", "hosta")
        task = asyncio.create_task(a.publisher.run())
        for _ in range(5):
            await asyncio.sleep(0)  # (it reconciles nothing, then waits)
        a.publisher.set([])
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            async with asyncio.timeout(5):
                await task

    asyncio.run(main())
