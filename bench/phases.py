"""Issue 28: a W1 10k run's work counted in instructions, not timed.

`python -m bench.phases [--quick] [--against SRC]` (or `scripts/bench --only phases`).

On a VM whose speed moves by 15-30 % from one run to the next, a change worth
a few percent of a run's time cannot be seen in wall-clock medians without
dozens of runs. Instructions can: cachegrind (valgrind, `--cache-sim=no`) counts
the user-space instructions each process runs, the same to within ~0.1 % from
one run to the next (PYTHONHASHSEED=0). What it does not count: the kernel's
work (the file system calls, page faults) and any wait.

Counted, on the W1 graph with explicit edges (10,000 files in 100 directories,
bench/files.py), in a tmpfs under /dev/shm:

- the evergraph parent's serial chain of a first apply (fresh state dir: the
  parse cache is cold) up to four points, where bench/_phase_exit.py ends the
  process: the fork of the early parse helper (frontends/early.py: it parses a
  large file's `resources:` beside the parent's imports; a tree without it has
  no such row), the parse's start (Python, imports), the fork of the children
  ahead (+ the parse), the go (+ the fork, the agent's modules and its start).
  Before the go a first apply is the parent's alone but for the helper.
- the same chain of a no-change run (the state dir of a first apply: a parse
  cache hit, every file in its state).
- whole runs, every process: evergraph's first apply and no change (the parent,
  the early helper and each child ahead), and the floor's (bench/floor_files.py)
  on the same files.

`--against SRC` counts the same with `PYTHONPATH=SRC` too (e.g. an unpacked `git
archive` of an earlier commit), for a before/after of a change; each count is
one run (they repeat). Needs valgrind (scripts/setup installs it).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.common import PYTHON, REPO, spawn, table, temp_dir
from bench.files import FLOOR, layout, write_inputs

N = 10_000
#: where bench/_phase_exit.py ends the parent (None: the whole run)
POINTS = ("early", "parse", "fork", "go")
EXIT = REPO / "bench" / "_phase_exit.py"
_REFS = re.compile(r"^==(\d+)== I\s+refs:\s+([\d,]+)", re.M)


def counted(cmd: list[str], env: dict[str, str] | None = None) -> tuple[int, list[int]]:
    """(instructions of the process `cmd` started, of each process it forked: what
    the child ran and what its parent had run before the fork)."""
    vg = ["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null"]
    run_env = {**os.environ, "PYTHONHASHSEED": "0", **(env or {})}
    p = spawn([*vg, *cmd], env=run_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, err = p.communicate()
    text = err.decode(errors="replace")
    if p.returncode:
        raise RuntimeError(f"exit status {p.returncode}: {' '.join(cmd)}\n{text[-2000:]}")
    # (valgrind runs the command in its own process: the pid is the command's)
    got = {int(pid): int(n.replace(",", "")) for pid, n in _REFS.findall(text)}
    parent = got.pop(p.pid)
    return parent, [got[pid] for pid in sorted(got)]  # (in the order of their forks)


def _count(
    src: str | None,
    label: str,
    cmd: list[str],
    env: dict[str, str],
    forked_at: int | None,
    helper_at: int | None = None,
) -> dict[str, Any]:
    """A row: the parent's count, and that of its children's own work (`forked_at`:
    the parent's count at the fork of the children ahead, which each one's count
    includes; None at a point, where they are killed with their parent, uncounted);
    `helper_at`: the parent's at the early helper's fork, the first child (None:
    no helper)."""
    env = {**env, "PYTHONPATH": src or str(REPO / "src")}  # (this checkout's by default)
    parent, children = counted(cmd, env)
    helper = None
    if helper_at is not None and children:
        helper = children.pop(0) - helper_at
    own = None if forked_at is None else sum(c - forked_at for c in children)
    return {
        "case": label,
        "src": src or "tree",
        "parent": parent,
        "children": own,
        "helper": helper,
    }


def run(quick: bool, against: str | None = None) -> tuple[list[dict[str, Any]], str]:
    """scripts/bench's entry (`quick`: a 1,000-file graph)."""
    if shutil.which("valgrind") is None:  # (scripts/setup installs it when run as root)
        return [], "phases: not run: valgrind is not installed (apt-get install valgrind)"
    n = 1_000 if quick else N
    srcs: list[str | None] = [None] if against is None else [None, against]
    results: list[dict[str, Any]] = []
    with temp_dir("/dev/shm", prefix="evergraph-bench-phases-") as work:
        for k, src in enumerate(srcs):
            sub = work / f"in-{k}"
            sub.mkdir()
            files = layout(work / f"target-{k}", n)
            yaml_path, spec = write_inputs(sub, files, "explicit")
            state = sub / "state"
            run_cmd = ["run", str(yaml_path), "--converged-exit", "--state-dir", str(state)]
            cmd = [PYTHON, str(EXIT), *run_cmd]  # (the same program at each point)
            has_helper = (Path(src or REPO / "src") / "evergraph/frontends/early.py").exists()
            for phase in ("first apply", "no change"):
                forked_at = 0
                helper_at = None
                for point in POINTS:
                    if point == "early" and not has_helper:
                        continue
                    if phase == "first apply":
                        shutil.rmtree(state, ignore_errors=True)  # (a cold parse cache)
                    env = {"EVERGRAPH_BENCH_EXIT_AT": point}
                    label = f"{phase}: parent to the {point}"
                    results.append(_count(src, label, cmd, env, None))
                    if point == "fork":
                        forked_at = results[-1]["parent"]
                    if point == "early":
                        helper_at = results[-1]["parent"]
                if phase == "first apply":
                    shutil.rmtree(state, ignore_errors=True)
                    shutil.rmtree(work / f"target-{k}", ignore_errors=True)
                label = f"{phase}: whole run"
                results.append(_count(src, label, cmd, {}, forked_at, helper_at))
            if k == 0:
                floor_cmd = [PYTHON, str(FLOOR), str(spec)]
                shutil.rmtree(work / f"target-{k}", ignore_errors=True)
                results.append(_count(None, "floor, first apply: whole run", floor_cmd, {}, 0))
                results.append(_count(None, "floor, no change: whole run", floor_cmd, {}, 0))
    rows = []
    for r in results:
        own, helper = r["children"], r.get("helper")
        total = r["parent"] + (own or 0) + (helper or 0)
        row = [
            r["case"],
            f"{r['parent'] / 1e6:,.0f}",
            "-" if helper is None else f"{helper / 1e6:,.0f}",
            "-" if own is None else f"{own / 1e6:,.0f}",
            f"{total / 1e6:,.0f}",
        ]
        if against is not None:
            if r["src"] == against:
                continue
            before = next(
                (x for x in results if x["case"] == r["case"] and x["src"] == against), None
            )
            was = (
                None
                if before is None
                else before["parent"] + (before["children"] or 0) + (before.get("helper") or 0)
            )
            row.append("-" if was is None else f"{total / was - 1:+.2%}")
        rows.append(row)
    header = ["W1 explicit, tmpfs", "parent", "early helper", "children ahead", "in all"]
    if against is not None:
        header.append(f"vs {against}")
    title = f"Instructions, millions (cachegrind, user space), W1 {n:,} files, explicit edges"
    return results, table(title, header, rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.phases", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a 1,000-file graph")
    ap.add_argument("--against", metavar="SRC", help="count with PYTHONPATH=SRC too")
    args = ap.parse_args(argv)
    results, text = run(args.quick, args.against)
    print(text)
    return 0 if results else 1


if __name__ == "__main__":
    if __package__ in (None, ""):
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    raise SystemExit(main())
