"""Boruta's API v1 on the wire, its fixed parts: the names (headers, versions),
Boruta's messages, and the error answers (`WireError`: an HTTP status and
`{"message": ...}`) that every route and body parser here raises. Pure.
"""

from __future__ import annotations

from typing import Any, Final

from evergraph.farm.model import IN_PROGRESS
from evergraph.http.boruta.gojson import dumps

CONTENT_TYPE: Final = "application/json"
API_VERSION: Final = "v1"
API_STATE: Final = "devel"
MAX_PAGE_LIMIT: Final = 65535
"""Boruta's `MaxPageLimit`: a page holds at most this many items, and a limit of 0
(or none, or more) means this many."""
SET_STATE_BODY: Final = b"null"
"""The body of setstate's 202 (Boruta marshals its nil error)."""

# Boruta's messages (its errors' texts), for the routes and for `invalid_request`.
BAD_ID: Final = "ID provided in URL isn't valid"
BAD_UUID: Final = "ID provided in URL isn't valid UUID"
ID_MISMATCH: Final = "request ID set in JSON doesn't match ID from URL"
NO_BODY: Final = "no body provided in HTTP request"
ERR_PRIORITY: Final = "requested priority out of bounds"
ERR_INVALID_TIME_RANGE: Final = "requested time range illegal - ValidAfter must be before Deadline"
ERR_DEADLINE_IN_THE_PAST: Final = "deadline in the past"
ERR_WORKER_NOT_ASSIGNED: Final = "worker not assigned"
ERR_MODIFICATION_FORBIDDEN: Final = "action cannot be executed in current state"
ERR_WRONG_SORT_ITEM: Final = "unknown name of item by which list should be sorted"
ERR_WRONG_SORT_ORDER: Final = "unknown sort order (valid: ascending or descending)"
ERR_WRONG_LIST_DIRECTION: Final = "unknown list direction (valid: forward or backward)"
ERR_WRONG_STATE_ARGUMENT: Final = "Only state changes to IDLE and MAINTENANCE are allowed"
ERR_FORBIDDEN_STATE_CHANGE: Final = "Invalid state transition was requested"
ERR_NOT_IN_FAIL_OR_MAINTENANCE: Final = "Worker is not in FAIL or MAINTENANCE state"
ERR_INTERNAL: Final = "internal server error"

# The headers Boruta sets (as Go canonicalises them on the wire).
LIST_TOTAL: Final = "Boruta-List-Total"
LIST_REMAINING: Final = "Boruta-List-Remaining"
LIST_BATCH_SIZE: Final = "Boruta-List-Batch-Size"
REQUEST_STATE: Final = "Boruta-Request-State"
JOB_TIMEOUT: Final = "Boruta-Job-Timeout"
WORKER_STATE: Final = "Boruta-Worker-State"
SERVER_VERSION: Final = "Boruta-Server-Version"
API_VERSION_HEADER: Final = "Boruta-Api-Version"
API_STATE_HEADER: Final = "Boruta-Api-State"


# ---------------------------------------------------------------- errors


class WireError(Exception):
    """An answer that is an error: HTTP `status` and Boruta's `message`."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message

    def body(self) -> bytes:
        """The response body: `{"message": ...}`."""
        return dumps(error(self.message))

    def __repr__(self) -> str:
        return f"WireError({self.status}, {self.message!r})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, WireError):
            return NotImplemented
        return (self.status, self.message) == (other.status, other.message)

    def __hash__(self) -> int:
        return hash((self.status, self.message))


def error(message: str) -> dict[str, Any]:
    """An error body's object."""
    return {"message": message}


def invalid_request(reason: str) -> WireError:
    """400 `invalid request: <reason>`: what Boruta answers for any refused input."""
    return WireError(400, f"invalid request: {reason}")


def not_found(what: str) -> WireError:
    """404 `<what> not found` (Boruta says `Request`, `Worker`, and lowercase
    `request` / `worker` for an unknown paginator ID)."""
    return WireError(404, f"{what} not found")


def no_body() -> WireError:
    """400 for an empty body where one is needed."""
    return WireError(400, NO_BODY)


def wire_state(state: str) -> str:
    """A request state as Boruta writes it (`IN PROGRESS`, whichever spelling the
    record holds)."""
    return IN_PROGRESS if state in ("IN_PROGRESS", "INPROGRESS") else state
