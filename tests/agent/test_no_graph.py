"""A graph that never comes: `check` of a Python graph whose graph() never returns
ends with one line naming the file and the timeout (exit 2, within the timeout, on
both the console script's fast path and click's); `run --max-runtime S` that loaded
no graph in S seconds (a graph() that never returns, deploys followed with none
yet) exits 1 saying so, not 0 as if it had converged."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import run_cli

#: the console script's entry (its fast path answers `check FILE` without click)
ENTRY = [sys.executable, "-m", "evergraph.cli.entry"]

SPIN = "def graph(g, world):\n    while True:\n        pass\n"
SLEEP = "import time\n\n\ndef graph(g, world):\n    time.sleep(1e9)\n"


@pytest.mark.parametrize("body", [SPIN, SLEEP], ids=["spin", "sleep"])
def test_check_of_a_graph_that_never_returns_times_out(tmp_path: Path, body: str) -> None:
    site = tmp_path / "site.py"
    site.write_text(body)
    t0 = time.monotonic()
    r = run_cli("check", site, "--timeout", "1", timeout=30)
    took = time.monotonic() - t0
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert str(site) in lines[0], lines
    assert "within 1 s" in lines[0], lines
    assert "--timeout" in lines[0], lines
    assert "Traceback" not in r.stderr
    assert took < 10, took  # the timeout, the start-up, not the graph
    # the console script: `check FILE --timeout S` goes to click as above; `check
    # FILE` alone is its fast path (no click), with the default timeout, shortened here
    fast = (
        "import sys; from evergraph.cli import entry; "
        "entry.load_for_check.__defaults__ = (0.5,); "
        f"sys.argv = ['evergraph', 'check', {str(site)!r}]; entry.main()"
    )
    r = subprocess.run([sys.executable, "-c", fast], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith(f"evergraph: {site}: graph() did not return within 0.5 s"), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_check_timeout_default_and_bad_values(tmp_path: Path) -> None:
    site = tmp_path / "site.py"
    site.write_text("def graph(g, world):\n    g.add('noop', 'a')\n")
    for argv in (["check", str(site)], ["check", str(site), "--timeout", "2"]):
        for cmd in ([sys.executable, "-m", "evergraph.cli.main"], ENTRY):
            r = subprocess.run([*cmd, *argv], capture_output=True, text=True, timeout=30)
            assert r.returncode == 0, r.stderr
            assert "is valid: 1 resources" in r.stdout
    # the values are click's to check (both executables hand `--timeout` to it, as
    # above): in process
    from click.testing import CliRunner

    from evergraph.cli.main import cli

    for bad in ("0", "-1", "nan", "inf", "soon"):
        r = CliRunner().invoke(cli, ["check", str(site), "--timeout", bad])
        assert r.exit_code == 2, r.output
        assert "--timeout" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr, r.stderr
        assert r.exception is None or isinstance(r.exception, SystemExit), r.exception


def test_run_max_runtime_with_no_graph_loaded_exits_1(tmp_path: Path) -> None:
    site = tmp_path / "site.py"
    site.write_text(SLEEP)
    r = run_cli("run", site, "--state-dir", tmp_path / "s", "--max-runtime", "1", timeout=30)
    assert r.returncode == 1, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if "no graph" in ln]
    assert len(lines) == 1, r.stderr
    assert "no graph was loaded in 1 s" in lines[0], r.stderr
    assert "Traceback" not in r.stderr
    # following deploys, none published yet
    r = run_cli("run", "--state-dir", tmp_path / "f", "--max-runtime", "1", timeout=30)
    assert r.returncode == 1, r.stderr
    assert "no graph was loaded in 1 s" in r.stderr, r.stderr


def test_the_wait_for_a_first_graph_counts_from_the_run_s_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`--max-runtime` counts from the command's start, as the CLI's own bound (the
    watchdog, a grace past it) does: a run whose start-up took longer than the limit
    says at once that no graph was loaded, instead of waiting the whole limit again
    (on a loaded machine the watchdog ended it first, with a vaguer line). Here the
    run began 1,000 s before the agent, with a limit of 500 s."""
    from evergraph.agent.api import run

    caplog.set_level(logging.INFO, logger="evergraph")
    t0 = time.monotonic()
    status = run(
        None, state_dir=tmp_path / "f", max_runtime=500.0, _started=t0 - 1000, handle_signals=False
    )
    assert status == 1
    assert time.monotonic() - t0 < 100  # (counted from the agent's own start: 500 s)
    said = [r.getMessage() for r in caplog.records]
    assert any("no graph was loaded in 500 s" in m for m in said), said
