"""tar: the timeline on real files under the test's tmp dir (apply, an input changed
from outside, the inotify watch rebuilds it, the archive itself damaged and repaired,
a clean re-check, reversal); the archive is deterministic (two archives of the same
inputs are the same bytes, times and owners zero); bad input refused (exit 2), nothing
written."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest

from evergraph.testing.kinds import graph_error
from tests.conftest import Agent, run_cli, wait_for
from tests.kit.kinds import refused_end_to_end


def write_graph(g: Path, body: str) -> Path:
    g.write_text("graph: t\nresources:\n" + body)
    return g


def converge(g: Path, state: Path) -> str:
    r = run_cli("run", g, "--state-dir", state, "--converged-exit")
    assert r.returncode == 0, r.stderr
    return r.stderr


def members(path: Path) -> dict[str, str | bytes]:
    """name -> content (a directory: 'dir', a link: '-> target'), checking the
    deterministic header fields on the way."""
    out: dict[str, str | bytes] = {}
    with tarfile.open(fileobj=io.BytesIO(path.read_bytes())) as t:
        for m in t.getmembers():
            assert (m.mtime, m.uid, m.gid, m.uname, m.gname) == (0, 0, 0, "", "")
            if m.isdir():
                out[m.name] = "dir"
            elif m.issym():
                out[m.name] = "-> " + m.linkname
            else:
                f = t.extractfile(m)
                assert f is not None
                out[m.name] = f.read()
    return out


def make_inputs(tmp: Path) -> tuple[Path, Path, Path]:
    src, site, one = tmp / "src", tmp / "site", tmp / "one.txt"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_bytes(b"a\n")
    (src / "sub" / "b.txt").write_bytes(b"b\n")
    os.chmod(src / "sub" / "b.txt", 0o600)
    (src / "link").symlink_to("a.txt")
    site.mkdir()
    (site / "index.html").write_bytes(b"<p>hi</p>\n")
    one.write_bytes(b"one\n")
    return src, site, one


def test_timeline_apply_input_drift_damage_recheck_reverse(tmp_path: Path, agents) -> None:  # type: ignore[no-untyped-def]
    src, site, one = make_inputs(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    a, b = out / "a.tar", out / "b.tar"
    inputs = f"[{src}/, {site}, {one}]"
    g = write_graph(
        tmp_path / "g.yaml",
        "  tar:\n"
        f"  - {{name: {a}, inputs: {inputs}, meta: {{reverse: true}}}}\n"
        f"  - {{name: twin, path: {b}, inputs: {inputs}, format: 4}}\n",
    )
    agent: Agent = agents(g, tmp_path / "s")
    agent.wait_converged()
    assert members(a) == {
        "a.txt": b"a\n",
        "link": "-> a.txt",
        "sub": "dir",
        "sub/b.txt": b"b\n",
        "site": "dir",
        "site/index.html": b"<p>hi</p>\n",
        "one.txt": b"one\n",
    }
    with tarfile.open(a) as t:
        assert t.getmember("sub/b.txt").mode == 0o600
    assert a.read_bytes() == b.read_bytes()  # deterministic: the same inputs, the same bytes

    # an input changed from outside, deep in a tree: the watch rebuilds both
    (src / "sub" / "b.txt").write_bytes(b"b2\n")
    wait_for(lambda: members(a).get("sub/b.txt") == b"b2\n", what="rebuilt after an input change")
    wait_for(lambda: a.read_bytes() == b.read_bytes(), what="the twin rebuilt the same")
    # a new directory with a file: watched from then on
    (src / "new").mkdir()
    (src / "new" / "c.txt").write_bytes(b"c\n")
    wait_for(lambda: members(a).get("new/c.txt") == b"c\n", what="new file archived")
    (src / "new" / "c.txt").write_bytes(b"c2\n")
    wait_for(lambda: members(a).get("new/c.txt") == b"c2\n", what="the new directory is watched")
    # the archive itself damaged: repaired from the inputs
    wait_for(lambda: a.read_bytes() == b.read_bytes(), what="the twin rebuilt the same")
    good = a.read_bytes()
    a.write_bytes(b"junk")
    wait_for(lambda: a.read_bytes() == good, what="damaged archive repaired")
    assert agent.stop() == 0

    # a re-check: nothing to do (the hashes in the state dir match)
    assert ": applied" not in converge(g, tmp_path / "s")
    # the state lost: the archive is built again, found the same, not written
    ino = a.stat().st_ino
    assert ": applied" not in converge(g, tmp_path / "s2")
    assert a.stat().st_ino == ino

    # reversal: the archive did not exist before, so it goes
    g.write_text("graph: t\nresources: {}\n")
    err = converge(g, tmp_path / "s")
    assert f"tar[{a}]: left the graph: reversed" in err, err
    assert not a.exists()
    assert b.exists()  # no meta.reverse: left


def test_a_missing_input_is_a_failure_naming_it(tmp_path: Path) -> None:
    out = tmp_path / "x.tar"
    g = write_graph(tmp_path / "g.yaml", f"  tar:\n  - {{name: {out}, inputs: [{tmp_path}/no]}}\n")
    r = run_cli("run", g, "--state-dir", tmp_path / "s", "--converged-exit")
    assert r.returncode == 1
    assert f"tar[{out}]: inputs: {tmp_path}/no: no such file or directory" in r.stderr
    assert not out.exists()


BAD_INPUT = [
    ("  tar:\n  - {name: x.tar, inputs: [T/a]}\n", "tar[x.tar].path: 'x.tar' is not an abs"),
    ("  tar:\n  - {name: T/x.tar, inputs: []}\n", "tar[T/x.tar].inputs: is empty"),
    ("  tar:\n  - {name: T/x.tar, inputs: [rel]}\n", "inputs.0: 'rel' is not an absolute"),
    ("  tar:\n  - {name: T/x.tar, inputs: [T/]}\n", "inputs.0: T/ holds the archive"),
    ("  tar:\n  - {name: T/x.tar, inputs: [T/a], format: 3}\n", "format: 3 is not 0"),
    ("  tar:\n  - {name: T/x.tar, input: [T/a]}\n", "input"),
    (
        "  tar:\n  - {name: T/x.tar, inputs: [T/a]}\n  file:\n  - {name: T/x.tar, content: hi}\n",
        "manages content:T/x.tar, as tar[T/x.tar]",
    ),
]


@pytest.mark.parametrize(("body", "needle"), BAD_INPUT)
def test_bad_input_exit_2_nothing_written(tmp_path: Path, body: str, needle: str) -> None:
    (tmp_path / "a").write_text("a\n")
    g = write_graph(tmp_path / "g.yaml", body.replace("T", str(tmp_path)))
    needle = needle.replace("T", str(tmp_path))
    assert needle in graph_error(g)  # as `evergraph check` loads it, in process
    if (body, needle) == BAD_INPUT[0]:  # and one of them end to end: exit 2
        refused_end_to_end(g, needle, tmp_path / "s")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "g.yaml"]
