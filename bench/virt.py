"""Benchmark: the virt kind on a real libvirtd (issue 27).

The bed is tests/kit/libvirtbed.py's own (`LibvirtBed`, under its machine-wide
lock `LOCK`, taken here as the `libvirtbed` fixture takes it): a private
libvirtd (or the machine's own, reused and never stopped), TCG guests booting
Debian's kernel directly with a busybox initramfs, 128 MiB each.

Measured:
(a) drift repair latency: an agent (`evergraph run`, one running domain) and
    out-of-band `virsh destroy` (then `virsh suspend`), TRIALS times each: the
    time from virsh's launch and from its return to the domain running again
    (libvirt's STARTED / RESUMED lifecycle event, seen by an observer of the
    bench's own on a connection of its own). The peer: a 1 s polling loop
    (Salt's beacon interval) with libvirt-python in a process of its own:
    every second, the domain's state; started (or resumed) if not running.
    Before each drift a random pause of 0-1 s (uniform), so the drift falls
    at any phase of the poller's second. The agent's repairs are counted in
    its log (one "started"/"resumed" line per drift expected).
(b) DOMAINS domains from nothing (defined + running) by an agent: seconds from
    its launch to its first converged; then a second agent over them (the
    no-change run): the same, and nothing started or defined in its log; and a
    one-shot `evergraph run --converged-exit` over them (wall time). The
    connections each agent held to libvirtd's socket: its socket fds (from
    /proc/PID/fd) whose peer is the socket's (from `ss -xn`).

`python -m bench.virt [--trials N] [--domains N] [--json F]` runs it alone;
`scripts/bench --only virt` with the defaults (`--quick`: 5 trials, 4
domains). Needs root, libvirtd, virtlogd, virsh, qemu-system-x86. At the end
every domain of the bench is destroyed and undefined, the agents and the
poller stopped by their pids, and the bed's libvirtd and virtlogd stopped by
theirs (the kit's teardown).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from bench.common import PYTHON, REPO, fmt_s, machine, percentile, spawn, stop, table, temp_dir

TRIALS = 50
DOMAINS = 20
#: the peer's polling interval (Salt's beacons: every second)
POLL = 1.0
#: the bench's domains (the kit's PREFIX: its teardown removes them whoever made them)
NAME = "evgt-bench"


def pythonpath() -> str:
    import evergraph

    src = str(Path(evergraph.__file__).resolve().parent.parent)
    return os.pathsep.join([src, str(REPO)])


def env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": pythonpath(), **extra}


# -- the bed (tests/kit/libvirtbed.py, as its fixture uses it) -----------------------
@contextlib.contextmanager
def libvirt_bed(base: Path) -> Iterator[Any]:
    from tests.kit.libvirtbed import libvirt_bed as kit_bed

    def wait() -> None:
        print("virt: waiting for the libvirtd lock", file=sys.stderr, flush=True)

    with kit_bed(lambda: Path(tempfile.mkdtemp(prefix="libvirt-", dir=base)), wait) as bed:
        yield bed


def socket_path(uri: str) -> str:
    m = re.search(r"socket=([^&]+)", uri)
    return m.group(1) if m else "/run/libvirt/libvirt-sock"


# -- an agent -------------------------------------------------------------------------
class Agent:
    """A background `evergraph run GRAPH` with a converged-status file."""

    def __init__(self, graph: Path, state: Path, extra_env: dict[str, str] | None = None) -> None:
        state.mkdir(parents=True, exist_ok=True)
        self.status = state / "converged.status"
        self.log = state / "agent.log"
        self.status.unlink(missing_ok=True)
        #: where this agent's lines begin in the log (a state dir's log is appended to)
        self.offset = self.log.stat().st_size if self.log.exists() else 0
        with open(self.log, "ab") as logf:
            self.t0 = time.monotonic()
            self.proc = spawn(
                [
                    PYTHON,
                    "-m",
                    "evergraph.cli.main",
                    "run",
                    str(graph),
                    "--state-dir",
                    str(state),
                    "--converged-timeout",
                    "0.05",
                    "--converged-status-file",
                    str(self.status),
                ],
                stdout=logf,
                stderr=subprocess.STDOUT,
                env=env(**(extra_env or {})),
                cwd=REPO,
            )

    def lines(self) -> list[str]:
        try:
            return self.status.read_text().split()
        except FileNotFoundError:
            return []

    def converged(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"the agent exited: {self.tail()}")
        ls = self.lines()
        return bool(ls) and ls[-1] == "true"

    def wait_converged(self, timeout: float) -> float:
        """Wait for it converged now; seconds since its launch."""
        wait(self.converged, timeout, "the agent converged")
        return time.monotonic() - self.t0

    def text(self) -> str:
        with open(self.log, "rb") as f:
            f.seek(self.offset)
            return f.read().decode(errors="replace")

    def count(self, what: str) -> int:
        return self.text().count(what)

    def tail(self, n: int = 20) -> str:
        return "\n".join(self.text().splitlines()[-n:])

    def stop(self) -> None:
        stop(self.proc, grace=15)


def wait(pred: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not after {timeout:g} s")
        time.sleep(0.005)


def unix_peers(pid: int, path: str) -> int:
    """How many of `pid`'s sockets are connected to the unix socket at `path`."""
    mine = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:["):
                mine.add(link[8:-1])
    out = subprocess.run(["ss", "-xn"], capture_output=True, text=True, check=True).stdout
    local_path: dict[str, str] = {}
    pairs: list[tuple[str, str]] = []
    for line in out.splitlines()[1:]:
        f = line.split()
        if len(f) < 8:
            continue
        local, linode, pinode = f[4], f[5], f[7]
        local_path[linode] = local
        pairs.append((linode, pinode))
    return sum(1 for lin, pin in pairs if lin in mine and local_path.get(pin) == path)


# -- the observer: libvirt's lifecycle events on a connection of the bench's own ----
class Events:
    """Events heard on another thread, (monotonic time, name, what), awaited by name."""

    def __init__(self) -> None:
        self.seen: list[tuple[float, str, object]] = []
        self.cond = threading.Condition()

    def add(self, name: str, what: object) -> None:
        t = time.monotonic()
        with self.cond:
            self.seen.append((t, name, what))
            self.cond.notify_all()

    def wait(self, name: str, whats: Sequence[object], since: float, timeout: float) -> float:
        """The time of the first of `whats` for `name` at or after `since`."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for t, n, w in self.seen:
                    if t >= since and n == name and w in whats:
                        return t
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{name}: no event {list(whats)} after {timeout:g} s")
                self.cond.wait(left)


class Observer:
    """Every lifecycle event of the URI's domains: (monotonic time, name, event)."""

    def __init__(self, uri: str) -> None:
        import libvirt

        self.lv = libvirt
        self.events = Events()
        self._stop = False
        libvirt.virEventRegisterDefaultImpl()
        self._loop = threading.Thread(target=self._run, daemon=True)
        self._loop.start()
        self.conn = libvirt.open(uri)
        self._cb = self.conn.domainEventRegisterAny(
            None, libvirt.VIR_DOMAIN_EVENT_ID_LIFECYCLE, self._event, None
        )

    def _run(self) -> None:
        while not self._stop:
            self.lv.virEventRunDefaultImpl()

    def _event(self, conn: Any, dom: Any, event: int, detail: int, opaque: Any) -> None:
        self.events.add(dom.name(), event)

    def wait(self, name: str, events: Sequence[int], since: float, timeout: float) -> float:
        """The time of the first of `events` for `name` at or after `since`."""
        return self.events.wait(name, events, since, timeout)

    def running(self, name: str) -> bool:
        with contextlib.suppress(self.lv.libvirtError):
            return bool(self.conn.lookupByName(name).state()[0] == self.lv.VIR_DOMAIN_RUNNING)
        return False

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.domainEventDeregisterAny(self._cb)
            self.conn.close()
        self._stop = True


# -- the peer: a 1 s polling loop with libvirt-python --------------------------------
def poll_main(argv: list[str]) -> int:
    """`python -m bench.virt poll URI NAME`: every POLL s, start (resume) NAME if not running."""
    import libvirt

    uri, name = argv
    conn = libvirt.open(uri)
    tick = time.monotonic()
    while True:
        with contextlib.suppress(libvirt.libvirtError):
            dom = conn.lookupByName(name)
            state = dom.state()[0]
            if state == libvirt.VIR_DOMAIN_PAUSED:
                dom.resume()
            elif state != libvirt.VIR_DOMAIN_RUNNING:
                dom.create()
        tick += POLL
        time.sleep(max(0.0, tick - time.monotonic()))


def guest_yaml(bed: Any, name: str, state: str = "running") -> str:
    return (
        f"  - name: {name}\n    uri: '{bed.uri}'\n    state: {state}\n"
        f"    memory: 131072\n    domaintype: qemu\n    kernel: {bed.kernel}\n"
        f"    initrd: {bed.initrd}\n    cmdline: console=ttyS0 quiet\n"
    )


def drift_trials(
    obs: Observer,
    virsh: Callable[..., Any],
    name: str,
    drift: str,
    trials: int,
    ready: Callable[[], bool],
) -> dict[str, list[float]]:
    """`virsh DRIFT NAME` `trials` times; seconds from its launch / return to running."""
    lv = obs.lv
    back = [lv.VIR_DOMAIN_EVENT_STARTED, lv.VIR_DOMAIN_EVENT_RESUMED]
    gone = [lv.VIR_DOMAIN_EVENT_STOPPED, lv.VIR_DOMAIN_EVENT_SUSPENDED]
    from_launch: list[float] = []
    from_done: list[float] = []
    from_event: list[float] = []
    for _ in range(trials):
        wait(lambda: obs.running(name) and ready(), 120, f"{name} running and settled")
        time.sleep(random.uniform(0, 1))
        began = time.monotonic()
        virsh(drift, name)
        done = time.monotonic()
        t = obs.wait(name, back, began, 60)
        from_launch.append(t - began)
        from_done.append(t - done)
        from_event.append(t - obs.wait(name, gone, began, 1))
    return {"from_launch": from_launch, "from_done": from_done, "from_event": from_event}


def repair_latency(bed: Any, tmp: Path, trials: int) -> dict[str, Any]:
    name = f"{NAME}-drift"
    graph = tmp / "one.yaml"
    graph.write_text("graph: g\nresources:\n  virt:\n" + guest_yaml(bed, name))
    obs = Observer(bed.uri)
    out: dict[str, Any] = {}
    try:
        agent = Agent(graph, tmp / "agent1")
        try:
            agent.wait_converged(120)
            starts0 = agent.count(f"virt[{name}]: started")
            for drift in ("destroy", "suspend"):
                print(f"virt: evergraph, {drift} x {trials}", file=sys.stderr, flush=True)
                out[f"evergraph_{drift}"] = drift_trials(
                    obs, bed.virsh, name, drift, trials, agent.converged
                )
                time.sleep(0.5)
            out["evergraph_repairs"] = {
                "destroy": agent.count(f"virt[{name}]: started") - starts0,
                "suspend": agent.count(f"virt[{name}]: resumed"),
                "errors": agent.count(" error: "),
            }
        finally:
            agent.stop()
        with open(tmp / "poll.log", "ab") as log:
            poller = spawn(
                [PYTHON, "-m", "bench.virt", "poll", bed.uri, name],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env(),
                cwd=REPO,
            )
        try:
            for drift in ("destroy", "suspend"):
                print(f"virt: 1 s poller, {drift} x {trials}", file=sys.stderr, flush=True)
                out[f"poll_{drift}"] = drift_trials(
                    obs, bed.virsh, name, drift, trials, lambda: poller.poll() is None
                )
        finally:
            stop(poller)
    finally:
        obs.close()
        bed.virsh("destroy", name, check=False)
        bed.virsh("undefine", name, check=False)
    return out


def many(bed: Any, tmp: Path, n: int) -> dict[str, Any]:
    names = [f"{NAME}-{i:02d}" for i in range(n)]
    graph = tmp / "many.yaml"
    graph.write_text(
        "graph: g\nresources:\n  virt:\n" + "".join(guest_yaml(bed, nm) for nm in names)
    )
    sock = socket_path(bed.uri)
    out: dict[str, Any] = {"domains": n}
    try:
        print(f"virt: {n} domains from nothing", file=sys.stderr, flush=True)
        first = Agent(graph, tmp / "many1")
        try:
            out["first_s"] = first.wait_converged(600)
            out["first_conns"] = unix_peers(first.proc.pid, sock)
            out["first_started"] = first.count(": started")
            out["first_errors"] = first.count(" error: ")
        finally:
            first.stop()
        out["running"] = sum(1 for nm in names if bed.state(nm) == "running")
        print(f"virt: no-change agent over {n}", file=sys.stderr, flush=True)
        second = Agent(graph, tmp / "many1")
        try:
            out["second_s"] = second.wait_converged(600)
            out["second_conns"] = unix_peers(second.proc.pid, sock)
            out["second_changed"] = second.count(": started") + second.count(": defined")
        finally:
            second.stop()
        t0 = time.monotonic()
        r = subprocess.run(
            [
                PYTHON,
                "-m",
                "evergraph.cli.main",
                "run",
                str(graph),
                "--state-dir",
                str(tmp / "many1"),
                "--converged-exit",
            ],
            capture_output=True,
            text=True,
            env=env(),
            cwd=REPO,
            timeout=600,
        )
        out["oneshot_s"] = time.monotonic() - t0
        out["oneshot_rc"] = r.returncode
        recap = [ln for ln in r.stderr.splitlines() if "recap:" in ln]
        out["oneshot_recap"] = recap[-1].split("recap:", 1)[1].strip() if recap else r.stderr[-300:]
    finally:
        for nm in names:
            bed.virsh("destroy", nm, check=False)
            bed.virsh("undefine", nm, check=False)
    return out


def drift_rows(
    res: dict[str, Any], tools: Sequence[tuple[str, str]], drifts: Sequence[str]
) -> list[list[str]]:
    rows = []
    for drift in drifts:
        for key, label in tools:
            d = res.get(f"{key}_{drift}")
            if not d:
                continue
            for frm in ("from_done", "from_launch", "from_event"):
                xs = d[frm]
                since = "its event" if frm == "from_event" else f"the command's {frm[5:]}"
                rows.append(
                    [
                        f"{label}: {drift}, from {since}",
                        str(len(xs)),
                        fmt_s(percentile(xs, 50)),
                        fmt_s(percentile(xs, 99)),
                        fmt_s(min(xs)),
                        fmt_s(max(xs)),
                    ]
                )
    return rows


def ratio_rows(res: dict[str, Any], peer: str, drifts: Sequence[str]) -> list[str]:
    notes = []
    for drift in drifts:
        a, b = res.get(f"evergraph_{drift}"), res.get(f"{peer}_{drift}")
        if a and b:
            for frm in ("from_done", "from_launch", "from_event"):
                r50 = percentile(a[frm], 50) / percentile(b[frm], 50)
                r99 = percentile(a[frm], 99) / percentile(b[frm], 99)
                notes.append(
                    f"evergraph/poller {drift} from {frm[5:]}: p50 {r50:.2f}x, p99 {r99:.2f}x"
                )
    return notes


def report(res: dict[str, Any]) -> str:
    header = ["what", "n", "p50", "p99", "min", "max"]
    tools = [("evergraph", "evergraph agent"), ("poll", "1 s poller")]
    rows = drift_rows(res.get("repair", {}), tools, ("destroy", "suspend"))
    text = table("virt: drift repair, out-of-band virsh -> running again (issue 27)", header, rows)
    notes = ratio_rows(res.get("repair", {}), "poll", ("destroy", "suspend"))
    rep = res.get("repair", {}).get("evergraph_repairs")
    if rep:
        notes.append(
            f"agent's repairs counted in its log: {rep['destroy']} starts, "
            f"{rep['suspend']} resumes; {rep['errors']} error lines"
        )
    m = res.get("many")
    if m:
        n = m["domains"]
        t2 = table(
            f"virt: {n} domains (TCG, 128 MiB, running)",
            ["run", "wall s", "libvirt connections", "changes"],
            [
                ["agent, from nothing to converged", f"{m['first_s']:.2f}",
                 str(m["first_conns"]), f"{m['first_started']} started"],
                ["agent, no change, to converged", f"{m['second_s']:.2f}",
                 str(m["second_conns"]), f"{m['second_changed']} started/defined"],
                ["run --converged-exit, no change", f"{m['oneshot_s']:.2f}", "-",
                 m["oneshot_recap"]],
            ],
        )  # fmt: skip
        notes.append(f"{m['running']}/{n} running after the first agent")
        text += "\n\n" + t2
    return text + "\n" + "\n".join(notes)


def run(
    quick: bool, trials: int | None = None, domains: int | None = None
) -> tuple[dict[str, Any], str]:
    trials = trials or (5 if quick else TRIALS)
    domains = domains or (4 if quick else DOMAINS)
    res: dict[str, Any] = {
        "machine": machine(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "load_before": os.getloadavg(),
        "trials": trials,
    }
    with temp_dir("/var/tmp", "bench-virt-") as tmp, libvirt_bed(tmp) as bed:
        tmp.chmod(0o755)
        res["uri"] = bed.uri
        res["repair"] = repair_latency(bed, tmp, trials)
        res["load_mid"] = os.getloadavg()
        res["many"] = many(bed, tmp, domains)
    res["load_after"] = os.getloadavg()
    return res, report(res)


def main(argv: list[str]) -> int:
    if argv and argv[0] == "poll":
        return poll_main(argv[1:])
    ap = argparse.ArgumentParser(prog="python -m bench.virt", description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=TRIALS)
    ap.add_argument("--domains", type=int, default=DOMAINS)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    from bench.common import standalone

    return standalone(lambda: run(False, a.trials, a.domains), a.json)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
