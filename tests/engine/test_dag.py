"""graph/: the pure DAG."""

from __future__ import annotations

import itertools
import random

import pytest

from evergraph.graph import DAG, CycleError, diff_keys


def test_toposort_puts_parents_first() -> None:
    rng = random.Random(7)
    g: DAG[int] = DAG()
    for v in range(300):
        g.add_vertex(v)
        for p in rng.sample(range(v), min(v, 3)):
            g.add_edge(p, v)
    pos = {v: i for i, v in enumerate(g.toposort())}
    assert len(pos) == 300
    for a, b in g.edges():
        assert pos[a] < pos[b]


def test_cycle_report_names_members_in_order() -> None:
    g: DAG[str] = DAG()
    g.add_edge("root", "a")
    g.add_edge("a", "b")
    g.add_edge("b", "c")
    g.add_edge("c", "a")
    g.add_edge("c", "leaf")
    with pytest.raises(CycleError) as e:
        g.toposort()
    cyc = e.value.cycle
    assert cyc[0] == cyc[-1]
    assert set(cyc) == {"a", "b", "c"}
    for x, y in itertools.pairwise(cyc):
        assert y in g.children(x)


def test_parallel_edges_collapse_and_relatives() -> None:
    g: DAG[str] = DAG()
    g.add_edge("a", "b")
    g.add_edge("a", "b")
    g.add_edge("b", "c")
    assert list(g.edges()) == [("a", "b"), ("b", "c")]
    assert g.ancestors("c") == {"a", "b"}
    assert g.descendants("a") == {"b", "c"}


def test_diff_keys() -> None:
    removed, added, common = diff_keys({"a": 1, "b": 2}, {"b": 3, "c": 4})
    assert (removed, added, common) == (["a"], ["c"], ["b"])
