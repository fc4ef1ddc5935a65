"""Issue 15 item 3: start-up and parsing, each figure against its floor.

`python -m bench.startup [--quick] [--edit] [--startup] [--against SRC]` (a
standalone case; tmpfs under /dev/shm; `--edit`: the one-line edit case alone;
`--startup`: the start-up cases alone; `--against SRC`: each start-up case also
with `PYTHONPATH=SRC`, e.g. an unpacked `git archive` of an earlier commit,
byte-compiled, run interleaved with the working tree's, for a before/after):

- start-up: `evergraph check` and `evergraph run --converged-exit` of a
  one-resource graph, and `python -c "import evergraph.cli.main"`, as whole
  processes; the floor is `python -c pass`. 20 interleaved runs, the median.
- parse: the YAML frontend's `load()` of a 10,000-file W1 graph, in process
  (read, parse, build, validate: the GraphModel the engine gets); the floor is
  `yaml_rs.loads` of the same text (the parser alone). Median of 9.
- one-line edit: a running agent (`run FILE --converged-timeout 0.2`) manages
  the 10,000 files; each trial rewrites the graph file in place with one
  resource's content changed and times until that file reads back the new
  content (polled every 0.5 ms). The floor is what the fastest possible agent
  must do too: `yaml_rs.loads` of the whole file plus one atomic file write.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml_rs

from bench.common import EVERGRAPH, PYTHON, fmt_ratio, fmt_s, spawn, stop, table

N = 10_000
#: per process: two runs at once (several engineers on one machine) must not share it
ROOT = Path(f"/dev/shm/evergraph-bench-startup-{os.getpid()}")


def _once(cmd: list[str], env: dict[str, str] | None = None) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, env=env)
    return time.perf_counter() - t0


def startup(runs: int, against: str | None = None) -> list[tuple[str, float, float]]:
    g = ROOT / "one.yaml"
    g.write_text(f"resources:\n  file:\n  - name: f\n    path: {ROOT}/one.txt\n    content: hi\n")
    cases = {
        "floor": [PYTHON, "-c", "pass"],
        "check, 1 resource": [EVERGRAPH, "check", str(g)],
        "run, 1 resource": [
            *(EVERGRAPH, "run", str(g), "--converged-exit", "--state-dir", str(ROOT / "st1")),
        ],
        "import evergraph.cli.main": [PYTHON, "-c", "import evergraph.cli.main"],
    }
    times: dict[str, list[float]] = {k: [] for k in cases}
    before: dict[str, list[float]] = {k: [] for k in cases if k != "floor"}
    env = {**os.environ, "PYTHONPATH": against} if against else None
    for _ in range(runs):
        for k, cmd in cases.items():
            times[k].append(_once(cmd))
            if env is not None and k in before:  # interleaved: the same minutes
                before[k].append(_once(cmd, env))
    floor = statistics.median(times.pop("floor"))
    rows = []
    for k, v in times.items():
        if env is not None:
            rows.append((f"{k} (--against)", statistics.median(before[k]), floor))
        rows.append((k, statistics.median(v), floor))
    return rows


def _line(i: int, tag: str) -> str:
    return (
        f"  - {{name: f{i}, path: {ROOT}/w/d{i // 100}/f{i}.txt, "
        f'content: "{tag} content number {i} padded to about seventy bytes\\n", mode: "0644"}}'
    )


def parse(lines: list[str], runs: int) -> tuple[float, float]:
    g = ROOT / "w1.yaml"
    g.write_text("\n".join(lines) + "\n")
    code = (
        "import sys, time, statistics, yaml_rs\n"
        "from evergraph.frontends.open import open_graph_file\n"
        "f = open_graph_file(sys.argv[1]); f.load()\n"
        "p, fl = [], []\n"
        f"for _ in range({runs}):\n"
        "    t = time.perf_counter(); f.load(); p.append(time.perf_counter() - t)\n"
        "    t = time.perf_counter(); yaml_rs.loads(open(sys.argv[1]).read())\n"
        "    fl.append(time.perf_counter() - t)\n"
        "print(statistics.median(p), statistics.median(fl))\n"
    )
    out = subprocess.run([PYTHON, "-c", code, str(g)], capture_output=True, text=True, check=True)
    ours, floor = map(float, out.stdout.split())
    return ours, floor


def edit(lines: list[str], trials: int) -> tuple[float, float]:
    g = ROOT / "w1.yaml"
    g.write_text("\n".join(lines) + "\n")
    status = ROOT / "status"
    p = spawn(
        [
            EVERGRAPH,
            "run",
            str(g),
            "--state-dir",
            str(ROOT / "st"),
            "--converged-status-file",
            str(status),
            "--converged-timeout",
            "0.2",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    took: list[float] = []
    try:
        deadline = time.monotonic() + 120
        while not (status.exists() and status.read_text().split()[-1:] == ["true"]):
            if time.monotonic() > deadline or p.poll() is not None:
                raise RuntimeError("the agent did not converge")
            time.sleep(0.05)
        for t in range(1, trials + 1):
            time.sleep(0.5)  # the agent idle, the last change settled
            i = (t * 997) % N
            lines[2 + i] = _line(i, f"v{t}")
            want = f"v{t} content number {i} padded to about seventy bytes\n"
            path = ROOT / "w" / f"d{i // 100}" / f"f{i}.txt"
            text = "\n".join(lines) + "\n"
            t0 = time.perf_counter()
            with open(g, "w") as f:  # an editor's in-place save
                f.write(text)
            while True:
                try:
                    if path.read_text() == want:
                        break
                except FileNotFoundError:
                    pass
                if time.perf_counter() - t0 > 20:
                    raise RuntimeError(f"trial {t}: the edit never reached the disk")
                time.sleep(0.0005)
            took.append(time.perf_counter() - t0)
    finally:
        stop(p)
    floor: list[float] = []
    for _ in range(trials):
        t0 = time.perf_counter()
        r = yaml_rs.loads(g.read_text())["resources"]["file"][i]
        tmp = r["path"] + ".tmp"
        with open(tmp, "w") as f:
            f.write(r["content"])
        os.chmod(tmp, 0o644)
        os.rename(tmp, r["path"])
        floor.append(time.perf_counter() - t0)
    return statistics.median(took), statistics.median(floor)


def main() -> int:
    quick = "--quick" in sys.argv
    edit_only = "--edit" in sys.argv  # the one-line edit case alone
    startup_only = "--startup" in sys.argv  # the start-up cases alone
    against = sys.argv[sys.argv.index("--against") + 1] if "--against" in sys.argv else None
    subprocess.run(["rm", "-rf", str(ROOT)], check=True)
    ROOT.mkdir(parents=True)
    try:
        rows: list[tuple[str, str, str, str]] = []
        lines = ["resources:", "  file:"] + [_line(i, "v0") for i in range(N)]
        if not edit_only:
            rows += [
                (k, fmt_s(v), fmt_s(f), fmt_ratio(v / f))
                for k, v, f in startup(5 if quick else 20, against)
            ]
        if not edit_only and not startup_only:
            ours, floor = parse(lines, 3 if quick else 9)
            rows.append(("parse 10k (load)", fmt_s(ours), fmt_s(floor), fmt_ratio(ours / floor)))
        if not startup_only:
            ours, floor = edit(lines, 5 if quick else 15)
            rows.append(
                ("1-line edit -> disk, 10k", fmt_s(ours), fmt_s(floor), fmt_ratio(ours / floor))
            )
    finally:
        subprocess.run(["rm", "-rf", str(ROOT)], check=True)
    print(table("start-up and parsing", ["case", "evergraph", "floor", "ratio"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
