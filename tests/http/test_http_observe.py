"""`run --http`: /metrics, the graph with its edges, server-sent vertex changes,
one vertex's masked parameters; all from a real agent process over real HTTP."""

from __future__ import annotations

import json
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import Agent, run_cli, wait_for
from tests.kit.http import api_url
from tests.kit.localuser import as_user, local_user, needs_root, shared_dir
from tests.kit.machine import MACHINE_WIDE

pytestmark = MACHINE_WIDE


def _graph(tmp: Path, names: tuple[str, ...] = ("a", "b", "c")) -> tuple[Path, dict[str, Path]]:
    files = {n: tmp / "files" / n for n in names}
    lines = ["graph: observed", "resources:", "  file:"]
    for n, p in files.items():
        lines += [f"  - name: {p}", f'    content: "content of {n}\\n"']
    lines += ["edges:"]
    first, *rest = names
    for n in rest:  # a -> b, a -> c
        lines += [
            f"- from: {{kind: file, name: {files[first]}}}",
            f"  to: {{kind: file, name: {files[n]}}}",
        ]
    g = tmp / "g.yaml"
    g.write_text("\n".join(lines) + "\n")
    return g, files


def _scrape(c: httpx.Client) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics: (name, sorted labels) -> value."""
    r = c.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _get(m: dict[Any, float], name: str, **labels: str) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_count_applies_and_a_drift_repair(tmp_path: Path, agents: Any) -> None:
    g, files = _graph(tmp_path)
    a: Agent = agents(g, tmp_path / "s", "--http", "127.0.0.1:0")
    a.wait_converged()
    with httpx.Client(base_url=api_url(a), timeout=10) as c:
        m = _scrape(c)
        # the first run created the three files
        assert _get(m, "evergraph_check_apply_total", kind="file", result="changed") == 3
        assert _get(m, "evergraph_check_apply_total", kind="file", result="failed") == 0
        assert _get(m, "evergraph_check_apply_duration_seconds_count", kind="file") == 3
        assert _get(m, "evergraph_check_apply_duration_seconds_sum", kind="file") > 0
        assert _get(m, "evergraph_vertices", state="changed") == 3
        assert _get(m, "evergraph_vertices", state="pending") == 0
        assert _get(m, "evergraph_converged") == 1
        assert _get(m, "evergraph_drift_repairs_total", kind="file") == 0
        assert _get(m, "evergraph_drift_repair_latency_seconds_count") == 0
        # the agent's World calls are timed (it claimed its hostname: a txn or cas)
        world_calls = sum(
            v for (n, _), v in m.items() if n == "evergraph_world_operation_seconds_count"
        )
        assert world_calls > 0
        assert _get(m, "evergraph_farm_waiting_requests") == 0
        assert _get(m, "process_resident_memory_bytes") > 0
        events_before = _get(m, "evergraph_watch_events_total")
        # what Prometheus itself asks for: OpenMetrics, one "# EOF" at the very end
        r = c.get("/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})
        assert r.headers["content-type"].startswith("application/openmetrics-text")
        assert r.text.endswith("# EOF\n")
        assert r.text.count("# EOF") == 1
        om = {f.name: f for f in openmetrics_families(r.text)}
        assert om["evergraph_check_apply"].type == "counter"
        assert om["evergraph_drift_repair_latency_seconds"].type == "histogram"

        # drift: someone edits b; the agent puts it back, and the metrics say so
        files["b"].write_text("edited by hand\n")

        def repaired() -> bool:
            return _get(_scrape(c), "evergraph_drift_repairs_total", kind="file") == 1

        wait_for(repaired, what="a drift repair in /metrics")
        assert files["b"].read_text() == "content of b\n"
        m = _scrape(c)
        assert _get(m, "evergraph_drift_repair_latency_seconds_count") == 1
        latency = _get(m, "evergraph_drift_repair_latency_seconds_sum")
        assert 0 < latency < 5
        # the le="5.0" bucket holds it, and +Inf the same count
        assert _get(m, "evergraph_drift_repair_latency_seconds_bucket", le="5.0") == 1
        assert _get(m, "evergraph_drift_repair_latency_seconds_bucket", le="+Inf") == 1
        assert _get(m, "evergraph_check_apply_total", kind="file", result="changed") == 4
        assert _get(m, "evergraph_watch_events_total") > events_before
        # a and c were never touched: no repair counted for them, and no failure
        assert _get(m, "evergraph_check_apply_total", kind="file", result="failed") == 0
        wait_for(lambda: _get(_scrape(c), "evergraph_converged") == 1, what="converged again")
    assert a.stop() == 0


def _events(c: httpx.Client, path: str) -> Iterator[dict[str, Any]]:
    """The JSON of each SSE `data:` line, as they come (comments skipped)."""
    with c.stream("GET", path) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith(": evergraph graph events"):
                yield {"attached": True}
            elif line.startswith("data: "):
                yield json.loads(line[6:])


def test_sse_delivers_a_vertex_change(tmp_path: Path, agents: Any) -> None:
    g, files = _graph(tmp_path)
    a: Agent = agents(g, tmp_path / "s", "--http", "127.0.0.1:0")
    a.wait_converged()
    ident = f"file[{files['c']}]"
    with httpx.Client(base_url=api_url(a), timeout=10) as c:
        before = {v["ident"]: v for v in c.get("/api/v1/graph").json()["vertices"]}[ident]
        seen: list[dict[str, Any]] = []
        for ev in _events(c, "/api/v1/graph/events"):
            if ev.get("attached"):
                files["c"].unlink()  # drift, once the stream is attached
                continue
            seen.append(ev)
            if ev["ident"] == ident and ev["changed_count"] > before["changed_count"]:
                break  # a read timeout (10 s) fails the test instead
    last = seen[-1]
    assert last["state"] in ("changed", "clean")
    assert last["kind"] == "file"
    assert last["last_changed"] > (before["last_changed"] or 0)
    assert last["duration"] > 0
    assert files["c"].read_text() == "content of c\n"
    assert a.stop() == 0


def test_sse_resumes_after_an_event_number_and_refuses_a_bad_one(
    tmp_path: Path, agents: Any
) -> None:
    g, _ = _graph(tmp_path)
    a: Agent = agents(g, tmp_path / "s", "--http", "127.0.0.1:0")
    a.wait_converged()
    with httpx.Client(base_url=api_url(a), timeout=10) as c:
        # from event 0: the start-up's statuses (still in the ring), latest per vertex
        got: dict[str, dict[str, Any]] = {}
        for ev in _events(c, "/api/v1/graph/events?after=0"):
            if not ev.get("attached"):
                got[ev["ident"]] = ev
            if len(got) == 3:
                break
        assert {v["state"] for v in got.values()} <= {"changed", "clean"}
        r = c.get("/api/v1/graph/events?after=x1")
        assert r.status_code == 400
        assert r.json()["message"] == "after: 'x1' is not an event number"
    assert a.stop() == 0


def test_graph_has_vertices_and_edges_and_never_a_secret(tmp_path: Path, agents: Any) -> None:
    secret_file = tmp_path / "db.pass"
    g = tmp_path / "g.yaml"
    g.write_text(
        f"""graph: secrets
resources:
  password:
  - name: db
  file:
  - name: {secret_file}
  - name: {tmp_path / "plain"}
    content: "not a secret\\n"
edges:
- from: {{kind: password, name: db, send: password}}
  to: {{kind: file, name: {secret_file}, recv: content}}
"""
    )
    a: Agent = agents(g, tmp_path / "s", "--http", "127.0.0.1:0")
    a.wait_converged()
    wait_for(lambda: secret_file.exists() and secret_file.stat().st_size > 0, what="password")
    password = secret_file.read_text()
    assert len(password) == 64
    ident = f"file[{secret_file}]"
    r = run_cli("farm", "token", "create", "root", "--admin", "--state-dir", tmp_path / "s")
    assert r.returncode == 0, r.stderr
    auth = {"Authorization": "Bearer " + r.stdout.strip()}
    with httpx.Client(base_url=api_url(a), timeout=10, headers=auth) as c:
        r = c.get("/api/v1/graph")
        assert r.status_code == 200
        body = r.json()
        assert body["graph"] == "secrets"
        states = {v["ident"]: v["state"] for v in body["vertices"]}
        assert set(states) == {"password[db]", ident, f"file[{tmp_path / 'plain'}]"}
        assert set(states.values()) <= {"changed", "clean"}
        assert body["edges"] == [
            {
                "from": "password[db]",
                "to": ident,
                "notify": False,
                "send": "password",
                "recv": "content",
            }
        ]
        assert isinstance(body["seq"], int)
        assert body["seq"] >= 3
        texts = [r.text]
        r = c.get("/api/v1/graph/vertices/" + ident)
        assert r.status_code == 200
        v = r.json()
        assert v["status"]["ident"] == ident
        assert v["params"]["content"] == "********"  # the received secret, masked whole
        texts.append(r.text)
        r = c.get(f"/api/v1/graph/vertices/file[{tmp_path / 'plain'}]")
        assert r.json()["params"]["content"] == "not a secret\n"  # others are shown
        r = c.get("/api/v1/graph/vertices/password[db]")
        assert r.json()["params"] == {"length": 64, "saved": ""}
        texts.append(r.text)
        r = c.get("/api/v1/graph/vertices/file[/nowhere]")
        assert r.status_code == 404
        assert r.json()["message"] == "no vertex 'file[/nowhere]' in the running graph"
        texts.append(c.get("/metrics").text)
        for ev in _events(c, "/api/v1/graph/events?after=0"):
            if not ev.get("attached"):
                texts.append(json.dumps(ev))
                if ev["ident"] == ident:
                    break
        for t in texts:
            assert password not in t
    assert a.stop() == 0


def test_the_page_and_its_files_are_served(tmp_path: Path, agents: Any) -> None:
    g, _ = _graph(tmp_path, ("a",))
    a: Agent = agents(g, tmp_path / "s", "--http", "127.0.0.1:0")
    a.wait_converged()
    with httpx.Client(base_url=api_url(a), timeout=10) as c:
        r = c.get("/")
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/html")
        assert '<script src="/static/app.js">' in r.text
        r = c.get("/static/app.js")
        assert r.headers["content-type"].startswith("text/javascript")
        assert "EventSource" in r.text
        assert c.get("/static/style.css").headers["content-type"].startswith("text/css")
        assert c.get("/static/nothing.js").status_code == 404
        assert c.get("/static/..%2Fapp.py").status_code == 404
    assert a.stop() == 0


def test_farm_queue_depth(tmp_path: Path, agents: Any) -> None:
    """A request no idle worker can take yet waits; the gauge counts it."""
    g, _ = _graph(tmp_path, ("a",))
    world = ("--world-db", str(tmp_path / "world.sqlite"))
    a: Agent = agents(
        g,
        tmp_path / "s",
        *world,
        "--http",
        "127.0.0.1:0",
        "--worker",  # registered, in MAINTENANCE: the request can match it, not now
        "--cap",
        "board=b1",
        "--authorized-keys",
        str(tmp_path / "keys"),
    )
    a.wait_converged()
    # made with the API server's state dir: signed by its key, which it trusts
    r = run_cli("farm", "token", "create", "alice", *world, "--state-dir", tmp_path / "s")
    assert r.returncode == 0, r.stderr
    auth = {"Authorization": "Bearer " + r.stdout.strip()}
    with httpx.Client(base_url=api_url(a), timeout=10) as c:
        assert _get(_scrape(c), "evergraph_farm_waiting_requests") == 0
        req = json.dumps({"Priority": 3, "Caps": {"board": "b1"}})
        r = c.post("/api/v1/reqs/", content=req, headers=auth)
        assert r.status_code == 201, r.text
        rid = r.json()["ReqID"]
        wait_for(
            lambda: _get(_scrape(c), "evergraph_farm_waiting_requests") == 1,
            what="one waiting request",
        )
        assert c.post(f"/api/v1/reqs/{rid}/close", headers=auth).status_code == 204
        wait_for(
            lambda: _get(_scrape(c), "evergraph_farm_waiting_requests") == 0,
            what="no waiting request",
        )
        m = _scrape(c)
        assert _get(m, "evergraph_world_operation_seconds_count", op="txn") > 0
    assert a.stop() == 0


def test_parameters_need_an_admin_token_from_a_non_loopback_address(tmp_path: Path) -> None:
    """Inside a network namespace of its own, the agent serves on 10.77.0.1 (on lo,
    but not a loopback address): the graph is served, a vertex's parameters (file
    contents, commands) only with an admin's token."""
    import subprocess
    import sys

    g, files = _graph(tmp_path, ("a",))
    ident = f"file[{files['a']}]"
    client = f"""
import sys, time, httpx
deadline = time.monotonic() + 30
while True:
    try:
        with httpx.Client(base_url="http://10.77.0.1:9233", timeout=5) as c:
            graph = c.get("/api/v1/graph").status_code
            bare = c.get("/api/v1/graph/vertices/{ident}")
            bad = c.get("/api/v1/graph/vertices/{ident}",
                        headers={{"Authorization": "Bearer egt_nosuchtoken"}})
        break
    except httpx.TransportError:
        if time.monotonic() > deadline:
            sys.exit("no server")
        time.sleep(0.05)
print(graph, bare.status_code, bad.status_code, "content of a" in bare.text)
"""
    (tmp_path / "client.py").write_text(client)
    script = f"""
ip link set lo up && ip addr add 10.77.0.1/32 dev lo || exit 9
{sys.executable} -m evergraph.cli.main run {g} --state-dir {tmp_path / "s"} --world memory \\
    --http 10.77.0.1:9233 2>{tmp_path / "log"} &
agent=$!
{sys.executable} {tmp_path / "client.py"}
kill $agent; wait $agent
"""
    r = subprocess.run(
        ["unshare", "--net", "--fork", "--kill-child", "sh", "-c", script],
        capture_output=True, text=True, timeout=90,
    )  # fmt: skip
    assert r.stdout.split() == ["200", "401", "401", "False"], (r.stdout, r.stderr)


@needs_root()
def test_a_local_user_cannot_read_parameters_on_loopback(tmp_path: Path, agents: Any) -> None:
    """Loopback is no trust boundary: another local user gets the graph, but a root-only
    managed file's content (a vertex's parameters) only with an admin token."""
    secret = tmp_path / "root-only"
    g = tmp_path / "g.yaml"
    g.write_text(
        f'graph: local\nresources:\n  file:\n  - name: {secret}\n    content: "top secret 42\\n"\n'
        '    mode: "0600"\n'
    )
    state = tmp_path / "s"
    a: Agent = agents(g, state, "--http", "127.0.0.1:0")
    a.wait_converged()
    url = f"{api_url(a)}/api/v1/graph/vertices/file[{secret}]"
    r = run_cli("farm", "token", "create", "root", "--admin", "--state-dir", state)
    assert r.returncode == 0, r.stderr
    admin = r.stdout.strip()
    r = run_cli("farm", "token", "create", "bob", "--state-dir", state)
    assert r.returncode == 0, r.stderr
    plain = r.stdout.strip()

    def curl(user: str | None, *headers: str) -> tuple[str, str]:
        cmd = ["curl", "-gs", "-w", "\n%{http_code}", *(f"-H{h}" for h in headers), url]
        out = subprocess.run(
            as_user(user, *cmd) if user else cmd, capture_output=True, text=True, timeout=30
        ).stdout
        body, _, code = out.rpartition("\n")
        return code, body

    with local_user() as user:
        assert curl(user, "Accept: application/json")[0] == "401"
        code, body = curl(user, f"Authorization: Bearer {plain}")
        assert (code, "top secret" in body) == ("403", False)
        code, body = curl(user, "Authorization: Bearer egt_forged")
        assert (code, "top secret" in body) == ("401", False)
        graph = subprocess.run(
            as_user(user, "curl", "-s", f"{api_url(a)}/api/v1/graph"),
            capture_output=True,
            text=True,
        ).stdout
        assert "top secret" not in graph
        assert f"file[{secret}]" in graph
        # root without a token is refused too: only the token counts
        assert curl(None)[0] == "401"
        code, body = curl(user, f"Authorization: Bearer {admin}")
        assert code == "200"
        assert json.loads(body)["params"]["content"] == "top secret 42\n"
    assert a.stop() == 0


@needs_root()
def test_root_reads_parameters_over_the_unix_socket_and_a_local_user_does_not(
    tmp_path: Path, agents: Any
) -> None:
    """`--http-socket`: every local user may connect (the graph), but a vertex's
    parameters go without a token only to a peer whose uid (SO_PEERCRED) is 0."""
    secret = tmp_path / "root-only"
    g = tmp_path / "g.yaml"
    g.write_text(
        f'graph: local\nresources:\n  file:\n  - name: {secret}\n    content: "top secret 42\\n"\n'
        '    mode: "0600"\n'
    )
    with shared_dir() as d, local_user() as user:
        sock = d / "api.sock"
        a: Agent = agents(g, tmp_path / "s", "--http-socket", str(sock))
        a.wait_converged()
        wait_for(lambda: f"HTTP API on unix:{sock}" in a.log.read_text(), what="the socket")
        assert stat.S_IMODE(sock.stat().st_mode) == 0o666
        vertex = f"http://agent/api/v1/graph/vertices/file[{secret}]"

        def curl(who: str | None, url: str = vertex) -> tuple[str, str]:
            cmd = ["curl", "-gs", "--unix-socket", str(sock), "-w", "\n%{http_code}", url]
            out = subprocess.run(
                as_user(who, *cmd) if who else cmd, capture_output=True, text=True, timeout=30
            ).stdout
            body, _, code = out.rpartition("\n")
            return code, body

        code, body = curl(user)
        assert (code, "top secret" in body) == ("401", False)
        code, body = curl(user, "http://agent/api/v1/graph")
        assert code == "200"
        assert f"file[{secret}]" in body
        code, body = curl(None)
        assert code == "200"
        assert json.loads(body)["params"]["content"] == "top secret 42\n"
        assert a.stop() == 0
        assert not sock.exists()  # removed when the agent stops

    # a file in the way: one line naming the flag, exit 2
    (tmp_path / "plain").write_text("x")
    r = run_cli("run", g, "--state-dir", tmp_path / "s2", "--http-socket", tmp_path / "plain")
    assert r.returncode == 2
    assert "--http-socket" in r.stderr
    assert "is not a socket" in r.stderr
