"""Automatic edges and grouping, seen through `evergraph graph` and real runs."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import run_cli


def graph_json(path: Path, *flags: str) -> dict:  # type: ignore[type-arg]
    r = run_cli("graph", path, "--format", "json", *flags)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)  # type: ignore[no-any-return]


def auto_edges(doc: dict) -> set[tuple[str, str]]:  # type: ignore[type-arg]
    return {(e["from"], e["to"]) for e in doc["edges"] if e["auto"]}


def test_files_follow_their_nearest_managed_directory_and_exec_its_program(
    tmp_path: Path,
) -> None:
    root = tmp_path / "root"
    g = tmp_path / "g.yaml"
    g.write_text(
        f"""graph: auto
resources:
  exec:
  - {{name: run, cmd: "{root}/bin/tool --flag"}}
  file:
  - {{name: deep, path: {root}/a/b/c/deep.txt, content: "d"}}
  - {{name: tool, path: {root}/bin/tool, content: "#!/bin/sh\\necho ok\\n", mode: "0755"}}
  - {{name: a, path: {root}/a/}}
  - {{name: ab, path: {root}/a/b/, mode: "0700"}}
  - {{name: root, path: {root}/}}
  - {{name: loose, path: {root}/a/b/loose, meta: {{autoedge: false}}}}
"""
    )
    doc = graph_json(g)
    assert auto_edges(doc) == {
        ("file[root]", "file[a]"),
        ("file[a]", "file[ab]"),
        ("file[ab]", "file[deep]"),  # nearest managed parent, not a/b/c/
        ("file[root]", "file[tool]"),
        ("file[tool]", "exec[run]"),
    }
    assert auto_edges(graph_json(g, "--no-autoedges")) == set()
    # The run needs that order: the program must exist before it is executed,
    # and a/b must get its 0700 before deep.txt is written below it.
    r = run_cli("run", g, "--state-dir", tmp_path / "s", "--converged-exit")
    assert r.returncode == 0, r.stderr
    assert (root / "a/b/c/deep.txt").read_text() == "d"
    lines = r.stderr.splitlines()
    order = [
        next(i for i, ln in enumerate(lines) if f"{x}: applied" in ln)
        for x in ("file[tool]", "exec[run]")
    ]
    assert order == sorted(order)


def test_an_autoedge_that_would_close_a_cycle_is_dropped(tmp_path: Path) -> None:
    g = tmp_path / "g.yaml"
    g.write_text(
        f"""graph: c
resources:
  file:
  - {{name: dir, path: {tmp_path}/d/}}
  - {{name: f, path: {tmp_path}/d/f}}
edges:
- {{from: {{kind: file, name: f}}, to: {{kind: file, name: dir}}}}
"""
    )
    r = run_cli("graph", g, "--format", "json")
    assert r.returncode == 0, r.stderr
    assert auto_edges(json.loads(r.stdout)) == set()
    assert "dropping automatic edge file[dir] -> file[f]" in r.stderr


def test_groupable_vertices_that_cannot_reach_each_other_merge(tmp_path: Path) -> None:
    g = tmp_path / "g.yaml"
    g.write_text(
        """graph: grp
resources:
  print:
  - {name: p1, msg: one}
  - {name: p2, msg: two}
  - {name: p3, msg: three}
  - {name: solo, msg: alone, meta: {autogroup: false}}
  noop:
  - {name: mid}
edges:
- {from: {kind: print, name: p1}, to: {kind: noop, name: mid}}
- {from: {kind: noop, name: mid}, to: {kind: print, name: p3}}
"""
    )
    doc = graph_json(g)
    groups = {v["id"]: v["group"] for v in doc["vertices"]}
    # p2 joins p1; p3 cannot (p1 reaches it through mid); solo opted out
    assert groups == {
        "print[p1]": ["print[p2]"],
        "print[p3]": [],
        "print[solo]": [],
        "noop[mid]": [],
    }
    assert {(e["from"], e["to"]) for e in doc["edges"]} == {
        ("print[p1]", "noop[mid]"),
        ("noop[mid]", "print[p3]"),
    }
    assert len(graph_json(g, "--no-autogroup")["vertices"]) == 5
    r = run_cli("run", g, "--state-dir", tmp_path / "s", "--converged-exit")
    assert r.returncode == 0, r.stderr
    for msg in ("print[p1]: one", "print[p2]: two", "print[p3]: three", "print[solo]: alone"):
        assert msg in r.stderr
    assert "converged: 4 vertices clean" in r.stderr


def test_grouping_never_creates_a_cycle_on_random_graphs() -> None:
    import random

    from evergraph.engine.autogroup import group_vertices
    from evergraph.engine.model import Edge, GraphModel
    from evergraph.resources.noop import Noop
    from evergraph.resources.print import Print

    for seed in range(200):
        rng = random.Random(seed)
        model = GraphModel(name="r")
        n = rng.randint(2, 14)
        names = []
        for i in range(n):
            res = Noop(name=f"n{i}") if rng.random() < 0.5 else Print(name=f"p{i}")
            model.add(res)
            names.append(res.ident)
        for i in range(n):
            for j in range(i + 1, n):
                if rng.random() < 0.25:
                    model.connect(Edge(names[i], names[j]))
        before = len(model.resources)
        merged = group_vertices(model)
        assert len(model.resources) == before - merged
        model.dag().toposort()  # raises CycleError if grouping closed a cycle
        grouped = [m.ident for r in model.resources.values() for m in r.group_members]
        assert len(grouped) == merged
        assert sorted([*model.resources, *grouped]) == sorted(names)


def test_grouping_is_hierarchical_a_sub_kind_joins_its_parent_kind() -> None:
    from evergraph.engine.autogroup import group_vertices
    from evergraph.engine.model import GraphModel
    from tests.kit.probe import ChildProbe, Probe

    class GProbe(Probe, kw_only=True, dict=True, forbid_unknown_fields=True):
        groupable = True

    class GChild(ChildProbe, kw_only=True, dict=True, forbid_unknown_fields=True):
        groupable = True

    model = GraphModel(name="h")
    model.add(GChild(name="c1"))  # declared first, yet the parent kind leads
    model.add(GProbe(name="p1"))
    model.add(GChild(name="c2"))
    assert group_vertices(model) == 2
    assert list(model.resources) == ["probe[p1]"]
    assert sorted(m.ident for m in model.resources["probe[p1]"].group_members) == [
        "probe:child[c1]",
        "probe:child[c2]",
    ]
