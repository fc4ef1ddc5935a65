"""Identities defend themselves (issue 22, items 3 and 8): an agent puts its own
`hostkeys/<me>` back the moment someone else overwrites or deletes it, so a host
that joins while it is up pins the real key and refuses exports forged "from" it;
`evergraph exports` marks forged records; pins edited under a running agent
(`hosts forget`, `hosts trust`) take effect within a second. Real agents, on the
sqlite World and on a real etcd."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from evergraph.cluster.hostkeys import HostKeys, identity
from evergraph.cluster.pins import Pins, fingerprint_of
from evergraph.world.etcd_server import EtcdServer
from evergraph.world.kv import KV
from tests.conftest import Agent, run_cli, wait_for
from tests.kit.identity_attacks import (
    COLLECT_FILES,
    AttackWorld,
    file_export_graph,
    forged_export,
    host_key_record,
)

AgentFactory = Callable[..., Agent]


@pytest.fixture(params=["sqlite", "etcd"])
def world(
    request: pytest.FixtureRequest, tmp_path: Path, servers: list[EtcdServer], shm: Path
) -> AttackWorld:
    return AttackWorld(request.param, tmp_path, servers, shm)


def _restored_within(
    world: AttackWorld, key: str, real: bytes, attack: Callable[[KV], object]
) -> float:
    """Run the attack on `key`, then the seconds until the World holds `real` again."""

    async def fn(kv: KV) -> float:
        await attack(kv)  # type: ignore[misc]
        t0 = time.monotonic()
        while True:
            item = await kv.get(key)
            if item is not None and json.loads(item.value) == json.loads(real):
                return time.monotonic() - t0
            if time.monotonic() - t0 > 10:
                raise AssertionError(f"{key} was not restored within 10 s")
            await asyncio.sleep(0.01)

    return world.call(fn)


def test_an_overwritten_host_key_is_restored_and_a_later_joiner_is_not_fooled(
    tmp_path: Path, agents: AgentFactory, world: AttackWorld
) -> None:
    legit, evil = tmp_path / "on-b" / "legit", tmp_path / "on-b" / "evil"
    ga, gb = tmp_path / "a.yaml", tmp_path / "b.yaml"
    ga.write_text(file_export_graph("a", legit, "legit\n"))
    gb.write_text(COLLECT_FILES)
    ea = agents(ga, tmp_path / "sa", "--hostname", "ea", *world.args)
    ea.wait_converged()
    real_keys = HostKeys(tmp_path / "sa")
    real = host_key_record("ea", real_keys)
    mallory = HostKeys(tmp_path / "mallory")
    fake = host_key_record("ea", mallory)

    # 1. Mallory overwrites ea's key record: ea puts it back within a second
    async def overwrite(kv: KV) -> None:
        await kv.put("hostkeys/ea", fake)

    took = _restored_within(world, "hostkeys/ea", real, overwrite)
    assert took < 1.0, f"restored after {took:.2f}s"
    found = fingerprint_of(identity(mallory.public, mallory.verify))
    wait_for(lambda: found in ea.log.read_text(), what="ea's alarm naming Mallory's key")
    alarm = [x for x in ea.log.read_text().splitlines() if found in x]
    assert len(alarm) == 1, alarm
    assert " error: ALARM" in alarm[0]
    assert "hostkeys/ea" in alarm[0]

    # 2. ... and deletes it: put back too
    async def delete(kv: KV) -> None:
        await kv.delete("hostkeys/ea")

    took = _restored_within(world, "hostkeys/ea", real, delete)
    assert took < 1.0, f"restored after {took:.2f}s"
    wait_for(lambda: "hostkeys/ea was deleted" in ea.log.read_text(), what="the deletion alarm")

    # 3. Mallory forges a `*` export "from ea" signed by her key: ea sees it among
    # its own and deletes it, with an alarm
    ops = forged_export(mallory, "ea", "*", evil, "pwned\n")[:1]
    world.call(lambda kv: kv.txn([], ops))
    wait_for(lambda: world.get(ops[0].key) is None, what="ea deleting the forged record")
    wait_for(lambda: f"ALARM: {ops[0].key}" in ea.log.read_text(), what="ea's alarm")

    # 4. eb joins now, while ea is up: it pins ea's real key and applies ea's export
    eb = agents(gb, tmp_path / "sb", "--hostname", "eb", *world.args)
    eb.wait_converged()
    wait_for(lambda: legit.exists() and legit.read_text() == "legit\n", what="ea's export on eb")
    pin = Pins(tmp_path / "sb").get("ea")
    assert pin is not None
    assert (pin.public, pin.verify) == real_keys.pair()

    # 5. a record "from ea" sealed to eb, signed by Mallory: eb refuses it, and the
    # listing (with eb's pins) marks it FORGED, ea's own ok, and exits 1
    eb_keys = HostKeys(tmp_path / "sb")
    ops = forged_export(mallory, "ea", "eb", evil, "pwned\n", public=eb_keys.public)[:1]
    world.call(lambda kv: kv.txn([], ops))
    wait_for(lambda: "bad signature: not signed by 'ea'" in eb.log.read_text(), what="refusal")
    assert not evil.exists()
    r = run_cli("exports", "--state-dir", tmp_path / "sb", *world.args)
    assert r.returncode == 1, r.stderr
    rows = {tuple(line.split("\t")) for line in r.stdout.splitlines()}
    assert ("*", "ea", f"file[{legit}]", "signed", "ok") in rows
    assert ("eb", "ea", f"file[{evil}]", "sealed", "FORGED") in rows
    assert ea.stop() == 0
    assert eb.stop() == 0


def test_hosts_forget_reaches_a_running_agent_within_a_second(
    tmp_path: Path, agents: AgentFactory, world: AttackWorld
) -> None:
    """eb refuses ea's new key (and tells the operator what to run); the operator runs
    `hosts forget ea` while eb runs: within a second eb trusts the new key and applies
    ea's export, without a restart."""
    target = tmp_path / "on-b" / "conf"
    ga, gb = tmp_path / "a.yaml", tmp_path / "b.yaml"
    ga.write_text(file_export_graph("a", target, "one\n"))
    gb.write_text(COLLECT_FILES)
    eb = agents(gb, tmp_path / "sb", "--hostname", "eb", *world.args)
    eb.wait_converged()
    ea = agents(ga, tmp_path / "sa1", "--hostname", "ea", *world.args)
    wait_for(lambda: target.exists() and target.read_text() == "one\n", what="first export")
    assert ea.stop() == 0
    # ea reinstalled: a new key (new state dir), the same name
    ga.write_text(file_export_graph("a", target, "two\n"))
    ea2 = agents(ga, tmp_path / "sa2", "--hostname", "ea", "--replace", *world.args)
    ea2.wait_converged()

    def refused() -> bool:
        text = eb.log.read_text()
        return "is pinned: refused" in text and "evergraph hosts forget ea" in text

    wait_for(refused, what="eb refuses ea's new key, naming `hosts forget`")
    wait_for(lambda: "not signed by 'ea'" in eb.log.read_text(), what="eb refuses the records")
    assert target.read_text() == "one\n"
    r = run_cli("hosts", "forget", "ea", "--state-dir", tmp_path / "sb")
    assert r.returncode == 0, r.stderr
    t0 = time.monotonic()
    wait_for(lambda: target.read_text() == "two\n", timeout=5, what="the new key's export")
    took = time.monotonic() - t0
    assert took < 1.0, f"applied {took:.2f}s after `hosts forget`"
    pin = Pins(tmp_path / "sb").get("ea")
    assert pin is not None
    assert (pin.public, pin.verify) == HostKeys(tmp_path / "sa2").pair()
    assert ea2.stop() == 0
    assert eb.stop() == 0


def test_pins_tell_listeners_what_another_process_changed(tmp_path: Path) -> None:
    """The hook other code (the deploy follower) uses: `listen`, fed by `poll`."""
    pins = Pins(tmp_path)
    heard: list[tuple[frozenset[str], bool]] = []
    pins.listen(lambda hosts, deployers: heard.append((hosts, deployers)))
    other = Pins(tmp_path)  # `evergraph hosts ...`, another process
    k = HostKeys(tmp_path / "k")
    other.trust("web1", identity(k.public, k.verify))
    pins.poll()
    assert heard == [(frozenset({"web1"}), False)]
    other.add_deployer(k.verify)
    pins.get("web1")  # a read picks the change up first: it is still told once
    pins.poll()
    pins.poll()
    assert heard[1:] == [(frozenset(), True)]
    pins.check("web2", k.public, k.verify)  # our own write: nobody to tell
    pins.poll()
    assert len(heard) == 2
    (tmp_path / "pins.json").write_text("{")  # broken: logged, the pins in memory stay
    pins.poll()
    assert pins.get("web1") is not None
    assert len(heard) == 2


def test_hosts_marks_a_garbled_key_record(tmp_path: Path) -> None:
    """`evergraph hosts` lists what fails verification instead of skipping it."""
    me = tmp_path / "me"
    r = run_cli("world", "put", "hostkeys/web1", "not a key record {", "--state-dir", me)
    assert r.returncode == 0, r.stderr
    r = run_cli("hosts", "--state-dir", me)
    assert r.returncode == 1
    assert r.stdout.splitlines() == ["web1\t-\t-\tbad-record"]
    assert "hostkeys/web1: not a host key record" in r.stderr


def test_the_start_up_sweep_spares_a_temp_file_another_process_is_writing(
    tmp_path: Path,
) -> None:
    """An agent starting on a state dir sweeps what a kill left (temporary files),
    but not `hosts trust` writing pins.json beside it at that moment: a temporary
    file younger than a minute may be a write in flight."""
    from evergraph._util.atomic import TEMP_GRACE, sweep_temps, temp_name
    from evergraph.agent.run import sweep_state_dir

    state = tmp_path / "state"
    state.mkdir()
    in_flight = state / temp_name("pins.json")
    left = state / temp_name("export-seq")
    old_dir = state / "deploys" / ".fetch.0123456789ab.tmp"
    young_dir = state / "deploys" / ".fetch.ba9876543210.tmp"
    old_dir.mkdir(parents=True)
    young_dir.mkdir()
    in_flight.write_text("{}")
    left.write_text("1\n")
    long_ago = time.time() - TEMP_GRACE - 5
    os.utime(left, (long_ago, long_ago))
    os.utime(old_dir, (long_ago, long_ago))
    sweep_state_dir(state)
    assert in_flight.exists()
    assert young_dir.exists()
    assert not left.exists()
    assert not old_dir.exists()
    # a minute later, the same temp file is a kill's leftover
    removed = sweep_temps(state, now=time.time() + TEMP_GRACE + 1, temp_dirs_in=("deploys",))
    assert sorted(removed) == sorted([str(in_flight), str(young_dir)])
