"""A seeded fuzz of the agent's HTTP API (issue 23): 1,000 requests with random
methods, paths, headers and bodies, some malformed on the wire. No answer is a
5xx (503 under load is allowed), the log holds no traceback, and the agent's
event loop never stalls 100 ms or more on their account (its own stall metric)."""

from __future__ import annotations

import contextlib
import random
import re
import socket
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import Agent
from tests.kit.http import api_url

ROUTES = [
    "/",
    "/healthz",
    "/metrics",
    "/api/v1/graph",
    "/api/v1/graph/vertices/file[x]",
    "/api/v1/reqs/",
    "/api/v1/reqs/list",
    "/api/v1/reqs/1",
    "/api/v1/reqs/1/close",
    "/api/v1/reqs/1/prolong",
    "/api/v1/reqs/999999999999999999999",
    "/api/v1/workers/",
    "/api/v1/workers/list",
    "/api/v1/workers/00000000-0000-0000-0000-000000000000",
    "/api/v1/workers/x/setstate",
    "/api/v1/workers/x/setgroups",
    "/api/v1/workers/x/deregister",
    "/api/v1/version",
    "/api/v1/openapi.json",
    "/api/reqs/",
    "/static/../../etc/passwd",
]
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]


def _body(rng: random.Random) -> bytes:
    pick = rng.randrange(9)
    if pick == 0:
        return b""
    if pick == 1:
        return rng.randbytes(rng.randrange(1, 4096))
    if pick == 2:
        d = rng.randrange(1, 300)
        return b'{"a":' * d + b"1" + b"}" * d
    if pick == 3:
        return b"[" * rng.randrange(1, 5000)
    if pick == 4:
        return b'{"Priority": %d, "Caps": {"a": "%s"}}' % (
            rng.randrange(-5, 40),
            rng.choice([b"x", b"1-2", b">=3", b"\xff\xfe", b"a" * 3000]),
        )
    if pick == 5:
        return b'{"Priority": 4, "Deadline": "%s"}' % rng.choice(
            [b"2000-01-01T00:00:00Z", b"garbage", b"9999-99-99T99:99:99Z", b""]
        )
    if pick == 6:
        return b'{"Filter": {"State": "%s"}, "Paginator": {"Limit": %d}}' % (
            rng.choice([b"WAITING", b"IN PROGRESS", b"x" * 100]),
            rng.randrange(-10, 10**6),
        )
    if pick == 7:
        return b'"' + b"\\u" * rng.randrange(1, 2000) + b'"'
    return b"x" * rng.randrange(100_000, 300_000)


def _headers(rng: random.Random) -> dict[str, str]:
    h: dict[str, str] = {}
    if rng.random() < 0.5:
        h["Authorization"] = rng.choice(
            ["Bearer egt_" + "x" * 43, "Bearer egt_", "Basic Zm9vOmJhcg==", "Bearer " + "a" * 300]
        )
    if rng.random() < 0.5:
        h["Content-Type"] = rng.choice(["application/json", "text/plain", "x/y; charset=zz"])
    if rng.random() < 0.1:
        h["X-Big"] = "v" * rng.randrange(1000, 8000)
    if rng.random() < 0.1:
        h["Accept"] = rng.choice(["text/event-stream", "application/openmetrics-text", "*/*"])
    return h


def _raw(host: str, port: int, data: bytes) -> bytes:
    with socket.create_connection((host, port), timeout=5) as s:
        with contextlib.suppress(OSError):
            s.sendall(data)
        out = b""
        with contextlib.suppress(OSError, TimeoutError):
            while chunk := s.recv(65536):
                out += chunk
                if len(out) > 1 << 16:
                    break
        return out


RAW = [
    b"GET / HTTP/1.1\r\n\r\n",  # no Host
    b"GARBAGE\r\n\r\n",
    b"GET /healthz HTTP/9.9\r\nHost: x\r\n\r\n",
    b"POST /api/v1/reqs/ HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
    b"POST /api/v1/reqs/ HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
    b"POST /api/v1/reqs/ HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"GET /" + b"a" * 20000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: x\r\n" + b"X: y\r\n" * 3000 + b"\r\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64,  # a TLS hello
]


@pytest.mark.slow
def test_a_thousand_random_requests_no_5xx_no_traceback_no_stall(
    tmp_path: Path, agents: Any
) -> None:
    g = tmp_path / "g.yaml"
    g.write_text(f"graph: h\nresources:\n  file:\n  - name: {tmp_path / 'f'}\n    content: x\n")
    a: Agent = agents(g, tmp_path / "s", "--http", "127.0.0.1:0", "--farm-anonymous", "lab")
    a.wait_converged()
    url = api_url(a)
    host, port = url.removeprefix("http://").rsplit(":", 1)
    rng = random.Random(23)
    statuses: dict[int, int] = {}
    with httpx.Client(base_url=url, timeout=3) as c:
        for i in range(1000):
            if i % 50 == 0:
                answer = _raw(host, int(port), RAW[(i // 50) % len(RAW)])
                assert not answer.startswith(b"HTTP/1.1 5"), answer[:200]
                continue
            path = rng.choice(ROUTES)
            if rng.random() < 0.2:
                path += rng.choice(["?x=1", "/../x", "%00", "%ff", "?after=-1", "?after=abc"])
            try:
                r = c.request(rng.choice(METHODS), path, content=_body(rng), headers=_headers(rng))
            except httpx.TimeoutException:  # a request that waits (acquire): fine
                continue
            except httpx.RemoteProtocolError:  # closed on us (over a limit): fine
                continue
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert r.status_code < 500 or r.status_code == 503, (path, r.status_code, r.text)
        metrics = c.get("/metrics").text
    assert sum(statuses.values()) > 800, statuses
    log = a.log.read_text()
    assert "Traceback" not in log, log[-3000:]
    assert "Exception" not in log, log[-3000:]
    # every stall of the agent's loop (10 ms+ while its thread was busy) was < 100 ms
    count = re.search(r"^evergraph_event_loop_stall_seconds_count (\S+)", metrics, re.M)
    under = re.search(
        r'^evergraph_event_loop_stall_seconds_bucket\{le="0\.1"\} (\S+)', metrics, re.M
    )
    assert count is not None
    assert under is not None
    assert float(under[1]) == float(count[1]), metrics
    assert a.stop() == 0
