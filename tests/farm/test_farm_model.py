"""farm/model.py: request and worker state machines, validation, prolong. Virtual time."""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import pytest

from evergraph.errors import InputError
from evergraph.farm import model as m
from evergraph.farm.model import (
    BUSY,
    CANCELLED,
    DONE,
    FAILED,
    IDLE,
    IN_PROGRESS,
    INVALID,
    MAINTENANCE,
    PREPARE,
    REQUEST_STATES,
    RUNNING,
    TIMEOUT,
    WAITING,
    WORKER_STATES,
    Job,
    Refused,
    Request,
    Worker,
)

NOW = 1_700_000_000.0
MONTH = 30 * 24 * 3600.0


def a_request(state: str = WAITING, **changes: object) -> Request:
    req = m.new_request(
        id=3,
        owner="ann",
        groups=["lab"],
        caps={"arch": "x86_64"},
        priority=8,
        now=NOW,
        queued=1,
    )
    job = Job(worker="w-1", timeout=NOW + 3600) if state in (IN_PROGRESS, DONE, FAILED) else None
    return msgspec.structs.replace(req, state=state, job=job, **changes)


def a_worker(state: str = MAINTENANCE, **changes: object) -> Worker:
    w = m.register_worker(
        uuid="w-1",
        caps={"arch": "x86_64"},
        groups=["lab"],
        address="10.0.0.5",
        port=22,
        username="boruta-user",
        now=NOW,
    )
    job = 7 if state in (RUNNING, BUSY) else None
    return msgspec.structs.replace(w, state=state, job=job, **changes)


def snapshot(x: Request | Worker) -> bytes:
    return msgspec.json.encode(x)


def refused(fn: Callable[[], object]) -> str:
    with pytest.raises(Refused) as e:
        fn()
    reason = e.value.reason
    assert reason
    assert "\n" not in reason
    return reason


# ---------------------------------------------------------------- request table

REQUEST_OPS: dict[str, Callable[[Request], Request]] = {
    "close": m.close_request,
    "expire": lambda r: m.expire_request(r, r.deadline),
    "invalidate": m.invalidate_request,
    "start": lambda r: m.start_request(r, "w-2", NOW + 1, 60),
    "finish": lambda r: m.finish_request(r, r.job.timeout if r.job else NOW + 2 * MONTH),
    "fail": m.fail_request,
    "update": lambda r: m.update_request(r, NOW, queued=99, priority=2),
    "prolong": lambda r: m.prolong(r, NOW + 1, 60, 3),
}

# (state, op) -> the state it leads to; every pair not listed is refused.
REQUEST_ALLOWED = {
    (WAITING, "close"): CANCELLED,
    (WAITING, "expire"): TIMEOUT,
    (WAITING, "invalidate"): INVALID,
    (WAITING, "start"): IN_PROGRESS,
    (WAITING, "update"): WAITING,
    (IN_PROGRESS, "close"): DONE,
    (IN_PROGRESS, "finish"): DONE,
    (IN_PROGRESS, "fail"): FAILED,
    (IN_PROGRESS, "prolong"): IN_PROGRESS,
}

SPEC_REQUEST_MOVES = {
    (WAITING, CANCELLED),
    (WAITING, TIMEOUT),
    (WAITING, INVALID),
    (WAITING, IN_PROGRESS),
    (IN_PROGRESS, DONE),
    (IN_PROGRESS, FAILED),
}


@pytest.mark.parametrize("state", REQUEST_STATES)
@pytest.mark.parametrize("op", list(REQUEST_OPS))
def test_request_transition_table(state: str, op: str) -> None:
    req = a_request(state)
    before = snapshot(req)
    want = REQUEST_ALLOWED.get((state, op))
    if want is None:
        reason = refused(lambda: REQUEST_OPS[op](req))
        assert f"request 3 is {state}" in reason
    else:
        assert REQUEST_OPS[op](req).state == want
    assert snapshot(req) == before  # the input never changes


def test_request_moves_are_exactly_the_specs() -> None:
    moves = set()
    for state in REQUEST_STATES:
        for op in REQUEST_OPS.values():
            try:
                after = op(a_request(state))
            except Refused:
                continue
            if after.state != state:
                moves.add((state, after.state))
    assert moves == SPEC_REQUEST_MOVES


def test_refused_reason_names_request_and_state() -> None:
    reason = refused(lambda: m.update_request(a_request(IN_PROGRESS), NOW, queued=9, priority=2))
    assert reason == "request 3 is IN PROGRESS: only a WAITING request can be updated"


def test_refused_is_an_input_error() -> None:
    with pytest.raises(InputError):
        m.close_request(a_request(DONE))


def test_start_sets_job_and_needs_a_ready_request() -> None:
    req = a_request(valid_after=NOW + 10, deadline=NOW + 100)
    refused(lambda: m.start_request(req, "w-2", NOW + 9, 60))  # not valid yet
    refused(lambda: m.start_request(req, "w-2", NOW + 100, 60))  # deadline reached
    started = m.start_request(req, "w-2", NOW + 10, 60)  # valid_after == now: ready
    assert started.state == IN_PROGRESS
    assert started.job == Job(worker="w-2", timeout=NOW + 70)
    assert m.is_ready(req, NOW + 99.5)
    assert not m.is_ready(req, NOW + 100)


def test_start_default_job_period_is_an_hour() -> None:
    assert m.start_request(a_request(), "w", NOW).job == Job(worker="w", timeout=NOW + 3600)


def test_expire_only_once_the_deadline_came() -> None:
    req = a_request(deadline=NOW + 100)
    reason = refused(lambda: m.expire_request(req, NOW + 99))
    assert "deadline" in reason
    assert m.expire_request(req, NOW + 100).state == TIMEOUT
    assert m.expire_request(req, NOW + 500).state == TIMEOUT


def test_finish_only_once_the_job_timed_out() -> None:
    req = a_request(IN_PROGRESS)
    assert req.job is not None
    timeout = req.job.timeout
    refused(lambda: m.finish_request(req, timeout - 1))
    done = m.finish_request(req, timeout)
    assert done.state == DONE
    assert done.job == req.job


def test_close_in_progress_keeps_the_job() -> None:
    req = a_request(IN_PROGRESS)
    assert m.close_request(req).job == req.job


def test_terminal_states() -> None:
    assert {s for s in REQUEST_STATES if m.is_terminal(a_request(s))} == {
        CANCELLED,
        TIMEOUT,
        INVALID,
        DONE,
        FAILED,
    }


# ---------------------------------------------------------------- validation and defaults


def test_defaults_valid_now_deadline_a_month() -> None:
    req = m.new_request(id=1, owner="ann", priority=4, now=NOW, queued=5)
    assert (req.valid_after, req.deadline) == (NOW, NOW + MONTH)
    assert req.state == WAITING
    assert req.job is None
    assert req.prolongs == 0
    assert req.caps == {}
    assert req.groups == []
    assert req.fragment is None
    assert req.queued == 5


def test_default_deadline_period_is_configurable() -> None:
    req = m.new_request(id=1, owner="a", priority=4, now=NOW, queued=1, deadline_period=60)
    assert req.deadline == NOW + 60


def test_given_times_and_fields_are_kept() -> None:
    req = m.new_request(
        id=9,
        owner="bob",
        groups=["a", "b", "a"],
        caps={"cpus": ">=4"},
        priority=1,
        now=NOW,
        queued=2,
        valid_after=NOW + 5,
        deadline=NOW + 50,
        fragment="file: {}",
    )
    assert (req.valid_after, req.deadline) == (NOW + 5, NOW + 50)
    assert req.groups == ["a", "b"]  # duplicates dropped
    assert req.caps == {"cpus": ">=4"}
    assert req.fragment == "file: {}"


@pytest.mark.parametrize("priority", [1, 16])
def test_priority_bounds_accepted(priority: int) -> None:
    req = m.new_request(id=1, owner="a", priority=priority, now=NOW, queued=1)
    assert req.priority == priority


@pytest.mark.parametrize("priority", [0, 17, -1, 255])
def test_priority_out_of_range_refused(priority: int) -> None:
    reason = refused(lambda: m.new_request(id=1, owner="a", priority=priority, now=NOW, queued=1))
    assert "priority" in reason
    assert "1..16" in reason


@pytest.mark.parametrize(
    ("valid_after", "deadline", "word"),
    [
        (0.0, NOW - 1, "past"),  # deadline in the past
        (0.0, NOW, "past"),  # a deadline of now is already over
        (NOW + 20, NOW + 10, "after the deadline"),
        (NOW + MONTH + 1, 0.0, "after the deadline"),  # beyond the default deadline
        (-5.0, 0.0, "must be a time"),
        (float("nan"), 0.0, "must be a time"),
        (0.0, float("inf"), "must be a time"),
    ],
)
def test_bad_windows_refused(valid_after: float, deadline: float, word: str) -> None:
    reason = refused(
        lambda: m.new_request(
            id=1,
            owner="a",
            priority=3,
            now=NOW,
            queued=1,
            valid_after=valid_after,
            deadline=deadline,
        )
    )
    assert word in reason


def test_window_edges_accepted() -> None:
    # valid_after == deadline, valid_after in the past
    req = m.new_request(
        id=1, owner="a", priority=3, now=NOW, queued=1, valid_after=NOW + 9, deadline=NOW + 9
    )
    assert req.valid_after == req.deadline
    past = m.new_request(id=1, owner="a", priority=3, now=NOW, queued=1, valid_after=NOW - 60)
    assert past.valid_after == NOW - 60


def test_malformed_caps_refused_naming_the_key() -> None:
    reason = refused(
        lambda: m.new_request(
            id=1, owner="a", priority=3, now=NOW, queued=1, caps={"arch": "x86", "cpus": ">=x"}
        )
    )
    assert reason.startswith("capability 'cpus': ")
    assert "'>=x'" in reason


# ---------------------------------------------------------------- updates


def test_update_priority_goes_to_the_tail() -> None:
    req = a_request()
    up = m.update_request(req, NOW, queued=42, priority=2)
    assert (up.priority, up.queued) == (2, 42)


def test_update_same_priority_keeps_the_place() -> None:
    req = a_request()
    assert m.update_request(req, NOW, queued=42, priority=req.priority) is req


def test_update_queued_must_grow() -> None:
    with pytest.raises(ValueError, match="queued"):
        m.update_request(a_request(queued=10), NOW, queued=10, priority=2)


def test_update_times() -> None:
    req = a_request()
    up = m.update_request(req, NOW, queued=2, valid_after=NOW + 10, deadline=NOW + 20)
    assert (up.valid_after, up.deadline, up.priority, up.queued) == (
        NOW + 10,
        NOW + 20,
        req.priority,
        req.queued,
    )
    # deadline alone, valid_after alone
    assert m.update_request(req, NOW, queued=2, deadline=NOW + 7).deadline == NOW + 7
    assert m.update_request(req, NOW, queued=2, valid_after=NOW + 7).valid_after == NOW + 7


@pytest.mark.parametrize(
    ("changes", "word"),
    [
        ({"priority": 17}, "priority"),
        ({"deadline": NOW - 1}, "past"),
        ({"valid_after": NOW + 2 * MONTH}, "after the deadline"),
        ({"valid_after": NOW + 30, "deadline": NOW + 20}, "after the deadline"),
        ({"deadline": float("nan")}, "must be a time"),
    ],
)
def test_update_refused_changes_nothing(changes: dict[str, float], word: str) -> None:
    req = a_request(valid_after=NOW + 10)
    before = snapshot(req)
    reason = refused(lambda: m.update_request(req, NOW, queued=50, **changes))  # type: ignore[arg-type]
    assert word in reason
    assert snapshot(req) == before


def test_update_deadline_before_valid_after_refused() -> None:
    req = a_request(valid_after=NOW + 100)
    assert "after the deadline" in refused(
        lambda: m.update_request(req, NOW, queued=2, deadline=NOW + 50)
    )


@pytest.mark.parametrize("state", REQUEST_STATES)
def test_empty_update_is_a_no_op_in_any_state(state: str) -> None:
    req = a_request(state)
    assert m.update_request(req, NOW, queued=9) is req


# ---------------------------------------------------------------- prolong


def test_prolong_extends_up_to_the_cap() -> None:
    req = m.start_request(a_request(), "w-1", NOW, 100)
    t = NOW
    for i in range(1, 4):
        t += 50
        req = m.prolong(req, t, 100, 3)
        assert req.job == Job(worker="w-1", timeout=t + 100)
        assert req.prolongs == i
    before = snapshot(req)
    reason = refused(lambda: m.prolong(req, t + 1, 100, 3))
    assert reason == "request 3 was prolonged 3 times: the limit is 3"
    assert snapshot(req) == before


def test_prolong_zero_cap_refuses_at_once() -> None:
    req = m.start_request(a_request(), "w-1", NOW, 100)
    refused(lambda: m.prolong(req, NOW + 1, 100, 0))


def test_prolong_never_shortens() -> None:
    req = m.start_request(a_request(), "w-1", NOW, 1000)
    assert m.prolong(req, NOW + 1, 10, 5).job == Job(worker="w-1", timeout=NOW + 1000)


def test_prolong_refused_once_the_job_timed_out() -> None:
    req = m.start_request(a_request(), "w-1", NOW, 100)
    assert "timed out" in refused(lambda: m.prolong(req, NOW + 100, 100, 5))


# ---------------------------------------------------------------- worker table

WORKER_OPS: dict[str, Callable[[Worker], Worker | None]] = {
    "set IDLE": lambda w: m.set_state(w, IDLE),
    "set MAINTENANCE": lambda w: m.set_state(w, MAINTENANCE),
    "complete_prepare": m.complete_prepare,
    "complete_maintenance": m.complete_maintenance,
    "set_fail": m.set_fail,
    "heartbeat_lost": lambda w: m.heartbeat_lost(w, NOW + 100, 10),
    "assign": lambda w: m.assign_worker(w, 9),
    "release": m.release_worker,
    "set_groups": lambda w: m.set_groups(w, ["x"]),
    "deregister": m.deregister_worker,
}

GONE = "(deregistered)"
# (state, op) -> the state it leads to; every pair not listed is refused.
WORKER_ALLOWED = {
    (MAINTENANCE, "set IDLE"): PREPARE,
    (MAINTENANCE, "set MAINTENANCE"): MAINTENANCE,
    (MAINTENANCE, "set_fail"): MAINTENANCE,  # ignored
    (MAINTENANCE, "heartbeat_lost"): FAILED,
    (MAINTENANCE, "deregister"): GONE,
    (PREPARE, "set IDLE"): PREPARE,  # already on its way
    (PREPARE, "set MAINTENANCE"): MAINTENANCE,
    (PREPARE, "complete_prepare"): IDLE,
    (PREPARE, "set_fail"): FAILED,
    (PREPARE, "heartbeat_lost"): FAILED,
    (IDLE, "set MAINTENANCE"): MAINTENANCE,
    (IDLE, "set_fail"): FAILED,
    (IDLE, "heartbeat_lost"): FAILED,
    (IDLE, "assign"): RUNNING,
    (RUNNING, "set MAINTENANCE"): BUSY,  # a job runs: passes BUSY
    (RUNNING, "set_fail"): FAILED,
    (RUNNING, "heartbeat_lost"): FAILED,
    (RUNNING, "release"): IDLE,
    (BUSY, "set MAINTENANCE"): BUSY,  # already on its way
    (BUSY, "complete_maintenance"): MAINTENANCE,
    (BUSY, "set_fail"): BUSY,  # ignored
    (BUSY, "heartbeat_lost"): FAILED,
    (FAILED, "set MAINTENANCE"): MAINTENANCE,
    (FAILED, "set_fail"): FAILED,
    (FAILED, "heartbeat_lost"): FAILED,
    (FAILED, "deregister"): GONE,
    **{(s, "set_groups"): s for s in WORKER_STATES},
}

SPEC_WORKER_MOVES = {
    (MAINTENANCE, PREPARE),
    (PREPARE, IDLE),
    (IDLE, RUNNING),
    (RUNNING, IDLE),
    (RUNNING, BUSY),
    (BUSY, MAINTENANCE),
    (PREPARE, MAINTENANCE),
    (IDLE, MAINTENANCE),
    (FAILED, MAINTENANCE),
    *((s, FAILED) for s in (MAINTENANCE, PREPARE, IDLE, RUNNING, BUSY)),
}


@pytest.mark.parametrize("state", WORKER_STATES)
@pytest.mark.parametrize("op", list(WORKER_OPS))
def test_worker_transition_table(state: str, op: str) -> None:
    w = a_worker(state)
    before = snapshot(w)
    want = WORKER_ALLOWED.get((state, op))
    if want is None:
        reason = refused(lambda: WORKER_OPS[op](w))
        assert reason.startswith("worker w-1 ")
    else:
        after = WORKER_OPS[op](w)
        assert (after.state if after is not None else GONE) == want
        if after is not None:
            # a job only while RUNNING or BUSY
            assert (after.job is not None) == (after.state in (RUNNING, BUSY))
    assert snapshot(w) == before


def test_worker_moves_are_exactly_the_specs() -> None:
    moves = set()
    for state in WORKER_STATES:
        for op in WORKER_OPS.values():
            try:
                after = op(a_worker(state))
            except Refused:
                continue
            if after is not None and after.state != state:
                moves.add((state, after.state))
    assert moves == SPEC_WORKER_MOVES


def test_set_state_to_other_states_refused() -> None:
    for state in (PREPARE, RUNNING, BUSY, FAILED, "nonsense"):
        reason = refused(lambda s=state: m.set_state(a_worker(), s))  # type: ignore[misc]
        assert "IDLE or MAINTENANCE" in reason


def test_worker_lifecycle_observes_intermediates() -> None:
    w = a_worker()
    assert w.state == MAINTENANCE
    w = m.set_state(w, IDLE)
    assert w.state == PREPARE
    w = m.complete_prepare(w)
    assert w.state == IDLE
    w = m.assign_worker(w, 12)
    assert (w.state, w.job) == (RUNNING, 12)
    w = m.set_state(w, MAINTENANCE)
    assert (w.state, w.job) == (BUSY, 12)
    w = m.complete_maintenance(w)
    assert (w.state, w.job) == (MAINTENANCE, None)
    assert m.deregister_worker(w) is None


def test_register_worker() -> None:
    w = a_worker()
    assert w.state == MAINTENANCE
    assert w.job is None
    assert w.heartbeat == NOW
    assert w.caps == {"arch": "x86_64", "UUID": "w-1"}
    assert (w.address, w.port, w.username, w.groups) == ("10.0.0.5", 22, "boruta-user", ["lab"])


@pytest.mark.parametrize(("uuid", "port"), [("", 22), ("w", 0), ("w", 65536)])
def test_register_bad_endpoint_refused(uuid: str, port: int) -> None:
    refused(
        lambda: m.register_worker(uuid=uuid, caps={}, address="h", port=port, username="u", now=NOW)
    )


def test_reregister_keeps_state_job_and_groups() -> None:
    w = m.set_groups(a_worker(RUNNING), ["admin-set"])
    again = m.reregister_worker(
        w, caps={"arch": "aarch64"}, address="10.0.0.6", port=2222, username="v", now=NOW + 5
    )
    assert (again.state, again.job, again.groups) == (RUNNING, 7, ["admin-set"])
    assert again.caps == {"arch": "aarch64", "UUID": "w-1"}
    assert (again.address, again.port, again.username, again.heartbeat) == (
        "10.0.0.6",
        2222,
        "v",
        NOW + 5,
    )


def test_heartbeat_never_goes_back() -> None:
    w = a_worker()
    assert m.heartbeat(w, NOW + 10).heartbeat == NOW + 10
    assert m.heartbeat(m.heartbeat(w, NOW + 10), NOW + 3).heartbeat == NOW + 10


def test_heartbeat_lost_only_after_the_timeout() -> None:
    w = a_worker(IDLE)
    refused(lambda: m.heartbeat_lost(w, NOW + 9.9, 10))
    assert m.heartbeat_lost(w, NOW + 10, 10).state == FAILED


def test_set_groups_drops_duplicates() -> None:
    assert m.set_groups(a_worker(), ["b", "a", "b"]).groups == ["b", "a"]
    assert m.set_groups(a_worker(), []).groups == []


def test_records_round_trip_through_json() -> None:
    req = m.prolong(m.start_request(a_request(), "w-1", NOW, 10), NOW + 1, 10, 2)
    assert msgspec.json.decode(msgspec.json.encode(req), type=Request) == req
    w = a_worker(RUNNING)
    assert msgspec.json.decode(msgspec.json.encode(w), type=Worker) == w
