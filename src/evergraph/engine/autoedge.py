"""Automatic edges: a resource that depends on another managed one runs after it.

Built from an index (provided key -> resource), so 10k files cost 10k
look-ups of a few keys each, not 10k² comparisons. An automatic edge that
would close a cycle with the user's own edges is dropped with a warning: the
user's explicit order wins.
"""

from __future__ import annotations

import itertools
import logging

from evergraph.engine.model import Edge, GraphCycleError, GraphModel
from evergraph.graph import CycleError

log = logging.getLogger("evergraph.autoedge")


def add_autoedges(model: GraphModel) -> int:
    """Add automatic edges to `model` in place; returns how many were added."""
    index: dict[str, str] = {}
    for ident, res in model.resources.items():
        if res.meta.autoedge:
            for key in res.autoedge_provides():
                index.setdefault(key, ident)
    if not index:
        return 0
    namespaces = {key.partition(":")[0] for key in index}
    existing = {(e.from_id, e.to_id) for e in model.edges}
    added: list[Edge] = []
    for ident, res in model.resources.items():
        if not res.meta.autoedge:
            continue
        for group in res.autoedge_wants():
            keys = iter(group)
            first = next(keys, None)
            if first is None or first.partition(":")[0] not in namespaces:
                continue  # nothing provides this kind of key: skip the walk
            for key in itertools.chain((first,), keys):
                provider = index.get(key)
                if provider is None or provider == ident:
                    continue
                if (provider, ident) not in existing:
                    existing.add((provider, ident))
                    added.append(Edge(provider, ident, name="auto"))
                break
    if not added:
        return 0
    model.edges.extend(added)
    auto = {(e.from_id, e.to_id) for e in added}
    while True:
        try:
            model.order()
            break
        except CycleError as e:
            cycle = [str(v) for v in e.cycle]
            pairs = list(itertools.pairwise(cycle))
            drop = next((p for p in pairs if p in auto), None)
            if drop is None:
                raise GraphCycleError(cycle) from None
            log.warning("dropping automatic edge %s -> %s: it closes a cycle", *drop)
            auto.discard(drop)
            model.edges[:] = [
                e for e in model.edges if not (e.name == "auto" and (e.from_id, e.to_id) == drop)
            ]
    return len(auto)
