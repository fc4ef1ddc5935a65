"""What the frontend tests compare two graphs by: all a model is, and what
`prepare` makes of it."""

from __future__ import annotations

import msgspec

from evergraph.engine.model import GraphModel
from evergraph.engine.prepare import prepare


def model_view(model: GraphModel) -> tuple[object, ...]:
    """All a graph is: name, resources (order, class, parameters and meta), edges
    with every field, collect specs, origins."""
    return (
        model.name,
        [(i, type(r), msgspec.to_builtins(r)) for i, r in model.resources.items()],
        [tuple(e) for e in model.edges],
        model.collect,
        model.origins,
    )


def model_groups(model: GraphModel) -> tuple[object, ...]:
    """The graph after automatic edges and grouping: vertices with their members,
    and every edge (`prepare` is run on `model`)."""
    prepare(model)
    members = {i: [m.ident for m in r.group_members] for i, r in model.resources.items()}
    return members, [tuple(e) for e in model.edges]
