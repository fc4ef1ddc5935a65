"""What observers see of a running graph: immutable snapshots, never the engine's
live `Vertex` objects (the CLI's status, HTTP and metrics). Observers that ask
rather than listen (HTTP's routes, /metrics) see the engine through `GraphQuery`,
a Protocol the engine meets without this module importing it, and read a vertex
only as a `VertexStatus` (`vertex_status`)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING, Literal, Protocol

import msgspec

from evergraph.engine.masking import MASK

if TYPE_CHECKING:
    from evergraph.engine.contract import Resource
    from evergraph.engine.model import Edge

#: "removed": the vertex left the graph (a swap); the last status of that ident
State = Literal[
    "pending", "running", "clean", "changed", "failed", "retrying", "removed", "unknown"
]


class Change(msgspec.Struct, frozen=True, gc=False):
    """One thing a check_apply changed, or would change under noop: a field with its
    old and new value as text (None: absent; secrets already masked); for content,
    old and new are sizes and `diff` a unified diff (truncated past a size), built
    under noop and with `run --diff` only (engine/changes.py). A Struct, like
    VertexStatus (a dataclass's generated methods are compiled at import)."""

    field: str
    old: str | None
    new: str | None
    diff: str | None = None


class VertexStatus(msgspec.Struct, frozen=True, gc=False):
    """One vertex's state at one moment. A msgspec Struct, not a dataclass: the engine
    makes one per state change when observed (20k+ for a 10k-file run), and a frozen
    dataclass costs ~4 us to build against ~0.3 us; not tracked by the cyclic GC
    either (it holds no cycles)."""

    ident: str
    kind: str
    name: str
    state: State
    #: when the state was entered (the engine's clock, monotonic seconds)
    since: float
    error: str | None = None
    changed_count: int = 0
    clean_count: int = 0
    fail_count: int = 0
    #: seconds the last check_apply took
    duration: float = 0.0
    #: when it last changed something (wall clock, seconds since the epoch)
    last_changed: float | None = None
    #: what it changed (or would change) on its last run that changed something
    changes: tuple[Change, ...] = ()


#: called with each vertex's new status as it changes
Observer = Callable[[VertexStatus], None]


class _Vertex(Protocol):
    def status(self) -> VertexStatus: ...


class GraphQuery(Protocol):
    """What an observer may ask of a running engine (`engine.Engine` is one): plain
    values and snapshots, read in the engine's loop. Its vertices are read through
    `vertex_status` and `vertex_count`, never touched."""

    @property
    def graph_name(self) -> str:
        """The running graph's name ("" before the first graph)."""
        ...

    @property
    def events(self) -> int:
        """Watch events received so far (`handle.event` calls)."""
        ...

    @property
    def vertices(self) -> Mapping[str, _Vertex]: ...

    def edges(self) -> tuple[Edge, ...]: ...

    def state_counts(self) -> Mapping[str, int]:
        """How many vertices are in each state."""
        ...

    def busy(self) -> bool:
        """A run is in flight, queued or due, or a watch is not ready yet."""
        ...

    def params(self, ident: str) -> dict[str, object] | None:
        """`ident`'s parameters, its secrets masked (None: no such vertex)."""
        ...


def vertex_status(engine: GraphQuery, ident: str) -> VertexStatus | None:
    """A snapshot of vertex `ident` now (None: not in the running graph)."""
    v = engine.vertices.get(ident)
    return None if v is None else v.status()


def vertex_count(engine: GraphQuery) -> int:
    """How many vertices the running graph has."""
    return len(engine.vertices)


def masked_params(
    res: Resource, secret_fields: Collection[str], mask: Callable[[str], str]
) -> dict[str, object]:
    """A resource's parameters as plain values that observers may show: a field
    holding a received secret is `MASK` whole, and every text anywhere in the
    others goes through `mask` (the secrets the vertex knows)."""
    out: dict[str, object] = {}
    for f in res.params():
        if f.name in secret_fields:
            out[f.name] = MASK
        else:
            out[f.name] = _masked(msgspec.to_builtins(getattr(res, f.name)), mask)
    return out


def _masked(value: object, mask: Callable[[str], str]) -> object:
    if isinstance(value, str):
        return mask(value)
    if isinstance(value, list):
        return [_masked(x, mask) for x in value]
    if isinstance(value, dict):
        return {mask(str(k)): _masked(x, mask) for k, x in value.items()}
    return value
