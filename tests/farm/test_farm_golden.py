"""Boruta's golden responses reproduced through the real routes on the real farm (the
shipped memory World, an admin token): the cases whose answer comes from the farm
itself (unknown ids, refused input, the statuses of valid moves). The byte-level
encoding of every golden case is checked in test_boruta_wire.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import pytest

from evergraph.cli.runner import check_fragment
from evergraph.cluster.hostkeys import HostKeys
from evergraph.farm import model, tokens
from evergraph.farm.service import Farm, encode, worker_key
from evergraph.farm.signed import FarmTrust
from evergraph.http.app import create_app
from evergraph.http.farm_api import FarmApi
from evergraph.world.memory import MemoryKV, MemoryStore
from tests.kit.boruta_cases import (
    BAD_PRIO_JSON,
    GOLDEN,
    INVALID_ID,
    MALFORMED_JSON,
    MISSING_UUID,
    SET_GROUPS_JSON,
    SET_PRIO_JSON,
    SET_STATE_JSON,
    UPDATE_VALID_JSON,
    VALID_REQ_JSON,
    VALID_UUID,
)

Setup = Callable[[Farm], Awaitable[None]]


async def _nothing(_: Farm) -> None:
    return None


async def _one_request(farm: Farm) -> None:
    admin = tokens.User(name="root", admin=True)
    await farm.new_request(admin, priority=8)


async def _worker(farm: Farm) -> None:
    w = model.register_worker(
        uuid=VALID_UUID, caps={}, address="127.0.0.1", port=22, username="t", now=0.0
    )
    key = worker_key(VALID_UUID)
    await farm.kv.put(key, farm.trust.seal(key, encode(w)))


# (golden name, method, path, body, set-up)
CASES: list[tuple[str, str, str, bytes, Setup]] = [
    ("new-req-valid", "POST", "/api/v1/reqs/", VALID_REQ_JSON, _nothing),
    ("new-req-malformed-json", "POST", "/api/v1/reqs/", MALFORMED_JSON, _nothing),
    ("new-req-bad-prio", "POST", "/api/v1/reqs/", BAD_PRIO_JSON, _nothing),
    ("req-info-missing", "GET", "/api/v1/reqs/2", b"", _nothing),
    ("req-info-bad-id", "GET", f"/api/v1/reqs/{INVALID_ID}", b"", _nothing),
    ("close-req-valid", "POST", "/api/v1/reqs/1/close", b"", _one_request),
    ("close-req-missing", "POST", "/api/v1/reqs/2/close", b"", _nothing),
    ("close-req-bad-id", "POST", f"/api/v1/reqs/{INVALID_ID}/close", b"", _nothing),
    ("acquire-worker-missing", "POST", "/api/v1/reqs/2/acquire_worker", b"", _nothing),
    ("acquire-worker-bad-id", "POST", f"/api/v1/reqs/{INVALID_ID}/acquire_worker", b"", _nothing),
    ("prolong-access-missing", "POST", "/api/v1/reqs/2/prolong", b"", _nothing),
    ("prolong-access-bad-id", "POST", f"/api/v1/reqs/{INVALID_ID}/prolong", b"", _nothing),
    ("update-req-valid", "POST", "/api/v1/reqs/1", UPDATE_VALID_JSON, _one_request),
    ("update-req-prio", "POST", "/api/v1/reqs/1", SET_PRIO_JSON, _one_request),
    ("update-req-missing", "POST", "/api/v1/reqs/2", SET_PRIO_JSON, _nothing),
    ("update-req-bad-id", "POST", f"/api/v1/reqs/{INVALID_ID}", SET_PRIO_JSON, _nothing),
    ("update-req-malformed-json", "POST", "/api/v1/reqs/1", MALFORMED_JSON, _one_request),
    ("update-req-mismatch", "POST", "/api/v1/reqs/2", UPDATE_VALID_JSON, _nothing),
    ("worker-info-missing", "GET", f"/api/v1/workers/{MISSING_UUID}", b"", _nothing),
    ("worker-info-bad-uuid", "GET", f"/api/v1/workers/{INVALID_ID}", b"", _nothing),
    (
        "worker-set-state-valid",
        "POST",
        f"/api/v1/workers/{VALID_UUID}/setstate",
        SET_STATE_JSON,
        _worker,
    ),
    (
        "worker-set-state-missing",
        "POST",
        f"/api/v1/workers/{MISSING_UUID}/setstate",
        SET_STATE_JSON,
        _nothing,
    ),
    (
        "worker-set-state-bad-uuid",
        "POST",
        f"/api/v1/workers/{INVALID_ID}/setstate",
        SET_STATE_JSON,
        _nothing,
    ),
    (
        "worker-set-state-malformed-json",
        "POST",
        f"/api/v1/workers/{VALID_UUID}/setstate",
        MALFORMED_JSON,
        _worker,
    ),
    (
        "worker-set-groups-valid",
        "POST",
        f"/api/v1/workers/{VALID_UUID}/setgroups",
        SET_GROUPS_JSON,
        _worker,
    ),
    (
        "worker-set-groups-missing",
        "POST",
        f"/api/v1/workers/{MISSING_UUID}/setgroups",
        SET_GROUPS_JSON,
        _nothing,
    ),
    (
        "worker-set-groups-bad-uuid",
        "POST",
        f"/api/v1/workers/{INVALID_ID}/setgroups",
        SET_GROUPS_JSON,
        _nothing,
    ),
    (
        "worker-set-groups-malformed-json",
        "POST",
        f"/api/v1/workers/{VALID_UUID}/setgroups",
        MALFORMED_JSON,
        _worker,
    ),
    ("worker-deregister-valid", "POST", f"/api/v1/workers/{VALID_UUID}/deregister", b"", _worker),
    (
        "worker-deregister-missing",
        "POST",
        f"/api/v1/workers/{MISSING_UUID}/deregister",
        b"",
        _nothing,
    ),
    (
        "worker-deregister-bad-uuid",
        "POST",
        f"/api/v1/workers/{INVALID_ID}/deregister",
        b"",
        _nothing,
    ),
]


def _golden(name: str, method: str) -> tuple[bytes | None, dict[str, str]]:
    body_file = GOLDEN / f"{name}-{method}.json"
    headers = json.loads((GOLDEN / f"{name}.headers").read_text())
    body = body_file.read_bytes() if body_file.exists() else None
    return body, {k.lower(): v[0] for k, v in headers.items()}


@pytest.mark.parametrize(
    ("name", "method", "path", "body", "setup"), CASES, ids=[c[0] for c in CASES]
)
def test_golden_through_the_routes(
    name: str, method: str, path: str, body: bytes, setup: Setup, tmp_path: Path
) -> None:
    want_body, want_headers = _golden(name, method)

    async def main() -> httpx.Response:
        kv = MemoryKV(MemoryStore())
        trust = FarmTrust(HostKeys(tmp_path), "srv")
        token = await tokens.create(kv, "root", [], admin=True, keys=trust.keys)
        farm = Farm(kv, trust=trust)
        await setup(farm)
        app = create_app(lambda: (), FarmApi(farm))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://farm") as c:
            headers = {"Authorization": f"Bearer {token}"}
            return await c.request(method, path, content=body, headers=headers)

    r = asyncio.run(main())
    got_headers = {k.lower(): v for k, v in r.headers.items()}
    if want_body is None:  # 204: no body, no content headers
        assert r.status_code in (202, 204)
        assert r.content == b""
    else:
        assert r.content == want_body
    assert got_headers == want_headers
    golden_status = {
        "new-req-valid": 201,
        "worker-set-state-valid": 202,
    }.get(name, 204 if want_body is None else (404 if "missing" in name else 400))
    assert r.status_code == golden_status


def test_the_golden_folder_is_there() -> None:
    assert GOLDEN.is_dir(), f"{GOLDEN}: shared/boruta-ref must sit beside the repository"
    assert len(list(Path(GOLDEN).glob("*.headers"))) > 60


def test_farm_anonymous_serves_tokenless_clients_as_a_plain_user(tmp_path: Path) -> None:
    async def main() -> list[int]:
        kv = MemoryKV(MemoryStore())
        farm = Farm(kv, trust=FarmTrust(HostKeys(tmp_path), "srv"))
        await _worker(farm)
        app = create_app(lambda: (), FarmApi(farm, anonymous="lab"))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://farm") as c:
            r1 = await c.get("/api/v1/workers/")
            r2 = await c.post("/api/v1/reqs/", content=b'{"Priority":3}')
            path = f"/api/v1/workers/{VALID_UUID}/setstate"
            r3 = await c.post(path, content=SET_STATE_JSON)  # admin only
            r4 = await c.get("/api/v1/reqs/1", headers={"Authorization": "Bearer egt_bad"})
        req = await farm.request(tokens.User(name="root", admin=True), 1)
        assert (req.owner, req.groups) == ("anonymous", ["lab"])
        return [r1.status_code, r2.status_code, r3.status_code, r4.status_code]

    assert asyncio.run(main()) == [200, 201, 403, 401]


def test_a_request_may_carry_a_graph_fragment_which_must_load(tmp_path: Path) -> None:
    async def main() -> list[tuple[int, str]]:
        kv = MemoryKV(MemoryStore())
        trust = FarmTrust(HostKeys(tmp_path), "srv")
        token = await tokens.create(kv, "alice", [], admin=False, keys=trust.keys, fragment=True)
        farm = Farm(kv, trust=trust)
        app = create_app(lambda: (), FarmApi(farm, check_fragment=check_fragment))
        out = []
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://farm") as c:
            headers = {"Authorization": f"Bearer {token}"}
            for fragment in (
                "resources:\n  noop:\n  - name: n\n",
                "resources:\n  nosuchkind:\n  - name: n\n",
            ):
                body = json.dumps({"Priority": 3, "Fragment": fragment})
                r = await c.post("/api/v1/reqs/", content=body, headers=headers)
                out.append((r.status_code, r.text))
        req = await farm.request(tokens.User(name="alice"), 1)
        assert req.fragment == "resources:\n  noop:\n  - name: n\n"
        return out

    (ok, _), (bad, message) = asyncio.run(main())
    assert ok == 201
    assert bad == 400
    assert "invalid request: Fragment:2:3" in message
    assert "unknown resource kind 'nosuchkind'" in message


def test_a_fragment_is_refused_where_the_api_was_given_no_way_to_check_it(
    tmp_path: Path,
) -> None:
    async def main() -> tuple[int, str, list[int]]:
        kv = MemoryKV(MemoryStore())
        trust = FarmTrust(HostKeys(tmp_path), "srv")
        token = await tokens.create(kv, "alice", [], admin=False, keys=trust.keys, fragment=True)
        farm = Farm(kv, trust=trust)
        app = create_app(lambda: (), FarmApi(farm))  # no check_fragment
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://farm") as c:
            headers = {"Authorization": f"Bearer {token}"}
            body = json.dumps({"Priority": 3, "Fragment": "resources:\n  noop:\n  - name: n\n"})
            r = await c.post("/api/v1/reqs/", content=body, headers=headers)
        listed = await farm.requests(tokens.User(name="alice"))
        return r.status_code, r.text, [q.id for q in listed]

    status, message, ids = asyncio.run(main())
    assert status == 400
    assert "invalid request: Fragment: this server cannot check graph fragments" in message
    assert ids == []  # nothing was written
