"""Benchmark: the refresh soak (issue 13). A parent file with a notify edge to a
refresh-only command; each round changes the parent, starts an agent, SIGKILLs it at
a random moment (0.05-0.6 s), then lets a clean run converge. Reported: rounds (kills)
per minute survived, refreshes lost (a round whose change was never followed by the
command) and doubled (followed more than once)."""

from __future__ import annotations

import random
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from bench.common import EVERGRAPH, table, temp_dir_until_exit


def _graph(d: Path, content: str) -> Path:
    g = d / "g.yaml"
    g.write_text(
        "graph: soak\nresources:\n  file:\n"
        f'  - name: conf\n    path: {d / "conf"}\n    content: "{content}\\n"\n'
        "  exec:\n  - name: reload\n    cmd: sh\n"
        f'    args: ["-c", "echo x >> {d / "reloads"}"]\n    refresh_only: true\n'
        "edges:\n"
        "- {from: {kind: file, name: conf}, to: {kind: exec, name: reload}, notify: true}\n"
    )
    return g


def _converge(d: Path, g: Path) -> None:
    subprocess.run(
        [
            EVERGRAPH,
            "run",
            str(g),
            "--state-dir",
            str(d / "s"),
            "--converged-exit",
            "--converged-timeout",
            "0.05",
        ],
        capture_output=True,
        check=True,
        timeout=60,
    )


def _reloads(d: Path) -> int:
    try:
        return len((d / "reloads").read_text().splitlines())
    except FileNotFoundError:
        return 0


def run(quick: bool) -> tuple[dict[str, Any], str]:
    rng = random.Random(3)
    d = temp_dir_until_exit("/var/tmp")
    _converge(d, _graph(d, "v0"))
    rounds = 20 if quick else 100
    lost = doubled = 0
    started = time.perf_counter()
    for i in range(1, rounds + 1):
        g = _graph(d, f"v{i}")
        before = _reloads(d)
        p = subprocess.Popen(
            [EVERGRAPH, "run", str(g), "--state-dir", str(d / "s")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            p.wait(timeout=rng.uniform(0.05, 0.6))
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGKILL)
            p.wait()
        _converge(d, g)
        delta = _reloads(d) - before
        lost += delta < 1
        doubled += delta > 1
    per_min = rounds / (time.perf_counter() - started) * 60
    res = {"rounds": rounds, "kills_per_min": per_min, "lost": lost, "doubled": doubled}
    text = table(
        "Refresh soak: parent changed, agent SIGKILLed at a random moment, clean restart",
        ["rounds", "kills/min", "lost", "doubled"],
        [[str(rounds), f"{per_min:,.0f}", str(lost), str(doubled)]],
    )
    return res, text
