"""graph/: the pure DAG."""

from __future__ import annotations

import itertools
import random

import pytest

from evergraph.graph import DAG, CycleError, diff_keys, topo_order


def test_toposort_puts_parents_first() -> None:
    rng = random.Random(7)
    edges = [(p, v) for v in range(300) for p in rng.sample(range(v), min(v, 3))]
    for order in (DAG.build(range(300), edges).toposort(), topo_order(range(300), edges)):
        pos = {v: i for i, v in enumerate(order)}
        assert len(pos) == len(order) == 300
        for a, b in edges:
            assert pos[a] < pos[b]


def test_cycle_report_names_members_in_order() -> None:
    edges = [("root", "a"), ("a", "b"), ("b", "c"), ("c", "a"), ("c", "leaf")]
    for sort in (
        lambda: DAG.build(["root"], edges).toposort(),
        lambda: topo_order(["root"], edges),
    ):
        with pytest.raises(CycleError) as e:
            sort()
        cyc = e.value.cycle
        assert cyc[0] == cyc[-1]
        assert set(cyc) == {"a", "b", "c"}
        for x, y in itertools.pairwise(cyc):
            assert (x, y) in edges
        assert str(e.value) == "cycle: a -> b -> c -> a"  # a stable report


def test_parallel_edges_collapse_and_unlisted_vertices_count() -> None:
    edges = [("a", "b"), ("a", "b"), ("b", "c")]
    assert DAG.build(["a"], edges).toposort() == ["a", "b", "c"]
    assert topo_order(["a"], edges) == ["a", "b", "c"]
    assert DAG.build(["x"], []).toposort() == ["x"]


def test_diff_keys() -> None:
    removed, added, common = diff_keys({"a": 1, "b": 2}, {"b": 3, "c": 4})
    assert (removed, added, common) == (["a"], ["c"], ["b"])
