"""The running graph, observed: `/metrics`, `/api/v1/graph` (vertices and edges),
`/api/v1/graph/events` (server-sent vertex changes), `/api/v1/graph/vertices/ID`
(one vertex: status and parameters, secrets masked; an admin token only) and the live page at `/`.

`GraphFeed` subscribes to the agent's observer hub: on the engine's hot path it
only appends the status to a bounded ring and counts. Each SSE client reads
the ring at its own pace, at most `SEND_EVERY` apart, sending only the latest
status of each vertex that changed since its last send (so a burst of 20k
statuses is a few batches). A client that falls further behind than the ring
holds gets every vertex's current status again. Nothing a client does (or
fails to read) reaches the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections import deque
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from evergraph.agent.observe import ClusterFigures, Histogram, ObserverHub, TimedKV
from evergraph.engine.status import GraphQuery, VertexStatus, vertex_status
from evergraph.farm.signed import FarmTrust
from evergraph.http.limits import AuthFailures
from evergraph.http.metrics import Exposition, FarmQueue, Metrics, watch_loop
from evergraph.world.kv import KV

if TYPE_CHECKING:
    from evergraph.http.server import HttpServer

#: statuses kept for SSE clients that are behind (a 10k graph's start-up overflows
#: it: those clients get a full snapshot instead)
RING = 16384
#: an SSE client gets a batch at most this often (seconds): bursts coalesce
SEND_EVERY = 0.05
#: a comment line this often keeps proxies from closing an idle stream
KEEPALIVE = 15.0
STATIC = Path(__file__).parent / "static"
_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css"}
_json = msgspec.json.Encoder()


class GraphFeed:
    """Vertex statuses as they change, numbered from 1, for SSE clients."""

    def __init__(self, snapshot: Callable[[], tuple[VertexStatus, ...]], ring: int = RING) -> None:
        self.snapshot = snapshot
        self._ring: deque[VertexStatus] = deque(maxlen=ring)
        #: number of the last status appended
        self.seq = 0
        self._waiter: asyncio.Future[None] | None = None
        self.closed = False

    def __call__(self, st: VertexStatus) -> None:
        self._ring.append(st)
        self.seq += 1
        w = self._waiter
        if w is not None:
            self._waiter = None
            if not w.done():
                w.set_result(None)

    def close(self) -> None:
        """End every stream (the server stops)."""
        self.closed = True
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def since(self, seq: int) -> list[VertexStatus] | None:
        """The statuses after number `seq`, or None if the ring no longer has them all."""
        first = self.seq - len(self._ring)  # the number before the ring's oldest
        if seq < first or seq > self.seq:
            return None
        return list(itertools.islice(self._ring, seq - first, None))

    async def _changed(self, seq: int, timeout: float) -> None:
        if self.seq != seq or self.closed:
            return
        if self._waiter is None:
            self._waiter = asyncio.get_running_loop().create_future()
        # shared by every client: shielded, so one leaving does not cancel the others'
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._waiter), timeout)

    async def stream(self, after: int | None) -> AsyncIterator[bytes]:
        """SSE: one event per vertex status (`id:` its number), from after `after`
        (None: from now on)."""
        seq = self.seq if after is None else after
        yield b": evergraph graph events\n\n"
        loop = asyncio.get_running_loop()
        while not self.closed:
            await self._changed(seq, KEEPALIVE)
            if self.closed:
                return
            if self.seq == seq:
                yield b": keepalive\n\n"
                continue
            batch = self.since(seq)
            if batch is None:  # too far behind: every vertex's status now
                batch = list(self.snapshot())
            seq = self.seq
            latest = {st.ident: st for st in batch}
            yield b"".join(
                b"id: %d\ndata: %s\n\n" % (seq, _json.encode(st)) for st in latest.values()
            )
            sent = loop.time()
            # let a burst gather (not a synchronisation: the next batch may wait)
            await asyncio.sleep(max(0.0, sent + SEND_EVERY - loop.time()))


class ObservedAgent(Protocol):
    """What the view reads of an agent (`agent.run.Agent` is one): the engine only
    through `GraphQuery`, its vertices only as snapshots."""

    @property
    def engine(self) -> GraphQuery | None: ...

    @property
    def kv(self) -> KV | None: ...

    @property
    def farm_trust(self) -> FarmTrust | None: ...

    @property
    def observers(self) -> ObserverHub: ...

    def status(self) -> tuple[VertexStatus, ...]: ...

    def cluster_figures(self) -> ClusterFigures | None:
        """Its self-forming cluster's figures; None when it runs no seat."""
        ...


class AgentView:
    """Everything the HTTP service observes of one agent, and its routes."""

    def __init__(self, agent: ObservedAgent, farm: bool = False) -> None:
        self.agent = agent
        self.metrics = Metrics()
        self.feed = GraphFeed(agent.status)
        self.farm = (
            FarmQueue(agent.kv, agent.farm_trust)
            if farm and agent.kv is not None and agent.farm_trust is not None
            else None
        )
        # the cluster's families only when the agent has a seat (--etcd embedded)
        cluster = agent.cluster_figures if agent.cluster_figures() is not None else None
        self.exposition = Exposition(
            self.metrics, lambda: agent.engine, self._world, self.farm, cluster=cluster
        )
        self._static: dict[str, bytes] = {}
        #: failed token attempts on the parameter routes (http/limits.py)
        self.auth_failures = AuthFailures()

    def _world(self) -> dict[str, Histogram]:
        kv = self.agent.kv
        return dict(kv.timings) if isinstance(kv, TimedKV) else {}

    def close(self) -> None:
        self.feed.close()

    async def serve(self, server: HttpServer) -> None:
        """Observe the agent while `server` runs (until cancelled)."""
        hub = self.agent.observers
        hub.subscribe(self.metrics)
        hub.subscribe(self.feed)
        try:
            async with asyncio.TaskGroup() as tg:
                helpers = [tg.create_task(watch_loop(self.metrics), name="loop-stalls")]
                if self.farm is not None:
                    helpers.append(tg.create_task(self.farm.run(), name="farm-queue"))
                try:
                    await server.run()
                finally:
                    for t in helpers:
                        t.cancel()
        finally:
            hub.unsubscribe(self.feed)
            hub.unsubscribe(self.metrics)

    # -- routes -----------------------------------------------------------------------------
    async def metrics_route(self, request: Request) -> Response:
        body, content_type = self.exposition.render(request.headers.get("accept", ""))
        return Response(body, headers={"Content-Type": content_type})

    async def graph(self, _: Request) -> Response:
        engine = self.agent.engine
        edges = engine.edges() if engine is not None else ()
        seq = self.feed.seq  # taken with the snapshot: nothing runs in between
        body = {
            "graph": engine.graph_name if engine is not None else "",
            "seq": seq,
            "vertices": self.agent.status(),
            "edges": [
                {
                    "from": e.from_id,
                    "to": e.to_id,
                    "notify": e.notify,
                    "send": e.send,
                    "recv": e.recv,
                }
                for e in edges
            ],
        }
        return Response(_json.encode(body), media_type="application/json")

    async def _may_read_params(self, request: Request) -> Response | None:
        """Parameters are the host's configuration (file contents, commands): served
        only to an admin's bearer token (a farm token made with `evergraph farm token
        create NAME --admin`), from any address, loopback included (another local
        user is no more trusted than a remote one); None when allowed, else the
        401/403. A connection from root over `--http-socket` (its uid read with
        SO_PEERCRED) needs no token."""
        from evergraph.http.server import PEER_UID

        if (request.scope.get("state") or {}).get(PEER_UID) == 0:
            return None
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        kv = self.agent.kv
        if scheme.lower() != "bearer" or not token.strip() or kv is None:
            return JSONResponse(
                {"message": "unauthorized: a vertex's parameters need an admin's "
                 "Authorization: Bearer TOKEN (evergraph farm token create NAME --admin)"},
                401,
            )  # fmt: skip
        from evergraph.farm import tokens

        address = request.client.host if request.client is not None else "?"
        wait = self.auth_failures.blocked(address, token.strip())
        if wait:
            message = f"too many failed token attempts: try again in {wait:.0f} s"
            return JSONResponse({"message": message}, 429)
        user = await tokens.lookup(kv, token.strip(), self.agent.farm_trust)
        if user is None:
            self.auth_failures.failed(address, token.strip())
            return JSONResponse({"message": "unauthorized: unknown token"}, 401)
        if not user.admin:
            return JSONResponse({"message": "forbidden: parameters are for admins"}, 403)
        return None

    async def vertex(self, request: Request) -> Response:
        refused = await self._may_read_params(request)
        if refused is not None:
            return refused
        ident = request.path_params["ident"]
        engine = self.agent.engine
        status = vertex_status(engine, ident) if engine is not None else None
        params = engine.params(ident) if engine is not None else None
        if status is None or params is None:
            return JSONResponse({"message": f"no vertex {ident!r} in the running graph"}, 404)
        body = {"status": status, "params": params}
        return Response(_json.encode(body), media_type="application/json")

    async def events(self, request: Request) -> Response:
        raw = request.headers.get("last-event-id") or request.query_params.get("after")
        after: int | None = None
        if raw:
            if not raw.isdigit():
                return JSONResponse({"message": f"after: {raw!r} is not an event number"}, 400)
            after = int(raw)
        return StreamingResponse(
            self.feed.stream(after),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def static(self, request: Request) -> Response:
        name = request.path_params.get("name", "index.html")
        body = self._static.get(name)
        if body is None:
            path = STATIC / name
            if "/" in name or path.suffix not in _TYPES or not path.is_file():
                return JSONResponse({"message": f"no such file: {name}"}, 404)
            body = self._static[name] = path.read_bytes()
        media = _TYPES[Path(name).suffix]
        return Response(body, media_type=media, headers={"Cache-Control": "no-cache"})

    def routes(self) -> list[Any]:
        get = ["GET"]
        return [
            Route("/", self.static, methods=get),
            Route("/static/{name}", self.static, methods=get),
            Route("/metrics", self.metrics_route, methods=get),
            Route("/api/v1/graph", self.graph, methods=get),
            Route("/api/v1/graph/events", self.events, methods=get),
            Route("/api/v1/graph/vertices/{ident:path}", self.vertex, methods=get),
        ]
