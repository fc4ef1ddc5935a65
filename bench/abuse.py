"""Issue 23: drift repair and /healthz while HTTP clients abuse the agent.

One agent on the W1 10k files with `--http`, twice per block, alternating: once
left alone, once while a client process holds 1,500 idle connections open and
streams 1 MiB request bodies (each read in full, parsed in a thread, refused
400) back to back. In both, random files are rewritten (as bench/drift.py) and
timed until repaired; under abuse, the client process also GETs /healthz every
50 ms on a fresh connection and times it.

Targets (issue 23): drift repair p99 under abuse within 10 % of the agent left
alone; /healthz p99 under 1 s (the agent's loop never stalls 100 ms on a
client's account).
"""

from __future__ import annotations

import contextlib
import json
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
from bench.http import cpu_of, free_port

N_FILES = 10_000
IDLE = 1500
BODY = b'{"Priority": 4, "Caps": {"board": "' + b"x" * ((1 << 20) - 64) + b'"}}'


class Abuse:
    """The abusing client, in a process of its own (its threads would otherwise
    hold this process's GIL while the trials time repairs)."""

    def __init__(self, port: int) -> None:
        self.stats: dict[str, Any] = {}
        cmd = [PYTHON, "-m", "bench.abuse", str(port)]
        self.proc = spawn(cmd, stdout=subprocess.PIPE, cwd=str(REPO))
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != b"ready":
            raise RuntimeError("the abusing client did not start")

    def close(self) -> None:
        stop(self.proc, grace=20.0)
        assert self.proc.stdout is not None
        out = self.proc.stdout.read().decode().strip()
        self.proc.stdout.close()
        if out:
            self.stats = json.loads(out.splitlines()[-1])


def _abuse_main(port: int) -> None:
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, IDLE + 500), hard))
    base = f"http://127.0.0.1:{port}"
    # wait for the agent to listen
    while not stopped.is_set():
        try:
            httpx.get(f"{base}/healthz", timeout=1)
            break
        except httpx.HTTPError:
            stopped.wait(0.05)
    idle = []
    for _ in range(IDLE):
        s = socket.socket()
        s.setblocking(False)
        with contextlib.suppress(BlockingIOError, OSError):
            s.connect(("127.0.0.1", port))
        idle.append(s)
    healthz: list[float] = []
    failures = {"healthz": 0, "bodies": 0}
    bodies = [0]

    def stream() -> None:
        with httpx.Client(base_url=base, timeout=30) as c:
            while not stopped.is_set():
                try:
                    c.post("/api/v1/reqs/", content=BODY)
                    bodies[0] += 1
                except httpx.HTTPError:
                    failures["bodies"] += 1

    def probe() -> None:
        while not stopped.is_set():
            t0 = time.perf_counter()
            try:
                r = httpx.get(f"{base}/healthz", timeout=5)
                if r.status_code == 200:
                    healthz.append(time.perf_counter() - t0)
                else:
                    failures["healthz"] += 1
            except httpx.HTTPError:
                failures["healthz"] += 1
            stopped.wait(0.05)

    threads = [threading.Thread(target=stream, daemon=True), threading.Thread(target=probe)]
    for t in threads:
        t.start()
    print("ready", flush=True)
    stopped.wait()
    threads[1].join()
    for s in idle:
        s.close()
    print(
        json.dumps(
            {
                "healthz_n": len(healthz),
                "healthz_p50_s": percentile(healthz, 50) if healthz else None,
                "healthz_p99_s": percentile(healthz, 99) if healthz else None,
                "healthz_max_s": max(healthz) if healthz else None,
                "bodies": bodies[0],
                "failures": failures,
            }
        ),
        flush=True,
    )
    os._exit(0)


def block(
    work: Path,
    yaml_path: Path,
    state: Path,
    files: list[tuple[str, str]],
    n: int,
    abused: bool,
    seed: int,
) -> tuple[list[float], dict[str, Any]]:
    name = "abused" if abused else "alone"
    status = work / f"status-{name}"
    status.unlink(missing_ok=True)
    port = free_port()
    cmd = [EVERGRAPH, "run", str(yaml_path), "--state-dir", str(state), "--http"]
    cmd += [f"127.0.0.1:{port}", "--farm-anonymous", "bench"]
    cmd += ["--converged-status-file", str(status), "--converged-timeout", "0.2"]
    with open(work / f"agent-{name}.log", "ab") as log:
        p = spawn(cmd, stdout=log, stderr=log)
    abuse = None
    try:
        wait_converged(p, status)
        if abused:
            abuse = Abuse(port)
        cpu0 = cpu_of(p.pid)
        lat, _capped = trials(files, n, seed=seed)
        cpu = cpu_of(p.pid) - cpu0
        if p.poll() is not None:
            raise RuntimeError(f"the agent exited with status {p.returncode} during the trials")
    finally:
        if abuse is not None:
            abuse.close()
        stop(p, grace=10.0)
    verify(files)
    return lat, {"cpu_s": cpu, **(abuse.stats if abuse is not None else {})}


def run(quick: bool) -> tuple[dict[str, Any], str]:
    blocks, per_block = (1, 25) if quick else (3, 50)
    work = temp_dir_until_exit("/var/tmp")
    files = layout(work / "target", N_FILES)
    sub = work / "in"
    sub.mkdir()
    yaml_path, _ = write_inputs(sub, files)
    state = work / "state"
    run_timed([EVERGRAPH, "run", str(yaml_path), "--converged-exit", "--state-dir", str(state)])
    lat: dict[str, list[float]] = {"alone": [], "abused": []}
    got: list[dict[str, Any]] = []
    for b in range(blocks):
        for abused in (False, True):
            xs, more = block(work, yaml_path, state, files, per_block, abused, b)
            lat["abused" if abused else "alone"] += xs
            if abused:
                got.append(more)
    hz = [g["healthz_p99_s"] for g in got if g.get("healthz_p99_s") is not None]
    out = {
        name: {"p50_s": percentile(xs, 50), "p99_s": percentile(xs, 99), "samples": xs}
        for name, xs in lat.items()
    }
    out["abuse"] = {"blocks": got}
    ratio = out["abused"]["p99_s"] / out["alone"]["p99_s"]
    rows = [
        ["drift repair p50", fmt_s(out["alone"]["p50_s"]), fmt_s(out["abused"]["p50_s"]), "-"],
        [
            "drift repair p99",
            fmt_s(out["alone"]["p99_s"]),
            fmt_s(out["abused"]["p99_s"]),
            f"{(ratio - 1) * 100:+.1f} % ({yes_no(ratio <= 1.10)} <= +10 %)",
        ],
        [
            "/healthz p99 (worst block)",
            "-",
            fmt_s(max(hz)) if hz else "-",
            yes_no(bool(hz) and max(hz) < 1.0) + " < 1 s",
        ],
        ["1 MiB bodies refused meanwhile", "-", str(sum(g.get("bodies", 0) for g in got)), "-"],
    ]
    text = table(
        f"abuse: {N_FILES} files, {IDLE} idle connections + a stream of 1 MiB bodies, "
        f"{blocks}x{per_block} drift trials per variant",
        ["case", "alone", "abused", "target"],
        rows,
    )
    return out, text


if __name__ == "__main__":
    _abuse_main(int(sys.argv[1]))
