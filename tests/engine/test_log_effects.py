"""The log survives kill -9 (issue 23 item 4): a change applied and a command run are
written through to the log before the agent goes on to its next effect, while other
lines stay buffered (a first apply of 10k files must not pay a write per line it
does not need). Killed at the N-th effect's log line (a named crash point), the log
on disk holds all N."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from tests.conftest import EVERGRAPH


def _run_until_crash(tmp: Path, graph: Path, nth: int) -> str:
    log = tmp / "agent.log"
    with open(log, "w") as out:  # a file, not a terminal: the buffered handler
        proc = subprocess.run(
            [*EVERGRAPH, "run", str(graph), "--state-dir", str(tmp / "s"), "--converged-exit"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "EVERGRAPH_CRASH_AT": f"effect-logged:{nth}"},
            timeout=60,
        )
    assert proc.returncode == -signal.SIGKILL
    return log.read_text()


@pytest.mark.parametrize("nth", [1, 7, 25])
def test_every_command_run_is_in_the_log_after_kill_9(tmp_path: Path, nth: int) -> None:
    g = tmp_path / "g.yaml"
    body = "".join(
        f"  - name: c{i}\n    shell: /bin/sh\n    cmd: echo {i} >> {tmp_path}/ran\n"
        for i in range(40)
    )
    g.write_text(f"graph: burst\nresources:\n  exec:\n{body}")
    text = _run_until_crash(tmp_path, g, nth)
    effects = re.findall(r"exec\[c\d+\]: (ran|applied)", text)
    assert len(effects) >= nth, text
    # each command logged as run did run
    ran = set(re.findall(r"exec\[c(\d+)\]: ran ", text))
    done = set((tmp_path / "ran").read_text().split())
    assert ran <= done


def test_every_file_applied_is_in_the_log_after_kill_9(tmp_path: Path) -> None:
    g = tmp_path / "g.yaml"
    body = "".join(
        f"  - name: f{i}\n    path: {tmp_path}/out/f{i}\n    content: x\n" for i in range(60)
    )
    g.write_text(f"graph: files\nresources:\n  file:\n{body}")
    text = _run_until_crash(tmp_path, g, 30)
    assert len(re.findall(r"file\[f\d+\]: applied", text)) >= 30, text
