"""What observers see of a running graph: immutable snapshots, never the engine's
live `Vertex` objects (the CLI's status now, HTTP and metrics later)."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Literal

import msgspec

from evergraph.engine.masking import MASK

if TYPE_CHECKING:
    from evergraph.engine.contract import Resource

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
