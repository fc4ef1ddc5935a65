"""A real etcd server as a child process: `--etcd embedded` and the etcd tests.

`EtcdServer` starts Debian's `etcd` (3.4) with its data in a directory we
own, waits until the member reports itself healthy, and stops it by PID
(SIGTERM, then SIGKILL after a grace). Failures are `WorldError`s with one
readable line: etcd not installed, a port already in use, etcd exiting
early (with its last log lines).

Health is read from an extra plain-HTTP loopback listener
(`--listen-metrics-urls`) serving `/health` and `/metrics`, so polling works
the same whether the client port speaks TLS with client certificates or not.

etcd's own log (zap JSON on stderr, warnings and worse) is drained by a
thread: errors go to our log, the last lines are kept for error messages.
The child gets SIGTERM if the thread that started it dies (`setpriv
--pdeathsig`), so a crashed agent leaves no orphaned etcd behind; start it
from the thread that lives as long as it should (the event loop thread).
"""

from __future__ import annotations

import collections
import contextlib
import errno
import ipaddress
import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from urllib.parse import urlsplit

from evergraph.world.kv import WorldError, log

INSTALL_HINT = "etcd is not installed: apt-get install etcd-server"

#: seconds between SIGTERM and SIGKILL in stop()
STOP_GRACE = 5.0
#: lines of etcd's log kept for error messages
_TAIL = 40
#: fast raft timing for loopback members (tests, a single host): elections in ~0.1 s
FAST_TIMING = (10, 100)
#: etcd's defaults, for members talking over a real network
DEFAULT_TIMING = (100, 1000)


#: what etcd logs when it finds (or is told) that its member was removed from the
#: cluster; it exits then, with status 0
_REMOVED = (
    "the member has been permanently removed from the cluster",
    "the local member has been removed",
    "data-dir used by this member must be removed",
)


class MemberRemoved(WorldError):
    """etcd exited because its member was removed from the cluster."""


class PortInUse(WorldError):
    """A port of the member is held by another process (before or at etcd's bind)."""


@dataclass(frozen=True)
class ServerTLS:
    """TLS for the client (and peer) ports: the server certificate and key, the CA
    that signed client (and peer) certificates, and whether clients must show one."""

    cert: Path
    key: Path
    ca: Path
    client_cert_auth: bool = False


#: where `free_port` looks first: below the kernel's ephemeral ports (Linux's default
#: 32768-60999), which outgoing connections take at any moment
PICK_LOW, PICK_HIGH = 20000, 32768
#: ports tried there before asking the kernel for one (bind to port 0)
PICK_TRIES = 64


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now, for a server started next (etcd's
    client and peer ports). Picked at random below the ephemeral ports, and free
    when tried: one from port 0 (the ephemeral range) could be taken by any
    outgoing connection before the server binds it, and two processes picking at
    once get the same one less often from a random pick than from the kernel's
    sequence. Falls back to port 0 when none of PICK_TRIES is free."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    low, high = PICK_LOW, min(PICK_HIGH, _ephemeral_low())
    draw = int.from_bytes(os.urandom(4), "big")
    for k in range(PICK_TRIES if high > low else 0):
        port = low + (draw + k * 7919) % (high - low)
        if port in _handed:
            continue  # (given out here moments ago: its server may not listen yet)
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return _hand(port)
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return _hand(int(s.getsockname()[1]))


#: the ports `free_port` gave out last, newest at the end: not given out again (a
#: cluster's members take theirs only once all are picked: two drew the same one)
_handed: dict[int, None] = {}
_HANDED_MAX = 512


def _hand(port: int) -> int:
    _handed.pop(port, None)
    _handed[port] = None
    if len(_handed) > _HANDED_MAX:
        del _handed[next(iter(_handed))]
    return port


def _ephemeral_low() -> int:
    """The first of the kernel's ephemeral ports (32768 if it cannot say)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _split_url(url: str, what: str, scheme: str, default_port: int) -> tuple[str, str, int]:
    """An advertised URL as (its host, the host to listen on, its port)."""
    parts = urlsplit(url.strip())
    try:
        port = parts.port or default_port
    except ValueError:
        port = -1
    if parts.scheme not in ("http", "https") or not parts.hostname or port <= 0:
        raise WorldError(f"bad etcd {what} URL {url!r}: expected http(s)://host:port")
    if parts.scheme != scheme:
        why = "TLS is given" if scheme == "https" else "no TLS certificate is given"
        raise WorldError(f"etcd {what} URL {url!r} must be {scheme}:// ({why})")
    host = parts.hostname
    try:
        ipaddress.ip_address(host)
        listen = host
    except ValueError:
        # etcd binds only to IP addresses (and localhost): a name listens everywhere
        listen = host if host == "localhost" else "0.0.0.0"
    return host, listen, port


def _port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as etcd does
        try:
            s.bind((host, port))
        except OSError as e:
            return e.errno == errno.EADDRINUSE
        return False


class EtcdServer:
    """One etcd member. Construct with `single`, `cluster` or `embedded`."""

    def __init__(
        self,
        data_dir: Path,
        *,
        name: str = "default",
        host: str = "127.0.0.1",
        client_port: int = 0,
        peer_port: int = 0,
        advertise_host: str | None = None,
        initial_cluster: str | None = None,
        cluster_token: str = "evergraph",
        tls: ServerTLS | None = None,
        timing: tuple[int, int] = DEFAULT_TIMING,
        extra_args: Sequence[str] = (),
        binary: str = "etcd",
        client_url: str | None = None,
        peer_url: str | None = None,
        cluster_state: str = "new",
        crl: Path | None = None,
    ) -> None:
        """`client_port`/`peer_port` 0: pick free loopback ports now (kept across restarts).
        `client_url`/`peer_url`: the URLs this member advertises, given whole (they
        override host, ports and advertise_host; it listens on their host and port,
        or on every address when the host is a DNS name); https exactly when `tls`.
        `initial_cluster` (`name=peer_url,...`): None for a single member.
        `cluster_state`: "new" to form a cluster, "existing" to join one as a member
        that MemberAdd added (both ignored once the data dir holds a member).
        `crl`: revoked certificates, refused on the client and peer ports (needs tls).
        `timing`: (heartbeat interval, election timeout) in milliseconds."""
        self.data_dir = Path(data_dir)
        self.name = name
        self.host = host
        if cluster_state not in ("new", "existing"):
            raise WorldError(f"etcd cluster state {cluster_state!r}: expected new or existing")
        if crl is not None and tls is None:
            raise WorldError("an etcd CRL needs TLS (a certificate and a CA)")
        #: ports we picked ourselves may be picked again if taken before etcd binds them
        self._auto_ports = client_port == 0 and peer_port == 0 and not (client_url or peer_url)
        self.client_port = client_port or (0 if client_url else free_port(host))
        self.peer_port = peer_port or (0 if peer_url else free_port(host))
        wildcard = host in ("0.0.0.0", "::", "")
        self.advertise_host = advertise_host or (socket.getfqdn() if wildcard else host)
        #: where each port listens, and the host it advertises
        self.client_host = self.peer_host = host
        self._client_adv = self._peer_adv = self.advertise_host
        scheme = "https" if tls is not None else "http"
        if client_url is not None:
            self._client_adv, self.client_host, self.client_port = _split_url(
                client_url, "client", scheme, 2379
            )
        if peer_url is not None:
            self._peer_adv, self.peer_host, self.peer_port = _split_url(
                peer_url, "peer", scheme, 2380
            )
        self.initial_cluster = initial_cluster
        self.cluster_state = cluster_state
        self.crl = crl
        self.cluster_token = cluster_token
        self.tls = tls
        self.timing = timing
        self.extra_args = list(extra_args)
        self.binary = binary
        self._proc: subprocess.Popen[bytes] | None = None
        self._health_port = 0
        self._tail: collections.deque[str] = collections.deque(maxlen=_TAIL)
        self._reader: threading.Thread | None = None
        #: etcd said this member was removed from its cluster (since the last spawn)
        self._removed = False

    # -- constructors -------------------------------------------------------------
    @classmethod
    def single(
        cls, data_dir: Path, name: str = "default", *, tls: ServerTLS | None = None
    ) -> EtcdServer:
        """A one-member cluster on free loopback ports, fast raft timing (tests)."""
        return cls(data_dir, name=name, tls=tls, timing=FAST_TIMING)

    @classmethod
    def cluster(cls, n: int, base_dir: Path, *, tls: ServerTLS | None = None) -> list[EtcdServer]:
        """`n` members on free loopback ports, data in `base_dir/m0..`; start them
        together with `EtcdServer.start_all` (a member alone has no quorum)."""
        members = [
            cls(
                Path(base_dir) / f"m{i}",
                name=f"m{i}",
                tls=tls,
                timing=FAST_TIMING,
            )
            for i in range(n)
        ]
        initial = ",".join(f"{m.name}={m.peer_url}" for m in members)
        for m in members:  # known once every member has its ports
            m.initial_cluster = initial
        return members

    @classmethod
    def embedded(
        cls,
        data_dir: Path,
        *,
        host: str = "127.0.0.1",
        client_port: int = 2379,
        peer_port: int = 2380,
        tls: ServerTLS | None = None,
        name: str = "evergraph",
        client_url: str | None = None,
        peer_url: str | None = None,
        initial_cluster: str | None = None,
        cluster_state: str = "new",
        crl: Path | None = None,
        timing: tuple[int, int] = DEFAULT_TIMING,
    ) -> EtcdServer:
        """`evergraph run --etcd embedded`: etcd's usual ports and timing, history
        compacted automatically (the last 10,000 revisions are kept). A member of a
        self-formed cluster gives its name, URLs and how it joins (see __init__)."""
        return cls(
            data_dir,
            name=name,
            host=host,
            client_port=client_port,
            peer_port=peer_port,
            tls=tls,
            client_url=client_url,
            peer_url=peer_url,
            initial_cluster=initial_cluster,
            cluster_state=cluster_state,
            crl=crl,
            timing=timing,
            extra_args=[
                "--auto-compaction-mode=revision",
                "--auto-compaction-retention=10000",
                "--snapshot-count=10000",
            ],
        )

    # -- addresses ------------------------------------------------------------------
    @property
    def _scheme(self) -> str:
        return "https" if self.tls is not None else "http"

    @property
    def client_url(self) -> str:
        return f"{self._scheme}://{_url_host(self._client_adv)}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"{self._scheme}://{_url_host(self._peer_adv)}:{self.peer_port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def removed(self) -> bool:
        """Whether etcd said this member was removed from its cluster (it exits
        then, with status 0): its data dir is stale, `wipe` it before it joins again."""
        proc, reader = self._proc, self._reader
        if proc is not None and proc.poll() is not None and reader is not None:
            reader.join(2)  # its last words
        return self._removed

    def has_member_data(self) -> bool:
        """Whether the data dir holds a member (etcd then ignores the initial
        cluster flags and restarts as that member)."""
        return (self.data_dir / "member").is_dir()

    def wipe(self) -> None:
        """Remove the data dir (a removed member's stale state); the process must be stopped."""
        if self.running:
            raise WorldError(f"cannot wipe etcd {self.name}'s data dir: etcd is running")
        try:
            shutil.rmtree(self.data_dir)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise WorldError(f"cannot remove etcd data dir {self.data_dir}: {e.strerror}") from None

    def log_tail(self) -> list[str]:
        """The last lines etcd logged (warnings and worse)."""
        return list(self._tail)

    # -- life cycle ---------------------------------------------------------------
    def _argv(self) -> list[str]:
        listen_client = f"{self._scheme}://{_url_host(self.client_host)}:{self.client_port}"
        listen_peer = f"{self._scheme}://{_url_host(self.peer_host)}:{self.peer_port}"
        argv = [
            f"--name={self.name}",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={listen_client}",
            f"--advertise-client-urls={self.client_url}",
            f"--listen-peer-urls={listen_peer}",
            f"--initial-advertise-peer-urls={self.peer_url}",
            f"--initial-cluster={self.initial_cluster or f'{self.name}={self.peer_url}'}",
            f"--initial-cluster-token={self.cluster_token}",
            # both ignored once the data dir holds a member
            f"--initial-cluster-state={self.cluster_state}",
            f"--listen-metrics-urls=http://127.0.0.1:{self._health_port}",
            f"--heartbeat-interval={self.timing[0]}",
            f"--election-timeout={self.timing[1]}",
            "--logger=zap",
            "--log-outputs=stderr",
            "--log-level=warn",
        ]
        if self.tls is not None:
            t = self.tls
            argv += [
                f"--cert-file={t.cert}",
                f"--key-file={t.key}",
                f"--trusted-ca-file={t.ca}",
                f"--client-cert-auth={'true' if t.client_cert_auth else 'false'}",
                f"--peer-cert-file={t.cert}",
                f"--peer-key-file={t.key}",
                f"--peer-trusted-ca-file={t.ca}",
                "--peer-client-cert-auth=true",
            ]
            if self.crl is not None:
                argv += [f"--client-crl-file={self.crl}", f"--peer-crl-file={self.crl}"]
        return argv + self.extra_args

    def spawn(self) -> None:
        """Start the process without waiting for it to be healthy."""
        if self.running:
            return
        self._reap()  # a previous process that exited by itself
        etcd = shutil.which(self.binary)
        if etcd is None:
            raise WorldError(INSTALL_HINT)
        for host, port, what in (
            (self.client_host, self.client_port, "client"),
            (self.peer_host, self.peer_port, "peer"),
        ):
            if _port_in_use(host, port):
                raise self._port_error(host, port, what)
        try:
            self.data_dir.mkdir(parents=True, exist_ok=True)
            self.data_dir.chmod(0o700)  # etcd insists
        except OSError as e:
            raise WorldError(f"etcd data dir {self.data_dir}: {e.strerror}") from None
        self._health_port = free_port()
        # etcd reads ETCD_* variables as flags: only ours count
        env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD_")}
        setpriv = shutil.which("setpriv")
        prefix = [setpriv, "--pdeathsig", "TERM"] if setpriv else []
        self._tail.clear()
        self._removed = False
        self._proc = subprocess.Popen(
            [*prefix, etcd, *self._argv()],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=env,
            start_new_session=True,  # a Ctrl-C on our terminal must not reach it first
        )
        self._reader = threading.Thread(
            target=self._drain, args=(self._proc,), name=f"etcd-log-{self.name}", daemon=True
        )
        self._reader.start()

    def _drain(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stderr is not None
        with proc.stderr:
            for raw in proc.stderr:
                line = _format_log_line(raw.decode(errors="replace").strip())
                if line is None:
                    continue
                if any(w in line for w in _REMOVED):
                    self._removed = True
                self._tail.append(line)
                if line.startswith(("error", "fatal", "panic")):
                    log.warning("etcd %s: %s", self.name, line)
                else:
                    log.debug("etcd %s: %s", self.name, line)

    def start(self, timeout: float = 15.0) -> None:
        """Start and wait until healthy; on failure the process is stopped and a
        WorldError says why."""
        for attempt in range(3):
            try:
                self.spawn()
                self.wait_healthy(timeout)
                return
            except WorldError as e:
                self.stop()
                if attempt == 2:
                    raise
                # ports we picked may have been taken between picking and binding:
                # the health port is picked anew at each spawn, ours if still fresh
                if f"127.0.0.1:{self._health_port}: bind" in "\n".join(self._tail):
                    continue
                fresh = not (self.data_dir / "member").exists()
                if "in use" in str(e) and self._auto_ports and fresh:
                    self.client_port = free_port(self.client_host)
                    self.peer_port = free_port(self.peer_host)
                    continue
                raise

    @staticmethod
    def start_all(servers: Iterable[EtcdServer], timeout: float = 20.0) -> None:
        """Start the members of a cluster together and wait until each is healthy."""
        members = list(servers)
        try:
            for m in members:
                m.spawn()
            deadline = time.monotonic() + timeout
            for m in members:
                m.wait_healthy(max(0.1, deadline - time.monotonic()))
        except BaseException:
            for m in members:
                m.stop()
            raise

    def wait_healthy(self, timeout: float = 15.0) -> None:
        """Poll `/health` until it answers true; raise if etcd exits (MemberRemoved if it
        was removed from its cluster) or the time runs out. A learner (etcd 3.4) is
        healthy once it has a leader, before it has caught up with the log: ask
        `etcd_cluster.member_status` for its raft index to know that."""
        self._wait(timeout, healthy_only=True)

    def wait_started(self, timeout: float = 15.0) -> None:
        """Wait until etcd is up (it joined or reloaded its member, and listens),
        healthy or not: a member restarting in a cluster that has lost quorum has no
        leader until enough of the others are back, and must not be stopped for it.
        Raises as wait_healthy does; a member removed while it was away usually
        learns it just after this returns: it exits then, and `removed()` says so."""
        self._wait(timeout, healthy_only=False)

    def _wait(self, timeout: float, *, healthy_only: bool) -> None:
        deadline = time.monotonic() + timeout
        url = f"http://127.0.0.1:{self._health_port}/health"
        last = "no answer"
        while True:
            proc = self._proc
            if proc is None:
                raise WorldError(f"etcd {self.name} is not started")
            if proc.poll() is not None:
                raise self._exit_error(proc.returncode)
            try:
                # the metrics listener (serving /health) opens once the member is
                # set up, after the client and peer listeners
                with urllib.request.urlopen(url, timeout=1) as resp:
                    body = json.loads(resp.read())
                if body.get("health") == "true" or not healthy_only:
                    return
                last = f"unhealthy: {body.get('reason') or body}"
            except urllib.error.HTTPError as e:  # 503 while it has no leader
                if not healthy_only:
                    return
                last = f"HTTP {e.code}"
            except (OSError, ValueError) as e:
                last = str(e)
            if time.monotonic() > deadline:
                state = "healthy" if healthy_only else "started"
                raise WorldError(
                    f"etcd {self.name} ({self.client_url}) was not {state} within {timeout:g} s"
                    f" ({last}){self._tail_text()}"
                )
            time.sleep(0.02)

    def stop(self, grace: float = STOP_GRACE) -> None:
        """SIGTERM, then SIGKILL if it has not exited after `grace` seconds."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.kill()
                return
        self._reap()

    def kill(self) -> None:
        """SIGKILL now (a crash, for failover tests)."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
        self._reap()

    def _reap(self) -> None:
        if self._proc is not None:
            self._proc.wait()
        if self._reader is not None:
            self._reader.join(5)
        self._proc = None
        self._reader = None

    def is_leader(self) -> bool:
        """Whether this member is the raft leader right now (from its metrics)."""
        if not self.running:
            return False
        url = f"http://127.0.0.1:{self._health_port}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                text = resp.read().decode()
        except OSError:
            return False
        return any(line.strip() == "etcd_server_is_leader 1" for line in text.splitlines())

    def __enter__(self) -> EtcdServer:
        self.start()
        return self

    def __exit__(
        self, tp: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # -- messages -----------------------------------------------------------------
    def _port_error(self, host: str, port: int, what: str) -> WorldError:
        return PortInUse(
            f"cannot start etcd {self.name}: {what} port {host}:{port} is already in use"
            " (is another etcd running?)"
        )

    def _exit_error(self, code: int) -> WorldError:
        if self._reader is not None:
            self._reader.join(2)  # its last words
        text = "\n".join(self._tail)
        if "address already in use" in text:
            for host, port, what in (
                (self.client_host, self.client_port, "client"),
                (self.peer_host, self.peer_port, "peer"),
            ):
                if f":{port}: bind" in text:
                    return self._port_error(host, port, what)
        if self._removed:
            return MemberRemoved(
                f"etcd {self.name} was removed from its cluster: its data dir"
                f" {self.data_dir} is stale (wipe it to join again as a new member)"
            )
        return WorldError(f"etcd {self.name} exited with status {code}{self._tail_text()}")

    def _tail_text(self) -> str:
        # errors first: a usage text after a bad flag would hide the reason
        tail = list(self._tail)
        bad = [ln for ln in tail if ln.startswith(("error", "fatal", "panic", "flag"))]
        lines = bad[-6:] or tail[-8:]
        return (":\n  " + "\n  ".join(lines)) if lines else ""


def _format_log_line(line: str) -> str | None:
    """zap's JSON line as `level: msg: error`; None for noise we always see."""
    if not line or "/health error" in line:  # our own polling, before it has a leader
        return None
    try:
        rec = json.loads(line)
    except ValueError:
        return line
    if not isinstance(rec, dict):
        return line
    msg = str(rec.get("msg", ""))
    if msg == "simple token is not cryptographically signed":
        return None
    text = f"{rec.get('level', '?')}: {msg}"
    if "error" in rec:
        text += f": {rec['error']}"
    return text
