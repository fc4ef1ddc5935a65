"""The farm's records and their state machines (SPEC §4.6). Pure: no I/O, no clock.

Every transition takes a frozen record and returns a NEW one, or raises
`Refused(reason)` and changes nothing. Time is a float `now` (seconds since the
epoch) passed in by the caller; 0 in a time argument means "unset".

Requests: WAITING -> CANCELLED (close), TIMEOUT (deadline passed), INVALID
(unsatisfiable), IN PROGRESS (matched, with a Job); IN PROGRESS -> DONE (close or
job timeout), FAILED (worker failed or went to maintenance). Nothing else moves.
Updates (priority, valid_after, deadline) only while WAITING; a priority change
takes a new, larger `queued` number, i.e. goes to the tail of its new priority.

Workers: register -> MAINTENANCE; admin `set_state(IDLE)` only from MAINTENANCE,
through PREPARE (`complete_prepare` finishes it); `set_state(MAINTENANCE)` from
any state, through BUSY while a job runs (`complete_maintenance` finishes it);
matched -> RUNNING, job end -> IDLE; `set_fail` -> FAILED (ignored in
MAINTENANCE and BUSY); heartbeat lost -> FAILED; deregister only from
MAINTENANCE or FAILED.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import msgspec

from evergraph.errors import InputError
from evergraph.farm.caps import caps_error

# Request states, spelled as on Boruta's wire.
WAITING = "WAITING"
IN_PROGRESS = "IN PROGRESS"
CANCELLED = "CANCELLED"
TIMEOUT = "TIMEOUT"
INVALID = "INVALID"
DONE = "DONE"
FAILED = "FAILED"  # a worker state too
REQUEST_STATES = (WAITING, IN_PROGRESS, CANCELLED, TIMEOUT, INVALID, DONE, FAILED)
TERMINAL_STATES = frozenset({CANCELLED, TIMEOUT, INVALID, DONE, FAILED})

# Worker states, spelled as on Boruta's wire.
MAINTENANCE = "MAINTENANCE"
PREPARE = "PREPARE"
IDLE = "IDLE"
RUNNING = "RUNNING"
BUSY = "BUSY"
WORKER_STATES = (MAINTENANCE, PREPARE, IDLE, RUNNING, BUSY, FAILED)

HIGHEST_PRIORITY = 1
LOWEST_PRIORITY = 16
DEFAULT_DEADLINE_PERIOD = 30 * 24 * 3600.0
"""A request without a deadline gets now + this (one month)."""
DEFAULT_JOB_PERIOD = 3600.0
"""A job's first timeout is its start + this (Boruta's one hour)."""
UUID_CAP = "UUID"
"""Boruta lists a worker's UUID among its caps; a request may want a worker by it."""


class Refused(InputError):
    """A move the state machine does not allow, or bad input; nothing changed.

    `reason` is one line, e.g. "request 3 is IN PROGRESS: only a WAITING request
    can be updated" (the HTTP layer answers 400 `invalid request: <reason>`).
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Job(msgspec.Struct, frozen=True, kw_only=True):
    worker: str
    """The UUID of the worker running it."""
    timeout: float
    """When the job ends unless prolonged (the request then becomes DONE)."""


class Request(msgspec.Struct, frozen=True, kw_only=True):
    id: int
    priority: int
    """1..16, 1 most urgent."""
    owner: str
    groups: list[str] = []
    """The owner's groups (from the token); none = any worker's group."""
    caps: dict[str, str] = {}
    valid_after: float
    deadline: float
    state: str = WAITING
    job: Job | None = None
    queued: int
    """FIFO order key within a priority: a sequence number, larger = later."""
    prolongs: int = 0
    fragment: str | None = None
    """An optional graph fragment applied on the worker for the job (opaque)."""


class Worker(msgspec.Struct, frozen=True, kw_only=True):
    uuid: str
    caps: dict[str, str] = {}
    groups: list[str] = []
    state: str = MAINTENANCE
    job: int | None = None
    """The id of the request it runs (RUNNING, BUSY), else None."""
    address: str
    port: int
    username: str
    heartbeat: float
    """When the worker's agent was last heard from."""
    lost_from: str | None = None
    """FAILED because its heartbeat was lost: the state it was in (it returns to it,
    or IDLE for a job it lost, when heard from again); None otherwise."""


# ---------------------------------------------------------------- helpers


def _time(name: str, value: float) -> float:
    if not math.isfinite(value) or value < 0:
        raise Refused(f"{name} must be a time (seconds since the epoch), not {value!r}")
    return float(value)


def _priority(value: int) -> int:
    if not HIGHEST_PRIORITY <= value <= LOWEST_PRIORITY:
        raise Refused(
            f"priority {value} is out of range {HIGHEST_PRIORITY}..{LOWEST_PRIORITY}"
            f" ({HIGHEST_PRIORITY} most urgent)"
        )
    return value


def _window(valid_after: float, deadline: float, now: float) -> None:
    if deadline <= now:
        raise Refused(f"deadline {deadline} is in the past (now is {now})")
    if valid_after > deadline:
        raise Refused(f"valid_after {valid_after} is after the deadline {deadline}")


def _groups(groups: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(groups))


def _req_state(req: Request, wanted: str, doing: str) -> None:
    if req.state != wanted:
        raise Refused(f"request {req.id} is {req.state}: only a {wanted} request can {doing}")


def _worker_state(worker: Worker, wanted: tuple[str, ...], doing: str) -> None:
    if worker.state not in wanted:
        allowed = " or ".join(wanted)
        raise Refused(
            f"worker {worker.uuid} is {worker.state}: only a {allowed} worker can {doing}"
        )


def _replace_req(req: Request, **changes: object) -> Request:
    return msgspec.structs.replace(req, **changes)


def _replace_worker(worker: Worker, **changes: object) -> Worker:
    if worker.lost_from is not None and "lost_from" not in changes:
        changes["lost_from"] = None  # any other move: no longer a lost heartbeat's
    return msgspec.structs.replace(worker, **changes)


def is_terminal(req: Request) -> bool:
    """Whether the request can never move again."""
    return req.state in TERMINAL_STATES


def is_ready(req: Request, now: float) -> bool:
    """Whether the request may be matched now: WAITING, valid, deadline not passed."""
    return req.state == WAITING and req.valid_after <= now < req.deadline


# ---------------------------------------------------------------- requests


def new_request(
    *,
    id: int,
    owner: str,
    priority: int,
    now: float,
    queued: int,
    groups: Iterable[str] = (),
    caps: Mapping[str, str] | None = None,
    valid_after: float = 0.0,
    deadline: float = 0.0,
    fragment: str | None = None,
    deadline_period: float = DEFAULT_DEADLINE_PERIOD,
) -> Request:
    """A new WAITING request, validated; refused with the first problem found.

    valid_after 0 = now; deadline 0 = now + `deadline_period`. The deadline must
    be after now and valid_after not after the deadline; priority 1..16; every
    wanted capability well-formed (see `farm.caps`).
    """
    now = _time("now", now)
    priority = _priority(priority)
    valid_after = _time("valid_after", valid_after) or now
    deadline = _time("deadline", deadline) or now + deadline_period
    _window(valid_after, deadline, now)
    wanted = dict(caps or {})
    problem = caps_error(wanted)
    if problem is not None:
        raise Refused(problem)
    return Request(
        id=id,
        priority=priority,
        owner=owner,
        groups=_groups(groups),
        caps=wanted,
        valid_after=valid_after,
        deadline=deadline,
        state=WAITING,
        job=None,
        queued=queued,
        prolongs=0,
        fragment=fragment,
    )


def update_request(
    req: Request,
    now: float,
    *,
    queued: int,
    priority: int = 0,
    valid_after: float = 0.0,
    deadline: float = 0.0,
) -> Request:
    """Change priority, valid_after and/or deadline (0 = keep) of a WAITING request.

    A changed priority moves the request to the tail of its new priority: it
    takes `queued`, which must be larger than any number given before (unused
    otherwise). Nothing to change returns `req` itself, whatever its state (as
    Boruta does). The resulting window is checked like `new_request`'s.
    """
    if not priority and not valid_after and not deadline:
        return req
    _req_state(req, WAITING, "be updated")
    changes: dict[str, object] = {}
    if priority and priority != req.priority:
        changes["priority"] = _priority(priority)
        if queued <= req.queued:
            raise ValueError(f"queued {queued} is not after {req.queued}")
        changes["queued"] = queued
    new_valid = _time("valid_after", valid_after) or req.valid_after
    new_deadline = _time("deadline", deadline) or req.deadline
    if deadline:
        _window(new_valid, new_deadline, _time("now", now))
    elif new_valid > new_deadline:
        raise Refused(f"valid_after {new_valid} is after the deadline {new_deadline}")
    if new_valid != req.valid_after:
        changes["valid_after"] = new_valid
    if new_deadline != req.deadline:
        changes["deadline"] = new_deadline
    return _replace_req(req, **changes) if changes else req


def close_request(req: Request) -> Request:
    """The owner closes it: WAITING -> CANCELLED, IN PROGRESS -> DONE."""
    if req.state == WAITING:
        return _replace_req(req, state=CANCELLED)
    if req.state == IN_PROGRESS:
        return _replace_req(req, state=DONE)
    raise Refused(
        f"request {req.id} is {req.state}: only a WAITING or IN PROGRESS request can be closed"
    )


def expire_request(req: Request, now: float) -> Request:
    """WAITING -> TIMEOUT once its deadline has come (deadline <= now)."""
    _req_state(req, WAITING, "time out")
    if req.deadline > now:
        raise Refused(f"request {req.id} has not reached its deadline {req.deadline} (now {now})")
    return _replace_req(req, state=TIMEOUT)


def invalidate_request(req: Request) -> Request:
    """WAITING -> INVALID: no registered worker could ever satisfy it."""
    _req_state(req, WAITING, "become INVALID")
    return _replace_req(req, state=INVALID)


def start_request(
    req: Request, worker: str, now: float, period: float = DEFAULT_JOB_PERIOD
) -> Request:
    """WAITING -> IN PROGRESS on `worker` (a UUID); the job times out at now + period.

    Refused unless the request is ready (valid_after <= now < deadline).
    """
    _req_state(req, WAITING, "start")
    if not is_ready(req, now):
        raise Refused(
            f"request {req.id} is not ready at {now}: valid from {req.valid_after}"
            f" until {req.deadline}"
        )
    return _replace_req(req, state=IN_PROGRESS, job=Job(worker=worker, timeout=now + period))


def finish_request(req: Request, now: float) -> Request:
    """IN PROGRESS -> DONE once its job's timeout has come (timeout <= now)."""
    _req_state(req, IN_PROGRESS, "finish")
    if req.job is not None and req.job.timeout > now:
        raise Refused(f"request {req.id}'s job runs until {req.job.timeout} (now {now})")
    return _replace_req(req, state=DONE)


def fail_request(req: Request) -> Request:
    """IN PROGRESS -> FAILED: its worker failed or went to maintenance."""
    _req_state(req, IN_PROGRESS, "fail")
    return _replace_req(req, state=FAILED)


def prolong(req: Request, now: float, period: float, max_prolong: int) -> Request:
    """Extend an IN PROGRESS request's job to now + period (never shortens it).

    At most `max_prolong` times per request; refused after, and refused once the
    job's timeout has come (it is being finished).
    """
    _req_state(req, IN_PROGRESS, "be prolonged")
    if req.job is None:
        raise Refused(f"request {req.id} has no job")
    if req.prolongs >= max_prolong:
        raise Refused(
            f"request {req.id} was prolonged {req.prolongs} times: the limit is {max_prolong}"
        )
    if req.job.timeout <= now:
        raise Refused(f"request {req.id}'s job timed out at {req.job.timeout}")
    job = Job(worker=req.job.worker, timeout=max(req.job.timeout, now + period))
    return _replace_req(req, job=job, prolongs=req.prolongs + 1)


# ---------------------------------------------------------------- workers


def _check_endpoint(uuid: str, port: int) -> None:
    if not uuid:
        raise Refused("a worker needs a UUID")
    if not 0 < port < 65536:
        raise Refused(f"worker {uuid}: port {port} is out of range 1..65535")


def register_worker(
    *,
    uuid: str,
    caps: Mapping[str, str],
    address: str,
    port: int,
    username: str,
    now: float,
    groups: Iterable[str] = (),
) -> Worker:
    """A newly registered worker: MAINTENANCE, heard from now.

    Its caps get `UUID: <uuid>` as Boruta's do (a request may want it).
    """
    _check_endpoint(uuid, port)
    return Worker(
        uuid=uuid,
        caps={**caps, UUID_CAP: uuid},
        groups=_groups(groups),
        state=MAINTENANCE,
        job=None,
        address=address,
        port=port,
        username=username,
        heartbeat=now,
    )


def reregister_worker(
    worker: Worker,
    *,
    caps: Mapping[str, str],
    address: str,
    port: int,
    username: str,
    now: float,
) -> Worker:
    """A registered worker's agent registers again (e.g. restarted): new caps and
    endpoint, heard from now; its state, job and (admin-set) groups are kept."""
    _check_endpoint(worker.uuid, port)
    return _replace_worker(
        worker,
        caps={**caps, UUID_CAP: worker.uuid},
        address=address,
        port=port,
        username=username,
        heartbeat=now,
    )


def heartbeat(worker: Worker, now: float) -> Worker:
    """The worker's agent was heard from at `now` (any state; never goes back)."""
    return _replace_worker(worker, heartbeat=max(worker.heartbeat, now))


def set_state(worker: Worker, state: str) -> Worker:
    """The admin's move: IDLE or MAINTENANCE, returning the intermediate state.

    IDLE: only from MAINTENANCE, -> PREPARE (`complete_prepare` then makes it
    IDLE); already PREPARE: unchanged. MAINTENANCE: from any state; with a job
    -> BUSY (`complete_maintenance` then makes it MAINTENANCE; the caller fails
    the job's request), without -> MAINTENANCE; already BUSY: unchanged.
    """
    if state == IDLE:
        if worker.state == PREPARE:
            return worker
        _worker_state(worker, (MAINTENANCE,), "be set IDLE")
        return _replace_worker(worker, state=PREPARE)
    if state == MAINTENANCE:
        if worker.state in (BUSY, MAINTENANCE):
            return worker
        if worker.job is not None:
            return _replace_worker(worker, state=BUSY)
        return _replace_worker(worker, state=MAINTENANCE)
    raise Refused(f"worker {worker.uuid} can be set IDLE or MAINTENANCE, not {state!r}")


def complete_prepare(worker: Worker) -> Worker:
    """PREPARE -> IDLE: the worker is ready for a job."""
    _worker_state(worker, (PREPARE,), "become IDLE")
    return _replace_worker(worker, state=IDLE)


def complete_maintenance(worker: Worker) -> Worker:
    """BUSY -> MAINTENANCE: the running job was torn down; the job is cleared."""
    _worker_state(worker, (BUSY,), "finish going to MAINTENANCE")
    return _replace_worker(worker, state=MAINTENANCE, job=None)


def set_groups(worker: Worker, groups: Iterable[str]) -> Worker:
    """Replace the worker's groups (any state; duplicates dropped, order kept)."""
    return _replace_worker(worker, groups=_groups(groups))


def deregister_worker(worker: Worker) -> None:
    """Refused unless MAINTENANCE or FAILED; the caller then deletes the record."""
    _worker_state(worker, (MAINTENANCE, FAILED), "be deregistered")


def set_fail(worker: Worker) -> Worker:
    """The worker reports a failure: -> FAILED, its job dropped (the caller fails
    the job's request). Ignored (unchanged) in MAINTENANCE, BUSY and FAILED."""
    if worker.state in (MAINTENANCE, BUSY, FAILED):
        return worker
    return _replace_worker(worker, state=FAILED, job=None)


def heartbeat_lost(worker: Worker, now: float, timeout: float) -> Worker:
    """-> FAILED when not heard from for `timeout` seconds (heartbeat + timeout <=
    now), from any state, its job dropped; already FAILED: unchanged."""
    if worker.state == FAILED:
        return worker
    if worker.heartbeat + timeout > now:
        raise Refused(
            f"worker {worker.uuid} was heard from at {worker.heartbeat}: not lost at {now}"
        )
    return _replace_worker(worker, state=FAILED, job=None, lost_from=worker.state)


def heartbeat_back(worker: Worker) -> Worker:
    """FAILED by a lost heartbeat (`lost_from`), heard from again: back to the state
    it was in (its job, if it had one, was failed meanwhile: IDLE; one going to
    MAINTENANCE: MAINTENANCE). Any other worker: unchanged."""
    if worker.state != FAILED or worker.lost_from is None:
        return worker
    back = MAINTENANCE if worker.lost_from in (MAINTENANCE, BUSY) else IDLE
    if worker.lost_from == PREPARE:
        back = IDLE
    return _replace_worker(worker, state=back, job=None, lost_from=None)


def assign_worker(worker: Worker, request_id: int) -> Worker:
    """IDLE (without a job) -> RUNNING the job of request `request_id`."""
    _worker_state(worker, (IDLE,), "take a job")
    if worker.job is not None:
        raise Refused(f"worker {worker.uuid} already runs request {worker.job}")
    return _replace_worker(worker, state=RUNNING, job=request_id)


def release_worker(worker: Worker) -> Worker:
    """RUNNING -> IDLE: its job ended (the request closed, timed out or failed)."""
    _worker_state(worker, (RUNNING,), "end a job")
    return _replace_worker(worker, state=IDLE, job=None)
