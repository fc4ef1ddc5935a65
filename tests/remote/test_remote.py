"""`evergraph remote` end to end over real sshds (tests/kit/sshbed.py): hosts with
nothing of evergraph converge a graph, a second run sends only hashes, host keys are
strict, a bad graph connects nowhere, and a killed initiator leaves no agent."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from evergraph.errors import InputError
from evergraph.remote.target import Target
from tests.conftest import wait_for
from tests.kit.sshbed import SSHD, SshBed, SshHost
from tests.remote.test_sshbed import run_on

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.geteuid() != 0
        or not all(map(shutil.which, ("ip", "nsenter", "unshare", "nft", "ssh-keygen")))
        or not os.access(SSHD, os.X_OK),
        reason="needs root, ip, nsenter, unshare, nft and Debian's openssh-server",
    ),
]

EVERGRAPH = [sys.executable, "-m", "evergraph.cli.main"]


def graph_file(tmp: Path, files: Path, *, sleep: int = 0) -> Path:
    """A Python graph: a file named after the host holding its name, then an exec."""
    path = tmp / "site.py"
    cmd = f"sleep {sleep}" if sleep else f"touch {files}/ran"
    path.write_text(
        "def graph(g, world):\n"
        f"    g.add('file', 'name', path='{files}/' + world.host, content=world.host + '\\n')\n"
        f"    g.add('exec', 'mark', cmd='{cmd}', creates='{files}/ran')\n"
    )
    return path


def remote_argv(
    bed: SshBed,
    file: Path,
    *hosts: str,
    known: Path | None = None,
    converged_timeout: float | None = None,
) -> list[str]:
    """The command line of a run on `bed`; `converged_timeout` None: the CLI's
    default end (coordinated: the session ends once every host converged)."""
    argv = [
        *EVERGRAPH,
        "remote",
        str(file),
        *hosts,
        "--ssh-key",
        str(bed.client_key),
        "--known-hosts",
        str(known or bed.known_hosts),
    ]
    if converged_timeout is not None:
        argv += ["--converged-timeout", f"{converged_timeout:g}"]
    return argv


def remote(argv: list[str], tmp: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SSH_AUTH_SOCK": "", "HOME": str(tmp), "TMPDIR": str(tmp)}
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)


def hosts_of(bed: SshBed) -> list[str]:
    return [f"root@{h.addr}" for h in bed.hosts]


def test_target_parsing() -> None:
    assert Target.parse("web1") == Target("web1")
    assert Target.parse("root@10.0.0.1:2222") == Target("10.0.0.1", 2222, "root")
    assert Target.parse("[::1]:22").host == "::1"
    for bad in ("", "a b", "@x", "h:0", "h:x", "h:70000", "-h"):
        with pytest.raises(InputError):
            Target.parse(bad)


def test_three_hosts_converge_and_a_second_run_sends_only_hashes(
    sshbed: Callable[[int], SshBed], tmp_path: Path
) -> None:
    bed = sshbed(3)
    file = graph_file(tmp_path, bed.files)
    before = [h.bytes_received() for h in bed.hosts]
    first = remote(remote_argv(bed, file, *hosts_of(bed)), tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    middle = [h.bytes_received() for h in bed.hosts]
    for h in bed.hosts:
        assert (h.files / h.addr).read_text() == f"{h.addr}\n"
        assert (h.files / "ran").exists()
        assert f"{h.addr}: converged" in first.stdout
        assert f"{h.addr} | " in first.stdout
    assert "total: 3 host(s): 3 converged" in first.stdout
    assert "evergraph-converged" not in first.stdout  # the agents' reports are not shown
    # an explicit --converged-timeout: each agent ends by itself, as before
    second = remote(remote_argv(bed, file, *hosts_of(bed), converged_timeout=1), tmp_path)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "total: 3 host(s): 3 converged" in second.stdout
    after = [h.bytes_received() for h in bed.hosts]
    for b, m, a in zip(before, middle, after, strict=True):
        assert a - m <= (m - b) / 100, (m - b, a - m)


def test_an_unknown_host_key_fails_that_host_naming_its_fingerprint(
    sshbed: Callable[[int], SshBed], tmp_path: Path
) -> None:
    bed = sshbed(3)
    h0 = bed.hosts[0]
    known = tmp_path / "known_hosts"
    known.write_text(bed.known_hosts_without(h0).read_text())
    file = graph_file(tmp_path, bed.files)
    out = remote(remote_argv(bed, file, *hosts_of(bed), known=known), tmp_path)
    assert out.returncode == 4, out.stdout + out.stderr
    failed = [line for line in out.stdout.splitlines() if line.startswith(f"{h0.addr}: ")]
    assert len(failed) == 1
    assert "unreachable: unknown host key" in failed[0]
    assert h0.host_key_fingerprint in failed[0]
    assert not (h0.files / h0.addr).exists()
    for h in bed.hosts[1:]:
        assert f"{h.addr}: converged" in out.stdout
        assert (h.files / h.addr).read_text() == f"{h.addr}\n"
    assert h0.host_key_line not in known.read_text()  # nothing recorded without the flag

    # trust on first use: the key is recorded and the host converges
    argv = [*remote_argv(bed, file, f"root@{h0.addr}", known=known), "--accept-new-host-keys"]
    out = remote(argv, tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"{h0.addr} {h0.host_key_line}" in known.read_text()
    assert (h0.files / h0.addr).read_text() == f"{h0.addr}\n"


def test_a_graph_that_fails_to_load_is_bad_input_and_connects_nowhere(
    sshbed: Callable[[int], SshBed], tmp_path: Path
) -> None:
    bed = sshbed(2)
    bad = tmp_path / "bad.yaml"
    bad.write_text("resources:\n  file:\n  - name: x\n    nosuch: 1\n")
    logs = [h.log.read_text() for h in bed.hosts]
    rx = [h.bytes_received() for h in bed.hosts]
    out = remote(remote_argv(bed, bad, *hosts_of(bed)), tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.startswith("evergraph: ")
    assert len(out.stderr.splitlines()) == 1
    assert out.stdout == ""
    assert [h.log.read_text() for h in bed.hosts] == logs
    # the bed's own chatter (neighbour discovery) is far below one SSH handshake
    assert all(h.bytes_received() - b < 2_000 for h, b in zip(bed.hosts, rx, strict=True))
    # and a connection is what the logs would show
    asyncio.run(run_on(bed, bed.hosts[0], "true", bed.known_hosts))
    assert bed.hosts[0].log.read_text() != logs[0]
    # a bad HOST is bad input too, before any connection
    out = remote(remote_argv(bed, graph_file(tmp_path, bed.files), "root@h:99999"), tmp_path)
    assert out.returncode == 2, out.stderr
    assert len(out.stderr.splitlines()) == 1, out.stderr


def test_kill_9_of_the_initiator_leaves_no_agent_on_any_host(
    sshbed: Callable[[int], SshBed], tmp_path: Path
) -> None:
    bed = sshbed(3)
    file = graph_file(tmp_path, bed.files, sleep=60)
    env = {**os.environ, "SSH_AUTH_SOCK": "", "HOME": str(tmp_path), "TMPDIR": str(tmp_path)}
    initiator = subprocess.Popen(
        remote_argv(bed, file, *hosts_of(bed)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    try:

        def sleeping(h: SshHost) -> bool:
            return any(b"sleep\x0060" in c for c in host_cmdlines(h))

        wait_for(lambda: all(map(sleeping, bed.hosts)), timeout=120, what="the exec on every host")
        assert all(any(b"evergraph" in c for c in host_cmdlines(h)) for h in bed.hosts)
        initiator.kill()
        initiator.wait()

        def none_left() -> bool:
            left = [c for h in bed.hosts for c in host_cmdlines(h)]
            return not any(b"evergraph" in c or b"sleep\x0060" in c for c in left)

        wait_for(none_left, timeout=10, what="no evergraph process on any host")
        # and the initiator's own etcd went with it (its parent-death signal)
        wait_for(lambda: not _orphans(tmp_path), timeout=10, what="the initiator's etcd gone")
    finally:
        if initiator.poll() is None:
            initiator.kill()
            initiator.wait()
        for pid in _orphans(tmp_path):  # (only if the check above failed)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def host_cmdlines(h: SshHost) -> list[bytes]:
    """The command lines of the processes in `h` (its network namespace: the hosts
    share the machine's pid namespace, so `pgrep` in one would see every host's)."""
    out = subprocess.run(
        ["ip", "netns", "pids", h.net.ns], capture_output=True, text=True, timeout=30
    ).stdout
    lines = []
    for pid in out.split():
        try:
            lines.append(Path(f"/proc/{pid}/cmdline").read_bytes())
        except OSError:
            pass
    return lines


def _orphans(tmp: Path) -> list[int]:
    """Processes of the initiator's etcd (its data dir is under `tmp`)."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmdline = (d / "cmdline").read_bytes()
            state = (d / "stat").read_text().split(") ", 1)[1][:1]
        except (OSError, IndexError):
            continue
        if b"etcd" in cmdline and str(tmp).encode() in cmdline and state != "Z":
            found.append(int(d.name))
    return found
