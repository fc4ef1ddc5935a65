"""No replay of exports (issue 22, item 4): whoever writes the World cannot put back
an older signed record or index of a live exporter, make a collector drop a record
by deleting it, or get a withdrawn export applied again by putting it back without
a lease. Real agents on the sqlite World and on a real etcd; the attacker only
replays bytes the real exporter wrote."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from urllib.parse import quote

import pytest

from evergraph.world.etcd_server import EtcdServer
from tests.conftest import Agent, wait_for
from tests.kit.identity_attacks import COLLECT_FILES, AttackWorld, file_export_graph

AgentFactory = Callable[..., Agent]


@pytest.fixture(params=["sqlite", "etcd"])
def world(
    request: pytest.FixtureRequest, tmp_path: Path, servers: list[EtcdServer], shm: Path
) -> AttackWorld:
    return AttackWorld(request.param, tmp_path, servers, shm)


class Pair:
    """ea exports a file to every host (`*`); eb collects it. ea's export went from
    v1 to v2; the attacker kept ea's v1 record and index, and the v2 record."""

    def __init__(self, tmp_path: Path, agents: AgentFactory, world: AttackWorld) -> None:
        self.world = world
        self.target = target = tmp_path / "on-b" / "conf"
        self.key = f"exported/*/ea/file/{quote(str(target), safe='')}"
        self.index = "exported/*/ea/index"
        self.ga, gb = tmp_path / "a.yaml", tmp_path / "b.yaml"
        self.ga.write_text(file_export_graph("a", target, "v1\n"))
        gb.write_text(COLLECT_FILES)
        self.eb = agents(gb, tmp_path / "sb", "--hostname", "eb", *world.args)
        self.eb.wait_converged()
        self.ea = agents(self.ga, tmp_path / "sa", "--hostname", "ea", *world.args)
        wait_for(lambda: target.exists() and target.read_text() == "v1\n", what="v1 on eb")
        self.old_record, self.old_index = world.get(self.key), world.get(self.index)
        assert self.old_record is not None
        self.ga.write_text(file_export_graph("a", target, "v2\n"))
        wait_for(lambda: target.read_text() == "v2\n", what="v2 on eb")
        self.new_record = world.get(self.key)
        assert self.new_record is not None
        # eb's log is flushed every 0.1 s: count its swaps once both (v1, v2) are there
        wait_for(lambda: self.swaps() >= 2, what="eb's two swaps in its log")

    def log(self) -> str:
        return self.eb.log.read_text()

    def swaps(self) -> int:
        return self.log().count("collected exports changed")

    def stop(self) -> None:
        assert self.ea.stop() == 0
        assert self.eb.proc.poll() is None
        assert self.eb.stop() == 0


def test_an_older_record_or_index_put_back_is_refused(
    tmp_path: Path, agents: AgentFactory, world: AttackWorld
) -> None:
    p = Pair(tmp_path, agents, world)
    assert p.old_record is not None
    # the older signed record put back: refused once, v2 stays
    world.put(p.key, p.old_record)
    wait_for(
        lambda: "replayed export refused" in p.log() or p.target.read_text() == "v1\n",
        what="eb's answer to the replayed record",
    )
    assert p.target.read_text() == "v2\n"
    assert p.log().count("replayed export refused") == 1
    assert p.key in next(x for x in p.log().splitlines() if "replayed export refused" in x)
    # the older index as well (it names the old record): refused
    if p.old_index is not None:  # (fc4cf40 had no index: the old record did it alone)
        world.put(p.index, p.old_index)
        world.put(p.key, p.old_record)
        wait_for(
            lambda: "replayed export index refused" in p.log() or p.target.read_text() == "v1\n",
            what="eb's answer to the replayed index",
        )
        assert p.target.read_text() == "v2\n"
    p.stop()


def test_a_record_deleted_behind_its_exporter_keeps_its_last_verified_value(
    tmp_path: Path, agents: AgentFactory, world: AttackWorld
) -> None:
    p = Pair(tmp_path, agents, world)
    before = p.swaps()
    world.delete(p.key)
    # eb keeps the resource (no swap that would drop it from its graph)
    wait_for(
        lambda: "index still lists it" in p.log() or p.swaps() > before,
        what="eb's answer to the deletion",
    )
    assert "index still lists it" in p.log()
    assert p.swaps() == before
    # ea saw it (a `*` export of its own, through its collector) and put it back
    wait_for(lambda: world.get(p.key) is not None, what="ea putting its record back")
    wait_for(lambda: f"ALARM: {p.key}" in p.ea.log.read_text(), what="ea's alarm")
    # a real withdrawal still reaches eb: it drops the export (a swap)
    p.ga.write_text("graph: a\nresources:\n  noop:\n  - name: a\n")
    wait_for(lambda: p.swaps() > before, what="the withdrawal reaching eb")
    p.stop()


def test_a_withdrawn_export_put_back_without_a_lease_is_not_applied(
    tmp_path: Path, agents: AgentFactory, world: AttackWorld
) -> None:
    p = Pair(tmp_path, agents, world)
    assert p.new_record is not None
    before = p.swaps()
    p.ga.write_text("graph: a\nresources:\n  noop:\n  - name: a\n")
    wait_for(lambda: p.swaps() > before, what="the withdrawal reaching eb")
    wait_for(lambda: world.get(p.key) is None, what="the record withdrawn")
    p.target.unlink()  # a removed resource leaves its file: make a re-apply visible
    assert p.ea.stop() == 0
    # ea is gone; its signed v2 record is put back, without a lease
    world.put(p.key, p.new_record)
    wait_for(
        lambda: "waits for its exporter's index" in p.log() or p.target.exists(),
        what="eb's answer to the withdrawn record put back",
    )
    assert not p.target.exists()
    assert p.eb.proc.poll() is None
    assert p.eb.stop() == 0


def test_a_restarted_collector_refuses_an_index_older_than_it_saw(tmp_path: Path) -> None:
    """The highest index sequences a collector saw are kept in its state dir (one
    throttled write for a burst of changes): an older index and record put back
    while it was down are refused after its restart. (Without the marks, the same
    put-back is applied: the control.)"""
    import asyncio

    from evergraph._util.atomic import ThrottledFile
    from evergraph.cluster.exports import (
        MARKS_FILE,
        encode_marks,
        export_key,
        index_key,
        load_marks,
        publish_hostkeys,
    )
    from evergraph.world.memory import MemoryKV, MemoryStore
    from tests.kit.exports import Host, file_params

    async def main() -> None:
        store = MemoryStore()
        kv = MemoryKV(store)
        a = Host(MemoryKV(store), tmp_path / "a", "hosta")
        b = Host(MemoryKV(store), tmp_path / "b", "hostb")
        key, ikey = export_key("hostb", "hosta", "file", "/x"), index_key("hostb", "hosta")
        await publish_hostkeys(kv, b.keys, "hostb")
        async with a.running():
            a.publisher.set([("hostb", "file", "/x", file_params("v1"))])
            await a.publisher.acknowledged.wait()
            old = [(k, item.value) for k in (key, ikey) if (item := await kv.get(k))]
            async with b.running():
                marks = ThrottledFile(
                    tmp_path / "b" / MARKS_FILE, lambda: encode_marks(b.collector.marks())
                )
                b.collector.on_marks = lambda _p, _i: marks.changed()
                for v in ("v2", "v3", "v4"):
                    a.publisher.set([("hostb", "file", "/x", file_params(v))])
                    while [e.params["content"] for e in b.collector.current()] != [v]:
                        await b.next_change()
                marks.flush()
                assert marks.writes == 1  # a burst, one write
        # a (down now too, its records stay: lease 0 here) and b are down; the
        # attacker puts back the v1 index and record
        for k, value in old:
            await kv.put(k, value)
        for restored in (True, False):
            c = Host(MemoryKV(store), tmp_path / "b", "hostb")
            if restored:
                c.collector.restore_marks(load_marks(tmp_path / "b"))
            async with c.running():
                await asyncio.sleep(0)  # (it read everything before `running` returned)
                got = [e.params["content"] for e in c.collector.current()]
                assert got == ([] if restored else ["v1"])
                assert (c.collector.refused >= 1) == restored

    asyncio.run(main())
