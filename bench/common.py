"""Shared helpers: temp dirs, child processes, statistics, tables, machine facts."""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
EVERGRAPH = str(VENV_BIN / "evergraph")
PYTHON = sys.executable

#: every temp dir and child process we made, so a crash or ^C still cleans up
_DIRS: set[Path] = set()
_PROCS: dict[int, subprocess.Popen[bytes]] = {}


@contextlib.contextmanager
def temp_dir(base: str, prefix: str = "evergraph-bench-") -> Iterator[Path]:
    """A fresh directory under `base` (e.g. /var/tmp or /dev/shm), removed afterwards."""
    d = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
    _DIRS.add(d)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)
        _DIRS.discard(d)


def temp_dir_until_exit(base: str, prefix: str = "evergraph-bench-") -> Path:
    """A fresh directory under `base`, removed only when the whole run ends (see files.py:
    deleting many files makes ext4-without-journal slow to create files for a minute)."""
    d = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
    _DIRS.add(d)
    return d


def spawn(cmd: Sequence[str], **kw: object) -> subprocess.Popen[bytes]:
    """Start a child process we must stop (by PID) before we exit."""
    p: subprocess.Popen[bytes] = subprocess.Popen(list(cmd), **kw)  # type: ignore[call-overload]
    _PROCS[p.pid] = p
    return p


def stop(p: subprocess.Popen[bytes], grace: float = 3.0) -> int | None:
    """SIGTERM the child by PID, SIGKILL it after `grace` seconds; returns its status."""
    try:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGTERM)
            try:
                p.wait(grace)
            except subprocess.TimeoutExpired:
                os.kill(p.pid, signal.SIGKILL)
                p.wait()
        return p.returncode
    finally:
        _PROCS.pop(p.pid, None)


def standalone(run: Callable[[], tuple[dict[str, Any], str]], json_path: Path | None) -> int:
    """A bench run on its own (`python -m bench.X`): cleaned up at exit or SIGTERM,
    its table printed, its results written to `json_path` if given."""
    import atexit
    import json

    atexit.register(cleanup_all)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    res, text = run()
    print(text)
    if json_path is not None:
        json_path.write_text(json.dumps(res, indent=2) + "\n")
    return 0


def cleanup_all() -> None:
    """At exit (normal, error or SIGTERM): stop our children, remove our temp dirs."""
    for p in list(_PROCS.values()):
        with contextlib.suppress(OSError):
            stop(p, grace=1.0)
    for d in list(_DIRS):
        shutil.rmtree(d, ignore_errors=True)
        _DIRS.discard(d)


def wait_exit(p: subprocess.Popen[bytes], timeout: float) -> int | None:
    """Block until the child exits (its status) or `timeout` passes (None).

    Popen.wait(timeout) polls with sleeps of up to 50 ms, which would quantize
    our timings; a pidfd becomes readable the moment the child exits.
    """
    fd = os.pidfd_open(p.pid)
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        if not poller.poll(timeout * 1000):
            return None
    finally:
        os.close(fd)
    return p.wait()


def run_timed(cmd: Sequence[str], log: Path | None = None, timeout: float = 300) -> float:
    """Run a whole process; wall seconds from fork to exit. Raises on a non-zero status."""
    out = open(log, "ab") if log is not None else subprocess.DEVNULL  # noqa: SIM115
    try:
        t0 = time.perf_counter()
        p = spawn(cmd, stdout=out, stderr=out)
        rc = wait_exit(p, timeout)
        took = time.perf_counter() - t0
        if rc is None:
            stop(p)
            raise RuntimeError(f"timed out after {timeout}s: {' '.join(cmd)}")
        _PROCS.pop(p.pid, None)
    finally:
        if log is not None:
            out.close()  # type: ignore[union-attr]
    if rc != 0:
        tail = log.read_text(errors="replace")[-2000:] if log is not None else ""
        raise RuntimeError(f"exit status {rc}: {' '.join(cmd)}\n{tail}")
    return took


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def percentile(xs: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty sample."""
    s = sorted(xs)
    k = max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))
    return s[k]


def fs_type(path: str | Path) -> str:
    """Filesystem type of the mount holding `path` (longest mount-point prefix)."""
    p = os.path.realpath(path)
    best, kind = "", "?"
    with open("/proc/self/mounts") as f:
        for line in f:
            parts = line.split()
            mnt = parts[1].replace("\\040", " ")
            inside = p == mnt or p.startswith(mnt.rstrip("/") + "/")
            if inside and len(mnt) >= len(best):
                best, kind = mnt, parts[2]
    return kind


def fmt_s(x: float | None) -> str:
    if x is None:
        return "-"
    if x < 0.01:
        return f"{x * 1000:.2f} ms"
    if x < 1:
        return f"{x * 1000:.0f} ms"
    return f"{x:.2f} s"


def fmt_ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}x"


def yes_no(met: bool | None) -> str:
    return "-" if met is None else ("yes" if met else "NO")


def table(title: str, header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Plain-text table, columns aligned; text left, everything else right."""
    widths = [len(h) for h in header]
    for r in rows:
        for i, c in enumerate(r):
            widths[i] = max(widths[i], len(c))

    def line(cells: Sequence[str]) -> str:
        out = []
        for i, c in enumerate(cells):
            out.append(c.ljust(widths[i]) if i == 0 else c.rjust(widths[i]))
        return "  ".join(out).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([title, line(header), sep, *(line(r) for r in rows)])


def machine() -> dict[str, str]:
    def sh(*cmd: str) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, check=False).stdout.strip()
        except OSError:
            return "?"

    mem = sh("free", "-h").splitlines()
    return {
        "nproc": sh("nproc"),
        "mem_total": mem[1].split()[1] if len(mem) > 1 else "?",
        "kernel": sh("uname", "-r"),
        "python3": sh("python3", "-V"),
        "venv_python": sys.version.split()[0],
        "cpu": _cpu_model(),
    }


def git_state() -> dict[str, str | bool]:
    """The commit measured, and whether src/ had uncommitted changes at the time."""

    def git(*args: str) -> str:
        p = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=False)
        return p.stdout.strip()

    return {
        "commit": git("rev-parse", "--short", "HEAD") or "?",
        "subject": git("log", "-1", "--format=%s"),
        "src_dirty": bool(git("status", "--porcelain", "--", "src")),
    }


def _cpu_model() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "?"


def tool_venv(
    venv: Path, requirements: Path, dists: Sequence[str], who: str
) -> tuple[Path, dict[str, str]]:
    """A venv of its own for a tool compared against (`venv`, gitignored), made (or
    made again when `requirements` changed) with pip; the project's .venv is never
    touched. Returns its bin dir and the installed version of each of `dists`."""
    want = hashlib.sha256(requirements.read_bytes()).hexdigest()
    stamp = venv / "requirements.sha256"
    bin_dir = venv / "bin"
    if not stamp.exists() or stamp.read_text().strip() != want:
        print(
            f"{who}: making {venv.relative_to(REPO)} from "
            f"{requirements.relative_to(REPO)} (pip; the project's .venv is not touched)",
            file=sys.stderr,
            flush=True,
        )
        shutil.rmtree(venv, ignore_errors=True)
        base = getattr(sys, "_base_executable", sys.executable)
        subprocess.run([base, "-m", "venv", str(venv)], check=True, timeout=300)
        subprocess.run(
            [str(bin_dir / "pip"), "install", "-q", "-r", str(requirements)],
            check=True,
            timeout=900,
        )
        stamp.write_text(want + "\n")
    else:
        print(f"{who}: using {venv.relative_to(REPO)}", file=sys.stderr, flush=True)
    versions = {}
    for dist in dists:
        code = f"import importlib.metadata as m; print(m.version({dist!r}))"
        out = subprocess.run(
            [str(bin_dir / "python"), "-c", code],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
        versions[dist] = out.stdout.strip()
    return bin_dir, versions
