"""http/boruta/: Boruta's API v1 wire format, byte for byte against Boruta's golden
responses (`shared/boruta-ref/testdata/`), plus its JSON reading (Go's decoder and
messages), RFC 3339 times, and keyset paging of requests and workers."""

from __future__ import annotations

import json

import pytest

from evergraph.farm.model import (
    CANCELLED,
    DONE,
    FAILED,
    IDLE,
    IN_PROGRESS,
    MAINTENANCE,
    WAITING,
    Job,
    Request,
)
from evergraph.http.boruta import bodies, encode, gojson, gotime, listing, wire
from tests.kit import boruta_cases as cases
from tests.kit.boruta_cases import GOLDEN, NOW, REQS, WORKERS, request, worker

GOLDEN_NAMES = sorted(p.name.removesuffix(".headers") for p in GOLDEN.glob("*.headers"))


def test_golden_data_is_beside_the_repository() -> None:
    assert GOLDEN.is_dir(), f"{GOLDEN} is missing (shared/ should be beside the repository)"
    assert len(GOLDEN_NAMES) == 67
    assert set(GOLDEN_NAMES) == set(cases.CASES), "every golden case is rebuilt"


# ---------------------------------------------------------------- the golden cases


def _golden(name: str) -> tuple[bytes | None, dict[str, str]]:
    headers = {k: v[0] for k, v in json.loads((GOLDEN / f"{name}.headers").read_text()).items()}
    bodies = sorted(GOLDEN.glob(f"{name}-*.json"))
    return (bodies[0].read_bytes() if bodies else None), headers


@pytest.mark.parametrize("name", sorted(cases.CASES))
def test_golden_case(name: str) -> None:
    expected_body, expected_headers = _golden(name)
    got = cases.run_case(name)
    assert got.status == cases.STATUS[name]
    if got.status == 204:
        assert expected_body is None
        assert expected_headers == {}
        return
    assert got.body is not None
    assert expected_body is not None
    length = int(expected_headers["Content-Length"])
    # The files were written by Go's test with the body as sent; one of them has a
    # newline added by an editor (Content-Length says the body has none).
    assert expected_body[:length] == got.body
    assert expected_body[length:] in (b"", b"\n")
    headers = {"Content-Type": wire.CONTENT_TYPE, "Content-Length": str(len(got.body))}
    assert {**headers, **got.headers} == expected_headers


def test_stale_list_file_is_the_same_list() -> None:
    """list-reqs-all-GET.json (no test uses it any more) is the four requests."""
    assert (
        gojson.dumps([encode.req_info(r) for r in REQS])
        == (GOLDEN / "list-reqs-all-GET.json").read_bytes()
    )


# ------------------------------------------------- listing: the real semantics of the cases


@pytest.mark.parametrize(
    ("name", "ids", "total", "remaining"),
    [
        ("filter-reqs-valid-filter", [1, 2], 2, 0),
        ("filter-reqs-valid-filter-sort-asc", [1, 2], 2, 0),
        ("filter-reqs-valid-filter-sort-desc", [2, 1], 2, 0),
        ("filter-reqs-empty-json", [1, 2, 3, 4], 4, 0),
        ("filter-reqs-nil", [1, 2, 3, 4], 4, 0),
        ("filter-reqs-empty", [1, 2, 3, 4], 4, 0),
        ("filter-reqs-paginator-fwd1", [1, 2], 4, 2),
        ("filter-reqs-paginator-fwd2", [3, 4], 4, 0),
        # the mock made these two up: before 4 come 1, 2, 3; before 2 only 1
        ("filter-reqs-paginator-back1", [2, 3], 4, 1),
        ("filter-reqs-paginator-back2", [1], 4, 0),
        ("filter-reqs-nomatch-all", [], 0, 0),
        ("filter-reqs-bad-filter", [], 0, 0),  # Boruta lists nothing; the mock refused
    ],
)
def test_list_requests_of_the_cases(name: str, ids: list[int], total: int, remaining: int) -> None:
    spec = listing.parse_requests_list(cases.LIST_BODIES[name])
    page, got_total, got_remaining = listing.list_requests(
        REQS, spec.filter, spec.sorter, spec.paginator
    )
    assert ([r.id for r in page], got_total, got_remaining) == (ids, total, remaining)


@pytest.mark.parametrize(
    ("name", "uuids", "total", "remaining"),
    [
        ("filter-workers-valid-filter", ["2", "3"], 2, 0),
        ("filter-workers-empty-body", ["0", "1", "2", "3"], 4, 0),
        ("filter-workers-empty-filter", ["0", "1", "2", "3"], 4, 0),
        ("filter-workers-empty2-filter", ["0", "1", "2", "3"], 4, 0),
        ("filter-workers-empty3-filter", ["0", "1", "2", "3"], 4, 0),
        ("filter-workers-empty-filter-sort-asc", ["0", "1", "2", "3"], 4, 0),
        ("filter-workers-empty-filter-sort-desc", ["2", "0", "3", "1"], 4, 0),
        # the mock made fwd1/fwd2 up: after "0" come "1", "2"; after "2" only "3"
        ("filter-workers-paginator-fwd1", ["1", "2"], 4, 1),
        ("filter-workers-paginator-fwd2", ["3"], 4, 0),
        ("filter-workers-paginator-back2", ["0", "1"], 4, 0),
        ("filter-workers-nomatch", [], 0, 0),
        ("filter-workers-bad-filter", [], 0, 0),
    ],
)
def test_list_workers_of_the_cases(name: str, uuids: list[str], total: int, remaining: int) -> None:
    spec = listing.parse_workers_list(cases.LIST_BODIES[name])
    page, got_total, got_remaining = listing.list_workers(
        WORKERS, spec.filter, spec.sorter, spec.paginator
    )
    assert ([w.uuid for w in page], got_total, got_remaining) == (uuids, total, remaining)


def test_worker_paginator_naming_no_worker_is_404() -> None:
    spec = listing.parse_workers_list(cases.LIST_BODIES["filter-workers-paginator-back1"])
    with pytest.raises(wire.WireError) as caught:
        listing.list_workers(WORKERS, spec.filter, spec.sorter, spec.paginator)
    assert caught.value == wire.WireError(404, "worker not found")
    assert caught.value.body() == b'{"message":"worker not found"}'


def test_list_bodies_parse_as_boruta_reads_them() -> None:
    parse = listing.parse_requests_list
    assert parse(cases.LIST_BODIES["filter-reqs-valid-filter"]) == listing.RequestsListSpec(
        filter=listing.RequestsFilter(states=(WAITING,)), sorter=listing.Sorter()
    )
    assert parse(b"") == parse(b"null") == parse(b"  \n") == listing.RequestsListSpec()
    assert parse(cases.LIST_BODIES["filter-reqs-paginator-back1"]).paginator == (
        listing.RequestsPaginator(id=4, backward=True, limit=2)
    )
    assert parse(cases.LIST_BODIES["filter-reqs-bad-filter"]).filter == listing.RequestsFilter(
        priorities=(99,), states=("NOSUCHSTATE",)
    )
    assert parse(
        b'{"filter":{"priorities":[1,2],"states":[" waiting "]},"sorter":{"item":"ID",'
        b'"order":"DESCENDING"},"paginator":{"limit":0}}'
    ) == listing.RequestsListSpec(
        filter=listing.RequestsFilter(priorities=(1, 2), states=(WAITING,)),
        sorter=listing.Sorter(item="id", descending=True),
        paginator=listing.RequestsPaginator(limit=wire.MAX_PAGE_LIMIT),
    )
    workers = listing.parse_workers_list
    assert workers(
        cases.LIST_BODIES["filter-workers-valid-filter"]
    ).filter == listing.WorkersFilter(
        groups=("Malinowy Chruśniak",), caps={"architecture": "RISC-V"}
    )
    assert workers(cases.LIST_BODIES["filter-workers-empty3-filter"]) == listing.WorkersListSpec(
        filter=listing.WorkersFilter()
    )
    assert workers(cases.LIST_BODIES["filter-workers-paginator-fwd1"]).paginator == (
        listing.WorkersPaginator(id="0", limit=2)
    )


# ---------------------------------------------------------------- keyset paging


def _sixteen() -> list[Request]:
    """Boruta's TestListRequests queue: 16 requests, every second one a priority
    lower (9), all but the first two DONE."""
    return [
        request(i, priority=9 if i % 2 == 0 else 8, state=WAITING if i <= 2 else DONE)
        for i in range(1, 17)
    ]


DESC = listing.Sorter(item="id", descending=True)
LOWER = listing.RequestsFilter(priorities=(9,))


@pytest.mark.parametrize(
    ("flt", "sorter", "pag", "ids", "total", "remaining"),
    [
        (LOWER, DESC, listing.RequestsPaginator(5, True, 3), [10, 8, 6], 8, 3),
        (LOWER, DESC, listing.RequestsPaginator(4, True, 3), [10, 8, 6], 8, 3),
        (LOWER, DESC, listing.RequestsPaginator(5, False, 3), [4, 2], 8, 0),
        (None, DESC, listing.RequestsPaginator(5, False, 3), [4, 3, 2], 16, 1),
        (None, DESC, listing.RequestsPaginator(5, True, 3), [8, 7, 6], 16, 8),
        (None, None, listing.RequestsPaginator(5, True, 32), [1, 2, 3, 4], 16, 0),
        (None, None, listing.RequestsPaginator(5, False, 32), list(range(6, 17)), 16, 0),
        (None, None, listing.RequestsPaginator(5, False, 0), list(range(6, 17)), 16, 0),
        (None, DESC, listing.RequestsPaginator(1, False, 32), [], 16, 0),
        (None, DESC, listing.RequestsPaginator(16, True, 32), [], 16, 0),
        (None, None, listing.RequestsPaginator(0, True, 5), [12, 13, 14, 15, 16], 16, 11),
        (listing.RequestsFilter(states=(WAITING,)), DESC, None, [2, 1], 2, 0),
        (listing.RequestsFilter(ids=(0, 3, 6, 9, 12, 15)), None, None, [3, 6, 9, 12, 15], 5, 0),
        (
            listing.RequestsFilter(ids=(0, 3, 6, 9, 12, 15), priorities=(8,), states=(DONE,)),
            None,
            None,
            [3, 9, 15],
            3,
            0,
        ),
        (listing.RequestsFilter(), None, None, list(range(1, 17)), 16, 0),
        (listing.RequestsFilter(states=("INVALID",)), DESC, None, [], 0, 0),
    ],
)
def test_keyset_paging_as_boruta_pages(
    flt: listing.RequestsFilter | None,
    sorter: listing.Sorter | None,
    pag: listing.RequestsPaginator | None,
    ids: list[int],
    total: int,
    remaining: int,
) -> None:
    """Boruta's own expectations (requests_test.go TestListRequests): the page is
    after/before the paginator's request in the sorted list, which need not match
    the filter."""
    page, got_total, got_remaining = listing.list_requests(_sixteen(), flt, sorter, pag)
    assert ([r.id for r in page], got_total, got_remaining) == (ids, total, remaining)


def test_paging_walks_the_whole_list_both_ways() -> None:
    reqs = _sixteen()
    for sorter in (None, DESC, listing.Sorter("priority"), listing.Sorter("state", True)):
        everything = [r.id for r in listing.list_requests(reqs, None, sorter)[0]]
        seen: list[int] = []
        pid = 0
        while True:
            page, total, remaining = listing.list_requests(
                reqs, None, sorter, listing.RequestsPaginator(pid, False, 5)
            )
            seen += [r.id for r in page]
            assert (total, remaining) == (16, 16 - len(seen))
            if not remaining:
                break
            pid = page[-1].id
        assert seen == everything
        back: list[int] = []
        pid = 0
        while True:
            page, total, remaining = listing.list_requests(
                reqs, None, sorter, listing.RequestsPaginator(pid, True, 5)
            )
            back = [r.id for r in page] + back
            assert remaining == 16 - len(back)
            if not remaining:
                break
            pid = page[0].id
        assert back == everything


def test_list_defaults_and_limits() -> None:
    many = [request(i) for i in range(1, wire.MAX_PAGE_LIMIT + 9)]
    page, total, remaining = listing.list_requests(many)
    assert (len(page), total, remaining) == (wire.MAX_PAGE_LIMIT, wire.MAX_PAGE_LIMIT + 8, 8)
    assert listing.parse_requests_list(b'{"Paginator":{"Limit":65535}}').paginator == (
        listing.RequestsPaginator(limit=65535)
    )
    with pytest.raises(wire.WireError) as caught:
        listing.parse_requests_list(b'{"Paginator":{"Limit":65536}}')
    assert caught.value.message == (
        "invalid request: json: cannot unmarshal number 65536 into Go struct field "
        "RequestsPaginator.Paginator.Limit of type uint16"
    )
    with pytest.raises(wire.WireError) as caught:
        listing.list_requests(REQS, paginator=listing.RequestsPaginator(id=99))
    assert caught.value == wire.WireError(404, "request not found")


def test_sort_items() -> None:
    reqs = [
        request(1, priority=3, deadline=300.0, valid_after=30.0, state=WAITING),
        request(2, priority=1, deadline=100.0, valid_after=0.0, state=DONE),
        request(3, priority=3, deadline=200.0, valid_after=10.0, state=CANCELLED),
    ]

    def ids(item: str, desc: bool = False) -> list[int]:
        return [r.id for r in listing.list_requests(reqs, sorter=listing.Sorter(item, desc))[0]]

    assert ids("priority") == [2, 1, 3]
    assert ids("priority", True) == [3, 1, 2]
    assert ids("deadline") == [2, 3, 1]
    assert ids("validafter") == [2, 3, 1]  # unset (0) is Go's zero time: first
    assert ids("state") == [3, 2, 1]
    workers = [
        worker("b", MAINTENANCE, ["x", "y"], {}),
        worker("a", IDLE, ["x"], {}),
        worker("c", IDLE, [], {}),
    ]

    def uuids(item: str, desc: bool = False) -> list[str]:
        return [w.uuid for w in listing.list_workers(workers, sorter=listing.Sorter(item, desc))[0]]

    assert uuids("") == ["a", "b", "c"]
    assert uuids("groups") == ["c", "a", "b"]
    assert uuids("groups", True) == ["b", "a", "c"]
    assert uuids("state", True) == ["b", "c", "a"]
    for body, parse in (
        (b'{"Sorter":{"Item":"uuid"}}', listing.parse_requests_list),
        (b'{"Sorter":{"Item":"priority"}}', listing.parse_workers_list),
    ):
        with pytest.raises(wire.WireError) as caught:
            parse(body)
        assert caught.value == wire.invalid_request(wire.ERR_WRONG_SORT_ITEM)


def test_workers_filter_matches_groups_any_and_caps_all() -> None:
    flt = listing.WorkersFilter(groups=("Lędzianie",), caps={"architecture": "AArch64"})
    assert [w.uuid for w in listing.list_workers(WORKERS, flt)[0]] == ["0"]
    by_uuid = listing.WorkersFilter(caps={"UUID": "3"})
    assert [w.uuid for w in listing.list_workers(WORKERS, by_uuid)[0]] == ["3"]


# ---------------------------------------------------------------- encoders


def test_req_info_shape() -> None:
    req = request(
        7,
        priority=2,
        groups=["g"],
        caps={"b": "2", "a": "1"},
        valid_after=1.25,
        deadline=0.0,
        state=IN_PROGRESS,
        job=Job(worker="w", timeout=2.5),
    )
    assert gojson.dumps(encode.req_info(req)) == (
        b'{"ID":7,"Priority":2,"Owner":{"Groups":["g"]},"Deadline":"0001-01-01T00:00:00Z",'
        b'"ValidAfter":"1970-01-01T00:00:01.25Z","State":"IN PROGRESS",'
        b'"Job":{"WorkerUUID":"w","Timeout":"1970-01-01T00:00:02.5Z"},"Caps":{"a":"1","b":"2"}}'
    )
    assert encode.request_headers(req) == {
        "Boruta-Request-State": "IN PROGRESS",
        "Boruta-Job-Timeout": "1970-01-01T00:00:02Z",
    }
    assert encode.request_headers(request(1, state="IN_PROGRESS"))["Boruta-Request-State"] == (
        IN_PROGRESS
    )


def test_worker_info_shape() -> None:
    w = worker("u", FAILED, ["g2", "g1"], {"z": "1", "UUID": "u"})
    assert gojson.dumps(encode.worker_info(w)) == (
        b'{"WorkerUUID":"u","State":"FAILED","Groups":["g2","g1"],"Caps":{"UUID":"u","z":"1"}}'
    )
    assert encode.worker_headers(w) == {"Boruta-Worker-State": "FAILED"}


def test_access_info_addresses() -> None:
    assert encode.access_info("::1", 2222, "K", "u")["Addr"] == {
        "IP": "::1",
        "Port": 2222,
        "Zone": "",
    }
    assert encode.access_info("fe80::1%eth0", 22, "K", "u")["Addr"]["Zone"] == "eth0"
    assert encode.access_info("::ffff:10.0.0.1", 22, "K", "u")["Addr"]["IP"] == "10.0.0.1"
    assert encode.access_info("", 22, "K", "u")["Addr"]["IP"] == ""


def test_dumps_escapes_as_go() -> None:
    assert gojson.dumps({"s": '<a&b>\u2028\u2029\x01\n\t"\\ł\x7f'}) == (
        '{"s":"\\u003ca\\u0026b\\u003e\\u2028\\u2029\\u0001\\n\\t\\"\\\\ł\x7f"}'.encode()
    )
    assert gojson.dumps({"s": "\ud800"}) == '{"s":"\ufffd"}'.encode()
    assert gojson.dumps(None) == b"null"
    assert gojson.dumps([]) == b"[]"


def test_list_headers() -> None:
    assert encode.list_headers(4, 2, 2) == {
        "Boruta-List-Total": "4",
        "Boruta-List-Remaining": "2",
        "Boruta-List-Batch-Size": "2",
    }
    assert encode.list_headers(None, None, 0) == {"Boruta-List-Batch-Size": "0"}


# ---------------------------------------------------------------- times


@pytest.mark.parametrize(
    ("text", "seconds", "back"),
    [
        ("1970-01-01T00:00:01Z", 1.0, None),
        ("2222-12-31T00:00:00Z", 7983792000.0, None),
        ("1683-09-12T00:00:00Z", -9034848000.0, None),
        ("2100-01-01T04:05:06.500Z", 4102459506.5, "2100-01-01T04:05:06.5Z"),
        ("2100-01-01T05:05:06+01:00", 4102459506.0, "2100-01-01T04:05:06Z"),
        ("2100-01-01T03:35:06-00:30", 4102459506.0, "2100-01-01T04:05:06Z"),
        ("2024-02-29T23:59:59.123456789Z", 1709251199.123457, "2024-02-29T23:59:59.123457Z"),
        ("0001-01-01T00:00:00Z", 0.0, None),
        ("0001-01-01T01:00:00+01:00", 0.0, "0001-01-01T00:00:00Z"),
        ("0000-03-01T00:00:00Z", -62162035200.0, None),
        ("9999-12-31T23:59:59Z", 253402300799.0, None),
    ],
)
def test_times_round_trip(text: str, seconds: float, back: str | None) -> None:
    assert gotime.parse_time(text) == pytest.approx(seconds, abs=1e-6)
    assert gotime.format_time(gotime.parse_time(text)) == (back or text)


def test_time_header_has_whole_seconds() -> None:
    assert gotime.format_time_header(1.999) == "1970-01-01T00:00:01Z"
    assert gotime.format_time_header(0.0) == gotime.ZERO_TIME
    assert gotime.format_time(-0.5) == "1969-12-31T23:59:59.5Z"
    assert gotime.format_time(0.9999999) == "1970-01-01T00:00:01Z"
    with pytest.raises(ValueError, match="year outside"):
        gotime.format_time(gotime.parse_time("9999-12-31T23:59:59-01:00"))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("xyz", 'parsing time "xyz" as "2006-01-02T15:04:05Z07:00": cannot parse "xyz" as "2006"'),
        ("2100", 'parsing time "2100" as "2006-01-02T15:04:05Z07:00": cannot parse "" as "-"'),
        ("2100-13-01T00:00:00Z", 'parsing time "2100-13-01T00:00:00Z": month out of range'),
        ("2100-02-29T00:00:00Z", 'parsing time "2100-02-29T00:00:00Z": day out of range'),
        ("2100-01-01T24:00:00Z", 'parsing time "2100-01-01T24:00:00Z": hour out of range'),
        ("2100-01-01T00:60:00Z", 'parsing time "2100-01-01T00:60:00Z": minute out of range'),
        ("2100-01-01T00:00:60Z", 'parsing time "2100-01-01T00:00:60Z": second out of range'),
        (
            "2100-01-01T4:05:06Z",
            'parsing time "2100-01-01T4:05:06Z" as "2006-01-02T15:04:05Z07:00":'
            ' cannot parse "4" as "15"',
        ),
        (
            "2100-01-01T04:05:06,5Z",
            'parsing time "2100-01-01T04:05:06,5Z" as "2006-01-02T15:04:05Z07:00":'
            ' cannot parse "," as "."',
        ),
        (
            "2100-01-01 04:05:06Z",
            'parsing time "2100-01-01 04:05:06Z" as "2006-01-02T15:04:05Z07:00":'
            ' cannot parse " 04:05:06Z" as "T"',
        ),
        (
            "2100-01-01T04:05:06",
            'parsing time "2100-01-01T04:05:06" as "2006-01-02T15:04:05Z07:00":'
            ' cannot parse "" as "Z07:00"',
        ),
        (
            "2100-01-01T04:05:06z",
            'parsing time "2100-01-01T04:05:06z" as "2006-01-02T15:04:05Z07:00":'
            ' cannot parse "z" as "Z07:00"',
        ),
        ("2100-01-01T04:05:06Z ", 'parsing time "2100-01-01T04:05:06Z ": extra text: " "'),
        (
            "2100-01-01T04:05:06+24:00",
            'parsing time "2100-01-01T04:05:06+24:00": timezone hour out of range',
        ),
        (
            "2100-01-01T04:05:06+25:00",
            'parsing time "2100-01-01T04:05:06+25:00": time zone offset hour out of range',
        ),
        (
            "2100-01-01T04:05:06-00:60",
            'parsing time "2100-01-01T04:05:06-00:60": timezone minute out of range',
        ),
        (
            "2100-01-0ł",
            'parsing time "2100-01-0\\xc5\\x82" as "2006-01-02T15:04:05Z07:00":'
            ' cannot parse "0\\xc5\\x82" as "02"',
        ),
    ],
)
def test_bad_times_say_what_go_says(text: str, message: str) -> None:
    with pytest.raises(gotime.TimeError) as caught:
        gotime.parse_time(text)
    assert str(caught.value) == message


# ---------------------------------------------------------------- bodies


def test_new_request_body() -> None:
    spec = bodies.parse_new_request(cases.VALID_REQ_JSON, now=NOW)
    assert spec == bodies.NewRequestSpec(
        priority=8,
        caps={"architecture": "armv7l", "monitor": "yes"},
        valid_after=gotime.parse_time("2100-01-01T04:05:06Z"),
        deadline=gotime.parse_time("2200-12-31T01:02:03Z"),
    )
    assert bodies.parse_new_request(b'{"priority":3}') == bodies.NewRequestSpec(priority=3)
    assert bodies.parse_new_request(b'{"Priority":3} trailing garbage is never read') == (
        bodies.NewRequestSpec(priority=3)
    )
    assert bodies.parse_new_request(b'{"Priority":3,"priority":4,"Unknown":[1,{"x":null}]}') == (
        bodies.NewRequestSpec(priority=4)
    )


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"", "no body provided in HTTP request"),
        (b'{"Priority":0}', "invalid request: requested priority out of bounds"),
        (b'{"Priority":17}', "invalid request: requested priority out of bounds"),
        (
            b'{"Priority":1,"Deadline":"2020-01-01T00:00:00Z"}',
            "invalid request: deadline in the past",
        ),
        (
            b'{"Priority":99,"Deadline":"2100-01-01T00:00:00Z","ValidAfter":"2100-01-02T00:00:00Z"}',
            "invalid request: requested time range illegal - ValidAfter must be before Deadline",
        ),
        (
            b'{"Priority":-1}',
            "invalid request: json: cannot unmarshal number -1 into Go struct field "
            "ReqInfo.Priority of type boruta.Priority",
        ),
        (
            b'{"Priority":"1"}',
            "invalid request: json: cannot unmarshal string into Go struct field "
            "ReqInfo.Priority of type boruta.Priority",
        ),
        (
            b'{"Owner":{"Groups":"g"},"Priority":true}',
            "invalid request: json: cannot unmarshal string into Go struct field "
            "UserInfo.Owner.Groups of type boruta.Groups",
        ),
        (
            b'{"Priority":"x","Deadline":7}',
            "invalid request: Time.UnmarshalJSON: input is not a JSON string",
        ),
        (
            b'{"Deadline":"2100-01-01"}',
            'invalid request: parsing time "2100-01-01" as "2006-01-02T15:04:05Z07:00":'
            ' cannot parse "" as "T"',
        ),
        (
            b'{"Caps":{"a":1}}',
            "invalid request: json: cannot unmarshal number into Go struct field ReqInfo.Caps"
            " of type string",
        ),
        (
            b'{"Job":{"Timeout":"now"}}',
            'invalid request: parsing time "now" as "2006-01-02T15:04:05Z07:00":'
            ' cannot parse "now" as "2006"',
        ),
        (
            b"[]",
            "invalid request: json: cannot unmarshal array into Go value of type boruta.ReqInfo",
        ),
        (b"{", "invalid request: unexpected EOF"),
        (
            b'{"Priority":1,}',
            "invalid request: invalid character '}' looking for beginning of object key string",
        ),
        (
            b"{'Priority':1}",
            "invalid request: invalid character '\\'' looking for beginning of object key string",
        ),
        (b'{"Priority" 1}', "invalid request: invalid character '1' after object key"),
        (
            b'{"Priority":1 "x"}',
            "invalid request: invalid character '\"' after object key:value pair",
        ),
        (b'{"Priority":01}', "invalid request: invalid character '1' after object key:value pair"),
        (b'{"Caps":{"a":"\x01"}}', "invalid request: invalid character '\\x01' in string literal"),
        (b'{"Caps":{"a":"\\x"}}', "invalid request: invalid character 'x' in string escape code"),
        (
            b'{"Caps":{"a":"\\u00zz"}}',
            "invalid request: invalid character 'z' in \\u hexadecimal character escape",
        ),
        (
            b'{"Priority":nul}',
            "invalid request: invalid character '}' in literal null (expecting 'l')",
        ),
        (b'{"Priority":-}', "invalid request: invalid character '}' in numeric literal"),
        (
            b'{"Priority":1.}',
            "invalid request: invalid character '}' after decimal point in numeric literal",
        ),
        (
            b'{"Priority":1e}',
            "invalid request: invalid character '}' in exponent of numeric literal",
        ),
        (
            b'{"Owner":{"Groups":["a" "b"]}}',
            "invalid request: invalid character '\"' after array element",
        ),
        ("ł".encode(), "invalid request: invalid character 'Å' looking for beginning of value"),
        (b"\n\t", "no body provided in HTTP request"),
    ],
)
def test_bad_new_request_bodies(body: bytes, message: str) -> None:
    with pytest.raises(wire.WireError) as caught:
        bodies.parse_new_request(body, now=NOW)
    assert caught.value.status == 400
    assert caught.value.message == message


def test_strings_decode_as_go() -> None:
    spec = bodies.parse_new_request(
        b'{"Priority":1,"Caps":{"k":"a\\"b\\\\c\\/d\\n\\u0142\\ud83d\\ude00\\ud800x"}}'
    )
    assert spec.caps == {"k": 'a"b\\c/d\nł😀\ufffdx'}
    # a null value in a map of strings is the empty string, as in Go
    assert bodies.parse_new_request(b'{"Priority":1,"Caps":{"k":null}}').caps == {"k": ""}


def test_update_request_body() -> None:
    assert bodies.parse_update_request(b'{"Priority":4}', 1) == bodies.UpdateSpec(id=1, priority=4)
    assert bodies.parse_update_request(cases.UPDATE_VALID_JSON, 1) == bodies.UpdateSpec(
        id=1, priority=4
    )
    assert bodies.parse_update_request(b'{"ID":0,"Deadline":"2100-01-01T00:00:00Z"}', 9) == (
        bodies.UpdateSpec(id=9, deadline=gotime.parse_time("2100-01-01T00:00:00Z"))
    )
    assert bodies.parse_update_request(b"{}", 9).empty
    with pytest.raises(wire.WireError) as caught:
        bodies.parse_update_request(b'{"ID":2}', 1)
    assert caught.value == wire.invalid_request(wire.ID_MISMATCH)


def test_check_update_request_in_boruta_order() -> None:
    waiting = request(1, priority=8, valid_after=NOW, deadline=NOW + 3600)
    later = NOW + 7200
    check = bodies.check_update_request
    assert check(bodies.UpdateSpec(1), request(1, state=DONE), NOW) is False  # nothing to do
    assert (
        check(bodies.UpdateSpec(1, priority=8, valid_after=NOW, deadline=NOW + 3600), waiting, NOW)
        is False
    )
    assert check(bodies.UpdateSpec(1, priority=2), waiting, NOW) is True
    for spec, req, message in [
        (bodies.UpdateSpec(1, priority=2), request(1, state=DONE), wire.ERR_MODIFICATION_FORBIDDEN),
        (bodies.UpdateSpec(1, priority=17, deadline=NOW - 1), waiting, wire.ERR_PRIORITY),
        (
            bodies.UpdateSpec(1, deadline=NOW - 1, valid_after=later),
            waiting,
            wire.ERR_DEADLINE_IN_THE_PAST,
        ),
        (bodies.UpdateSpec(1, valid_after=later), waiting, wire.ERR_INVALID_TIME_RANGE),
        (
            bodies.UpdateSpec(1, valid_after=later + 1, deadline=later),
            waiting,
            wire.ERR_INVALID_TIME_RANGE,
        ),
    ]:
        with pytest.raises(wire.WireError) as caught:
            check(spec, req, NOW)
        assert caught.value == wire.invalid_request(message)
    assert check(bodies.UpdateSpec(1, valid_after=later, deadline=later + 1), waiting, NOW) is True


def test_set_state_and_groups_bodies() -> None:
    assert bodies.parse_set_state(b'{"WorkerState":"MAINTENANCE"}') == MAINTENANCE
    assert bodies.parse_set_state(b'{"workerstate":"IDLE"}') == IDLE
    for body in (b'{"WorkerState":"RUNNING"}', b"{}", b"null"):
        with pytest.raises(wire.WireError) as caught:
            bodies.parse_set_state(body)
        assert caught.value == wire.invalid_request(wire.ERR_WRONG_STATE_ARGUMENT)
    assert bodies.parse_set_groups(b'["a","b"]') == ["a", "b"]
    assert bodies.parse_set_groups(b"null") == []
    assert bodies.parse_set_groups(b"[]") == []
    for body, message in [
        (b'{"a":1}', "json: cannot unmarshal object into Go value of type boruta.Groups"),
        (b'["a",1]', "json: cannot unmarshal number into Go value of type boruta.Group"),
    ]:
        with pytest.raises(wire.WireError) as caught:
            bodies.parse_set_groups(body)
        assert caught.value == wire.invalid_request(message)
    with pytest.raises(wire.WireError) as caught:
        bodies.parse_set_groups(b"")
    assert caught.value == wire.no_body()


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"Sorter":{"Order":"up"}}', wire.ERR_WRONG_SORT_ORDER),
        (b'{"Paginator":{"Direction":"sideways"}}', wire.ERR_WRONG_LIST_DIRECTION),
        (
            b'{"Sorter":{"Order":true}}',
            "json: cannot unmarshal bool into Go struct field SortInfo.Sorter.Order"
            " of type boruta.SortOrder",
        ),
        (
            b'{"Filter":{"IDs":["1"]}}',
            "json: cannot unmarshal string into Go struct field Requests.Filter.IDs"
            " of type boruta.ReqID",
        ),
        (
            b'{"Filter":[]}',
            "json: cannot unmarshal array into Go struct field RequestsListSpec.Filter"
            " of type filter.Requests",
        ),
        (b'{"Filter":{"Priorities":"Y!=="}}', "illegal base64 data at input byte 1"),
        (b"7", "json: cannot unmarshal number into Go value of type http.RequestsListSpec"),
    ],
)
def test_bad_requests_list_bodies(body: bytes, message: str) -> None:
    with pytest.raises(wire.WireError) as caught:
        listing.parse_requests_list(body)
    assert caught.value == wire.invalid_request(message)


def test_list_order_and_direction_spellings() -> None:
    for order, desc in (("", False), ("Ascending", False), ("DESCENDING", True), ("desc", True)):
        body = f'{{"Sorter":{{"Item":"state","Order":"{order}"}}}}'.encode()
        assert listing.parse_workers_list(body).sorter == listing.Sorter("state", desc)
    for direction, backward in (("", False), ("Forward", False), ("BACKWARD", True)):
        body = f'{{"Paginator":{{"ID":"x","Direction":"{direction}"}}}}'.encode()
        assert listing.parse_workers_list(body).paginator == listing.WorkersPaginator("x", backward)
    with pytest.raises(wire.WireError) as caught:
        listing.parse_workers_list(b'{"Filter":{"Capabilities":[]}}')
    assert caught.value == wire.invalid_request(
        "json: cannot unmarshal array into Go struct field Workers.Filter.Capabilities"
        " of type boruta.Capabilities"
    )


def test_url_parameters() -> None:
    assert bodies.parse_req_id("007") == 7
    assert bodies.parse_req_id(str(2**64 - 1)) == 2**64 - 1
    for bad in ("", "-1", "+1", "1.0", " 1", str(2**64), "\u0661"):
        with pytest.raises(wire.WireError) as caught:
            bodies.parse_req_id(bad)
        assert caught.value == wire.WireError(
            400, "invalid request: ID provided in URL isn't valid"
        )
    assert bodies.parse_worker_uuid(cases.VALID_UUID) == cases.VALID_UUID
    for bad in (cases.VALID_UUID.upper(), cases.VALID_UUID + "\n", "test", ""):
        with pytest.raises(wire.WireError) as caught:
            bodies.parse_worker_uuid(bad)
        assert caught.value.message == "invalid request: ID provided in URL isn't valid UUID"


def test_wire_errors() -> None:
    assert wire.not_found("Request").body() == b'{"message":"Request not found"}'
    assert wire.not_found("Worker").status == 404
    assert (
        wire.invalid_request("x <y>").body() == b'{"message":"invalid request: x \\u003cy\\u003e"}'
    )
    assert wire.no_body() == wire.WireError(400, "no body provided in HTTP request")
    assert wire.error("m") == {"message": "m"}
