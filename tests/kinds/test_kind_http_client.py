"""http:client: downloads from a real HTTP server on 127.0.0.1 started by the test, to
files under the test's tmp dir: the timeline (apply, the file changed, its mode
changed and removed from outside, the watch repairs each, a clean re-check that
fetches nothing, reversal); a download with another hash fails and leaves the file as
it was; without sha256 the last download is kept; bad input refused (exit 2), nothing
written."""

from __future__ import annotations

import hashlib
import http.server
import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from evergraph.testing.kinds import graph_error
from tests.conftest import Agent, run_cli, wait_for
from tests.kit.kinds import refused_end_to_end

PAYLOAD = bytes(range(256)) * 64 + b"\0end"  # binary, 16 KiB and a bit
SHA = hashlib.sha256(PAYLOAD).hexdigest()


class Server:
    """http.server in a thread, serving `root`; counts the GETs of each path."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.gets: dict[str, int] = {}
        self.posts: dict[str, int] = {}
        self.post_bodies: list[bytes] = []
        server = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
                super().__init__(*args, directory=str(root), **kwargs)

            def do_GET(self) -> None:
                server.gets[self.path] = server.gets.get(self.path, 0) + 1
                super().do_GET()

            def do_POST(self) -> None:
                # what a POST answers: the path's `.post` file, if there is one
                server.posts[self.path] = server.posts.get(self.path, 0) + 1
                length = int(self.headers.get("Content-Length") or 0)
                server.post_bodies.append(self.rfile.read(length))
                page = root / (self.path.lstrip("/") + ".post")
                if not page.is_file():
                    self.send_error(405)
                    return
                body = page.read_bytes()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(10)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    root = tmp_path / "www"
    root.mkdir()
    (root / "app.bin").write_bytes(PAYLOAD)
    s = Server(root)
    yield s
    s.stop()


def write_graph(g: Path, body: str) -> Path:
    g.write_text("graph: h\nresources:\n  http:client:\n" + body)
    return g


def converge(g: Path, state: Path, code: int = 0) -> str:
    r = run_cli("run", g, "--state-dir", state, "--converged-exit")
    assert r.returncode == code, r.stderr
    return r.stderr


def test_timeline_apply_drift_recheck_reverse(tmp_path: Path, server: Server, agents) -> None:  # type: ignore[no-untyped-def]
    f = tmp_path / "dl" / "app.bin"
    f.parent.mkdir()
    g = write_graph(
        tmp_path / "g.yaml",
        f"  - {{name: {f}, url: '{server.url}/app.bin', sha256: {SHA}, mode: '0640',"
        " meta: {reverse: true}}\n",
    )
    agent: Agent = agents(g, tmp_path / "s")
    agent.wait_converged()
    assert f.read_bytes() == PAYLOAD
    assert stat.S_IMODE(f.stat().st_mode) == 0o640
    assert server.gets == {"/app.bin": 1}

    # changed from outside (in place, one write): fetched again
    fd = os.open(f, os.O_WRONLY)
    try:
        os.pwrite(fd, b"X", 10)
    finally:
        os.close(fd)
    wait_for(lambda: f.read_bytes() == PAYLOAD, what="changed file fetched again")
    assert server.gets == {"/app.bin": 2}
    # its mode changed: put back, nothing fetched
    os.chmod(f, 0o666)
    wait_for(lambda: stat.S_IMODE(f.stat().st_mode) == 0o640, what="mode repaired")
    # removed: fetched again
    f.unlink()
    wait_for(f.exists, what="removed file fetched again")
    wait_for(lambda: f.read_bytes() == PAYLOAD, what="complete")
    assert agent.stop() == 0
    assert server.gets == {"/app.bin": 3}

    # a re-check: the hash matches, nothing to do, nothing fetched
    assert ": applied" not in converge(g, tmp_path / "s")
    assert server.gets == {"/app.bin": 3}

    # reversal: the file did not exist before, so it goes
    g.write_text("graph: h\nresources: {}\n")
    err = converge(g, tmp_path / "s")
    assert f"http:client[{f}]: left the graph: reversed" in err, err
    assert not f.exists()


def test_a_wrong_hash_fails_and_leaves_the_file(tmp_path: Path, server: Server) -> None:
    f = tmp_path / "app.bin"
    f.write_bytes(b"old\n")
    ino = f.stat().st_ino
    other = hashlib.sha256(b"something else").hexdigest()
    g = write_graph(
        tmp_path / "g.yaml",
        f"  - {{name: x, file: {f}, url: '{server.url}/app.bin', sha256: {other}}}\n",
    )
    err = converge(g, tmp_path / "s", code=1)
    assert f"the download's sha256 is {SHA}, not {other}: {f} left as it was" in err, err
    assert f.read_bytes() == b"old\n"
    assert f.stat().st_ino == ino
    assert [p.name for p in (tmp_path / "s").rglob("*.tmp")] == []  # the download is gone


def test_http_errors_name_the_url(tmp_path: Path, server: Server) -> None:
    f = tmp_path / "x"
    g = write_graph(tmp_path / "g.yaml", f"  - {{name: {f}, url: '{server.url}/missing'}}\n")
    err = converge(g, tmp_path / "s", code=1)
    assert f"GET {server.url}/missing: 404 File not found" in err, err
    assert not f.exists()


def test_without_sha256_the_last_download_is_kept(tmp_path: Path, server: Server) -> None:
    f = tmp_path / "app.bin"
    g = write_graph(tmp_path / "g.yaml", f"  - {{name: {f}, url: '{server.url}/app.bin'}}\n")
    converge(g, tmp_path / "s")
    assert f.read_bytes() == PAYLOAD
    assert ": applied" not in converge(g, tmp_path / "s")  # matches what was downloaded
    assert server.gets == {"/app.bin": 1}
    f.write_bytes(b"drift")
    assert f"http:client[{f}]: applied" in converge(g, tmp_path / "s")
    assert f.read_bytes() == PAYLOAD
    # the state lost, the file right: fetched once to compare, not rewritten
    ino = f.stat().st_ino
    assert ": applied" not in converge(g, tmp_path / "s2")
    assert f.stat().st_ino == ino


def test_method_post_fetches_what_a_post_answers(tmp_path: Path, server: Server) -> None:
    (server.root / "gen.post").write_bytes(b"made by POST\n")
    (server.root / "gen").write_bytes(b"made by GET\n")
    f = tmp_path / "gen"
    g = write_graph(
        tmp_path / "g.yaml", f"  - {{name: {f}, url: '{server.url}/gen', method: POST}}\n"
    )
    converge(g, tmp_path / "s")
    assert f.read_bytes() == b"made by POST\n"
    assert server.posts == {"/gen": 1}
    assert server.gets == {}
    assert server.post_bodies == [b""]  # no body: the answer is the content
    assert ": applied" not in converge(g, tmp_path / "s")  # kept: nothing fetched again
    assert server.posts == {"/gen": 1}
    # the method is part of what was downloaded: GET now is another download
    g.write_text(g.read_text().replace("method: POST", "method: get"))
    assert f"http:client[{f}]: applied" in converge(g, tmp_path / "s")
    assert f.read_bytes() == b"made by GET\n"
    assert server.gets == {"/gen": 1}
    # errors name the method
    g.write_text(g.read_text().replace("method: get", "method: post").replace("/gen", "/nope"))
    err = converge(g, tmp_path / "s", code=1)
    assert f"POST {server.url}/nope: 405" in err, err


BAD_INPUT = [
    # (lower case: every capital T is the tmp dir here)
    ("  - {name: T/f, url: 'http://h/x', method: head}\n", "http:client[T/f].method: 'head'"),
    ("  - {name: T/f, url: 'http://h/x', method: delete}\n", ".method: 'delete' is not"),
    ("  - {name: T/f, url: 'http://h/x', method: put}\n", ".method: 'put' is not"),
    ("  - {name: T/f, url: 'http://h/x', method: ''}\n", ".method: '' is not"),
    ("  - {name: T/f, url: 'http://h/x', method: 'get /'}\n", ".method: 'get /' is not"),
    ("  - {name: dl, url: 'http://h/x'}\n", "http:client[dl].file: is empty"),
    ("  - {name: T/f, url: 'ftp://h/x'}\n", ".url: 'ftp://h/x' is not an http(s)://"),
    ("  - {name: T/f}\n", ".url: is empty"),
    ("  - {name: T/f, url: 'http://h/x', sha256: abc}\n", ".sha256: 'abc' is not 64"),
    ("  - {name: T/f, url: 'http://h/x', mode: '999'}\n", ".mode: '999'"),
    ("  - {name: x, file: rel, url: 'http://h/x'}\n", ".file: 'rel' is not an absolute"),
    ("  - {name: T/f, url: 'http://h/x', longpoll: true}\n", "longpoll"),
    (
        "  - {name: T/f, url: 'http://h/x'}\n  file:\n  - {name: T/f, content: hi}\n",
        "manages content:T/f, as http:client[T/f]",
    ),
]


@pytest.mark.parametrize(("body", "needle"), BAD_INPUT)
def test_bad_input_exit_2_nothing_written(tmp_path: Path, body: str, needle: str) -> None:
    g = tmp_path / "g.yaml"
    write_graph(g, body.replace("T", str(tmp_path)))
    needle = needle.replace("T", str(tmp_path))
    assert needle in graph_error(g)  # as `evergraph check` loads it, in process
    if (body, needle) == BAD_INPUT[0]:  # and one of them end to end: exit 2
        refused_end_to_end(g, needle, tmp_path / "s", one_line=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.yaml"]
