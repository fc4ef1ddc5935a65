"""sysctl: the timeline inside a network namespace (net.* parameters are per
namespace) and a private mount namespace with a tmpfs over /etc/sysctl.d, so the
host's kernel values and files are never touched: apply, drift from outside (through
nsenter), the poll and the inotify watch repair it, a clean re-check, reversal; bad
input refused (exit 2) with nothing changed."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import EVERGRAPH, status_lines, wait_for
from tests.kit.kinds import refused

FORWARD = "net.ipv4.ip_forward"
PORTS = "net.ipv4.ip_local_port_range"
CONF = "/etc/sysctl.d/99-net.ipv4.ip_forward.conf"

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0
    or not shutil.which("unshare")
    or not shutil.which("nsenter")
    or not os.path.isdir("/etc/sysctl.d"),
    reason="needs root, unshare, nsenter and /etc/sysctl.d to mount a tmpfs over",
)

#: run the rest in a new network namespace and a private mount namespace whose
#: /etc/sysctl.d is an empty tmpfs
IN_NS = [
    "unshare",
    "--net",
    "--mount",
    "--propagation",
    "private",
    "sh",
    "-c",
    # not forwarding to begin with: a new namespace copies the host's ip_forward,
    # which a container engine or libvirtd on the machine may have turned on
    'mount -t tmpfs none /etc/sysctl.d && echo 0 > /proc/sys/net/ipv4/ip_forward && exec "$@"',
    "sh",
]


def proc(name: str) -> str:
    return "/proc/sys/" + name.replace(".", "/")


def fresh_defaults() -> tuple[str, str]:
    """The values a new network namespace of these tests starts with (ip_forward
    set to 0, as IN_NS does)."""
    out = subprocess.run(
        [
            *("unshare", "--net", "sh", "-c"),
            f"echo 0 > {proc(FORWARD)} && cat {proc(FORWARD)} {proc(PORTS)}",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    return out[0], out[1]


def in_ns(pid: int, *cmd: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["nsenter", "-t", str(pid), "-n", "-m", *map(str, cmd)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def value(pid: int, name: str) -> str:
    r = in_ns(pid, "cat", proc(name))
    assert r.returncode == 0, r.stderr
    return r.stdout.rstrip("\n")


class NsAgent:
    """`evergraph run` in its own network and mount namespaces."""

    def __init__(self, g: Path, state: Path) -> None:
        state.mkdir(parents=True, exist_ok=True)
        self.status = state / "converged.status"
        self.log = state / "agent.log"
        self._logf = open(self.log, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [
                *IN_NS,
                *EVERGRAPH,
                "run",
                str(g),
                "--state-dir",
                str(state),
                "--converged-timeout",
                "0.05",
                "--converged-status-file",
                str(self.status),
            ],
            stdout=self._logf,
            stderr=subprocess.STDOUT,
        )
        self.pid = self.proc.pid  # unshare and sh exec: the agent keeps the pid

    def wait_converged(self) -> None:
        def ok() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"agent exited early:\n{self.log.read_text()}")
            lines = status_lines(self.status)
            return bool(lines) and lines[-1] == "true"

        wait_for(ok, 30, "converged")

    def conf(self) -> Path:
        """The persisted file as the agent's mount namespace sees it."""
        return Path(f"/proc/{self.pid}/root{CONF}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._logf.close()
        return self.proc.returncode


@pytest.fixture
def ns_agents() -> Iterator[list[NsAgent]]:
    started: list[NsAgent] = []
    yield started
    for a in started:
        a.stop()


def write(g: Path, body: str) -> Path:
    g.write_text("graph: s\nresources:\n  sysctl:\n" + body)
    return g


GRAPH = (
    f"  - {{name: {FORWARD}, value: '1', interval: 0.05, meta: {{reverse: true}}}}\n"
    f"  - {{name: {PORTS}, value: '40000 50000', persist: false, interval: 0.05,"
    " meta: {reverse: true}}\n"
)


def test_timeline_in_a_network_namespace(tmp_path: Path, ns_agents: list[NsAgent]) -> None:
    forward0, ports0 = fresh_defaults()
    assert forward0 != "1"
    host_forward = Path(proc(FORWARD)).read_text()
    g = write(tmp_path / "g.yaml", GRAPH)
    agent = NsAgent(g, tmp_path / "s")
    ns_agents.append(agent)
    agent.wait_converged()
    assert value(agent.pid, FORWARD) == "1"
    assert value(agent.pid, PORTS) == "40000\t50000"  # the kernel's form matches ours
    assert agent.conf().read_text() == f"{FORWARD} = 1\n"
    # the host is untouched: its value, and no file in its /etc/sysctl.d
    assert Path(proc(FORWARD)).read_text() == host_forward
    assert not Path(CONF).exists()

    # drift of the runtime values from outside: /proc/sys has no inotify, the poll sees it
    assert in_ns(agent.pid, "sh", "-c", f"echo 0 > {proc(FORWARD)}").returncode == 0
    assert in_ns(agent.pid, "sh", "-c", f"echo '30000 31000' > {proc(PORTS)}").returncode == 0
    wait_for(lambda: value(agent.pid, FORWARD) == "1", what="ip_forward repaired")
    wait_for(lambda: value(agent.pid, PORTS) == "40000\t50000", what="port range repaired")
    # drift of the persisted file: inotify
    new = Path(f"/proc/{agent.pid}/root/etc/sysctl.d/new")
    new.write_text(f"{FORWARD} = 0\n")
    new.rename(agent.conf())
    wait_for(lambda: agent.conf().read_text() == f"{FORWARD} = 1\n", what="file repaired")
    agent.conf().unlink()
    wait_for(agent.conf().exists, what="file made again")

    # a re-check in the same namespaces: nothing would change (noop exits 3 if it would)
    r = in_ns(
        agent.pid, *EVERGRAPH, "run", g, "--state-dir", tmp_path / "s2", "--noop", "--no-watch"
    )
    assert r.returncode == 0, r.stderr
    assert "nothing would change or failed, 2 clean" in r.stderr, r.stderr

    # reversal: both leave the graph; the values found come back, the file goes
    g.write_text("graph: s\nresources: {}\n")
    wait_for(lambda: value(agent.pid, FORWARD) == forward0, what="ip_forward reversed")
    wait_for(lambda: value(agent.pid, PORTS) == ports0, what="port range reversed")
    wait_for(lambda: not agent.conf().exists(), what="persisted file removed")
    assert agent.stop() == 0
    log = agent.log.read_text()
    assert f"sysctl[{FORWARD}]: left the graph: reversed" in log, log
    assert f"sysctl[{PORTS}]: left the graph: reversed" in log, log
    assert log.count(f"sysctl[{FORWARD}]: applied") == 4, log  # start, 3 drifts


def test_unknown_parameter_is_a_failure_naming_it(tmp_path: Path) -> None:
    g = write(
        tmp_path / "g.yaml", "  - {name: net.ipv4.no_such_thing, value: '1', persist: false}\n"
    )
    r = subprocess.run(
        [*IN_NS, *EVERGRAPH, "run", g, "--state-dir", tmp_path / "s", "--converged-exit"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1
    assert "/proc/sys/net/ipv4/no_such_thing does not exist" in r.stderr


BAD_INPUT = [
    ("  - {name: net/ipv4/ip_forward, value: '1'}\n", "name: 'net/ipv4/ip_forward' contains a"),
    ("  - {name: net..ip_forward, value: '1'}\n", "is not a dotted name"),
    (f"  - {{name: {FORWARD}, value: ''}}\n", ".value: is empty"),
    (f"  - {{name: {FORWARD}, value: ' 1'}}\n", "leading/trailing whitespace"),
    (
        f"  - {{name: {FORWARD}, value: '1', runtime: false, persist: false}}\n",
        ".runtime: and persist are both false",
    ),
    (f"  - {{name: {FORWARD}, value: '1', path: rel.conf}}\n", "is not an absolute file"),
    (f"  - {{name: {FORWARD}, value: '1', path: /etc/sysctl.d/x}}\n", "does not end in .conf"),
    (f"  - {{name: {FORWARD}, value: '1', interval: 0}}\n", ".interval: must be between"),
    (f"  - {{name: {FORWARD}, value: '1', unpersist: true}}\n", "cannot be combined"),
    (f"  - {{name: {FORWARD}, value: '1', persistent: true}}\n", "persistent"),
]


@pytest.mark.parametrize(("body", "needle"), BAD_INPUT)
def test_bad_input_exit_2_nothing_changed(tmp_path: Path, body: str, needle: str) -> None:
    # a good resource beside the bad one: it must not be applied either
    good = f"  - {{name: {PORTS}, value: '40000 50000'}}\n"
    g = write(tmp_path / "g.yaml", good + body)
    # in process, as `evergraph check` loads it; one of them end to end: exit 2,
    # nothing changed
    if not refused(g, needle, end_to_end=(body, needle) == BAD_INPUT[0]):
        return
    r = subprocess.run(
        [
            "unshare",
            "--net",
            "--mount",
            "sh",
            "-c",
            'mount -t tmpfs none /etc/sysctl.d && "$@"; echo "rc=$?";'
            f" cat {proc(PORTS)}; ls -A /etc/sysctl.d",
            "sh",
            *EVERGRAPH,
            "run",
            str(g),
            "--state-dir",
            str(tmp_path / "s"),
            "--converged-exit",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert needle in r.stderr, r.stderr
    assert r.stdout.splitlines() == ["rc=2", fresh_defaults()[1]]  # no value, no file


@pytest.mark.parametrize("name", ["kernel.hostname", "kernel.domainname"])
def test_uts_names_are_repaired_by_the_kernels_event(tmp_path: Path, name: str) -> None:
    """kernel.hostname and kernel.domainname signal changes (POLLPRI): drift is repaired
    at once though the read interval is an hour (the other entries have no event: the
    timeline above sees them by reading). In a new UTS namespace: the host's names are
    never touched."""
    host_value = Path(proc(name)).read_text()
    g = write(
        tmp_path / "g.yaml",
        f"  - {{name: {name}, value: egtest-want, persist: false, interval: 3600}}\n",
    )
    state = tmp_path / "s"
    state.mkdir()
    status = state / "converged.status"
    with open(state / "agent.log", "w") as log:
        agent = subprocess.Popen(
            [
                "unshare",
                "--uts",
                *EVERGRAPH,
                "run",
                str(g),
                "--state-dir",
                str(state),
                "--converged-timeout",
                "0.05",
                "--converged-status-file",
                str(status),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:

        def uts(*cmd: str) -> str:
            r = subprocess.run(
                ["nsenter", "-t", str(agent.pid), "-u", *cmd],
                capture_output=True,
                text=True,
                timeout=30,
            )
            assert r.returncode == 0, r.stderr
            return r.stdout

        def now() -> str:
            return uts("cat", proc(name)).rstrip("\n")

        wait_for(lambda: now() == "egtest-want", what=f"{name} set")
        for drift in ("egtest-drift", "egtest-again"):
            uts("sh", "-c", f"echo {drift} > {proc(name)}")
            wait_for(lambda: now() == "egtest-want", timeout=5, what=f"{name} repaired")
        assert Path(proc(name)).read_text() == host_value
    finally:
        agent.send_signal(signal.SIGTERM)
        try:
            agent.wait(10)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait()
    text = (state / "agent.log").read_text()
    assert agent.returncode == 0, text
    assert text.count(f"sysctl[{name}]: applied") == 3, text  # start, 2 drifts
