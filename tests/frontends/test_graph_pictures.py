"""`evergraph graph --format dot|svg|png|json [-o FILE]` and `run --graphviz FILE`:
pictures drawn by the real Graphviz `dot`, files replaced atomically, a live edit
of the graph redrawn."""

from __future__ import annotations

import json
import os
import pty
import shutil
import subprocess
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import EVERGRAPH, Agent, run_cli, wait_for

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SVG = "{http://www.w3.org/2000/svg}"

GRAPH = """\
graph: pictures
resources:
  exec:
  - name: make
    cmd: "echo hi"
  file:
  - name: out
    path: {out}
  noop:
  - name: after
edges:
- {{from: {{kind: exec, name: make, send: output}}, to: {{kind: file, name: out, recv: content}},
   notify: true}}
- {{from: {{kind: file, name: out}}, to: {{kind: noop, name: after}}}}
"""

needs_dot = pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz is not installed")


@pytest.fixture
def graph_file(tmp_path: Path) -> Path:
    f = tmp_path / "site.yaml"
    f.write_text(GRAPH.format(out=tmp_path / "never-written"))
    return f


def one_line_error(r: subprocess.CompletedProcess[str], status: int, needle: str) -> str:
    assert r.returncode == status, (r.returncode, r.stderr)
    err = r.stderr.strip()
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    assert needle in err, err
    return err


def test_dot_labels_notify_and_send_on_one_edge(graph_file: Path) -> None:
    r = run_cli("graph", graph_file)
    assert r.returncode == 0, r.stderr
    edge = next(line for line in r.stdout.splitlines() if '"exec[make]" -> "file[out]"' in line)
    # one label with both facts: a second `label=` would hide the first
    assert edge.count("label=") == 1, edge
    assert 'label="notify\\noutput -> content"' in edge, edge


@needs_dot
def test_svg_to_stdout_is_a_drawing_of_every_vertex_and_edge(graph_file: Path) -> None:
    r = run_cli("graph", graph_file, "--format", "svg")
    assert r.returncode == 0, r.stderr
    root = ET.fromstring(r.stdout)
    assert root.tag == f"{SVG}svg"
    titles = {t.text for t in root.iter(f"{SVG}title")}
    assert {"exec[make]", "file[out]", "noop[after]"} <= titles, titles
    # dot names an edge's group `from->to`
    assert {"exec[make]->file[out]", "file[out]->noop[after]"} <= titles, titles
    texts = {t.text for t in root.iter(f"{SVG}text")}
    assert {"notify", "output -> content"} <= texts, texts


@needs_dot
def test_png_to_a_file_is_written_atomically_and_readable(graph_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "pictures" / "site.png"
    out.parent.mkdir()
    out.write_bytes(b"an older picture")
    before = out.stat().st_ino
    r = run_cli("graph", graph_file, "--format", "png", "-o", out)
    assert r.returncode == 0, r.stderr
    assert r.stdout == ""
    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC)
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width > 100, width
    assert height > 10, height
    # replaced by a rename (a reader never sees half a picture), nothing left behind
    assert out.stat().st_ino != before
    assert sorted(p.name for p in out.parent.iterdir()) == ["site.png"]
    assert out.stat().st_mode & 0o777 == 0o644


@needs_dot
def test_png_to_a_pipe_is_fine_but_a_terminal_is_refused(graph_file: Path) -> None:
    piped = subprocess.run(
        [*EVERGRAPH, "graph", str(graph_file), "--format", "png"], capture_output=True, timeout=60
    )
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout.startswith(PNG_MAGIC)

    master, slave = pty.openpty()
    try:
        proc = subprocess.run(
            [*EVERGRAPH, "graph", str(graph_file), "--format", "png"],
            stdout=slave,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
        os.set_blocking(master, False)
        try:
            on_terminal = os.read(master, 4096)
        except (BlockingIOError, OSError):
            on_terminal = b""
    finally:
        os.close(slave)
        os.close(master)
    assert on_terminal == b""
    one_line_error(proc, 2, "png is binary")
    assert "-o FILE.png" in proc.stderr


@needs_dot
def test_every_format_to_output_equals_stdout(graph_file: Path, tmp_path: Path) -> None:
    # the command's output, not the process's: in process (the executable's own are
    # run by the tests around this one)
    from click.testing import CliRunner

    from evergraph.cli.main import cli

    for fmt in ("dot", "json", "svg"):
        out = tmp_path / f"g.{fmt}"
        r = CliRunner().invoke(cli, ["graph", str(graph_file), "--format", fmt, "--output", out])
        assert r.exit_code == 0, (r.output, r.exception)
        to_stdout = CliRunner().invoke(cli, ["graph", str(graph_file), "--format", fmt])
        assert to_stdout.exit_code == 0, (to_stdout.output, to_stdout.exception)
        assert out.read_text() == to_stdout.stdout
    assert json.loads((tmp_path / "g.json").read_text())["graph"] == "pictures"


def test_without_graphviz_one_line_names_the_package(graph_file: Path, tmp_path: Path) -> None:
    empty = tmp_path / "empty-path"
    empty.mkdir()
    out = tmp_path / "g.svg"
    r = subprocess.run(
        [*EVERGRAPH, "graph", str(graph_file), "--format", "svg", "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PATH": str(empty)},
    )
    err = one_line_error(r, 1, "install the graphviz package")
    assert "`dot`" in err
    assert not out.exists()
    # dot and json need no Graphviz
    r = subprocess.run(
        [*EVERGRAPH, "graph", str(graph_file), "--format", "dot"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PATH": str(empty)},
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith('digraph "pictures"'), r.stdout


def test_output_into_a_missing_directory_is_bad_input(graph_file: Path, tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such"
    r = run_cli("graph", graph_file, "-o", missing / "g.dot")
    one_line_error(r, 2, f"--output: no such directory: {missing}")
    assert not (tmp_path / "no").exists()


def test_bad_graph_is_exit_2_before_any_drawing(tmp_path: Path) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text('graph: g\nresources:\n  file:\n  - name: /a\n    mode: "899"\n')
    out = tmp_path / "g.png"
    r = run_cli("graph", f, "--format", "png", "-o", out)
    one_line_error(r, 2, f"{f}:5:11: file[/a].mode")
    assert not out.exists()


def test_run_graphviz_is_redrawn_on_every_live_edit(
    tmp_path: Path, agents: Callable[..., Agent]
) -> None:
    f = tmp_path / "live.yaml"
    f.write_text("graph: live\nresources:\n  noop:\n  - name: first\n")
    picture = tmp_path / "out" / "live.dot"
    a = agents(f, tmp_path / "state", "--graphviz", str(picture), "--world", "memory")
    a.wait_converged(1)
    first = picture.read_text()
    assert '"noop[first]"' in first, first
    assert "second" not in first, first
    inode = picture.stat().st_ino

    f.write_text(
        "graph: live\nresources:\n  noop:\n  - name: first\n  - name: second\n"
        "edges:\n- {from: {kind: noop, name: first}, to: {kind: noop, name: second}}\n"
    )
    wait_for(lambda: '"noop[second]"' in picture.read_text(), what="the redrawn graph")
    second = picture.read_text()
    assert '"noop[first]" -> "noop[second]";' in second, second
    assert picture.stat().st_ino != inode, "replaced by a rename, not rewritten in place"

    f.write_text("graph: live\nresources:\n  noop:\n  - name: third\n")
    wait_for(lambda: '"noop[third]"' in picture.read_text(), what="the second redraw")
    third = picture.read_text()
    assert "first" not in third, third
    assert "second" not in third, third
    assert sorted(p.name for p in picture.parent.iterdir()) == ["live.dot"]
    assert a.stop() == 0
