"""The two event streams an agent serves, on routes that do not collide (SPEC §5.2
named `/api/v1/events` for both; see docs/operations.md): `/api/v1/graph/events`
carries vertex state changes (no token, like `/api/v1/graph`), `/api/v1/events` the
farm's request and worker changes (a bearer token, a user's own requests), each
only its own kind; the unversioned spellings redirect to each. One real agent with
`--http` on a sqlite World, real tokens, real HTTP."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from tests.conftest import Agent, run_cli
from tests.kit.http import api_url


def _stream(c: httpx.Client, path: str, headers: dict[str, str]) -> Iterator[tuple[str, str]]:
    """(field, value) of each SSE line, as they come."""
    with c.stream("GET", path, headers=headers) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line:
                field, _, value = line.partition(":")
                yield field, value.strip()


def test_vertex_and_farm_events_on_their_own_routes(tmp_path: Path, agents: Any) -> None:
    db = tmp_path / "world.sqlite"
    world = ("--world-db", str(db))
    g = tmp_path / "g.yaml"
    f = tmp_path / "out"
    g.write_text(f"graph: g\nresources:\n  file:\n  - name: {f}\n    content: hi\n")
    srv: Agent = agents(g, tmp_path / "srv", "--hostname", "srv", *world, "--http", "127.0.0.1:0")
    srv.wait_converged()
    # (signed by the API server's own key: a token of another host is refused)
    r = run_cli("farm", "token", "create", "alice", *world, "--state-dir", tmp_path / "srv")
    assert r.returncode == 0, r.stderr
    alice = {"Authorization": "Bearer " + r.stdout.strip()}
    with httpx.Client(base_url=api_url(srv), timeout=30) as c:
        rid = c.post("/api/v1/reqs/", content=json.dumps({"Priority": 3}), headers=alice)
        assert rid.status_code == 201, rid.text
        req = rid.json()["ReqID"]

        # vertex states: no token needed, vertices only
        kinds, data = set(), []
        for field, value in _stream(c, "/api/v1/graph/events?after=0", {}):
            if field == "":
                assert value == "evergraph graph events", value
            elif field == "event":
                kinds.add(value)
            elif field == "data":
                data.append(json.loads(value))
                if any(d.get("ident") == f"file[{f}]" for d in data):
                    break
        assert kinds == set()  # unnamed events: vertex statuses, nothing of the farm
        assert all("ident" in d and "state" in d for d in data), data

        # the farm's: a token, and requests and workers only
        r = c.get("/api/v1/events")
        assert r.status_code == 401, r.text
        assert "message" in r.json()
        kinds, data = set(), []
        for field, value in _stream(c, "/api/v1/events", alice):
            if field == "":
                assert value == "evergraph farm events", value
            elif field == "event":
                kinds.add(value)
            elif field == "data":
                data.append(json.loads(value))
                if any(d.get("ID") == req for d in data):
                    break
        assert kinds <= {"request", "worker"}
        assert "request" in kinds
        assert not any("ident" in d for d in data), data

        # Boruta's unversioned spelling reaches each, not the other
        r = c.get("/api/events", follow_redirects=False)
        assert r.status_code == 308
        assert r.headers["location"].endswith("/api/v1/events")
        r = c.get("/api/graph/events", follow_redirects=False)
        assert r.status_code == 308
        assert r.headers["location"].endswith("/api/v1/graph/events")
        # the farm's OpenAPI document names its stream, not the graph's
        paths = c.get("/api/v1/openapi.json").json()["paths"]
        assert "/api/v1/events" in paths
        assert not any(p.startswith("/api/v1/graph") for p in paths)
    assert srv.stop() == 0
