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

from .conftest import Agent, wait_for
from .identity_attacks import COLLECT_FILES, AttackWorld, file_export_graph

AgentFactory = Callable[..., Agent]


@pytest.fixture(params=["sqlite", "etcd"])
def world(
    request: pytest.FixtureRequest, tmp_path: Path, servers: list[EtcdServer], shm: Path
) -> AttackWorld:
    return AttackWorld(request.param, tmp_path, servers, shm)


def test_replayed_deleted_and_withdrawn_exports_are_refused(
    tmp_path: Path, agents: AgentFactory, world: AttackWorld
) -> None:
    target = tmp_path / "on-b" / "conf"
    key = f"exported/*/ea/file/{quote(str(target), safe='')}"
    index = "exported/*/ea/index"
    ga, gb = tmp_path / "a.yaml", tmp_path / "b.yaml"
    ga.write_text(file_export_graph("a", target, "v1\n"))
    gb.write_text(COLLECT_FILES)
    eb = agents(gb, tmp_path / "sb", "--hostname", "eb", *world.args)
    eb.wait_converged()
    ea = agents(ga, tmp_path / "sa", "--hostname", "ea", *world.args)
    wait_for(lambda: target.exists() and target.read_text() == "v1\n", what="v1 on eb")
    old_record, old_index = world.get(key), world.get(index)
    assert old_record is not None
    ga.write_text(file_export_graph("a", target, "v2\n"))
    wait_for(lambda: target.read_text() == "v2\n", what="v2 on eb")
    new_record = world.get(key)
    assert new_record is not None

    def log() -> str:
        return eb.log.read_text()

    def swaps() -> int:
        return log().count("collected exports changed")

    # 1. the older signed record put back: refused once, v2 stays
    world.put(key, old_record)
    wait_for(
        lambda: "replayed export refused" in log() or target.read_text() == "v1\n",
        what="eb's answer to the replayed record",
    )
    assert target.read_text() == "v2\n"
    assert log().count("replayed export refused") == 1
    assert key in next(x for x in log().splitlines() if "replayed export refused" in x)

    # 2. the older index put back as well (it names the old record): refused
    if old_index is not None:  # (today's main has no index: the old record did it)
        world.put(index, old_index)
        wait_for(
            lambda: "replayed export index refused" in log() or target.read_text() == "v1\n",
            what="eb's answer to the replayed index",
        )
        assert target.read_text() == "v2\n"

    # 3. the record deleted behind ea's back: eb keeps the last verified value (its
    # graph does not lose the resource: no swap)
    before = swaps()
    world.delete(key)
    wait_for(
        lambda: "index still lists it" in log() or swaps() > before,
        what="eb's answer to the deletion",
    )
    assert "index still lists it" in log()
    assert swaps() == before
    # ea saw it (a `*` export of its own, through its collector) and put it back
    wait_for(lambda: world.get(key) is not None, what="ea putting its record back")
    wait_for(lambda: f"ALARM: {key}" in ea.log.read_text(), what="ea's alarm")

    # 4. ea withdraws the export for real: eb drops it (a swap)
    ga.write_text("graph: a\nresources:\n  noop:\n  - name: a\n")
    wait_for(lambda: swaps() > before, what="the withdrawal reaching eb")
    target.unlink()  # a removed resource leaves its file: make a re-apply visible

    # 5. the withdrawn record put back without a lease: not applied
    world.put(key, new_record)
    wait_for(
        lambda: "waits for its exporter's index" in log() or target.exists(),
        what="eb's answer to the withdrawn record put back",
    )
    assert not target.exists()
    assert ea.stop() == 0
    assert eb.proc.poll() is None
    assert eb.stop() == 0
