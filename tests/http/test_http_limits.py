"""What one HTTP client may cost the agent is bounded (issue 23 item 1): big bodies
are refused unread, deep JSON is a 400, idle connections cannot take its
descriptors, and through all of it the agent answers /healthz and repairs drift.
A real agent on loopback, real sockets."""

from __future__ import annotations

import contextlib
import os
import re
import resource
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import Agent, wait_for
from tests.kit.http import api_url


def _start(tmp_path: Path, agents: Any, *extra: str) -> tuple[Agent, str, Path]:
    target = tmp_path / "conf"
    g = tmp_path / "g.yaml"
    g.write_text(f'graph: h\nresources:\n  file:\n  - name: {target}\n    content: "v=1\\n"\n')
    a: Agent = agents(g, tmp_path / "s", "--http", "127.0.0.1:0", *extra)
    a.wait_converged()
    return a, api_url(a), target


def _hostport(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _healthz_answers(url: str) -> None:
    """/healthz answers 200 (a deadline for liveness: an agent held up by the
    clients under test would not answer at all; no timing claim)."""
    r = httpx.get(f"{url}/healthz", timeout=15)
    assert r.status_code == 200


def _answer(sock: socket.socket) -> bytes:
    sock.settimeout(10)
    out = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            out += chunk
    return out


def test_a_huge_declared_body_is_refused_unread(tmp_path: Path, agents: Any) -> None:
    a, url, _ = _start(tmp_path, agents)
    with socket.create_connection(_hostport(url)) as s:
        s.sendall(
            b"POST /api/v1/reqs/ HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000000000\r\n\r\n"
        )
        answer = _answer(s)  # answered, and closed, without a byte of the body
    assert answer.startswith(b"HTTP/1.1 413"), answer
    assert b"at most 1048576 bytes" in answer
    _healthz_answers(url)
    wait_for(lambda: "over 1048576 bytes to /api/v1/reqs/: refused (413)" in a.log.read_text())
    assert "Traceback" not in a.log.read_text()


def test_a_streamed_body_is_cut_at_the_limit(tmp_path: Path, agents: Any) -> None:
    a, url, target = _start(tmp_path, agents, "--http-max-body", "65536")
    chunk = b"x" * 16384
    sent = 0
    with socket.create_connection(_hostport(url)) as s:
        s.sendall(b"POST /api/v1/reqs/ HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            for _ in range(3200):  # 50 MiB, unless the agent stops reading first
                s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                sent += len(chunk)
        answer = _answer(s)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert sent < 50 * 1024 * 1024  # the agent hung up long before the end
    assert _rss_mib(a.proc.pid) < 200
    # and it kept its work: drift is repaired, health answers
    target.write_text("drift\n")
    wait_for(lambda: target.read_text() == "v=1\n", 5, "drift repaired")
    _healthz_answers(url)


@pytest.mark.parametrize("depth", [65, 500, 100_000])
def test_deep_json_is_a_400_not_a_traceback(tmp_path: Path, agents: Any, depth: int) -> None:
    a, url, _ = _start(tmp_path, agents, "--farm-anonymous", "lab")
    body = b"[" * depth + b"]" * depth
    r = httpx.post(f"{url}/api/v1/reqs/", content=body, timeout=10)
    if depth * 2 > 1 << 20:
        assert r.status_code == 413
    else:
        assert r.status_code == 400, r.text
        assert r.json() == {"message": "invalid request: exceeded max depth"}
    _healthz_answers(url)
    assert "Traceback" not in a.log.read_text()


@contextlib.contextmanager
def _nofile(soft: int) -> Iterator[None]:
    old = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, old[1]), old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, old)


def test_1500_idle_connections_take_neither_health_nor_repairs(tmp_path: Path, agents: Any) -> None:
    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 2000:
        pytest.fail("this test needs a hard descriptor limit of 2000 or more")
    with _nofile(1024):  # the agent runs with 1,024 descriptors, as systemd's default
        a, url, target = _start(tmp_path, agents)
    idle: list[socket.socket] = []
    with _nofile(4096):
        try:
            for _ in range(1500):
                s = socket.socket()
                s.setblocking(False)
                with contextlib.suppress(BlockingIOError):
                    s.connect(_hostport(url))
                idle.append(s)
            # the agent keeps answering and repairing while they are held (deadlines
            # for liveness, not timing claims: a full accept backlog costs a SYN
            # retry of a second, and a loaded machine more)
            for i in range(5):
                _healthz_answers(url)
                target.write_text(f"drift {i}\n")
                wait_for(lambda: target.read_text() == "v=1\n", 15, "drift repaired")
            # it holds at most a quarter of its descriptors for clients
            fds = len(os.listdir(f"/proc/{a.proc.pid}/fd"))
            assert fds < 1024 // 4 + 100, fds
        finally:
            for s in idle:
                s.close()
    log = a.log.read_text()
    assert "Traceback" not in log
    assert "too many open files" not in log.lower()
    assert log.count("connections at once: closing idle ones") == 1


def _stalls_over(url: str, seconds: float) -> float:
    """How many of the agent's loop stalls (its own metric) lasted `seconds` or more."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    count = re.search(r"^evergraph_event_loop_stall_seconds_count (\S+)", text, re.M)
    under = re.search(
        rf'^evergraph_event_loop_stall_seconds_bucket\{{le="{seconds}"\}} (\S+)', text, re.M
    )
    assert count is not None
    assert under is not None
    return float(count[1]) - float(under[1])


def test_failed_token_attempts_are_slowed_and_logged_once(tmp_path: Path, agents: Any) -> None:
    a, url, _ = _start(tmp_path, agents)
    with httpx.Client(base_url=url, timeout=10) as c:
        # one token guessed again and again: 401 five times, then 429
        same = {"Authorization": "Bearer egt_" + "a" * 43}
        codes = [c.get("/api/v1/reqs/1", headers=same).status_code for _ in range(7)]
        assert codes == [401] * 5 + [429] * 2, codes
        # many tokens from one address: 429 once it made 30 failed attempts
        codes = [
            c.get("/api/v1/reqs/1", headers={"Authorization": f"Bearer egt_{i:043d}"}).status_code
            for i in range(40)
        ]
        assert codes.count(401) == 30 - 5, codes
        assert codes[-1] == 429
        r = c.get("/api/v1/reqs/1", headers=same)
        wait = re.search(r"try again in (\d+) s", r.json()["message"])
        assert wait is not None
        assert 1 <= int(wait[1]) <= 60
    wait_for(lambda: "failed token attempt from 127.0.0.1" in a.log.read_text())
    log = a.log.read_text()
    assert log.count("failed token attempt from 127.0.0.1") == 1  # once a minute
    assert "egt_" not in log  # never the token


def test_a_large_body_is_parsed_off_the_loop(tmp_path: Path, agents: Any) -> None:
    a, url, target = _start(tmp_path, agents, "--farm-anonymous", "lab")
    big = b'{"Priority": 4, "Caps": {"board": "' + b"x" * 900_000 + b'"}}'
    with httpx.Client(base_url=url, timeout=30) as c:
        for _ in range(3):
            r = c.post("/api/v1/reqs/", content=big)
            assert r.status_code in (201, 400), r.text
        _healthz_answers(url)
    assert _stalls_over(url, 0.1) == 0
    target.write_text("drift\n")
    wait_for(lambda: target.read_text() == "v=1\n", 5, "drift repaired")
    assert "Traceback" not in a.log.read_text()
