"""Boruta's API v1 request bodies, read: a new request, an update, a worker's
state or groups, and the IDs in URLs; with Boruta's checks, in its order, each
refusal its 400 (`invalid request: <reason>`). Pure.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from evergraph.farm.model import (
    HIGHEST_PRIORITY,
    IDLE,
    LOWEST_PRIORITY,
    MAINTENANCE,
    WAITING,
    Request,
)
from evergraph.http.boruta.schema import GROUPS, REQ_INFO, WORKER_STATE_PACK, read_body
from evergraph.http.boruta.wire import (
    BAD_ID,
    BAD_UUID,
    ERR_DEADLINE_IN_THE_PAST,
    ERR_INVALID_TIME_RANGE,
    ERR_MODIFICATION_FORBIDDEN,
    ERR_PRIORITY,
    ERR_WRONG_STATE_ARGUMENT,
    ID_MISMATCH,
    invalid_request,
    wire_state,
)


def parse_req_id(text: str) -> int:
    """A request ID from a URL (Go's `strconv.ParseUint(s, 10, 64)`); else 400."""
    if text.isascii() and text.isdigit() and int(text) < 1 << 64:
        return int(text)
    raise invalid_request(BAD_ID)


_UUID_RE = re.compile(r"[0-9a-f]{8}-(?:[0-9a-f]{4}-){3}[0-9a-f]{12}")


def parse_worker_uuid(text: str) -> str:
    """A worker UUID from a URL (lowercase hex, Boruta's pattern); else 400."""
    if _UUID_RE.fullmatch(text) is None:
        raise invalid_request(BAD_UUID)
    return text


@dataclass(frozen=True)
class NewRequestSpec:
    """A `POST /api/v1/reqs/` body: what Boruta's NewRequest takes from it (the
    owner comes from the caller's token, never the body)."""

    priority: int
    caps: dict[str, str] = field(default_factory=dict)
    valid_after: float = 0.0
    """0 = unset (Boruta: now)."""
    deadline: float = 0.0
    """0 = unset (Boruta: a month from now)."""
    fragment: str = ""
    """evergraph's addition: YAML applied on the worker for the job's lifetime."""


def check_new_request(spec: NewRequestSpec, now: float) -> None:
    """Boruta's NewRequest checks, in its order: a set deadline not in the past,
    valid_after not after a set deadline, priority 1..16. Raises 400."""
    if spec.deadline and spec.deadline < now:
        raise invalid_request(ERR_DEADLINE_IN_THE_PAST)
    if spec.deadline and spec.valid_after and spec.valid_after > spec.deadline:
        raise invalid_request(ERR_INVALID_TIME_RANGE)
    if not HIGHEST_PRIORITY <= spec.priority <= LOWEST_PRIORITY:
        raise invalid_request(ERR_PRIORITY)


def parse_new_request(body: bytes, now: float | None = None) -> NewRequestSpec:
    """Read a create body (a `ReqInfo`; only Priority, Caps, ValidAfter and
    Deadline count). With `now`, also `check_new_request`."""
    info = read_body(body, REQ_INFO, empty_ok=False)
    spec = NewRequestSpec(
        priority=info["Priority"],
        caps=dict(info["Caps"] or {}),
        valid_after=info["ValidAfter"],
        deadline=info["Deadline"],
        fragment=info["Fragment"],
    )
    if now is not None:
        check_new_request(spec, now)
    return spec


@dataclass(frozen=True)
class UpdateSpec:
    """A `POST /api/v1/reqs/{id}` body; 0 in a field = leave it as it is."""

    id: int
    priority: int = 0
    valid_after: float = 0.0
    deadline: float = 0.0

    @property
    def empty(self) -> bool:
        """Nothing to change: Boruta answers 204 without looking the request up."""
        return not self.priority and not self.valid_after and not self.deadline


def parse_update_request(body: bytes, url_id: int) -> UpdateSpec:
    """Read an update body (a `ReqInfo`: Priority, ValidAfter, Deadline; an ID, if
    set, must be the URL's: else 400 `invalid request: request ID set in JSON
    doesn't match ID from URL`)."""
    info = read_body(body, REQ_INFO, empty_ok=False)
    if info["ID"] and info["ID"] != url_id:
        raise invalid_request(ID_MISMATCH)
    return UpdateSpec(
        id=url_id,
        priority=info["Priority"],
        valid_after=info["ValidAfter"],
        deadline=info["Deadline"],
    )


def check_update_request(spec: UpdateSpec, req: Request, now: float) -> bool:
    """Boruta's UpdateRequest checks against the stored request, in its order
    (the caller answers 404 for a missing request first, unless `spec.empty`):
    only a WAITING request (else `action cannot be executed in current state`),
    priority 0 or 1..16, a set deadline not in the past, a set valid_after not
    after the (new or kept) deadline. Raises 400; returns whether anything
    changes."""
    if spec.empty:
        return False
    if wire_state(req.state) != WAITING:
        raise invalid_request(ERR_MODIFICATION_FORBIDDEN)
    if (spec.priority, spec.valid_after, spec.deadline) == (
        req.priority,
        req.valid_after,
        req.deadline,
    ):
        return False
    if spec.priority and not HIGHEST_PRIORITY <= spec.priority <= LOWEST_PRIORITY:
        raise invalid_request(ERR_PRIORITY)
    deadline = req.deadline
    if spec.deadline:
        if spec.deadline < now:
            raise invalid_request(ERR_DEADLINE_IN_THE_PAST)
        deadline = spec.deadline
    if spec.valid_after and deadline and spec.valid_after > deadline:
        raise invalid_request(ERR_INVALID_TIME_RANGE)
    return True


def parse_set_state(body: bytes) -> str:
    """Read a setstate body `{"WorkerState": "IDLE" | "MAINTENANCE"}`; another
    state is 400 (Boruta refuses it before looking the worker up)."""
    state = read_body(body, WORKER_STATE_PACK, empty_ok=False)["WorkerState"]
    if state not in (IDLE, MAINTENANCE):
        raise invalid_request(ERR_WRONG_STATE_ARGUMENT)
    return str(state)


def parse_set_groups(body: bytes) -> list[str]:
    """Read a setgroups body: a JSON list of group names (null: none)."""
    groups = read_body(body, GROUPS, empty_ok=False)
    return list(groups or [])
