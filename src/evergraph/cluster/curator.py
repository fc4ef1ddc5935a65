"""The curator: one elected agent keeps the etcd cluster at its ideal size (SPEC 4.8).

Every agent started with `--etcd embedded` holds the cluster CA and stands for
election as curator (`election/etcd-curator`); the one elected makes every
membership change, one at a time, each decided afresh from what the cluster
says now (etcd's member list and each member's status) and what the World says
(candidates, the ideal size, voters leaving):

1. a learner in flight comes first: promoted once its raft index has caught up
   with the leader's, removed if its agent is gone or it has not caught up
   within the member timeout. Never a second learner (etcd refuses one too);
2. a dead voter (its agent's member lease expired, so its candidate record is
   gone, and its member unreachable for the member timeout) is removed, if the
   healthy voters left still make a quorum;
3. fewer voters than the ideal size, or a voter leaving and a standby to take
   its place: the first standby (by name) is added as a learner and invited
   (`cluster/invites/<name>`); its agent starts etcd and joins;
4. a voter leaving (a clean stop) is removed once it has been replaced, or at
   once if no standby can replace it, if the quorum holds;
5. more voters than the ideal size: one voter (not the leader; an unhealthy one
   first) is removed, and stays a standby.

Each change is one log line naming what and why, also kept at
`cluster/last-change` for `evergraph cluster watch`. A step is a pure decision
(`decide`) over a snapshot, then one action, so the logic is tested without
etcd.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from evergraph._util.clock import SYSTEM, Clock
from evergraph.cluster.ca import ClusterCA
from evergraph.cluster.election import Election
from evergraph.cluster.revoke import CRL_KEY, read_crl
from evergraph.cluster.roster import (
    CANDIDATES,
    INVITES,
    LAST_CHANGE,
    LEAVING,
    SIZE_KEY,
    Candidate,
    Invite,
    SizeSeen,
    decode_candidate,
    encode_change,
    encode_invite,
    leaving_names,
)
from evergraph.world.etcd_cluster import (
    EtcdMember,
    MemberBusy,
    MemberStatus,
    initial_cluster,
    member_add,
    member_list,
    member_promote,
    member_remove,
    member_status,
)
from evergraph.world.kv import Delete, Put, WorldError

log = logging.getLogger("evergraph.cluster")

CURATOR = "etcd-curator"
#: a learner is caught up when its raft index is this close to the leader's
CAUGHT_UP = 50
#: seconds between two looks when nothing wakes the curator
TICK = 0.5


def quorum(voters: int) -> int:
    return voters // 2 + 1


@dataclass(frozen=True)
class Snapshot:
    """What the curator decides from."""

    members: Sequence[EtcdMember]
    status: dict[int, MemberStatus | None]
    candidates: dict[str, Candidate]
    leaving: frozenset[str]
    size: int
    #: member id -> seconds it has been unreachable (0: reachable now)
    down_for: dict[int, float]
    #: member id -> seconds since the learner was added
    learner_age: dict[int, float]
    timeout: float
    me: str = ""
    #: names with an invite in the World
    invites: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Action:
    what: str  # "add" | "invite" | "promote" | "remove" | "wait" | "none"
    member: EtcdMember | None = None
    candidate: Candidate | None = None
    why: str = ""


def _healthy(s: Snapshot, m: EtcdMember) -> bool:
    return s.status.get(m.id) is not None


def _removable(s: Snapshot, voters: Sequence[EtcdMember], m: EtcdMember) -> bool:
    """Removing voter `m` keeps a quorum of healthy voters."""
    healthy = sum(1 for v in voters if v.id != m.id and _healthy(s, v))
    return healthy >= quorum(len(voters) - 1)


def decide(s: Snapshot) -> Action:
    voters = [m for m in s.members if not m.is_learner]
    learners = [m for m in s.members if m.is_learner]
    leader_id = next((st.leader for st in s.status.values() if st is not None), 0)
    leader_index = max((st.raft_index for st in s.status.values() if st is not None), default=0)
    by_peer = {u: m for m in s.members for u in m.peer_urls}

    # 1. a learner in flight
    if learners:
        lm = learners[0]
        st = s.status.get(lm.id)
        gone = lm.name not in s.candidates and not any(
            c.peer_url in lm.peer_urls for c in s.candidates.values()
        )
        if gone or s.learner_age.get(lm.id, 0.0) > max(s.timeout, 30.0) * 2:
            why = "its agent is gone" if gone else "it did not catch up in time"
            return Action("remove", lm, why=f"learner {lm.name or lm.peer_urls[0]}: {why}")
        if st is not None and st.raft_index + CAUGHT_UP >= leader_index:
            return Action("promote", lm, why="caught up with the leader")
        if not lm.name:  # not started: its invite may never have been written
            c = next((c for c in s.candidates.values() if c.peer_url in lm.peer_urls), None)
            if c is not None and c.name not in s.invites:
                return Action("invite", lm, candidate=c, why="a learner without an invite")
        return Action("wait", lm, why="learner catching up")

    # 2. dead voters
    for v in voters:
        agent_gone = v.name not in s.candidates
        if agent_gone and s.down_for.get(v.id, 0.0) >= s.timeout and _removable(s, voters, v):
            return Action(
                "remove",
                v,
                why=f"its agent is gone and it has been unreachable for {s.timeout:g} s",
            )

    standbys = sorted(
        (c for c in s.candidates.values() if c.peer_url not in by_peer and c.name not in s.leaving),
        key=lambda c: c.name,
    )
    leaving = [v for v in voters if v.name in s.leaving]
    staying = len(voters) - len(leaving)

    # 3. grow (or replace a voter that leaves)
    if standbys and (len(voters) < s.size or (leaving and staying < s.size)):
        c = standbys[0]
        why = (
            f"{len(voters)} voters, ideal {s.size}"
            if len(voters) < s.size
            else f"replacing {leaving[0].name}, which is stopping"
        )
        return Action("add", candidate=c, why=why)

    # 4. voters leaving
    for v in leaving:
        if len(voters) > 1 and _removable(s, voters, v):
            return Action("remove", v, why="it is stopping (handover)")

    # 5. shrink
    if len(voters) > s.size:
        order = sorted(
            (v for v in voters if v.id != leader_id),
            key=lambda v: (_healthy(s, v), v.name == s.me, v.name),
        )
        for v in order:
            if _removable(s, voters, v):
                return Action(
                    "remove", v, why=f"{len(voters)} voters, ideal {s.size} (it stays a standby)"
                )
    return Action("none")


@dataclass
class CuratorStats:
    """What the curator did (metrics)."""

    replacements: int = 0
    changes: int = 0
    last: list[str] = field(default_factory=list)


class Curator:
    """Runs `decide` and its actions while elected; until cancelled."""

    def __init__(
        self,
        kv: object,
        ca: ClusterCA,
        election: Election,
        member_timeout: float,
        clock: Clock = SYSTEM,
        size_seen: SizeSeen | None = None,
    ) -> None:
        self.kv = kv
        #: the newest signed ideal size seen (a replayed older one is ignored)
        self.size_seen = size_seen or SizeSeen(None)
        self.ca = ca
        self.election = election
        self.timeout = member_timeout
        self.clock = clock
        self.stats = CuratorStats()
        self._down_since: dict[int, float] = {}
        self._added_at: dict[int, float] = {}
        self._on_change: list[Callable[[str], None]] = []

    def on_change(self, fn: Callable[[str], None]) -> None:
        self._on_change.append(fn)

    async def run(self) -> None:
        await self.election.lead(self._curate, "the etcd cluster")

    async def _curate(self) -> None:
        while True:
            try:
                await self.step()
            except MemberBusy as e:
                # etcd is not ready for a change yet (a member just started): look again
                log.debug("cluster: curator: %s", e)
            except WorldError as e:
                log.warning("cluster: curator: %s", e)
            await self.clock.sleep(TICK)

    async def snapshot(self) -> Snapshot:
        kv = self.kv
        members = await member_list(kv)  # type: ignore[arg-type]
        urls = {m.id: m.client_urls[0] for m in members if m.client_urls}

        async def status(mid: int) -> tuple[int, MemberStatus | None]:
            url = urls.get(mid)
            if url is None:
                return mid, None
            return mid, await member_status(kv, url, timeout=1.0)  # type: ignore[arg-type]

        pairs = await asyncio.gather(*(status(m.id) for m in members))
        statuses = dict(pairs)
        now = self.clock.monotonic()
        for m in members:
            if statuses.get(m.id) is None:
                self._down_since.setdefault(m.id, now)
            else:
                self._down_since.pop(m.id, None)
            if m.is_learner:
                self._added_at.setdefault(m.id, now)
        ids = {m.id for m in members}
        for d in (self._down_since, self._added_at):
            for mid in list(d):
                if mid not in ids:
                    del d[mid]
        cands_kv, _ = await kv.range(CANDIDATES)  # type: ignore[attr-defined]
        # a removed host's agent may still write its record: its certificate is revoked
        revoked = read_crl(self.ca, await kv.get(CRL_KEY)) or set()  # type: ignore[attr-defined]
        candidates: dict[str, Candidate] = {}
        for item in cands_kv:
            c = decode_candidate(self.ca, item, revoked)
            if c is None:
                log.debug("cluster: %s is not a certified candidate: ignored", item.key)
                continue
            candidates[c.name] = c
        leaving_kv, _ = await kv.range(LEAVING)  # type: ignore[attr-defined]
        leaving = leaving_names(self.ca, leaving_kv, revoked)
        size = self.size_seen.size(self.ca, await kv.get(SIZE_KEY))  # type: ignore[attr-defined]
        invites_kv, _ = await kv.range(INVITES)  # type: ignore[attr-defined]
        invites = frozenset(item.key[len(INVITES) :] for item in invites_kv)
        return Snapshot(
            members=members,
            status=statuses,
            candidates=candidates,
            leaving=leaving,
            size=size,
            down_for={mid: now - t for mid, t in self._down_since.items()},
            learner_age={mid: now - t for mid, t in self._added_at.items()},
            timeout=self.timeout,
            me=self.election.me,
            invites=invites,
        )

    async def step(self) -> Action:
        s = await self.snapshot()
        act = decide(s)
        if act.what in ("none", "wait"):
            return act
        kv = self.kv
        if act.what == "add":
            assert act.candidate is not None
            c = act.candidate
            new, after = await member_add(kv, [c.peer_url], learner=True)  # type: ignore[arg-type]
            await self._invite(c, new.id, after)
            await self._tell(f"added {c.name} as a learner ({act.why})")
        elif act.what == "invite":
            assert act.candidate is not None
            assert act.member is not None
            await self._invite(act.candidate, act.member.id, s.members)
            await self._tell(f"invited learner {act.candidate.name} again ({act.why})")
        elif act.what == "promote":
            assert act.member is not None
            await member_promote(kv, act.member.id)  # type: ignore[arg-type]
            with contextlib.suppress(WorldError):
                await self.election.fenced([Delete(INVITES + act.member.name)])
            await self._tell(f"promoted {act.member.name} to voter ({act.why})")
        elif act.what == "remove":
            assert act.member is not None
            await member_remove(kv, act.member.id)  # type: ignore[arg-type]
            if "agent is gone" in act.why and not act.member.is_learner:
                self.stats.replacements += 1
            with contextlib.suppress(WorldError):
                await self.election.fenced([Delete(INVITES + act.member.name)])
            await self._tell(f"removed {act.member.name or act.member.peer_urls[0]} ({act.why})")
        return act

    async def _invite(self, c: Candidate, member_id: int, members: Sequence[EtcdMember]) -> None:
        inv = Invite(
            name=c.name,
            member_id=member_id,
            peer_url=c.peer_url,
            initial_cluster=initial_cluster(members, c.name, c.peer_url),
        )
        if not await self.election.fenced([Put(INVITES + c.name, encode_invite(self.ca, inv))]):
            log.warning("cluster: no longer curator: learner %s not invited", c.name)

    async def _tell(self, line: str) -> None:
        """One log line for a change made, and the same line at `cluster/last-change`
        (best effort: the change is made, telling it may fail)."""
        self.stats.changes += 1
        self.stats.last = [*self.stats.last[-9:], line]
        log.info("cluster: %s", line)
        for fn in self._on_change:
            fn(line)
        record = encode_change(line, self.election.me, self.clock.time())
        try:
            await self.election.fenced([Put(LAST_CHANGE, record)])
        except WorldError as e:
            log.debug("cluster: curator: could not record the change: %s", e)
