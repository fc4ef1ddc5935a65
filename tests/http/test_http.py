"""The agent's HTTP API (`--http ADDR`), served for real on loopback."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import httpx

from tests.conftest import Agent, run_cli
from tests.kit.http import api_url


def test_status_routes_and_the_unversioned_redirect(tmp_path: Path, agents: Any) -> None:
    g = tmp_path / "g.yaml"
    g.write_text(f"graph: h\nresources:\n  file:\n  - name: {tmp_path / 'f'}\n    content: x\n")
    a: Agent = agents(g, tmp_path / "s", "--http", "127.0.0.1:0")
    a.wait_converged()
    url = api_url(a)
    with httpx.Client(base_url=url, timeout=10) as c:
        r = c.get("/healthz")
        assert r.status_code == 200
        assert r.json()["ok"] is True
        r = c.get("/api/v1/graph")
        assert r.status_code == 200
        [v] = r.json()["vertices"]
        assert v["ident"] == f"file[{tmp_path / 'f'}]"
        assert v["state"] in ("changed", "clean")
        r = c.get("/api/graph?x=1")
        assert r.status_code == 308
        assert r.headers["location"] == "/api/v1/graph?x=1"
        r = c.get("/api/v1/nothing-here")
        assert r.status_code == 404
    assert a.stop() == 0


def test_a_bad_or_taken_address_is_an_input_error(tmp_path: Path) -> None:
    g = tmp_path / "g.yaml"
    g.write_text("graph: h\nresources:\n  noop:\n  - name: n\n")
    r = run_cli("run", g, "--state-dir", tmp_path / "s", "--http", "nonsense")
    assert r.returncode == 2
    assert "--http: 'nonsense' is not HOST:PORT" in r.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        r = run_cli("run", g, "--state-dir", tmp_path / "s", "--http", f"127.0.0.1:{port}")
    assert r.returncode == 2
    assert "cannot listen on" in r.stderr
    assert not (tmp_path / "s").exists()
