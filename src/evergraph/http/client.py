"""A Python client for the farm's HTTP API v1 (what `evergraph farm ...` and the tests
use). It speaks Boruta's wire format, so it works against Boruta-compatible servers
too; answers are the decoded JSON (dicts and lists), errors one `FarmClientError`
carrying the HTTP status and the server's message."""

from __future__ import annotations

import json
import socket
from typing import Any

import httpx


class FarmClientError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{message} (HTTP {status})" if status else message)
        self.status = status
        self.message = message


class FarmClient:
    def __init__(self, url: str, token: str | None = None, timeout: float = 30.0) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        # TCP_NODELAY: a request's headers and body go out as two writes; without it
        # the body waits for the server's delayed ACK (~40 ms a request)
        transport = httpx.HTTPTransport(
            socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]
        )
        self.http = httpx.Client(
            base_url=url.rstrip("/"), headers=headers, timeout=timeout, transport=transport
        )

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> FarmClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, path: str, body: Any = None, **kw: Any) -> httpx.Response:
        content = json.dumps(body) if body is not None else None
        try:
            r = self.http.request(method, f"/api/v1{path}", content=content, **kw)
        except httpx.HTTPError as e:
            raise FarmClientError(0, f"cannot reach {self.http.base_url}: {e}") from None
        if r.status_code >= 400:
            try:
                message = str(r.json()["message"])
            except (ValueError, KeyError, TypeError):
                message = r.text.strip() or r.reason_phrase
            raise FarmClientError(r.status_code, message)
        return r

    # -- requests ----------------------------------------------------------------------
    def new_request(
        self,
        priority: int,
        caps: dict[str, str] | None = None,
        valid_after: str | None = None,
        deadline: str | None = None,
        fragment: str | None = None,
    ) -> int:
        """Create a request; its id. Times are RFC 3339 strings (None: server default);
        `fragment`: YAML the worker applies for the job's lifetime (evergraph only)."""
        body: dict[str, Any] = {"Priority": priority, "Caps": caps or {}}
        if fragment:
            body["Fragment"] = fragment
        if valid_after:
            body["ValidAfter"] = valid_after
        if deadline:
            body["Deadline"] = deadline
        return int(self._call("POST", "/reqs/", body).json()["ReqID"])

    def requests(
        self,
        states: list[str] | None = None,
        sorter: dict[str, str] | None = None,
        paginator: dict[str, Any] | None = None,
    ) -> tuple[list[dict[str, Any]], dict[str, str]]:
        """(requests, the Boruta-List-* headers)."""
        body: dict[str, Any] = {}
        if states:
            body["Filter"] = {"States": states}
        if sorter:
            body["Sorter"] = sorter
        if paginator:
            body["Paginator"] = paginator
        r = self._call("POST", "/reqs/list", body)
        headers = {k: v for k, v in r.headers.items() if k.lower().startswith("boruta-list")}
        return list(r.json()), headers

    def request(self, rid: int) -> dict[str, Any]:
        return dict(self._call("GET", f"/reqs/{rid}").json())

    def update(
        self,
        rid: int,
        priority: int = 0,
        valid_after: str | None = None,
        deadline: str | None = None,
    ) -> None:
        body: dict[str, Any] = {}
        if priority:
            body["Priority"] = priority
        if valid_after:
            body["ValidAfter"] = valid_after
        if deadline:
            body["Deadline"] = deadline
        self._call("POST", f"/reqs/{rid}", body)

    def close_request(self, rid: int) -> None:
        self._call("POST", f"/reqs/{rid}/close")

    def acquire(self, rid: int, wait: float | None = None) -> dict[str, Any]:
        """{Addr: {IP, Port, Zone}, Key (PEM), Username}; waits while WAITING."""
        params = {"wait": str(wait)} if wait is not None else None
        timeout = max(30.0, (wait or 0) + 30.0)
        r = self._call("POST", f"/reqs/{rid}/acquire_worker", params=params, timeout=timeout)
        return dict(r.json())

    def prolong(self, rid: int) -> None:
        self._call("POST", f"/reqs/{rid}/prolong")

    # -- workers -----------------------------------------------------------------------
    def workers(self, groups: list[str] | None = None) -> list[dict[str, Any]]:
        if not groups:
            return list(self._call("GET", "/workers/").json())
        return list(self._call("POST", "/workers/list", {"Filter": {"Groups": groups}}).json())

    def worker(self, uuid: str) -> dict[str, Any]:
        return dict(self._call("GET", f"/workers/{uuid}").json())

    def set_state(self, uuid: str, state: str) -> None:
        self._call("POST", f"/workers/{uuid}/setstate", {"WorkerState": state})

    def set_groups(self, uuid: str, groups: list[str]) -> None:
        self._call("POST", f"/workers/{uuid}/setgroups", groups)

    def deregister(self, uuid: str) -> None:
        self._call("POST", f"/workers/{uuid}/deregister")
