"""What the kind tests share: a graph with a bad input refused end to end."""

from __future__ import annotations

from pathlib import Path

from evergraph.testing.kinds import graph_error
from tests.conftest import run_cli


def refused_end_to_end(g: Path, needle: str, state: Path, *, one_line: bool = False) -> None:
    """`evergraph check G` and `evergraph run G` both exit 2, saying `needle`, with
    no traceback (`one_line`: and nothing but one line)."""
    for cmd in (["check", g], ["run", g, "--state-dir", state, "--converged-exit"]):
        r = run_cli(*cmd)
        assert r.returncode == 2, r.stderr
        assert needle in r.stderr, r.stderr
        if one_line:
            assert len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert "Traceback" not in r.stderr


def refused(g: Path, needle: str, where: str = "", *, end_to_end: bool) -> bool:
    """G is refused as `evergraph check` loads it, in process, saying `needle` at
    `where`; with `end_to_end`, `evergraph check G` too exits 2 saying them, with no
    traceback. Returns `end_to_end` (the caller then runs G its own way)."""
    err = graph_error(g)
    assert needle in err, err
    assert where in err, err
    if end_to_end:
        r = run_cli("check", g)
        assert r.returncode == 2, r.stderr
        assert needle in r.stderr, r.stderr
        assert where in r.stderr, r.stderr
        assert "Traceback" not in r.stderr
    return end_to_end
