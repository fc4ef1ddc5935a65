"""The YAML frontend's parse cache (`frontends/cache.py`, issue 28): a model
taken from the cache is exactly the one the parse gives (resources in order
with their parameters and meta, edges with notify and send/recv, collect
specs, groups after `prepare`, warnings, what `validated()` keeps), on mgmt's
corpus and on seeded random graphs; an entry made from other content, another
version or other kinds is never used (an edit, and a rewrite of the same size
with the same mtime, both run the new content); an entry someone else could
have planted, or a corrupt one, is ignored (the file is parsed, never an
error); errors are never cached and name the same `file:line:col`."""

from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from evergraph.engine.contract import Registry
from evergraph.engine.model import GraphModel
from evergraph.engine.prepare import prepare
from evergraph.errors import InputError
from evergraph.frontends import cache as parse_cache
from evergraph.frontends import yaml as yaml_frontend
from evergraph.frontends.open import builtin_registry, open_frontend
from evergraph.frontends.yaml import YamlFrontend, parse_yaml
from evergraph.resources.noop import Noop
from tests.conftest import run_cli
from tests.kit.models import model_groups, model_view

REG = builtin_registry()
MGMT_YAML = Path("/work/shared/mgmt-yaml")


class Loads:
    """Loads of graph files through a frontend with a parse cache in `state`,
    counting the parses (a load that did not parse took the cache's model)."""

    def __init__(self, state: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.state = state
        state.mkdir(parents=True, exist_ok=True)  # (the cache never makes a state dir)
        self.parses = 0
        real = yaml_frontend.parse_yaml

        def counting(*args: object, **kw: object) -> GraphModel:
            self.parses += 1
            return real(*args, **kw)  # type: ignore[arg-type]

        monkeypatch.setattr(yaml_frontend, "parse_yaml", counting)

    @property
    def entries(self) -> list[Path]:
        d = self.state / parse_cache.SUBDIR
        return sorted(p for p in d.iterdir() if not p.name.startswith(".")) if d.is_dir() else []

    def load(self, path: Path, registry: Registry = REG) -> GraphModel:
        f = YamlFrontend(path, registry)
        f.cache_parses(self.state)
        return f.load()

    def hit(self, path: Path, registry: Registry = REG) -> GraphModel:
        """A load that must take the cache's model."""
        before = self.parses
        model = self.load(path, registry)
        assert self.parses == before, f"{path}: parsed, not taken from the cache"
        return model

    def miss(self, path: Path, registry: Registry = REG) -> GraphModel:
        """A load that must parse the file."""
        before = self.parses
        model = self.load(path, registry)
        assert self.parses == before + 1, f"{path}: taken from the cache, not parsed"
        return model


def entries_in(d: Path) -> list[Path]:
    """The entries of cache directory `d` (not its secret)."""
    return sorted(p for p in d.iterdir() if p.name != parse_cache.KEY_NAME)


def signed(entry: Path, body: bytes) -> bytes:
    """`body` as the cache writes an entry next to `entry`: its MAC under the
    cache's secret first (what only a user who can read the secret can make)."""
    secret = (entry.parent / parse_cache.KEY_NAME).read_bytes()
    return parse_cache._mac(secret, body) + body


def body_of(entry: Path) -> bytes:
    return entry.read_bytes()[parse_cache.MAC_SIZE :]


@pytest.fixture
def loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Loads:
    return Loads(tmp_path / "state", monkeypatch)


def _view(model: GraphModel) -> tuple[object, ...]:
    """All a graph is (`model_view`), and the claims `validated()` keeps."""
    valid = model.validated()
    return (
        *model_view(model),
        sorted(valid),
        {i: (list(w), list(p)) for i, (w, p) in valid.claims.items()},
    )


_groups = model_groups


def _outcome(
    load: object, path: Path, caplog: pytest.LogCaptureFixture
) -> tuple[object, list[tuple[int, str]]]:
    """(the model's view and groups, or the error), and the records logged."""
    caplog.clear()
    try:
        model = load(path)  # type: ignore[operator]
    except InputError as e:
        got: object = f"{e.where}: {e.message}"
    else:
        got = (_view(model), _groups(model))
    logged = [
        (r.levelno, r.getMessage())
        for r in caplog.records
        if r.name.startswith("evergraph.frontend") and r.levelno >= logging.WARNING
    ]
    return got, logged


def _parsed(path: Path) -> GraphModel:
    """The model as the frontend's parse gives it, without a cache."""
    return YamlFrontend(path, REG).load()


def _same_either_way(loads: Loads, path: Path, caplog: pytest.LogCaptureFixture) -> bool:
    """The parse, a load that fills the cache and a load from it give one outcome;
    whether the file was a graph (else no entry is kept)."""
    plain = _outcome(_parsed, path, caplog)
    first = _outcome(loads.load, path, caplog)
    assert first == plain, path
    if isinstance(plain[0], str):
        n = loads.parses
        assert _outcome(loads.load, path, caplog) == plain, path
        assert loads.parses == n + 1, f"{path}: an error was cached"
        return False
    assert _outcome(loads.hit, path, caplog) == plain, path
    return True


# -- mgmt's corpus ----------------------------------------------------------------------


def _corpus() -> Iterator[Path]:
    if not MGMT_YAML.is_dir():
        pytest.skip(f"{MGMT_YAML} is absent (mgmt's examples are not part of this repository)")
    yield from sorted(MGMT_YAML.glob("*.yaml"))


def test_mgmt_corpus_the_cached_model_is_the_parsed_one(
    loads: Loads, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    graphs = errors = 0
    warned = []
    for path in _corpus():
        if _same_either_way(loads, path, caplog):
            graphs += 1
        else:
            errors += 1
        if _outcome(_parsed, path, caplog)[1]:
            warned.append(path.name)
    # both outcomes, and graphs that warn (keys mgmt's code dropped), are exercised
    assert graphs >= 40, graphs
    assert errors >= 1, errors
    assert warned, "no file of the corpus warns"
    assert len(loads.entries) == min(graphs, parse_cache.MAX_ENTRIES)


# -- random graphs ----------------------------------------------------------------------

NAMES = ["a", "n1", "web-1", "x.y", "/etc/hosts", "a:b", "é", "x y", "@@exp", "true", "1"]


def _value(rng: random.Random) -> str:
    return json.dumps(
        rng.choice(["", "text", "line\nbreak", "ünï", "0741", "a: b", "#", "yes", "1.5"])
    )


def _meta(rng: random.Random) -> str:
    fields = [
        "noop: true",
        "retry: 3",
        "delay: 10",
        "poll: 5",
        "sema: [lock, 'pool:2']",
        "hidden: true",
        "autogroup: false",
        "autoedge: false",
        "export: [h1]",
        "limit: .inf",
    ]
    return "{" + ", ".join(rng.sample(fields, rng.randint(1, 3))) + "}"


def _random_graph(rng: random.Random, root: Path) -> str:
    names = rng.sample(NAMES, rng.randint(2, len(NAMES)))
    rows: list[str] = ["  noop:\n"]
    for name in names:
        extra = f", comment: {_value(rng)}" if rng.random() < 0.5 else ""
        meta = f", meta: {_meta(rng)}" if rng.random() < 0.3 else ""
        rows.append(f"  - {{name: {json.dumps(name)}{extra}{meta}}}\n")
    if rng.random() < 0.5:
        rows.append("  print:\n")
        for i in range(rng.randint(1, 4)):
            notify = ", refresh_only: true" if rng.random() < 0.5 else ""
            rows.append(f"  - {{name: p{i}, msg: {_value(rng)}{notify}}}\n")
    if rng.random() < 0.4:
        rows.append("  exec:\n")
        for i in range(rng.randint(1, 3)):
            dropped = "\n    timeout: 5" if rng.random() < 0.5 else ""  # a warning
            rows.append(f"  - name: x{i}\n    cmd: echo {i}\n    shell: /bin/sh{dropped}\n")
        rows.append("  - name: recv\n    cmd: cat\n")
    if rng.random() < 0.4:
        rows.append("  file:\n")
        for i in range(rng.randint(1, 4)):
            mode = rng.choice(["0644", '"0600"', "u=rw"])
            rows.append(
                f"  - {{name: f{i}, path: {root}/d/f{i}, content: {_value(rng)}, mode: {mode}}}\n"
            )
        rows.append(f"  - {{name: d, path: {root}/d/}}\n")
    edges: list[str] = []
    plain = [n for n in names if not n.startswith("@@")]
    for _ in range(rng.randint(0, 6)):
        if len(plain) < 2:
            break
        a, b = sorted(rng.sample(range(len(plain)), 2))
        if rng.random() < 0.05:
            a, b = b, a  # maybe a cycle: an error
        notify = "\n  notify: true" if rng.random() < 0.3 else ""
        edges.append(
            f"- name: e{len(edges)}\n  from:\n    kind: noop\n    name: {json.dumps(plain[a])}\n"
            f"  to:\n    kind: noop\n    name: {json.dumps(plain[b])}{notify}\n"
        )
    if "  exec:\n" in rows and rng.random() < 0.7:
        edges.append(
            "- {from: {kind: exec, name: x0, send: stdout}, to: {kind: exec, name: recv, "
            "recv: cmd}}\n"
        )
    if rng.random() < 0.05:
        edges.append("- {from: {kind: noop, name: nosuch}, to: {kind: noop, name: a}}\n")
    text = "graph: g\nresources:\n" + "".join(rows)
    if edges:
        text += "edges:\n" + "".join(edges)
    if rng.random() < 0.3:
        text += "collect:\n- kind: file\n  filter: {mode: '0644'}\n"
    return text


def test_random_graphs_the_cached_model_is_the_parsed_one(
    loads: Loads, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    rng = random.Random(2028)
    graphs = 0
    n = 150
    for i in range(n):
        path = tmp_path / f"g{i}.yaml"
        path.write_text(_random_graph(rng, tmp_path))
        graphs += _same_either_way(loads, path, caplog)
    assert n // 2 < graphs < n, graphs  # graphs and errors both


# -- what makes an entry another's --------------------------------------------------------

GRAPH = "graph: g\nresources:\n  noop:\n  - {name: a, comment: one}\n  - {name: b}\n"


def _comments(model: GraphModel) -> dict[str, str]:
    return {i: r.comment for i, r in model.resources.items()}  # type: ignore[attr-defined]


def test_an_edited_file_runs_its_new_content(loads: Loads, tmp_path: Path) -> None:
    g = tmp_path / "g.yaml"
    g.write_text(GRAPH)
    loads.miss(g)
    assert _comments(loads.hit(g))["noop[a]"] == "one"
    g.write_text(GRAPH.replace("one", "two and longer"))
    assert _comments(loads.miss(g))["noop[a]"] == "two and longer"
    assert _comments(loads.hit(g))["noop[a]"] == "two and longer"


def test_a_rewrite_of_the_same_size_and_mtime_runs_its_new_content(
    loads: Loads, tmp_path: Path
) -> None:
    g = tmp_path / "g.yaml"
    g.write_text(GRAPH)
    loads.miss(g)
    loads.hit(g)
    st = g.stat()
    g.write_text(GRAPH.replace("one", "two"))
    os.utime(g, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert g.stat().st_size == st.st_size
    assert g.stat().st_mtime_ns == st.st_mtime_ns
    assert _comments(loads.miss(g))["noop[a]"] == "two"
    # and back: the first content's entry is still right for it
    g.write_text(GRAPH)
    os.utime(g, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert _comments(loads.hit(g))["noop[a]"] == "one"


def test_another_version_code_or_kinds_do_not_use_the_entry(
    loads: Loads, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    g = tmp_path / "g.yaml"
    g.write_text(GRAPH)
    loads.miss(g)
    loads.hit(g)
    with monkeypatch.context() as m:
        m.setattr(parse_cache, "__version__", "0.0.0-other")
        loads.miss(g)
    with monkeypatch.context() as m:  # a module that builds the model changed
        m.setitem(parse_cache._digests, "evergraph.frontends.yaml", "other code")
        loads.miss(g)
    more = REG.copy()

    class Extra(Noop, kw_only=True, dict=True, forbid_unknown_fields=True):
        kind = "extra"

    more.add("extra", Extra)
    loads.miss(g, more)
    loads.hit(g)  # the first entry is still there, and still right
    with monkeypatch.context() as m:  # the noop kind's code changed
        m.setitem(parse_cache._digests, Noop.__module__, "other code")
        loads.miss(g)  # (the entry is now that code's)
    loads.miss(g)
    loads.hit(g)


def test_the_key_covers_the_parser_modules_a_cached_run_never_imports(tmp_path: Path) -> None:
    """A run whose model comes from the cache imports no parser module (yaml_edges,
    yaml_load, engine.build: they load with the first parse), yet its key still
    digests their source: the same key as in a process that imported them."""
    g = tmp_path / "g.yaml"
    g.write_text(GRAPH)
    parsers = ("evergraph.frontends.yaml_edges", "evergraph.frontends.yaml_load")
    code = (
        "import sys, importlib\n"
        "from evergraph.frontends import cache\n"
        "from evergraph.frontends.open import builtin_registry\n"
        f"parsers = {(*parsers, 'evergraph.engine.build')!r}\n"
        "before = [m for m in parsers if m in sys.modules]\n"
        "if sys.argv[1] == 'imported':\n"
        "    for m in parsers: importlib.import_module(m)\n"
        "key = cache.entry_key(b'graph', sys.argv[2], builtin_registry())\n"
        "print(before, key)\n"
    )

    def key(how: str) -> str:
        out = subprocess.run(
            [sys.executable, "-c", code, how, str(g)], capture_output=True, text=True, check=True
        ).stdout.split()
        assert out[0] == "[]", out  # none imported by the cache itself
        return out[-1]

    assert key("imported") == key("not-imported")


def test_the_same_content_under_another_name_is_another_entry(
    loads: Loads, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Warnings and errors name the file: an entry is the file's at its path."""
    caplog.set_level(logging.WARNING)
    text = "graph: g\nresources:\n  exec:\n  - name: x\n    cmd: 'true'\n    timeout: 5\n"
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text(text)
    b.write_text(text)
    for path in (a, b):
        loads.miss(path)
        caplog.clear()
        loads.hit(path)
        first = next(r.getMessage() for r in caplog.records)
        assert first.startswith(f"{path}:6:"), first


def test_an_entry_of_other_content_under_this_name_is_not_used(
    loads: Loads, tmp_path: Path
) -> None:
    g = tmp_path / "g.yaml"
    g.write_text(GRAPH)
    loads.miss(g)
    (entry,) = loads.entries
    g.write_text(GRAPH.replace("one", "two"))
    loads.miss(g)
    (other,) = [p for p in loads.entries if p != entry]
    os.replace(entry, other)  # the first content's entry, under the second's name
    assert _comments(loads.miss(g))["noop[a]"] == "two"
    assert _comments(loads.hit(g))["noop[a]"] == "two"


# -- entries that may not be trusted ----------------------------------------------------


def test_a_planted_entry_is_ignored(loads: Loads, tmp_path: Path) -> None:
    g = tmp_path / "g.yaml"
    g.write_text(GRAPH)
    loads.miss(g)
    (entry,) = loads.entries
    # another user's entry (as root: made another's by chown)
    os.chown(entry, 4321, 4321)
    loads.miss(g)  # and rewritten, ours again
    assert entry.stat().st_uid == os.geteuid()
    loads.hit(g)
    # an entry others may write
    entry.chmod(0o620)
    loads.miss(g)
    assert entry.stat().st_mode & 0o777 == 0o600
    loads.hit(g)
    # a directory others may write: neither read nor written
    d = entry.parent
    d.chmod(0o770)
    loads.miss(g)
    loads.miss(g)
    d.chmod(0o700)
    loads.hit(g)
    # a directory of another user
    os.chown(d, 4321, 4321)
    loads.miss(g)
    os.chown(d, os.geteuid(), os.getegid())
    loads.hit(g)


def test_a_symlinked_cache_directory_or_entry_is_ignored(loads: Loads, tmp_path: Path) -> None:
    g = tmp_path / "g.yaml"
    g.write_text(GRAPH)
    loads.miss(g)
    (entry,) = loads.entries
    d = entry.parent
    elsewhere = tmp_path / "elsewhere"
    d.rename(elsewhere)
    d.symlink_to(elsewhere)
    loads.miss(g)
    d.unlink()
    d.mkdir(mode=0o700)
    (d / entry.name).symlink_to(elsewhere / entry.name)
    loads.miss(g)  # and replaced by a file
    assert not (d / entry.name).is_symlink()
    loads.hit(g)


@pytest.mark.parametrize(
    "spoil",
    [
        lambda b: b[: len(b) // 2],
        lambda b: b[:-1],
        lambda b: b"",
        # (the body's first byte: 0xc1 is never msgpack, so this always changes it;
        # the entry's first byte is its MAC's, 0xc1 already once in 256 runs)
        lambda b: b[: parse_cache.MAC_SIZE] + b"\xc1" + b[parse_cache.MAC_SIZE + 1 :],
        lambda b: b[:100] + bytes(50) + b[150:],
        lambda b: os.urandom(len(b)),
    ],
    ids=["half", "last-byte", "empty", "bad-type", "zeroed", "random"],
)
def test_a_corrupt_entry_is_parsed_anew_and_rewritten(
    loads: Loads, tmp_path: Path, spoil: object, caplog: pytest.LogCaptureFixture
) -> None:
    g = tmp_path / "g.yaml"
    g.write_text(GRAPH)
    want = _view(loads.miss(g))
    (entry,) = loads.entries
    entry.write_bytes(spoil(entry.read_bytes()))  # type: ignore[operator]
    caplog.clear()
    assert _view(loads.miss(g)) == want
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert _view(loads.hit(g)) == want


def test_an_entry_this_cache_did_not_write_is_not_used(loads: Loads, tmp_path: Path) -> None:
    """Each entry carries its MAC under the cache's own secret (0600, ours): an
    entry of the right model under another secret, a secret changed, gone, or
    readable by others, is a miss (then a new secret is made, and the entry
    written again under it)."""
    g = tmp_path / "g.yaml"
    g.write_text(GRAPH)
    want = _view(loads.miss(g))
    (entry,) = loads.entries
    key = entry.parent / parse_cache.KEY_NAME
    body = body_of(entry)
    # the same bytes under another secret
    entry.write_bytes(parse_cache._mac(os.urandom(parse_cache.KEY_SIZE), body) + body)
    assert _view(loads.miss(g)) == want
    assert _view(loads.hit(g)) == want
    # the secret changed, removed, or others may read it: no entry is this cache's
    for spoil in (
        lambda: key.write_bytes(os.urandom(parse_cache.KEY_SIZE)),
        key.unlink,
        lambda: key.chmod(0o640),
        lambda: key.write_bytes(b"short"),
    ):
        spoil()
        assert _view(loads.miss(g)) == want
        assert key.stat().st_mode & 0o777 == 0o600
        assert len(key.read_bytes()) == parse_cache.KEY_SIZE
        assert _view(loads.hit(g)) == want
    # and the entry signed anew is this cache's (the helpers below plant so)
    entry.write_bytes(signed(entry, body))
    assert _view(loads.hit(g)) == want


# -- errors -----------------------------------------------------------------------------


def test_errors_are_not_cached_and_name_the_same_place(loads: Loads, tmp_path: Path) -> None:
    g = tmp_path / "g.yaml"
    g.write_text(GRAPH)
    loads.miss(g)
    bad = GRAPH + "edges:\n- from: {kind: noop, name: a}\n  to: {kind: noop, name: zz}\n"
    g.write_text(bad)
    errors = []
    for _ in range(2):
        with pytest.raises(InputError) as e:
            loads.miss(g)
        errors.append(str(e.value))
    with pytest.raises(InputError) as e:
        parse_yaml(bad, str(g), REG)
    assert errors == [str(e.value)] * 2
    assert f"{g}:7:" in errors[0], errors[0]
    assert len(loads.entries) == 1  # the good content's alone
    g.write_text(GRAPH)
    loads.hit(g)


def test_a_cached_model_failing_its_check_is_parsed_for_the_error(
    loads: Loads, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Should the check of a cached model come out otherwise (it must not: it
    depends on the values alone), the parse reports the error, where it is."""
    g = tmp_path / "g.yaml"
    g.write_text(GRAPH)
    loads.miss(g)
    loads.hit(g)

    def refuse(self: GraphModel, *args: object, **kw: object) -> list[str]:
        raise InputError("refused", "noop[a]")

    monkeypatch.setattr(GraphModel, "check", refuse)
    n = loads.parses
    with pytest.raises(InputError, match="refused") as e:
        loads.load(g)
    assert loads.parses == n + 1
    assert e.value.where.startswith(f"{g}:4:"), e.value.where


# -- bounds, and what is not cached ----------------------------------------------------


def test_the_directory_keeps_the_most_recently_used_entries(
    loads: Loads, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(parse_cache, "MAX_ENTRIES", 3)
    paths = []
    for i in range(5):
        p = tmp_path / f"g{i}.yaml"
        p.write_text(GRAPH.replace("one", f"v{i}"))
        paths.append(p)
    long_ago = time.time() - 1000
    for i, p in enumerate(paths[:3]):
        before = set(loads.entries)
        loads.miss(p)
        (new,) = set(loads.entries) - before
        os.utime(new, (long_ago + i, long_ago + i))  # written in this order
    loads.hit(paths[0])  # used: now the most recent
    loads.miss(paths[3])  # goes: g1's
    loads.miss(paths[4])  # goes: g2's
    assert len(loads.entries) == 3
    for p in (paths[0], paths[3], paths[4]):
        loads.hit(p)
    loads.miss(paths[1])
    loads.miss(paths[2])
    assert len(loads.entries) == 3


def test_python_graphs_are_not_cached(tmp_path: Path) -> None:
    g = tmp_path / "g.py"
    g.write_text("def graph(g, world):\n    g.add('noop', 'a')\n")
    f = open_frontend(g, REG)
    f.cache_parses(tmp_path / "state")
    f.load()
    assert not (tmp_path / "state").exists()


def test_a_run_keeps_its_parse_under_the_state_dir(tmp_path: Path) -> None:
    g = tmp_path / "g.yaml"
    g.write_text(GRAPH)
    state = tmp_path / "s"
    d = state / parse_cache.SUBDIR
    # the state dir did not exist when the graph was parsed: the entry is written
    # once the agent has made it (the cache never makes a state dir; a run refused
    # for bad input leaves none behind)
    r = run_cli("run", g, "--state-dir", state, "--converged-exit")
    assert r.returncode == 0, r.stderr
    assert state.is_dir()
    assert d.stat().st_mode & 0o777 == 0o700
    (entry,) = entries_in(d)
    assert entry.stat().st_mode & 0o777 == 0o600
    assert (d / parse_cache.KEY_NAME).stat().st_mode & 0o777 == 0o600
    made = entry.stat()
    for _ in range(2):
        long_ago = time.time() - 1000
        os.utime(entry, (long_ago, long_ago))
        r = run_cli("run", g, "--state-dir", state, "--converged-exit")
        assert r.returncode == 0, r.stderr
        assert "converged: 1 vertices clean" in r.stderr, r.stderr  # (the two noops grouped)
        # the run read the entry (marked used), and did not write it again
        (again,) = entries_in(d)
        assert again.stat().st_ino == made.st_ino
        assert again.stat().st_mtime > long_ago + 500


def test_a_run_refused_for_bad_input_leaves_no_state_dir(tmp_path: Path) -> None:
    g = tmp_path / "g.yaml"
    g.write_text(GRAPH)
    state = tmp_path / "s"
    # the graph parses (its entry is made), then the run is refused: nothing written
    r = run_cli("run", g, "--state-dir", state, "--converged-exit", "--hostname", "under_score")
    assert r.returncode == 2, r.stderr
    assert "under_score" in r.stderr, r.stderr
    assert not state.exists()


def test_without_a_state_dir_the_user_cache_directory_is_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    g = tmp_path / "g.yaml"
    g.write_text(GRAPH)
    f = YamlFrontend(g, REG)
    f.cache_parses(None)
    f.load()
    (entry,) = entries_in(tmp_path / "xdg" / "evergraph" / parse_cache.SUBDIR)
    assert entry.stat().st_mode & 0o777 == 0o600


def test_the_library_run_keeps_its_parse_under_the_state_dir(tmp_path: Path) -> None:
    import evergraph

    g = tmp_path / "g.yaml"
    g.write_text(GRAPH)
    state = tmp_path / "s"
    for _ in range(2):
        assert evergraph.run(g, state_dir=state, converged_exit=True, world=None) == 0
        # (the first run's too: written once the agent made the state dir)
        assert len(entries_in(state / parse_cache.SUBDIR)) == 1


@pytest.mark.parametrize("cached", [False, True])
def test_a_one_shot_load_keeps_nothing_for_a_live_edit(
    loads: Loads, tmp_path: Path, cached: bool
) -> None:
    """A run that takes only its first graph (`Frontend.one_shot`) keeps neither
    the text, the entries, the validated resources nor their claims, and gets the
    same model as a live run does."""
    g = tmp_path / "g.yaml"
    g.write_text(GRAPH)
    if cached:
        loads.miss(g)  # the entry, for the loads below to hit

    def frontend() -> YamlFrontend:
        f = YamlFrontend(g, REG)
        if cached:
            f.cache_parses(loads.state)
        return f

    live = frontend()
    model_live = live.load()
    once = frontend()
    once.one_shot()
    before = loads.parses
    model_once = once.load()
    assert loads.parses == before + (not cached)
    assert _view(model_once)[:-1] == _view(model_live)[:-1]  # all but the kept claims
    assert _groups(prepare(model_once)) == _groups(prepare(model_live))
    assert live._text
    assert live._valid
    assert model_live._claims
    assert once._text == ""
    assert not once._valid
    assert model_once._claims is None
    assert once._entries.reuse(GRAPH) is None  # nothing a first edit could reuse


def test_an_entry_kept_for_later_is_written_once_the_state_dir_exists(tmp_path: Path) -> None:
    """A one-shot preload keeps its entry for later (`put(later=True)`); a flush
    before the state dir exists encodes it and keeps it, a flush after writes it
    (the first child of the work ahead flushes twice: before and after the go)."""
    g = tmp_path / "g.yaml"
    g.write_text(GRAPH)
    state = tmp_path / "s"
    f = YamlFrontend(g, REG)
    f.cache_parses(state)
    f.one_shot()
    f.preload()
    cache = f._cache
    assert cache is not None
    assert cache.holds_later()
    cache.flush()
    assert not state.exists()  # (nothing made before the run is accepted)
    assert not cache.holds_later()
    state.mkdir()
    cache.flush()
    (entry,) = entries_in(state / parse_cache.SUBDIR)
    assert entry.stat().st_size > 0


def test_an_entry_encoded_in_steps_is_the_one_encoded_at_once(tmp_path: Path) -> None:
    """A child ahead encodes the entry in steps while it waits for the go, stopped
    where the go comes and taken up again after its making (`encode_later`'s
    `until`): the entry is byte for byte the one encoded at once, and a later run
    takes its model from it."""
    n = 3 * parse_cache.STEP + 5  # (three full steps, and a few more)
    text = "graph: steps\nresources:\n  noop:\n" + "".join(
        f"  - {{name: n{i}, comment: c{i % 7}}}\n" for i in range(n)
    )
    g = tmp_path / "g.yaml"
    g.write_text(text)
    key = parse_cache.entry_key(text.encode(), str(g), REG)
    at_once = parse_cache.ParseCache(tmp_path / "at-once")
    at_once.put(key, parse_yaml(text, str(g), REG), [], REG)
    stepped = parse_cache.ParseCache(tmp_path / "stepped")
    stepped.put(key, parse_yaml(text, str(g), REG), [], REG, later=True)
    asked = 0

    def until() -> bool:  # a go after every other step
        nonlocal asked
        asked += 1
        return asked % 2 == 0

    assert stepped.encode_later(lambda: True) is False  # (a go before any step)
    stops = 0
    while not stepped.encode_later(until):
        stops += 1
    assert stops >= 3, stops
    stepped.write_held()
    [a] = entries_in(tmp_path / "at-once")
    [b] = entries_in(tmp_path / "stepped")
    assert body_of(b) == body_of(a)
    got = stepped.get(key, REG)
    assert got is not None
    assert parse_cache.same_model(got, parse_yaml(text, str(g), REG))
