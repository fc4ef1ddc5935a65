"""Benchmark 1, engine: converge N noop vertices (chain, fan-out, random DAG) in-process.

Each case runs in a fresh child process (`python -m bench.engine --child ...`)
so that its peak RSS is its own. The child builds the edge list (the input,
as plain ints) first, records ru_maxrss as the baseline, then times building
the `GraphModel` (add, connect, check), then `Engine.run` under asyncio.run,
and reports peak RSS growth per vertex.

The child also reports the longest time the event loop was held during the run
(a 10 ms timer's lateness): `python -m bench.engine --child --impl evergraph
--shape random --n 1000000` measures it at a million vertices.

Floor: the same edges fed to `graphlib.TopologicalSorter`, then a plain loop
calling a no-op function per vertex in its get_ready/done order.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import PYTHON, REPO, fmt_ratio, fmt_s, median, table, temp_dir, yes_no

SHAPES = ("chain", "fanout", "random")
TARGET_S = 5.0
TARGET_KB = 3.0
SEED = 20261122
#: a case that takes longer than this is not repeated
SLOW_S = 20.0


def edges_for(shape: str, n: int) -> list[tuple[int, int]]:
    """(parent, child) pairs, parent < child."""
    if shape == "chain":
        return [(i - 1, i) for i in range(1, n)]
    if shape == "fanout":
        return [(0, i) for i in range(1, n)]
    rng = random.Random(SEED)
    out: list[tuple[int, int]] = []
    for i in range(1, n):
        k = rng.randint(0, min(2, i))
        out.extend((p, i) for p in rng.sample(range(i), k))
    return out


def _maxrss_kb() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux


def child_evergraph(n: int, edges: list[tuple[int, int]], state_dir: str) -> dict[str, Any]:
    import asyncio

    from evergraph.engine.engine import Engine
    from evergraph.engine.model import Edge, GraphModel
    from evergraph.engine.settings import Settings
    from evergraph.resources.noop import Noop

    stall = [0.0]

    async def ticker() -> None:
        # the longest the loop was held during the run, as a 10 ms timer sees it (a
        # World keep-alive every ttl/3 must not wait longer than that, less margin)
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.01)
            now = time.perf_counter()
            stall[0] = max(stall[0], now - last - 0.01)
            last = now

    async def main() -> tuple[float, float, int]:
        t0 = time.perf_counter()
        model = GraphModel(name="bench")
        for i in range(n):
            model.add(Noop(name=f"n{i}"))
        for a, b in edges:
            model.connect(Edge(f"noop[n{a}]", f"noop[n{b}]"))
        model.check()
        engine = Engine(
            Settings(state_dir=Path(state_dir), converged_timeout=0, converged_exit=True)
        )
        t1 = time.perf_counter()
        tick = asyncio.create_task(ticker())
        try:
            rc = await engine.run(model)
        finally:
            tick.cancel()
        t2 = time.perf_counter()
        clean = sum(1 for v in engine.vertices.values() if v.ok)
        if rc != 0 or clean != n:
            raise SystemExit(f"engine exit {rc}, {clean} of {n} vertices clean")
        return t2 - t0, t2 - t1, rc

    base = _maxrss_kb()
    total, run, _ = asyncio.run(main())
    return {"total_s": total, "run_s": run, "rss_kb": _maxrss_kb() - base, "stall_s": stall[0]}


def child_floor(n: int, edges: list[tuple[int, int]]) -> dict[str, Any]:
    from graphlib import TopologicalSorter

    def noop() -> None:
        pass

    base = _maxrss_kb()
    t0 = time.perf_counter()
    ts: TopologicalSorter[str] = TopologicalSorter()
    names = [f"noop[n{i}]" for i in range(n)]
    for name in names:
        ts.add(name)
    for a, b in edges:
        ts.add(names[b], names[a])
    fns = dict.fromkeys(names, noop)
    ts.prepare()
    calls = 0
    while ts.is_active():
        for v in ts.get_ready():
            fns[v]()
            calls += 1
            ts.done(v)
    total = time.perf_counter() - t0
    assert calls == n
    return {"total_s": total, "run_s": None, "rss_kb": _maxrss_kb() - base, "stall_s": None}


def _child_main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--impl", choices=("evergraph", "floor"), required=True)
    ap.add_argument("--shape", choices=SHAPES, required=True)
    ap.add_argument("--n", type=int, required=True)
    ap.add_argument("--state-dir", default="")
    a = ap.parse_args(argv)
    edges = edges_for(a.shape, a.n)
    if a.impl == "evergraph":
        out = child_evergraph(a.n, edges, a.state_dir)
    else:
        out = child_floor(a.n, edges)
    out["edges"] = len(edges)
    print(json.dumps(out))


def _one(impl: str, shape: str, n: int, state_dir: str) -> dict[str, Any]:
    cmd = [PYTHON, "-m", "bench.engine", "--child", "--impl", impl, "--shape", shape, "--n", str(n)]
    cmd += ["--state-dir", state_dir]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {p.returncode}\n{p.stderr[-2000:]}")
    return dict(json.loads(p.stdout.strip().splitlines()[-1]))


def _reps(impl: str, shape: str, n: int, reps: int, tmp: Path) -> list[dict[str, Any]]:
    """Up to `reps` runs; a case slower than SLOW_S runs once, to keep the whole run bounded."""
    out: list[dict[str, Any]] = []
    for r in range(reps):
        out.append(_one(impl, shape, n, str(tmp / f"state-{impl}-{shape}-{n}-{r}")))
        if out[-1]["total_s"] > SLOW_S:
            break
    return out


def _runs(reps: int) -> str:
    if reps == 1:
        return "1 run"
    return f"median of {reps} runs (1 if slower than {SLOW_S:g} s)"


def run(quick: bool) -> tuple[list[dict[str, Any]], str]:
    sizes = (1_000, 10_000) if quick else (1_000, 10_000, 100_000)
    reps = 1 if quick else 3
    results: list[dict[str, Any]] = []
    rows: list[list[str]] = []
    with temp_dir("/var/tmp") as tmp:
        for shape in SHAPES:
            for n in sizes:
                eg = _reps("evergraph", shape, n, reps, tmp)
                fl = _reps("floor", shape, n, reps, tmp)
                r = {
                    "case": shape,
                    "n": n,
                    "edges": eg[0]["edges"],
                    "runs": len(eg),
                    "evergraph_s": median([x["total_s"] for x in eg]),
                    "evergraph_run_s": median([x["run_s"] for x in eg]),
                    "evergraph_kb_per_vertex": median([x["rss_kb"] for x in eg]) / n,
                    "evergraph_stall_s": max(x["stall_s"] for x in eg),
                    "floor_s": median([x["total_s"] for x in fl]),
                    "floor_kb_per_vertex": median([x["rss_kb"] for x in fl]) / n,
                    "evergraph_samples_s": [x["total_s"] for x in eg],
                    "floor_samples_s": [x["total_s"] for x in fl],
                }
                r["ratio"] = r["evergraph_s"] / r["floor_s"]
                if n >= 100_000:
                    r["target"] = f"< {TARGET_S:g} s, < {TARGET_KB:g} KB/vertex"
                    r["met_time"] = r["evergraph_s"] < TARGET_S
                    r["met_rss"] = r["evergraph_kb_per_vertex"] < TARGET_KB
                    r["met"] = r["met_time"] and r["met_rss"]
                else:
                    r["target"], r["met"] = "-", None
                results.append(r)
                rows.append(
                    [
                        shape,
                        f"{n:,}",
                        fmt_s(r["evergraph_s"]),
                        fmt_s(r["evergraph_run_s"]),
                        fmt_s(r["floor_s"]),
                        fmt_ratio(r["ratio"]),
                        f"{r['evergraph_kb_per_vertex']:.2f}",
                        f"{r['floor_kb_per_vertex']:.2f}",
                        fmt_s(r["evergraph_stall_s"]),
                        r["target"],
                        _met(r),
                    ]
                )
                print(f"  engine {shape} {n}: {fmt_s(r['evergraph_s'])}", file=sys.stderr)
    header = [
        "case",
        "N",
        "evergraph",
        "(engine.run)",
        "floor",
        "ratio",
        "KB/v",
        "floor KB/v",
        "longest stall",
        "target",
        "met?",
    ]
    title = (
        f"engine: N noop vertices in-process, {_runs(reps)}; time = build GraphModel + Engine.run"
    )
    return results, table(title, header, rows)


def _met(r: dict[str, Any]) -> str:
    if r["met"] is None:
        return "-"
    if r["met"]:
        return "yes"
    why = [w for w, ok in (("time", r["met_time"]), ("RSS", r["met_rss"])) if not ok]
    return f"{yes_no(False)} ({', '.join(why)})"


if __name__ == "__main__":
    _child_main(sys.argv[1:])
