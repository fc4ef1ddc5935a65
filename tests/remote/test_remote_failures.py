"""How `evergraph remote` fails a host, over real sshds (tests/kit/sshbed.py): a
wrong user, a port nobody answers on, a host that wants a password, a host whose
python3 differs — each is one line naming the host, exit 4, and the other hosts
converge; and an interrupted initiator or a cut link leaves no agent behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from evergraph.remote.bundle import running_python
from tests.conftest import SIGINT_DEFAULT, wait_for
from tests.kit.sshbed import SshBed, SshHost
from tests.remote.test_remote import (
    _orphans,
    graph_file,
    host_cmdlines,
    hosts_of,
    pytestmark,
    remote,
    remote_argv,
)

__all__ = ["pytestmark"]


def recap_line(out: str, h: SshHost, port: int = 22) -> str:
    """The one recap line of `h` in the initiator's output."""
    label = h.addr if port == 22 else f"{h.addr}:{port}"
    lines = [line for line in out.splitlines() if line.startswith(f"{label}: ")]
    assert len(lines) == 1, out
    return lines[0]


def assert_converged(out: str, *hosts: SshHost) -> None:
    for h in hosts:
        assert recap_line(out, h) == f"{h.addr}: converged", out
        assert (h.files / h.addr).read_text() == f"{h.addr}\n"


def test_a_user_unknown_or_without_our_key_fails_that_host_naming_host_and_user(
    sshbed: Callable[[int], SshBed], tmp_path: Path
) -> None:
    bed = sshbed(3)
    h0, h1, h2 = bed.hosts
    h1.add_user("alice")
    h1.configure_sshd("Match User alice\n    AuthorizedKeysFile none")
    file = graph_file(tmp_path, bed.files)
    argv = remote_argv(bed, file, f"nosuch@{h0.addr}", f"alice@{h1.addr}", f"root@{h2.addr}")
    out = remote(argv, tmp_path)
    assert out.returncode == 4, out.stdout + out.stderr
    for h, user in ((h0, "nosuch"), (h1, "alice")):
        line = recap_line(out.stdout, h)
        assert line.startswith(f"{h.addr}: unreachable: "), line
        assert f"user {user}" in line, line
        assert not (h.files / h.addr).exists()
    assert_converged(out.stdout, h2)
    assert "total: 3 host(s): 1 converged, 2 unreachable" in out.stdout


def test_a_port_refused_or_dropped_fails_that_host_in_one_line(
    sshbed: Callable[[int], SshBed], tmp_path: Path
) -> None:
    bed = sshbed(3)
    h0, h1, h2 = bed.hosts
    h1.drop("tcp dport 22")  # a firewall: no answer at all, not even a refusal
    file = graph_file(tmp_path, bed.files)
    argv = remote_argv(bed, file, f"root@{h0.addr}:2222", f"root@{h1.addr}", f"root@{h2.addr}")
    out = remote(argv, tmp_path)
    assert out.returncode == 4, out.stdout + out.stderr
    refused = recap_line(out.stdout, h0, 2222)
    assert refused.startswith(f"{h0.addr}:2222: unreachable: "), refused
    assert "refused" in refused.lower(), refused
    dropped = recap_line(out.stdout, h1)
    # the connection time-out (5 s) ended it: an answer that never comes is no hang
    assert dropped.startswith(f"{h1.addr}: unreachable: no SSH answer within 5 s"), dropped
    assert_converged(out.stdout, h2)


def test_a_host_that_wants_a_password_fails_saying_so_and_never_prompts(
    sshbed: Callable[[int], SshBed], tmp_path: Path
) -> None:
    bed = sshbed(2)
    h0, h1 = bed.hosts
    h0.add_user("bob")
    h0.configure_sshd(
        "Match User bob\n"
        "    PubkeyAuthentication no\n"
        "    PasswordAuthentication yes\n"
        "    KbdInteractiveAuthentication yes"
    )
    file = graph_file(tmp_path, bed.files)
    out = remote(remote_argv(bed, file, f"bob@{h0.addr}", f"root@{h1.addr}"), tmp_path)
    assert out.returncode == 4, out.stdout + out.stderr
    line = recap_line(out.stdout, h0)
    assert line.startswith(f"{h0.addr}: unreachable: "), line
    assert "needs a password for user bob" in line, line
    assert "assword:" not in out.stdout + out.stderr  # no prompt was shown
    assert_converged(out.stdout, h1)


#: a `python3` that says it is Python 3.9 (the real one runs its -c program with
#: sys.version_info replaced): what a host with another Python answers
OTHER_PYTHON = """\
#!/usr/bin/python3
import sys
args = sys.argv[1:]
while args and args[0] == "-I":
    args = args[1:]
assert args[0] == "-c", args
sys.argv = ["-c", *args[2:]]
sys.version_info = (3, 9, 18, "final", 0)
exec(compile(args[1], "<string>", "exec"), {"__name__": "__main__"})
"""


def test_a_host_whose_python_differs_fails_naming_both_versions(
    sshbed: Callable[[int], SshBed], tmp_path: Path
) -> None:
    bed = sshbed(2)
    h0, h1 = bed.hosts
    h0.put_on_path("python3", OTHER_PYTHON)
    file = graph_file(tmp_path, bed.files)
    out = remote(remote_argv(bed, file, *hosts_of(bed)), tmp_path)
    assert out.returncode == 4, out.stdout + out.stderr
    line = recap_line(out.stdout, h0)
    assert line.startswith(f"{h0.addr}: unreachable: "), line
    here = running_python()
    assert "python 3.9" in line, line
    assert f"python{here}" in line, line
    assert f"install python{here} on {h0.addr}" in line, line
    assert not (h0.var_lib / "remote" / "bundles").exists()  # nothing was sent
    assert_converged(out.stdout, h1)


def _spawn(argv: list[str], tmp: Path) -> subprocess.Popen[bytes]:
    """`argv` with SIGINT at its default, however the tests were started (a test run
    in the background of a script ignores SIGINT, and so would the initiator: its
    Ctrl-C would do nothing and the run go on to its end, 60 s later); its output in
    tmp/initiator.out."""
    env = {**os.environ, "SSH_AUTH_SOCK": "", "HOME": str(tmp), "TMPDIR": str(tmp)}
    with (tmp / "initiator.out").open("wb") as out:
        return subprocess.Popen([*SIGINT_DEFAULT, *argv], stdout=out, stderr=out, env=env)


def _spawn_initiator(bed: SshBed, tmp: Path) -> subprocess.Popen[bytes]:
    """The initiator on every host of `bed`, its exec sleeping 60 s (see `_spawn`)."""
    file = graph_file(tmp, bed.files, sleep=60)
    return _spawn(remote_argv(bed, file, *hosts_of(bed)), tmp)


def test_the_initiator_takes_ctrl_c_even_when_the_tests_were_started_ignoring_it(
    tmp_path: Path,
) -> None:
    # as under `scripts/test &` from a script: every process of the run ignores SIGINT
    check = "import signal; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)"
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        probe = _spawn([sys.executable, "-c", check], tmp_path)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert probe.wait(timeout=30) == 0
    assert (tmp_path / "initiator.out").read_text() == "True\n"


def _sleeping(h: SshHost) -> bool:
    return any(b"sleep\x0060" in c for c in host_cmdlines(h))


def _agent_gone(h: SshHost) -> bool:
    return not any(b"evergraph" in c or b"sleep\x0060" in c for c in host_cmdlines(h))


def test_ctrl_c_of_the_initiator_exits_130_and_leaves_no_agent(
    sshbed: Callable[[int], SshBed], tmp_path: Path
) -> None:
    bed = sshbed(2)
    initiator = _spawn_initiator(bed, tmp_path)
    try:
        wait_for(lambda: all(map(_sleeping, bed.hosts)), timeout=120, what="the exec everywhere")
        initiator.send_signal(signal.SIGINT)
        assert initiator.wait(timeout=60) == 130
        wait_for(lambda: all(map(_agent_gone, bed.hosts)), timeout=10, what="no agent left")
        wait_for(lambda: not _orphans(tmp_path), timeout=10, what="the initiator's etcd gone")
    finally:
        if initiator.poll() is None:
            initiator.kill()
            initiator.wait()


def test_a_cut_link_ends_that_hosts_agent_and_fails_the_host(
    sshbed: Callable[[int], SshBed], tmp_path: Path
) -> None:
    bed = sshbed(2)
    h0, h1 = bed.hosts
    initiator = _spawn_initiator(bed, tmp_path)
    try:
        wait_for(lambda: all(map(_sleeping, bed.hosts)), timeout=120, what="the exec everywhere")
        h0.cut_from_client()
        # the wrapper misses the initiator's heartbeats: the agent ends within 10 s
        wait_for(lambda: _agent_gone(h0), timeout=20, what="h0's agent gone")
        # and the initiator, its keepalives unanswered, fails that host alone
        output = tmp_path / "initiator.out"
        wait_for(
            lambda: f"{h0.addr} | connection lost" in output.read_text(),
            timeout=30,
            what="h0's connection given up",
        )
        assert initiator.poll() is None, output.read_text()
        assert _sleeping(h1)  # the other host goes on
    finally:
        if initiator.poll() is None:
            initiator.kill()
            initiator.wait()
