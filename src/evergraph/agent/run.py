"""The agent: the composition root that owns everything one `evergraph run` runs.

One TaskGroup holds every long-running service — the inotify hub, the World's
membership (lease keep-alive), the host-key book, the export publisher and
collector, the frontend's updates and the engine (the HTTP server, scheduler and
farm join it later). Cancellation is the one stop signal; when the engine
returns, the services are cancelled and the World is closed. Nothing is patched
into the engine after construction: it receives the watcher, World and keys.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import fcntl
import gc
import inspect
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from evergraph._util.atomic import ThrottledFile, sweep_temps
from evergraph._version import __version__
from evergraph.agent.observe import ClusterFigures, ObserverHub, TimedKV
from evergraph.cluster.exports import (
    MARKS_FILE,
    Collector,
    HostKeyBook,
    Publisher,
    SeqCounter,
    encode_marks,
    load_marks,
    publish_hostkeys,
)
from evergraph.cluster.hostbook import load_cluster_trust
from evergraph.cluster.hostkeys import HostKeys, KeyError_
from evergraph.cluster.members import HostnameTaken, Member, Membership
from evergraph.cluster.pins import Pins, PinsError
from evergraph.engine.engine import Engine
from evergraph.engine.model import GraphModel
from evergraph.engine.prepare import prepare
from evergraph.engine.services import Services
from evergraph.engine.settings import Settings, default_state_dir
from evergraph.engine.status import VertexStatus
from evergraph.errors import InputError
from evergraph.frontends.base import Context, Frontend, merged
from evergraph.frontends.collect import exports_of, merge
from evergraph.frontends.open import builtin_registry, parse_fragment
from evergraph.watch import InotifyHub
from evergraph.world.kv import KV, WorldError
from evergraph.world.names import hostname_problem
from evergraph.world.open import OpenWorld, WorldOptions, open_world

if TYPE_CHECKING:
    from evergraph.cluster.curator import Curator
    from evergraph.cluster.seat import Seat
    from evergraph.farm.host import WorkerHost
    from evergraph.farm.service import FarmSettings
    from evergraph.farm.signed import FarmTrust

log = logging.getLogger("evergraph.agent")

#: a long-running service the caller adds to the agent (the HTTP server): started
#: once the engine exists, owned by the agent's TaskGroup like every other
Service = Callable[["Agent"], Coroutine[Any, Any, None]]

T = TypeVar("T")


def prepare_state_dir(state_dir: Path | None) -> Path:
    d = state_dir or default_state_dir()
    try:
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as e:
        raise InputError(f"cannot create the state directory: {e.strerror}", str(d)) from None
    return d


def existing_state_dir(state_dir: Path | None) -> Path:
    """The state dir of a read-only command: it must exist (else it would read, or
    create, an empty World and answer with nothing)."""
    d = state_dir or default_state_dir()
    if not d.is_dir():
        raise InputError(
            "no such state directory (no agent has run with it): give the --state-dir of "
            "an agent, or --seeds for an etcd World",
            str(d),
        )
    return d


def prepare_model(model: GraphModel, settings: Settings) -> GraphModel:
    """Automatic edges and grouping, as the settings say; InputError on a cycle."""
    return prepare(model, autoedges=settings.autoedges, autogroup=settings.autogroup)


#: graphs of at least this many resources are prepared in a thread: automatic edges
#: and grouping of a million resources take seconds, while the loop must keep the
#: World lease alive (the thread gives it the GIL every switch interval, 5 ms)
PREPARE_IN_THREAD = 20_000


async def prepare_off_loop(model: GraphModel, settings: Settings) -> GraphModel:
    """`prepare_model`, in a thread for a big graph (nothing else touches `model`)."""
    if len(model.resources) < PREPARE_IN_THREAD:
        return prepare_model(model, settings)
    return await asyncio.to_thread(prepare_model, model, settings)


class FarmOptions(msgspec.Struct, frozen=True):
    """This agent's part in the farm (SPEC 4.6). (A Struct: a dataclass's generated
    methods are compiled at import, ~1 ms of every start.)"""

    #: `--worker`: lease this host to farm users
    worker: bool = False
    #: `--cap k=v` (discovered facts are added) and `--group g`
    caps: dict[str, str] = msgspec.field(default_factory=dict)
    groups: list[str] = msgspec.field(default_factory=list)
    #: how users reach this worker: sshd port and account
    ssh_port: int = 22
    ssh_user: str = "root"
    #: the authorized_keys file job keys go to (default: the ssh user's own)
    authorized_keys: str = ""
    #: agents a worker hands job keys to (`--farm-server`); this host always
    key_servers: tuple[str, ...] = ()
    #: their keys as given (`--farm-server NAME=KEY`: `public:verify`), pinned
    #: explicitly at start; a NAME given alone must be pinned explicitly already
    server_keys: dict[str, str] = msgspec.field(default_factory=dict)
    #: the resource kinds a request's fragment may use here (`--fragment-kinds`;
    #: empty: any kind)
    fragment_kinds: tuple[str, ...] = ()
    #: run the farm's matcher when elected (agents serving the farm API)
    matcher: bool = False
    #: periods and limits (None: the defaults)
    settings: FarmSettings | None = None


def sweep_state_dir(state_dir: Path) -> None:
    """What a kill -9 of the last run with this state dir left: commands still
    running (killed), temporary files. Only under the state dir's lock."""
    from evergraph.resources._proc import sweep_survivors

    sweep_survivors(state_dir)
    for path in sweep_temps(state_dir, prune=("etcd", "deploys/*"), temp_dirs_in=("deploys",)):
        log.info("removed %s (an interrupted write's)", path)


class _StateLock:
    """One agent per state dir: an flock on STATE/agent.lock (released by the kernel
    when the process dies, so kill -9 leaves nothing stale)."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / "agent.lock"
        self.fd = -1

    def __enter__(self) -> _StateLock:
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise InputError(
                f"cannot write the state directory ({e.strerror} on {self.path.name}): "
                "give a --state-dir the agent's user may write",
                str(self.path.parent),
            ) from None
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = os.pread(self.fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(self.fd)
            raise InputError(
                f"another agent (pid {other}) is running with this state directory",
                str(self.path.parent),
            ) from None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)


async def run_agent(
    settings: Settings,
    frontend: Frontend,
    handle_signals: bool = True,
    flush: tuple[Callable[[], None], float] | None = None,
    world: WorldOptions | None = None,
    replace: bool = False,
    services: Sequence[Service] = (),
    farm: FarmOptions | None = None,
    started: float | None = None,
) -> int:
    """Converge the frontend's first graph, swap in each later one, stop on signals;
    the exit status.

    `flush`: (function, seconds) called periodically while running (log buffers).
    `world`: join this World: claim the hostname as a member, publish what each
    graph exports, and let the frontend collect what other hosts export to us.
    `replace`: take the hostname over from another live agent.
    `services`: more services to own (started once the engine exists).
    `farm`: be a farm worker and/or run the farm's matcher when elected.
    `started`: the `time.monotonic()` the run began at (the command's start: the CLI
    ends the process a grace past `max_runtime` from there), from which the wait for
    a first graph counts too; None: from now.
    """
    # The graph lives as long as the agent: move it out of the cyclic GC's
    # generations so collections do not keep re-walking 10k+ long-lived objects.
    gc.freeze()
    agent = Agent(settings, frontend, world, replace, services, farm, started)
    loop = asyncio.get_running_loop()
    if handle_signals:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, agent.request_stop)
    try:
        with _StateLock(settings.state_dir):
            sweep_state_dir(settings.state_dir)
            return await agent.run(flush)
    except InputError as e:
        log.error("%s", e)
        return 2
    except OSError as e:
        if agent.engine is not None:
            raise  # not a failure to start: keep its traceback
        log.error("agent: cannot start: %s", e)  # e.g. no inotify instance left
        return 1
    finally:
        if handle_signals:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)


class Agent:
    def __init__(
        self,
        settings: Settings,
        frontend: Frontend,
        world: WorldOptions | None,
        replace: bool,
        services: Sequence[Service] = (),
        farm: FarmOptions | None = None,
        started: float | None = None,
    ) -> None:
        self.settings = settings
        self.extra = list(services)
        self.farm = farm or FarmOptions()
        self.worker: WorkerHost | None = None
        #: the request whose fragment was refused (logged once per job)
        self._fragment_refused = 0
        #: the farm's signer and trusted keys (None: not in the farm)
        self.farm_trust: FarmTrust | None = None
        #: the last graph from the frontend, untouched (a job's resources are merged
        #: into a copy of it whenever the job changes)
        self._raw: GraphModel | None = None
        self.frontend = frontend
        self.world_opts = world
        self.replace = replace
        self.stop = asyncio.Event()
        #: when the run began (`time.monotonic()`: see `run_agent`)
        self.started = time.monotonic() if started is None else started
        self.engine: Engine | None = None
        self._keys: HostKeys | None = None
        #: each service's task, and the coroutine it runs
        self._services: list[tuple[asyncio.Task[Any], Coroutine[Any, Any, Any]]] = []
        self._tg: asyncio.TaskGroup | None = None
        #: the World, once open (None without one)
        self.kv: KV | None = None
        self.publisher: Publisher | None = None
        self.collector: Collector | None = None
        #: this host's pins (with a World): `pins.listen(fn)` hears `hosts trust`,
        #: `hosts forget` and deployer changes made while the agent runs
        self.pins: Pins | None = None
        self._hub: InotifyHub | None = None
        #: the engine's observer: services (the HTTP view) subscribe to it
        self.observers = ObserverHub()
        #: `--etcd embedded`: this agent's seat in the self-forming cluster, and the
        #: curator it stands for election as
        self.seat: Seat | None = None
        self.curator: Curator | None = None

    def request_stop(self) -> None:
        self.stop.set()
        if self.engine is not None:
            self.engine.request_stop()

    def status(self) -> tuple[VertexStatus, ...]:
        """A snapshot of every vertex (empty before the first graph)."""
        return self.engine.status() if self.engine is not None else ()

    def cluster_figures(self) -> ClusterFigures | None:
        """The cluster as this agent's seat and curator see it (None without
        `--etcd embedded`)."""
        if self.seat is None:
            return None
        c = self.seat.counts()
        return ClusterFigures(
            voters=c.voters,
            learners=c.learners,
            standbys=c.standbys,
            leader_changes=c.leader_changes,
            replacements=self.curator.stats.replacements if self.curator is not None else 0,
        )

    def keys(self) -> HostKeys:
        """Loaded on first use: nacl costs start-up time a World-less run need not pay."""
        if self._keys is None:
            self._keys = HostKeys(self.settings.state_dir)
        return self._keys

    def _service(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        assert self._tg is not None
        task = self._tg.create_task(_logged(coro, name), name=name)
        self._services.append((task, coro))
        return task

    async def run(self, flush: tuple[Callable[[], None], float] | None) -> int:
        opened: OpenWorld | None = None
        #: what the resources share (connections, locks, committer): closed at the end
        self.shared = Services()
        try:
            # a run that exits the moment it converges watches no file (see
            # `Settings.one_shot`): its hub makes no inotify instance unless
            # something subscribes (a kind's own watch task may)
            lazy = self.settings.one_shot
            async with InotifyHub(lazy=lazy) as hub, asyncio.TaskGroup() as tg:
                self._tg = tg
                self._hub = hub
                self._service(hub.run(), "inotify")
                if flush is not None:
                    # from the start: a deploy follower may wait long for its first graph
                    self._service(_every(*flush), "log-flush")
                membership: Membership | None = None
                try:
                    if self.world_opts is not None and self.world_opts.embedded:
                        opened = await self._open_seat(self.world_opts)
                    elif self.world_opts is not None:
                        opts = self.world_opts
                        if self.settings.one_shot:
                            opts = dataclasses.replace(opts, short_lived=True)
                        opened = await open_world(opts, self.settings.state_dir)
                        if self.world_opts.is_etcd:
                            self._follow_cluster(opened.kv)
                    if opened is not None:
                        # every World call the agent makes is timed (for metrics)
                        opened.kv = self.kv = TimedKV(opened.kv)
                        membership = await self._join(opened)
                    status = await self._converge(hub, opened)
                    if self.seat is not None and membership is not None:
                        await self.seat.handover(membership.lease)
                    if membership is not None:
                        await membership.stop()
                except WorldError as e:
                    log.error("world: %s", e)
                    status = 1
                except (HostnameTaken, PinsError, InputError, KeyError_) as e:
                    log.error("%s", e)  # KeyError_: this host's key files are damaged
                    status = 2
                finally:
                    for t, coro in self._services:
                        t.cancel()
                        if inspect.getcoroutinestate(coro) == inspect.CORO_CREATED:
                            # cancelled before it ever ran (a refused start):
                            # close it, or Python warns it "was never awaited"
                            coro.close()
                return status
        except BaseExceptionGroup as eg:  # a service failed (logged by _logged)
            log.error("agent: stopped because a service failed: %s", eg.exceptions[0])
            return 1
        finally:
            self._tg = None
            await self.shared.aclose()
            if opened is not None:
                await opened.close()

    async def _join(self, opened: OpenWorld) -> Membership:
        """Claim the hostname, publish our keys, start the book, publisher, collector."""
        kv, host = opened.kv, self.settings.host()
        why = hostname_problem(host)
        if why:
            raise InputError(why, "--hostname")
        keys = self.keys()
        # with a cluster CA, hosts accept a key only with the CA's certificate of it
        ca, cert = load_cluster_trust(self.settings.state_dir)
        self.pins = pins = Pins(self.settings.state_dir)
        if self._hub is not None and not self.settings.one_shot:
            # pins are live: edits reach us within a second (a one-shot run ends at
            # once, and makes no inotify instance it need not)
            self._hub.subscribe(str(pins.path), lambda _mask: pins.poll())
        servers = self._farm_servers(pins, host)  # pinned before any key is read
        caps, groups = self._worker_caps(host)
        membership = Membership(
            kv,
            Member(
                host=host,
                public=keys.public,
                verify=keys.verify,
                version=__version__,
                capabilities=caps,
                groups=groups,
            ),
            keys=keys,
        )
        previous = await membership.claim(replace=self.replace)
        await publish_hostkeys(kv, keys, host, cert=cert)
        # restores hostkeys/<me>
        seat = self.seat
        book = HostKeyBook(
            kv,
            pins,
            host,
            own=keys,
            ca=ca,
            own_cert=cert,
            revoked=(lambda: seat.revoked) if seat is not None else (lambda: ()),
        )
        if seat is not None:
            seat.on_revoked(book.recheck)
        self.publisher = Publisher(
            kv, keys, host, book, lambda: membership.lease, SeqCounter(self.settings.state_dir)
        )
        self.collector = collector = Collector(kv, keys, host, book, own=self.publisher.noticed)
        # the highest index sequences seen, kept across restarts (an older index put
        # back while this agent was down is refused too)
        collector.restore_marks(load_marks(self.settings.state_dir))
        marks = ThrottledFile(
            self.settings.state_dir / MARKS_FILE, lambda: encode_marks(collector.marks())
        )
        collector.on_marks = lambda _pair, _idx: marks.changed()
        membership.on_regrant(self.publisher.resync)

        def rebuild(why: str) -> None:
            # a replaced World: what the agent owns without a lease (its host keys)
            # is written again too; the lease's records follow `on_regrant`
            self._service(
                _retrying(
                    lambda: publish_hostkeys(kv, keys, host, cert=cert), "re-publish host keys"
                ),
                "hostkeys-republish",
            )

        membership.on_replaced(rebuild)
        self._service(membership.run(), "membership")
        self._service(self._on_replaced(membership), "replaced-watch")
        self._service(book.run(), "hostkeys")
        await book.ready.wait()
        self._service(self.publisher.run(), "export-publisher")
        self._service(self.collector.run(), "export-collector")
        if previous:
            self._service(self._retire(opened, previous), "retire-old-lease")
        await self._join_farm(kv, host, membership, book, servers)
        if self.seat is not None:
            self._seat_services(kv, host, membership)
        return membership

    def _follow_cluster(self, kv: KV) -> None:
        """An etcd World: its client follows the members' client URLs, so a seed that
        dies later is no single point of failure (a seat does this itself)."""
        from evergraph.world.etcd import EtcdKV

        if isinstance(kv, EtcdKV):
            from evergraph.world.etcd_cluster import follow_members

            self._service(follow_members(kv), "etcd-members")

    async def _open_seat(self, opts: WorldOptions) -> OpenWorld:
        """`--etcd embedded`: this agent's seat in a self-forming cluster."""
        from evergraph.cluster.jointokens import TokenError, read_token_source
        from evergraph.cluster.seat import Seat, SeatOptions

        host = self.settings.host()
        why = hostname_problem(host)
        if why:
            raise InputError(why, "--hostname")
        try:
            token = read_token_source(opts.join_token_file, os.environ)
        except TokenError as e:
            raise InputError(str(e), "--join-token-file") from None
        self.seat = seat = Seat(
            self.settings.state_dir,
            host,
            self.keys(),
            SeatOptions(
                client_url=opts.client_url,
                peer_url=opts.peer_url,
                seeds=opts.seeds,
                token=token,
                member_timeout=opts.member_timeout,
            ),
        )
        kv = await seat.open()
        return OpenWorld(kv, seat)

    def _seat_services(self, kv: KV, host: str, membership: Membership) -> None:
        """The seat's upkeep and the curator's candidacy (every embedded member holds
        the CA, so any may be elected)."""
        from evergraph.cluster.curator import CURATOR, Curator
        from evergraph.cluster.election import Election

        seat = self.seat
        assert seat is not None
        assert seat.ca is not None
        assert seat.kv is not None
        self._service(seat.run(lambda: membership.lease), "etcd-seat")
        election = Election(kv, CURATOR, host)
        self._service(election.run(), "curator-election")
        from evergraph.cluster.roster import SizeSeen

        self.curator = Curator(
            seat.kv,
            seat.ca,
            election,
            seat.opts.member_timeout,
            size_seen=SizeSeen(seat.dir / "size-seen.json"),
        )
        self._service(self.curator.run(), "etcd-curator")

    def _farm_servers(self, pins: Pins, host: str) -> dict[str, str]:
        """The farm servers' verify keys: `--farm-server NAME=KEY` is pinned explicitly
        (whatever the World says of NAME); NAME alone must be pinned explicitly
        already (`hosts trust`), else the start is refused (exit 2)."""
        out: dict[str, str] = {}
        for name in self.farm.key_servers:
            if name == host:
                continue  # this host is always trusted
            ident = self.farm.server_keys.get(name, "")
            pin = pins.get(name)
            if ident:
                if pin is None or pin.how != "explicit" or pin.identity != ident:
                    pin = pins.trust(name, ident)
                    log.info("farm: pinned the key of farm server %s (--farm-server)", name)
            elif pin is None or pin.how != "explicit":
                raise InputError(
                    f"farm server {name}: its key is not pinned explicitly; give "
                    f"--farm-server {name}=KEY (KEY as `evergraph hosts key` prints it on "
                    f"{name}), or pin it with `evergraph hosts trust {name} KEY`",
                    "--farm-server",
                )
            out[name] = pin.verify
        return out

    async def _join_farm(
        self,
        kv: KV,
        host: str,
        membership: Membership,
        book: HostKeyBook,
        servers: dict[str, str],
    ) -> None:
        # imported in each branch: the farm's modules (the worker's RSA keys:
        # cryptography) cost start-up time agents without the farm need not pay
        opts = self.farm
        if opts.matcher or opts.worker:
            from evergraph.farm.signed import FarmTrust

            def host_key(name: str) -> str | None:
                pair = book.trusted(name)
                return pair[1] if pair is not None else None

            self.farm_trust = FarmTrust(self.keys(), host, servers, host_key)
        if opts.matcher:
            from evergraph.cluster.election import Election
            from evergraph.farm.leader import FarmLeader
            from evergraph.farm.service import FarmSettings

            assert self.farm_trust is not None
            farm_settings = opts.settings or FarmSettings()
            election = Election(kv, "farm", host, ttl=farm_settings.election_ttl)
            self._service(election.run(), "farm-election")
            leader = FarmLeader(kv, election, self.farm_trust, farm_settings)
            self._service(leader.run(), "farm-matcher")
        if opts.worker:
            from evergraph.farm.facts import discovered, worker_uuid
            from evergraph.farm.host import WorkerHost

            assert self.publisher is not None
            assert self.farm_trust is not None
            try:
                uuid = worker_uuid(self.settings.state_dir)
            except ValueError as e:
                raise InputError(str(e), "--worker") from None
            worker = WorkerHost(
                kv,
                uuid=uuid,
                host=host,
                caps=membership.member.capabilities or {**discovered(), "hostname": host},
                groups=list(opts.groups),
                address=membership.member.address,
                port=opts.ssh_port,
                username=opts.ssh_user,
                lease=lambda: membership.lease,
                publisher=self.publisher,
                key_servers={host, *opts.key_servers},
                trust=self.farm_trust,
                state_dir=self.settings.state_dir,
            )
            await worker.alive()
            await worker.register()

            def alive_again() -> None:
                self._service(_retrying(worker.alive, "mark the worker alive"), "farm-alive")

            def register_again(why: str) -> None:
                self._service(_retrying(worker.register, "register the worker"), "farm-register")

            membership.on_regrant(alive_again)
            membership.on_replaced(register_again)
            self._service(worker.run(), "farm-worker")
            self.worker = worker

    def _worker_caps(self, host: str) -> tuple[dict[str, str], list[str]]:
        """A worker's capabilities and groups (its member record shows them too);
        none for other agents."""
        if not self.farm.worker:
            return {}, []
        from evergraph.farm.facts import discovered

        return {**discovered(), "hostname": host, **self.farm.caps}, list(self.farm.groups)

    async def _on_replaced(self, membership: Membership) -> None:
        await membership.replaced.wait()
        self.request_stop()

    async def _retire(self, opened: OpenWorld, lease: int) -> None:
        """Our previous run's lease: once everything is re-published under the new
        one, end it (what it still carries is what we no longer export)."""
        assert self.publisher is not None
        await self.publisher.acknowledged.wait()
        with contextlib.suppress(WorldError):
            await opened.kv.revoke(lease)

    async def _converge(self, hub: InotifyHub, opened: OpenWorld | None) -> int:
        settings = self.settings
        self.engine = engine = Engine(
            settings,
            # fed only when a service listens: snapshots cost the hot path (a
            # service that subscribes says so: `observes = True`)
            observer=self.observers
            if any(getattr(s, "observes", False) for s in self.extra)
            else None,
            watcher=hub,
            world=opened.kv if opened is not None else None,
            keys=self.keys,
            services=self.shared,
        )
        for i, service in enumerate(self.extra):
            self._service(service(self), f"service-{i}")
        if self.stop.is_set():
            return 0
        ctx = Context(
            registry=builtin_registry(),
            hostname=engine.hostname,
            state_dir=settings.state_dir,
            watcher=hub if settings.watch else None,
            kv=opened.kv if opened is not None else None,
            collector=self.collector,
        )
        # (--max-runtime from the run's start, as the CLI's own bound counts: a slow
        # start-up still ends here, with the line below, before that bound)
        wait = settings.max_runtime
        if wait is not None:
            wait = max(0.0, self.started + wait - time.monotonic())
        raw = await _unless_stopped(self.frontend.first(ctx), self.stop, wait)
        if raw is None:
            if self.stop.is_set():
                return 0  # stopped while waiting for a first graph (a deploy)
            # --max-runtime passed first: nothing ran, which is no success
            log.error(
                "no graph was loaded in %g s (--max-runtime): nothing ran", settings.max_runtime
            )
            return 1
        raw = self._with_job(raw)
        self._publish(raw)
        model = await prepare_off_loop(raw, settings)
        # a one-shot run does not follow the graph file (nor later graphs): like a
        # change to a checked file during it, a save during it is not seen, as
        # the same save a moment after the exit would not be
        follow = settings.watch and not settings.one_shot
        updates = self._prepared(self._jobs(self.frontend.updates(ctx))) if follow else None
        return await engine.run(model, updates)

    def _with_job(self, raw: GraphModel, fresh: bool = True) -> GraphModel:
        """`raw` with the running job's resources (a worker): its key authorized
        (`meta.reverse`: revoked when the job ends, even across a crash) and the
        request's graph fragment. `fresh`: `raw` is the frontend's new graph."""
        if self.worker is None:
            return raw
        if fresh:
            self._raw = copy.deepcopy(raw)  # prepare() changes what it is given
        job = self.worker.job
        if job is None:
            return raw
        from evergraph.engine.build import build  # (a worker's only)

        kind, key, *comment = job.public_key.split(" ")
        grant = build(
            builtin_registry(),
            "ssh_authorized_key",
            {
                "name": f"farm-job-{job.request}",
                **(
                    {"file": self.farm.authorized_keys}
                    if self.farm.authorized_keys
                    else {"user": self.farm.ssh_user}
                ),
                "type": kind,
                "key": key,
                "comment": " ".join(comment),
                "meta": {"reverse": True},
            },
            f"the job of farm request {job.request}",
        )
        merge(raw, [grant])
        if job.fragment:
            try:
                frag = parse_fragment(
                    job.fragment, f"request {job.request}'s fragment", builtin_registry()
                )
            except InputError as e:
                log.error("farm: %s (the job runs without its fragment)", e)
            else:
                allowed = set(self.farm.fragment_kinds)
                other = sorted({r.kind for r in frag.resources.values()} - allowed)
                if allowed and other:
                    if self._fragment_refused != job.request:
                        self._fragment_refused = job.request
                        log.error(
                            "farm: request %d's fragment uses %s, not among this worker's "
                            "--fragment-kinds (%s): refused, the job runs without it",
                            job.request,
                            ", ".join(other),
                            ",".join(sorted(allowed)),
                        )
                    return raw
                # what the fragment changes is undone when the job ends, even across
                # a crash (a persisted reversal), whatever the fragment's own meta says
                for res in frag.resources.values():
                    res.meta = msgspec.structs.replace(res.meta, reverse=True)
                merge(raw, list(frag.resources.values()))
                for edge in frag.edges:
                    raw.edges.append(edge)
        return raw

    async def _jobs(self, graphs: AsyncIterator[GraphModel]) -> AsyncIterator[GraphModel]:
        """The frontend's graphs, and the last one again whenever the job changes."""
        if self.worker is None:
            async for raw in graphs:
                yield raw
            return
        changed: asyncio.Queue[bool] = asyncio.Queue()
        unlisten = self.worker.listen(lambda: changed.put_nowait(True))

        async def jobs() -> AsyncIterator[tuple[str, Any]]:
            while True:
                yield "job", await changed.get()

        async def frontend() -> AsyncIterator[tuple[str, Any]]:
            async for raw in graphs:
                yield "graph", raw

        try:
            async for what, payload in merged(frontend(), jobs()):
                if what == "graph":
                    yield self._with_job(payload)
                elif self._raw is not None:
                    log.info("farm: the job changed: swapping its resources in live")
                    yield self._with_job(copy.deepcopy(self._raw), fresh=False)
        finally:
            unlisten()

    def _publish(self, raw: GraphModel) -> None:
        exports = exports_of(raw)
        if self.publisher is not None:
            self.publisher.set(exports)
        elif exports:
            log.warning("this graph exports resources, but the agent runs without a World")

    async def _prepared(self, graphs: AsyncIterator[GraphModel]) -> AsyncIterator[GraphModel]:
        """The frontend's later graphs, their exports published, prepared for the engine."""
        async for raw in graphs:
            self._publish(raw)
            try:
                yield await prepare_off_loop(raw, self.settings)
            except InputError as e:
                log.error("%s (the running graph is kept)", e)


async def _logged(coro: Awaitable[Any], name: str) -> Any:
    """A service that fails is logged with its name, then fails the agent."""
    try:
        return await coro
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("agent: the %s service failed", name)
        raise


async def _retrying(fn: Callable[[], Awaitable[None]], what: str) -> None:
    """`fn()` until the World takes it (a World error is retried with backoff)."""
    delay = 0.05
    while True:
        try:
            await fn()
            return
        except WorldError as e:
            log.warning("world: cannot %s (%s); retrying in %.2fs", what, e, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)


async def _unless_stopped(
    work: Awaitable[T], stop: asyncio.Event, timeout: float | None
) -> T | None:
    """`work`'s result, or None (work cancelled) if `stop` is set or `timeout`
    passes first. Both waits are owned by a TaskGroup: neither outlives the call."""
    outcome: list[tuple[bool, Any]] = []

    async def body() -> None:
        try:
            outcome.append((True, await work))
        except Exception as e:  # raised to the caller as it is, not in a group
            outcome.append((False, e))

    async with asyncio.TaskGroup() as tg:
        task = tg.create_task(body())
        stopper = tg.create_task(stop.wait())
        await asyncio.wait({task, stopper}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        task.cancel()
        stopper.cancel()
    if not outcome:
        return None
    ok, value = outcome[0]
    if not ok:
        raise value
    result: T = value
    return result


async def _every(fn: Callable[[], None], seconds: float) -> None:
    while True:
        await asyncio.sleep(seconds)
        fn()
