"""The farm with real agents on one sqlite World: a worker agent (`--worker`) and a
matcher agent (`--http`); the test plays the users through the farm library."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

from evergraph.farm import model
from evergraph.farm.tokens import User
from tests.conftest import Agent, host_key, wait_for
from tests.kit.farm import ADMIN, farm_call, worker_uuid

ALICE = User(name="alice", fragment=True)  # (her requests carry fragments)


@pytest.mark.slow
def test_a_job_authorizes_a_key_until_it_ends_and_a_dead_worker_fails_its_job(
    tmp_path: Path, agents: Any
) -> None:
    db = tmp_path / "world.sqlite"
    keys = tmp_path / "home" / "authorized_keys"
    g = tmp_path / "g.yaml"
    g.write_text("graph: g\nresources:\n  noop:\n  - name: n\n")
    world = ("--world-db", str(db))
    # (no grace after the dead worker's lease: FAILED at its expiry)
    srv: Agent = agents(
        g,
        tmp_path / "srv",
        "--hostname",
        "srv",
        *world,
        "--http",
        "127.0.0.1:0",
        "--farm-alive-grace",
        "0",
    )
    wstate = tmp_path / "wk1"
    wk: Agent = agents(
        g,
        wstate,
        "--hostname",
        "wk1",
        *world,
        "--worker",
        "--cap",
        "board=rpi4",
        "--authorized-keys",
        str(keys),
        "--farm-server",
        f"srv={host_key(tmp_path / 'srv')}",
    )
    srv.wait_converged()
    wk.wait_converged()
    uuid = worker_uuid(wstate)
    w = farm_call(db, lambda f: f.worker(uuid))
    assert w.state == model.MAINTENANCE
    assert w.caps["board"] == "rpi4"
    assert w.caps["hostname"] == "wk1"
    assert "arch" in w.caps
    farm_call(db, lambda f: f.set_state(ADMIN, uuid, model.IDLE))
    # the request carries a graph fragment: applied on the worker for the job's life
    marker = tmp_path / "job" / "motd"
    fragment = (
        f'resources:\n  file:\n  - name: {marker}\n    content: "in a job\\n"\n'
        "    meta: {reverse: true}\n"
    )
    rid = farm_call(
        db,
        lambda f: f.new_request(ALICE, priority=3, caps={"board": "rpi4"}, fragment=fragment),
    )
    req = farm_call(db, lambda f: f.wait_started(ALICE, rid, 15))
    assert req.state == model.IN_PROGRESS
    wait_for(lambda: keys.exists() and f"evergraph-job-{rid}" in keys.read_text(), what="key")
    assert oct(keys.stat().st_mode & 0o777) == "0o600"
    wait_for(lambda: marker.exists() and marker.read_text() == "in a job\n", what="fragment")
    farm_call(db, lambda f: f.close_request(ALICE, rid))
    wait_for(lambda: f"evergraph-job-{rid}" not in keys.read_text(), what="key revoked")
    wait_for(lambda: not marker.exists(), what="the fragment's file reversed")
    # a second job, then the worker dies with it
    wait_for(
        lambda: farm_call(db, lambda f: f.worker(uuid)).state == model.IDLE, what="worker IDLE"
    )
    # (its fragment asks for no reversal: the worker adds it, persisted like the key's)
    left = tmp_path / "job" / "left-by-job-2"
    fragment2 = f'resources:\n  file:\n  - name: {left}\n    content: "job 2\\n"\n'
    rid2 = farm_call(db, lambda f: f.new_request(ALICE, priority=3, fragment=fragment2))
    assert farm_call(db, lambda f: f.wait_started(ALICE, rid2, 15)).state == model.IN_PROGRESS
    wait_for(lambda: f"evergraph-job-{rid2}" in keys.read_text(), what="second key")
    wait_for(left.exists, what="job 2's fragment applied")
    os.kill(wk.proc.pid, signal.SIGKILL)
    wk.proc.wait()
    wait_for(
        lambda: farm_call(db, lambda f: f.request(ALICE, rid2)).state == model.FAILED,
        timeout=15,
        what="the dead worker's request FAILED (lease expiry)",
    )
    assert farm_call(db, lambda f: f.worker(uuid)).state == model.FAILED
    # the key is still in the file (nobody ran to remove it) until the worker's agent
    # comes back: its persisted reversal removes it
    assert f"evergraph-job-{rid2}" in keys.read_text()
    assert left.exists()
    # --farm-server NAME alone: the first run pinned srv's key explicitly
    wk2: Agent = agents(
        g,
        wstate,
        *("--hostname", "wk1", *world, "--worker", "--authorized-keys", str(keys)),
        *("--farm-server", "srv"),
    )
    wait_for(lambda: f"evergraph-job-{rid2}" not in keys.read_text(), what="revoked on restart")
    wait_for(lambda: not left.exists(), what="job 2's fragment reversed on restart")
    wk2.wait_converged()  # stopped before its first convergence, a run exits 1
    assert wk2.stop() == 0
    assert srv.stop() == 0
