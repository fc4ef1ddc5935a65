"""The farm's HTTP API v1 end to end: real agents (a server with `--http`, a worker
with `--worker`) on one sqlite World, a real HTTP client, real tokens."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.hazmat.primitives.serialization import load_pem_private_key

from evergraph.world.etcd_server import EtcdServer
from tests.conftest import Agent, host_key, run_cli, wait_for
from tests.kit.farm import farm_token
from tests.kit.http import api_url


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["sqlite", "etcd"])
def test_boruta_routes_with_tokens_over_real_agents(
    tmp_path: Path, agents: Any, backend: str, shm: Path, servers: list[EtcdServer]
) -> None:
    db = tmp_path / "world.sqlite"
    keys = tmp_path / "home" / "authorized_keys"
    g = tmp_path / "g.yaml"
    g.write_text("graph: g\nresources:\n  noop:\n  - name: n\n")
    world: tuple[str, ...] = ("--world-db", str(db))
    if backend == "etcd":
        server = EtcdServer.single(shm)
        servers.append(server)
        server.start()
        world = ("--seeds", server.client_url)
    srv: Agent = agents(g, tmp_path / "srv", "--hostname", "srv", *world, "--http", "127.0.0.1:0")
    wk: Agent = agents(
        g,
        tmp_path / "wk1",
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
    admin = {"Authorization": "Bearer " + farm_token(tmp_path / "srv", world, "root", "--admin")}
    alice = {
        "Authorization": "Bearer "
        + farm_token(tmp_path / "srv", world, "alice", "--group", "lab", "--fragment")
    }
    bob = {"Authorization": "Bearer " + farm_token(tmp_path / "srv", world, "bob")}
    with httpx.Client(base_url=api_url(srv), timeout=30) as c:
        r = c.get("/api/v1/version")
        assert r.status_code == 200
        assert r.json()["API_Version"] == "v1"
        # no token, a bad token
        assert c.get("/api/v1/workers/").status_code == 401
        assert (
            c.get("/api/v1/workers/", headers={"Authorization": "Bearer egt_x"}).status_code == 401
        )
        [w] = c.get("/api/v1/workers/", headers=alice).json()
        uuid = w["WorkerUUID"]
        assert w["State"] == "MAINTENANCE"
        assert w["Caps"]["board"] == "rpi4"
        # admin routes
        body = json.dumps({"WorkerState": "IDLE"})
        r = c.post(f"/api/v1/workers/{uuid}/setstate", content=body, headers=alice)
        assert r.status_code == 403
        r = c.post(f"/api/v1/workers/{uuid}/setstate", content=body, headers=admin)
        assert r.status_code == 202
        wait_for(
            lambda: c.get(f"/api/v1/workers/{uuid}", headers=alice).json()["State"] == "IDLE",
            what="worker IDLE",
        )
        # bad input
        r = c.post("/api/v1/reqs/", content="{", headers=alice)
        assert r.status_code == 400
        assert r.json()["message"].startswith("invalid request: ")
        r = c.post("/api/v1/reqs/", content=json.dumps({"Priority": 17}), headers=alice)
        assert r.status_code == 400
        assert c.get("/api/v1/reqs/99", headers=alice).json() == {"message": "Request not found"}
        # a request, matched
        req = {"Priority": 3, "Caps": {"board": "rpi3|rpi4"}}
        r = c.post("/api/v1/reqs/", content=json.dumps(req), headers=alice)
        assert r.status_code == 201
        rid = r.json()["ReqID"]
        assert c.get(f"/api/v1/reqs/{rid}", headers=bob).status_code == 404  # not bob's
        r = c.post(f"/api/v1/reqs/{rid}/acquire_worker?wait=20", headers=alice)
        assert r.status_code == 200, r.text
        access = r.json()
        assert access["Addr"]["Port"] == 22
        assert access["Username"] == "root"
        assert access["Key"].startswith("-----BEGIN RSA PRIVATE KEY-----")
        key = load_pem_private_key(access["Key"].encode(), password=None)
        assert isinstance(key, rsa.RSAPrivateKey)
        assert key.key_size == 2048
        r = c.get(f"/api/v1/reqs/{rid}", headers=alice)
        assert r.json()["State"] == "IN PROGRESS"
        assert r.headers["Boruta-Request-State"] == "IN PROGRESS"
        assert "Boruta-Job-Timeout" in r.headers
        wait_for(lambda: keys.exists() and f"evergraph-job-{rid}" in keys.read_text(), what="key")
        r = c.post(f"/api/v1/reqs/{rid}/prolong", headers=alice)
        assert r.status_code == 204
        # lists: alice sees her one request; pagination headers
        r = c.post("/api/v1/reqs/list", content="", headers=alice)
        assert r.status_code == 200
        assert [x["ID"] for x in r.json()] == [rid]
        assert r.headers["Boruta-List-Total"] == "1"
        # server-sent events: the current state first
        with c.stream("GET", "/api/v1/events", headers=alice) as events:
            lines = events.iter_lines()
            seen = []
            for line in lines:
                if line.startswith("data: "):
                    seen.append(json.loads(line[6:]))
                if len(seen) >= 2:
                    break
        assert {x.get("ID") for x in seen if "ID" in x} == {rid}
        # close: DONE, the key revoked on the worker
        assert c.post(f"/api/v1/reqs/{rid}/close", headers=alice).status_code == 204
        assert c.get(f"/api/v1/reqs/{rid}", headers=alice).json()["State"] == "DONE"
        wait_for(lambda: f"evergraph-job-{rid}" not in keys.read_text(), what="key revoked")
        r = c.post(f"/api/v1/reqs/{rid}/acquire_worker?wait=0", headers=alice)
        assert r.status_code == 400
        # the unversioned path redirects, keeping the method
        r = c.post("/api/reqs/list", content="", headers=alice)
        assert r.status_code == 308
        assert r.headers["location"] == "/api/v1/reqs/list"
        url = api_url(srv)
    # the same through the CLI (built on the client library)
    env = ("--url", url, "--token", alice["Authorization"].split()[1])
    bad = tmp_path / "bad-fragment.yaml"
    bad.write_text("resources:\n  file:\n  - name: x\n    bogus: 1\n")
    r = run_cli("farm", "new", "--fragment", bad, *env)
    assert r.returncode == 2
    assert "invalid request: Fragment:4:5: file[x].bogus: unknown parameter" in r.stderr
    r = run_cli("farm", "new", "--priority", "2", "--cap", "board=rpi4", *env)
    assert r.returncode == 0, r.stderr
    rid2 = int(r.stdout)
    pem = tmp_path / "job.pem"
    r = run_cli("farm", "acquire", str(rid2), "--wait", "20", "--key-file", pem, *env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"ssh -i {pem} -p 22 root@{access['Addr']['IP']}"
    assert oct(pem.stat().st_mode & 0o777) == "0o600"
    assert pem.read_text().startswith("-----BEGIN RSA PRIVATE KEY-----")
    r = run_cli("farm", "requests", "--state", "in progress", *env)
    assert [line.split("\t")[:3] for line in r.stdout.splitlines()] == [
        [str(rid2), "2", "IN PROGRESS"]
    ]
    r = run_cli("farm", "workers", *env)
    assert r.stdout.split("\t")[:2] == [uuid, "RUNNING"]
    r = run_cli("farm", "set-state", uuid, "IDLE", *env)  # alice is no admin
    assert r.returncode == 2
    assert "403" in r.stderr
    r = run_cli("farm", "close", str(rid2), "--url", url, "--token", "egt_nope")
    assert r.returncode == 2
    assert "401" in r.stderr
    assert run_cli("farm", "close", str(rid2), *env).returncode == 0
    assert wk.stop() == 0
    assert srv.stop() == 0
