"""Automatic edges and the graph check on their fast paths (issue 28) give what the
general algorithm gives, on seeded random graphs of files, directories, commands
and noops with explicit edges (forward, backward, closing cycles with automatic
edges, or cycles of their own):

- `add_autoedges` adds the very edges, in order, with the same count and warnings,
  as the reference below (the algorithm as it was before its fast paths), or
  raises the same cycle;
- `automatic_edges` (what a parse cache entry keeps) applied through
  `GraphModel.auto` gives the same again, and changes neither the model nor the
  keys kept for a live run's next prepare;
- `GraphModel.check` accepts exactly the acyclic graphs and returns a
  topological order of them (its fast path: the declaration order when every
  edge goes forward in it).
"""

from __future__ import annotations

import itertools
import logging
import random

import pytest

import evergraph.resources  # noqa: F401  (registers the kinds)
from evergraph.engine import autoedge
from evergraph.engine.autoedge import add_autoedges, automatic_edges
from evergraph.engine.build import build
from evergraph.engine.contract import Resource, default_registry
from evergraph.engine.model import Edge, GraphCycleError, GraphModel
from evergraph.graph import CycleError, topo_order


def reference_autoedges(model: GraphModel) -> tuple[int, list[tuple[str, str]]]:
    """The automatic edges as found before any fast path: (count, dropped pairs)."""
    index: dict[str, str] = {}
    for ident, res in model.resources.items():
        if res.meta.autoedge:
            for key in res.autoedge_provides():
                index.setdefault(key, ident)
    if not index:
        return 0, []
    namespaces = {key.partition(":")[0] for key in index}
    existing = {(e.from_id, e.to_id) for e in model.edges}
    added: list[Edge] = []
    for ident, res in model.resources.items():
        if not res.meta.autoedge:
            continue
        for group in res.autoedge_wants():
            keys_of = iter(group)
            first = next(keys_of, None)
            if first is None or first.partition(":")[0] not in namespaces:
                continue
            for key in itertools.chain((first,), keys_of):
                provider = index.get(key)
                if provider is None or provider == ident:
                    continue
                if (provider, ident) not in existing:
                    existing.add((provider, ident))
                    added.append(Edge(provider, ident, name="auto"))
                break
    if not added:
        return 0, []
    model.edges.extend(added)
    auto = {(e.from_id, e.to_id) for e in added}
    dropped: list[tuple[str, str]] = []
    while True:
        try:
            model.order()
            break
        except CycleError as e:
            cycle = [str(v) for v in e.cycle]
            drop = next((p for p in itertools.pairwise(cycle) if p in auto), None)
            if drop is None:
                raise GraphCycleError(cycle) from None
            logging.getLogger("evergraph.autoedge").warning(
                "dropping automatic edge %s -> %s: it closes a cycle", *drop
            )
            dropped.append(drop)
            auto.discard(drop)
            model.edges[:] = [
                e for e in model.edges if not (e.name == "auto" and (e.from_id, e.to_id) == drop)
            ]
    return len(auto), dropped


def _res(kind: str, params: dict[str, object]) -> Resource:
    return build(default_registry, kind, params)


def random_model(rng: random.Random) -> GraphModel:
    """Files and directories of a small tree (some declared twice under other names,
    some without automatic edges), commands running some of them, noops; explicit
    edges between any two, in any direction."""
    m = GraphModel(name="g")
    dirs = ["/", "/r/", "/r/a/", "/r/a/b/", "/r/c/", "/r/c/d/", "/s/"]  # ("/": the root
    # itself, and files right under it)
    paths = [d + f"f{i}" for d in dirs for i in range(3)]
    chosen = rng.sample(dirs, rng.randint(0, len(dirs))) + rng.sample(
        paths, rng.randint(1, len(paths))
    )
    rng.shuffle(chosen)
    for n, path in enumerate(chosen):
        params: dict[str, object] = {"name": f"r{n}", "path": path}
        if not path.endswith("/"):
            params["content"] = f"x{n}"
        if rng.random() < 0.1:
            params["meta"] = {"autoedge": False}
        m.add(_res("file", params))
    for i in range(rng.randint(0, 3)):
        cmd = rng.choice(paths) if rng.random() < 0.7 else "/bin/true"
        m.add(_res("exec", {"name": f"x{i}", "cmd": f"{cmd} --flag"}))
    for i in range(rng.randint(0, 3)):
        m.add(_res("noop", {"name": f"n{i}"}))
    idents = list(m.resources)
    seen: set[tuple[str, str]] = set()
    for _ in range(rng.randint(0, len(idents))):
        a, b = rng.sample(idents, 2)
        if rng.random() < 0.7 and idents.index(a) > idents.index(b):
            a, b = b, a  # mostly forward: backward ones may close cycles
        if (a, b) not in seen:
            seen.add((a, b))
            m.connect(Edge(a, b, name=f"e{len(seen)}"))
    return m


def _copy(m: GraphModel) -> GraphModel:
    return GraphModel(name=m.name, resources=dict(m.resources), edges=list(m.edges))


def _outcome(
    run: object, m: GraphModel, caplog: pytest.LogCaptureFixture
) -> tuple[object, list[str]]:
    caplog.clear()
    try:
        got: object = (run(m), [tuple(e) for e in m.edges])  # type: ignore[operator]
    except GraphCycleError as e:
        got = e.message
    warned = [r.getMessage() for r in caplog.records if r.name == "evergraph.autoedge"]
    return got, warned


@pytest.mark.parametrize("seed", range(4))
def test_random_graphs_get_the_reference_automatic_edges(
    seed: int, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="evergraph.autoedge")
    rng = random.Random(seed)
    added = dropped = known = cycles = 0
    for _ in range(150):
        m = random_model(rng)
        want, warned = _outcome(lambda x: reference_autoedges(x)[0], _copy(m), caplog)
        assert _outcome(add_autoedges, _copy(m), caplog) == (want, warned)
        kept = dict(autoedge._last)
        edges = list(m.edges)
        auto = automatic_edges(m)
        assert m.edges == edges
        assert m.auto is None
        assert autoedge._last == kept  # and the keys a live run keeps
        if isinstance(want, str):
            assert auto is None  # a cycle: the run reports it
            cycles += 1
            continue
        assert auto is not None  # (these kinds' keys are their parameters' alone)
        known += 1
        with_known = _copy(m)
        with_known.auto = auto
        assert _outcome(add_autoedges, with_known, caplog) == (want, warned)
        assert with_known.auto is None  # used once
        added += bool(want[0])  # type: ignore[index]
        dropped += bool(warned)
    # every case is exercised: edges added, dropped, known, and cycles
    assert min(added, known) > 20, (added, known)
    assert min(dropped, cycles) > 3, (dropped, cycles)


def test_known_edges_are_not_used_for_a_model_changed_since_or_closing_a_cycle(
    caplog: pytest.LogCaptureFixture,
) -> None:
    m = GraphModel(name="g")
    m.add(_res("file", {"name": "/r/"}))
    m.add(_res("file", {"name": "/r/f", "content": "x"}))
    auto = automatic_edges(m)
    assert auto is not None
    assert [tuple(e)[:2] for e in auto.edges] == [("file[/r/]", "file[/r/f]")]
    # resources added since (collected ones): found anew
    grown = _copy(m)
    grown.add(_res("file", {"name": "/r/g", "content": "y"}))
    grown.auto = auto
    assert add_autoedges(grown) == 2
    # edges that would close a cycle (a planted entry's): found anew, the user's
    # explicit order winning as always
    back = _copy(m)
    back.connect(Edge("file[/r/f]", "file[/r/]"))
    back.auto = auto._replace(edges_before=1)
    caplog.set_level(logging.WARNING, logger="evergraph.autoedge")
    assert add_autoedges(back) == 0
    assert [tuple(e)[:2] for e in back.edges] == [("file[/r/f]", "file[/r/]")]
    assert "closes a cycle" in caplog.text


def test_no_edges_are_known_for_kinds_whose_keys_are_not_their_parameters_alone() -> None:
    m = GraphModel(name="g")
    m.add(_res("file", {"name": "/r/f", "content": "x"}))
    m.add(_res("pkg", {"name": "cowsay"}))  # provides the files it installs
    assert automatic_edges(m) is None


@pytest.mark.parametrize("seed", range(3))
def test_the_check_accepts_exactly_the_acyclic_graphs_in_a_topological_order(
    seed: int,
) -> None:
    rng = random.Random(100 + seed)
    forward = cyclic = 0
    for _ in range(200):
        m = random_model(rng)
        try:
            topo_order(m.resources, ((e.from_id, e.to_id) for e in m.edges))
        except CycleError:
            with pytest.raises(GraphCycleError):
                m.check()
            cyclic += 1
            continue
        order = m.check()
        assert sorted(order) == sorted(m.resources)
        pos = {v: i for i, v in enumerate(order)}
        assert all(pos[e.from_id] < pos[e.to_id] for e in m.edges)
        forward += order == list(m.resources)
    assert forward > 20, forward  # (the fast path)
    assert cyclic > 10, cyclic
