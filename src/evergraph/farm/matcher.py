"""The matcher: from one snapshot of requests and workers, the moves now due. Pure.

`match(requests, workers, now)` decides, and the `Plan` it returns lists the
transitions; applying them (through `farm.model`'s functions, fenced by
leadership) is the caller's job. It is level-triggered: any snapshot, even one
left half-applied by a leader that died, yields the moves that make it right,
and a snapshot with nothing due yields an empty plan. After applying a
non-empty plan, match again (released workers may take waiting requests);
otherwise sleep until `next_wakeup` or a change.

Order: ready requests (WAITING, valid_after <= now < deadline) by priority (1
first), then `queued` (FIFO), then id. Candidates: IDLE workers without a job
(and not named by any IN PROGRESS request) whose caps satisfy the request and
that share a group with it (no groups on either side = any). The least-capable
fitting worker wins: fewest caps plus groups, ties by UUID. Each match takes its
worker out of the pool for the rest of the plan.

Cost: O(requests x workers) at worst; requests wanting the same caps and groups
share their checks.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from evergraph.farm.caps import CapsPredicate, compile_caps, groups_overlap
from evergraph.farm.model import (
    FAILED,
    IDLE,
    IN_PROGRESS,
    RUNNING,
    WAITING,
    Request,
    Worker,
)


class Assignment(msgspec.Struct, frozen=True, kw_only=True):
    """Start `request` on `worker`: `start_request` and `assign_worker`, applied
    together in ONE transaction (a worker never holds two jobs)."""

    request: int
    worker: str


class Plan(msgspec.Struct, frozen=True, kw_only=True):
    """The moves due at `now`, each list in a stable order."""

    now: float
    assign: list[Assignment] = []
    """WAITING -> IN PROGRESS with IDLE -> RUNNING, in matching order."""
    timeout: list[int] = []
    """WAITING requests past their deadline -> TIMEOUT (`expire_request`)."""
    invalid: list[int] = []
    """WAITING requests no registered worker could ever satisfy -> INVALID."""
    done: list[int] = []
    """IN PROGRESS requests whose job timed out -> DONE (`finish_request`)."""
    failed: list[int] = []
    """IN PROGRESS requests whose worker is gone, lost, FAILED, in (or going to)
    maintenance, or not RUNNING their job -> FAILED (`fail_request`)."""
    release: list[str] = []
    """RUNNING workers whose job's request ended or is no longer IN PROGRESS on
    them (including this plan's `done`) -> IDLE (`release_worker`)."""
    lost: list[str] = []
    """Workers not heard from for `heartbeat_timeout` -> FAILED (`heartbeat_lost`);
    only when `match` was given a heartbeat_timeout."""
    next_wakeup: float | None = None
    """The earliest time after `now` at which something becomes due, or None."""

    @property
    def empty(self) -> bool:
        """Whether nothing is to be done now."""
        return not (
            self.assign
            or self.timeout
            or self.invalid
            or self.done
            or self.failed
            or self.release
            or self.lost
        )


def score(worker: Worker) -> int:
    """How capable a worker is: caps plus groups (the least capable fit wins)."""
    return len(worker.caps) + len(worker.groups)


def fits(request: Request, worker: Worker) -> bool:
    """Whether the worker could serve the request by caps and groups (any state)."""
    return groups_overlap(request.groups, worker.groups) and compile_caps(request.caps)(worker.caps)


def _signature(req: Request) -> tuple[frozenset[tuple[str, str]], frozenset[str]]:
    return frozenset(req.caps.items()), frozenset(req.groups)


def match(
    requests: Iterable[Request],
    workers: Iterable[Worker],
    now: float,
    *,
    heartbeat_timeout: float | None = None,
) -> Plan:
    """The plan for this snapshot at `now` (see the module docstring).

    `requests`: at least every WAITING and IN PROGRESS one (others are ignored).
    `workers`: every registered worker (deregistered ones absent).
    `heartbeat_timeout`: when given, workers not heard from for that long (and not
    already FAILED) are `lost`, and their heartbeat deadlines count for
    `next_wakeup`.
    """
    reqs = sorted(
        (r for r in requests if r.state in (WAITING, IN_PROGRESS)),
        key=lambda r: (r.priority, r.queued, r.id),
    )
    by_uuid = {w.uuid: w for w in workers}
    wakeups: list[float] = []

    lost: list[str] = []
    if heartbeat_timeout is not None:
        for w in sorted(by_uuid.values(), key=lambda w: w.uuid):
            if w.state == FAILED:
                continue
            due = w.heartbeat + heartbeat_timeout
            if due <= now:
                lost.append(w.uuid)
            else:
                wakeups.append(due)
    lost_set = set(lost)

    # Running jobs: timed out, failed, or keeping their worker.
    done: list[int] = []
    failed: list[int] = []
    holding: dict[str, int] = {}  # worker uuid -> the IN PROGRESS request staying on it
    claimed: set[str] = set()  # every worker named by an IN PROGRESS request
    for r in reqs:
        if r.state != IN_PROGRESS:
            continue
        job = r.job
        on = by_uuid.get(job.worker) if job is not None else None
        if job is not None:
            claimed.add(job.worker)
        if (
            job is None
            or on is None
            or on.uuid in lost_set
            or on.state != RUNNING
            or on.job != r.id
        ):
            failed.append(r.id)
        elif job.timeout <= now:
            done.append(r.id)
        else:
            holding[on.uuid] = r.id
            wakeups.append(job.timeout)
    release = sorted(
        w.uuid
        for w in by_uuid.values()
        if w.state == RUNNING and w.uuid not in lost_set and w.uuid not in holding
    )

    # The pool: free IDLE workers, least capable first, ties by UUID.
    excluded = lost_set | claimed
    pool = sorted(
        (
            w
            for w in by_uuid.values()
            if w.state == IDLE and w.job is None and w.uuid not in excluded
        ),
        key=lambda w: (score(w), w.uuid),
    )
    taken: set[str] = set()
    registered = list(by_uuid.values())

    timeout: list[int] = []
    invalid: list[int] = []
    assign: list[Assignment] = []
    predicates: dict[object, CapsPredicate] = {}
    satisfiable: dict[object, bool] = {}
    no_idle_fit: set[object] = set()  # signatures that found no free worker this plan

    for r in reqs:
        if r.state != WAITING:
            continue
        if r.deadline <= now:
            timeout.append(r.id)
            continue
        sig = _signature(r)
        pred = predicates.get(sig)
        if pred is None:
            pred = predicates[sig] = compile_caps(r.caps)
        ok = satisfiable.get(sig)
        if ok is None:
            ok = satisfiable[sig] = any(
                groups_overlap(r.groups, w.groups) and pred(w.caps) for w in registered
            )
        if not ok:
            invalid.append(r.id)
            continue
        if r.valid_after > now:
            wakeups.append(r.valid_after)
            wakeups.append(r.deadline)
            continue
        chosen = None
        if sig not in no_idle_fit:
            for w in pool:
                if w.uuid not in taken and groups_overlap(r.groups, w.groups) and pred(w.caps):
                    chosen = w
                    break
        if chosen is None:
            no_idle_fit.add(sig)
            wakeups.append(r.deadline)
            continue
        taken.add(chosen.uuid)
        assign.append(Assignment(request=r.id, worker=chosen.uuid))

    future = [t for t in wakeups if t > now]
    return Plan(
        now=now,
        assign=assign,
        timeout=timeout,
        invalid=invalid,
        done=done,
        failed=failed,
        release=release,
        lost=lost,
        next_wakeup=min(future) if future else None,
    )
