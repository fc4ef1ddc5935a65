"""A 50,000-noop graph, end to end: it converges, keeps running, and SIGTERM ends it
(cleanly, status 0). How fast is measured in `scripts/bench --only graphops`
("50k noops: run converges" and "SIGTERM to exit"), not asserted here; the waits
below are hang guards."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest

from tests.conftest import Agent


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "50k-vertices"])
def test_fifty_thousand_noops_converge_and_stop_on_sigterm(
    tmp_path: Path, agents, grouped: bool
) -> None:  # type: ignore[no-untyped-def]
    g = tmp_path / "big.yaml"
    g.write_text(
        "graph: big\nresources:\n  noop:\n"
        + "".join(f"  - {{name: n{i}}}\n" for i in range(50_000))
    )
    extra = ("--world", "memory", *(() if grouped else ("--no-autogroup",)))
    a: Agent = agents(g, tmp_path / "s", *extra)
    a.wait_converged(timeout=60)
    a.proc.send_signal(signal.SIGTERM)
    try:
        assert a.proc.wait(timeout=10) == 0
    except subprocess.TimeoutExpired:
        pytest.fail("the agent did not stop within 10 s of SIGTERM")
    log = a.log.read_text()
    vertices = 1 if grouped else 50_000
    assert f"graph big loaded: {vertices} vertices" in log
    assert f"converged: {vertices} vertices clean" in log
