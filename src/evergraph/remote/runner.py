"""`evergraph remote`'s run over many hosts: a World the initiator owns, each host's
session (remote/session.py) bounded by ``--parallel``, and the recap.

The World is an etcd on the initiator's loopback; each host reaches it through a
reverse port forward of its own SSH connection, so nothing but SSH crosses the
network and the World lives exactly as long as the run. With ``seeds`` the hosts
use that cluster instead (the URLs go to the agents as given): no etcd here, no
forward.

The end of a session is coordinated (`Ending`), unless `--converged-timeout` is
given (each agent exits once converged that long) or with ``seeds`` (the agents
fall back to that per-agent timeout, DEFAULT_SEEDS_TIMEOUT by default: the seeds'
World may not be reachable from here). Each agent reports on its stdout the moment
its graph is clean and idle, and when it is busy again (an export arrived); the
run tells every agent to exit once all of its live hosts are converged and its
World had no write for QUIET seconds, during which no host went busy. A write in
that window (an export on its way to a host) starts it again.

Each host's progress is told through `Report` (connecting, installing, running,
then its outcome's state) for the live display (remote/progress.py).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import tempfile
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import asyncssh

from evergraph.remote.bundle import Bundle, BundleError
from evergraph.remote.session import (
    AgentArgs,
    Emit,
    HostFailed,
    SshOptions,
    connect,
    copy_graph,
    install_bundle,
    run_agent,
)
from evergraph.remote.target import Target

#: exit statuses (SPEC: 0 clean, 1 a resource failed, 2 bad input, 4 a host not reached)
EXIT_OK, EXIT_FAILED, EXIT_NOOP_CHANGES, EXIT_UNREACHABLE = 0, 1, 3, 4

#: seconds the World must go without a write, and every live host stay converged,
#: before a coordinated session ends (an export written just before is on its way:
#: its target turns busy within this, and the window starts again). Time, not a
#: revision handshake: a host hears only the keys it watches, so no revision tells
#: that it has heard everything; 0.5 s leaves a loaded machine's watch delivery
#: room (0.2 s would end every run 0.3 s sooner, with less margin)
QUIET = 0.5
#: the agents' converged-timeout with --seeds and no --converged-timeout
DEFAULT_SEEDS_TIMEOUT = 5.0

#: a host's progress: (its label, "connecting" | "installing" | "running" | the
#: outcome's state once it ended)
Report = Callable[[str, str], None]


def _no_report(label: str, state: str) -> None:
    del label, state


@dataclass
class Outcome:
    """How one host's session ended."""

    target: Target
    #: "converged", "changes" (noop), "failed" or "unreachable"
    state: str = "unreachable"
    reason: str = ""

    @property
    def line(self) -> str:
        """The host's recap line."""
        text = {"changes": "would change (noop)"}.get(self.state, self.state)
        return f"{self.target.label}: {text}" + (f": {self.reason}" if self.reason else "")


class Ending:
    """The coordinated end of a session: tells the agents to exit (sets each live
    host's `end` event) once every live host is converged, and stayed so with the
    World unwritten (`revision` unchanged) for `quiet` seconds.

    A host is live from the moment it holds a slot (`--parallel`) until its session
    ends: while it connects and installs it counts as busy, so the hosts already
    converged wait for it (and for its exports). Hosts still waiting for a slot are
    not live: the hosts holding the slots end without them, as each one did by its
    timeout before, and free the slots for them."""

    def __init__(self, revision: Callable[[], Awaitable[int]], quiet: float = QUIET) -> None:
        self.revision = revision
        self.quiet = quiet
        #: live host -> converged (False: setting up, or busy)
        self.converged: dict[str, bool] = {}
        #: live host -> the event that tells its agent to exit
        self.ends: dict[str, asyncio.Event] = {}
        #: how many times a host went busy (a change in a quiet window spoils it)
        self.busied = 0
        self._changed = asyncio.Event()

    def live(self, label: str) -> asyncio.Event:
        """`label` holds a slot now (busy until it reports); its end event."""
        self.converged[label] = False
        self.ends[label] = end = asyncio.Event()
        self._changed.set()
        return end

    def report(self, label: str, converged: bool) -> None:
        """What the agent on `label` said: converged (True) or busy again."""
        if label not in self.converged:
            return
        if not converged:
            self.busied += 1
        self.converged[label] = converged
        self._changed.set()

    def gone(self, label: str) -> None:
        """`label`'s session ended (its agent exited, or it never ran one)."""
        self.converged.pop(label, None)
        self.ends.pop(label, None)
        self._changed.set()

    def _all_converged(self) -> bool:
        return bool(self.converged) and all(self.converged.values())

    async def run(self) -> None:
        """Decide the ends, for as long as the run lasts (cancelled then)."""
        while True:
            await self._changed.wait()
            self._changed.clear()
            if not self._all_converged() or all(e.is_set() for e in self.ends.values()):
                continue
            busied, revision = self.busied, await self.revision()
            await asyncio.sleep(self.quiet)
            if (
                self._all_converged()
                and busied == self.busied
                and revision == await self.revision()
            ):
                for end in self.ends.values():
                    end.set()
            else:
                self._changed.set()  # look again: a new window


def etcd_revision(port: int) -> Callable[[], Awaitable[int]]:
    """The current revision of the etcd on loopback `port` (its JSON gateway)."""
    body = json.dumps({"key": base64.b64encode(b"\0").decode(), "count_only": True}).encode()
    # straight to loopback: an http_proxy in the environment must not take it
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def read() -> int:
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v3/kv/range",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        with opener.open(request, timeout=5) as r:
            return int(json.load(r)["header"]["revision"])

    async def revision() -> int:
        try:
            return await asyncio.to_thread(read)
        except (OSError, ValueError, KeyError, TypeError):
            # a World we cannot read counts as quiet: the hosts' reports decide alone
            # (rather than a session that never ends; its agents, which cannot read
            # it either, fail and end their sessions so)
            return 0

    return revision


@dataclass
class RemoteRun:
    """One `evergraph remote` invocation (everything checked already)."""

    file: Path
    targets: Sequence[Target]
    ssh: SshOptions = field(default_factory=SshOptions)
    agent: AgentArgs = field(default_factory=AgentArgs)
    parallel: int = 32
    #: the cluster the hosts use (etcd client URLs); empty: a World of the run's own
    seeds: Sequence[str] = ()

    async def run(self, emit: Emit, report: Report = _no_report) -> list[Outcome]:
        """Every host's outcome, in the order given."""
        if self.seeds and self.agent.coordinated:
            # no World of ours to watch for quiet: each agent ends by its own timeout
            self.agent = dataclasses.replace(self.agent, converged_timeout=DEFAULT_SEEDS_TIMEOUT)
        data = self.file.read_bytes()
        bundle = await asyncio.to_thread(Bundle.of_running_python)
        async with self._world() as etcd_port:
            gate = asyncio.Semaphore(self.parallel)
            outcomes = [Outcome(t) for t in self.targets]
            ending = None
            if self.agent.coordinated and etcd_port is not None:
                ending = Ending(etcd_revision(etcd_port))
            async with asyncio.TaskGroup() as tg:
                hosts = [
                    tg.create_task(
                        self._host(o, gate, bundle, data, etcd_port, emit, report, ending)
                    )
                    for o in outcomes
                ]
                if ending is not None:
                    decider = tg.create_task(ending.run())
                    await asyncio.wait(hosts)
                    decider.cancel()
            return outcomes

    @contextlib.asynccontextmanager
    async def _world(self) -> AsyncIterator[int | None]:
        """The loopback port of the run's own etcd, for as long as the run; None
        with `seeds` (the hosts' World is theirs)."""
        if self.seeds:
            yield None
            return
        from evergraph.world.etcd_server import EtcdServer

        with tempfile.TemporaryDirectory(prefix="evergraph-remote-") as tmp:
            etcd = EtcdServer.single(Path(tmp) / "etcd", name="remote")
            # spawned from the loop's thread, which lives as long as the run: etcd
            # gets SIGTERM when it dies (pdeathsig follows the spawning thread)
            etcd.spawn()
            try:
                await asyncio.to_thread(etcd.wait_healthy)
            except BaseException:
                etcd.stop()
                raise
            try:
                yield etcd.client_port
            finally:
                await asyncio.to_thread(etcd.stop)

    async def _host(
        self,
        outcome: Outcome,
        gate: asyncio.Semaphore,
        bundle: Bundle,
        data: bytes,
        etcd_port: int | None,
        emit: Emit,
        report: Report,
        ending: Ending | None,
    ) -> None:
        label = outcome.target.label
        try:
            await self._session(outcome, gate, bundle, data, etcd_port, emit, report, ending)
        finally:
            if ending is not None:
                ending.gone(label)
            report(label, outcome.state)

    async def _session(
        self,
        outcome: Outcome,
        gate: asyncio.Semaphore,
        bundle: Bundle,
        data: bytes,
        etcd_port: int | None,
        emit: Emit,
        report: Report,
        ending: Ending | None,
    ) -> None:
        target = outcome.target
        label = target.label
        ssh = self.ssh
        async with gate:
            end = ending.live(label) if ending is not None else None
            report(label, "connecting")
            try:
                conn = await connect(target, ssh)
            except HostFailed as e:
                outcome.reason = str(e)
                emit(label, f"unreachable: {e}")
                return
            async with conn:
                report(label, "installing")
                listener: asyncssh.SSHListener | None = None
                try:
                    site = await install_bundle(conn, bundle, label)
                    graph = await copy_graph(conn, self.file, data)
                    if etcd_port is not None:
                        listener = await conn.forward_remote_port(
                            "127.0.0.1", 0, "127.0.0.1", etcd_port
                        )
                except (BundleError, HostFailed) as e:
                    outcome.reason = str(e)
                    emit(label, f"not set up: {e}")
                    return
                except (OSError, asyncssh.Error) as e:
                    outcome.reason = f"set-up failed: {' '.join(str(e).split())}"
                    emit(label, outcome.reason)
                    return
                seeds = ",".join(self.seeds)
                if listener is not None:
                    seeds = f"http://127.0.0.1:{listener.get_port()}"
                report(label, "running")
                try:
                    status = await run_agent(
                        conn,
                        site=site,
                        graph=graph,
                        seeds=seeds,
                        hostname=target.agent_hostname,
                        args=self.agent,
                        emit=emit,
                        label=label,
                        converged=(None if ending is None else lambda c: ending.report(label, c)),
                        end=end,
                    )
                except (OSError, asyncssh.Error, ExceptionGroup) as e:
                    # a cut link (keepalives unanswered): the agent's wrapper ends it
                    lost = _connection_error(e)
                    if lost is None:
                        raise
                    outcome.reason = f"connection lost: {' '.join(str(lost).split())}"
                    emit(label, outcome.reason)
                    return
                finally:
                    if listener is not None:
                        listener.close()
        outcome.state, outcome.reason = _agent_outcome(status)


def _connection_error(e: BaseException) -> BaseException | None:
    """The connection's error if that is all `e` is (a group of them, from the tasks
    relaying the agent's output, or one), else None."""
    if isinstance(e, BaseExceptionGroup):
        match, rest = e.split((OSError, asyncssh.Error))
        if match is None or rest is not None:
            return None
        first: BaseException = match
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        return first
    return e if isinstance(e, (OSError, asyncssh.Error)) else None


def _agent_outcome(status: int) -> tuple[str, str]:
    if status == 0:
        return "converged", ""
    if status == 3:
        return "changes", ""
    if status == 1:
        return "failed", "a resource failed (see its lines above)"
    if status == 2:
        return "failed", "the agent refused its input (see its lines above)"
    return "failed", f"the agent exited with status {status}"


def exit_status(outcomes: Sequence[Outcome]) -> int:
    """4 if a host was not reached or set up, else 1 if one failed, else 3 (noop
    changes) or 0."""
    states = {o.state for o in outcomes}
    if "unreachable" in states:
        return EXIT_UNREACHABLE
    if "failed" in states:
        return EXIT_FAILED
    if "changes" in states:
        return EXIT_NOOP_CHANGES
    return EXIT_OK


def total_line(outcomes: Sequence[Outcome]) -> str:
    """The last line: how many hosts ended how."""
    counts: dict[str, int] = {}
    for o in outcomes:
        counts[o.state] = counts.get(o.state, 0) + 1
    parts = [
        f"{counts[s]} {s}" for s in ("converged", "changes", "failed", "unreachable") if s in counts
    ]
    return f"total: {len(outcomes)} host(s): " + ", ".join(parts)
