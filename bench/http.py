"""Issue 14, the cost of `--http` (metrics and the live view) on the W1 10k-file graph.

Each case runs without `--http`, then with `--http 127.0.0.1:PORT` while two
clients in this process load it as an operator's tools would: a scraper GETs
`/metrics` every 100 ms and an SSE client reads `/api/v1/graph/events`
(both start before the agent and retry until it listens):

- **no change**: a whole `evergraph run FILE --converged-exit --state-dir S`
  process on 10,000 files already converged (first apply untimed), the two
  variants alternating, median of REPS each: the engine's part (from the log's
  "graph loaded" to "converged" lines, ms stamps: 10k check_apply calls with the
  observer fed, scrapes and SSE served meanwhile) and the wall time from fork to
  exit (which adds --http's one-time costs: importing the HTTP stack, binding,
  the farm's election, the server's shutdown), and the agent's CPU time
  (user+sys, steadier than wall times on a shared machine);
- **drift repair**: a running agent (as bench/drift.py, with the same trials:
  one random file rewritten in place, timed until it reads back right) on the
  same 10,000 files; 4 agents per variant, alternating, 50 trials each; p50
  and p99 of the 200 pooled.

Target: `--http` at most 5 % slower (the engine's part; p99 for drift).
"""

from __future__ import annotations

import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench.common import (
    EVERGRAPH,
    PYTHON,
    REPO,
    fmt_s,
    median,
    percentile,
    run_timed,
    spawn,
    stop,
    table,
    temp_dir_until_exit,
    yes_no,
)
from bench.drift import trials, wait_converged
from bench.files import layout, verify, write_inputs

N_FILES = 10_000
TARGET = 1.05
SCRAPE_EVERY = 0.1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class _Load:
    """The scraper and the SSE reader, on threads (in the clients' own process)."""

    def __init__(self, port: int) -> None:
        self.base = f"http://127.0.0.1:{port}"
        self.done = threading.Event()
        self.scrapes = 0
        self.events = 0
        self._http = httpx.Client(base_url=self.base, timeout=5)
        self._sse = httpx.Client(base_url=self.base, timeout=httpx.Timeout(5, read=None))
        self.threads = [
            threading.Thread(target=self._scrape, daemon=True),
            threading.Thread(target=self._listen, daemon=True),
        ]
        for t in self.threads:
            t.start()

    def _scrape(self) -> None:
        next_at = time.perf_counter()
        while not self.done.is_set():
            try:
                r = self._http.get("/metrics")
                if r.status_code == 200:
                    self.scrapes += 1
            except httpx.HTTPError:
                self.done.wait(0.01)  # not listening yet, or gone
                continue
            next_at += SCRAPE_EVERY
            self.done.wait(max(0.0, next_at - time.perf_counter()))

    def _listen(self) -> None:
        while not self.done.is_set():
            try:
                with self._sse.stream("GET", "/api/v1/graph/events?after=0") as r:
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            self.events += 1
                        if self.done.is_set():
                            return
            except httpx.HTTPError:
                pass
            self.done.wait(0.01)


class Clients:
    """`_Load` in a process of its own, until `close()`: in this process its threads
    would hold the GIL while the trials' timing thread wants to wake up."""

    def __init__(self, port: int) -> None:
        self.scrapes = 0
        self.events = 0
        cmd = [PYTHON, "-m", "bench.http", str(port)]
        self.proc = spawn(cmd, stdout=subprocess.PIPE, cwd=str(REPO))
        assert self.proc.stdout is not None
        # started (imports done) before the agent is: its start-up is not the agent's
        if self.proc.stdout.readline().strip() != b"ready":
            raise RuntimeError("the HTTP clients' process did not start")

    def close(self) -> None:
        stop(self.proc, grace=10.0)
        assert self.proc.stdout is not None
        out = self.proc.stdout.read().decode().split()
        self.proc.stdout.close()
        if len(out) == 2:
            self.scrapes, self.events = int(out[0]), int(out[1])


def _clients_main(port: int) -> None:
    """The clients' process: load the agent until SIGTERM, then print the counts."""
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    load = _Load(port)
    print("ready", flush=True)
    stopped.wait()
    load.done.set()
    print(load.scrapes, load.events, flush=True)
    os._exit(0)  # the SSE thread may still be in a read


def _clock(line: str) -> float:
    h, m, s = line[:12].split(":")
    return int(h) * 3600 + int(m) * 60 + float(s)


def engine_phase(log: Path) -> float:
    """Seconds from "graph ... loaded" to "converged:" in an agent's log (ms stamps)."""
    loaded = converged = None
    for line in log.read_text(errors="replace").splitlines():
        if " graph " in line and " loaded: " in line:
            loaded = _clock(line)
        elif " converged: " in line:
            converged = _clock(line)
    if loaded is None or converged is None:
        raise RuntimeError(f"{log}: no 'loaded' and 'converged' lines")
    return converged - loaded


def _cpu_of_children() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def no_change(work: Path, yaml_path: Path, state: Path, reps: int) -> dict[str, Any]:
    plain = [EVERGRAPH, "run", str(yaml_path), "--converged-exit", "--state-dir", str(state)]
    wall: dict[str, list[float]] = {"plain": [], "http": []}
    engine: dict[str, list[float]] = {"plain": [], "http": []}
    cpu: dict[str, list[float]] = {"plain": [], "http": []}
    scrapes, events = [], []
    for i in range(reps):
        for name in ("plain", "http"):
            log = work / f"no-change-{name}-{i}.log"
            cmd, clients = plain, None
            if name == "http":
                port = free_port()
                cmd = [*plain, "--http", f"127.0.0.1:{port}"]
                clients = Clients(port)
            cpu0 = _cpu_of_children()
            try:
                wall[name].append(run_timed(cmd, log))
                # the agent's only: the clients' process is not reaped yet
                cpu[name].append(_cpu_of_children() - cpu0)
            finally:
                if clients is not None:
                    clients.close()
                    scrapes.append(clients.scrapes)
                    events.append(clients.events)
            engine[name].append(engine_phase(log))
    out: dict[str, Any] = {"scrapes_per_run": scrapes, "sse_events_per_run": events}
    for name in ("plain", "http"):
        out[f"{name}_s"] = median(wall[name])
        out[f"{name}_engine_s"] = median(engine[name])
        out[f"{name}_cpu_s"] = median(cpu[name])
        out[f"{name}_samples"] = wall[name]
        out[f"{name}_engine_samples"] = engine[name]
        out[f"{name}_cpu_samples"] = cpu[name]
    return out


def cpu_of(pid: int) -> float:
    """A running process' CPU seconds so far (user+sys, from /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def drift_block(
    work: Path,
    yaml_path: Path,
    state: Path,
    files: list[tuple[str, str]],
    n: int,
    http: bool,
    seed: int,
) -> tuple[list[float], int, dict[str, float]]:
    """One agent, `n` trials: latencies, trials capped, and what the clients got
    and the agent's CPU seconds during the trials."""
    name = "http" if http else "plain"
    status = work / f"status-{name}"
    status.unlink(missing_ok=True)
    cmd = [EVERGRAPH, "run", str(yaml_path), "--state-dir", str(state)]
    cmd += ["--converged-status-file", str(status), "--converged-timeout", "0.2"]
    clients = None
    if http:
        port = free_port()
        cmd += ["--http", f"127.0.0.1:{port}"]
        clients = Clients(port)
    with open(work / f"drift-{name}.log", "ab") as log:
        p = spawn(cmd, stdout=log, stderr=log)
    try:
        wait_converged(p, status)
        cpu0 = cpu_of(p.pid)
        lat, capped = trials(files, n, seed=seed)
        cpu = cpu_of(p.pid) - cpu0
        if p.poll() is not None:
            raise RuntimeError(f"the agent exited with status {p.returncode} during the trials")
    finally:
        rc = stop(p, grace=5.0)
        if clients is not None:
            clients.close()
    if rc != 0:
        raise RuntimeError(f"the agent exited with status {rc} on SIGTERM")
    verify(files)
    got: dict[str, float] = {"cpu_s": cpu}
    if clients is not None:
        got.update(scrapes=clients.scrapes, sse_events=clients.events)
    return lat, capped, got


def drift(
    work: Path, yaml_path: Path, state: Path, files: list[tuple[str, str]], blocks: int, n: int
) -> dict[str, dict[str, Any]]:
    """`blocks` agents per variant, alternating (so a busy moment of the machine
    does not fall on one variant only), `n` trials each, pooled."""
    lat: dict[str, list[float]] = {"plain": [], "http": []}
    capped = {"plain": 0, "http": 0}
    cpu = {"plain": 0.0, "http": 0.0}
    scrapes = events = 0
    for b in range(blocks):
        for name in ("plain", "http"):
            got, c, more = drift_block(work, yaml_path, state, files, n, name == "http", b)
            lat[name] += got
            capped[name] += c
            cpu[name] += more["cpu_s"]
            scrapes += int(more.get("scrapes", 0))
            events += int(more.get("sse_events", 0))
    out = {}
    for name, xs in lat.items():
        out[name] = {
            "trials": blocks * n,
            "repaired": len(xs),
            "capped": capped[name],
            "p50_s": percentile(xs, 50),
            "p99_s": percentile(xs, 99),
            "max_s": max(xs),
            "cpu_per_trial_s": cpu[name] / (blocks * n),
            "samples": xs,
        }
    out["http"].update(scrapes=scrapes, sse_events=events)
    return out


def run(quick: bool) -> tuple[dict[str, Any], str]:
    reps = 3 if quick else 7
    blocks, per_block = (2, 25) if quick else (4, 50)
    n_trials = blocks * per_block
    work = temp_dir_until_exit("/var/tmp")
    files = layout(work / "target", N_FILES)
    sub = work / "in"
    sub.mkdir()
    yaml_path, _ = write_inputs(sub, files)
    state = work / "state"
    run_timed([EVERGRAPH, "run", str(yaml_path), "--converged-exit", "--state-dir", str(state)])
    verify(files)
    nc = no_change(work, yaml_path, state, reps)
    print(f"  http no change: {fmt_s(nc['plain_s'])} -> {fmt_s(nc['http_s'])}", file=sys.stderr)
    d = drift(work, yaml_path, state, files, blocks, per_block)
    plain, http = d["plain"], d["http"]
    rows = []

    def ratio_row(case: str, a: float, b: float, target: bool) -> None:
        ratio = b / a
        rows.append(
            [
                case,
                fmt_s(a),
                fmt_s(b),
                f"{(ratio - 1) * 100:+.1f} %",
                "<= +5 %" if target else "-",
                yes_no(ratio <= TARGET) if target else "-",
            ]
        )

    ratio_row(
        f"no change: loaded -> converged (median of {reps})",
        nc["plain_engine_s"],
        nc["http_engine_s"],
        True,
    )
    ratio_row(f"no change: whole process (median of {reps})", nc["plain_s"], nc["http_s"], False)
    ratio_row("no change: agent CPU (user+sys)", nc["plain_cpu_s"], nc["http_cpu_s"], False)
    ratio_row("drift repair p50", plain["p50_s"], http["p50_s"], False)
    ratio_row("drift repair p99", plain["p99_s"], http["p99_s"], True)
    ratio_row(
        "drift: agent CPU per trial",
        plain["cpu_per_trial_s"],
        http["cpu_per_trial_s"],
        False,
    )
    header = [
        "case (10,000 files, ext4)",
        "no --http",
        "--http + clients",
        "change",
        "target",
        "met?",
    ]
    title = (
        f"--http overhead: scraper every {SCRAPE_EVERY * 1000:g} ms + one SSE client; "
        f"{nc['scrapes_per_run']} scrapes and {nc['sse_events_per_run']} SSE events per "
        f"no-change run; drift: {http['scrapes']} scrapes, {http['sse_events']} SSE events, "
        f"repaired {plain['repaired']}/{n_trials} and {http['repaired']}/{n_trials}"
    )
    result = {"no_change": nc, "drift_plain": plain, "drift_http": http, "target_ratio": TARGET}
    return result, table(title, header, rows)


if __name__ == "__main__":
    _clients_main(int(sys.argv[1]))
