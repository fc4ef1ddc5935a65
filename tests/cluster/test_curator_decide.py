"""The curator's decisions, over snapshots: one change at a time, never below quorum."""

from __future__ import annotations

from evergraph.cluster.curator import Action, Snapshot, decide
from evergraph.cluster.roster import Candidate
from evergraph.world.etcd_cluster import EtcdMember, MemberStatus


def member(i: int, name: str | None = None, learner: bool = False) -> EtcdMember:
    n = f"h{i}" if name is None else name
    return EtcdMember(
        id=100 + i,
        name=n,
        peer_urls=(f"https://10.0.0.{i}:2380",),
        client_urls=(f"https://10.0.0.{i}:2379",) if n else (),
        is_learner=learner,
    )


def status(i: int, index: int = 1000, leader: int = 100, learner: bool = False) -> MemberStatus:
    return MemberStatus(
        id=100 + i, leader=leader, raft_index=index, raft_term=2, is_learner=learner, db_size=1
    )


def cand(i: int) -> Candidate:
    return Candidate(
        name=f"h{i}",
        peer_url=f"https://10.0.0.{i}:2380",
        client_url=f"https://10.0.0.{i}:2379",
        public="p",
        verify="v",
        cert="c",
    )


def snap(
    members: list[EtcdMember],
    up: dict[int, MemberStatus | None],
    cands: list[int],
    size: int = 3,
    leaving: tuple[str, ...] = (),
    down_for: dict[int, float] | None = None,
    learner_age: dict[int, float] | None = None,
) -> Snapshot:
    return Snapshot(
        members=members,
        status={m.id: up.get(m.id) for m in members},
        candidates={f"h{i}": cand(i) for i in cands},
        leaving=frozenset(leaving),
        size=size,
        down_for=down_for or {},
        learner_age=learner_age or {},
        timeout=15.0,
        me="h0",
    )


def test_a_lone_voter_adds_the_first_standby_as_a_learner() -> None:
    s = snap([member(0)], {100: status(0)}, [0, 1, 2])
    act = decide(s)
    assert act.what == "add"
    assert act.candidate is not None
    assert act.candidate.name == "h1"
    assert "1 voters, ideal 3" in act.why


def test_never_a_second_learner_and_promote_once_caught_up() -> None:
    members = [member(0), member(1, learner=True)]
    behind = snap(members, {100: status(0, 1000), 101: status(1, 10, learner=True)}, [0, 1, 2])
    assert decide(behind) == Action("wait", members[1], why="learner catching up")
    caught = snap(members, {100: status(0, 1000), 101: status(1, 990, learner=True)}, [0, 1, 2])
    assert decide(caught).what == "promote"


def test_a_learner_whose_agent_is_gone_is_removed() -> None:
    members = [member(0), member(1, learner=True)]
    act = decide(snap(members, {100: status(0)}, [0, 2]))
    assert act.what == "remove"
    assert act.member == members[1]


def test_a_dead_voter_is_removed_only_after_the_timeout_and_with_quorum() -> None:
    members = [member(0), member(1), member(2)]
    up = {100: status(0), 101: status(1), 102: None}
    early = snap(members, up, [0, 1, 3], down_for={102: 5.0})
    assert decide(early).what != "remove"
    late = snap(members, up, [0, 1, 3], down_for={102: 16.0})
    act = decide(late)
    assert act.what == "remove"
    assert act.member == members[2]
    # agent alive (candidate record there): its member is not removed
    alive = snap(members, up, [0, 1, 2, 3], down_for={102: 60.0})
    assert decide(alive).what == "none"
    # two of three dead: no quorum left, nothing is removed
    two_dead = snap(
        members, {100: status(0), 101: None, 102: None}, [0], down_for={101: 60, 102: 60}
    )
    assert decide(two_dead).what == "none"


def test_grow_to_the_ideal_size_then_stop() -> None:
    members = [member(0), member(1), member(2)]
    up = {m.id: status(m.id - 100) for m in members}
    assert decide(snap(members, up, [0, 1, 2, 3, 4])).what == "none"
    act = decide(snap(members, up, [0, 1, 2, 3, 4], size=5))
    assert act.what == "add"
    assert act.candidate is not None
    assert act.candidate.name == "h3"


def test_shrink_removes_one_voter_never_the_leader() -> None:
    members = [member(i) for i in range(5)]
    up = {m.id: status(m.id - 100, leader=100) for m in members}
    act = decide(snap(members, up, [0, 1, 2, 3, 4], size=3))
    assert act.what == "remove"
    assert act.member is not None
    assert act.member.id != 100
    assert "stays a standby" in act.why


def test_a_leaving_voter_is_replaced_before_it_is_removed() -> None:
    members = [member(0), member(1), member(2)]
    up = {m.id: status(m.id - 100) for m in members}
    first = decide(snap(members, up, [0, 1, 2, 3], leaving=("h2",)))
    assert first.what == "add"
    assert "replacing h2" in first.why
    members4 = [*members, member(3)]
    up4 = {**up, 103: status(3)}
    then = decide(snap(members4, up4, [0, 1, 2, 3], leaving=("h2",)))
    assert then.what == "remove"
    assert then.member == members[2]


def test_a_learner_never_invited_is_invited_again() -> None:
    unstarted = EtcdMember(
        id=101,
        name="",
        peer_urls=("https://10.0.0.1:2380",),
        client_urls=(),
        is_learner=True,
    )
    members = [member(0), unstarted]
    s = snap(members, {100: status(0)}, [0, 1])
    act = decide(s)
    assert act.what == "invite"
    assert act.candidate is not None
    assert act.candidate.name == "h1"
    invited = Snapshot(**{**s.__dict__, "invites": frozenset({"h1"})})
    assert decide(invited).what == "wait"
