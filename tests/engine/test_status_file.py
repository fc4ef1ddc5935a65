"""The converged status file: appended to, never followed through a symlink."""

from __future__ import annotations

import os
from pathlib import Path

from tests.conftest import run_cli


def _graph(tmp_path: Path) -> Path:
    g = tmp_path / "g.yaml"
    g.write_text("graph: g\nresources:\n  noop:\n  - {name: a}\n")
    return g


def test_the_status_file_records_transitions(tmp_path: Path) -> None:
    status = tmp_path / "status"
    r = run_cli(
        "run", _graph(tmp_path), "--state-dir", tmp_path / "s",
        "--converged-exit", "--converged-status-file", status,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert status.read_text() == "false\ntrue\n"


def test_a_symlink_at_the_status_file_is_not_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    status = tmp_path / "status"
    status.symlink_to(victim)
    r = run_cli(
        "run", _graph(tmp_path), "--state-dir", tmp_path / "s",
        "--converged-exit", "--converged-status-file", status,
    )  # fmt: skip
    assert victim.read_text() == "precious\n"
    assert f"cannot write converged status file {status}" in r.stderr
    assert r.returncode == 0, r.stderr  # the run itself is unaffected


def test_a_fifo_at_the_status_file_is_refused_not_blocked_on(tmp_path: Path) -> None:
    status = tmp_path / "status"
    os.mkfifo(status)
    r = run_cli(
        "run", _graph(tmp_path), "--state-dir", tmp_path / "s",
        "--converged-exit", "--converged-status-file", status, timeout=20,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "cannot write converged status file" in r.stderr
