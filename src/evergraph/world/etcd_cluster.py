"""An etcd cluster's membership, asked and changed through an `EtcdKV`: list, add
(as a learner or a voter), promote and remove members, and one member's own
status (its raft index, to tell whether a learner has caught up).

The curator (cluster/curator.py) builds its membership changes on these; the
rules it follows (one learner at a time, never below quorum) are etcd's own too,
and etcd's refusals come back as WorldError subclasses the caller can wait on:
`MemberBusy` (try again later), `LearnerNotReady`, `NoSuchMember`.

Calls go through the EtcdKV's failover (`_call`): a member that cannot be
reached is skipped for the next. MemberAdd and MemberRemove are not idempotent:
when the connection breaks while one is in flight, the WorldError says its
outcome is unknown (list the members to find out), as delete and cas do.
MemberPromote is: promoting a member that is a voter already answers the list.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc  # type: ignore[import-untyped]
import grpc.aio  # type: ignore[import-untyped]
from aetcd import rpc

from evergraph._util.clock import SYSTEM, Clock
from evergraph.world._etcd_link import _Endpoint, _hint, _reason, _tls_problem
from evergraph.world.etcd import EtcdKV
from evergraph.world.kv import WorldError


class MemberBusy(WorldError):
    """etcd refused a membership change for now (a learner is already being added,
    or the change would risk quorum while members are not all connected): wait
    and try again."""


class LearnerNotReady(WorldError):
    """The learner has not caught up with the leader's log yet."""


class NoSuchMember(WorldError):
    """No member has that id (removed already, or never added)."""


@dataclass(frozen=True)
class EtcdMember:
    """A member as etcd lists it; `name` is "" until the member has started."""

    id: int
    name: str
    peer_urls: tuple[str, ...]
    client_urls: tuple[str, ...]
    is_learner: bool


@dataclass(frozen=True)
class MemberStatus:
    """What one member says of itself (Maintenance.Status)."""

    id: int
    leader: int  # 0: it knows no leader
    raft_index: int
    raft_term: int
    is_learner: bool
    db_size: int


def _member(m: Any) -> EtcdMember:
    return EtcdMember(
        id=int(m.ID),
        name=str(m.name),
        peer_urls=tuple(str(u) for u in m.peerURLs),
        client_urls=tuple(str(u) for u in m.clientURLs),
        is_learner=bool(m.isLearner),
    )


def _members(resp: Any) -> list[EtcdMember]:
    return sorted((_member(m) for m in resp.members), key=lambda m: (m.name == "", m.name, m.id))


#: etcd's refusals of a membership change (in its words) and what they mean here
_BUSY = (
    "too many learner members in cluster",
    "unhealthy cluster",
    "not enough started members",
)
_NOT_READY = "can only promote a learner member which is in sync with leader"
_NOT_FOUND = "member not found"
_NOT_LEARNER = "can only promote a learner member"


def _refusal(e: Any, ep: _Endpoint, what: str, rpc_name: str) -> WorldError | None:
    """etcd's verdict on a membership change as its WorldError, or None for an
    error that is the connection's (left to the failover)."""
    details = " ".join(str(e.details() or "").split())
    text = f"etcd at {ep.url} refused to {what}: {details.removeprefix('etcdserver: ')}"
    if any(w in details for w in _BUSY):
        return MemberBusy(f"{text} (try again later)")
    if _NOT_READY in details:
        return LearnerNotReady(f"{text} (it has not caught up yet)")
    if _NOT_FOUND in details:
        if rpc_name == "MemberAdd":
            # etcd derives a new member's id from its peer URLs and the time in
            # seconds: re-added within the second of its removal, it gets the
            # removed id, which etcd refuses as not found
            return MemberBusy(
                f"{text} (a member with these peer URLs was removed within the last"
                " second: try again)"
            )
        return NoSuchMember(text)
    return None


async def _cluster_call(kv: EtcdKV, what: str, rpc_name: str, req: Any, idempotent: bool) -> Any:
    async def op(ep: _Endpoint, t: float) -> Any:
        try:
            return await getattr(ep.cluster, rpc_name)(req, timeout=t, metadata=ep.metadata())
        except grpc.aio.AioRpcError as e:
            refused = _refusal(e, ep, what, rpc_name)
            if refused is not None:
                raise refused from None
            raise

    # the failover machinery of EtcdKV's own calls (the cluster is part of its link)
    return await kv._call(what, op, idempotent=idempotent)


async def member_list(kv: EtcdKV) -> list[EtcdMember]:
    """Every member (voters and learners), named ones first by name."""
    resp = await _cluster_call(kv, "list the members", "MemberList", rpc.MemberListRequest(), True)
    return _members(resp)


async def member_add(
    kv: EtcdKV, peer_urls: Sequence[str], *, learner: bool
) -> tuple[EtcdMember, list[EtcdMember]]:
    """Add a member with these peer URLs (a learner, or a voter); answers the new
    member (named "" until it starts) and every member after the change. Raises
    MemberBusy while another learner is in the cluster (etcd allows one)."""
    req = rpc.MemberAddRequest(peerURLs=list(peer_urls), isLearner=learner)
    what = f"add {'a learner' if learner else 'a member'} at {', '.join(peer_urls)}"
    resp = await _cluster_call(kv, what, "MemberAdd", req, False)
    return _member(resp.member), _members(resp)


async def member_promote(kv: EtcdKV, member_id: int) -> list[EtcdMember]:
    """Make a learner a voter; answers every member after. Raises LearnerNotReady
    while it lags behind the leader, NoSuchMember for an unknown id. A member that
    is a voter already (a retry whose first answer was lost) is not an error."""
    req = rpc.MemberPromoteRequest(ID=member_id)
    what = f"promote member {member_id:x}"
    try:
        resp = await _cluster_call(kv, what, "MemberPromote", req, True)
    except WorldError as e:
        if _NOT_LEARNER not in str(e) or _NOT_READY in str(e):
            raise
        members = await member_list(kv)
        if any(m.id == member_id and not m.is_learner for m in members):
            return members
        raise
    return _members(resp)


async def member_remove(kv: EtcdKV, member_id: int) -> list[EtcdMember]:
    """Remove a member (its etcd exits once it learns it); answers every member
    after. Raises NoSuchMember for an unknown id, MemberBusy when removing this
    voter now could cost the cluster its quorum."""
    req = rpc.MemberRemoveRequest(ID=member_id)
    resp = await _cluster_call(kv, f"remove member {member_id:x}", "MemberRemove", req, False)
    return _members(resp)


async def member_status(kv: EtcdKV, client_url: str, timeout: float = 1.0) -> MemberStatus | None:
    """Ask the member at `client_url` (and only it, with kv's TLS settings) for its
    own status; None when it cannot be reached or does not answer in `timeout`."""
    if kv._closed:
        raise WorldError("the World connection is closed")
    ep, channel = kv._connection(client_url)
    try:
        with kv._using(ep):  # (a listed endpoint's channel stays open meanwhile)
            resp = await ep.maintenance.Status(
                rpc.StatusRequest(), timeout=timeout, metadata=ep.metadata()
            )
    except grpc.aio.AioRpcError as e:
        details = str(e.details() or "")
        if e.code() == grpc.StatusCode.UNAVAILABLE and _tls_problem(details):
            # a TLS setup that cannot work is not a member that is down
            raise WorldError(
                f"etcd at {ep.url} is not reachable: {_reason(e)}{_hint(details)}"
            ) from None
        if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return None
        raise WorldError(f"etcd at {ep.url} refused its status: {_reason(e)}") from None
    finally:
        if channel is not None:
            await channel.close()
    return MemberStatus(
        id=int(resp.header.member_id),
        leader=int(resp.leader),
        raft_index=int(resp.raftIndex),
        raft_term=int(resp.raftTerm),
        is_learner=bool(resp.isLearner),
        db_size=int(resp.dbSize),
    )


def initial_cluster(members: Sequence[EtcdMember], name: str, peer_url: str) -> str:
    """The `--initial-cluster` of a member joining as `name` at `peer_url` after
    MemberAdd: every named member's `name=url` and the joiner's own (the joiner
    is found by its peer URL; it has no name in the list until it starts). etcd
    checks the count against its member list: another member that never started
    (no name) makes the join fail with "member count is unequal"."""
    parts: list[str] = []
    for m in members:
        if peer_url in m.peer_urls or not m.name or m.name == name:
            continue
        parts += [f"{m.name}={u}" for u in m.peer_urls]
    parts.append(f"{name}={peer_url}")
    return ",".join(parts)


async def follow_members(kv: EtcdKV, every: float = 5.0, clock: Clock = SYSTEM) -> None:
    """Keep `kv`'s endpoints at the cluster's client URLs (and the ones it was given),
    so a client whose seed dies goes on through the other members; until cancelled.
    A member list that cannot be read leaves the endpoints as they are."""
    given = list(kv.endpoints)
    while True:
        try:
            members = await member_list(kv)
        except WorldError:
            pass
        else:
            urls = [u for m in members for u in m.client_urls]
            if urls:
                kv.set_endpoints([*urls, *(u for u in given if u not in urls)])
        await clock.sleep(every)
