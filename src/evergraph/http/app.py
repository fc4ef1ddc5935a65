"""The routes: status of the running graph now (with an agent's view: metrics, the
graph's edges, its live events and the web page, see observe.py); the farm's
Boruta-compatible API v1 joins them. Handlers read immutable snapshots, never
the engine's live objects."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Route

from evergraph._version import __version__
from evergraph.engine.status import VertexStatus
from evergraph.http.farm_api import FarmApi

if TYPE_CHECKING:
    from evergraph.http.observe import AgentView

Snapshot = Callable[[], tuple[VertexStatus, ...]]


def create_app(
    status: Snapshot, farm: FarmApi | None = None, view: AgentView | None = None
) -> Starlette:
    """The app: status routes, and the farm's API v1 (`farm`: None, not served);
    `view`: an agent's metrics, graph, events and web page (None: the status only)."""

    async def healthz(_: Request) -> Response:
        return JSONResponse({"ok": True, "version": __version__})

    async def graph(_: Request) -> Response:
        body = msgspec.json.encode({"vertices": status()})
        return Response(body, media_type="application/json")

    async def unversioned(request: Request) -> Response:
        # Boruta: /api/<path> without a version is the current one (308 keeps the method)
        path = request.path_params["path"]
        if path == "v1" or path.startswith("v1/"):
            return JSONResponse({"message": "no such route"}, status_code=404)
        url = f"/api/v1/{path}"
        if request.url.query:
            url += f"?{request.url.query}"
        return RedirectResponse(url, status_code=308)

    routes = [
        Route("/healthz", healthz),
        *(view.routes() if view is not None else [Route("/api/v1/graph", graph)]),
        *(farm.routes() if farm is not None else []),
        Route("/api/{path:path}", unversioned, methods=["GET", "POST", "PUT", "DELETE"]),
    ]
    return Starlette(routes=routes)
