"""Boruta's Go types as its server decodes request bodies into them (`ReqInfo`,
the list specs, `WorkerStatePack`), declared for the `gojson` reader, and
`read_body`: a body decoded into one, a failure answered as Boruta answers it
(400 `invalid request: <Go's message>`, or `no body provided in HTTP request`).
The Go type names (`boruta.ReqID`...) appear in Go's type-error messages.
"""

from __future__ import annotations

from typing import Any

from evergraph.http.boruta.gojson import (
    Bytes,
    DecodeError,
    EmptyBody,
    Map,
    Pointer,
    Slice,
    String,
    Struct,
    Text,
    Time,
    Type,
    Uint,
    decode,
)
from evergraph.http.boruta.wire import (
    ERR_WRONG_LIST_DIRECTION,
    ERR_WRONG_SORT_ORDER,
    invalid_request,
    no_body,
)


def _sort_order(text: str) -> bool:
    """Boruta's SortOrder: "ascending" (or empty) / "descending", any case;
    True is descending. (`asc` / `desc` are accepted too.)"""
    order = text.lower()
    if order in ("", "ascending", "asc"):
        return False
    if order in ("descending", "desc"):
        return True
    raise DecodeError(ERR_WRONG_SORT_ORDER)


def _direction(text: str) -> bool:
    """Boruta's ListDirection: "forward" (or empty) / "backward", any case;
    True is backward."""
    direction = text.lower()
    if direction in ("", "forward"):
        return False
    if direction == "backward":
        return True
    raise DecodeError(ERR_WRONG_LIST_DIRECTION)


_TIME = Time()
_REQ_ID = Uint("boruta.ReqID", 64)
_PRIORITY = Uint("boruta.Priority", 8)
GROUPS = Slice("boruta.Groups", String("boruta.Group"))
_CAPS = Map("boruta.Capabilities", String("string"))
REQ_INFO = Struct(
    "boruta.ReqInfo",
    [
        ("ID", _REQ_ID),
        ("Priority", _PRIORITY),
        ("Owner", Struct("boruta.UserInfo", [("Groups", GROUPS)])),
        ("Deadline", _TIME),
        ("ValidAfter", _TIME),
        ("State", String("boruta.ReqState")),
        (
            "Job",
            Pointer(
                Struct(
                    "boruta.JobInfo",
                    [("WorkerUUID", String("boruta.WorkerUUID")), ("Timeout", _TIME)],
                )
            ),
        ),
        ("Caps", _CAPS),
        # evergraph's addition (ignored by Boruta): a graph fragment for the job
        ("Fragment", String("string")),
    ],
)
_SORTER = Pointer(
    Struct(
        "boruta.SortInfo",
        [("Item", String("string")), ("Order", Text("boruta.SortOrder", _sort_order))],
    )
)
_DIRECTION = Text("boruta.ListDirection", _direction)
_LIMIT = Uint("uint16", 16)
REQUESTS_LIST = Struct(
    "http.RequestsListSpec",
    [
        (
            "Filter",
            Pointer(
                Struct(
                    "filter.Requests",
                    [
                        ("IDs", Slice("[]boruta.ReqID", _REQ_ID)),
                        ("Priorities", Bytes("[]boruta.Priority", _PRIORITY)),
                        ("States", Slice("[]boruta.ReqState", String("boruta.ReqState"))),
                    ],
                )
            ),
        ),
        ("Sorter", _SORTER),
        (
            "Paginator",
            Pointer(
                Struct(
                    "boruta.RequestsPaginator",
                    [("ID", _REQ_ID), ("Direction", _DIRECTION), ("Limit", _LIMIT)],
                )
            ),
        ),
    ],
)
WORKERS_LIST = Struct(
    "http.WorkersListSpec",
    [
        (
            "Filter",
            Pointer(Struct("filter.Workers", [("Groups", GROUPS), ("Capabilities", _CAPS)])),
        ),
        ("Sorter", _SORTER),
        (
            "Paginator",
            Pointer(
                Struct(
                    "boruta.WorkersPaginator",
                    [
                        ("ID", String("boruta.WorkerUUID")),
                        ("Direction", _DIRECTION),
                        ("Limit", _LIMIT),
                    ],
                )
            ),
        ),
    ],
)
WORKER_STATE_PACK = Struct("http.WorkerStatePack", [("WorkerState", String("boruta.WorkerState"))])


def read_body(body: bytes, kind: Type, *, empty_ok: bool) -> Any:
    """`body` decoded into `kind` as Go's `json.NewDecoder(body).Decode` does.

    An empty body is `kind`'s zero value where `empty_ok` (Boruta's list
    handlers), else 400 `no body provided in HTTP request`. Any other failure is
    400 `invalid request: <Go's message>`."""
    try:
        return decode(body, kind)
    except EmptyBody:
        if empty_ok:
            return kind.zero()
        raise no_body() from None
    except DecodeError as exc:
        raise invalid_request(str(exc)) from None
