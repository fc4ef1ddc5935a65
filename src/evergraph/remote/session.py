"""One host of `evergraph remote`: connect, install, copy the graph, run the agent.

The SSH connection is strict about host keys (never a prompt: an unknown or
changed key fails the host naming its SHA256 fingerprint) and about
authentication (public keys only: a server asking for a password or
keyboard-interactive answer is declined, never prompted for, and the host fails
saying it needs a password). SSH keepalives end a connection whose host went
silent. The agent runs under `AGENT_WRAPPER`, which ties its life to the SSH
channel: when the channel's stdin ends (the initiator exited or was killed) or
its heartbeats stop (the link was cut) the wrapper kills the agent's process
group. The initiator keeps stdin open, writing heartbeats, until the agent exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import getpass
import hashlib
import os
import shlex
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import asyncssh

from evergraph.engine.converger import REPORT_LINES
from evergraph.remote.bundle import DEFAULT_STORE, Bundle, BundleError, Stdin, install
from evergraph.remote.target import Target

#: seconds to wait for a host's SSH handshake (an unknown key must fail within 5 s)
CONNECT_TIMEOUT = 5.0
#: SSH keepalives: a host silent for KEEPALIVE_INTERVAL * KEEPALIVE_COUNT_MAX seconds
#: (a cut link) ends its connection, so its session fails instead of hanging
KEEPALIVE_INTERVAL = 3.0
KEEPALIVE_COUNT_MAX = 3
#: seconds between the heartbeats the initiator writes to the agent's stdin; the
#: wrapper (AGENT_WRAPPER) ends the agent after 6 s without one
HEARTBEAT_INTERVAL = 2.0
#: where the graph of a run is copied, under a directory named by its sha256
RUN_DIR = f"{DEFAULT_STORE}/run"
#: the remote agent's state dir
STATE_DIR = f"{DEFAULT_STORE}/state"

#: The host's end of the agent, stdlib only: ``python3 -I -c AGENT_WRAPPER SITE ARGS...``
#: starts ``evergraph ARGS...`` from the bundle at SITE in a process group of its own
#: (its output goes straight to the channel), and kills that group (TERM, then KILL
#: after 5 s) when its stdin reaches EOF, or stays silent for 6 s (three missed
#: heartbeats): the SSH channel is gone, so is the agent. A line "exit" on stdin (the
#: initiator's end of a session) sends the agent SIGTERM: it stops as on a first
#: SIGTERM and exits with its usual status. Its exit status is the agent's.
AGENT_WRAPPER = r"""
import os, select, signal, subprocess, sys, threading, time
site = sys.argv[1]
boot = "import sys; sys.path.insert(0, %r); from evergraph.cli.main import main; main()" % site
agent = subprocess.Popen([sys.executable, "-I", "-c", boot] + sys.argv[2:],
                         stdin=subprocess.DEVNULL, start_new_session=True)
def kill_group():
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(agent.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + 5
        while agent.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
def watch_stdin():
    # the initiator writes a heartbeat every HEARTBEAT_INTERVAL s: 6 s of silence
    # is a link cut without a FIN (this sshd would not notice for many minutes);
    # "exit" ends the agent as a first SIGTERM does (its usual exit status)
    tail = b""
    while True:
        try:
            if not select.select([0], [], [], 6)[0]:
                break
            data = os.read(0, 65536)
        except OSError:
            break
        if not data:
            break
        tail = (tail + data)[-16:]
        if b"exit\n" in tail:
            tail = b""
            try:
                os.kill(agent.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    kill_group()
threading.Thread(target=watch_stdin, daemon=True).start()
code = agent.wait()
try:
    os.killpg(agent.pid, signal.SIGKILL)
except (ProcessLookupError, PermissionError):
    pass
sys.exit(code if code >= 0 else 128 - code)
"""


class HostFailed(Exception):
    """A host could not be reached or set up: the one line to show for it."""


@dataclass(frozen=True)
class SshOptions:
    """How to authenticate and whom to trust (the command line's SSH options)."""

    keys: Sequence[Path] = ()
    known_hosts: Path = Path("~/.ssh/known_hosts")
    accept_new_host_keys: bool = False


@dataclass(frozen=True)
class AgentArgs:
    """What the remote agent is run with, but for its seeds and hostname.
    `converged_timeout` None (the default): the agent reports each converged
    transition on stdout (`run --converged-timeout 0 --converged-report`) and exits
    when the initiator writes "exit" (the session's coordinated end,
    remote/runner.py); a number: it runs with `--converged-exit` and exits by itself
    once converged that long. Either way its exit status is `--converged-exit`'s (3
    with --noop if something would change)."""

    converged_timeout: float | None = None
    noop: bool = False
    #: `run --diff`: each change's content diff in the log
    diff: bool = False
    #: the agent's `--log-format` (json: the initiator parses its lines)
    log_format: str = "text"

    @property
    def coordinated(self) -> bool:
        """The initiator ends the agent (see the class doc)."""
        return self.converged_timeout is None

    def argv(self) -> list[str]:
        """These as `evergraph run` flags."""
        if self.converged_timeout is None:
            out = ["--converged-timeout", "0", "--converged-report"]
        else:
            out = ["--converged-timeout", f"{self.converged_timeout:g}", "--converged-exit"]
        out += ["--log-format", self.log_format]
        if self.noop:
            out.append("--noop")
        if self.diff:
            out.append("--diff")
        return out


#: where each line a host prints goes (the host's label, the line)
Emit = Callable[[str, str], None]


def _known_hosts(path: Path) -> str | tuple[list[str], list[str], list[str]]:
    # a missing file trusts nobody (asyncssh would fail reading it)
    return str(path) if path.is_file() else ([], [], [])


def _host_pattern(target: Target) -> str:
    return target.host if target.port == 22 else f"[{target.host}]:{target.port}"


def _has_entry(path: Path, target: Target) -> bool:
    """Whether known_hosts names this host at all (a key there, even another one)."""
    if not path.is_file():
        return False
    try:
        keys, *_ = asyncssh.read_known_hosts(str(path)).match(target.host, target.host, target.port)
    except (OSError, ValueError):
        return False
    return bool(keys)


class _NoPasswords(asyncssh.SSHClient):
    """Never answers a password or keyboard-interactive prompt (asyncssh reads no
    terminal then), but remembers that the server asked for one."""

    def __init__(self) -> None:
        self.asked: set[str] = set()

    def password_auth_requested(self) -> None:
        self.asked.add("password")

    def kbdint_auth_requested(self) -> None:
        self.asked.add("keyboard-interactive")


async def connect(target: Target, ssh: SshOptions) -> asyncssh.SSHClientConnection:
    """A connection to `target`, or HostFailed with one line saying why."""
    known = ssh.known_hosts.expanduser()
    user = target.user or getpass.getuser()
    client = _NoPasswords()

    async def attempt() -> asyncssh.SSHClientConnection:
        conn, _ = await asyncssh.create_connection(
            lambda: client,
            target.host,
            port=target.port,
            username=user,
            # an inventory's key for this host is tried before the command line's
            client_keys=[str(k) for k in (target.key, *ssh.keys) if k is not None] or (),
            known_hosts=_known_hosts(known),
            # password methods are offered so that a server wanting one can be told
            # apart; _NoPasswords declines them (never a prompt)
            preferred_auth="publickey,keyboard-interactive,password",
            connect_timeout=CONNECT_TIMEOUT,
            login_timeout=CONNECT_TIMEOUT,
            keepalive_interval=KEEPALIVE_INTERVAL,
            keepalive_count_max=KEEPALIVE_COUNT_MAX,
        )
        return conn

    try:
        return await attempt()
    except asyncssh.HostKeyNotVerifiable:
        fingerprint, key = await _server_key(target)
        recorded = _has_entry(known, target)
        if ssh.accept_new_host_keys and not recorded and key is not None:
            known.parent.mkdir(parents=True, exist_ok=True)
            with known.open("ab") as f:
                f.write(_host_pattern(target).encode() + b" " + key.export_public_key())
            try:
                return await attempt()
            except asyncssh.PermissionDenied:
                raise HostFailed(_denied(user, client.asked)) from None
            except (OSError, asyncssh.Error, TimeoutError) as e:
                raise HostFailed(_why(e, target)) from None
        if recorded:
            raise HostFailed(
                f"host key changed: the server offers {fingerprint}, which {known} does not "
                "hold for it (if the host was reinstalled, remove its old line there)"
            ) from None
        raise HostFailed(
            f"unknown host key {fingerprint}: not in {known} (check it, then add it there "
            "or run with --accept-new-host-keys)"
        ) from None
    except asyncssh.PermissionDenied:
        raise HostFailed(_denied(user, client.asked)) from None
    except (OSError, asyncssh.Error, TimeoutError) as e:
        raise HostFailed(_why(e, target)) from None


def _denied(user: str, asked: set[str]) -> str:
    # sshd does not say whether the user exists: an unknown user and one without
    # our key look the same from here
    if asked:
        return (
            f"needs a password for user {user} (it asked for {' or '.join(sorted(asked))}; "
            "evergraph remote logs in with keys only: authorise a key for that user)"
        )
    return (
        f"no SSH key was accepted for user {user} (is that the right user? public keys "
        "only, never a password: give --ssh-key FILE or load the key into ssh-agent)"
    )


async def _server_key(target: Target) -> tuple[str, asyncssh.SSHKey | None]:
    try:
        key = await asyncio.wait_for(
            asyncssh.get_server_host_key(target.host, target.port), CONNECT_TIMEOUT
        )
    except (OSError, asyncssh.Error, TimeoutError):
        key = None
    if key is None:
        return "(its fingerprint could not be read)", None
    return key.get_fingerprint("sha256"), key


def _why(e: BaseException, target: Target) -> str:
    if isinstance(e, TimeoutError):
        return f"no SSH answer within {CONNECT_TIMEOUT:g} s (port {target.port} filtered?)"
    if isinstance(e, ConnectionRefusedError):
        return f"connection refused on port {target.port} (no sshd listening there)"
    if isinstance(e, OSError) and e.errno in _UNREACHABLE:
        return f"{os.strerror(e.errno or 0).lower()} (port {target.port})"
    text = getattr(e, "reason", None) or getattr(e, "strerror", None) or str(e)
    return " ".join(str(text).split()) or type(e).__name__


#: errors of a connect() that say the host cannot be reached at all
_UNREACHABLE = {errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ECONNRESET, errno.ETIMEDOUT}


async def install_bundle(conn: asyncssh.SSHClientConnection, bundle: Bundle, label: str) -> str:
    """Install `bundle` on the host; its site directory there. A streamed stdin (the
    objects' plan, as it is compressed) is written as it comes, with SSH's flow
    control; a host that fails early is reported by its own message."""

    async def run(argv: Sequence[str], stdin: Stdin) -> bytes:
        command = shlex.join(["python3", *argv])
        if isinstance(stdin, bytes):
            r = await conn.run(command, input=stdin, encoding=None)
        else:
            async with conn.create_process(command, encoding=None) as proc:
                try:
                    async for chunk in stdin:
                        proc.stdin.write(chunk)
                        await proc.stdin.drain()
                    proc.stdin.write_eof()
                except (OSError, asyncssh.Error):
                    pass  # the host stopped reading: its exit status and stderr say why
                r = await proc.wait()
        if r.exit_status != 0:
            err = r.stderr if isinstance(r.stderr, bytes) else b""
            raise BundleError(
                f"python3 on the host failed ({r.exit_status}): "
                + (" ".join(err.decode(errors="replace").split()) or "no message")
            )
        return r.stdout if isinstance(r.stdout, bytes) else b""

    return (await install(bundle, run, host=label)).site


async def copy_graph(conn: asyncssh.SSHClientConnection, file: Path, data: bytes) -> str:
    """Put the graph file under RUN_DIR/<sha256>/ on the host; its path there."""
    dest_dir = f"{RUN_DIR}/{hashlib.sha256(data).hexdigest()}"
    dest = f"{dest_dir}/{file.name}"
    q = shlex.quote
    command = (
        f"mkdir -p {q(dest_dir)} && cat > {q(dest + '.tmp')} && mv -f {q(dest + '.tmp')} {q(dest)}"
    )
    r = await conn.run(command, input=data, encoding=None)
    if r.exit_status != 0:
        raise HostFailed(f"cannot copy {file.name} to {dest_dir}: exit {r.exit_status}")
    return dest


@contextlib.asynccontextmanager
async def _heartbeats(stdin: asyncssh.SSHWriter[str]) -> AsyncIterator[None]:
    """Write a newline to the agent's wrapper every HEARTBEAT_INTERVAL s while the
    body runs: its proof that the link still carries data (AGENT_WRAPPER)."""

    async def beat() -> None:
        while True:
            try:
                stdin.write("\n")
            except (OSError, asyncssh.Error):
                return  # the channel is closing: its EOF does the rest
            await asyncio.sleep(HEARTBEAT_INTERVAL)

    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def run_agent(
    conn: asyncssh.SSHClientConnection,
    *,
    site: str,
    graph: str,
    seeds: str,
    hostname: str,
    args: AgentArgs,
    emit: Emit,
    label: str,
    converged: Callable[[bool], None] | None = None,
    end: asyncio.Event | None = None,
) -> int:
    """Run the agent on the host until it exits; relay its lines; its exit status.
    A coordinated agent (`args.coordinated`) tells `converged` each change of its
    state (True: every vertex clean and idle) and is told to exit once `end` is set."""
    argv = [
        "run",
        graph,
        "--seeds",
        seeds,
        "--hostname",
        hostname,
        "--state-dir",
        STATE_DIR,
        *args.argv(),
    ]
    command = shlex.join(["python3", "-I", "-c", AGENT_WRAPPER, site, *argv])
    # stdin stays open (written only with heartbeats, never closed) until the agent exits
    async with (
        conn.create_process(command, encoding="utf-8", errors="replace") as proc,
        _heartbeats(proc.stdin),
    ):
        reports = dict(zip(REPORT_LINES, (True, False), strict=True))

        async def relay(stream: asyncssh.SSHReader[str], tell: bool) -> None:
            async for text in stream:
                if not text:
                    continue  # asyncssh's iteration ends with "" at EOF: no line
                line = text.rstrip("\n")
                state = reports.get(line) if tell else None
                if state is None:
                    emit(label, line)
                elif converged is not None:
                    converged(state)

        async def ask_exit(event: asyncio.Event) -> None:
            await event.wait()
            with contextlib.suppress(OSError, asyncssh.Error):
                proc.stdin.write("exit\n")

        async with asyncio.TaskGroup() as tg:
            asker = tg.create_task(ask_exit(end)) if end is not None else None
            relays = [
                tg.create_task(relay(proc.stdout, args.coordinated)),
                tg.create_task(relay(proc.stderr, False)),
            ]
            await asyncio.wait(relays)
            if asker is not None:
                asker.cancel()
        done = await proc.wait()
    status = done.exit_status
    return 255 if status is None else status
