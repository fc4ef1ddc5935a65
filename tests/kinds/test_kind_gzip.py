"""gzip: the timeline on real files under the test's tmp dir, chained after a tar by
an automatic edge (apply, an input changed from outside, the watch compresses again,
the output damaged and repaired, a clean re-check, reversal); deterministic output (no
name, time 0); bad input refused (exit 2), nothing written."""

from __future__ import annotations

import gzip
import io
import tarfile
import zlib
from pathlib import Path

import pytest

from evergraph.testing.kinds import graph_error
from tests.conftest import Agent, run_cli, wait_for
from tests.kit.kinds import refused_end_to_end


def write_graph(g: Path, body: str) -> Path:
    g.write_text("graph: z\nresources:\n" + body)
    return g


def converge(g: Path, state: Path) -> str:
    r = run_cli("run", g, "--state-dir", state, "--converged-exit")
    assert r.returncode == 0, r.stderr
    return r.stderr


def names_in(gz: Path) -> list[str]:
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(gz.read_bytes()))) as t:
        return t.getnames()


def test_timeline_after_a_tar_apply_drift_damage_recheck_reverse(tmp_path: Path, agents) -> None:  # type: ignore[no-untyped-def]
    src = tmp_path / "src"
    src.mkdir()
    (src / "a").write_text("a\n")
    tar, gz, hello = tmp_path / "site.tar", tmp_path / "site.tar.gz", tmp_path / "hello.gz"
    g = write_graph(
        tmp_path / "g.yaml",
        # the gzip comes first in the file: the automatic edge (its input is the
        # tar's path) runs it after the tar
        "  gzip:\n"
        f"  - {{name: {gz}, input: {tar}, level: 9, meta: {{reverse: true}}}}\n"
        f'  - {{name: hello, path: {hello}, content: "hello\\n", level: -2}}\n'
        f"  tar:\n  - {{name: {tar}, inputs: [{src}/]}}\n",
    )
    agent: Agent = agents(g, tmp_path / "s")
    agent.wait_converged()
    assert gzip.decompress(gz.read_bytes()) == tar.read_bytes()
    assert gzip.decompress(hello.read_bytes()) == b"hello\n"
    head = gz.read_bytes()[:10]
    assert head[:4] == b"\x1f\x8b\x08\x00"  # deflate, no flags: no file name in it
    assert head[4:8] == b"\0\0\0\0"  # time 0: the same input gives the same bytes
    z = zlib.compressobj(9, zlib.DEFLATED, 31)
    assert gz.read_bytes() == z.compress(tar.read_bytes()) + z.flush()

    # an input of the tar changed from outside: the tar, then the gzip, are made again
    (src / "b").write_text("b\n")
    wait_for(lambda: names_in(gz) == ["a", "b"], what="gzip follows the tar")
    # the output damaged: repaired
    good = gz.read_bytes()
    gz.write_bytes(good[:20])
    wait_for(lambda: gz.read_bytes() == good, what="damaged gzip repaired")
    assert agent.stop() == 0
    log = agent.log.read_text()
    assert log.index(f"tar[{tar}]: applied") < log.index(f"gzip[{gz}]: applied")

    assert ": applied" not in converge(g, tmp_path / "s")  # a clean re-check
    # another level: compressed again
    g.write_text(g.read_text().replace("level: 9", "level: 1"))
    assert f"gzip[{gz}]: applied" in converge(g, tmp_path / "s")
    assert gzip.decompress(gz.read_bytes()) == tar.read_bytes()
    assert gz.read_bytes() != good

    # reversal: the gzip did not exist before, so it goes
    g.write_text(f"graph: z\nresources:\n  tar:\n  - {{name: {tar}, inputs: [{src}/]}}\n")
    err = converge(g, tmp_path / "s")
    assert f"gzip[{gz}]: left the graph: reversed" in err, err
    assert not gz.exists()
    assert tar.exists()


def test_a_missing_input_is_a_failure_naming_it(tmp_path: Path) -> None:
    out = tmp_path / "x.gz"
    g = write_graph(tmp_path / "g.yaml", f"  gzip:\n  - {{name: {out}, input: {tmp_path}/no}}\n")
    r = run_cli("run", g, "--state-dir", tmp_path / "s", "--converged-exit")
    assert r.returncode == 1
    assert f"gzip[{out}]: input {tmp_path}/no: no such file" in r.stderr
    assert not out.exists()


BAD_INPUT = [
    ("  gzip:\n  - {name: x.gz, content: a}\n", "gzip[x.gz].path: 'x.gz' is not an abs"),
    ("  gzip:\n  - {name: T/x.gz, input: rel}\n", "input: 'rel' is not an absolute"),
    ("  gzip:\n  - {name: T/x.gz, input: T/x.gz}\n", "is the output itself"),
    ("  gzip:\n  - {name: T/x.gz, input: T/a, content: b}\n", "content: cannot be combined"),
    ("  gzip:\n  - {name: T/x.gz, content: a, level: 10}\n", "level: 10 is not between"),
    ("  gzip:\n  - {name: T/x.gz, content: a, compression: 9}\n", "compression"),
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
