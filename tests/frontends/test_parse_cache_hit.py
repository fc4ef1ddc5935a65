"""What a one-shot run's parse cache hit does after the decode (issue 28): the
check validates again only the resources `validate` gave state (the others'
validation is a function of the parameters the entry's parse validated), and
the automatic edges `prepare` adds are taken from the entry (found at the parse,
for graphs whose kinds' keys are their parameters alone).

A hit still gives the graph the parse gives (resources, edges, groups after
`prepare`, warnings), on mgmt's corpus, on random graphs, and on graphs of
files whose automatic edges the explicit ones make redundant or drop for closing
a cycle. And it trusts an entry (ours, 0600 in a 0700 directory) only as far as
its parse could have made it: an entry holding a graph whose claims conflict or
whose edges cycle is not used (the file is parsed), and automatic edges that
would close a cycle or name no resource of the graph are found anew.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

import msgspec
import pytest

from evergraph.engine.autoedge import automatic_edges
from evergraph.engine.build import build
from evergraph.engine.contract import DEFAULT_META, default_registry
from evergraph.engine.model import Edge, GraphModel
from evergraph.engine.prepare import prepare
from evergraph.errors import InputError
from evergraph.frontends import cache as parse_cache
from evergraph.frontends.yaml import YamlFrontend
from evergraph.resources.file import File
from tests.frontends.test_parse_cache import (
    REG,
    Loads,
    _corpus,
    _random_graph,
    _view,
    body_of,
    signed,
)


@pytest.fixture
def loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Loads:
    return Loads(tmp_path / "state", monkeypatch)


def _once(loads: Loads | None, path: Path) -> GraphModel:
    """A one-shot run's load (with the cache of `loads`, or none)."""
    f = YamlFrontend(path, REG)
    if loads is not None:
        f.cache_parses(loads.state)
    f.one_shot()
    return f.load()


def _prepared(
    load: object, path: Path, caplog: pytest.LogCaptureFixture
) -> tuple[object, list[str]]:
    """The model, then prepared (its edges, groups and every field), and the warnings
    given; or the error."""
    caplog.clear()
    try:
        model = load(path)  # type: ignore[operator]
        view = _view(model)[:-2]  # (a one-shot load keeps no claims)
        prepare(model)
    except InputError as e:
        return f"{e.where}: {e.message}", []
    members = {i: [m.ident for m in r.group_members] for i, r in model.resources.items()}
    got = (view, members, [tuple(e) for e in model.edges])
    return got, [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def _same_either_way(loads: Loads, path: Path, caplog: pytest.LogCaptureFixture) -> bool:
    """Parsed, filling the cache, and from it: one outcome; whether the hit knew its
    automatic edges (None: an error, not cached)."""
    plain = _prepared(lambda p: _once(None, p), path, caplog)
    assert _prepared(lambda p: _once(loads, p), path, caplog) == plain, path
    if isinstance(plain[0], str):
        return False
    n = loads.parses
    knew: list[bool] = []

    def hit(p: Path) -> GraphModel:
        model = _once(loads, p)
        knew.append(model.auto is not None)
        return model

    assert _prepared(hit, path, caplog) == plain, path
    assert loads.parses == n, f"{path}: parsed, not taken from the cache"
    return knew[0]


def test_mgmt_corpus_a_hit_gives_the_parsed_graph(
    loads: Loads, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    known = sum(_same_either_way(loads, path, caplog) for path in _corpus())
    assert known >= 20, known


def test_random_graphs_a_hit_gives_the_parsed_graph(
    loads: Loads, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    rng = random.Random(2029)
    known = 0
    for i in range(120):
        path = tmp_path / f"g{i}.yaml"
        path.write_text(_random_graph(rng, tmp_path))
        known += _same_either_way(loads, path, caplog)
    assert known > 30, known


def _files_graph(rng: random.Random, root: Path) -> str:
    """Directories and files (some without a managed directory), explicit edges
    from a file's directory (redundant with the automatic one), and backward
    ones (the automatic edge they oppose is dropped, with a warning)."""
    dirs = [f"{root}/d{j}/" for j in range(rng.randint(1, 4))]
    rows = ["graph: w\nresources:\n  file:\n"]
    for j, d in enumerate(dirs):
        rows.append(f"  - {{name: d{j}, path: {d}}}\n")
    files = []
    for i in range(rng.randint(1, 12)):
        j = rng.randrange(len(dirs) + 1)
        d = dirs[j] if j < len(dirs) else f"{root}/free/"
        files.append((f"f{i}", j))
        rows.append(f"  - {{name: f{i}, path: {d}f{i}, content: x{i}}}\n")
    rows.append("edges:\n")
    for name, j in files:
        if j >= len(dirs) or rng.random() < 0.3:
            continue
        ends = [f"d{j}", name] if rng.random() < 0.8 else [name, f"d{j}"]
        rows.append(
            f"- name: e{name}\n  from:\n    kind: file\n    name: {ends[0]}\n"
            f"  to:\n    kind: file\n    name: {ends[1]}\n"
        )
    return "".join(rows)


def test_file_graphs_with_explicit_edges_a_hit_gives_the_parsed_graph(
    loads: Loads, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    rng = random.Random(28)
    dropped = 0
    for i in range(60):
        path = tmp_path / f"w{i}.yaml"
        path.write_text(_files_graph(rng, tmp_path / "t"))
        assert _same_either_way(loads, path, caplog), path  # every such hit knows them
        dropped += "closes a cycle" in caplog.text
    assert dropped > 5, dropped


def test_a_hit_validates_only_the_resources_validate_gave_state(
    loads: Loads, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    g = tmp_path / "g.yaml"
    g.write_text(_files_graph(random.Random(1), tmp_path / "t"))
    loads.miss(g)
    calls: list[str] = []
    real = File.validate

    def counting(self: File) -> None:
        calls.append(self.ident)
        real(self)

    monkeypatch.setattr(File, "validate", counting)
    model = _once(loads, g)
    assert loads.parses == 1
    assert model.resources
    assert calls == []
    # one the entry says `validate` gave state of its own: validated again
    (entry_path,) = loads.entries
    entry, _ = parse_cache.decode(body_of(entry_path), REG)
    some = next(iter(model.resources))
    entry.stateful = [some]
    entry_path.write_bytes(signed(entry_path, parse_cache._encoder.encode(entry)))
    _once(loads, g)
    assert loads.parses == 1
    assert calls == [some]


# -- planted entries ------------------------------------------------------------------

GRAPH = (
    "graph: g\nresources:\n  file:\n"
    "  - {name: d, path: /srv/p/}\n"
    "  - {name: a, path: /srv/p/a, content: one}\n"
    "  - {name: b, path: /srv/p/b, content: two}\n"
)


def _plant(
    loads: Loads, path: Path, model: GraphModel, auto: object = None, sign: bool = True
) -> None:
    """Entry `model` under the key of `path`'s content, as the cache writes its own
    (`sign`: under its secret, as only a user who can read it could)."""
    (entry,) = loads.entries
    key = parse_cache.entry_key(path.read_bytes(), str(path), REG)
    assert entry.name == key
    body = parse_cache.encode(key, model, [], auto)  # type: ignore[arg-type]
    entry.write_bytes(signed(entry, body) if sign else body)
    entry.chmod(0o600)


def _file(name: str, path: str, content: str | None = None) -> File:
    params = {"name": name, "path": path}
    if content is not None:
        params["content"] = content
    res = build(default_registry, "file", params)
    assert isinstance(res, File)
    return res


def _model(*resources: File, edges: tuple[Edge, ...] = ()) -> GraphModel:
    m = GraphModel(name="g")
    for r in resources:
        m.resources[r.ident] = r
    m.edges.extend(edges)
    return m


def test_a_planted_entry_of_conflicting_claims_or_a_cycle_is_not_used(
    loads: Loads, tmp_path: Path
) -> None:
    """Planted by someone who cannot read the cache's secret: not its MAC, a miss.
    (A one-shot hit does not check the claims and the cycles again: see
    frontends/cache.py, what a hit trusts.)"""
    g = tmp_path / "g.yaml"
    g.write_text(GRAPH)
    parsed = _view(loads.miss(g))
    loads.hit(g)
    d = _file("d", "/srv/p/")
    a, b = _file("a", "/srv/p/a", "one"), _file("b", "/srv/p/b", "two")
    fight = _file("b", "/srv/p/a", "two")  # manages a's file with other content
    cycle = (Edge(a.ident, b.ident), Edge(b.ident, a.ident))
    for planted in (_model(d, a, fight), _model(d, a, b, edges=cycle)):
        with pytest.raises(InputError):
            planted.check()  # what a parse of such a graph refuses
        _plant(loads, g, planted, sign=False)
        assert _view(loads.miss(g)) == parsed  # parsed: the file's own graph
        assert _view(loads.hit(g)) == parsed  # (its entry written again)


def test_planted_automatic_edges_closing_a_cycle_or_naming_no_resource_are_found_anew(
    loads: Loads, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    g = tmp_path / "g.yaml"
    g.write_text(GRAPH)
    plain = _prepared(lambda p: _once(None, p), g, caplog)
    model = loads.miss(g)
    auto = automatic_edges(model)
    assert model.auto == auto  # (the parse's: its prepare does not find them again)
    assert auto is not None
    assert len(auto.edges) == 2
    a, b = "file[a]", "file[b]"
    for edges in (
        [*auto.edges, Edge(a, b, name="auto"), Edge(b, a, name="auto")],  # a cycle
        [*auto.edges, Edge("file[nowhere]", a, name="auto")],  # no such resource
        [*auto.edges, Edge(a, b, notify=True, name="auto")],  # not an automatic edge
    ):
        _plant(loads, g, model, auto._replace(edges=edges))
        n = loads.parses
        assert _prepared(lambda p: _once(loads, p), g, caplog) == plain
        assert loads.parses == n  # (a hit: the entry's resources and edges are the file's)


def test_an_entry_leaves_out_the_fields_at_their_defaults_and_a_hit_gives_them_back(
    loads: Loads, tmp_path: Path
) -> None:
    """A hit decodes only what the graph gave (a File's ~20 fields, its meta's ~17,
    are mostly defaults); a value equal to its default but of another type is kept
    as it was, and a default meta comes back as the one shared DEFAULT_META."""
    g = tmp_path / "g.yaml"
    g.write_text(
        "resources:\n  file:\n"
        f"  - {{name: d, path: {tmp_path}/t/}}\n"
        f"  - {{name: a, path: {tmp_path}/t/a, content: one, mode: '0644'}}\n"
        f"  - {{name: b, path: {tmp_path}/t/b, meta: {{retry: 2, poll: 0.0}}}}\n"
    )
    parsed = _once(None, g)
    loads.miss(g)
    (entry_path,) = loads.entries
    data = entry_path.read_bytes()
    # field names at their defaults are not in the entry (msgpack: names as strings)
    for absent in (b"recurse", b"purge", b"symlink", b"owner", b"fragments"):
        assert absent not in data, absent
    n = loads.parses
    hit = _once(loads, g)
    assert loads.parses == n  # taken from the entry
    assert list(hit.resources) == list(parsed.resources)
    for ident, res in parsed.resources.items():
        got = hit.resources[ident]
        assert type(got) is type(res), ident
        assert got == res, ident
        for f in msgspec.structs.fields(res):
            assert type(getattr(got, f.name)) is type(getattr(res, f.name)), (ident, f.name)
    assert hit.resources["file[d]"].meta is DEFAULT_META
    assert hit.resources["file[b]"].meta.retry == 2


def test_a_one_shot_hit_never_decodes_the_text_and_bad_bytes_are_still_refused(
    loads: Loads, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bytes of a hit parsed once, so they are UTF-8: a one-shot hit does not
    decode them again (W1 10k: 2.7 MB of text nothing reads). Bytes that are not
    UTF-8 are never cached: refused as without a cache."""
    from evergraph.frontends import yaml as yaml_frontend

    g = tmp_path / "g.yaml"
    g.write_text(GRAPH)
    loads.miss(g)
    decoded: list[Path] = []
    real = yaml_frontend.graph_text

    def counting(data: bytes, path: Path) -> str:
        decoded.append(path)
        return real(data, path)

    monkeypatch.setattr(yaml_frontend, "graph_text", counting)
    n = loads.parses
    assert list(_once(loads, g).resources) == ["file[d]", "file[a]", "file[b]"]
    assert loads.parses == n
    assert decoded == []
    loads.hit(g)  # a run that follows the file keeps its text for a live edit
    assert decoded == [g.absolute()]
    g.write_bytes(GRAPH.encode() + b"# \xff\n")
    with pytest.raises(InputError, match="not UTF-8"):
        _once(loads, g)
