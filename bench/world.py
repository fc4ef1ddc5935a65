"""Benchmark 5, the World: KV throughput and watch latency per backend, and the
export -> collected -> applied latency between two hosts.

KV: one client writes N keys sequentially (`put`), reads them (`get`), then
times N put -> watch-event round trips (a second client of the same World
watches; the clock runs from just before `put` to the event's arrival).
Floors, doing the same operations with nothing of ours: for sqlite, the
`sqlite3` module committing one row per transaction in WAL mode; for etcd, a
bare aetcd client (put/get loop and one watch) against the same server.

Exports: an agent (host B, `evergraph run` with `collect:`) and this process
acting as host A on one sqlite World. Each trial A writes a signed, sealed
export record of a file with new content; the clock stops when B's file
reads back with that content (our own inotify on the directory). Target p99
<= 50 ms.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sqlite3
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import (
    EVERGRAPH,
    fmt_s,
    percentile,
    spawn,
    stop,
    table,
    temp_dir_until_exit,
    yes_no,
)

TARGET_EXPORT_P99_S = 0.050


def _stats(xs: list[float]) -> dict[str, float]:
    return {"p50": percentile(xs, 50), "p99": percentile(xs, 99)}


async def _kv_ops(make: Any, n: int) -> dict[str, Any]:
    a, b = make(), make()
    try:
        t0 = time.perf_counter()
        for i in range(n):
            await a.put(f"bench/{i:06d}", b"x" * 64)
        puts = n / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        for i in range(n):
            await a.get(f"bench/{i:06d}")
        gets = n / (time.perf_counter() - t0)
        _, rev = await a.range("watch/")
        it = b.watch("watch/", rev + 1).__aiter__()
        lat = []
        for i in range(min(n, 500)):
            t0 = time.perf_counter()
            await a.put(f"watch/{i}", b"v")
            await it.__anext__()
            lat.append(time.perf_counter() - t0)
        return {"puts_per_s": puts, "gets_per_s": gets, "watch": _stats(lat)}
    finally:
        await a.close()
        await b.close()


def _sqlite_floor(path: Path, n: int) -> dict[str, Any]:
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    db.execute("CREATE TABLE kv(key TEXT PRIMARY KEY, value BLOB)")
    t0 = time.perf_counter()
    for i in range(n):
        db.execute("BEGIN IMMEDIATE")
        db.execute("INSERT OR REPLACE INTO kv VALUES (?, ?)", (f"bench/{i:06d}", b"x" * 64))
        db.execute("COMMIT")
    puts = n / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for i in range(n):
        db.execute("SELECT value FROM kv WHERE key = ?", (f"bench/{i:06d}",)).fetchone()
    gets = n / (time.perf_counter() - t0)
    db.close()
    return {"puts_per_s": puts, "gets_per_s": gets}


async def _etcd_floor(url: str, n: int) -> dict[str, Any]:
    import aetcd

    host, port = url.removeprefix("http://").split(":")
    async with aetcd.Client(host=host, port=int(port)) as c:
        t0 = time.perf_counter()
        for i in range(n):
            await c.put(f"floor/{i:06d}".encode(), b"x" * 64)
        puts = n / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        for i in range(n):
            await c.get(f"floor/{i:06d}".encode())
        gets = n / (time.perf_counter() - t0)
        watch = await c.watch_prefix(b"floorw/")
        it = watch.__aiter__()
        lat = []
        for i in range(min(n, 500)):
            t0 = time.perf_counter()
            await c.put(f"floorw/{i}".encode(), b"v")
            await it.__anext__()
            lat.append(time.perf_counter() - t0)
        await watch.cancel()
    return {"puts_per_s": puts, "gets_per_s": gets, "watch": _stats(lat)}


def _kv_rows(quick: bool) -> tuple[dict[str, Any], list[list[str]]]:
    from evergraph.world.memory import MemoryKV, MemoryStore
    from evergraph.world.sqlite import SQLiteKV

    n = 300 if quick else 2000
    res: dict[str, Any] = {}
    d = Path(temp_dir_until_exit("/var/tmp"))

    async def memory() -> dict[str, Any]:
        store = MemoryStore()
        return await _kv_ops(lambda: MemoryKV(store), n)

    res["memory"] = asyncio.run(memory())
    res["sqlite"] = asyncio.run(_kv_ops(lambda: SQLiteKV(d / "w.sqlite"), n))
    res["sqlite_floor"] = _sqlite_floor(d / "floor.sqlite", n)
    try:
        from evergraph.world.etcd import EtcdKV
        from evergraph.world.etcd_server import EtcdServer
    except ImportError:
        EtcdKV = None
    if EtcdKV is not None and shutil.which("etcd"):
        data = Path(tempfile.mkdtemp(prefix="evergraph-bench-etcd-", dir="/dev/shm"))
        server = EtcdServer.single(data)
        try:
            server.start()
            res["etcd"] = asyncio.run(_kv_ops(lambda: EtcdKV([server.client_url]), n))
            res["etcd_floor"] = asyncio.run(_etcd_floor(server.client_url, n))
        finally:
            server.stop()
            shutil.rmtree(data, ignore_errors=True)
    rows = []
    for name in ("memory", "sqlite", "sqlite_floor", "etcd", "etcd_floor"):
        r = res.get(name)
        if r is None:
            continue
        w = r.get("watch")
        rows.append(
            [
                name.replace("_floor", " (floor)"),
                f"{r['puts_per_s']:,.0f}",
                f"{r['gets_per_s']:,.0f}",
                fmt_s(w["p50"]) if w else "-",
                fmt_s(w["p99"]) if w else "-",
            ]
        )
    return res, rows


async def _export_trials(
    state_a: Path, make_kv: Any, target: Path, trials: int, exports: int, agent_pid: int
) -> tuple[list[float], float]:
    """(latencies, agent B's CPU seconds per change): `exports` records to B, one of
    which changes per trial (the others stay: a change among N must cost one)."""
    from asyncinotify import Inotify, Mask

    from evergraph.cluster.exports import SeqCounter, decode_hostkeys, export_key, make_record
    from evergraph.cluster.exports.index import (
        Content,
        entry_name,
        index_contents,
        layout,
        make_content,
        record_digest,
    )
    from evergraph.cluster.hostkeys import HostKeys
    from evergraph.world.kv import Put

    seq = SeqCounter()
    #: what host A's index names (an agent's publisher writes the record and the
    #: index records that changed, a bucket of its index past 16 entries, in one txn:
    #: no replay)
    entries: dict[str, tuple[int, str]] = {}
    written: dict[str, Content] = {}
    of: list[int | None] = [None]

    async def write(key: str, value: bytes, n: int) -> None:
        entries[entry_name(key)] = (n, record_digest(value))
        of[0] = layout(len(entries), of[0])
        ops = []
        for ikey, content in index_contents("hostb", "hosta", entries, of[0]).items():
            if written.get(ikey) != content:
                written[ikey] = content
                ops.append(Put(ikey, make_content(keys, "hosta", "hostb", seq.next(), content)))
        await kv.txn([], [*ops, Put(key, value)])

    keys = HostKeys(state_a)
    kv = make_kv()
    await kv.put(
        "hostkeys/hosta",
        json.dumps({"host": "hosta", "public": keys.public, "verify": keys.verify}).encode(),
    )
    rec = None
    for _ in range(200):
        item = await kv.get("hostkeys/hostb")
        if item is not None:
            rec = decode_hostkeys(item)
            break
        await asyncio.sleep(0.05)
    assert rec is not None, "host B never published its keys"
    target.parent.mkdir(parents=True, exist_ok=True)
    for n in range(1, exports):  # the ones that do not change
        path = target.parent / f"still-{n}"
        s = seq.next()
        value = make_record(
            keys, "hosta", "hostb", "file", str(path), {"content": f"{n}\n"}, rec.public, s
        )
        await write(export_key("hostb", "hosta", "file", str(path)), value, s)
    key = export_key("hostb", "hosta", "file", str(target))
    out = []
    cpu0 = 0.0
    with Inotify() as ino:
        ino.add_watch(target.parent, Mask.MOVED_TO | Mask.CLOSE_WRITE)
        for i in range(trials + 1):
            want = f"trial {i}\n"
            s = seq.next()
            value = make_record(
                keys, "hosta", "hostb", "file", str(target), {"content": want}, rec.public, s
            )
            t0 = time.perf_counter()
            await write(key, value, s)
            while True:
                try:
                    if target.read_text() == want:
                        break
                except FileNotFoundError:
                    pass
                await asyncio.wait_for(ino.get(), 20)
            if i:  # the first trial includes B's first swap of a new resource kind
                out.append(time.perf_counter() - t0)
            else:
                await asyncio.sleep(0.2)  # let the filler swaps settle before measuring
                cpu0 = _cpu_seconds(agent_pid)
            await asyncio.sleep(0.02)
    cpu = (_cpu_seconds(agent_pid) - cpu0) / max(1, trials)
    await kv.close()
    return out, cpu


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _export_latency(quick: bool, backend: str, exports: int) -> dict[str, Any]:
    """Agent B runs with `collect:`; this process plays host A on the same World."""
    from evergraph.world.sqlite import SQLiteKV

    d = Path(temp_dir_until_exit("/var/tmp"))
    db, target = d / "world.sqlite", d / "b" / "exported.conf"
    g = d / "b.yaml"
    g.write_text("graph: b\nresources:\n  noop:\n  - name: b\ncollect:\n- {kind: file}\n")
    server = None
    if backend == "etcd":
        from evergraph.world.etcd import EtcdKV
        from evergraph.world.etcd_server import EtcdServer

        server = EtcdServer.single(Path(temp_dir_until_exit("/dev/shm")))
        server.start()
        url = server.client_url
        world_args = ["--seeds", url]

        def make_kv() -> Any:
            return EtcdKV([url])
    else:
        world_args = ["--world-db", str(db)]

        def make_kv() -> Any:
            return SQLiteKV(db)

    agent = spawn(
        [
            EVERGRAPH,
            "run",
            str(g),
            "--state-dir",
            str(d / "sb"),
            "--hostname",
            "hostb",
            *world_args,
        ],
        stdout=open(d / "b.log", "wb"),  # noqa: SIM115
        stderr=-2,
    )
    try:
        lat, cpu = asyncio.run(
            _export_trials(d / "sa", make_kv, target, 30 if quick else 200, exports, agent.pid)
        )
    finally:
        stop(agent)
        if server is not None:
            server.stop()
    return _stats(lat) | {"trials": len(lat), "exports": exports, "cpu_per_change_s": cpu}


def _collector_cpu(exports: int, changes: int, repeats: int) -> float:
    """The collector's own CPU per change (us), one change among `exports` to this
    host: its follow callbacks fed the World events a publisher's txn makes (the
    record and the index records that changed), no World and no event loop turns;
    `thread_time` over `changes`, the minimum of `repeats`."""
    from evergraph.cluster.exports import (
        Collector,
        HostKeyBook,
        export_key,
        make_record,
        publish_hostkeys,
    )
    from evergraph.cluster.exports.index import (
        Content,
        entry_name,
        index_contents,
        layout,
        make_content,
        record_digest,
    )
    from evergraph.cluster.hostkeys import HostKeys
    from evergraph.cluster.pins import Pins
    from evergraph.world.kv import KeyValue
    from evergraph.world.memory import MemoryKV

    d = Path(temp_dir_until_exit("/var/tmp"))
    ka, kb = HostKeys(d / "a"), HostKeys(d / "b")
    seq, rev = [1000], [1]
    entries: dict[str, tuple[int, str]] = {}
    written: dict[str, Content] = {}
    world: dict[str, KeyValue] = {}
    of: list[int | None] = [None]

    def change(name: str, content: str) -> list[tuple[KeyValue | None, KeyValue]]:
        seq[0] += 1
        value = make_record(
            ka, "hosta", "hostb", "file", name, {"content": content}, kb.public, seq[0]
        )
        key = export_key("hostb", "hosta", "file", name)
        entries[entry_name(key)] = (seq[0], record_digest(value))
        of[0] = layout(len(entries), of[0])
        ops = []
        for ik, c in index_contents("hostb", "hosta", entries, of[0]).items():
            if written.get(ik) != c:
                written[ik] = c
                seq[0] += 1
                ops.append((ik, make_content(ka, "hosta", "hostb", seq[0], c)))
        rev[0] += 1
        out = []
        for k, v in [*ops, (key, value)]:
            prev = world.get(k)
            world[k] = KeyValue(k, v, prev.create_revision if prev else rev[0], rev[0])
            out.append((prev, world[k]))
        return out

    async def main() -> float:
        kv = MemoryKV()
        await publish_hostkeys(kv, ka, "hosta")
        book = HostKeyBook(kv, Pins(d / "b"), "hostb")
        for item in (await kv.range("hostkeys/"))[0]:
            await book.new(book.decode(item))
        await book.batch_done()
        col = Collector(kv, kb, "hostb", book)
        for i in range(exports):
            for _prev, new in change(f"f{i}", "0"):
                await col.new(new)
        await col.batch_done()
        best = float("inf")
        for r in range(repeats):
            batches = [change("f0", f"v{r}-{c}") for c in range(changes)]
            t0 = time.thread_time()
            for ops in batches:
                for prev, new in ops:
                    await (col.new(new) if prev is None else col.updated(prev, new))
                await col.batch_done()
            best = min(best, (time.thread_time() - t0) / changes * 1e6)
        await kv.close()
        return best

    return asyncio.run(main())


def run(quick: bool) -> tuple[dict[str, Any], str]:
    res, rows = _kv_rows(quick)
    text = table(
        "World KV: sequential ops/s and put->watch latency (2 clients, one World)",
        ["backend", "puts/s", "gets/s", "watch p50", "watch p99"],
        rows,
    )
    rows = []
    backends = ["sqlite"] + (["etcd"] if shutil.which("etcd") else [])
    for backend in backends:
        for n in (1, 10, 100):
            exp = _export_latency(quick, backend, n)
            name = "export" if backend == "sqlite" else f"export_{backend}"
            res[name if n == 1 else f"{name}_{n}"] = exp
            rows.append(
                [
                    backend,
                    str(n),
                    str(exp["trials"]),
                    fmt_s(exp["p50"]),
                    fmt_s(exp["p99"]),
                    fmt_s(exp["cpu_per_change_s"]),
                    fmt_s(TARGET_EXPORT_P99_S),
                    yes_no(exp["p99"] <= TARGET_EXPORT_P99_S),
                ]
            )
    cpu_rows = []
    for n in (1, 100, 1000):
        us = _collector_cpu(n, 100 if quick else 300, 3 if quick else 7)
        res[f"collector_cpu_{n}_us"] = us
        cpu_rows.append([str(n), f"{us:.1f} us"])
    text += "\n\n" + table(
        "The export collector alone: CPU per change among N (min of repeats)",
        ["exports", "collector CPU/change"],
        cpu_rows,
    )
    text += "\n\n" + table(
        "Export -> collected -> applied (host A record -> file on agent B, one World; "
        "one of N exports changes per trial; CPU = agent B's per change)",
        ["world", "exports", "trials", "p50", "p99", "B CPU/change", "target p99", "met"],
        rows,
    )
    return res, text
