"""What observers see of a running graph: immutable snapshots, never the engine's
live `Vertex` objects (the CLI's status now, HTTP and metrics later)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

State = Literal["pending", "running", "clean", "changed", "failed", "retrying"]


@dataclass(frozen=True, slots=True)
class VertexStatus:
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


#: called with each vertex's new status as it changes
Observer = Callable[[VertexStatus], None]
