"""`evergraph remote FILE HOST... --install` / `--uninstall`: bare hosts made into a
self-formed TLS cluster of agents that run as services and follow FILE (issue 26).

Per host, over SSH (remote/session.py's strict connection): the bundle is
installed as the agent-less path does; a launcher (`LAUNCHER`, a ``python3 -I``
script putting the bundle's site on ``sys.path``) gives the unit a stable command;
the host's own ``evergraph setup systemd`` (run through the launcher) writes the
unit, ``run --etcd embedded`` with TLS URLs on the address the host is reached
at. The first host forms the cluster; once ``cluster --json`` there shows it
formed, a join token made there (``cluster token``) is written to the others
(`TOKEN_FILE`, 0600) and their services start with host 1 as seed.

The services run with no FILE: they follow signed deploys. Every host trusts the
initiator's deploy key (``hosts trust-deployer``), and FILE is deployed signed by
the initiator: the record is built and signed here, and host 1 only writes the
signed bytes into its World (`host_publish`, run there through the bundle). The
World need not trust who writes: each agent checks the initiator's signature.

Without systemd (no ``/run/systemd/system``, e.g. a container), the unit is
written below `NO_SYSTEMD_ROOT` (``setup systemd --root``) and its ``ExecStart=``
line (parsed by `exec_start`) is started directly, detached from the SSH session
(a session of its own, output to ``STATE/agent.log``); its PID is kept in
`PID_FILE` so that ``--uninstall`` can stop it.
"""

from __future__ import annotations

import asyncio
import base64
import json
import shlex
import shutil
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncssh
import msgspec
import nacl.signing

from evergraph.remote.bundle import DEFAULT_STORE, Bundle, BundleError
from evergraph.remote.runner import EXIT_OK, EXIT_UNREACHABLE, Outcome
from evergraph.remote.session import Emit, HostFailed, SshOptions, connect, install_bundle
from evergraph.remote.target import Target

#: what ``/var/lib/evergraph`` holds for an installed agent
VAR_LIB = "/var/lib/evergraph"
#: the service's state dir (host keys, the cluster's CA and etcd data, the World)
STATE = f"{VAR_LIB}/state"
#: the stable command the unit names (a launcher of the installed bundle)
LAUNCHER = f"{DEFAULT_STORE}/bin/evergraph"
#: the join token of a host that joins host 1's cluster (0600)
TOKEN_FILE = f"{VAR_LIB}/join.token"
#: where the unit goes when the host has no systemd (its ExecStart is run directly)
NO_SYSTEMD_ROOT = f"{DEFAULT_STORE}/root"
#: the PID of the agent started without systemd
PID_FILE = f"{DEFAULT_STORE}/agent.pid"
UNIT = "etc/systemd/system/evergraph.service"
#: etcd's client and peer ports on every host
CLIENT_PORT, PEER_PORT = 2379, 2380
#: seconds host 1 may take to form its cluster, and every host to show up in it
FORM_TIMEOUT = 180.0
JOIN_TIMEOUT = 300.0
#: seconds between progress lines while waiting
PROGRESS_EVERY = 10.0
#: seconds a stopped agent gets to finish before its process group is killed
STOP_GRACE = 30.0
#: how long a join token made for the install lives
TOKEN_TTL = "1h"

_LAUNCHER_TEXT = """\
#!{python} -I
# written by `evergraph remote --install`: the evergraph bundle at {site}
import os, sys
sys.path.insert(0, {site!r})
# the etcd shipped with the bundle, for a host that has none of its own
os.environ["PATH"] = os.environ.get("PATH", "/usr/bin:/bin") + ":" + {bin!r}
from evergraph.cli.main import main
main()
"""

#: ``python3 -I -c SPAWN PIDFILE LOG ARGV...``: ARGV in a session of its own (no
#: SSH session, no terminal), output appended to LOG; its PID written to PIDFILE
SPAWN = r"""
import os, subprocess, sys
pidfile, log, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
os.makedirs(os.path.dirname(log), mode=0o700, exist_ok=True)
with open(log, "ab") as out:
    p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                         start_new_session=True, cwd="/")
os.makedirs(os.path.dirname(pidfile), exist_ok=True)
with open(pidfile + ".tmp", "w") as f:
    f.write("%d\n" % p.pid)
os.replace(pidfile + ".tmp", pidfile)
print(p.pid)
"""

#: ``python3 -I -c STOP PIDFILE GRACE``: SIGTERM to the recorded agent (if that PID is
#: still an evergraph), SIGKILL to its process group after GRACE seconds; the PID
#: file is removed. Nothing recorded, nothing to do.
STOP = r"""
import os, signal, sys, time
pidfile, grace = sys.argv[1], float(sys.argv[2])
try:
    with open(pidfile) as f:
        pid = int(f.read().split()[0])
except (OSError, ValueError, IndexError):
    sys.exit(0)
def alive():
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return False
def ours():
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            return b"evergraph" in f.read()
    except OSError:
        return False
if alive() and ours():
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
try:
    os.unlink(pidfile)
except FileNotFoundError:
    pass
"""


# --- the unit's ExecStart= -------------------------------------------------------


def exec_start(unit: str) -> list[str]:
    """The command of a unit's ``ExecStart=`` line, as systemd would run it.

    A tiny parser for what `setup systemd` writes (cli/setup.py systemd_word):
    words split on blanks, double quotes with ``\\`` escapes, ``%%`` and ``$$``
    standing for ``%`` and ``$``; a leading ``-``/``@``/``+``/``!`` prefix is
    dropped. ValueError if there is no such line."""
    for line in unit.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip() == "ExecStart":
            words = shlex.split(value.strip().lstrip("-@+!:"), comments=False, posix=True)
            if not words:
                break
            return [w.replace("%%", "%").replace("$$", "$") for w in words]
    raise ValueError("the unit has no ExecStart= line")


# --- the deploy, signed here ---------------------------------------------------------


@dataclass(frozen=True)
class Deployment:
    """FILE as one deploy: its entry, its content, and who signs it."""

    entry: str
    data: bytes
    key: nacl.signing.SigningKey
    by: str

    @property
    def signer(self) -> str:
        from evergraph.cluster.deploy_record import verify_key_of

        return verify_key_of(self.key)

    def record(self, n: int, parent: str) -> bytes:
        """The signed record of this deploy as deploy `n` after `parent`."""
        from evergraph.cluster.deploy_record import file_ref, signed_deploy

        d = signed_deploy(
            self.key,
            n=n,
            parent=parent,
            entry=self.entry,
            files={self.entry: file_ref(self.data, 0o644)},
            git=None,
            by=self.by,
            time=time.time(),
        )
        return msgspec.json.encode(d)


def local_etcd() -> Path:
    """This machine's etcd binary, shipped to the hosts (a static program of the
    same architecture, which the bundle's Python check already requires)."""
    from evergraph.world.etcd_server import INSTALL_HINT

    found = shutil.which("etcd")
    if found is None:
        raise BundleError(f"--install ships this machine's etcd to the hosts: {INSTALL_HINT}")
    return Path(found).resolve()


def host_publish() -> None:
    """The host's half of the deploy (run there through the bundle:
    ``python3 -I -c 'import sys; sys.path.insert(0, SITE); from evergraph.remote.install
    import host_publish; host_publish()' STATE``), a line protocol on stdin/stdout:

    in: ``{"entry", "data"}`` (base64); the blobs are written; then, until a number
    is claimed: out ``{"n", "parent"}`` (the next number and its parent's hash), in
    the signed record, out ``{"written": n}`` or (another deployer took n) the next
    ``{"n", "parent"}``. The record is checked (signature, hash) before it is written.
    """
    asyncio.run(_host_publish(Path(sys.argv[1])))


async def _host_publish(state_dir: Path) -> None:
    from evergraph.cluster import deploys as dp
    from evergraph.cluster.deploy_record import MAX_ATTEMPTS, decode_record
    from evergraph.cluster.seat import open_cluster

    async def line() -> dict[str, Any]:
        text = await asyncio.to_thread(sys.stdin.readline)
        if not text:
            raise SystemExit("the initiator went away")
        value: dict[str, Any] = json.loads(text)
        return value

    def say(obj: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    first = await line()
    data = base64.b64decode(first["data"])
    kv, _ca = await open_cluster(state_dir)
    try:
        await dp.put_blobs(kv, [data])
        for _ in range(MAX_ATTEMPTS):
            n, prev = await dp.next_slot(kv)
            say({"n": n + 1, "parent": prev.hash if prev else ""})
            value = base64.b64decode((await line())["record"])
            d = decode_record(value, "the initiator's record")
            if d.n != n + 1 or d.files.get(first["entry"]) is None:
                raise SystemExit("the initiator's record is not the deploy asked for")
            if await dp.claim(kv, d, value):
                say({"written": d.n})
                return
        raise SystemExit("other deploys kept taking the next number; try again")
    finally:
        await kv.close()


async def publish_on(conn: asyncssh.SSHClientConnection, site: str, deployment: Deployment) -> int:
    """Deploy `deployment` through the host of `conn` (its World); its number."""
    boot = (
        f"import sys; sys.path.insert(0, {site!r}); "
        "from evergraph.remote.install import host_publish; host_publish()"
    )
    command = shlex.join(["python3", "-I", "-c", boot, STATE])
    async with conn.create_process(command, encoding="utf-8", errors="replace") as proc:
        data = base64.b64encode(deployment.data).decode()
        proc.stdin.write(json.dumps({"entry": deployment.entry, "data": data}) + "\n")
        while True:
            text = await proc.stdout.readline()
            if not text:
                err = " ".join((await proc.stderr.read()).split())
                raise HostFailed(f"the deploy was not written: {err or 'no message'}")
            msg = json.loads(text)
            if "written" in msg:
                proc.stdin.write_eof()
                return int(msg["written"])
            record = deployment.record(int(msg["n"]), str(msg["parent"]))
            proc.stdin.write(json.dumps({"record": base64.b64encode(record).decode()}) + "\n")


# --- one host ------------------------------------------------------------------------


async def sh(conn: asyncssh.SSHClientConnection, command: str, stdin: bytes = b"") -> str:
    """`command` on the host; its stdout, or HostFailed with its stderr's last line."""
    r = await conn.run(command, input=stdin, encoding=None)
    out = r.stdout if isinstance(r.stdout, bytes) else b""
    if r.exit_status != 0:
        err = r.stderr if isinstance(r.stderr, bytes) else b""
        lines = err.decode(errors="replace").strip().splitlines()
        raise HostFailed(
            f"`{_short(command)}` failed (exit {r.exit_status}): "
            + (lines[-1].strip() if lines else "no message")
        )
    return out.decode(errors="replace")


def _short(command: str) -> str:
    words = command.split()
    return " ".join(words[:4]) + (" ..." if len(words) > 4 else "")


def _put_file(path: str, mode: int) -> str:
    """A shell command writing stdin to `path` atomically with `mode`."""
    q = shlex.quote
    tmp = q(path + ".tmp")
    return (
        f"mkdir -p {q(str(Path(path).parent))} && (umask 077 && cat > {tmp}) && "
        f"chmod {mode:o} {tmp} && mv -f {tmp} {q(path)}"
    )


def _evergraph(*argv: str) -> str:
    return shlex.join([LAUNCHER, *argv])


@dataclass
class Host:
    """One host of an install: how it is reached and what was found there."""

    target: Target
    outcome: Outcome
    conn: asyncssh.SSHClientConnection | None = None
    site: str = ""
    systemd: bool = False

    @property
    def addr(self) -> str:
        return self.target.host

    @property
    def url_host(self) -> str:
        return f"[{self.addr}]" if ":" in self.addr else self.addr

    @property
    def client_url(self) -> str:
        return f"https://{self.url_host}:{CLIENT_PORT}"

    @property
    def unit_path(self) -> str:
        return f"/{UNIT}" if self.systemd else f"{NO_SYSTEMD_ROOT}/{UNIT}"


@dataclass
class Install:
    """One `remote --install` (or, with `uninstall`, `--uninstall`) over `targets`."""

    file: Path
    targets: Sequence[Target]
    key: nacl.signing.SigningKey | None = None
    ssh: SshOptions = field(default_factory=SshOptions)
    purge: bool = False

    async def run(self, emit: Emit) -> list[Outcome]:
        """Install on every host (host 1 forms the cluster); each host's outcome."""
        from evergraph.cluster.deploy_record import whoami

        if self.key is None:
            raise ValueError("an install needs the deploy key")
        deployment = Deployment(self.file.name, self.file.read_bytes(), self.key, whoami())
        # everything (no AGENT_LEAVES_OUT): a permanent, TLS-protected member needs
        # cryptography for its cluster CA, and its host keeps the whole CLI
        bundle = await asyncio.to_thread(
            Bundle.of_running_python, {"etcd": local_etcd()}, leave_out=()
        )
        hosts = [Host(t, Outcome(t)) for t in self.targets]
        try:
            async with asyncio.TaskGroup() as tg:
                for i, h in enumerate(hosts):
                    seed = None if i == 0 else hosts[0]
                    tg.create_task(self._prepare(h, seed, bundle, deployment.signer, emit))
            first = hosts[0]
            if first.conn is None or first.outcome.reason:
                for h in hosts[1:]:
                    _fail(h, "not started: the first host, which forms the cluster, failed", emit)
                return [h.outcome for h in hosts]
            try:
                await self._start(first, emit)
                await self._wait_formed(first, emit)
                assert first.conn is not None
                n = await publish_on(first.conn, first.site, deployment)
                emit(first.target.label, f"deployed {deployment.entry} as deploy {n}")
                token = await sh(
                    first.conn,
                    _evergraph("cluster", "token", "--ttl", TOKEN_TTL, "--state-dir", STATE),
                )
            except HostFailed as e:
                _fail(first, str(e), emit)
                for h in hosts[1:]:
                    _fail(h, "not started: the first host, which forms the cluster, failed", emit)
                return [h.outcome for h in hosts]
            async with asyncio.TaskGroup() as tg:
                for h in hosts[1:]:
                    tg.create_task(self._join(h, token.strip().encode() + b"\n", emit))
            await self._wait_members(first, [h for h in hosts if not h.outcome.reason], emit)
            return [h.outcome for h in hosts]
        finally:
            for h in hosts:
                if h.conn is not None:
                    h.conn.close()

    async def _prepare(
        self, h: Host, seed: Host | None, bundle: Bundle, signer: str, emit: Emit
    ) -> None:
        label = h.target.label
        try:
            h.conn = await connect(h.target, self.ssh)
        except HostFailed as e:
            h.outcome.reason = str(e)
            emit(label, f"unreachable: {e}")
            return
        try:
            h.site = await install_bundle(h.conn, bundle, label)
            python = (await sh(h.conn, "command -v python3")).strip() or "/usr/bin/python3"
            bin_dir = h.site.rsplit("/", 1)[0] + "/bin"
            text = _LAUNCHER_TEXT.format(python=python, site=h.site, bin=bin_dir)
            await sh(h.conn, _put_file(LAUNCHER, 0o755), text.encode())
            await sh(h.conn, _evergraph("hosts", "trust-deployer", signer, "--state-dir", STATE))
            h.systemd = (await sh(h.conn, "test -d /run/systemd/system && echo y || true")) != ""
            argv = ["setup", "systemd", "--state-dir", STATE]
            if not h.systemd:
                argv += ["--root", NO_SYSTEMD_ROOT]
            argv += ["--", "--etcd", "embedded", "--hostname", h.target.agent_hostname]
            argv += ["--etcd-client-url", h.client_url]
            argv += ["--etcd-peer-url", f"https://{h.url_host}:{PEER_PORT}"]
            if seed is not None:
                argv += ["--seeds", seed.client_url, "--join-token-file", TOKEN_FILE]
            await sh(h.conn, _evergraph(*argv))
            emit(label, f"unit written: {h.unit_path}")
        except (BundleError, HostFailed) as e:
            _fail(h, f"not set up: {e}", emit)
        except (OSError, asyncssh.Error) as e:
            _fail(h, f"set-up failed: {' '.join(str(e).split())}", emit)

    async def _start(self, h: Host, emit: Emit) -> None:
        """(Re)start the host's service: systemd's, or its ExecStart run directly."""
        assert h.conn is not None
        if h.systemd:
            await sh(
                h.conn,
                "systemctl daemon-reload && systemctl enable evergraph && "
                "systemctl restart evergraph",
            )
            emit(h.target.label, "started evergraph.service")
            return
        await sh(h.conn, shlex.join(["python3", "-I", "-c", STOP, PID_FILE, f"{STOP_GRACE:g}"]))
        argv = exec_start(await sh(h.conn, shlex.join(["cat", h.unit_path])))
        out = await sh(
            h.conn,
            shlex.join(["python3", "-I", "-c", SPAWN, PID_FILE, f"{STATE}/agent.log", *argv]),
        )
        emit(h.target.label, f"no systemd: started the unit's ExecStart (pid {out.strip()})")

    async def _rows(self, h: Host) -> list[dict[str, Any]]:
        assert h.conn is not None
        r = await h.conn.run(_evergraph("cluster", "--json", "--state-dir", STATE), encoding=None)
        if r.exit_status != 0 or not isinstance(r.stdout, bytes):
            return []
        try:
            rows = json.loads(r.stdout)
        except ValueError:
            return []
        return rows if isinstance(rows, list) else []

    async def _wait_formed(self, h: Host, emit: Emit) -> None:
        async def formed() -> bool:
            return any(r.get("role") == "voter" and r.get("healthy") for r in await self._rows(h))

        await _wait(formed, FORM_TIMEOUT, "the cluster to form", h.target.label, emit)
        emit(h.target.label, "cluster formed")

    async def _join(self, h: Host, token: bytes, emit: Emit) -> None:
        if h.conn is None or h.outcome.reason:
            return
        try:
            await sh(h.conn, _put_file(TOKEN_FILE, 0o600), token)
            await self._start(h, emit)
        except HostFailed as e:
            _fail(h, str(e), emit)

    async def _wait_members(self, first: Host, hosts: list[Host], emit: Emit) -> None:
        """Until each started host is in the cluster (voter, learner or standby)."""
        roles: dict[str, str] = {}

        async def all_in() -> bool:
            rows = await self._rows(first)
            roles.clear()
            roles.update({str(r.get("client_url")): str(r.get("role")) for r in rows})
            return all(h.client_url in roles for h in hosts if not h.outcome.reason)

        try:
            await _wait(all_in, JOIN_TIMEOUT, "every host to join", first.target.label, emit)
        except HostFailed:
            pass
        for h in hosts:
            if h.outcome.reason:
                continue
            role = roles.get(h.client_url)
            if role is None:
                _fail(h, f"did not join the cluster within {JOIN_TIMEOUT:g} s", emit)
            else:
                h.outcome.state, h.outcome.reason = "installed", role

    # --- uninstall -------------------------------------------------------------------

    async def uninstall(self, emit: Emit) -> list[Outcome]:
        """Stop and remove the service on every host (idempotent)."""
        outcomes = [Outcome(t) for t in self.targets]
        async with asyncio.TaskGroup() as tg:
            for o in outcomes:
                tg.create_task(self._uninstall(o, emit))
        return outcomes

    async def _uninstall(self, outcome: Outcome, emit: Emit) -> None:
        label = outcome.target.label
        try:
            conn = await connect(outcome.target, self.ssh)
        except HostFailed as e:
            outcome.reason = str(e)
            emit(label, f"unreachable: {e}")
            return
        async with conn:
            try:
                if (await sh(conn, "test -d /run/systemd/system && echo y || true")) != "":
                    await sh(
                        conn,
                        "systemctl disable --now evergraph 2>/dev/null; "
                        f"rm -f /{UNIT} && systemctl daemon-reload",
                    )
                await sh(
                    conn, shlex.join(["python3", "-I", "-c", STOP, PID_FILE, f"{STOP_GRACE:g}"])
                )
                gone = [f"{NO_SYSTEMD_ROOT}/{UNIT}", LAUNCHER, TOKEN_FILE]
                await sh(conn, shlex.join(["rm", "-f", *gone]))
                if self.purge:
                    await sh(conn, shlex.join(["rm", "-rf", STATE, DEFAULT_STORE]))
            except (HostFailed, OSError, asyncssh.Error) as e:
                outcome.reason = f"not uninstalled: {' '.join(str(e).split())}"
                emit(label, outcome.reason)
                return
        outcome.state = "uninstalled"
        emit(label, "uninstalled" + (" (state purged)" if self.purge else ""))


def _fail(h: Host, reason: str, emit: Emit) -> None:
    h.outcome.reason = reason
    emit(h.target.label, reason)


async def _wait(
    check: Callable[[], Awaitable[bool]], timeout: float, what: str, label: str, emit: Emit
) -> None:
    """Poll `check()` (async) until true; a progress line every PROGRESS_EVERY s;
    HostFailed after `timeout` s."""
    start = time.monotonic()
    said = start
    while not await check():
        now = time.monotonic()
        if now - start > timeout:
            raise HostFailed(f"gave up waiting for {what} after {timeout:g} s")
        if now - said >= PROGRESS_EVERY:
            emit(label, f"waiting for {what} ({now - start:.0f} s)")
            said = now
        await asyncio.sleep(1)


def exit_status(outcomes: Sequence[Outcome]) -> int:
    """0 when every host is installed (or uninstalled), else 4 (a host not reached
    or not set up)."""
    return (
        EXIT_OK
        if all(o.state in ("installed", "uninstalled") for o in outcomes)
        else (EXIT_UNREACHABLE)
    )


def total_line(outcomes: Sequence[Outcome]) -> str:
    """The last line: how many hosts ended how."""
    counts: dict[str, int] = {}
    for o in outcomes:
        state = o.state if o.state in ("installed", "uninstalled") else "failed"
        counts[state] = counts.get(state, 0) + 1
    parts = [f"{v} {k}" for k, v in counts.items()]
    return f"total: {len(outcomes)} host(s): " + ", ".join(parts)


def main(job: Install, *, uninstall: bool, echo: Callable[[str], None]) -> int:
    """Run `job` (install, or uninstall), print each host's lines and the recap; the
    exit status."""
    width = max(len(t.label) for t in job.targets)

    def emit(label: str, line: str) -> None:
        echo(f"{label:<{width}} | {line}")

    try:
        outcomes = asyncio.run(job.uninstall(emit) if uninstall else job.run(emit))
    except KeyboardInterrupt:
        return 130
    for o in outcomes:
        echo(o.line)
    echo(total_line(outcomes))
    return exit_status(outcomes)
