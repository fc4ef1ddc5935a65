"""A kind may declare the namespaces it wants (`wants_namespaces`): its
`autoedge_wants` is then called only when the graph provides one of them."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from typing import ClassVar

import evergraph.resources  # noqa: F401  (registers the kinds)
from evergraph.engine.autoedge import add_autoedges
from evergraph.engine.build import build
from evergraph.engine.contract import Resource, default_registry
from evergraph.engine.model import GraphModel
from evergraph.resources.file import File


class Wanting(Resource, kw_only=True, dict=True):
    """Wants `dir:` keys of its name's parents; counts the calls."""

    kind: ClassVar[str] = "test:wanting"
    wants_namespaces: ClassVar[frozenset[str] | None] = frozenset({"dir"})
    calls: ClassVar[int] = 0

    def autoedge_wants(self) -> Iterable[Iterable[str]]:
        Wanting.calls += 1
        return [[f"dir:{os.path.dirname(self.name)}/"]]


def _file(path: str) -> Resource:
    params = {"name": path} if path.endswith("/") else {"name": path, "content": "x"}
    return build(default_registry, "file", params)


def test_wants_are_asked_only_when_the_graph_provides_their_namespace() -> None:
    Wanting.calls = 0
    m = GraphModel(name="g")
    m.add(Wanting(name="/srv/app/conf"))
    m.add(_file("/srv/other"))  # provides path:, not dir:
    m.check()
    assert add_autoedges(m) == 0
    assert Wanting.calls == 0
    m2 = GraphModel(name="g")
    m2.add(Wanting(name="/srv/app/conf"))
    m2.add(_file("/srv/app/"))  # a directory: provides dir:/srv/app/
    m2.check()
    assert add_autoedges(m2) == 1
    assert Wanting.calls == 1
    assert [(e.from_id, e.to_id) for e in m2.edges] == [
        ("file[/srv/app/]", "test:wanting[/srv/app/conf]")
    ]


def test_the_file_kind_wants_no_namespace_it_does_not_declare() -> None:
    declared = File.wants_namespaces
    assert declared is not None
    for path in ("/a", "/a/b/c", "/a/b/", "/", "/x/../y/./z", "rel/ignored"):
        res = File(name=path)
        groups: Iterator[Iterable[str]] = iter(res.autoedge_wants())
        for group in groups:
            for key in group:
                assert key.partition(":")[0] in declared, (path, key)


def test_a_file_under_a_managed_directory_still_gets_its_edge() -> None:
    m = GraphModel(name="g")
    m.add(_file("/srv/d/f"))
    m.add(_file("/srv/d/"))
    m.check()
    assert add_autoedges(m) == 1
    assert [(e.from_id, e.to_id) for e in m.edges] == [("file[/srv/d/]", "file[/srv/d/f]")]
