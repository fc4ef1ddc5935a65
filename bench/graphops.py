"""Graph operations against mgmt 1.1.0's own figures for its Go engine.

- sync: a running engine with 10k noop vertices (a binary tree) swaps to a
  graph where 1 % of the vertices changed a parameter (target <= 16 ms);
- autoedges: 10k files in 100 managed directories (target <= 53 ms);
- autogroup: 1k independent groupable noop vertices (target <= 179 ms); 10k and
  50k (no mgmt figure: targets 10x the 1k one, and "in seconds" for 50k); 10k
  with edges (1,000 chains of 10: they group by depth; mgmt's "chain" figure
  is 460 ms, target 10x the 1k one).

Each is timed in-process (median of several rounds after one warm-up round),
on the library the CLI uses.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import PYTHON, REPO, table, temp_dir, yes_no

TARGETS_MS = {
    "sync 10k, 1% changed": 16.0,
    "autoedges 10k files": 53.0,
    "autogroup 1k": 179.0,
    "autogroup 10k": 1790.0,
    "autogroup 50k": 5000.0,
    "autogroup 10k in chains": 1790.0,
    "50k noops: run converges": 5000.0,
    "50k noops: SIGTERM to exit": 1000.0,
}


def _tree(n: int, changed: set[int]) -> Any:
    from evergraph.engine.model import Edge, GraphModel
    from evergraph.resources.noop import Noop

    m = GraphModel(name="sync")
    for i in range(n):
        m.add(Noop(name=f"n{i}", comment="changed" if i in changed else ""))
    for i in range(1, n):
        m.connect(Edge(f"noop[n{(i - 1) // 2}]", f"noop[n{i}]"))
    return m


async def _sync_rounds(n: int, rounds: int, state: Path) -> list[float]:
    from evergraph.engine.engine import Engine
    from evergraph.engine.settings import Settings

    eng = Engine(Settings(state_dir=state, hostname="bench"))
    task = asyncio.create_task(eng.run(_tree(n, set())))
    while len(eng.vertices) < n or eng._running:  # converged once
        await asyncio.sleep(0.01)
    out = []
    for k in range(rounds + 1):
        model = _tree(n, set(range(k % 100, n, 100)))
        t0 = time.perf_counter()
        await eng.swap(model)
        out.append((time.perf_counter() - t0) * 1000)
        while eng._running:
            await asyncio.sleep(0.005)
    eng.request_stop()
    await task
    return out[1:]


def _autoedges(rounds: int) -> list[float]:
    from evergraph.engine.model import GraphModel
    from evergraph.engine.prepare import prepare
    from evergraph.resources.file import File

    m = GraphModel(name="files")
    for d in range(100):
        m.add(File(name=f"d{d}", path=f"/srv/bench/d{d}/"))
    for i in range(10_000):
        m.add(File(name=f"f{i}", path=f"/srv/bench/d{i // 100}/f{i}.txt"))
    out = []
    for _ in range(rounds + 1):
        m.edges.clear()
        t0 = time.perf_counter()
        prepare(m, autogroup=False)  # as the agent calls it
        out.append((time.perf_counter() - t0) * 1000)
        assert len(m.edges) == 10_000
    return out[1:]


def _autogroup(rounds: int, n: int = 1_000, chain: int = 1) -> list[float]:
    from evergraph.engine.model import Edge, GraphModel
    from evergraph.engine.prepare import prepare
    from evergraph.resources.noop import Noop

    out = []
    for _ in range(rounds + 1):
        m = GraphModel(name="group")
        for i in range(n):
            m.add(Noop(name=f"n{i}"))
            if i % chain:
                m.connect(Edge(f"noop[n{i - 1}]", f"noop[n{i}]"))
        t0 = time.perf_counter()
        prepare(m, autoedges=False)  # as the agent calls it
        out.append((time.perf_counter() - t0) * 1000)
        assert len(m.resources) == chain
    return out[1:]


def _big_run(rounds: int, stop: bool) -> list[float]:
    """A real `evergraph run` of 50k noops (--no-autogroup: 50k vertices): ms from
    start to converged, or from SIGTERM to exit."""
    import os
    import signal

    out = []
    with temp_dir("/var/tmp") as tmp:
        g = tmp / "big.yaml"
        g.write_text(
            "graph: big\nresources:\n  noop:\n"
            + "".join(f"  - {{name: n{i}}}\n" for i in range(50_000))
        )
        for r in range(rounds + 1):
            status = tmp / f"status{r}"
            status.write_text("")
            t0 = time.perf_counter()
            p = subprocess.Popen(
                [PYTHON, "-m", "evergraph.cli.main", "run", str(g), "--world", "memory",
                 "--state-dir", str(tmp / f"s{r}"), "--no-autogroup",
                 "--converged-timeout", "0", "--converged-status-file", str(status)],
                stderr=subprocess.DEVNULL,
            )  # fmt: skip
            while "true" not in status.read_text():
                time.sleep(0.005)
            converged = time.perf_counter()
            os.kill(p.pid, signal.SIGTERM)
            p.wait(timeout=60)
            gone = time.perf_counter()
            out.append(((gone - converged) if stop else (converged - t0)) * 1000)
    return out[1:]


def _child(case: str, rounds: int) -> list[float]:
    if case.startswith("big"):
        return _big_run(rounds, case == "bigstop")
    if case == "sync":
        with temp_dir("/var/tmp") as tmp:
            return asyncio.run(_sync_rounds(10_000, rounds, tmp))
    if case.startswith("autogroup"):
        kind, _, n = case.partition(":")
        return _autogroup(rounds, int(n or 1_000), 10 if kind == "autogroupchains" else 1)
    return _autoedges(rounds)


def run(quick: bool) -> tuple[list[dict[str, Any]], str]:
    rounds = 3 if quick else 9
    measured = {}
    # each case in a fresh process: one case's leftovers must not slow the next
    for case, key in (
        ("sync 10k, 1% changed", "sync"),
        ("autoedges 10k files", "autoedges"),
        ("autogroup 1k", "autogroup"),
        ("autogroup 10k", "autogroup:10000"),
        ("autogroup 50k", "autogroup:50000"),
        ("autogroup 10k in chains", "autogroupchains:10000"),
        ("50k noops: run converges", "bigrun"),
        ("50k noops: SIGTERM to exit", "bigstop"),
    ):
        out = subprocess.run(
            [PYTHON, "-m", "bench.graphops", key, str(rounds)],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        )
        measured[case] = json.loads(out.stdout.strip().splitlines()[-1])
    results, rows = [], []
    for case, samples in measured.items():
        med = statistics.median(samples)
        target = TARGETS_MS[case]
        results.append(
            {
                "case": case,
                "median_ms": med,
                "samples_ms": samples,
                "target_ms": target,
                "met": med <= target,
            }
        )
        rows.append(
            [
                case,
                f"{med:.1f} ms",
                f"{min(samples):.1f} ms",
                f"<= {target:g} ms",
                yes_no(med <= target),
            ]
        )
    text = table(
        "graph operations (in-process; mgmt 1.1.0 Go figures as targets)",
        ["case", "median", "best", "target", "met"],
        rows,
    )
    return results, text


if __name__ == "__main__":
    print(json.dumps(_child(sys.argv[1], int(sys.argv[2]))))
