"""Boruta's golden HTTP cases (`shared/boruta-ref/testdata/`), rebuilt on the pure wire
module: for each case of Boruta's `http/server/api/v1/handlers_test.go`, the request
it sends (URL parameter and body, as Go marshals them) and what its mocks return,
answered the way Boruta's handler answers, through `evergraph.http.boruta` only.

Where a golden answer comes from the farm (a 404 for a missing ID, a list the mock
made up), the case says so and stands in for the farm with that answer; the real
listing of the same items is checked separately in the tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from evergraph.farm.model import CANCELLED, FAILED, IDLE, IN_PROGRESS, WAITING, Job, Request, Worker
from evergraph.http.boruta import bodies, encode, gojson, gotime, listing, wire

GOLDEN = Path(__file__).resolve().parents[3] / "shared" / "boruta-ref" / "testdata"

INVALID_ID = "test"
VALID_UUID = "ec4898ac-0853-407c-8501-cbb24ef6bd77"
MISSING_UUID = "8f8ade90-a319-4275-9407-977ca3e9607c"
FUTURE = gotime.parse_time("2222-12-31T00:00:00Z")
PAST = gotime.parse_time("1683-09-12T00:00:00Z")
NOW = gotime.parse_time("2024-12-17T00:00:00Z")
"""When the handlers run (before every deadline of the cases)."""

MALFORMED_JSON = b'{"Priority{}'
VALID_REQ_JSON = b"""{
\t\t"ID":1,
\t\t"State":"WAITING",
\t\t"Job":null,
\t\t"Priority":8,
\t\t"Deadline":"2200-12-31T01:02:03Z",
\t\t"ValidAfter":"2100-01-01T04:05:06Z",
\t\t"Caps":{
\t\t\t"architecture":"armv7l",
\t\t\t"monitor":"yes"
\t\t},
\t\t"Owner":{}
\t}"""
BAD_PRIO_JSON = (
    b'{"Priority":32,"Deadline":"2200-12-31T01:02:03Z","ValidAfter":"2100-01-01T04:05:06Z",'
    b'"Caps":{"architecture":"armv7l","monitor":"yes"}}'
)
SET_PRIO_JSON = b'{"Priority":4}'
# jsonMustMarshal(&boruta.ReqInfo{ID: 1, Priority: 4})
UPDATE_VALID_JSON = (
    b'{"ID":1,"Priority":4,"Owner":{"Groups":null},"Deadline":"0001-01-01T00:00:00Z",'
    b'"ValidAfter":"0001-01-01T00:00:00Z","State":"","Job":null,"Caps":null}'
)
SET_STATE_JSON = b'{"WorkerState":"IDLE"}'
SET_GROUPS_JSON = b'["foo","bar"]'

KEY_PEM = (
    "-----BEGIN RSA PRIVATE KEY-----\n"
    "MIICXgIBAAKBgQCyBgKbrwKh75BDoigwltbazFGDLdlxf9YLpFj5v+4ieKgsaN+W\n"
    "+kRvamSuB5CC2tqFql5x7kPt1U+vVMwkzVRewF/HHzRYxgLHlge6d1ZALpCWywaz\n"
    "slt5pNCmF7NoZ//WTSrafufDI4IRoNgkHtEKvnWdBaPPnY4Cf+PCbZOYNQIDAQAB\n"
    "AoGBAJvoz5fxKekQmdPhzDjhocF1d13fZbQVNSx0/seb476k1QQvxMHA5PZ+wzX2\n"
    "wgUYDpFJp/U3qp48VtFC/pasjNoG7zLPLLUJcg15eOoh4Ld7I1e4lRkLl3CwnqMk\n"
    "bc6UoKQRLli4O3cmaMxVHXal0o72s3o0qnHlRlZXLekwi6aBAkEA69j3bnbAybsF\n"
    "/NHelRYDH8bou+LCX2d/p6ReUR0bJ4yCAWRi/9Ld0ng482xinxGSpfovbIplBMFx\n"
    "H2eT2Cw0OQJBAME8LLz/3zb/vLG/t8Lfsequ1ZhVca/LlVR4yJLlyaVcywT9SJlO\n"
    "mKCy13SpKl8TY7czyufYrY4lobZjYaIsm90CQQCKhkRGWG/BzRymMyp2DJjHKFB4\n"
    "Uqbx3FuJPqy7HcpeP1P4t1rCgbsSLNTefRGr9mlZHYqPSPYuheQImxCmTshZAkEA\n"
    "wAp5u+vfft1yPoT2r+l4/G99P8PLFJcTdbwEOlm8qWcrLW47dIE0FqEml3536b1v\n"
    "YGdMxFYHRjoIGSdzpKUI0QJAAqPdDp+y7kWaeIbKkp3Z3bLrj5wii2QAy2YlBDKe\n"
    "pXrvruWJvL75OCYcxRju3DpVaoYqEmso+UEiQEDRB42YYg==\n"
    "-----END RSA PRIVATE KEY-----\n"
)


def request(rid: int, **fields: Any) -> Request:
    """A record as the farm stores it (owner, queue position: irrelevant on the wire)."""
    values: dict[str, Any] = {
        "id": rid,
        "priority": 8,
        "owner": "",
        "valid_after": PAST,
        "deadline": FUTURE,
        "queued": rid,
    }
    values.update(fields)
    return Request(**values)


def worker(uuid: str, state: str, groups: list[str], caps: dict[str, str]) -> Worker:
    return Worker(
        uuid=uuid,
        state=state,
        groups=groups,
        caps=caps,
        address="127.0.0.1",
        port=22,
        username="boruta-user",
        heartbeat=NOW,
    )


# TestListRequestsHandler's requests (priorities (HiPrio+LoPrio)/2 = 8 and 9)
REQS = [
    request(1, priority=8, state=WAITING),
    request(2, priority=9, state=WAITING),
    request(3, priority=8, state=CANCELLED),
    request(4, priority=9, state=CANCELLED),
]
# TestListWorkersHandler's workers
WORKERS = [
    worker("0", IDLE, ["Lędzianie"], {"architecture": "AArch64"}),
    worker("1", FAILED, ["Malinowy Chruśniak"], {"architecture": "AArch64"}),
    worker("2", IDLE, ["Malinowy Chruśniak", "Lędzianie"], {"architecture": "RISC-V"}),
    worker("3", FAILED, ["Malinowy Chruśniak"], {"architecture": "RISC-V"}),
]


def valid_req() -> Request:
    """validReqJSON as GetRequestInfo returns it (request 1)."""
    spec = bodies.parse_new_request(VALID_REQ_JSON)
    return request(
        1,
        priority=spec.priority,
        caps=spec.caps,
        valid_after=spec.valid_after,
        deadline=spec.deadline,
    )


def running_req() -> Request:
    """Request 2: validReqJSON IN PROGRESS on VALID_UUID until 2222-12-31."""
    return request(
        2,
        priority=8,
        caps=valid_req().caps,
        valid_after=valid_req().valid_after,
        deadline=valid_req().deadline,
        state=IN_PROGRESS,
        job=Job(worker=VALID_UUID, timeout=FUTURE),
    )


# ---------------------------------------------------------------- list bodies, as Go marshals

_NO_FILTER = b'{"IDs":null,"Priorities":null,"States":null}'


def reqs_spec(flt: bytes = b"null", sorter: bytes = b"null", pag: bytes = b"null") -> bytes:
    return b'{"Filter":' + flt + b',"Sorter":' + sorter + b',"Paginator":' + pag + b"}"


REQS_VALID_FILTER = b'{"IDs":null,"Priorities":null,"States":["WAITING"]}'
DEFAULT_SORTER = b'{"Item":"","Order":"ascending"}'
BAD_SORTER = b'{"Item":"foobarbaz","Order":"ascending"}'


def pag(pid: str, direction: str, limit: int) -> bytes:
    return f'{{"ID":{pid},"Direction":"{direction}","Limit":{limit}}}'.encode()


WORKERS_VALID_FILTER = (
    '{"Groups":["Malinowy Chruśniak"],"Capabilities":{"architecture":"RISC-V"}}'.encode()
)

LIST_BODIES: dict[str, bytes] = {
    "filter-reqs-valid-filter": reqs_spec(REQS_VALID_FILTER, DEFAULT_SORTER),
    "filter-reqs-valid-filter-sort-asc": reqs_spec(
        REQS_VALID_FILTER, b'{"Item":"priority","Order":"ascending"}'
    ),
    "filter-reqs-valid-filter-sort-desc": reqs_spec(
        REQS_VALID_FILTER, b'{"Item":"state","Order":"descending"}'
    ),
    "filter-reqs-empty-json": b"",
    "filter-reqs-nil": b"null",
    "filter-reqs-empty": reqs_spec(_NO_FILTER),
    "filter-reqs-paginator-fwd1": reqs_spec(_NO_FILTER, pag=pag("0", "forward", 2)),
    "filter-reqs-paginator-fwd2": reqs_spec(_NO_FILTER, pag=pag("2", "forward", 2)),
    "filter-reqs-paginator-back1": reqs_spec(_NO_FILTER, pag=pag("4", "backward", 2)),
    "filter-reqs-paginator-back2": reqs_spec(_NO_FILTER, pag=pag("2", "backward", 2)),
    "filter-reqs-nomatch-all": reqs_spec(b'{"IDs":null,"Priorities":null,"States":["INVALID"]}'),
    # Go marshals []boruta.Priority{99} (a uint8 slice) as base64
    "filter-reqs-bad-filter": reqs_spec(
        b'{"IDs":null,"Priorities":"Yw==","States":["NOSUCHSTATE"]}'
    ),
    "filter-reqs-bad-sorter-item": reqs_spec(REQS_VALID_FILTER, BAD_SORTER),
    "filter-reqs-malformed-json": MALFORMED_JSON,
    "filter-workers-valid-filter": reqs_spec(WORKERS_VALID_FILTER, DEFAULT_SORTER),
    "filter-workers-empty-body": b"",
    "filter-workers-empty-filter": reqs_spec(b'{"Groups":null,"Capabilities":null}'),
    "filter-workers-empty-filter-sort-asc": reqs_spec(
        sorter=b'{"Item":"uuid","Order":"ascending"}'
    ),
    "filter-workers-empty-filter-sort-desc": reqs_spec(
        sorter=b'{"Item":"state","Order":"descending"}'
    ),
    "filter-workers-empty2-filter": reqs_spec(b'{"Groups":null,"Capabilities":{}}'),
    "filter-workers-empty3-filter": reqs_spec(b'{"Groups":[],"Capabilities":null}'),
    "filter-workers-paginator-fwd1": reqs_spec(pag=pag('"0"', "forward", 2)),
    "filter-workers-paginator-fwd2": reqs_spec(pag=pag('"2"', "forward", 2)),
    "filter-workers-paginator-back1": reqs_spec(pag=pag('"4"', "backward", 2)),
    "filter-workers-paginator-back2": reqs_spec(pag=pag('"2"', "backward", 2)),
    "filter-workers-nomatch": reqs_spec(b'{"Groups":["Fern Flower"],"Capabilities":null}'),
    "filter-workers-bad-filter": reqs_spec(b'{"Groups":["Oops"],"Capabilities":null}'),
    "filter-workers-bad-sorter-item": reqs_spec(WORKERS_VALID_FILTER, BAD_SORTER),
    "filter-workers-malformed-json": MALFORMED_JSON,
}

# What Boruta's mocks return where that is not what the real listing gives:
# (page by ID/UUID, (total, remaining) or None when the mock gave no ListInfo).
MOCK_PAGES: dict[str, tuple[list[Any], tuple[int, int] | None]] = {
    "filter-reqs-valid-filter": ([1, 2], None),
    "filter-reqs-nomatch-all": ([], None),
    "filter-reqs-paginator-back1": ([3, 4], (4, 2)),
    "filter-reqs-paginator-back2": ([1, 2], (4, 0)),
    "filter-workers-paginator-fwd1": (["0", "1"], (4, 2)),
    "filter-workers-paginator-fwd2": (["2", "3"], (4, 0)),
    "filter-workers-paginator-back1": (["2", "3"], (4, 2)),
}
# The mocks' made-up failure for a filter they were told to refuse.
MOCK_ERRORS = {
    "filter-reqs-bad-filter": "foo bar: pizza failed",
    "filter-workers-bad-filter": "foo bar: pizza failed",
}


# ---------------------------------------------------------------- the handlers


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes | None
    headers: dict[str, str]


def answer(status: int, obj: Any = None, headers: dict[str, str] | None = None) -> Answer:
    return Answer(status, None if status == 204 else gojson.dumps(obj), headers or {})


def handle(run: Callable[[], Answer]) -> Answer:
    """Boruta's wrapper: an error is its status and `{"message": ...}`."""
    try:
        return run()
    except wire.WireError as exc:
        return Answer(exc.status, exc.body(), {})


def _req_page(name: str) -> Answer:
    spec = listing.parse_requests_list(LIST_BODIES[name])
    if name in MOCK_ERRORS:
        raise wire.invalid_request(MOCK_ERRORS[name])
    if name in MOCK_PAGES:
        ids, info = MOCK_PAGES[name]
        page = [r for rid in ids for r in REQS if r.id == rid]
        total, remaining = info if info else (None, None)
    else:
        page, total, remaining = listing.list_requests(
            REQS, spec.filter, spec.sorter, spec.paginator
        )
    return answer(
        200, [encode.req_info(r) for r in page], encode.list_headers(total, remaining, len(page))
    )


def _worker_page(name: str) -> Answer:
    spec = listing.parse_workers_list(LIST_BODIES[name])
    if name in MOCK_ERRORS:
        raise wire.invalid_request(MOCK_ERRORS[name])
    if name in MOCK_PAGES:
        uuids, info = MOCK_PAGES[name]
        page = [w for uuid in uuids for w in WORKERS if w.uuid == uuid]
        total, remaining = info if info else (None, None)
    else:
        page, total, remaining = listing.list_workers(
            WORKERS, spec.filter, spec.sorter, spec.paginator
        )
    return answer(
        200, [encode.worker_info(w) for w in page], encode.list_headers(total, remaining, len(page))
    )


def _missing_request(url_id: str) -> Answer:
    bodies.parse_req_id(url_id)
    raise wire.not_found("Request")  # the farm has no request 2 (3 for req-info)


def _missing_worker(uuid: str) -> Answer:
    bodies.parse_worker_uuid(uuid)
    raise wire.not_found("Worker")


def _new_req_valid() -> Answer:
    bodies.parse_new_request(VALID_REQ_JSON, now=NOW)
    return answer(201, encode.req_id(1))


def _update(url_id: str, body: bytes) -> Answer:
    spec = bodies.parse_update_request(body, bodies.parse_req_id(url_id))
    if spec.id != 1 and not spec.empty:
        raise wire.not_found("Request")
    bodies.check_update_request(spec, valid_req(), NOW)
    return answer(204)


def _req_info(req: Request) -> Answer:
    return answer(200, encode.req_info(req), encode.request_headers(req))


def _acquire_valid() -> Answer:
    bodies.parse_req_id("1")
    return answer(200, encode.access_info("127.0.0.1", 22, KEY_PEM, "wołchw"))


def _worker_info_valid() -> Answer:
    w = worker(bodies.parse_worker_uuid(VALID_UUID), IDLE, [], {})
    return answer(200, encode.worker_info(w), encode.worker_headers(w))


def _set_state(uuid: str, body: bytes) -> Answer:
    bodies.parse_worker_uuid(uuid)
    bodies.parse_set_state(body)
    if uuid == MISSING_UUID:
        raise wire.not_found("Worker")
    return Answer(202, wire.SET_STATE_BODY, {})


def _set_groups(uuid: str, body: bytes) -> Answer:
    bodies.parse_worker_uuid(uuid)
    bodies.parse_set_groups(body)
    if uuid == MISSING_UUID:
        raise wire.not_found("Worker")
    return answer(204)


def _version() -> Answer:
    return answer(200, encode.version("0.2.1"), encode.version_headers("0.2.1"))


def _bad(run: Callable[[], object]) -> Callable[[], Answer]:
    def call() -> Answer:
        run()
        raise AssertionError("expected a WireError")

    return call


CASES: dict[str, Callable[[], Answer]] = {
    "acquire-worker-bad-id": _bad(lambda: bodies.parse_req_id(INVALID_ID)),
    "acquire-worker-missing": lambda: _missing_request("2"),
    "acquire-worker-valid": _acquire_valid,
    "api-version": _version,
    "close-req-bad-id": _bad(lambda: bodies.parse_req_id(INVALID_ID)),
    "close-req-missing": lambda: _missing_request("2"),
    "close-req-valid": lambda: (bodies.parse_req_id("1"), answer(204))[1],
    "new-req-bad-prio": _bad(lambda: bodies.parse_new_request(BAD_PRIO_JSON, now=NOW)),
    "new-req-malformed-json": _bad(lambda: bodies.parse_new_request(MALFORMED_JSON, now=NOW)),
    "new-req-valid": _new_req_valid,
    "prolong-access-bad-id": _bad(lambda: bodies.parse_req_id(INVALID_ID)),
    "prolong-access-missing": lambda: _missing_request("2"),
    "prolong-access-valid": lambda: (bodies.parse_req_id("1"), answer(204))[1],
    "req-info": lambda: _req_info(valid_req()),
    "req-info-bad-id": _bad(lambda: bodies.parse_req_id(INVALID_ID)),
    "req-info-missing": lambda: _missing_request("3"),
    "req-info-running": lambda: _req_info(running_req()),
    "update-req-bad-id": _bad(lambda: bodies.parse_req_id(INVALID_ID)),
    "update-req-empty": lambda: _update("1", b""),
    "update-req-malformed-json": lambda: _update("1", MALFORMED_JSON),
    "update-req-mismatch": lambda: _update("2", UPDATE_VALID_JSON),
    "update-req-missing": lambda: _update("2", SET_PRIO_JSON),
    "update-req-prio": lambda: _update("1", SET_PRIO_JSON),
    "update-req-valid": lambda: _update("1", UPDATE_VALID_JSON),
    "worker-deregister-bad-uuid": _bad(lambda: bodies.parse_worker_uuid(INVALID_ID)),
    "worker-deregister-missing": lambda: _missing_worker(MISSING_UUID),
    "worker-deregister-valid": lambda: (bodies.parse_worker_uuid(VALID_UUID), answer(204))[1],
    "worker-info-bad-uuid": _bad(lambda: bodies.parse_worker_uuid(INVALID_ID)),
    "worker-info-missing": lambda: _missing_worker(MISSING_UUID),
    "worker-info-valid": _worker_info_valid,
    "worker-set-groups-bad-uuid": lambda: _set_groups(INVALID_ID, SET_GROUPS_JSON),
    "worker-set-groups-malformed-json": lambda: _set_groups(VALID_UUID, MALFORMED_JSON),
    "worker-set-groups-missing": lambda: _set_groups(MISSING_UUID, SET_GROUPS_JSON),
    "worker-set-groups-valid": lambda: _set_groups(VALID_UUID, SET_GROUPS_JSON),
    "worker-set-state-bad-uuid": lambda: _set_state(INVALID_ID, SET_STATE_JSON),
    "worker-set-state-malformed-json": lambda: _set_state(VALID_UUID, MALFORMED_JSON),
    "worker-set-state-missing": lambda: _set_state(MISSING_UUID, SET_STATE_JSON),
    "worker-set-state-valid": lambda: _set_state(VALID_UUID, SET_STATE_JSON),
}
for _name in LIST_BODIES:
    CASES[_name] = partial(_req_page if _name.startswith("filter-reqs-") else _worker_page, _name)

# The status each case answers (handlers_test.go).
_NO_CONTENT = {
    "close-req-valid",
    "prolong-access-valid",
    "update-req-prio",
    "update-req-valid",
    "worker-deregister-valid",
    "worker-set-groups-valid",
}
_BAD_REQUEST = (
    "-bad-id",
    "-bad-uuid",
    "-malformed-json",
    "-bad-prio",
    "-mismatch",
    "-bad-filter",
    "-bad-sorter-item",
    "update-req-empty",
)


def _status(name: str) -> int:
    if name == "new-req-valid":
        return 201
    if name == "worker-set-state-valid":
        return 202
    if name in _NO_CONTENT:
        return 204
    if name.endswith("-missing"):
        return 404
    if name.endswith(_BAD_REQUEST):
        return 400
    return 200


STATUS = {name: _status(name) for name in CASES}


def run_case(name: str) -> Answer:
    return handle(CASES[name])
