"""Autogrouping: correct on random graphs with every kind of edge, linear at scale,
and a member with a notify or send/recv edge keeps its own vertex (its refresh and
received values are its own)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

import evergraph.resources  # noqa: F401  (registers the kinds)
from evergraph.engine import autogroup
from evergraph.engine.build import build
from evergraph.engine.contract import default_registry
from evergraph.engine.model import Edge, GraphModel
from tests.conftest import run_cli


def _model(seed: int, n: int, edges: int, special: float = 0.0) -> GraphModel:
    rng = random.Random(seed)
    m = GraphModel()
    for i in range(n):
        kind = "noop" if rng.random() < 0.7 else "print"
        m.add(build(default_registry, kind, {"name": f"n{i:03d}"}))
    idents = list(m.resources)
    for _ in range(edges):
        a, b = sorted(rng.sample(range(n), 2))  # forward only: acyclic
        notify = rng.random() < special
        e = Edge(idents[a], idents[b], notify)
        if not any(x.from_id == e.from_id and x.to_id == e.to_id for x in m.edges):
            m.connect(e)
    return m


@pytest.mark.parametrize("seed", range(60))
def test_grouping_keeps_every_order_and_never_groups_a_notified_vertex(seed: int) -> None:
    n = 40
    m = _model(seed, n, seed % 45, special=0.2)
    original = list(m.edges)
    notified = {x for e in original if e.notify for x in (e.from_id, e.to_id)}
    kinds = {ident: res.kind for ident, res in m.resources.items()}
    merged = autogroup.group_vertices(m)
    leader = {ident: ident for ident in m.resources}
    for ident, res in m.resources.items():
        for member in res.group_members:
            leader[member.ident] = ident
            assert member.kind == res.kind  # one key per group
            assert member.ident not in notified
            assert ident not in notified
    assert merged == n - len(m.resources)
    assert sorted(leader) == sorted(kinds)
    quotient = {(e.from_id, e.to_id, e.notify) for e in m.edges}
    for e in original:
        a, b = leader[e.from_id], leader[e.to_id]
        assert a != b, f"{e} fell inside one group"
        assert (a, b, e.notify) in quotient  # every member's order (and notify) is kept
    m.dag().toposort()  # raises CycleError if grouping closed a cycle


def test_vertices_with_edges_group_by_depth() -> None:
    m = GraphModel()
    for name in ("root", "a", "b", "c", "tail"):
        m.add(build(default_registry, "noop", {"name": name}))
    m.add(build(default_registry, "noop", {"name": "lone"}))
    for a, b in (("root", "a"), ("root", "b"), ("a", "c"), ("b", "c"), ("c", "tail")):
        m.connect(Edge(f"noop[{a}]", f"noop[{b}]"))
    assert autogroup.group_vertices(m) == 2
    groups = {
        ident: sorted(r.ident for r in res.group_members) for ident, res in m.resources.items()
    }
    # a and b are both at depth 1; lone has no edge and joins the first group
    assert groups == {
        "noop[root]": ["noop[lone]"],
        "noop[a]": ["noop[b]"],
        "noop[c]": [],
        "noop[tail]": [],
    }


def test_twenty_thousand_noops_in_chains_group_in_linear_time() -> None:
    # 2,000 chains of 10: each depth's 2,000 vertices form one group. The earlier
    # closure update was quadratic here (8,000 took 12 s); this would time out.
    m = GraphModel()
    for c in range(2_000):
        for d in range(10):
            m.add(build(default_registry, "noop", {"name": f"c{c}d{d}"}))
            if d:
                m.connect(Edge(f"noop[c{c}d{d - 1}]", f"noop[c{c}d{d}]"))
    assert autogroup.group_vertices(m) == 20_000 - 10
    assert len(m.edges) == 9
    m.dag().toposort()


def test_fifty_thousand_noops_group_into_one() -> None:
    m = GraphModel()
    for i in range(50_000):
        m.add(build(default_registry, "noop", {"name": f"x{i}"}))
    assert autogroup.group_vertices(m) == 49_999
    [(_leader, res)] = m.resources.items()
    assert len(res.group_members) == 49_999


def test_a_notified_refresh_only_print_is_refreshed_not_swallowed_by_a_group(
    tmp_path: Path,
) -> None:
    g = tmp_path / "g.yaml"
    g.write_text(
        f"""graph: g
resources:
  file:
  - {{name: f, path: {tmp_path / "f"}, content: "x\\n"}}
  print:
  - {{name: lead, msg: lead}}
  - {{name: notified, msg: REFRESHED, refresh_only: true}}
  - {{name: other, msg: other}}
edges:
- {{from: {{kind: file, name: f}}, to: {{kind: print, name: notified}}, notify: true}}
"""
    )
    r = run_cli("run", g, "--state-dir", tmp_path / "s", "--converged-exit")
    assert r.returncode == 0, r.stderr
    assert "print[notified]: REFRESHED" in r.stderr
    doc = run_cli("graph", g, "--format", "json")
    assert doc.returncode == 0, doc.stderr
    groups = {v["id"]: v["group"] for v in json.loads(doc.stdout)["vertices"]}
    assert groups == {"file[f]": [], "print[lead]": ["print[other]"], "print[notified]": []}


class _Unread(list[Edge]):
    """Edges that must not be read."""

    def __iter__(self):  # type: ignore[no-untyped-def]
        raise AssertionError("the edges were read")


def test_a_graph_without_two_groupable_resources_is_left_without_a_pass_over_its_edges() -> None:
    """10k files (not groupable) and their 10k edges: nothing to group, and the edges
    are not walked to find that out (issue 28: ~4 ms of a one-shot run's start)."""
    m = GraphModel()
    for i in range(3):
        m.add(build(default_registry, "file", {"name": f"f{i}", "path": f"/srv/x/f{i}"}))
    m.add(build(default_registry, "noop", {"name": "only"}))  # one groupable: no pair
    a, b, *_ = list(m.resources)
    m.edges = _Unread([Edge(a, b)])
    assert autogroup.group_vertices(m) == 0
    assert len(m.resources) == 4
