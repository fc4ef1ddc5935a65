"""The self-forming etcd World heals, under a writer that counts: kill -9 of a voter
(the leader or not) and a standby takes its seat; resize 3 -> 5 -> 3 without a
gap in the writes; one member killed and restarted ten times comes back each
time; and formation itself, many runs in a row. Real agents and etcd members in
network namespaces (tests/kit/netbed.py); the writer is tests/kit/cluster_client.py."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

import pytest

from tests.kit.netbed import NetBed
from tests.kit.selfform import (
    CLUSTER_TEST,
    CounterWriter,
    Member,
    cluster_timeout,
    formed,
    leader,
    roles,
    settled,
    wait_until,
    with_role,
)

pytestmark = CLUSTER_TEST

#: how many formations in a row the formation test makes
FORMATION_RUNS = int(os.environ.get("EVERGRAPH_FORMATION_RUNS", "20"))


def three_and_two(bed: NetBed) -> tuple[list[Member], dict[str, Member]]:
    members, _ = formed(bed, 5)
    wait_until(settled(members, 3, 2), 90, "3 voters and 2 standbys", members)
    return members, {m.h.name: m for m in members}


@cluster_timeout(300)
@pytest.mark.parametrize("victim_leads", [False, True], ids=["follower", "leader"])
def test_kill9_of_a_voter_a_standby_takes_its_seat_and_no_write_is_lost(
    netbed: Callable[[int], NetBed], victim_leads: bool
) -> None:
    bed = netbed(5)
    members, by = three_and_two(bed)
    standbys = with_role(members[0].rows(), "standby")
    # the writer runs on a standby's host, with that host's TLS files
    watcher = by[standbys[-1]]
    writer = CounterWriter(watcher.h)
    writer.start()
    wait_until(writer.grew(20), 30, "the writer's first writes", members)
    rows = watcher.rows()
    lead = leader(rows)
    assert lead is not None, rows
    voters = with_role(rows, "voter")
    victim = by[lead] if victim_leads else by[next(v for v in voters if v != lead)]
    alive = [m for m in members if m is not victim]

    def replaced() -> bool:
        rows = watcher.rows()
        now = with_role(rows, "voter")
        return (
            victim.h.name not in roles(rows)  # out of the member list (and its lease gone)
            and len(now) == 3
            and any(v in standbys for v in now)
            and all(r["healthy"] for r in rows if r["role"] == "voter")
        )

    victim.kill9()
    took = wait_until(replaced, 30, f"a standby in {victim.h.name}'s seat", alive)
    print(f"kill -9 of {victim.h.name} (leader: {victim_leads}): a standby voted in {took:.1f} s")
    # the curator said what it did and why, one line each
    said = "\n".join(m.text() for m in alive)
    assert f"cluster: removed {victim.h.name} (its agent is gone" in said
    assert "to voter (caught up with the leader)" in said
    wait_until(settled(alive, 3, 1, ask=watcher), 30, "3 voters and 1 standby", alive)
    wait_until(writer.grew(50), 30, "writes after the replacement", alive)
    writer.stop()
    report = writer.verify()
    print(f"writer: {report}")
    for m in members:
        assert "too many learner members" not in m.text()


@cluster_timeout(400)
def test_resize_three_five_three_while_a_writer_runs_loses_no_quorum(
    netbed: Callable[[int], NetBed],
) -> None:
    bed = netbed(5)
    members, by = three_and_two(bed)
    writer = CounterWriter(by[with_role(members[0].rows(), "standby")[-1]].h)
    writer.start()
    wait_until(writer.grew(20), 30, "the writer's first writes", members)
    assert members[0].cli("size", "5").returncode == 0
    up = wait_until(settled(members, 5, 0), 120, "5 voters", members)
    assert members[0].cli("size").stdout.strip() == "5"
    assert members[0].cli("size", "3").returncode == 0
    down = wait_until(settled(members, 3, 2), 120, "3 voters and 2 standbys again", members)
    wait_until(writer.grew(20), 30, "writes after the resize", members)
    writer.stop()
    report = writer.verify()
    print(f"resize: 3 -> 5 in {up:.1f} s, 5 -> 3 in {down:.1f} s; writer: {report}")
    # the election timeout is 0.1 s with fast timing: a gap of 2 s would be a
    # quorum lost, not an election
    assert report.max_gap < 2.0, (
        f"the longest gap between two acknowledged writes was {report.max_gap:.2f} s "
        f"({report.errors} errors, {report.acks} writes)"
    )


@cluster_timeout(900)
def test_a_member_killed_and_restarted_ten_times_comes_back_each_time(
    netbed: Callable[[int], NetBed],
) -> None:
    bed = netbed(4)
    members, _ = formed(bed, 4)
    wait_until(settled(members, 3, 1), 90, "3 voters and 1 standby", members)
    rows = members[0].rows()
    victim = next(m for m in members[1:] if roles(rows)[m.h.name] == "voter")
    back = settled(members, 3, 1)
    took: list[float] = []
    for i in range(10):
        role = roles(members[0].rows()).get(victim.h.name)
        mark = len(victim.text())
        victim.kill9()
        victim.restart()  # at once, same ports, same state dir

        def returned(mark: int = mark) -> bool:
            rows = members[0].rows()
            mine = [r for r in rows if r["name"] == victim.h.name]
            return (
                victim.alive()
                # the new agent opened its seat (etcd up, or a standby) and serves joins
                and "join service listening" in victim.text()[mark:]
                and len(mine) == 1
                and mine[0]["role"] in ("voter", "standby")
                and mine[0]["healthy"]
                and back()
            )

        t = wait_until(returned, 60, f"{victim.h.name} back (restart {i + 1})", members)
        took.append(t)
        print(f"restart {i + 1}: {victim.h.name} ({role} before) back in {t:.1f} s")
    print(f"restarts: max {max(took):.1f} s, median {statistics.median(took):.1f} s")
    for m in members:
        assert "too many learner members" not in m.text()


@cluster_timeout(120 + 180 * FORMATION_RUNS)
def test_formation_many_runs_in_a_row(netbed: Callable[[int], NetBed]) -> None:
    """One seed and four agents at once: exactly 3 voters and 2 standbys, no learner
    left, no "too many learner members" error, a write on one read on all; each run
    on a fresh bed (EVERGRAPH_FORMATION_RUNS runs, default 20)."""
    times: list[float] = []
    for i in range(FORMATION_RUNS):
        bed = netbed(5)
        t0 = time.monotonic()
        members, _ = formed(bed, 5)
        wait_until(settled(members, 3, 2), 90, f"3 voters and 2 standbys (run {i + 1})", members)
        times.append(time.monotonic() - t0)
        everyone = list(bed.hosts)
        members[4].world("put", "test/k", f"run{i}", seeds=everyone)
        for m in members:
            assert m.world("get", "test/k", seeds=everyone).stdout.strip() == f"run{i}"
        rows = members[0].rows()
        assert not with_role(rows, "learner"), rows
        for m in members:
            assert "too many learner members" not in m.text(), f"run {i + 1}: {m.h.name}"
        for m in members:  # no clean stop: handovers would only make the run slower
            m.kill9()
        bed.close()
        print(f"formation run {i + 1}/{FORMATION_RUNS}: {times[-1]:.1f} s")
    times.sort()
    p95 = times[min(len(times) - 1, round(0.95 * (len(times) - 1)))]
    print(f"formation: p50 {statistics.median(times):.1f} s, p95 {p95:.1f} s over {len(times)}")
