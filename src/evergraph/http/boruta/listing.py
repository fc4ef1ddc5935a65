"""Boruta's API v1 lists: the list bodies (filter, sorter, paginator) read, and
one page of requests or workers chosen as Boruta's keyset paginator does it (the
page after, or before, the item with a given ID in the sorted list). Pure.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Protocol, TypeVar

from evergraph.farm.model import Request, Worker
from evergraph.http.boruta.encode import worker_caps
from evergraph.http.boruta.gotime import ZERO_EPOCH
from evergraph.http.boruta.schema import REQUESTS_LIST, WORKERS_LIST, read_body
from evergraph.http.boruta.wire import (
    ERR_WRONG_SORT_ITEM,
    MAX_PAGE_LIMIT,
    invalid_request,
    not_found,
    wire_state,
)


@dataclass(frozen=True)
class Sorter:
    """What to sort a list by (Boruta's SortInfo), the item lowercased; ties are
    broken by ID (UUID), in the same order."""

    item: str = ""
    descending: bool = False


@dataclass(frozen=True)
class RequestsFilter:
    """Requests whose ID, priority and state are each among the given ones (an
    empty tuple does not filter). States are compared uppercased."""

    ids: tuple[int, ...] = ()
    priorities: tuple[int, ...] = ()
    states: tuple[str, ...] = ()

    def matches(self, r: Request) -> bool:
        return (
            (not self.ids or r.id in self.ids)
            and (not self.priorities or r.priority in self.priorities)
            and (not self.states or wire_state(r.state) in self.states)
        )


@dataclass(frozen=True)
class WorkersFilter:
    """Workers in any of the groups (none: any) that have every capability with
    exactly the value given (Boruta's list filter; the UUID is a capability)."""

    groups: tuple[str, ...] = ()
    caps: Mapping[str, str] = field(default_factory=dict)

    def matches(self, w: Worker) -> bool:
        if self.groups and not any(group in self.groups for group in w.groups):
            return False
        caps = worker_caps(w)
        return all(caps.get(key) == value for key, value in self.caps.items())


@dataclass(frozen=True)
class RequestsPaginator:
    """A page of `limit` requests after (or, `backward`, before) the request
    `id` in the sorted list; id 0 = from the start (backward: the end)."""

    id: int = 0
    backward: bool = False
    limit: int = MAX_PAGE_LIMIT


@dataclass(frozen=True)
class WorkersPaginator:
    """As `RequestsPaginator`, by worker UUID ("" = from the start / the end)."""

    id: str = ""
    backward: bool = False
    limit: int = MAX_PAGE_LIMIT


@dataclass(frozen=True)
class RequestsListSpec:
    filter: RequestsFilter | None = None
    sorter: Sorter | None = None
    paginator: RequestsPaginator | None = None


@dataclass(frozen=True)
class WorkersListSpec:
    filter: WorkersFilter | None = None
    sorter: Sorter | None = None
    paginator: WorkersPaginator | None = None


REQUEST_SORT_ITEMS: Final = frozenset({"", "id", "priority", "deadline", "validafter", "state"})
WORKER_SORT_ITEMS: Final = frozenset({"", "uuid", "state", "groups"})


def _sorter(raw: dict[str, Any] | None, items: frozenset[str]) -> Sorter | None:
    if raw is None:
        return None
    item = str(raw["Item"]).lower()
    if item not in items:
        raise invalid_request(ERR_WRONG_SORT_ITEM)
    return Sorter(item=item, descending=bool(raw["Order"]))


def _limit(limit: int) -> int:
    return limit if 0 < limit <= MAX_PAGE_LIMIT else MAX_PAGE_LIMIT


def parse_requests_list(body: bytes) -> RequestsListSpec:
    """Read a `POST /api/v1/reqs/list` body `{"Filter": {"IDs", "Priorities",
    "States"}, "Sorter": {"Item", "Order"}, "Paginator": {"ID", "Direction",
    "Limit"}}`, any part null or missing; an empty body lists everything.
    Sort items: id (default), priority, deadline, validafter, state."""
    raw = read_body(body, REQUESTS_LIST, empty_ok=True)
    flt, pag = raw["Filter"], raw["Paginator"]
    return RequestsListSpec(
        filter=None
        if flt is None
        else RequestsFilter(
            ids=tuple(flt["IDs"] or ()),
            priorities=tuple(flt["Priorities"] or ()),
            states=tuple(str(s).strip().upper() for s in flt["States"] or ()),
        ),
        sorter=_sorter(raw["Sorter"], REQUEST_SORT_ITEMS),
        paginator=None
        if pag is None
        else RequestsPaginator(
            id=pag["ID"], backward=bool(pag["Direction"]), limit=_limit(pag["Limit"])
        ),
    )


def parse_workers_list(body: bytes) -> WorkersListSpec:
    """Read a `POST /api/v1/workers/list` body `{"Filter": {"Groups",
    "Capabilities"}, "Sorter": {"Item", "Order"}, "Paginator": {"ID",
    "Direction", "Limit"}}`, any part null or missing; an empty body lists
    everything. Sort items: uuid (default), state, groups."""
    raw = read_body(body, WORKERS_LIST, empty_ok=True)
    flt, pag = raw["Filter"], raw["Paginator"]
    return WorkersListSpec(
        filter=None
        if flt is None
        else WorkersFilter(groups=tuple(flt["Groups"] or ()), caps=dict(flt["Capabilities"] or {})),
        sorter=_sorter(raw["Sorter"], WORKER_SORT_ITEMS),
        paginator=None
        if pag is None
        else WorkersPaginator(
            id=pag["ID"], backward=bool(pag["Direction"]), limit=_limit(pag["Limit"])
        ),
    )


# ---------------------------------------------------------------- listing


_Item = TypeVar("_Item")
_Item_contra = TypeVar("_Item_contra", contravariant=True)


def _time_key(t: float) -> float:
    return t if t else float(ZERO_EPOCH)


_REQUEST_KEYS: dict[str, Callable[[Request], Any]] = {
    "": lambda r: r.id,
    "id": lambda r: r.id,
    "priority": lambda r: (r.priority, r.id),
    "deadline": lambda r: (_time_key(r.deadline), r.id),
    "validafter": lambda r: (_time_key(r.valid_after), r.id),
    "state": lambda r: (wire_state(r.state), r.id),
}
_WORKER_KEYS: dict[str, Callable[[Worker], Any]] = {
    "": lambda w: w.uuid,
    "uuid": lambda w: w.uuid,
    "state": lambda w: (w.state, w.uuid),
    "groups": lambda w: (list(w.groups), w.uuid),
}


def _page(
    matching: list[_Item],
    pivot: _Item | None,
    pivot_matches: bool,
    backward: bool,
    limit: int,
) -> tuple[list[_Item], int, int]:
    """Boruta's paging of a sorted list that holds the pivot (the item whose ID
    the paginator names), whether or not it matches the filter."""
    count = len(matching)
    if not count:
        return [], 0, 0
    index = 0
    if pivot is not None:
        index = next(i for i, item in enumerate(matching) if item is pivot)
    if backward:
        if pivot is None:
            index = count
        size = min(limit, index)
        remaining = index - size
        index -= size
    else:
        if pivot is not None:
            index += 1
        size = min(limit, count - index)
        remaining = count - index - size
    total = count if pivot_matches else count - 1
    return matching[index : index + size], total, remaining


class _Filter(Protocol[_Item_contra]):
    def matches(self, item: _Item_contra) -> bool: ...


def _list(
    items: Iterable[_Item],
    ident: Callable[[_Item], object],
    pid: object,
    filter: _Filter[_Item] | None,
    key: Callable[[_Item], Any],
    descending: bool,
    backward: bool,
    limit: int,
    what: str,
) -> tuple[list[_Item], int, int]:
    """One page of `items` matching `filter`, sorted by `key`; the pivot `pid`
    (falsy: none) is kept even if the filter drops it. 404 `<what> not found` for
    an unknown pivot."""
    pivot: _Item | None = None
    matching: list[_Item] = []
    for item in items:
        if pid and ident(item) == pid:
            pivot = item
            matching.append(item)
        elif filter is None or filter.matches(item):
            matching.append(item)
    if pid and pivot is None:
        raise not_found(what)
    matching.sort(key=key, reverse=descending)
    kept = pivot is None or filter is None or filter.matches(pivot)
    return _page(matching, pivot, kept, backward, limit)


def list_requests(
    items: Iterable[Request],
    filter: RequestsFilter | None = None,
    sorter: Sorter | None = None,
    paginator: RequestsPaginator | None = None,
) -> tuple[list[Request], int, int]:
    """One page of the requests matching `filter`, sorted: (page, total matching,
    remaining after the page in its direction). `items` are all the requests the
    caller may see; a paginator naming none of them is 404 `request not found`."""
    sorter = sorter or Sorter()
    return _list(
        items,
        lambda r: r.id,
        paginator.id if paginator is not None else 0,
        filter,
        _REQUEST_KEYS[sorter.item],
        sorter.descending,
        paginator is not None and paginator.backward,
        _limit(paginator.limit) if paginator is not None else MAX_PAGE_LIMIT,
        "request",
    )


def list_workers(
    items: Iterable[Worker],
    filter: WorkersFilter | None = None,
    sorter: Sorter | None = None,
    paginator: WorkersPaginator | None = None,
) -> tuple[list[Worker], int, int]:
    """As `list_requests`, for workers (paged by UUID; an unknown one is 404
    `worker not found`)."""
    sorter = sorter or Sorter()
    return _list(
        items,
        lambda w: w.uuid,
        paginator.id if paginator is not None else "",
        filter,
        _WORKER_KEYS[sorter.item],
        sorter.descending,
        paginator is not None and paginator.backward,
        _limit(paginator.limit) if paginator is not None else MAX_PAGE_LIMIT,
        "worker",
    )
