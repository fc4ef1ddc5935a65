"""Autogrouping at scale: isolated groupable vertices join in O(1), with exactly the
groups the general (closure-updating) algorithm makes."""

from __future__ import annotations

import random

import pytest

import evergraph.resources  # noqa: F401  (registers the kinds)
from evergraph.engine import autogroup
from evergraph.engine.build import build
from evergraph.engine.contract import default_registry
from evergraph.engine.model import Edge, GraphModel


def _model(seed: int, n: int, edges: int) -> GraphModel:
    rng = random.Random(seed)
    m = GraphModel()
    for i in range(n):
        m.add(build(default_registry, "noop", {"name": f"n{i:03d}"}))
    for _ in range(edges):
        a, b = sorted(rng.sample(range(n), 2))  # forward only: acyclic
        e = Edge(f"noop[n{a:03d}]", f"noop[n{b:03d}]")
        if e not in m.edges:
            m.connect(e)
    return m


def _groups(m: GraphModel) -> list[tuple[str, ...]]:
    return sorted(
        (ident, *sorted(r.ident for r in res.group_members)) for ident, res in m.resources.items()
    )


@pytest.mark.parametrize("seed", range(25))
def test_the_fast_path_groups_exactly_as_the_general_one(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    n = 40
    fast, slow = _model(seed, n, seed % 30), _model(seed, n, seed % 30)
    autogroup.group_vertices(fast)
    monkeypatch.setattr(autogroup, "_FAST", False)
    autogroup.group_vertices(slow)
    assert _groups(fast) == _groups(slow)
    assert [(e.from_id, e.to_id) for e in fast.edges] == [(e.from_id, e.to_id) for e in slow.edges]
    fast.order()  # still acyclic


def test_fifty_thousand_noops_group_into_one() -> None:
    m = _model(0, 0, 0)
    for i in range(50_000):
        m.add(build(default_registry, "noop", {"name": f"x{i}"}))
    assert autogroup.group_vertices(m) == 49_999
    [(_leader, res)] = m.resources.items()
    assert len(res.group_members) == 49_999
