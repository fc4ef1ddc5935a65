"""Secrets stay secret whichever resource receives them (issue 13, item 4).

A `password` marks what it sends as a secret; every test learns the generated
password by opening its sealed state file with the agent's host key, then
looks for it where it must not be: log lines (text and JSON), error messages,
the status view, the World, `reversal.json`, a file's mode, `ps`.
"""

from __future__ import annotations

import json
import stat
import subprocess
from pathlib import Path
from typing import Any

import httpx

from evergraph.engine.masking import MASK
from evergraph.world.etcd_server import FAST_TIMING, EtcdServer
from tests.conftest import Agent, run_cli
from tests.kit.http import api_url
from tests.kit.passwords import password_of


def edge(to: str, recv: str, sender: str = "p") -> str:
    kind, _, name = to.partition(":")
    return (
        f"- from: {{kind: password, name: {sender}, send: password}}\n"
        f"  to: {{kind: {kind}, name: '{name}', recv: {recv}}}\n"
    )


def run(g: Path, state: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return run_cli("run", g, "--state-dir", state, "--converged-exit", "-vv", *extra)


def world_get(state: Path, key: str) -> str:
    r = run_cli("world", "get", key, "--state-dir", state)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_log_lines_errors_and_the_status_view_mask_it(tmp_path: Path, agents: Any) -> None:
    # print logs what it receives; a command made of it fails and quotes it
    g, state = tmp_path / "g.yaml", tmp_path / "s"
    g.write_text(
        "graph: sec\nresources:\n  password:\n  - {name: p}\n"
        "  print:\n  - {name: show}\n"
        "  exec:\n  - {name: use, shell: /bin/sh, cmd: 'true'}\n"
        "edges:\n" + edge("print:show", "msg") + edge("exec:use", "cmd")
    )
    r = run(g, state)
    assert r.returncode == 1, r.stderr  # exec[use] failed
    password = password_of(state)
    assert password not in r.stderr
    assert f"print[show]: {MASK}" in r.stderr
    assert "exec[use]: cmd exited with status 127" in r.stderr
    assert f"{MASK}: not found" in r.stderr
    # the JSON log format, and the status snapshot the HTTP view serves
    agent: Agent = agents(g, state, "--log-format", "json", "-vv", "--http", "127.0.0.1:0")
    agent.wait_converged()
    with httpx.Client(base_url=api_url(agent), timeout=10) as c:
        vertices = c.get("/api/v1/graph").json()["vertices"]
    [use] = [v for v in vertices if v["ident"] == "exec[use]"]
    assert use["state"] == "failed"
    assert MASK in use["error"]
    assert password not in json.dumps(vertices)
    agent.stop()
    log = agent.log.read_text()
    lines = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    assert any(rec["msg"] == f"print[show]: {MASK}" for rec in lines), log
    assert any("exec[use]: cmd exited with status 127" in rec["msg"] for rec in lines), log
    assert password not in log


def test_a_file_receiving_it_without_mode_is_0600(tmp_path: Path) -> None:
    g, state, out, old = tmp_path / "g.yaml", tmp_path / "s", tmp_path / "pw", tmp_path / "old"
    old.write_text("an older file\n")
    old.chmod(0o644)
    g.write_text(
        "graph: sec\nresources:\n  password:\n  - {name: p}\n"
        f"  file:\n  - {{name: {out}}}\n  - {{name: {old}}}\n"
        "edges:\n" + edge(f"file:{out}", "content") + edge(f"file:{old}", "content")
    )
    r = run(g, state)
    assert r.returncode == 0, r.stderr
    password = password_of(state)
    for f in (out, old):  # created private, and an existing file made private
        assert f.read_text() == password
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f


def test_kv_stores_it_sealed_and_reads_it_back_on_this_host(tmp_path: Path) -> None:
    g, state = tmp_path / "g.yaml", tmp_path / "s"
    g.write_text(
        "graph: sec\nresources:\n  password:\n  - {name: p}\n"
        "  kv:\n  - {name: db, value: ''}\n"
        "edges:\n" + edge("kv:db", "value")
    )
    r = run(g, state)
    assert r.returncode == 0, r.stderr
    password = password_of(state)
    stored = world_get(state, "kv/db")
    assert stored.startswith("sealed:local:"), stored  # marked: readers know
    assert password not in stored
    for f in state.glob("world.sqlite*"):
        assert password.encode() not in f.read_bytes(), f
    assert password not in r.stderr
    # a second run finds the sealed value equal to the secret: clean
    r = run(g, state)
    assert r.returncode == 0, r.stderr
    assert "kv[db]: applied" not in r.stderr
    # read back on this host: the secret again, and still a secret (file 0600)
    back = tmp_path / "back"
    g.write_text(
        f"graph: back\nresources:\n  kv:\n  - {{name: db, readonly: true}}\n"
        f"  file:\n  - {{name: {back}}}\n"
        f"edges:\n- from: {{kind: kv, name: db, send: value}}\n"
        f"  to: {{kind: file, name: {back}, recv: content}}\n"
    )
    r = run(g, state)
    assert r.returncode == 0, r.stderr
    assert back.read_text() == password
    assert stat.S_IMODE(back.stat().st_mode) == 0o600
    assert password not in r.stderr


def test_reversal_of_a_receiver_is_sealed(tmp_path: Path) -> None:
    g, state, out = tmp_path / "g.yaml", tmp_path / "s", tmp_path / "pw"
    spec = f"  file:\n  - {{name: {out}, mode: '0640'{{meta}}}}\n"

    def graph(sender: str, with_file: bool = True, meta: str = "") -> None:
        body = spec.replace("{meta}", meta) + "edges:\n" + edge(f"file:{out}", "content", sender)
        g.write_text(
            f"graph: sec\nresources:\n  password:\n  - {{name: {sender}, length: 20}}\n"
            + (body if with_file else "")
        )

    graph("p")
    r = run(g, state)
    assert r.returncode == 0, r.stderr
    first = password_of(state, "p")
    # another password replaces it, reversibly: what it restores is the first one
    graph("q", meta=", meta: {reverse: true}")
    r = run(g, state)
    assert r.returncode == 0, r.stderr
    second = password_of(state, "q")
    assert out.read_text() == second
    [reversal] = state.rglob("reversal.json")
    data = reversal.read_bytes()
    assert first.encode() not in data
    assert second.encode() not in data
    assert set(json.loads(data)) == {"sealed"}
    # the file leaves the graph: the first password comes back, never shown
    graph("q", with_file=False)
    r = run(g, state)
    assert r.returncode == 0, r.stderr
    assert f"file[{out}]: left the graph: reversed" in r.stderr
    assert out.read_text() == first
    assert stat.S_IMODE(out.stat().st_mode) == 0o640
    assert not list(state.rglob("reversal.json"))
    assert first not in r.stderr
    assert second not in r.stderr


def _etcd_with_auth(shm: Path, servers: list[EtcdServer], password: str) -> str:
    server = EtcdServer(shm / "data", timing=FAST_TIMING, extra_args=["--bcrypt-cost=4"])
    servers.append(server)
    server.start()
    ctl = ["etcdctl", f"--endpoints={server.client_url}"]
    for args in (
        ["user", "add", "root", f"--new-user-password={password}", "--interactive=false"],
        ["user", "grant-role", "root", "root"],
        ["auth", "enable"],
    ):
        r = subprocess.run(
            ctl + args, capture_output=True, text=True, env={"ETCDCTL_API": "3"}, timeout=30
        )
        assert r.returncode == 0, r.stderr
    return server.client_url


def test_the_etcd_password_is_not_on_the_command_line(
    tmp_path: Path, shm: Path, servers: list[EtcdServer], agents: Any, monkeypatch: Any
) -> None:
    secret = "etcd-s3cret-7f2c"
    url = _etcd_with_auth(shm, servers, secret)
    pw_file = tmp_path / "etcd.pass"
    pw_file.write_text(secret + "\n")
    pw_file.chmod(0o600)
    env_out = tmp_path / "env.txt"
    g = tmp_path / "g.yaml"
    # the exec writes the environment its commands get
    g.write_text(
        "graph: e\nresources:\n  kv:\n  - {name: k, value: v}\n"
        f"  exec:\n  - {{name: env, shell: /bin/sh, cmd: 'env > {env_out}', creates: {env_out}}}\n"
    )
    world = ("--seeds", url, "--etcd-user", "root")
    # from a file
    agent: Agent = agents(g, tmp_path / "s1", *world, "--etcd-password-file", pw_file)
    agent.wait_converged()
    cmdline = Path(f"/proc/{agent.proc.pid}/cmdline").read_bytes()
    assert str(pw_file).encode() in cmdline
    assert secret.encode() not in cmdline
    assert agent.stop() == 0
    assert secret not in agent.log.read_text()
    # from the environment: not on the command line, not handed to the commands it runs
    env_out.unlink()
    monkeypatch.setenv("EVERGRAPH_ETCD_PASSWORD", secret)
    agent = agents(g, tmp_path / "s2", *world, "--hostname", "other")
    agent.wait_converged()
    assert secret.encode() not in Path(f"/proc/{agent.proc.pid}/cmdline").read_bytes()
    assert agent.stop() == 0
    assert "EVERGRAPH_ETCD_PASSWORD" not in env_out.read_text()
    monkeypatch.delenv("EVERGRAPH_ETCD_PASSWORD")
    r = run_cli("world", "get", "kv/k", "--state-dir", tmp_path / "s1", *world)
    assert r.returncode != 0  # no password at all: refused by etcd
    # the flag still works, with a warning; the flag and the file together are refused
    r = run_cli("world", "get", "kv/k", "--state-dir", tmp_path / "s1", *world,
                "--etcd-password", secret)  # fmt: skip
    assert (r.returncode, r.stdout) == (0, "v\n"), r.stderr
    assert "warning: --etcd-password is visible to every user of this host" in r.stderr
    r = run_cli("world", "get", "kv/k", "--state-dir", tmp_path / "s1", *world,
                "--etcd-password", secret, "--etcd-password-file", pw_file)  # fmt: skip
    assert r.returncode == 2
    assert "not both" in r.stderr
