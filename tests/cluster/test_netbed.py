"""The multi-host test bed itself (tests/kit/netbed.py): hosts reach each other over
the bridge, each has its own hostname, a partition cuts traffic both ways and heal
restores it, and closing the bed leaves no process and no namespace behind."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import wait_for
from tests.kit.netbed import NetBed, NetHost, _claim_subnet, _namespaces

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not all(map(shutil.which, ("ip", "nsenter", "unshare", "nft"))),
    reason="needs root, ip, nsenter, unshare and nft (Debian nftables)",
)

#: a listener that says when it listens, then answers one line per connection
LISTEN = """
import socket, sys
s = socket.socket(); s.bind(("0.0.0.0", 7000)); s.listen()
print("listening", flush=True)
while True:
    c, _ = s.accept(); c.sendall(socket.gethostname().encode() + b"\\n"); c.close()
"""
#: connect to argv[1]:7000 and print the answer, or the error
CONNECT = """
import socket, sys
try:
    with socket.create_connection((sys.argv[1], 7000), timeout=float(sys.argv[2])) as c:
        print(c.makefile().readline().strip())
except OSError as e:
    print("failed", type(e).__name__)
"""


def listen(h: NetHost, tmp: Path) -> None:
    log = tmp / f"{h.name}-listen.log"
    proc = h.spawn(sys.executable, "-c", LISTEN, log=log)

    def up() -> bool:
        assert proc.poll() is None, log.read_text()
        return "listening" in log.read_text()

    wait_for(up, what=f"the listener in {h.name}")


def connect(src: NetHost, dst: NetHost, timeout: float = 10) -> str:
    return src.run(sys.executable, "-c", CONNECT, dst.addr, str(timeout)).stdout.strip()


def test_hosts_reach_each_other_and_have_their_names(
    netbed: Callable[[int], NetBed], tmp_path: Path
) -> None:
    bed = netbed(3)
    assert [h.name for h in bed.hosts] == ["h0", "h1", "h2"]
    for h in bed.hosts:
        assert h.run("hostname").stdout.strip() == h.name
        assert f"inet {h.cidr}" in h.run("ip", "-o", "addr", "show", "eth0").stdout
        assert h.state_dir.is_dir()
        assert h.state_dir.is_relative_to(tmp_path)
        listen(h, tmp_path)
    # the answer is the listener's own hostname: the connection crossed the bridge
    assert connect(bed.hosts[0], bed.hosts[1]) == "h1"
    assert connect(bed.hosts[1], bed.hosts[2]) == "h2"
    assert connect(bed.hosts[2], bed.hosts[0]) == "h0"
    # the machine's own network is not on the bridge
    assert (
        bed.hosts[0].addr
        not in subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout
    )


def test_partition_cuts_both_ways_and_heal_restores(
    netbed: Callable[[int], NetBed], tmp_path: Path
) -> None:
    h0, h1, h2 = netbed(3).hosts
    for h in (h0, h1, h2):
        listen(h, tmp_path)
    h0.partition(h1)
    # a dropped SYN is never answered: the connect runs into its own timeout
    assert connect(h0, h1, timeout=1) == "failed TimeoutError"
    assert connect(h1, h0, timeout=1) == "failed TimeoutError"
    # the others still talk
    assert connect(h2, h0) == "h0"
    assert connect(h1, h2) == "h2"
    h0.heal()
    assert connect(h0, h1) == "h1"
    assert connect(h1, h0) == "h0"
    for h in (h0, h1):
        assert "drop" not in h.run("nft", "list", "ruleset").stdout


def alive(pid: int) -> bool:
    """`pid` runs (a zombie waiting for init to reap it does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow  # the bed gives the stubborn process its 5 s of grace
def test_kill9_and_close_leave_nothing(tmp_path: Path) -> None:
    with NetBed(2, tmp=tmp_path) as bed:
        h0 = bed.hosts[0]
        victim = h0.spawn("sleep", "infinity")
        h0.kill9(victim)
        assert victim.returncode == -9
        # a process ignoring SIGTERM, with a child in its process group
        stubborn = h0.spawn(
            "sh", "-c", "trap '' TERM; sleep infinity & echo $!; wait", log=tmp_path / "s.log"
        )
        wait_for(lambda: (tmp_path / "s.log").read_text().strip() != "", what="the child's pid")
        child = int((tmp_path / "s.log").read_text())
        assert alive(child)
        assert sorted(ns for ns in _namespaces() if ns.startswith(bed.prefix)) == [
            f"{bed.prefix}-h0",
            f"{bed.prefix}-h1",
            f"{bed.prefix}-sw",
        ]
    assert stubborn.returncode == -9
    assert not alive(child)
    assert not [ns for ns in _namespaces() if ns.startswith(bed.prefix)]


def test_a_failed_start_cleans_up(tmp_path: Path) -> None:
    bed = NetBed(2, tmp=tmp_path)
    bed.hosts[1].name = "h1 bad"  # `ip link add vh1 bad` fails in the middle of the start
    with pytest.raises(RuntimeError), bed:
        pass
    assert not [ns for ns in _namespaces() if ns.startswith(bed.prefix)]


def test_two_beds_side_by_side(netbed: Callable[[int], NetBed], tmp_path: Path) -> None:
    a, b = netbed(1), netbed(1)
    assert a.prefix != b.prefix
    assert a.subnet != b.subnet
    assert a.hosts[0].run("hostname").stdout.strip() == "h0"
    assert b.hosts[0].run("hostname").stdout.strip() == "h0"


def test_a_subnet_held_by_a_bed_of_another_process_is_not_taken() -> None:
    """The subnet is claimed across processes (xdist workers have consecutive pids:
    a key from the pid and a count alone met), and free again once let go."""
    first = 0x4242
    code = (
        "import sys; from tests.kit.netbed import _claim_subnet; "
        f"key, claim = _claim_subnet({first}); print(key, flush=True); sys.stdin.read()"
    )
    repo = Path(__file__).resolve().parents[2]
    with subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=repo,
    ) as held:
        assert held.stdout is not None
        taken = int(held.stdout.readline())  # (`first`, unless a bed running holds it)
        key, claim = _claim_subnet(taken)
        claim.close()
        assert key != taken
        assert held.stdin is not None
        held.stdin.close()  # (it lets go)
        assert held.wait(timeout=30) == 0
    key, claim = _claim_subnet(taken)  # (its process is gone: so is its claim)
    claim.close()
    assert key == taken
