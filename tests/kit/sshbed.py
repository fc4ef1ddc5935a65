"""SSH hosts for the remote tests (issue 26): a NetBed (tests/kit/netbed.py) whose
hosts each run their own sshd (Debian's openssh-server, a config, host key and
pid file of its own in the test's tmp dir), reachable from the test's own network
namespace through an uplink veth plugged into the bed's bridge. The bed makes a
client key pair authorised for root on every host and a known_hosts file holding
every host's key. Each host sees a private `/var/lib/evergraph`, an empty home for
root and a private managed-files dir (`bed.files`, the same path on every host),
all bind mounts inside the host's mount namespace, so nothing of the machine is
written (but the empty mount point /var/lib/evergraph and sshd's /run/sshd, made
if missing). Closing
the bed stops every sshd and whatever their sessions left running, then closes
the NetBed (namespaces, veths and the uplink with them)."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import wait_for
from tests.kit.netbed import NetBed, NetHost, _ip, _open, _stop, started_beds

SSHD = "/usr/sbin/sshd"
#: where evergraph keeps its state on a host; private per host (a bind mount)
VAR_LIB = Path("/var/lib/evergraph")
PRIVSEP = Path("/run/sshd")

SSHD_CONFIG = """\
# a test sshd: one host of an SshBed (tests/kit/sshbed.py); nothing of /etc/ssh
Port 22
ListenAddress {addr}
HostKey {host_key}
PidFile {pid_file}
AuthorizedKeysFile {authorized_keys}
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
# the authorised keys live under /tmp (world-writable): the path check would refuse them
StrictModes no
Subsystem sftp internal-sftp
"""


def _keygen(path: Path, comment: str) -> None:
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
        check=True,
        capture_output=True,
        timeout=30,
    )


class SshHost:
    """One host of an SshBed: its NetHost (`net`) plus the sshd it runs."""

    def __init__(self, bed: SshBed, net: NetHost) -> None:
        self.bed = bed
        self.net = net
        self.name = net.name
        self.addr = net.addr
        self.ssh_port = 22
        #: the sshd's config, keys, pid file and log
        self.ssh_dir = net.state_dir / "ssh"
        #: what the host sees as /var/lib/evergraph, from the test's side
        self.var_lib = net.state_dir / "var-lib-evergraph"
        #: what the host sees at `bed.files`, from the test's side
        self.files = net.state_dir / "files"
        #: what the host sees as root's home (/root): empty, so a session's shell reads
        #: none of the machine's dotfiles (a pyenv init there costs seconds a command)
        self.home = net.state_dir / "root"
        self.host_key = self.ssh_dir / "ssh_host_ed25519_key"
        self.log = self.ssh_dir / "sshd.log"
        self.sshd: subprocess.Popen[bytes] | None = None

    @property
    def host_key_line(self) -> str:
        """`ssh-ed25519 AAAA…` (the public host key, without its comment)."""
        kind, blob, *_ = Path(f"{self.host_key}.pub").read_text().split()
        return f"{kind} {blob}"

    @property
    def host_key_fingerprint(self) -> str:
        """`SHA256:…` of the host key, as `ssh-keygen -lf` prints it."""
        out = subprocess.run(
            ["ssh-keygen", "-lf", f"{self.host_key}.pub"],
            check=True,
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
        return out.split()[1]

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """`argv` inside this host (see NetHost.run)."""
        return self.net.run(*argv, check=check)

    def bytes_received(self) -> int:
        """RX bytes of the host's eth0 so far: what was sent to it over the bed."""
        out = self.net.run("cat", "/sys/class/net/eth0/statistics/rx_bytes").stdout
        return int(out)

    def _start(self) -> None:
        for d in (self.ssh_dir, self.var_lib, self.files, self.home):
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.net.run("mount", "--bind", str(self.home), "/root")
        self.net.run("mount", "--bind", str(self.var_lib), str(VAR_LIB))
        self.net.run("mount", "--bind", str(self.files), str(self.bed.files))
        _keygen(self.host_key, self.name)
        config = self.ssh_dir / "sshd_config"
        config.write_text(
            SSHD_CONFIG.format(
                addr=self.addr,
                host_key=self.host_key,
                pid_file=self.ssh_dir / "sshd.pid",
                authorized_keys=self.bed.authorized_keys,
            )
        )
        self.sshd = self.net.spawn(SSHD, "-D", "-e", "-f", str(config), log=self.log)
        sshd = self.sshd

        def listening() -> bool:
            if sshd.poll() is not None:
                raise RuntimeError(f"{self.name}: sshd exited: {self.log.read_text()}")
            return f"Server listening on {self.addr} port 22" in self.log.read_text()

        wait_for(listening, what=f"sshd in {self.name}")

    def _restart_sshd(self) -> None:
        """Stop the listener and start it again on the (changed) config."""
        assert self.sshd is not None, "the host is not started"
        _stop(self.sshd)
        self.bed.net._procs.remove(self.sshd)
        config = self.ssh_dir / "sshd_config"
        ready = self.log.read_text().count(f"Server listening on {self.addr} port 22") + 1
        self.sshd = self.net.spawn(SSHD, "-D", "-e", "-f", str(config), log=self.log)
        sshd = self.sshd

        def listening() -> bool:
            if sshd.poll() is not None:
                raise RuntimeError(f"{self.name}: sshd exited: {self.log.read_text()}")
            return self.log.read_text().count(f"Server listening on {self.addr} port 22") >= ready

        wait_for(listening, what=f"sshd in {self.name} restarted")

    def configure_sshd(self, text: str) -> None:
        """Append `text` to the host's sshd_config (a `Match` block goes last, so
        append those last) and restart its sshd."""
        config = self.ssh_dir / "sshd_config"
        config.write_text(config.read_text() + text.rstrip("\n") + "\n")
        self._restart_sshd()

    def add_user(self, name: str, *, uid: int = 4242) -> None:
        """A user `name` on this host only (its /etc/passwd and /etc/shadow are copies
        bind-mounted in the host's mount namespace), with an empty home of its own.
        The bed's key is authorised for every user (one AuthorizedKeysFile): use
        `configure_sshd` with a `Match User` block to take it away."""
        home = self.net.state_dir / f"home-{name}"
        home.mkdir(mode=0o755, exist_ok=True)
        for table, line in (
            ("passwd", f"{name}:x:{uid}:65534::{home}:/bin/sh\n"),
            ("shadow", f"{name}:*:19000:0:99999:7:::\n"),
        ):
            copy = self.net.state_dir / f"etc-{table}"
            if not copy.exists():
                copy.write_text(Path(f"/etc/{table}").read_text())
                copy.chmod(0o644 if table == "passwd" else 0o640)
                self.net.run("mount", "--bind", str(copy), f"/etc/{table}")
            copy.write_text(copy.read_text() + line)

    def put_on_path(self, name: str, text: str) -> Path:
        """An executable `name` holding `text`, first in the PATH of every SSH session
        on this host (sshd's `SetEnv PATH=…`); its path."""
        bin_dir = self.net.state_dir / "shims"
        bin_dir.mkdir(mode=0o755, exist_ok=True)
        shim = bin_dir / name
        shim.write_text(text)
        shim.chmod(0o755)
        path = f"{bin_dir}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        self.configure_sshd(f"SetEnv PATH={path}")
        return shim

    def drop(self, rule: str) -> None:
        """Drop the packets `rule` matches (an nft match, e.g. `tcp dport 2222`) coming
        in or going out of this host, in a table of the kit's own (`NetHost.partition`
        flushes the whole ruleset: do not mix the two on one host)."""
        self.run("nft", "add", "table", "inet", "sshbed")
        for chain, hook in (("in", "input"), ("out", "output")):
            spec = f"{{ type filter hook {hook} priority 0; }}"
            self.run("nft", "add", "chain", "inet", "sshbed", chain, spec)
        self.run("nft", "add", "rule", "inet", "sshbed", "in", *rule.split(), "drop")
        out_rule = rule.replace("saddr", "daddr").replace("dport", "sport")
        self.run("nft", "add", "rule", "inet", "sshbed", "out", *out_rule.split(), "drop")

    def cut_from_client(self) -> None:
        """Drop every packet between this host and the test (a cut link)."""
        self.drop(f"ip saddr {self.bed.client_addr}")

    def _stop(self) -> None:
        """Stop the sshd, then kill what its sessions left in the host (a session's
        sshd makes a session of its own: the listener's process group misses it)."""
        if self.sshd is not None:
            _stop(self.sshd)
            self.bed.net._procs.remove(self.sshd)
            self.sshd = None
        keep = {p.pid for p in self.bed.net._procs if p.poll() is None}
        if self.net._anchor is not None:
            keep.add(self.net._anchor.pid)
        out = subprocess.run(
            ["ip", "netns", "pids", self.net.ns], capture_output=True, text=True, timeout=30
        ).stdout
        for pid in {int(p) for p in out.split()} - keep:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class SshBed:
    """`n` hosts h0..h{n-1}, each with an sshd; a context manager (see the module doc)."""

    def __init__(self, n: int, *, tmp: Path) -> None:
        self.tmp = tmp
        tmp.mkdir(parents=True, exist_ok=True)
        self.net = NetBed(n, tmp=tmp)
        self.hosts = [SshHost(self, h) for h in self.net.hosts]
        #: the test's own address on the bed's bridge (what the hosts see it as)
        self.client_addr = f"{self.net.subnet}.254"
        self._uplink = f"u{self.net.prefix.removeprefix('nb')}"[:15]
        #: the managed-files dir: the same path on every host, each host's own
        self.files = tmp / "files"
        self.client_key = tmp / "client_ed25519"
        self.authorized_keys = tmp / "authorized_keys"
        self.known_hosts = tmp / "known_hosts"
        self._closed = False

    def __enter__(self) -> SshBed:
        _open.append(self)
        try:
            self.net.__enter__()
            sw = self.net.switch
            _ip("link", "add", self._uplink, "type", "veth", "peer", "name", "up0", "netns", sw)
            _ip("link", "set", "up0", "master", "br0", "up", ns=sw)
            _ip("addr", "add", f"{self.client_addr}/24", "dev", self._uplink)
            _ip("link", "set", self._uplink, "up")
            self.files.mkdir(mode=0o700, exist_ok=True)
            # the mount point of every host's private state dir (nothing is written in it)
            VAR_LIB.mkdir(mode=0o700, parents=True, exist_ok=True)
            # sshd's privilege separation dir (an empty chroot), as Debian's ssh unit makes it
            PRIVSEP.mkdir(mode=0o755, exist_ok=True)
            _keygen(self.client_key, "sshbed-client")
            self.authorized_keys.write_text(Path(f"{self.client_key}.pub").read_text())
            for h in self.hosts:
                h._start()
            self.known_hosts.write_text(self._known_hosts_text(self.hosts))
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _known_hosts_text(self, hosts: list[SshHost]) -> str:
        return "".join(f"{h.addr} {h.host_key_line}\n" for h in hosts)

    def known_hosts_without(self, host: SshHost) -> Path:
        """A known_hosts file with every host's key but `host`'s."""
        path = self.tmp / f"known_hosts_without_{host.name}"
        path.write_text(self._known_hosts_text([h for h in self.hosts if h is not host]))
        return path

    def close(self) -> None:
        """Stop every sshd and what their sessions left, then close the NetBed (the
        uplink goes with the switch's namespace); raises if a namespace is left."""
        if self._closed:
            return
        self._closed = True
        if self in _open:
            _open.remove(self)
        try:
            for h in self.hosts:
                h._stop()
        finally:
            self.net.close()


@pytest.fixture
def sshbed(tmp_path: Path) -> Iterator[Callable[[int], SshBed]]:
    """`sshbed(n)`: a started bed of n SSH hosts, closed when the test ends."""
    yield from started_beds(lambda n, d: SshBed(n, tmp=d).__enter__(), tmp_path, "sshbed")
