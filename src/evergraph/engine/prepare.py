"""From a frontend's graph to the graph the engine runs: automatic edges, then grouping."""

from __future__ import annotations

from evergraph._gc import gc_paused
from evergraph.engine.autoedge import add_autoedges
from evergraph.engine.autogroup import group_vertices
from evergraph.engine.model import GraphModel


def prepare(model: GraphModel, *, autoedges: bool = True, autogroup: bool = True) -> GraphModel:
    """Add automatic edges and group vertices (in place); raises InputError on a cycle."""
    with gc_paused():
        if autoedges:
            add_autoedges(model)
        if autogroup:
            group_vertices(model)
    return model
