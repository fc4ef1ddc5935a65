"""Run every benchmark, print one table each, write bench/results/latest.json.

Usage: `scripts/bench [--quick] [--only NAME ...]` (NAME: see BENCHMARKS below)
(or `.venv/bin/python -m bench ...`, or `.venv/bin/python bench/run.py ...`).
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import importlib
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common

BENCHMARKS = (
    "engine",
    "graphops",
    "drift",
    "files",
    "phases",
    "world",
    "farm",
    "failover",
    "soak",
    "http",
    "abuse",
    "cluster",
    "selfform",
    "world10k",
    "remote",
    "virt",
    "containers",
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/bench", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller N, one run each (< 1 min)")
    ap.add_argument(
        "--only",
        action="append",
        choices=BENCHMARKS,
        help="run only this benchmark (repeatable); default: all",
    )
    ap.add_argument(
        "--with-salt",
        action="store_true",
        help="files: Salt too, one run at the largest N (slow: minutes at 10k; bench/salt.py)",
    )
    ap.add_argument(
        "--json",
        type=Path,
        default=common.REPO / "bench" / "results" / "latest.json",
        help="where to write the machine-readable results [default: %(default)s]",
    )
    args = ap.parse_args(argv)
    atexit.register(common.cleanup_all)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    chosen = [b for b in BENCHMARKS if not args.only or b in args.only]
    started = time.perf_counter()
    out: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "quick": args.quick,
        "machine": common.machine(),
        "fs": {p: common.fs_type(p) for p in ("/var/tmp", "/dev/shm")},
        "git": common.git_state(),
    }
    m, g = out["machine"], out["git"]
    print(
        f"evergraph {g['commit']}{' (src/ modified)' if g['src_dirty'] else ''}; "
        f"{m['nproc']} cores, {m['mem_total']} RAM, Linux {m['kernel']}, Python "
        f"{m['venv_python']}; /var/tmp on {out['fs']['/var/tmp']}, /dev/shm on "
        f"{out['fs']['/dev/shm']}{'; --quick' if args.quick else ''}",
        flush=True,
    )
    tables: list[str] = []
    for name in chosen:
        t0 = time.perf_counter()
        print(f"== {name}", file=sys.stderr, flush=True)
        # each benchmark is a module bench/<name>.py with run(quick) -> (results, table)
        module = importlib.import_module(f"bench.{name}")
        kw = {"with_salt": True} if name == "files" and args.with_salt else {}
        out[name], text = module.run(args.quick, **kw)
        took = time.perf_counter() - t0
        out.setdefault("seconds", {})[name] = round(took, 1)
        print(f"\n{text}\n", flush=True)
        tables.append(text)
    out["seconds"]["total"] = round(time.perf_counter() - started, 1)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2) + "\n")
    print(f"results: {args.json} ({out['seconds']['total']} s in all)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
