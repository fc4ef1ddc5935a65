"""line: the timeline on a real file (apply, drift from outside, the watch repairs it,
a clean re-check, reversal), the rest of the file kept byte for byte with its mode and
owner; bad input refused (exit 2) with the file untouched. Only files under the test's
tmp dir are touched, so no namespace is needed."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from evergraph.testing.kinds import graph_error
from tests.conftest import Agent, run_cli, wait_for
from tests.kit.kinds import refused_end_to_end

NOBODY = 65534
BEFORE = b"# head\r\nkeep me\nremove me\n\ttabbed  \ntail without newline"


def write_graph(g: Path, body: str) -> Path:
    g.write_text("graph: l\nresources:\n" + body)
    return g


def lines_graph(g: Path, f: Path) -> Path:
    return write_graph(
        g,
        "  line:\n"
        f"  - {{name: add, file: {f}, content: added, meta: {{reverse: true}}}}\n"
        f"  - {{name: rm, file: {f}, content: remove me, state: absent,"
        " meta: {reverse: true}}\n",
    )


def converge(g: Path, state: Path) -> str:
    r = run_cli("run", g, "--state-dir", state, "--converged-exit")
    assert r.returncode == 0, r.stderr
    return r.stderr


def test_timeline_apply_drift_repair_recheck_reverse(tmp_path: Path, agents) -> None:  # type: ignore[no-untyped-def]
    f = tmp_path / "etc" / "app.conf"
    f.parent.mkdir()
    f.write_bytes(BEFORE)
    os.chmod(f, 0o640)
    os.chown(f, NOBODY, NOBODY)
    g = lines_graph(tmp_path / "g.yaml", f)
    want = b"# head\r\nkeep me\n\ttabbed  \ntail without newline\nadded\n"

    agent: Agent = agents(g, tmp_path / "s")
    agent.wait_converged()
    assert f.read_bytes() == want  # everything else byte for byte
    st = f.stat()
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o640, NOBODY, NOBODY)

    # drift from outside, in place (same inode, one write: no half state to see)
    fd = os.open(f, os.O_WRONLY)
    try:
        assert os.pwrite(fd, b"remove me\n", want.index(b"\ttabbed")) == 10
    finally:
        os.close(fd)
    drifted = b"# head\r\nkeep me\ntail without newline\nadded\n"
    wait_for(lambda: f.read_bytes() == drifted, what="in-place drift repaired")
    # drift by replacement (another editor's rename): both repaired
    (tmp_path / "etc" / "new").write_bytes(b"other\nremove me\n")
    os.rename(tmp_path / "etc" / "new", f)
    wait_for(lambda: f.read_bytes() == b"other\nadded\n", what="replaced file repaired")
    assert agent.stop() == 0
    log = agent.log.read_text()
    # each repair is a run started by the watch (nothing polls)
    assert log.count("line[add]: applied") == 2, log
    assert log.count("line[rm]: applied") == 3, log

    # a re-check finds nothing to do
    assert ": applied" not in converge(g, tmp_path / "s")

    # reversal: both leave the graph; the added line goes, the removed one comes back
    g.write_text("graph: l\nresources: {}\n")
    err = converge(g, tmp_path / "s")
    assert "line[add]: left the graph: reversed" in err, err
    assert "line[rm]: left the graph: reversed" in err, err
    assert f.read_bytes() == b"other\nremove me\n"


def test_block_of_lines_missing_file_and_symlink(tmp_path: Path) -> None:
    target = tmp_path / "real"
    target.write_bytes(b"x\na\nb\ny\na\nb\n")
    link = tmp_path / "link"
    link.symlink_to("real")
    new = tmp_path / "new.conf"
    g = write_graph(
        tmp_path / "g.yaml",
        "  line:\n"
        f'  - {{name: blk, file: {link}, content: "a\\nb\\n", state: absent}}\n'
        f"  - {{name: mk, file: {new}, content: first}}\n",
    )
    converge(g, tmp_path / "s")
    assert link.is_symlink()  # the link stays; the file it points to is edited
    assert target.read_bytes() == b"x\ny\n"
    assert new.read_bytes() == b"first\n"
    assert ": applied" not in converge(g, tmp_path / "s")


def test_missing_directory_is_a_failure_naming_it(tmp_path: Path) -> None:
    f = tmp_path / "nodir" / "x"
    g = write_graph(tmp_path / "g.yaml", f"  line:\n  - {{name: l, file: {f}, content: a}}\n")
    r = run_cli("run", g, "--state-dir", tmp_path / "s", "--converged-exit")
    assert r.returncode == 1
    assert f"line[l]: {f}: directory {f.parent} does not exist" in r.stderr


def test_a_file_with_only_mode_and_a_line_share_a_path(tmp_path: Path) -> None:
    f = tmp_path / "shared"
    g = write_graph(
        tmp_path / "g.yaml",
        f"  file:\n  - {{name: {f}, mode: '0600'}}\n"
        f"  line:\n  - {{name: l1, file: {f}, content: one}}\n"
        f"  - {{name: l2, file: {f}, content: two}}\n",
    )
    converge(g, tmp_path / "s")
    assert f.read_bytes() in (b"one\ntwo\n", b"two\none\n")
    assert stat.S_IMODE(f.stat().st_mode) == 0o600


BAD_INPUT = [
    ("  line:\n  - {name: l, file: rel/x, content: a}\n", "line[l].file: 'rel/x' is not an"),
    ("  line:\n  - {name: l, content: a}\n", "line[l].file: is empty"),
    ("  line:\n  - {name: l, file: F, content: ''}\n", "line[l].content: is empty"),
    ("  line:\n  - {name: l, file: F, content: a, state: gone}\n", "line[l].state"),
    ("  line:\n  - {name: l, file: F, contents: a}\n", "contents"),
    (
        "  file:\n  - {name: F, content: whole}\n  line:\n  - {name: l, file: F, content: a}\n",
        "manages a part of content:F, all of which file[F]",
    ),
    (
        "  line:\n  - {name: l, file: F, content: a}\n  file:\n  - {name: F, state: absent}\n",
        "manages all of content:F, a part of which line[l]",
    ),
    (
        "  line:\n  - {name: l, file: F, content: a}\n"
        "  - {name: m, file: F, content: a, state: absent}\n",
        "manages line:F:a, as line[l]",
    ),
]


@pytest.mark.parametrize(("body", "needle"), BAD_INPUT)
def test_bad_input_exit_2_file_untouched(tmp_path: Path, body: str, needle: str) -> None:
    f = tmp_path / "f"
    f.write_bytes(BEFORE)
    g = write_graph(tmp_path / "g.yaml", body.replace("F", str(f)))
    needle = needle.replace("F", str(f))
    assert needle in graph_error(g)  # as `evergraph check` loads it, in process
    if (body, needle) == BAD_INPUT[0]:  # and one of them end to end: exit 2
        refused_end_to_end(g, needle, tmp_path / "s")
    assert f.read_bytes() == BEFORE
