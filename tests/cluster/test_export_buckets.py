"""The exporter's index in buckets (issue 22, round 2): a change among N exports to
one target rewrites, signs and verifies one small bucket, not an index of all N;
the replay and deletion guarantees hold per bucket. In process, on the shipped
memory World (the agents' end-to-end replay tests are in test_export_replay.py)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from evergraph.cluster.exports import (
    PER_BUCKET,
    bucket_key,
    entry_name,
    export_key,
    index_key,
    parse_bucket_key,
)
from evergraph.cluster.exports.index import bucket_of, layout
from evergraph.world.kv import KV
from evergraph.world.memory import MemoryKV, MemoryStore
from tests.kit.exports import Host, file_params


def _files(n: int, changed: dict[int, str] | None = None) -> list[tuple[str, str, str, dict]]:
    changed = changed or {}
    return [("hostb", "file", f"f{i}", file_params(changed.get(i, f"{i}\n"))) for i in range(n)]


async def _index_keys(kv: KV) -> dict[str, int]:
    items, _ = await kv.range("exported/hostb/hosta/index")
    return {i.key: i.mod_revision for i in items}


async def _settled(b: Host, want: dict[str, str]) -> None:
    while {e.name: e.params["content"] for e in b.collector.current()} != want:
        await b.next_change()


def _pair(tmp_path: Path) -> tuple[MemoryKV, Host, Host]:
    """A World client of one memory World, and hosts `hosta` and `hostb` on it."""
    store = MemoryStore()
    a = Host(MemoryKV(store), tmp_path / "a", "hosta")
    b = Host(MemoryKV(store), tmp_path / "b", "hostb")
    return MemoryKV(store), a, b


def test_layout_grows_and_shrinks_without_flapping() -> None:
    assert layout(1) == 1
    assert layout(PER_BUCKET) == 1
    assert layout(PER_BUCKET + 1) == 2
    assert layout(100) == 8
    # an etcd request holds ~20,000 entries: 20,000 exports now take buckets of ~10
    assert layout(20_000) == 2048
    assert layout(100, 8) == 8
    assert layout(60, 8) == 8  # fewer, but not so few that it shrinks
    assert layout(20, 8) == 8
    assert layout(16, 8) == 1  # eight times what 16 need
    assert layout(200, 8) == 16


def test_one_change_among_100_rewrites_one_bucket(tmp_path: Path) -> None:
    async def main() -> None:
        kv, a, b = _pair(tmp_path)
        async with a.running(), b.running():
            a.publisher.set(_files(100))
            await _settled(b, {f"f{i}": f"{i}\n" for i in range(100)})
            await a.publisher.acknowledged.wait()
            before = await _index_keys(kv)
            assert sorted(before) == sorted(
                [index_key("hostb", "hosta")] + [bucket_key("hostb", "hosta", i) for i in range(8)]
            )
            for key in before:
                item = await kv.get(key)
                assert item is not None
                assert len(item.value) < 2000  # not 7 KB: about 12 entries a bucket
            indexes = b.collector.verified_indexes
            a.publisher.set(_files(100, {42: "new\n"}))
            await _settled(b, {f"f{i}": "new\n" if i == 42 else f"{i}\n" for i in range(100)})
            await a.publisher.acknowledged.wait()
            after = await _index_keys(kv)
            moved = [k for k in after if after[k] != before[k]]
            name = entry_name(export_key("hostb", "hosta", "file", "f42"))
            assert moved == [bucket_key("hostb", "hosta", bucket_of(name, 8))]
            # one signature checked: the record's (the bucket waits for a decision
            # that needs it: a deletion, a record not applied, an older one)
            assert b.collector.verified_indexes - indexes == 0
            records = b.collector.verified
            # a record that was not applied needs its bucket: verified then, once
            a.publisher.set(
                [*_files(100, {42: "new\n"}), ("hostb", "file", "f100", file_params("x"))]
            )
            await _settled(
                b,
                {f"f{i}": "new\n" if i == 42 else f"{i}\n" for i in range(100)} | {"f100": "x"},
            )
            assert b.collector.verified - records == 1
            assert b.collector.verified_indexes - indexes >= 1

    asyncio.run(main())


def test_an_older_bucket_put_back_is_refused(tmp_path: Path) -> None:
    async def main() -> None:
        kv, a, b = _pair(tmp_path)
        key = export_key("hostb", "hosta", "file", "f42")
        bkey = bucket_key("hostb", "hosta", bucket_of(entry_name(key), 8))
        async with a.running(), b.running():
            a.publisher.set(_files(100))
            await _settled(b, {f"f{i}": f"{i}\n" for i in range(100)})
            await a.publisher.acknowledged.wait()
            old_bucket, old_record = await kv.get(bkey), await kv.get(key)
            assert old_bucket is not None
            assert old_record is not None
            a.publisher.set(_files(100, {42: "new\n"}))
            want = {f"f{i}": "new\n" if i == 42 else f"{i}\n" for i in range(100)}
            await _settled(b, want)
            refused = b.collector.refused
            # the attacker puts back the older bucket and the older record it names
            await kv.put(bkey, old_bucket.value)
            await kv.put(key, old_record.value)
            while b.collector.refused < refused + 2:
                await asyncio.sleep(0.01)
            assert {e.name: e.params["content"] for e in b.collector.current()} == want

    asyncio.run(main())


def test_a_bucket_deleted_with_its_records_keeps_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Deleting a bucket and the records it names is not a withdrawal: the head still
    names the layout, so the collector keeps the last verified values."""

    async def main() -> None:
        kv, a, b = _pair(tmp_path)
        async with a.running(), b.running():
            a.publisher.set(_files(100))
            want = {f"f{i}": f"{i}\n" for i in range(100)}
            await _settled(b, want)
            await a.publisher.acknowledged.wait()
            bkey = bucket_key("hostb", "hosta", 3)
            item = await kv.get(bkey)
            assert item is not None
            names = [
                n
                for n in want
                if bucket_of(entry_name(export_key("hostb", "hosta", "file", n)), 8) == 3
            ]
            assert names
            with caplog.at_level(logging.ERROR, "evergraph.exports"):
                for n in names:
                    await kv.delete(export_key("hostb", "hosta", "file", n))
                await kv.delete(bkey)
                while "index.3 deleted while its head stands" not in caplog.text:
                    await asyncio.sleep(0.01)
            assert {e.name: e.params["content"] for e in b.collector.current()} == want
            # the exporter's next change to that bucket still reaches the collector
            a.publisher.set(_files(100, {int(names[0][1:]): "later\n"}))
            await _settled(b, want | {names[0]: "later\n"})

    asyncio.run(main())


def test_the_layout_follows_the_count_and_old_buckets_go(tmp_path: Path) -> None:
    async def main() -> None:
        kv, a, b = _pair(tmp_path)
        async with a.running(), b.running():
            of: int | None = None
            steps = [
                (5, 1),
                (100, 8),
                (300, 32),
                (40, 4),
                (3, 4),
                (0, 0),
                (100, 8),
                (3, 1),
                (50, 4),
            ]
            for n, expect in steps:
                a.publisher.set(_files(n, {1: f"at {n}\n"}))
                want = {f"f{i}": f"at {n}\n" if i == 1 else f"{i}\n" for i in range(n)}
                await _settled(b, want)
                await a.publisher.acknowledged.wait()
                of = layout(n, of) if n else None
                assert (of or 0) == expect
                keys = await _index_keys(kv)
                buckets = sorted(w[2] for k in keys if (w := parse_bucket_key(k)) is not None)
                assert (index_key("hostb", "hosta") in keys) == (n > 0)
                assert buckets == (list(range(expect)) if expect > 1 else [])
            assert b.collector.refused == 0

    asyncio.run(main())
