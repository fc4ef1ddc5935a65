"""From a frontend's graph to the graph the engine runs: automatic edges, then grouping."""

from __future__ import annotations

from evergraph._util.gc import gc_paused
from evergraph.engine.autoedge import add_autoedges
from evergraph.engine.autogroup import group_vertices
from evergraph.engine.model import GraphModel


def prepare(model: GraphModel, *, autoedges: bool = True, autogroup: bool = True) -> GraphModel:
    """Add automatic edges and group vertices (in place); raises InputError on a cycle."""
    with gc_paused():
        tell_managed(model)
        if autoedges:
            add_autoedges(model)
        if autogroup:
            group_vertices(model)
    return model


def tell_managed(model: GraphModel) -> None:
    """Tell resources that ask (`managed_under`) which paths under it others manage.

    Paths come from the `autoedge_provides` keys (`path:/a/b`, `dir:/a/b/`), so
    any kind that provides paths counts, not only files.
    """
    askers = [(r, d) for r in model.resources.values() if (d := r.managed_under()) is not None]
    if not askers:
        return
    provided = [
        key.partition(":")[2]
        for r in model.resources.values()
        for key in r.autoedge_provides()
        if key.startswith(("path:", "dir:"))
    ]
    for res, d in askers:
        res.know_managed(frozenset(p.rstrip("/") for p in provided if p.startswith(d) and p != d))
