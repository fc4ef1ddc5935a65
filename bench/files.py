"""Benchmark 2, W1: N files (100 per directory) with content and mode, from a YAML graph.

The graph has each directory as a resource (`path: .../dJ/`, `state: exists`)
and each file as one (`path`, `content`, `mode`, `state: exists`), in two edge
styles (issue 28): `auto`, no `edges:` (each file's automatic edge from its
directory orders them), and `explicit`, the same graph with one explicit edge
per file from its directory, in mgmt's block layout (`- name: eI` / `from:` /
`kind: file` / `name: dJ` / `to:` / ...), as mgmt's graphs and its corpus
write them. The floor does the same job for both (it makes missing parent
directories itself).

Three phases, each a whole `evergraph run FILE --converged-exit --state-dir S`
process timed from outside (Python start-up and YAML load included): first
apply (target directory absent), no-change re-run, and 1 % drift (1 % of the
files rewritten with other content first, untimed). The floor is
`bench/floor_files.py` run the same way on the same files (a JSON spec); it
writes without fsync, as evergraph writes a file where there was none (its
writes that replace a file are durable: atomic.py's fsync policy), and it is
also run with `--durable` (every write synced, the way evergraph syncs a
replacing write) and both ratios are given.
Each timed run follows an `os.sync()`, so no earlier run's writeback is in it.

Targets are deleted only when the whole run is over. The root file system
here is ext4 *without a journal*, and there the kernel avoids reusing
recently freed inodes (`recently_deleted()` in ext4's inode allocator): for
about a minute after a mass `rm -rf`, every file creation scans past those
inodes (measured: 5,000 creates took 3.07 s right after a run's cleanup,
0.10 s 50 s later), for evergraph and the floor alike. So each run gets a
directory that never existed, nothing is deleted between timed runs, and
back-to-back invocations of the benchmarks should be a minute apart.

Every timed process's peak RSS is taken from wait4(2) (its own and its reaped
children's largest). With `--with-salt` (`python -m bench.files --with-salt`, or
`scripts/bench --only files --with-salt`), Salt (`salt-call --local state.apply`,
masterless, in its own venv: bench/salt.py) does the same three phases once, at
the largest N on ext4, in a target of its own; a last table gives every
implementation's times and peak RSS there, with the ratios to the floor and
Salt's to evergraph.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import (
    EVERGRAPH,
    PYTHON,
    REPO,
    fmt_ratio,
    fmt_s,
    fs_type,
    git_state,
    machine,
    median,
    spawn,
    standalone,
    stop,
    table,
    temp_dir,
    yes_no,
)

PHASES = ("first apply", "no change", "1% drift")
#: the graph's edges: automatic (dir -> file) or one explicit edge per file (issue 28)
STYLES = ("auto", "explicit")
#: evergraph per edge style, the floor, the floor writing durably (each write synced)
IMPLS = ("evergraph-auto", "evergraph-explicit", "floor", "floor-durable")
#: issue 15: first apply and no change of 10k files each <= 2x the plain floor
TARGET_RATIO = 2.0
FLOOR = str(REPO / "bench" / "floor_files.py")
MODE = "0644"
#: a Salt first apply of 10k files takes ~90 s on this machine
SALT_TIMEOUT = 1800.0


def content(i: int, n: int) -> str:
    return f"# file {i} of {n}, managed by the W1 benchmark\nkey{i} = value-{i}\n"


def layout(root: Path, n: int) -> list[tuple[str, str]]:
    """(path, content) of every file: file i lives in directory d(i // 100)."""
    return [(f"{root}/d{i // 100}/f{i}.txt", content(i, n)) for i in range(n)]


def write_inputs(work: Path, files: list[tuple[str, str]], style: str) -> tuple[Path, Path]:
    dirs = sorted({path.rsplit("/", 1)[0] for path, _ in files})
    lines = ["graph: w1", "resources:", "  file:"]
    for j, d in enumerate(dirs):
        lines.append(f"  - {{name: d{j}, path: {json.dumps(d + '/')}, state: exists}}")
    parent: list[int] = []
    index = {d: j for j, d in enumerate(dirs)}
    for i, (path, text) in enumerate(files):
        parent.append(index[path.rsplit("/", 1)[0]])
        lines.append(
            f"  - {{name: f{i}, path: {json.dumps(path)}, content: {json.dumps(text)},"
            f' mode: "{MODE}", state: exists}}'
        )
    if style == "explicit":
        lines.append("edges:")
        for i, j in enumerate(parent):
            lines += [
                f"- name: e{i}",
                "  from:",
                "    kind: file",
                f"    name: d{j}",
                "  to:",
                "    kind: file",
                f"    name: f{i}",
            ]
    yaml_path = work / f"w1-{style}.yaml"
    yaml_path.write_text("\n".join(lines) + "\n")
    spec_path = work / "w1.json"
    spec_path.write_text(json.dumps([[p, t, MODE] for p, t in files]))
    return yaml_path, spec_path


def verify(files: list[tuple[str, str]]) -> None:
    for path, text in files:
        with open(path) as f:
            if f.read() != text:
                raise RuntimeError(f"{path}: content not converged")
        if os.stat(path).st_mode & 0o7777 != int(MODE, 8):
            raise RuntimeError(f"{path}: mode not converged")


def drift(files: list[tuple[str, str]], seed: int) -> int:
    """Rewrite 1 % of the files (at least one) with other content, in place."""
    rng = random.Random(seed)
    chosen = rng.sample(range(len(files)), max(1, len(files) // 100))
    for i in chosen:
        with open(files[i][0], "w") as f:
            f.write("drifted: someone edited this by hand\n")
    return len(chosen)


def run_measured(cmd: list[str], log: Path, timeout: float = 300) -> tuple[float, float, float]:
    """As common.run_timed (wall seconds from fork to exit through a pidfd; raises on
    a non-zero status), and from wait4(2) the process's peak RSS in MiB and its CPU
    seconds (user + system, its reaped children's included)."""
    with open(log, "ab") as out:
        t0 = time.perf_counter()
        p = spawn(cmd, stdout=out, stderr=out)
        fd = os.pidfd_open(p.pid)
        try:
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            exited = bool(poller.poll(timeout * 1000))
        finally:
            os.close(fd)
        if not exited:
            stop(p)
            raise RuntimeError(f"timed out after {timeout}s: {' '.join(cmd)}")
        _, status, usage = os.wait4(p.pid, 0)
        took = time.perf_counter() - t0
        p.returncode = os.waitstatus_to_exitcode(status)
        stop(p)  # reaped already: only forgets it
    if p.returncode != 0:
        tail = log.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"exit status {p.returncode}: {' '.join(cmd)}\n{tail}")
    return took, usage.ru_maxrss / 1024, usage.ru_utime + usage.ru_stime  # KiB on Linux


def one_round(
    impl: str, n: int, base: str, rep: int, log: Path, work: Path, salt_bin: Path | None = None
) -> dict[str, float]:
    """The three phases for one implementation (`evergraph-auto`,
    `evergraph-explicit`, `floor`, `floor-durable`, `salt` with `salt_bin`), in a
    fresh target directory: {phase: wall seconds}, {"rss " + phase: peak MiB} and
    {"cpu " + phase: CPU seconds}."""
    key = f"{impl}-{n}-{rep}-{fs_type(base)}"
    root = Path(base) / f"target-{key}"
    state = work / f"state-{key}"
    files = layout(root, n)
    sub = work / f"in-{key}"
    sub.mkdir()
    style = impl.partition("-")[2] if impl.startswith("evergraph") else "auto"
    yaml_path, spec_path = write_inputs(sub, files, style)
    timeout = 300.0
    if impl == "salt":
        from bench import salt

        if salt_bin is None:
            raise ValueError("impl salt needs salt_bin (bench.salt.salt_venv())")
        conf, roots = salt.write_job(sub, files, MODE)
        cmd = salt.command(salt_bin, conf, roots)
        timeout = SALT_TIMEOUT
    elif impl.startswith("evergraph"):
        cmd = [EVERGRAPH, "run", str(yaml_path), "--converged-exit", "--state-dir", str(state)]
    else:
        cmd = [PYTHON, FLOOR, str(spec_path)]
        if impl == "floor-durable":
            cmd.append("--durable")
    out: dict[str, float] = {}
    if root.exists():
        raise RuntimeError(f"{root} exists: first apply needs the target directory absent")
    # The target stays until the whole benchmark ends: see the module docstring.
    try:
        for phase in PHASES:
            if phase == "1% drift":
                drift(files, seed=rep)
            os.sync()
            out[phase], out[f"rss {phase}"], out[f"cpu {phase}"] = run_measured(cmd, log, timeout)
            verify(files)
    finally:
        shutil.rmtree(state, ignore_errors=True)
    return out


def _runs(reps: int) -> str:
    return "1 run" if reps == 1 else f"median of {reps} runs"


def run(
    quick: bool,
    with_salt: bool = False,
    sizes: tuple[int, ...] | None = None,
    reps: int | None = None,
) -> tuple[list[dict[str, Any]], str]:
    """scripts/bench's entry; `with_salt`: Salt too, once, at the largest N on ext4."""
    if sizes is None:
        sizes = (100, 1_000) if quick else (100, 1_000, 10_000)
    if reps is None:
        reps = 1 if quick else 3
    salt_bin, salt_version = None, ""
    if with_salt:
        from bench import salt

        salt_bin, salt_version = salt.salt_venv()
    ext4_base = "/var/tmp"
    cases = [(ext4_base, n) for n in sizes] + [("/dev/shm", sizes[-1])]
    results: list[dict[str, Any]] = []
    rows: list[list[str]] = []
    last = ""  # the per-implementation table, at the largest N on ext4
    with (
        temp_dir(ext4_base) as work,
        temp_dir(ext4_base, prefix="evergraph-w1-") as ext4_target,
        temp_dir("/dev/shm", prefix="evergraph-w1-") as tmpfs_target,
    ):
        log = work / "runs.log"
        for base, n in cases:
            target = ext4_target if base == ext4_base else tmpfs_target
            fs = fs_type(target)
            samples: dict[str, list[dict[str, float]]] = {impl: [] for impl in IMPLS}
            for rep in range(reps):
                for impl in IMPLS:
                    samples[impl].append(one_round(impl, n, str(target), rep, log, work))
            summary = base == ext4_base and n == sizes[-1]
            if summary and salt_bin is not None:
                # one run: Salt takes minutes at 10k (the table says so)
                samples["salt"] = [one_round("salt", n, str(target), 0, log, work, salt_bin)]
            if summary:
                results.extend(impl_results(samples, n, fs, base, salt_version))
                last = impl_table(samples, n, fs, reps, salt_version)
            for phase in PHASES:
                fl = median([s[phase] for s in samples["floor"]])
                fd = median([s[phase] for s in samples["floor-durable"]])
                has_target = base == ext4_base and n == 10_000 and phase != "1% drift"
                for style in STYLES:
                    got = [s[phase] for s in samples[f"evergraph-{style}"]]
                    eg = median(got)
                    r: dict[str, Any] = {
                        "case": phase,
                        "edges": style,
                        "n": n,
                        "fs": fs,
                        "dir": base,
                        "runs": reps,
                        "evergraph_s": eg,
                        "floor_s": fl,
                        "ratio": eg / fl,
                        "evergraph_samples": got,
                        "floor_samples": [s[phase] for s in samples["floor"]],
                        "floor_durable_s": fd,
                        "ratio_durable": eg / fd,
                        "floor_durable_samples": [s[phase] for s in samples["floor-durable"]],
                        "evergraph_rss_mib": median(
                            [s[f"rss {phase}"] for s in samples[f"evergraph-{style}"]]
                        ),
                        "floor_rss_mib": median([s[f"rss {phase}"] for s in samples["floor"]]),
                        "target": f"<= {TARGET_RATIO:g}x floor" if has_target else "-",
                        "met": (eg / fl <= TARGET_RATIO) if has_target else None,
                    }
                    results.append(r)
                    rows.append(
                        [
                            f"{phase} ({fs})" if style == STYLES[0] else "",
                            f"{n:,}" if style == STYLES[0] else "",
                            style,
                            fmt_s(eg),
                            fmt_s(fl) if style == STYLES[0] else "",
                            fmt_ratio(r["ratio"]),
                            fmt_s(fd) if style == STYLES[0] else "",
                            fmt_ratio(r["ratio_durable"]),
                            r["target"],
                            yes_no(r["met"]),
                        ]
                    )
            print(f"  files {n} on {fs}: done", file=sys.stderr)
    header = [
        "case", "N", "edges", "evergraph", "floor", "ratio", "floor fsync", "ratio", "target",
        "met?",
    ]  # fmt: skip
    title = (
        f"W1 files: whole processes, wall time, {_runs(reps)}; ext4 = {ext4_base},"
        " tmpfs = /dev/shm; edges: automatic (dir -> file) or one explicit edge per file"
        " (mgmt's layout); floor fsync = the floor syncing every write (--durable)"
    )
    return results, table(title, header, rows) + "\n\n" + last


#: the rows of the per-implementation table: (impl key, label)
ROWS = (
    ("evergraph-auto", "evergraph, automatic edges"),
    ("evergraph-explicit", "evergraph, explicit edges"),
    ("floor", "floor"),
    ("floor-durable", "floor fsync"),
    ("salt", "Salt"),
)


def _med(samples: list[dict[str, float]], key: str) -> float:
    return median([s[key] for s in samples])


def _peak(samples: list[dict[str, float]]) -> float:
    """Peak RSS over the three phases (median over runs of each run's largest)."""
    return median([max(s[f"rss {p}"] for p in PHASES) for s in samples])


def impl_results(
    samples: dict[str, list[dict[str, float]]], n: int, fs: str, base: str, salt_version: str
) -> list[dict[str, Any]]:
    """One record per implementation at the summary size (`"impl"` tells them from
    the per-phase records above)."""
    out = []
    for impl, _ in ROWS:
        if impl not in samples:
            continue
        got = samples[impl]
        r: dict[str, Any] = {
            "impl": impl,
            "n": n,
            "fs": fs,
            "dir": base,
            "runs": len(got),
            "seconds": {p: _med(got, p) for p in PHASES},
            "cpu_seconds": {p: _med(got, f"cpu {p}") for p in PHASES},
            "peak_rss_mib": _peak(got),
            "samples": got,
            "ratio_floor": {p: _med(got, p) / _med(samples["floor"], p) for p in PHASES},
        }
        if impl == "salt":
            r["version"] = salt_version
            r["ratio_evergraph_explicit"] = {
                p: _med(got, p) / _med(samples["evergraph-explicit"], p) for p in PHASES
            }
        out.append(r)
    return out


def impl_table(
    samples: dict[str, list[dict[str, float]]], n: int, fs: str, reps: int, salt_version: str
) -> str:
    """Times and peak RSS per implementation, then the ratios (the issue's table)."""
    rows: list[list[str]] = []
    ratios: list[list[str]] = []

    def ratio_row(label: str, impl: str, over: str) -> list[str]:
        cells = [fmt_ratio(_med(samples[impl], p) / _med(samples[over], p)) for p in PHASES]
        return [label, *cells, fmt_ratio(_peak(samples[impl]) / _peak(samples[over]))]

    for impl, label in ROWS:
        if impl not in samples:
            continue
        if impl == "salt":
            runs = _runs(len(samples[impl]))
            label = f"Salt {salt_version} state.apply (a require per file), {runs}"
        got = samples[impl]
        rows.append([label, *(fmt_s(_med(got, p)) for p in PHASES), f"{_peak(got):.0f} MiB"])
        if impl.startswith("evergraph"):
            ratios.append(ratio_row(f"evergraph {impl.partition('-')[2]} / floor", impl, "floor"))
        elif impl == "salt":
            ratios.append(ratio_row("Salt / floor", impl, "floor"))
    cpu = [
        [impl, *(fmt_s(_med(samples[impl], f"cpu {p}")) for p in PHASES), ""]
        for impl, _ in ROWS
        if impl in samples
    ]
    if "salt" in samples:
        ratios.append(ratio_row("Salt / evergraph explicit", "salt", "evergraph-explicit"))
        ratios.append(ratio_row("Salt / evergraph auto", "salt", "evergraph-auto"))
    title = (
        f"W1 {n:,} files on {fs}, per implementation: whole processes, wall time and peak RSS"
        f" (largest of the three phases); {_runs(reps)} except where said"
    )
    header = ["", *PHASES, "peak RSS"]
    blank = ["", "", "", "", ""]
    rows += [["ratios (wall)", *blank[1:]], *ratios, ["CPU (user + system)", *blank[1:]], *cpu]
    return table(title, header, rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.files", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="N = 100 and 1,000, one run each")
    ap.add_argument("--sizes", help="comma-separated N instead (e.g. 500)")
    ap.add_argument("--reps", type=int, help="runs per implementation [default: 3, --quick 1]")
    ap.add_argument(
        "--with-salt",
        action="store_true",
        help="Salt too (bench/.venv-salt, made on first use), one run at the largest N on ext4",
    )
    ap.add_argument("--json", type=Path, help="write the results here too")
    args = ap.parse_args(argv)
    sizes = tuple(int(x) for x in args.sizes.split(",")) if args.sizes else None

    def go() -> tuple[dict[str, Any], str]:
        res, text = run(args.quick, args.with_salt, sizes, args.reps)
        return {"machine": machine(), "git": git_state(), "files": res}, text

    return standalone(go, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
