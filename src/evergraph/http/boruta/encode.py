"""Boruta's API v1 answers, built: the JSON objects of requests, workers, access
and versions in Go's field order (`gojson.dumps` writes them byte-identical to
Boruta's), and the `Boruta-*` headers. Times are RFC 3339 as Go marshals a
`time.Time` (`gotime`); 0.0 (unset) is Go's zero time. Pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from evergraph._version import __version__
from evergraph.farm.model import IN_PROGRESS, UUID_CAP, Request, Worker
from evergraph.http.boruta.gotime import format_time, format_time_header
from evergraph.http.boruta.wire import (
    API_STATE,
    API_STATE_HEADER,
    API_VERSION,
    API_VERSION_HEADER,
    JOB_TIMEOUT,
    LIST_BATCH_SIZE,
    LIST_REMAINING,
    LIST_TOTAL,
    REQUEST_STATE,
    SERVER_VERSION,
    WORKER_STATE,
    wire_state,
)


def _go_map(mapping: Mapping[str, str]) -> dict[str, str] | None:
    """A Go map as Go marshals it: keys sorted; empty is null (Boruta's records
    hold nil maps until something is set)."""
    return {key: mapping[key] for key in sorted(mapping)} if mapping else None


def req_info(r: Request) -> dict[str, Any]:
    """Boruta's `ReqInfo` of a request: `{"ID", "Priority", "Owner": {"Groups"},
    "Deadline", "ValidAfter", "State", "Job": {"WorkerUUID", "Timeout"} | null,
    "Caps"}`. No groups / no caps are null, as in Boruta's records."""
    job = r.job
    return {
        "ID": r.id,
        "Priority": r.priority,
        "Owner": {"Groups": list(r.groups) or None},
        "Deadline": format_time(r.deadline),
        "ValidAfter": format_time(r.valid_after),
        "State": wire_state(r.state),
        "Job": (
            None if job is None else {"WorkerUUID": job.worker, "Timeout": format_time(job.timeout)}
        ),
        "Caps": _go_map(r.caps),
    }


def worker_caps(w: Worker) -> dict[str, str]:
    """A worker's caps as Boruta shows them: its UUID among them."""
    return {**w.caps, UUID_CAP: w.uuid}


def worker_info(w: Worker) -> dict[str, Any]:
    """Boruta's `WorkerInfo`: `{"WorkerUUID", "State", "Groups", "Caps"}`; the caps
    hold `UUID` too (as Boruta's do); no groups is null."""
    return {
        "WorkerUUID": w.uuid,
        "State": w.state,
        "Groups": list(w.groups) or None,
        "Caps": _go_map(worker_caps(w)),
    }


def _ip_text(ip: str) -> tuple[str, str]:
    """(address as Go's `net.IP` writes it, IPv6 zone)."""
    import ipaddress  # only acquire_worker needs it

    address, _, zone = ip.partition("%")
    if not address:
        return "", zone
    parsed = ipaddress.ip_address(address)
    if isinstance(parsed, ipaddress.IPv6Address) and parsed.ipv4_mapped is not None:
        return str(parsed.ipv4_mapped), zone  # Go prints a v4-in-v6 address as v4
    return str(parsed), zone


def access_info(ip: str, port: int, key_pem: str, username: str) -> dict[str, Any]:
    """Boruta's acquire_worker answer (`AccessInfo2`): where to ssh and as whom,
    with the job's private key in PEM (`-----BEGIN RSA PRIVATE KEY-----`...):
    `{"Addr": {"IP", "Port", "Zone"}, "Key", "Username"}`. An IPv6 zone may
    follow the address (`fe80::1%eth0`)."""
    address, zone = _ip_text(ip)
    return {
        "Addr": {"IP": address, "Port": port, "Zone": zone},
        "Key": key_pem,
        "Username": username,
    }


def req_id(rid: int) -> dict[str, Any]:
    """A created request's answer (201): `{"ReqID": n}`."""
    return {"ReqID": rid}


def version(server: str = __version__) -> dict[str, Any]:
    """`GET /api/v1/version`'s body: `{"Server", "API_Version", "API_State"}`."""
    return {"Server": server, "API_Version": API_VERSION, "API_State": API_STATE}


# ---------------------------------------------------------------- headers


def version_headers(server: str = __version__) -> dict[str, str]:
    """The headers `GET /api/v1/version` adds."""
    return {
        API_STATE_HEADER: API_STATE,
        API_VERSION_HEADER: API_VERSION,
        SERVER_VERSION: server,
    }


def request_headers(r: Request) -> dict[str, str]:
    """The headers of an answer carrying one request: its state, and its job's
    timeout while IN PROGRESS."""
    state = wire_state(r.state)
    headers = {REQUEST_STATE: state}
    if state == IN_PROGRESS and r.job is not None:
        headers[JOB_TIMEOUT] = format_time_header(r.job.timeout)
    return headers


def worker_headers(w: Worker) -> dict[str, str]:
    """The header of an answer carrying one worker: its state."""
    return {WORKER_STATE: w.state}


def list_headers(total: int | None, remaining: int | None, batch: int) -> dict[str, str]:
    """The headers of a list's answer: how many items match (`total`), how many
    are left after this page in its direction (`remaining`) and how many it holds
    (`batch`). Boruta leaves total and remaining out when it has no such
    information (None here)."""
    headers = {LIST_BATCH_SIZE: str(batch)}
    if total is not None and remaining is not None:
        headers[LIST_REMAINING] = str(remaining)
        headers[LIST_TOTAL] = str(total)
    return headers
