"""The farm's HTTP API v1, wire-compatible with Boruta's (`http/boruta/` holds the
wire format; `farm/service.py` the operations), plus what no Boruta client trips
over: bearer-token auth (401/403), users seeing only their own requests, server-sent
events of request and worker changes, and an OpenAPI document.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.requests import Request as HttpRequest
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from evergraph.errors import InputError
from evergraph.farm import model, tokens
from evergraph.farm.service import (
    REQS,
    WORKERS,
    Farm,
    Forbidden,
    NotFound,
)
from evergraph.farm.tokens import User
from evergraph.http import limits
from evergraph.http.boruta import bodies, encode, gojson, listing, wire
from evergraph.http.boruta.wire import WireError
from evergraph.world.follow import SimpleFollower, follow
from evergraph.world.kv import KeyValue, WorldError

T = TypeVar("T")

log = logging.getLogger("evergraph.http")

Handler = Callable[[HttpRequest], Awaitable[Response]]
#: loads a request's graph fragment as the worker will (raises InputError if it
#: would not): the frontends' business, handed in by the CLI (http imports no frontend)
FragmentCheck = Callable[[str], None]


def _json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(gojson.dumps(obj), status, headers, media_type="application/json")


async def _parsed(request: HttpRequest, parse: Callable[..., T], *args: Any) -> T:
    """`parse(body, *args)`: in a thread for a large body (the pure-Python reader
    takes ~1 s a MiB, and the loop must keep its turns: leases, watches, health)."""
    body = await request.body()
    if len(body) > limits.PARSE_IN_THREAD:
        return await asyncio.to_thread(parse, body, *args)
    return parse(body, *args)


def _error(status: int, message: str) -> Response:
    return _json(wire.error(message), status)


class FarmApi:
    """The routes over one `Farm`. `anonymous`: serve tokenless (legacy Boruta)
    clients as a non-admin user of that group (`--farm-anonymous GROUP`).
    `check_fragment`: how a request's graph fragment is checked before it is
    accepted (None: a request with a fragment is refused, 400)."""

    def __init__(
        self,
        farm: Farm | None,
        anonymous: str | None = None,
        check_fragment: FragmentCheck | None = None,
    ) -> None:
        self.farm = farm
        self.anonymous = anonymous
        self.check_fragment = check_fragment
        self.failures = limits.AuthFailures()

    async def _user(self, request: HttpRequest) -> User:
        assert self.farm is not None
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if not auth:
            if self.anonymous is not None:
                return User(name="anonymous", groups=[self.anonymous])
            raise WireError(401, "unauthorized: give Authorization: Bearer TOKEN")
        if scheme.lower() != "bearer" or not token.strip():
            raise WireError(401, "unauthorized: give Authorization: Bearer TOKEN")
        address = request.client.host if request.client is not None else "?"
        wait = self.failures.blocked(address, token.strip())
        if wait:
            raise WireError(429, f"too many failed token attempts: try again in {wait:.0f} s")
        user = await tokens.lookup(self.farm.kv, token.strip(), self.farm.trust)
        if user is None:
            self.failures.failed(address, token.strip())
            raise WireError(401, "unauthorized: unknown token")
        return user

    def _wrap(self, fn: Callable[[HttpRequest, Farm, User], Awaitable[Response]]) -> Handler:
        async def handler(request: HttpRequest) -> Response:
            if self.farm is None:
                return _error(503, "this agent has no World: the farm is not served here")
            try:
                user = await self._user(request)
                return await fn(request, self.farm, user)
            except WireError as e:
                return Response(e.body(), e.status, media_type="application/json")
            except model.Refused as e:
                return _error(400, f"invalid request: {e.reason}")
            except NotFound as e:
                return _error(404, f"{e.what.capitalize()} not found")  # Boruta's words
            except Forbidden as e:
                return _error(403, str(e))
            except WorldError as e:
                log.warning("farm API: %s", e)
                return _error(503, f"the World is not available: {e}")

        return handler

    # -- requests -------------------------------------------------------------------------
    async def new_request(self, request: HttpRequest, farm: Farm, user: User) -> Response:
        spec = await _parsed(request, bodies.parse_new_request, farm.clock.time())
        if spec.fragment:
            farm.may_send_fragment(user)  # 403 before anything of it is read
            _check_fragment(spec.fragment, self.check_fragment)
        rid = await farm.new_request(
            user,
            priority=spec.priority,
            caps=spec.caps,
            valid_after=spec.valid_after,
            deadline=spec.deadline,
            fragment=spec.fragment or None,
        )
        return _json(encode.req_id(rid), 201)

    async def list_requests(self, request: HttpRequest, farm: Farm, user: User) -> Response:
        spec = await _parsed(request, listing.parse_requests_list)
        items = await farm.requests(user)
        page, total, remaining = listing.list_requests(
            items, spec.filter, spec.sorter, spec.paginator
        )
        body = [encode.req_info(r) for r in page]
        return _json(body, 200, encode.list_headers(total, remaining, len(page)))

    async def request_info(self, request: HttpRequest, farm: Farm, user: User) -> Response:
        rid = bodies.parse_req_id(request.path_params["id"])
        r = await farm.request(user, rid)
        return _json(encode.req_info(r), 200, encode.request_headers(r))

    async def update_request(self, request: HttpRequest, farm: Farm, user: User) -> Response:
        rid = bodies.parse_req_id(request.path_params["id"])
        spec = await _parsed(request, bodies.parse_update_request, rid)
        if spec.empty:
            return Response(status_code=204)  # as Boruta: no change, no lookup
        # Boruta's checks and messages first, then the model's own
        if not bodies.check_update_request(spec, await farm.request(user, rid), farm.clock.time()):
            return Response(status_code=204)
        await farm.update_request(
            user,
            rid,
            priority=spec.priority,
            valid_after=spec.valid_after,
            deadline=spec.deadline,
        )
        return Response(status_code=204)

    async def close_request(self, request: HttpRequest, farm: Farm, user: User) -> Response:
        await farm.close_request(user, bodies.parse_req_id(request.path_params["id"]))
        return Response(status_code=204)

    async def acquire(self, request: HttpRequest, farm: Farm, user: User) -> Response:
        rid = bodies.parse_req_id(request.path_params["id"])
        wait_text = request.query_params.get("wait")
        try:
            wait = float(wait_text) if wait_text is not None else None
        except ValueError:
            raise wire.invalid_request(f"wait {wait_text!r} is not a number of seconds") from None
        access = await farm.acquire(user, rid, wait)
        return _json(encode.access_info(access.ip, access.port, access.key, access.username))

    async def prolong(self, request: HttpRequest, farm: Farm, user: User) -> Response:
        await farm.prolong(user, bodies.parse_req_id(request.path_params["id"]))
        return Response(status_code=204)

    # -- workers ----------------------------------------------------------------------------
    async def workers_all(self, request: HttpRequest, farm: Farm, user: User) -> Response:
        page, total, remaining = listing.list_workers(await farm.workers())
        body = [encode.worker_info(w) for w in page]
        return _json(body, 200, encode.list_headers(total, remaining, len(page)))

    async def list_workers(self, request: HttpRequest, farm: Farm, user: User) -> Response:
        spec = await _parsed(request, listing.parse_workers_list)
        page, total, remaining = listing.list_workers(
            await farm.workers(), spec.filter, spec.sorter, spec.paginator
        )
        body = [encode.worker_info(w) for w in page]
        return _json(body, 200, encode.list_headers(total, remaining, len(page)))

    async def worker_info(self, request: HttpRequest, farm: Farm, user: User) -> Response:
        w = await farm.worker(bodies.parse_worker_uuid(request.path_params["uuid"]))
        return _json(encode.worker_info(w), 200, encode.worker_headers(w))

    async def set_state(self, request: HttpRequest, farm: Farm, user: User) -> Response:
        uuid = bodies.parse_worker_uuid(request.path_params["uuid"])
        state = await _parsed(request, bodies.parse_set_state)
        await farm.set_state(user, uuid, state)
        return Response(wire.SET_STATE_BODY, 202, media_type="application/json")

    async def set_groups(self, request: HttpRequest, farm: Farm, user: User) -> Response:
        uuid = bodies.parse_worker_uuid(request.path_params["uuid"])
        groups = await _parsed(request, bodies.parse_set_groups)
        await farm.set_groups(user, uuid, groups)
        return Response(status_code=204)

    async def deregister(self, request: HttpRequest, farm: Farm, user: User) -> Response:
        await farm.deregister(user, bodies.parse_worker_uuid(request.path_params["uuid"]))
        return Response(status_code=204)

    # -- additions ------------------------------------------------------------------------------
    async def events(self, request: HttpRequest, farm: Farm, user: User) -> Response:
        """Server-sent events: `request` and `worker` changes as they happen (a user
        sees their own requests' only); the first events are the current state."""
        queue: asyncio.Queue[tuple[str, dict[str, Any]]] = asyncio.Queue(maxsize=10000)

        def on_request(kv: KeyValue) -> None:
            r = farm.trusted_request(kv)  # an untrusted record is no event
            if r is not None and (user.admin or r.owner == user.name):
                queue.put_nowait(("request", encode.req_info(r)))

        def on_worker(kv: KeyValue) -> None:
            w = farm.trusted_worker(kv)
            if w is not None:
                queue.put_nowait(("worker", encode.worker_info(w)))

        async def stream() -> AsyncIterator[bytes]:
            async with asyncio.TaskGroup() as tg:
                tasks = [
                    tg.create_task(
                        follow(farm.kv, REQS, SimpleFollower(on_new_updated=on_request))
                    ),
                    tg.create_task(
                        follow(farm.kv, WORKERS, SimpleFollower(on_new_updated=on_worker))
                    ),
                ]
                try:
                    yield b": evergraph farm events\n\n"
                    while True:
                        kind, obj = await queue.get()
                        yield f"event: {kind}\ndata: {json.dumps(obj)}\n\n".encode()
                finally:
                    for t in tasks:
                        t.cancel()

        return StreamingResponse(stream(), media_type="text/event-stream")

    def routes(self) -> list[Route]:
        w = self._wrap
        post, get = ["POST"], ["GET"]
        return [
            Route("/api/v1/version", version, methods=get),
            Route("/api/v1/openapi.json", openapi, methods=get),
            Route("/api/v1/reqs/", w(self.new_request), methods=post),
            Route("/api/v1/reqs/list", w(self.list_requests), methods=post),
            Route("/api/v1/reqs/{id}", w(self.request_info), methods=get),
            Route("/api/v1/reqs/{id}", w(self.update_request), methods=post),
            Route("/api/v1/reqs/{id}/close", w(self.close_request), methods=post),
            Route("/api/v1/reqs/{id}/acquire_worker", w(self.acquire), methods=post),
            Route("/api/v1/reqs/{id}/prolong", w(self.prolong), methods=post),
            Route("/api/v1/workers/", w(self.workers_all), methods=get),
            Route("/api/v1/workers/list", w(self.list_workers), methods=post),
            Route("/api/v1/workers/{uuid}", w(self.worker_info), methods=get),
            Route("/api/v1/workers/{uuid}/setstate", w(self.set_state), methods=post),
            Route("/api/v1/workers/{uuid}/setgroups", w(self.set_groups), methods=post),
            Route("/api/v1/workers/{uuid}/deregister", w(self.deregister), methods=post),
            Route("/api/v1/events", w(self.events), methods=get),
        ]


def _check_fragment(text: str, check: FragmentCheck | None) -> None:
    """A request's graph fragment must load here, as it will on the worker (400)."""
    if len(text) > 256 * 1024:
        raise wire.invalid_request("Fragment: at most 256 KiB")
    if check is None:
        raise wire.invalid_request("Fragment: this server cannot check graph fragments")
    try:
        check(text)
    except InputError as e:
        raise wire.invalid_request(str(e)) from None


async def version(_: HttpRequest) -> Response:
    return _json(encode.version(), 200, encode.version_headers())


_OPS = {
    ("post", "/api/v1/reqs/"): "Create a request (201 {ReqID})",
    ("post", "/api/v1/reqs/list"): "List requests ({Filter, Sorter, Paginator})",
    ("get", "/api/v1/reqs/{id}"): "A request (ReqInfo)",
    ("post", "/api/v1/reqs/{id}"): "Update a WAITING request (204)",
    ("post", "/api/v1/reqs/{id}/close"): "Close a request (204)",
    ("post", "/api/v1/reqs/{id}/acquire_worker"): "Access to the job's worker (?wait=S)",
    ("post", "/api/v1/reqs/{id}/prolong"): "Prolong the job (204)",
    ("get", "/api/v1/workers/"): "All workers",
    ("post", "/api/v1/workers/list"): "List workers ({Filter, Sorter, Paginator})",
    ("get", "/api/v1/workers/{uuid}"): "A worker (WorkerInfo)",
    ("post", "/api/v1/workers/{uuid}/setstate"): "Admin: IDLE or MAINTENANCE (202)",
    ("post", "/api/v1/workers/{uuid}/setgroups"): "Admin: the worker's groups (204)",
    ("post", "/api/v1/workers/{uuid}/deregister"): "Admin: remove a worker (204)",
    ("get", "/api/v1/events"): "Server-sent events of request and worker changes",
    ("get", "/api/v1/version"): "Server and API version",
}


async def openapi(_: HttpRequest) -> Response:
    paths: dict[str, dict[str, Any]] = {}
    for (method, path), summary in _OPS.items():
        paths.setdefault(path, {})[method] = {
            "summary": summary,
            "security": [] if path == "/api/v1/version" else [{"bearer": []}],
            "responses": {"default": {"description": "Boruta API v1 wire format"}},
        }
    doc = {
        "openapi": "3.0.3",
        "info": {"title": "evergraph farm (Boruta API v1)", "version": "v1"},
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "paths": paths,
    }
    return Response(json.dumps(doc), 200, media_type="application/json")
