"""What a frontend hands the engine: resources by identity, and edges between them."""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass, field
from types import UnionType
from typing import TYPE_CHECKING, Annotated, Any, NamedTuple, Union, get_args, get_origin

import msgspec

from evergraph.engine.contract import DEFAULT_META, Resource, semaphores
from evergraph.errors import InputError
from evergraph.graph import DAG, CycleError, topo_order

if TYPE_CHECKING:
    from evergraph.engine.ahead import Ahead


class Edge(NamedTuple):
    """`a -> b`: a before b. `notify`: b is refreshed when a changed something.

    A NamedTuple, not a dataclass: graphs of 10k+ edges are built and compared
    on every load and swap, and tuples are several times cheaper at both.
    """

    from_id: str
    to_id: str
    notify: bool = False
    send: str | None = None
    recv: str | None = None
    name: str = ""


class CollectSpec(msgspec.Struct, frozen=True):
    """Collect exported resources of `kind` whose exporter, name and parameters match."""

    kind: str
    host: str | None = None
    name: str | None = None
    params: dict[str, object] = msgspec.field(default_factory=dict)

    def matches(self, kind: str, host: str, name: str, params: dict[str, object]) -> bool:
        return (
            kind == self.kind
            and (self.host is None or host == self.host)
            and (self.name is None or name == self.name)
            and all(params.get(k) == v for k, v in self.params.items())
        )


class AutoEdges(NamedTuple):
    """The automatic edges a model gets (`autoedge.automatic_edges`), known before it
    is prepared (a parse cache entry keeps them): those added, in order, and those
    dropped for closing a cycle (each a warning). For the model of `resources`
    resources and `edges` edges it was found for: `fits`."""

    edges: list[Edge]
    dropped: list[tuple[str, str]]
    resources: int
    edges_before: int

    def fits(self, model: GraphModel) -> bool:
        """The model is as it was found for (nothing added since: `collect:`)."""
        return (
            len(model.resources) == self.resources
            and len(model.edges) == self.edges_before
            and not model.collect
        )


@dataclass(slots=True)
class GraphModel:
    """A validated graph ready for the engine. Build with `add` and `connect`, then `check`."""

    name: str = ""
    resources: dict[str, Resource] = field(default_factory=dict)
    edges: list[Edge] = field(default_factory=list)
    #: where each resource was declared (e.g. `file.yaml:12:5`), for messages
    origins: dict[str, str] = field(default_factory=dict)
    #: live queries for resources other hosts export to this one (YAML `collect:`)
    collect: list[CollectSpec] = field(default_factory=list)
    #: each resource's claims (whole, part) as `check(keep=True)` found them
    _claims: dict[str, tuple[Iterable[str], Iterable[str]]] | None = field(
        default=None, repr=False, compare=False
    )
    #: its automatic edges, when known before `prepare` (a one-shot run's parse cache
    #: hit); `add_autoedges` uses them once instead of finding them
    auto: AutoEdges | None = field(default=None, repr=False, compare=False)
    #: its resources' checks running ahead in a child (a one-shot run: ahead.py)
    ahead: Ahead | None = field(default=None, repr=False, compare=False)

    def add(self, res: Resource, origin: str = "") -> None:
        """Add a resource; an equal duplicate merges, a different one is an error."""
        ident = res.ident
        prev = self.resources.get(ident)
        if prev is not None:
            if prev.cmp(res):
                return
            first = self.origins.get(ident, "")
            raise InputError(
                f"{ident} is declared twice with different parameters"
                + (f" (first at {first})" if first else ""),
                origin,
            )
        self.resources[ident] = res
        if origin:
            self.origins[ident] = origin

    def connect(self, edge: Edge, origin: str = "") -> None:
        for end in (edge.from_id, edge.to_id):
            if end not in self.resources:
                raise InputError(f"edge names {end}, which is not a resource of this graph", origin)
        if edge.from_id == edge.to_id:
            raise InputError(f"edge from {edge.from_id} to itself", origin)
        if edge.send is not None or edge.recv is not None:
            check_send_recv(self.resources[edge.from_id], edge, self.resources[edge.to_id], origin)
        self.edges.append(edge)

    def order(self) -> list[str]:
        """A topological order of the identities; raises CycleError."""
        return topo_order(self.resources, ((e.from_id, e.to_id) for e in self.edges))

    def forward_order(self) -> list[str] | None:
        """The declaration order if every edge goes forward in it, else None. Such
        an order is topological, so the graph has no cycle: the common case (a
        directory declared before its files) costs a look-up per edge instead of
        a topological sort (~10 ms for 10k edges)."""
        pos = dict(zip(self.resources, range(len(self.resources)), strict=True))
        get = pos.get
        for e in self.edges:
            a = get(e[0])  # (from_id, to_id: by index, several times cheaper)
            b = get(e[1])
            if a is None or b is None or a >= b:
                return None
        return list(pos)

    def dag(self) -> DAG[str]:
        return DAG.build(self.resources, ((e.from_id, e.to_id) for e in self.edges))

    def check(
        self,
        valid: Mapping[str, Resource] | None = None,
        *,
        keep: bool = False,
        stateful: Container[str] | None = None,
    ) -> list[str]:
        """Validate every resource and the shape; returns a topological order.

        `valid`: resources validated before (`validated()` of an earlier model):
        one equal to its entry there is not validated again (`validate` checks
        the parameters alone), e.g. the unchanged 9,999 of a live edit, and its
        claims are taken from there (a `Validated` of a model checked with
        `keep`: claims are keys of parameter values too). `keep`: remember each
        resource's claims for `validated()`. `stateful` (instead of `valid`): every
        resource but these was validated before, with the parameters it has now (a
        parse cache hit: the entry is a model whose parse validated it)."""
        #: semaphore id -> (its count, the first resource that gave it)
        semas: dict[str, tuple[int, Resource]] = {}
        #: what each resource manages (`file:/etc/x`) -> the first resource claiming it
        claimed: dict[str, Resource] = {}
        #: what resources manage a part of (`content:/etc/hosts`) -> the first doing so
        parts: dict[str, Resource] = {}
        known = valid.claims if isinstance(valid, Validated) else None
        kept: dict[str, tuple[Iterable[str], Iterable[str]]] | None = {} if keep else None
        default = DEFAULT_META
        for ident, res in self.resources.items():
            meta = res.meta
            if meta is not default:
                meta.check(ident)
                if meta.sema:
                    self._check_semas(res, semas)
                if meta.reverse and not res.reversible():
                    raise InputError(
                        f"{res.kind} resources cannot be reversed", f"{ident}.meta.reverse"
                    )
            got = None
            if stateful is not None:
                if ident in stateful:
                    res.validate()
            elif valid is None or valid.get(ident) != res:
                res.validate()
            elif known is not None:
                got = known.get(ident)
            if got is None:
                got = (res.claims(), res.claims_part())
            if kept is not None:
                kept[ident] = got
            whole, part = got
            for key in whole:
                first = claimed.setdefault(key, res)
                if first is not res and not same_but_named(first, res):
                    self._fight(key, first, res)
                if parts and key in parts and parts[key] is not res:
                    self._fight_part(key, res, parts[key], later=res)
            for key in part:
                other = claimed.get(key)
                if other is not None and other is not res:
                    self._fight_part(key, other, res, later=res)
                parts.setdefault(key, res)
        self._claims = kept
        forward = self.forward_order()
        if forward is not None:
            return forward
        try:
            return self.order()
        except CycleError as e:
            cyc = [str(v) for v in e.cycle]
            where = self.origins.get(cyc[0], "")
            raise GraphCycleError(cyc, where) from None

    def validated(self) -> Validated:
        """Right after `check`: its resources, for a later model's `check(valid=)`.
        Those carrying state of their own (set by `validate`, or since) are left
        out: they are validated again. With their claims if `check` kept them."""
        out = Validated((i, r) for i, r in self.resources.items() if not r.__dict__)
        out.claims = self._claims or {}
        return out

    def claimed(self) -> tuple[dict[str, Resource], dict[str, Resource]]:
        """What the graph's resources manage whole (`file:/etc/x`) and in part
        (`content:/etc/hosts` for a line) -> the first claiming it."""
        whole: dict[str, Resource] = {}
        parts: dict[str, Resource] = {}
        for res in self.resources.values():
            for key in res.claims():
                whole.setdefault(key, res)
            for key in res.claims_part():
                parts.setdefault(key, res)
        return whole, parts

    def _fight(self, key: str, first: Resource, res: Resource) -> None:
        where = self.origins.get(first.ident, "")
        raise InputError(
            f"manages {key}, as {first.ident}" + (f" (at {where})" if where else "") + " does "
            "with other parameters: the two would undo each other's changes for ever; "
            "keep one",
            res.ident,
        )

    def _fight_part(self, key: str, whole: Resource, part: Resource, *, later: Resource) -> None:
        """`whole` manages all of `key` (a file's content), `part` a piece of it (a
        line); the error is reported at `later`, the second of the two."""
        first = part if later is whole else whole
        where = self.origins.get(first.ident, "")
        at = f" (at {where})" if where else ""
        if later is whole:
            text = f"manages all of {key}, a part of which {first.ident}{at} manages"
        else:
            text = f"manages a part of {key}, all of which {first.ident}{at} manages"
        raise InputError(
            f"{text}: the two would undo each other's changes for ever; keep one", later.ident
        )

    def _check_semas(self, res: Resource, seen: dict[str, tuple[int, Resource]]) -> None:
        """A semaphore id has one count graph-wide (`a` is `a:1`)."""
        for sid, n in semaphores(res.meta.sema):
            count, first = seen.setdefault(sid, (n, res))
            if count != n:
                where = self.origins.get(first.ident, "")
                raise InputError(
                    f"semaphore {sid!r} has count {count} in {first.ident}"
                    + (f" (at {where})" if where else "")
                    + f" but {n} in {res.ident}: one count per id (`{sid}` is `{sid}:1`)",
                    f"{res.ident}.meta.sema",
                )


class Validated(dict[str, Resource]):
    """`GraphModel.validated()`: identity -> resource as validated, and `claims`:
    what each claimed (whole, part), when its `check` kept them."""

    claims: dict[str, tuple[Iterable[str], Iterable[str]]]


def same_but_named(a: Resource, b: Resource) -> bool:
    """Equal resources under two names (apart from meta): they do not fight."""
    return type(a) is type(b) and msgspec.structs.replace(b, name=a.name, meta=a.meta) == a


class GraphCycleError(InputError):
    """A cycle among the graph's edges; `cycle` lists the identities, first repeated last."""

    def __init__(self, cycle: list[str], where: str = "") -> None:
        super().__init__("the graph has a cycle: " + " -> ".join(cycle), where)
        self.cycle = cycle


def _type_name(t: object) -> str:
    """`str`, `str | None`, `list[str]`: a declared type as its user wrote it, without
    the `Annotated[..., doc(...)]` wrapper every parameter has."""
    if get_origin(t) is Annotated:
        t = get_args(t)[0]
    if isinstance(t, type) and not get_args(t):
        return t.__name__
    return str(t).replace("typing.", "").replace("NoneType", "None")


def _accepts(field_type: object, value_type: object) -> bool:
    """Whether a field declared `field_type` takes values of `value_type`."""
    if get_origin(field_type) is Annotated:
        field_type = get_args(field_type)[0]
    if field_type == value_type or field_type is Any or value_type is Any:
        return True  # a sender of Any (value): checked when a value arrives
    if isinstance(field_type, UnionType) or get_origin(field_type) is Union:
        return any(_accepts(a, value_type) for a in get_args(field_type))
    return False


def check_send_recv(sender: Resource, edge: Edge, receiver: Resource, origin: str = "") -> None:
    """Types are checked before the graph runs: a mismatch names both ends."""
    where = f"{edge.from_id}.{edge.send} -> {edge.to_id}.{edge.recv}"
    if edge.send is None or edge.recv is None:
        raise InputError(f"edge {where}: send and recv go together", origin)
    sends = type(sender).sends
    if edge.send not in sends:
        offered = ", ".join(sorted(sends)) or "nothing"
        raise InputError(
            f"edge {where}: {sender.kind} sends no {edge.send!r} (it sends: {offered})", origin
        )
    fields = {f.name: f.type for f in receiver.params()}
    if edge.recv not in fields:
        raise InputError(
            f"edge {where}: {receiver.kind} has no parameter {edge.recv!r} "
            f"(parameters: {', '.join(sorted(fields))})",
            origin,
        )
    sent_type = sends[edge.send]
    if not _accepts(fields[edge.recv], sent_type):
        raise InputError(
            f"edge {where}: type mismatch: {sender.kind}.{edge.send} is "
            f"{_type_name(sent_type)}, {receiver.kind}.{edge.recv} takes "
            f"{_type_name(fields[edge.recv])}",
            origin,
        )
