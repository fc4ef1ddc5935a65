"""This agent's seat in a self-forming etcd cluster (`run --etcd embedded`, SPEC 4.8).

`Seat.open()` decides, from the state dir, what this node is:

- **resume**: `cluster/cluster.json` says this node formed or joined a cluster
  before. If its etcd data dir holds a member, etcd starts on it (a voter, or
  a learner, comes back); a member the cluster removed meanwhile discards its
  stale data and waits as a standby to be added again as a new member;
- **join**: a join token (`--join-token-file`, `EVERGRAPH_JOIN_TOKEN`) and
  seeds: the join service of a seed certifies this node (cluster/joinwire.py);
  it starts as a standby;
- **form**: no token and no seed that answers: a new cluster with its own CA,
  this node its only voter. Seeds that answer without a token is an input
  error (exit 2): joining always takes a token.

`cluster.json` is written last, so a kill -9 half-way forms or joins again.
The KV it returns follows the cluster: its endpoints are the members' client
URLs, refreshed from etcd's member list.

`Seat.run(lease)` (a service of the agent) keeps the candidate record under
the agent's member lease, starts etcd when the curator invites this standby,
restarts an etcd that died, discards the data of a member that was removed
(it is a standby again), and serves joins for hosts holding a token.
`Seat.handover()` on a clean stop asks to be replaced and waits until the
curator has done so (only when a standby can take the seat).

`Seat.counts()` is what the seat last saw of the cluster (voters, learners,
standbys, leader changes), for the agent's metrics; `_follow` keeps it current.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from evergraph._util.atomic import atomic_write, make_dirs
from evergraph._util.clock import SYSTEM, Clock
from evergraph.cluster import ca as ca_files
from evergraph.cluster.ca import CAError, ClusterCA, cluster_dir, new_node_key, url_hosts
from evergraph.cluster.hostkeys import HostKeys
from evergraph.cluster.jointokens import JoinToken
from evergraph.cluster.joinwire import (
    JoinRefused,
    JoinServer,
    JoinUnreachable,
    join_port,
    request_join,
)
from evergraph.cluster.revoke import CRL_KEY, read_crl
from evergraph.cluster.roster import (
    CANDIDATES,
    INVITES,
    LEAVING,
    Candidate,
    decode_candidate,
    decode_invite,
    encode_candidate,
)
from evergraph.errors import InputError
from evergraph.world.etcd import EtcdKV
from evergraph.world.etcd_cluster import EtcdMember, member_list, member_status
from evergraph.world.etcd_server import (
    DEFAULT_TIMING,
    EtcdServer,
    MemberRemoved,
    PortInUse,
    ServerTLS,
)
from evergraph.world.follow import Tombstone, watch_one
from evergraph.world.kv import WorldError
from evergraph.world.open import member_urls_problem

log = logging.getLogger("evergraph.cluster")

STATE_FILE = "cluster.json"
#: `EVERGRAPH_ETCD_TIMING=fast`: loopback raft timing (tests on one machine)
TIMING_ENV = "EVERGRAPH_ETCD_TIMING"
#: seconds between two looks at etcd's member list
FOLLOW_EVERY = 1.0
#: seconds a member's port held by another process is waited for at its start (its
#: etcd of before, still exiting), before the start fails with the reason
PORT_WAIT_S = 15.0


@dataclass(frozen=True)
class SeatOptions:
    client_url: str = "http://127.0.0.1:2379"
    peer_url: str = "http://127.0.0.1:2380"
    seeds: tuple[str, ...] = ()
    token: JoinToken | None = None
    member_timeout: float = 15.0
    #: how long `open` keeps trying the seeds with a token before giving up
    join_timeout: float = 300.0

    def check(self) -> None:
        err = member_urls_problem(self.client_url, self.peer_url)
        if err is not None:
            raise err


@dataclass(frozen=True)
class SeatCounts:
    """The cluster as this seat last saw it (the agent's metrics)."""

    voters: int = 0
    learners: int = 0
    #: certified candidates that are no member
    standbys: int = 0
    #: times the etcd leader was seen to be another member than the last one seen
    leader_changes: int = 0


@dataclass
class ClusterState:
    """`cluster/cluster.json`: what this node knows of its cluster."""

    ca_fingerprint: str
    endpoints: list[str]
    scheme: str
    formed: bool = False
    extra: dict[str, object] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path) -> ClusterState | None:
        try:
            raw = json.loads(path.read_bytes())
            return cls(
                ca_fingerprint=str(raw["ca_fingerprint"]),
                endpoints=[str(u) for u in raw["endpoints"]],
                scheme=str(raw.get("scheme", "https")),
                formed=bool(raw.get("formed", False)),
            )
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise InputError(
                f"damaged cluster state ({e}): remove it to join again", str(path)
            ) from None

    def save(self, path: Path) -> None:
        body = {
            "ca_fingerprint": self.ca_fingerprint,
            "endpoints": self.endpoints,
            "scheme": self.scheme,
            "formed": self.formed,
        }
        atomic_write(path, json.dumps(body, indent=1).encode() + b"\n", mode=0o600)


def _reachable(url: str, timeout: float = 1.0) -> bool:
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname or "", parts.port or 2379), timeout):
            return True
    except OSError:
        return False


class Seat:
    def __init__(
        self,
        state_dir: Path,
        host: str,
        keys: HostKeys,
        opts: SeatOptions,
        clock: Clock = SYSTEM,
    ) -> None:
        self.state_dir = Path(state_dir)
        self.dir = cluster_dir(state_dir)
        self.host = host
        self.keys = keys
        self.opts = opts
        self.clock = clock
        self.scheme = urlsplit(opts.client_url).scheme
        self.server: EtcdServer | None = None
        self.kv: EtcdKV | None = None
        self.ca: ClusterCA | None = None
        self.state: ClusterState | None = None
        #: the member list as last read (empty: not yet)
        self.members: list[EtcdMember] = []
        self._stopping = False
        self._formed_now = False
        self._lock = asyncio.Lock()
        #: serials the cluster revoked (`cluster remove`), from `cluster/crl`
        self.revoked: set[int] = set()
        self._revoked_listeners: list[Callable[[], None]] = []
        #: candidates as last read: key -> (mod revision, the record if certified),
        #: so each record's certificate is checked once, not at every look
        self._candidates: dict[str, tuple[int, Candidate | None]] = {}
        self._counted_revoked: frozenset[int] = frozenset()
        #: the last leader seen (0: none yet), and how often it changed
        self._leader = 0
        self._leader_changes = 0
        self._counts = SeatCounts()

    # -- where things are ------------------------------------------------------------
    @property
    def _data_dir(self) -> Path:
        return self.state_dir / "etcd"

    def _path(self, name: str) -> Path:
        return self.dir / name

    @property
    def tls(self) -> ServerTLS | None:
        if self.scheme != "https":
            return None
        return ServerTLS(
            cert=self._path(ca_files.NODE_CERT),
            key=self._path(ca_files.NODE_KEY),
            ca=self._path(ca_files.CA_CERT),
            client_cert_auth=True,
        )

    @property
    def role(self) -> str:
        """voter, learner or standby, as the member list last said."""
        for m in self.members:
            if self.opts.peer_url in m.peer_urls:
                return "learner" if m.is_learner else "voter"
        return "standby"

    def _timing(self) -> tuple[int, int]:
        from evergraph.world.etcd_server import FAST_TIMING

        return FAST_TIMING if os.environ.get(TIMING_ENV) == "fast" else DEFAULT_TIMING

    def _server(self, initial_cluster: str | None, cluster_state: str) -> EtcdServer:
        return EtcdServer.embedded(
            self._data_dir,
            name=self.host,
            client_url=self.opts.client_url,
            peer_url=self.opts.peer_url,
            initial_cluster=initial_cluster,
            cluster_state=cluster_state,
            tls=self.tls,
            crl=self._path(ca_files.CRL) if self.tls is not None else None,
            timing=self._timing(),
        )

    # -- opening -------------------------------------------------------------------------
    async def open(self) -> EtcdKV:
        """Resume, join or form; the KV of the cluster. InputError for bad input (a
        refused join), WorldError when etcd cannot start."""
        self.opts.check()
        make_dirs(self.dir)
        self.state = ClusterState.load(self._path(STATE_FILE))
        if self.state is None:
            self._refuse_foreign_data()
            if self.opts.token is not None:
                await self._join()
            else:
                live = [u for u in self.opts.seeds if await asyncio.to_thread(_reachable, u)]
                if live:
                    raise InputError(
                        f"joining the cluster at {live[0]} needs a join token: give "
                        "--join-token-file F or set EVERGRAPH_JOIN_TOKEN (`evergraph cluster "
                        "token` on a member prints one)",
                        "--join-token-file",
                    )
                self._form()
        try:
            self.ca = ClusterCA.load(self.dir)
        except CAError as e:
            raise InputError(str(e), str(self.dir)) from None
        assert self.ca is not None
        assert self.state is not None
        if self.state.scheme != self.scheme:
            raise InputError(
                f"this node's cluster uses {self.state.scheme}:// URLs", "--etcd-client-url"
            )
        await self._start_existing()
        if self._formed_now:
            self.state.save(self._path(STATE_FILE))
        endpoints = self._endpoints(self.state.endpoints)
        kw: dict[str, Path] = {}
        if self.tls is not None:
            kw = {"ca": self.tls.ca, "cert": self.tls.cert, "key": self.tls.key}
        self.kv = EtcdKV(endpoints, **kw)  # type: ignore[arg-type]
        try:
            await self._first_read(self.kv)
        except BaseException:
            await self.kv.close()
            self.stop()
            raise
        return self.kv

    async def _first_read(self, kv: EtcdKV, timeout: float = 60.0) -> None:
        """Read the World once, waiting for a member that serves: etcd listens before
        it has a leader (and closes TLS connections until then), and the other
        members of a resumed cluster may still be starting."""
        deadline = self.clock.monotonic() + timeout
        said = self.clock.monotonic()
        while True:
            try:
                await kv.range("members/")
                return
            except WorldError as e:
                now = self.clock.monotonic()
                if now > deadline:
                    raise
                if now - said > 5:
                    log.info("cluster: waiting for the cluster to serve (%s)", e)
                    said = now
            await self.clock.sleep(0.2)

    def _endpoints(self, known: Sequence[str]) -> list[str]:
        own = [self.opts.client_url] if self.server is not None else []
        out: list[str] = []
        for u in [*own, *known, *self.opts.seeds]:
            if u not in out:
                out.append(u)
        return out

    def _refuse_foreign_data(self) -> None:
        """An etcd data dir this seat did not make (an `--etcd embedded` of an earlier
        version, a copy): never wiped to form or join, it may be someone's World.
        (A seat's own interrupted attempt saved the CA before etcd ever started.)"""
        if (self.dir / ca_files.CA_CERT).exists():
            return
        if EtcdServer.embedded(self._data_dir).has_member_data():
            raise InputError(
                "holds an etcd member this agent did not make (an earlier --etcd "
                "embedded?): back it up and move it away to form or join a cluster; "
                "its data is not adopted",
                str(self._data_dir),
            )

    def _form(self) -> None:
        ca = ClusterCA.new(self.host)
        ca.save(self.dir)
        self._certify_self(ca)
        if self._data_dir.exists():
            EtcdServer.embedded(self._data_dir).wipe()  # another cluster's leftovers
        self.state = ClusterState(ca.fingerprint, [self.opts.client_url], self.scheme, formed=True)
        self._formed_now = True  # cluster.json is written once etcd runs
        log.info(
            "cluster: formed a new cluster (CA %s…), %s its first voter",
            ca.fingerprint[:16],
            self.host,
        )

    def _certify_self(self, ca: ClusterCA) -> None:
        pub = new_node_key(self._path(ca_files.NODE_KEY))
        hosts = url_hosts([self.opts.client_url, self.opts.peer_url])
        atomic_write(
            self._path(ca_files.NODE_CERT), ca.issue_node(self.host, pub, hosts), mode=0o644
        )
        cert = ca.issue_host(self.host, self.keys.public, self.keys.verify)
        atomic_write(self._path(ca_files.HOST_CERT), cert, mode=0o644)
        atomic_write(self._path(ca_files.CRL), ca.crl([]), mode=0o644)

    async def _join(self) -> None:
        token = self.opts.token
        assert token is not None
        if not self.opts.seeds:
            raise InputError("a join token needs --seeds URL naming a member", "--seeds")
        pub = new_node_key(self._path(ca_files.NODE_KEY))
        deadline = self.clock.monotonic() + self.opts.join_timeout
        said = 0.0
        attempt = 0
        while True:
            seed = self.opts.seeds[attempt % len(self.opts.seeds)]
            attempt += 1
            try:
                grant = await request_join(
                    seed,
                    token,
                    name=self.host,
                    peer_url=self.opts.peer_url,
                    client_url=self.opts.client_url,
                    node_key=pub.decode(),
                    public=self.keys.public,
                    verify=self.keys.verify,
                )
                break
            except JoinRefused as e:
                raise InputError(f"join refused by {seed}: {e}", "--join-token-file") from None
            except JoinUnreachable as e:
                now = self.clock.monotonic()
                if now > deadline:
                    raise WorldError(
                        f"no seed answered within {self.opts.join_timeout:g} s: {e}"
                    ) from None
                if now - said > 5:
                    log.info("cluster: waiting for a seed to answer (%s)", e)
                    said = now
                await self.clock.sleep(min(1.0, 0.1 * attempt))
        ca = ClusterCA.from_pem(grant.ca.encode(), grant.ca_key.encode())
        ca.save(self.dir)
        atomic_write(self._path(ca_files.NODE_CERT), grant.node_cert.encode(), mode=0o644)
        atomic_write(self._path(ca_files.HOST_CERT), grant.host_cert.encode(), mode=0o644)
        atomic_write(self._path(ca_files.CRL), grant.crl.encode(), mode=0o644)
        if self._data_dir.exists():
            EtcdServer.embedded(self._data_dir).wipe()
        self.state = ClusterState(ca.fingerprint, list(grant.endpoints), self.scheme)
        self.state.save(self._path(STATE_FILE))
        log.info(
            "cluster: joined the cluster of CA %s… through %s: a standby until the curator adds it",
            ca.fingerprint[:16],
            seed,
        )

    async def _start_existing(self) -> None:
        """Start etcd on the data dir if it holds a member; a removed member's data
        is discarded (this node is a standby then)."""
        probe = EtcdServer.embedded(self._data_dir)
        formed_now = self._formed_now
        if not probe.has_member_data() and not formed_now:
            return
        # a cluster formed now starts as a new one-member cluster; otherwise etcd
        # ignores the initial cluster for a data dir that holds a member
        server = self._server(None, "new" if formed_now else "existing")
        try:
            await self._start(server)
        except MemberRemoved:
            log.info(
                "cluster: %s was removed from the cluster while away: its data is "
                "discarded, it waits as a standby",
                self.host,
            )
            server.stop()
            server.wipe()
            return
        self.server = server

    async def _start(self, server: EtcdServer, timeout: float = 60.0) -> None:
        # a port held by this node's etcd of before (killed with its agent by
        # pdeathsig, and still exiting: an agent restarted at once after a kill -9)
        # is free a moment later: tried again for PORT_WAIT_S, then said
        deadline = self.clock.monotonic() + PORT_WAIT_S
        while True:
            try:
                server.spawn()  # from the loop's thread: etcd dies with it (pdeathsig)
                await asyncio.to_thread(server.wait_started, timeout)
                return
            except PortInUse:
                server.stop()
                if self.clock.monotonic() >= deadline:
                    raise
            except BaseException:
                server.stop()
                raise
            await self.clock.sleep(0.2)

    # -- running ---------------------------------------------------------------------------
    async def run(self, lease: Callable[[], int]) -> None:
        assert self.kv is not None
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._candidate(lease))
            tg.create_task(self._invites())
            tg.create_task(self._follow())
            tg.create_task(self._serve_joins())
            tg.create_task(self._follow_crl())

    def on_revoked(self, fn: Callable[[], None]) -> None:
        """`fn()` after the revoked serials changed (`self.revoked`)."""
        self._revoked_listeners.append(fn)

    async def _follow_crl(self) -> None:
        """`cluster/crl` to crl.pem (etcd checks it at each handshake) and `revoked`."""
        kv, ca = self.kv, self.ca
        assert kv is not None
        assert ca is not None
        async for snap in watch_one(kv, CRL_KEY):
            if isinstance(snap, Tombstone):
                continue  # a deleted list revokes nothing less: keep what we know
            serials = read_crl(ca, snap)
            if serials is None:
                log.error(
                    "cluster: %s is not a revocation list signed by the cluster CA: ignored",
                    CRL_KEY,
                )
                continue
            if serials < self.revoked:
                log.error(
                    "cluster: %s lists fewer revoked certificates than seen before: ignored",
                    CRL_KEY,
                )
                continue
            atomic_write(self._path(ca_files.CRL), snap.value, mode=0o644)
            if serials != self.revoked:
                self.revoked = serials
                for fn in self._revoked_listeners:
                    fn()

    def _candidate_value(self) -> bytes:
        """This host's signed, certified record (as a candidate, and when leaving)."""
        cert = self._path(ca_files.HOST_CERT).read_bytes()
        return encode_candidate(
            self.keys, self.host, self.opts.peer_url, self.opts.client_url, cert
        )

    async def _candidate(self, lease: Callable[[], int]) -> None:
        """Keep `cluster/candidates/<me>` under the member lease."""
        kv = self.kv
        assert kv is not None
        value = self._candidate_value()
        key = CANDIDATES + self.host
        put_under = -1
        while not self._stopping:
            cur = lease()
            try:
                found = await kv.get(key)
                if cur != put_under or found is None or found.value != value or found.lease != cur:
                    await kv.put(key, value, lease=cur)
                    put_under = cur
            except WorldError as e:
                log.debug("cluster: candidate record: %s", e)
            await self.clock.sleep(FOLLOW_EVERY)

    async def _invites(self) -> None:
        kv, ca = self.kv, self.ca
        assert kv is not None
        assert ca is not None
        async for snap in watch_one(kv, INVITES + self.host):
            if isinstance(snap, Tombstone) or self._stopping:
                continue
            inv = decode_invite(ca, snap)
            if inv is None:
                log.error("cluster: %s is not signed by the cluster CA: ignored", snap.key)
                continue
            if inv.peer_url != self.opts.peer_url:
                continue
            async with self._lock:
                if self.server is not None and self.server.running:
                    continue
                log.info("cluster: invited as learner %x: starting etcd", inv.member_id)
                server = self._server(inv.initial_cluster, "existing")
                server.stop()
                server.wipe()
                try:
                    await self._start(server)
                except WorldError as e:
                    log.error("cluster: could not start etcd as a learner: %s", e)
                    continue
                self.server = server
                kv.set_endpoints(self._endpoints(kv.endpoints))

    async def _follow(self) -> None:
        """Follow etcd's member list: the KV's endpoints, our own removal, a dead etcd."""
        kv = self.kv
        assert kv is not None
        assert self.state is not None
        while True:
            try:
                self.members = await member_list(kv)
            except WorldError as e:
                log.debug("cluster: member list: %s", e)
            else:
                urls = [u for m in self.members for u in m.client_urls]
                if urls:
                    kv.set_endpoints(self._endpoints(urls))
                    if sorted(urls) != sorted(self.state.endpoints):
                        self.state.endpoints = urls
                        with contextlib.suppress(OSError):
                            self.state.save(self._path(STATE_FILE))
                await self._check_own_member()
                await self._count()
            await self.clock.sleep(FOLLOW_EVERY)

    def counts(self) -> SeatCounts:
        """Voters, learners, standbys and leader changes, as last seen (`_follow`)."""
        return self._counts

    async def _count(self) -> None:
        """Recount from the member list just read, the candidates and the leader."""
        kv, ca = self.kv, self.ca
        assert kv is not None
        assert ca is not None
        try:
            items, _ = await kv.range(CANDIDATES)
        except WorldError as e:
            log.debug("cluster: candidates: %s", e)
            return
        cache: dict[str, tuple[int, Candidate | None]] = {}
        revoked = frozenset(self.revoked)
        if revoked != self._counted_revoked:  # a host removed: check every record again
            self._candidates, self._counted_revoked = {}, revoked
        for item in items:
            hit = self._candidates.get(item.key)
            if hit is None or hit[0] != item.mod_revision:
                hit = (item.mod_revision, decode_candidate(ca, item, revoked))
            cache[item.key] = hit
        self._candidates = cache
        peers = {u for m in self.members for u in m.peer_urls}
        standbys = sum(1 for _, c in cache.values() if c is not None and c.peer_url not in peers)
        leader = await self._leader_id()
        if leader and leader != self._leader:
            if self._leader:
                self._leader_changes += 1
                log.info("cluster: etcd leader is now member %x (was %x)", leader, self._leader)
            self._leader = leader
        learners = sum(1 for m in self.members if m.is_learner)
        self._counts = SeatCounts(
            voters=len(self.members) - learners,
            learners=learners,
            standbys=standbys,
            leader_changes=self._leader_changes,
        )

    async def _leader_id(self) -> int:
        """The leader's member id as a member says (our own first); 0 if none says."""
        kv = self.kv
        assert kv is not None
        urls = [u for m in self.members for u in m.client_urls[:1]]
        if self.server is not None and self.opts.client_url in urls:
            urls.remove(self.opts.client_url)
            urls.insert(0, self.opts.client_url)
        for url in urls:
            try:
                st = await member_status(kv, url)
            except WorldError as e:
                log.debug("cluster: status of %s: %s", url, e)
                continue
            if st is not None and st.leader:
                return st.leader
        return 0

    async def _check_own_member(self) -> None:
        async with self._lock:
            server = self.server
            if server is None or self._stopping:
                return
            listed = any(self.opts.peer_url in m.peer_urls for m in self.members)
            if server.running and (listed or not self.members):
                return
            if server.running:
                # removed (shrink, or replaced while it was cut off): a standby now
                log.info(
                    "cluster: %s is no longer a member: stopping etcd, a standby now", self.host
                )
            elif server.removed():
                log.info("cluster: %s was removed from the cluster: a standby now", self.host)
            else:
                log.warning("cluster: etcd exited: starting it again%s", _tail(server))
                try:
                    await self._start(server)
                    return
                except MemberRemoved:
                    pass
                except WorldError as e:
                    log.error("cluster: etcd did not start again: %s", e)
                    return
            server.stop()
            server.wipe()
            self.server = None

    async def _serve_joins(self) -> None:
        assert self.kv is not None
        assert self.ca is not None
        host = urlsplit(self.opts.client_url).hostname or "127.0.0.1"
        kv = self.kv

        def endpoints() -> list[str]:
            return list(kv.endpoints)

        def crl() -> bytes:
            return self._path(ca_files.CRL).read_bytes()

        server = JoinServer(
            kv,
            self.ca,
            cert=self._path(ca_files.NODE_CERT),
            key=self._path(ca_files.NODE_KEY),
            host=host,
            port=join_port(self.opts.client_url),
            scheme=self.scheme,
            endpoints=endpoints,
            crl=crl,
        )
        await server.run()

    # -- stopping ----------------------------------------------------------------------------
    async def handover(self, lease: int, timeout: float = 60.0) -> None:
        """A clean stop of a voter: when a standby can take its seat, ask the curator
        to replace it and wait (up to `timeout`) until it has; then stop etcd."""
        kv = self.kv
        if kv is None or self.server is None or not self.server.running:
            return
        try:
            members = await member_list(kv)
            cands, _ = await kv.range(CANDIDATES)
        except WorldError as e:
            log.warning("cluster: no handover (%s)", e)
            return
        voters = [m for m in members if not m.is_learner]
        peer_urls = {u for m in members for u in m.peer_urls}
        ca = self.ca
        assert ca is not None
        others = [c for c in (decode_candidate(ca, item) for item in cands) if c is not None]
        standby = any(c.peer_url not in peer_urls for c in others if c.name != self.host)
        if len(voters) <= 1 or not standby:
            return
        log.info("cluster: %s is stopping: handing its seat to a standby", self.host)
        try:
            await kv.put(LEAVING + self.host, self._candidate_value(), lease=lease)
        except WorldError as e:
            log.warning("cluster: no handover (%s)", e)
            return
        deadline = self.clock.monotonic() + timeout
        while self.clock.monotonic() < deadline:
            with contextlib.suppress(WorldError):
                members = await member_list(kv)
                if not any(self.opts.peer_url in m.peer_urls for m in members):
                    log.info("cluster: %s handed over its seat", self.host)
                    self._stopping = True
                    with contextlib.suppress(WorldError):
                        await kv.delete(LEAVING + self.host)
                    if self.server is not None:
                        self.server.stop()
                        self.server.wipe()
                        self.server = None
                    return
            await self.clock.sleep(0.25)
        log.warning("cluster: %s: no handover within %g s: stopping anyway", self.host, timeout)
        with contextlib.suppress(WorldError):
            await kv.delete(LEAVING + self.host)

    def stop(self) -> None:
        self._stopping = True
        if self.server is not None:
            self.server.stop()


def _tail(server: EtcdServer) -> str:
    tail = server.log_tail()
    return f" ({tail[-1]})" if tail else ""


async def open_cluster(state_dir: Path, seeds: Sequence[str] = ()) -> tuple[EtcdKV, ClusterCA]:
    """The World of the cluster a member's state dir belongs to, with its node
    certificate (the `evergraph cluster` commands); InputError if the state dir
    holds no cluster."""
    d = cluster_dir(state_dir)
    state = ClusterState.load(d / STATE_FILE)
    try:
        ca = ClusterCA.load(d)
    except CAError as e:
        raise InputError(str(e), str(d)) from None
    if state is None or ca is None:
        raise InputError(
            "no self-forming cluster here (no agent ran with --etcd embedded on this state dir)",
            str(state_dir),
        )
    endpoints = [*state.endpoints, *(u for u in seeds if u not in state.endpoints)]
    kw: dict[str, Path] = {}
    if state.scheme == "https":
        kw = {
            "ca": d / ca_files.CA_CERT,
            "cert": d / ca_files.NODE_CERT,
            "key": d / ca_files.NODE_KEY,
        }
    return EtcdKV(endpoints, **kw), ca  # type: ignore[arg-type]
