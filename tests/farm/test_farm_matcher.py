"""farm/caps.py and farm/matcher.py: capability forms, matching order, timers. Virtual time."""

from __future__ import annotations

import random
import time

import msgspec
import pytest

from evergraph.farm import caps as c
from evergraph.farm import model as m
from evergraph.farm.matcher import Assignment, Plan, fits, match, score
from evergraph.farm.model import (
    BUSY,
    DONE,
    FAILED,
    IDLE,
    IN_PROGRESS,
    MAINTENANCE,
    PREPARE,
    RUNNING,
    WAITING,
    Job,
    Request,
    Worker,
)

NOW = 1_700_000_000.0

# ---------------------------------------------------------------- capability forms


@pytest.mark.parametrize(
    ("wanted", "have", "ok"),
    [
        # exact
        ("x86_64", "x86_64", True),
        ("x86_64", "aarch64", False),
        ("x86-64", "x86-64", True),  # not numbers on both sides: not a range
        ("4", "4", True),
        ("4", "4.0", False),  # exact is exact
        ("", "", True),
        # any-of
        ("a|b|c", "a", True),
        ("a|b|c", "c", True),
        ("a|b|c", "d", False),
        ("a | b", "b", True),  # alternatives are stripped
        ("a|b", "a|b", False),
        ("2|3", "2.0", False),  # alternatives are exact strings
        # inclusive numeric range
        ("2.9-3.6", "3.3", True),
        ("2.9-3.6", "2.9", True),
        ("2.9-3.6", "3.6", True),
        ("2.9-3.6", "2.89", False),
        ("2.9-3.6", "3.61", False),
        ("2.9-3.6", "high", False),
        ("2.9 - 3.6", "3", True),
        ("-5--3", "-4", True),
        ("1e3-2e3", "1500", True),
        ("3-3", "3", True),
        # at least / at most
        (">=4", "4", True),
        (">=4", "64", True),
        (">=4", "3.99", False),
        (">=4", "four", False),
        (">=4", " 8 ", True),
        (">= 4", "5", True),
        (">=4", "nan", False),
        (">=4", "inf", False),
        (">=4", "1e999", False),
        (">=4", "", False),
        ("<=2.5", "2.5", True),
        ("<=2.5", "-1", True),
        ("<=2.5", "2.51", False),
        ("<=-1", "-2", True),
        ("<=2.5", "low", False),
    ],
)
def test_capability_forms(wanted: str, have: str, ok: bool) -> None:
    assert c.is_well_formed(wanted)
    assert c.value_matches(wanted, have) is ok
    assert c.satisfies({"k": have}, {"k": wanted}) is ok


@pytest.mark.parametrize(
    ("wanted", "word"),
    [
        (">=", "expected a number after '>='"),
        (">=x", "expected a number after '>='"),
        ("<=abc", "expected a number after '<='"),
        (">=4|8", "expected a number"),
        (">4", "'>=N' and '<=N'"),
        ("<4", "'>=N' and '<=N'"),
        ("a||b", "empty alternative"),
        ("a|", "empty alternative"),
        ("|a", "empty alternative"),
        ("a| |b", "empty alternative"),
        ("3.6-2.9", "empty range"),
        (">=1e999", "too large"),
    ],
)
def test_malformed_capability_forms(wanted: str, word: str) -> None:
    reason = c.wanted_error(wanted)
    assert reason is not None
    assert word in reason
    assert repr(wanted) in reason
    assert not c.is_well_formed(wanted)
    with pytest.raises(c.MalformedCap):
        c.parse_wanted(wanted)
    assert not c.value_matches(wanted, "4")  # never satisfied
    assert not c.satisfies({"k": "4"}, {"k": wanted})
    assert c.caps_error({"ok": "1", "k": wanted}) == f"capability 'k': {reason}"


def test_caps_error() -> None:
    assert c.caps_error({}) is None
    assert c.caps_error({"arch": "x86_64|aarch64", "cpus": ">=4", "volt": "2.9-3.6"}) is None
    assert c.caps_error({"": "x"}) == "an empty capability name"


def test_satisfies_needs_every_wanted_key() -> None:
    have = {"arch": "x86_64", "cpus": "8", "os": "linux"}
    assert c.satisfies(have, {})
    assert c.satisfies(have, {"arch": "x86_64", "cpus": ">=4"})  # extra keys don't matter
    assert not c.satisfies(have, {"arch": "x86_64", "gpu": "any"})
    assert not c.satisfies(have, {"arch": "x86_64", "cpus": ">=16"})


@pytest.mark.parametrize(
    ("request_groups", "worker_groups", "ok"),
    [
        ([], [], True),
        ([], ["a"], True),
        (["a"], [], True),
        (["a"], ["a", "b"], True),
        (["a", "c"], ["b", "c"], True),
        (["a"], ["b"], False),
    ],
)
def test_groups_overlap(request_groups: list[str], worker_groups: list[str], ok: bool) -> None:
    assert c.groups_overlap(request_groups, worker_groups) is ok


# ---------------------------------------------------------------- matcher helpers


def W(
    uuid: str,
    caps: dict[str, str] | None = None,
    groups: list[str] | None = None,
    state: str = IDLE,
    job: int | None = None,
    heartbeat: float = NOW,
) -> Worker:
    return Worker(
        uuid=uuid,
        caps=caps or {},
        groups=groups or [],
        state=state,
        job=job,
        address="10.0.0.1",
        port=22,
        username="u",
        heartbeat=heartbeat,
    )


def R(
    id: int,
    priority: int = 8,
    queued: int | None = None,
    caps: dict[str, str] | None = None,
    groups: list[str] | None = None,
    valid_after: float = NOW - 10,
    deadline: float = NOW + 1000,
    state: str = WAITING,
    job: Job | None = None,
) -> Request:
    return Request(
        id=id,
        priority=priority,
        owner="ann",
        groups=groups or [],
        caps=caps or {},
        valid_after=valid_after,
        deadline=deadline,
        state=state,
        job=job,
        queued=id if queued is None else queued,
    )


def pairs(plan: Plan) -> list[tuple[int, str]]:
    return [(a.request, a.worker) for a in plan.assign]


# ---------------------------------------------------------------- order


def test_priority_first() -> None:
    reqs = [R(1, priority=5), R(2, priority=1), R(3, priority=3)]
    assert pairs(match(reqs, [W("w")], NOW)) == [(2, "w")]
    plan = match(reqs, [W("a"), W("b"), W("c")], NOW)
    assert [r for r, _ in pairs(plan)] == [2, 3, 1]
    assert [w for _, w in pairs(plan)] == ["a", "b", "c"]


def test_fifo_within_a_priority() -> None:
    reqs = [R(1, queued=7), R(2, queued=3), R(3, queued=5)]
    assert pairs(match(reqs, [W("w")], NOW)) == [(2, "w")]
    assert [r for r, _ in pairs(match(reqs, [W("a"), W("b"), W("c")], NOW))] == [2, 3, 1]


def test_a_priority_change_goes_to_the_tail() -> None:
    a = m.new_request(id=1, owner="x", priority=2, now=NOW, queued=1)
    b = m.new_request(id=2, owner="x", priority=2, now=NOW, queued=2)
    c_ = m.new_request(id=3, owner="x", priority=5, now=NOW, queued=3)
    c_ = m.update_request(c_, NOW, queued=4, priority=2)  # joins priority 2 last
    at = NOW + 1
    assert [r for r, _ in pairs(match([c_, b, a], [W("p"), W("q"), W("r")], at))] == [1, 2, 3]
    # a leaves priority 2 and comes back: it is now behind b and c
    a = m.update_request(m.update_request(a, NOW, queued=5, priority=3), NOW, queued=6, priority=2)
    assert [r for r, _ in pairs(match([c_, b, a], [W("p"), W("q"), W("r")], at))] == [2, 3, 1]
    assert pairs(match([c_, b, a], [W("p")], at)) == [(2, "p")]


def test_a_more_urgent_request_takes_the_worker_first() -> None:
    # only one worker fits both; the urgent one wins it even though it came later
    reqs = [R(1, priority=9, caps={"arch": "arm"}), R(2, priority=1, caps={"arch": "arm"})]
    workers = [W("arm", {"arch": "arm"}), W("x86", {"arch": "x86"})]
    assert pairs(match(reqs, workers, NOW)) == [(2, "arm")]


def test_a_taken_worker_leaves_the_pool() -> None:
    reqs = [R(1), R(2), R(3)]
    plan = match(reqs, [W("a"), W("b")], NOW)
    assert pairs(plan) == [(1, "a"), (2, "b")]
    assert plan.invalid == []
    assert plan.timeout == []


def test_a_request_that_fits_nothing_free_does_not_block_the_queue() -> None:
    reqs = [R(1, caps={"gpu": "yes"}), R(2)]
    workers = [W("gpu", {"gpu": "yes"}, state=MAINTENANCE), W("plain")]
    plan = match(reqs, workers, NOW)
    assert pairs(plan) == [(2, "plain")]
    assert plan.invalid == []  # a registered worker could serve 1 later


# ---------------------------------------------------------------- least capable


def test_least_capable_fitting_worker_wins() -> None:
    req = R(1, caps={"arch": "x86_64"})
    big = W("a-big", {"arch": "x86_64", "cpus": "64", "gpu": "yes", "os": "linux"})
    small = W("z-small", {"arch": "x86_64", "cpus": "2"})
    other = W("b-other", {"arch": "aarch64"})  # least capable but does not fit
    assert pairs(match([req], [big, other, small], NOW)) == [(1, "z-small")]


def test_groups_count_towards_capability() -> None:
    req = R(1, caps={"arch": "x86_64"})
    grouped = W("a", {"arch": "x86_64"}, groups=["g1", "g2"])
    plain = W("b", {"arch": "x86_64", "cpus": "2"})
    assert score(grouped) == 3
    assert score(plain) == 2
    assert pairs(match([req], [grouped, plain], NOW)) == [(1, "b")]


def test_ties_broken_by_uuid() -> None:
    workers = [W(u, {"arch": "x"}) for u in ("m", "c", "x", "a", "q")]
    for seed in range(5):
        random.Random(seed).shuffle(workers)
        assert pairs(match([R(1, caps={"arch": "x"})], workers, NOW)) == [(1, "a")]
        plan = match([R(1), R(2), R(3)], workers, NOW)
        assert pairs(plan) == [(1, "a"), (2, "c"), (3, "m")]


def test_request_can_want_a_worker_by_uuid() -> None:
    w1 = m.complete_prepare(
        m.set_state(
            m.register_worker(uuid="u-1", caps={}, address="h", port=22, username="u", now=NOW),
            IDLE,
        )
    )
    w2 = msgspec.structs.replace(w1, uuid="u-0", caps={"UUID": "u-0"})
    assert pairs(match([R(1, caps={"UUID": "u-1"})], [w2, w1], NOW)) == [(1, "u-1")]


# ---------------------------------------------------------------- groups and pool


@pytest.mark.parametrize(
    ("request_groups", "worker_groups", "matched"),
    [
        (["lab"], ["lab"], True),
        (["lab"], ["lab", "ci"], True),
        (["lab", "ci"], ["ci"], True),
        (["lab"], ["ci"], False),
        ([], ["ci"], True),
        (["lab"], [], True),
    ],
)
def test_groups(request_groups: list[str], worker_groups: list[str], matched: bool) -> None:
    plan = match([R(1, groups=request_groups)], [W("w", groups=worker_groups)], NOW)
    assert pairs(plan) == ([(1, "w")] if matched else [])
    assert plan.invalid == ([] if matched else [1])
    assert fits(R(1, groups=request_groups), W("w", groups=worker_groups)) is matched


@pytest.mark.parametrize("state", [MAINTENANCE, PREPARE, RUNNING, BUSY, FAILED])
def test_only_idle_workers_are_candidates(state: str) -> None:
    job = 99 if state in (RUNNING, BUSY) else None
    plan = match([R(1)], [W("w", state=state, job=job)], NOW)
    assert plan.assign == []
    assert plan.invalid == []  # registered and fitting: the request waits


def test_an_idle_worker_with_a_job_is_not_a_candidate() -> None:
    assert match([R(1)], [W("w", job=5)], NOW).assign == []


def test_a_worker_named_by_a_running_request_is_not_a_candidate() -> None:
    # half-applied snapshot: request 5 IN PROGRESS on w, but w still IDLE without a job
    running = R(5, state=IN_PROGRESS, job=Job(worker="w", timeout=NOW + 100))
    plan = match([running, R(1)], [W("w")], NOW)
    assert plan.assign == []
    assert plan.failed == [5]  # w is not running its job
    assert plan.release == []


# ---------------------------------------------------------------- INVALID and TIMEOUT


def test_invalid_when_no_registered_worker_could_ever_satisfy() -> None:
    reqs = [
        R(1, caps={"arch": "sparc"}),
        R(2, caps={"cpus": ">=128"}),
        R(3, caps={"arch": "x86_64"}, valid_after=NOW + 500),  # invalid even before valid
        R(4, caps={"arch": "x86_64"}),
        R(5, caps={"arch": "x86_64"}, groups=["other"]),
    ]
    workers = [W("a", {"arch": "x86_64", "cpus": "8"}, groups=["lab"], state=FAILED)]
    plan = match(reqs, workers, NOW)
    assert plan.invalid == [1, 2, 5]
    assert plan.assign == []
    assert match(reqs[3:4], [], NOW).invalid == [4]  # no worker at all


def test_malformed_caps_on_record_are_invalid() -> None:
    assert match([R(1, caps={"cpus": ">=x"})], [W("w", {"cpus": "4"})], NOW).invalid == [1]


def test_timeout_when_the_deadline_came() -> None:
    reqs = [
        R(1, deadline=NOW),  # deadline == now: over
        R(2, deadline=NOW - 5),
        R(3, deadline=NOW - 5, caps={"never": "there"}),  # TIMEOUT wins over INVALID
        R(4, deadline=NOW + 5),
    ]
    plan = match(reqs, [W("w")], NOW)
    assert plan.timeout == [1, 2, 3]
    assert plan.invalid == []
    assert pairs(plan) == [(4, "w")]


# ---------------------------------------------------------------- running jobs


def test_job_timeout_done_and_worker_released() -> None:
    r1 = R(1, state=IN_PROGRESS, job=Job(worker="a", timeout=NOW))
    r2 = R(2, state=IN_PROGRESS, job=Job(worker="b", timeout=NOW + 60))
    workers = [W("a", state=RUNNING, job=1), W("b", state=RUNNING, job=2)]
    plan = match([r1, r2], workers, NOW)
    assert plan.done == [1]
    assert plan.release == ["a"]
    assert plan.failed == []
    assert plan.next_wakeup == NOW + 60
    assert match([r1, r2], workers, NOW - 1).done == []


@pytest.mark.parametrize(
    "worker",
    [
        W("a", state=FAILED),
        W("a", state=MAINTENANCE),
        W("a", state=BUSY, job=1),
        W("a", state=RUNNING, job=2),  # runs someone else's job
        None,  # deregistered
    ],
)
def test_running_request_fails_with_its_worker(worker: Worker | None) -> None:
    r1 = R(1, state=IN_PROGRESS, job=Job(worker="a", timeout=NOW + 60))
    plan = match([r1], [worker] if worker else [], NOW)
    assert plan.failed == [1]
    assert plan.done == []


def test_release_a_worker_whose_request_ended() -> None:
    ended = R(1, state=DONE, job=Job(worker="a", timeout=NOW + 60))
    plan = match([ended, R(2)], [W("a", state=RUNNING, job=1), W("b", state=RUNNING, job=42)], NOW)
    assert plan.release == ["a", "b"]
    assert plan.assign == []  # released workers are free only once applied


def test_heartbeat_lost() -> None:
    r1 = R(1, state=IN_PROGRESS, job=Job(worker="a", timeout=NOW + 600))
    workers = [
        W("a", state=RUNNING, job=1, heartbeat=NOW - 31),
        W("b", heartbeat=NOW - 30),  # exactly the timeout: lost
        W("c", heartbeat=NOW - 10),
        W("d", state=FAILED, heartbeat=NOW - 999),  # already failed
    ]
    plan = match([r1, R(2)], workers, NOW, heartbeat_timeout=30)
    assert plan.lost == ["a", "b"]
    assert plan.failed == [1]
    assert pairs(plan) == [(2, "c")]  # lost workers are not candidates
    assert plan.next_wakeup == NOW + 20  # c's heartbeat deadline
    assert match([r1, R(2)], workers, NOW).lost == []  # not asked


# ---------------------------------------------------------------- next_wakeup and plans


def test_next_wakeup_is_the_earliest_future_time() -> None:
    reqs = [
        R(1, valid_after=NOW + 50, deadline=NOW + 900),
        R(2, caps={"gpu": "yes"}, deadline=NOW + 70),  # valid, no free worker: its deadline
        R(3, state=IN_PROGRESS, job=Job(worker="r", timeout=NOW + 40)),
    ]
    workers = [W("g", {"gpu": "yes"}, state=MAINTENANCE), W("r", state=RUNNING, job=3)]
    assert match(reqs, workers, NOW).next_wakeup == NOW + 40
    assert match(reqs[:2], workers, NOW).next_wakeup == NOW + 50
    assert match(reqs[1:2], workers, NOW).next_wakeup == NOW + 70


def test_next_wakeup_none_when_nothing_is_due() -> None:
    plan = match([], [W("w")], NOW)
    assert plan.empty
    assert plan.next_wakeup is None
    # everything resolved in this plan: nothing left to wait for
    plan = match([R(1), R(2, deadline=NOW - 1)], [W("w")], NOW)
    assert not plan.empty
    assert plan.next_wakeup is None


def test_a_request_becomes_valid_on_virtual_time() -> None:
    reqs = [R(1, valid_after=NOW + 30)]
    plan = match(reqs, [W("w")], NOW)
    assert plan.empty
    assert plan.next_wakeup == NOW + 30
    assert pairs(match(reqs, [W("w")], NOW + 30)) == [(1, "w")]


def test_plan_encodes() -> None:
    plan = match([R(1)], [W("w")], NOW)
    assert plan.assign == [Assignment(request=1, worker="w")]
    assert msgspec.json.decode(msgspec.json.encode(plan), type=Plan) == plan


# ---------------------------------------------------------------- a simulated farm


def apply(
    plan: Plan, reqs: dict[int, Request], workers: dict[str, Worker], job_period: float
) -> None:
    """What the leader does with a plan (here: in memory)."""
    now = plan.now
    for rid in plan.timeout:
        reqs[rid] = m.expire_request(reqs[rid], now)
    for rid in plan.invalid:
        reqs[rid] = m.invalidate_request(reqs[rid])
    for rid in plan.done:
        reqs[rid] = m.finish_request(reqs[rid], now)
    for rid in plan.failed:
        reqs[rid] = m.fail_request(reqs[rid])
    for uuid in plan.lost:
        workers[uuid] = m.heartbeat_lost(workers[uuid], now, 30)
    for uuid in plan.release:
        workers[uuid] = m.release_worker(workers[uuid])
    for a in plan.assign:
        assert workers[a.worker].job is None
        reqs[a.request] = m.start_request(reqs[a.request], a.worker, now, job_period)
        workers[a.worker] = m.assign_worker(workers[a.worker], a.request)


def test_simulated_farm_on_virtual_time() -> None:
    rng = random.Random(12)
    archs = ["x86_64", "aarch64"]
    workers = {
        f"w{i}": W(f"w{i}", {"arch": archs[i % 2], "cpus": str(2 ** (i % 4))}) for i in range(5)
    }
    reqs: dict[int, Request] = {}
    for i in range(1, 201):
        caps = rng.choice([{}, {"arch": "x86_64"}, {"cpus": ">=4"}, {"arch": "riscv"}])
        reqs[i] = m.new_request(
            id=i,
            owner="ann",
            priority=rng.randint(1, 16),
            now=NOW,
            queued=i,
            caps=caps,
            valid_after=NOW + rng.uniform(0, 500),
            deadline=NOW + rng.uniform(600, 3000),
        )
    now = NOW
    started: list[tuple[float, int]] = []
    for _ in range(2000):
        plan = match(reqs.values(), workers.values(), now)
        if not plan.empty:
            apply(plan, reqs, workers, job_period=rng.uniform(5, 100))
            started += [(now, a.request) for a in plan.assign]
            # no worker holds two jobs; every running request is on its worker
            running = [r for r in reqs.values() if r.state == IN_PROGRESS]
            on = [r.job.worker for r in running if r.job]
            assert len(on) == len(set(on)) == len(running)
            for r in running:
                assert r.job is not None
                assert workers[r.job.worker].job == r.id
            continue
        if plan.next_wakeup is None:
            break
        assert plan.next_wakeup > now
        now = plan.next_wakeup
    assert all(m.is_terminal(r) for r in reqs.values())
    assert {r.caps.get("arch") for r in reqs.values() if r.state == "INVALID"} == {"riscv"}
    assert sum(r.state == DONE for r in reqs.values()) > 20
    assert all(w.state == IDLE and w.job is None for w in workers.values())
    # when several started at the same instant they went in queue order
    for t in {t for t, _ in started}:
        ids = [rid for tt, rid in started if tt == t]
        keys = [(reqs[i].priority, reqs[i].queued) for i in ids]
        assert keys == sorted(keys)


def test_matching_1000_requests_over_50_workers_is_fast() -> None:
    rng = random.Random(3)
    workers = [
        W(
            f"w{i:02}",
            {"arch": rng.choice(["x86_64", "aarch64"]), "cpus": str(rng.choice([2, 4, 8, 16]))},
            groups=rng.sample(["a", "b", "c"], rng.randint(0, 2)),
        )
        for i in range(50)
    ]
    reqs = [
        R(
            i,
            priority=rng.randint(1, 16),
            caps={"arch": rng.choice(["x86_64", "aarch64", "x86_64|aarch64"]), "cpus": ">=8"},
            groups=rng.sample(["a", "b", "c", "d"], rng.randint(0, 2)),
        )
        for i in range(1000)
    ]
    t0 = time.perf_counter()
    plan = match(reqs, workers, NOW)
    elapsed = time.perf_counter() - t0
    assert plan.assign
    assert len({a.worker for a in plan.assign}) == len(plan.assign)
    assert elapsed < 1.0, elapsed
