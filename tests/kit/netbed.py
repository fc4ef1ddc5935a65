"""A multi-host test bed for the cluster tests: n "hosts", each a network
namespace (`ip netns`) with its own mount and UTS namespaces and hostname, all
plugged by veth pairs into one bridge that lives in a "switch" namespace of its
own, so nothing of the bed touches the machine's network. Partitions are
nftables rules inside the hosts' namespaces. Everything a bed makes (processes,
namespaces, the bridge and the veths with them) goes when it closes, and, through
a module registry and `atexit`, when a crashed test never closed it."""

from __future__ import annotations

import atexit
import itertools
import os
import signal
import socket
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Protocol, TypeVar

import pytest

#: how long a spawned process may take to go after SIGTERM before SIGKILL
GRACE = 5.0
_counter = itertools.count()


class _Closable(Protocol):
    def close(self) -> None: ...


#: beds not closed yet (these and the kits' built on them), closed at exit
_open: list[_Closable] = []


def _ip(*args: str, ns: str | None = None, input: str | None = None) -> None:
    argv = ["ip", *(["-n", ns] if ns else []), *args]
    r = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {r.returncode}: {r.stderr.strip()}")


def _namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]


def _stop(proc: subprocess.Popen[bytes], grace: float = GRACE) -> None:
    """SIGTERM the process group `proc` leads, SIGKILL it after `grace` seconds (and
    always once the leader is gone, for children it left behind)."""
    _killpg(proc, signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        pass
    _killpg(proc, signal.SIGKILL)
    proc.wait()


def _killpg(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


class NetHost:
    """One host of a bed: `run`/`spawn` put commands into its namespaces."""

    def __init__(self, bed: NetBed, index: int) -> None:
        self.bed = bed
        self.name = f"h{index}"
        self.ns = f"{bed.prefix}-{self.name}"
        self.addr = f"{bed.subnet}.{index + 1}"  # the IP alone, for URLs
        self.cidr = f"{self.addr}/24"
        self.state_dir = bed.tmp / self.name
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._anchor: subprocess.Popen[bytes] | None = None

    def _start(self) -> None:
        _ip("netns", "add", self.ns)
        _ip("link", "set", "lo", "up", ns=self.ns)
        veth = f"v{self.name}"
        _ip(
            "link",
            "add",
            veth,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            self.ns,
            ns=self.bed.switch,
        )
        _ip("link", "set", veth, "master", "br0", "up", ns=self.bed.switch)
        _ip("addr", "add", self.cidr, "dev", "eth0", ns=self.ns)
        _ip("link", "set", "eth0", "up", ns=self.ns)
        # The anchor holds the host's mount and UTS namespaces (with the hostname
        # set) for as long as the bed lives; every command enters them with nsenter.
        self._anchor = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                self.ns,
                "unshare",
                "--mount",
                "--uts",
                "sh",
                "-ec",
                f"hostname {self.name}; echo ready; exec sleep infinity",
            ],
            stdout=subprocess.PIPE,
            start_new_session=True,
        )
        assert self._anchor.stdout is not None
        if self._anchor.stdout.readline() != b"ready\n":
            raise RuntimeError(f"{self.name}: namespaces did not come up")

    def _enter(self, argv: tuple[str, ...]) -> list[str]:
        assert self._anchor is not None, "the bed is not started"
        pid = str(self._anchor.pid)
        return ["nsenter", "-t", pid, "-n", "-m", "-u", f"--wd={os.getcwd()}", "--", *argv]

    def run(
        self, *argv: str, env: dict[str, str] | None = None, check: bool = True, timeout: float = 30
    ) -> subprocess.CompletedProcess[str]:
        """`argv` inside this host, to completion; its output captured."""
        r = subprocess.run(
            self._enter(argv), env=env, capture_output=True, text=True, timeout=timeout
        )
        if check and r.returncode != 0:
            raise AssertionError(f"{self.name}: {argv} exited {r.returncode}: {r.stderr}")
        return r

    def spawn(
        self, *argv: str, log: Path | None = None, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        """`argv` inside this host in a process group of its own (nsenter execs it: the
        Popen's pid is the process); output to `log`. The bed stops it on close."""
        out: IO[bytes] | int = subprocess.DEVNULL
        if log is not None:
            out = open(log, "ab")  # noqa: SIM115 - the child holds it; ours closes below
        try:
            proc = subprocess.Popen(
                self._enter(argv),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        finally:
            if not isinstance(out, int):
                out.close()
        self.bed._procs.append(proc)
        return proc

    def kill9(self, proc: subprocess.Popen[bytes]) -> None:
        """SIGKILL `proc` and its process group: a crash, no clean stop."""
        _killpg(proc, signal.SIGKILL)
        proc.wait()

    def partition(self, *others: NetHost) -> None:
        """Drop every packet between this host and `others` (both ways, in both)."""
        for o in others:
            self.bed._cuts.add(frozenset((self.name, o.name)))
        for h in (self, *others):
            h._apply_rules()

    def heal(self) -> None:
        """Remove every cut involving this host."""
        cut = {c for c in self.bed._cuts if self.name in c}
        self.bed._cuts -= cut
        for h in self.bed.hosts:
            if any(h.name in c for c in cut) or h is self:
                h._apply_rules()

    def _apply_rules(self) -> None:
        peers = sorted(
            h.addr for h in self.bed.hosts if frozenset((self.name, h.name)) in self.bed._cuts
        )
        rules = "flush ruleset\n"
        if peers:
            s = ", ".join(peers)
            hook = "type filter hook {} priority 0;"
            rules += (
                "table inet netbed {\n"
                f"  chain input {{ {hook.format('input')} ip saddr {{ {s} }} drop; }}\n"
                f"  chain output {{ {hook.format('output')} ip daddr {{ {s} }} drop; }}\n"
                "}\n"
            )
        r = subprocess.run(
            ["ip", "netns", "exec", self.ns, "nft", "-f", "-"],
            input=rules,
            capture_output=True,
            text=True,
            timeout=30,
        )
        if r.returncode != 0:
            raise RuntimeError(f"{self.name}: nft failed: {r.stderr.strip()}\n{rules}")

    def _close(self) -> None:
        if self._anchor is not None:
            _stop(self._anchor, grace=0)
            assert self._anchor.stdout is not None
            self._anchor.stdout.close()


class NetBed:
    """`n` hosts h0..h{n-1} on one bridge; a context manager (see the module doc)."""

    def __init__(self, n: int, *, tmp: Path, prefix: str | None = None) -> None:
        k = next(_counter)
        # unique per process and bed, so parallel runs and xdist workers never meet
        self.prefix = prefix or f"nb{os.getpid()}x{k}"
        key, self._claim = _claim_subnet((os.getpid() * 16 + k) & 0xFFFF)
        self.subnet = f"10.{key >> 8}.{key & 0xFF}"
        self.switch = f"{self.prefix}-sw"
        self.tmp = tmp
        self._procs: list[subprocess.Popen[bytes]] = []
        self._cuts: set[frozenset[str]] = set()
        self.hosts = [NetHost(self, i) for i in range(n)]

    def __enter__(self) -> NetBed:
        _open.append(self)
        try:
            _ip("netns", "add", self.switch)
            _ip("link", "set", "lo", "up", ns=self.switch)
            _ip("link", "add", "br0", "type", "bridge", ns=self.switch)
            _ip("link", "set", "br0", "up", ns=self.switch)
            for h in self.hosts:
                h._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop every spawned process, then delete the namespaces (the veths and the
        bridge go with them); raises if any namespace of the bed is left."""
        if self in _open:
            _open.remove(self)
        for p in self._procs:
            _stop(p)
        for h in self.hosts:
            h._close()
        mine = [ns for ns in _namespaces() if ns.startswith(f"{self.prefix}-")]
        for ns in mine:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        left = [ns for ns in _namespaces() if ns.startswith(f"{self.prefix}-")]
        if left:
            raise RuntimeError(f"netbed {self.prefix}: namespaces left: {left}")
        self._claim.close()  # (the subnet is free again: nothing of the bed is left)


def _claim_subnet(first: int) -> tuple[int, socket.socket]:
    """A subnet key (10.<hi>.<lo>) no other bed of any process holds, from `first`
    on, and its claim: a unix socket bound in the abstract namespace, which the
    kernel frees with the process, so a crashed test leaves nothing. (A key from the
    pid and a count alone met: an SshBed's address is on the machine's own network,
    and xdist workers have consecutive pids, so a worker's 17th bed had its
    neighbour's first subnet.)"""
    for i in range(0x10000):
        key = (first + i) & 0xFFFF
        claim = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # (not inherited)
        try:
            claim.bind(f"\0evergraph-netbed-{key}")
        except OSError:  # held by another bed
            claim.close()
            continue
        return key, claim
    raise RuntimeError("netbed: every subnet 10.x.y is held by a bed")


@atexit.register
def _close_all() -> None:
    for bed in list(_open):
        try:
            bed.close()
        except Exception:  # clean up the rest whatever one leaves
            pass


B = TypeVar("B", bound="_Closable")


def started_beds(
    make: Callable[[int, Path], B], tmp: Path, label: str
) -> Iterator[Callable[[int], B]]:
    """A fixture's body: `make(n, dir)` beds on demand (numbered dirs under `tmp`),
    every one closed at the end; the first error a close raised is raised after all
    were closed."""
    beds: list[B] = []

    def start(n: int) -> B:
        bed = make(n, tmp / f"{label}{len(beds)}")
        beds.append(bed)
        return bed

    try:
        yield start
    finally:
        errors = []
        for bed in beds:
            try:
                bed.close()
            except RuntimeError as e:
                errors.append(e)
        if errors:
            raise errors[0]


@pytest.fixture
def netbed(tmp_path: Path) -> Iterator[Callable[[int], NetBed]]:
    """`netbed(n)`: a started bed of n hosts, closed when the test ends."""
    yield from started_beds(lambda n, d: NetBed(n, tmp=d).__enter__(), tmp_path, "bed")
