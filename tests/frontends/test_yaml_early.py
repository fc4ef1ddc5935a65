"""A large YAML graph's `resources:` section is parsed by a helper forked as the
console script starts (`frontends/early.py`, issue 28). Every graph must be the
one a whole parse gives (resources in order with their parameters, edges,
groups, warnings, and errors with the same `file:line:col`), on mgmt's corpus
and on seeded random graphs; what cannot be cut for certain is parsed whole;
the helper's data is used only for the very bytes the run read, and the helper
never outlives what needs it."""

from __future__ import annotations

import hashlib
import json
import logging
import marshal
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from evergraph.engine.model import GraphModel
from evergraph.errors import InputError
from evergraph.frontends import early
from evergraph.frontends.open import builtin_registry
from evergraph.frontends.yaml import parse_yaml
from tests.kit.models import model_groups, model_view

#: the console script's main (`run_cli` runs the click application, which forks no helper)
ENTRY = [sys.executable, "-m", "evergraph.cli.entry"]

REG = builtin_registry()
F = "/g/graph.yaml"
MGMT_YAML = Path("/work/shared/mgmt-yaml")


def _parse(text: str, section: early.Early | None = None) -> GraphModel | str:
    """The model, or the error as `where: message`."""
    try:
        return parse_yaml(text, F, REG, section=section)
    except InputError as e:
        return f"{e.where}: {e.message}"


def _same(text: str, caplog: pytest.LogCaptureFixture) -> bool:
    """The early path gives what a whole parse gives; whether it was taken."""
    section = _handed_over(text)
    caplog.clear()
    got = _parse(text, section)
    got_log = [(r.levelno, r.getMessage()) for r in caplog.records]
    caplog.clear()
    whole = _parse(text)
    whole_log = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert got_log == whole_log
    if isinstance(got, str) or isinstance(whole, str):
        assert got == whole
    else:
        assert model_view(got) == model_view(whole)
        assert model_groups(got) == model_groups(whole)
    return section is not None


def _handed_over(text: str) -> early.Early | None:
    """What the helper hands over for `text`, as `take` gets it: None where it gives
    up (the section does not cut for certain, or does not parse, or holds what
    `marshal` does not carry: a date)."""
    try:
        section = early.parse_section(text)
        return None if section is None else marshal.loads(marshal.dumps(section))  # type: ignore[no-any-return]
    except ValueError:  # (marshal: a date; yaml_rs: a syntax error)
        return None
    except Exception:
        return None


# -- mgmt's corpus ----------------------------------------------------------------------


def test_mgmt_corpus_gives_the_same_graphs(caplog: pytest.LogCaptureFixture) -> None:
    if not MGMT_YAML.is_dir():
        pytest.skip(f"{MGMT_YAML} is absent (mgmt's examples are not part of this repository)")
    caplog.set_level(logging.WARNING)
    taken = [p.name for p in sorted(MGMT_YAML.glob("*.yaml")) if _same(p.read_text(), caplog)]
    assert len(taken) >= 40, taken  # most of the corpus cuts for certain


# -- random graphs ----------------------------------------------------------------------

#: entries of a kind, written the ways a graph writes them (some invalid, some
#: with keys mgmt's code dropped, some exported)
ENTRIES = [
    "- {name: NAME}\n",
    "- name: NAME\n  comment: plain text\n",
    '- name: NAME\n  comment: "two\\nlines"\n',
    "- name: NAME\n  comment: |\n    a block\n    scalar\n",
    "- name: NAME\n  comment: |+\n    kept\n\n",
    "- name: NAME\n  comment: >-\n    folded\n    text\n",
    "- name: NAME\n  comment: |\n",
    "- name: NAME\n  comment: &anchor anchored\n",
    "- name: NAME\n# a comment at column 0\n  comment: after it\n",
    "- name: NAME\n  comment: 2001-12-14\n",
    "- name: NAME\n  comment: 12345678901234567890123\n",
    "- name: NAME\n  nosuchkey: 1\n",
    "- name: NAME\n  comment: [a, b]\n",
    "- name: '@@NAME'\n",
    "- name: NAME\n  meta:\n    poll: 5\n",
    "-\n  name: NAME\n",
]
KINDS = ["noop", "print", "msg", "nosuch"]
TAILS = [
    "",
    "",
    "edges:\n- name: e\n  from:\n    kind: noop\n    name: r0\n  to:\n    kind: print\n"
    "    name: r1\n",
    "edges:\n- {from: {kind: noop, name: r0}, to: {kind: noop, name: r1}}\n",
    "comment: after\n",
    "# a last comment\n",
    "collect:\n- kind: noop\n",
]


def _random_graph(rng: random.Random) -> str:
    """A graph with 1-3 kinds of resources written the ways of `ENTRIES` (mostly
    valid ones), the section anywhere, and now and then what does not cut."""
    rows = []
    kinds = ["noop", "print", "msg"] + (["nosuch"] if rng.random() < 0.05 else [])
    for kind in rng.sample(kinds, rng.choice([1, 2, 2, 3])):
        rows.append(f"  {kind}:{rng.choice(['', '', '  # kind'])}\n")
        indent = rng.choice(["  ", "  ", "    "])
        for i in range(rng.randint(0, 6)):
            entry = rng.choice(ENTRIES[:9]) if rng.random() < 0.95 else rng.choice(ENTRIES)
            name = f"r{i}" if rng.random() < 0.97 else rng.choice(["r0", "x y", "true", ""])
            entry = entry.replace("NAME", name)
            rows.append("".join(indent + line if line else "" for line in entry.splitlines(True)))
    head = rng.choice(["graph: g\n", "graph: g\n", "---\ngraph: g\n", ""])
    resources = "resources:" + rng.choice(["", "", "  # the resources"]) + "\n" + "".join(rows)
    tail = rng.choice(TAILS)
    parts = [head, resources, tail] if rng.random() < 0.7 else [head, tail, resources]
    text = "".join(parts)
    r = rng.random()
    if r < 0.03:
        text = text.replace("\n", "\r\n")
    elif r < 0.06:
        text = text.replace("comment: after", "comment: *anchor")
    elif r < 0.09:
        text = text + "resources:\n  noop:\n  - name: again\n"
    elif r < 0.12:
        text = "%YAML 1.2\n---\n" + text
    elif r < 0.15:
        text = text.replace("  noop:\n", "  noop:\n\t", 1)
    elif r < 0.18:
        text = text.rstrip("\n")
    return text


def test_random_graphs_give_the_same_graph_or_error_either_way(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    rng = random.Random(2028)
    taken = models = 0
    n = 800
    for _ in range(n):
        text = _random_graph(rng)
        try:
            taken += _same(text, caplog)
        except AssertionError:
            print(text)
            raise
        models += not isinstance(_parse(text), str)
    # both paths, and both outcomes, are exercised
    assert n // 4 < taken < n - n // 20, taken
    assert n // 10 < models < n - n // 10, models


# -- what is cut, and what is not -------------------------------------------------------


def test_the_cut_is_the_section_and_the_helper_reads_it_as_the_whole_file_does() -> None:
    text = (
        "graph: g\nresources:  # here\n  noop:\n  - name: a\n    comment: |\n      x\n\n"
        "# a comment at column 0\n  - name: b\nedges: []\n"
    )
    got = early.parse_section(text)
    assert got is not None
    begin, end, value, edges = got
    assert text[:begin] == "graph: g\nresources:  # here\n"
    assert text[end:] == "edges: []\n"
    assert value == {"noop": [{"name": "a", "comment": "x\n"}, {"name": "b"}]}
    assert edges is None  # (not mgmt's layout: the parent parses them)
    # mgmt's layout: read by the helper too, before or after the section
    blocks = "edges:\n- name: e\n  from:\n    kind: noop\n    name: a\n"
    blocks += "  to:\n    kind: noop\n    name: b\n"
    section = "resources:\n  noop:\n  - name: a\n  - name: b\n"
    for both in (
        f"graph: g\n{section}{blocks}comment: after\n",
        f"graph: g\n{blocks}{section}comment: after\n",
        f"graph: g\n{blocks}{section}",
    ):
        got = early.parse_section(both)
        assert got is not None
        assert got[3] is not None
        assert got[3][3] == [("e", "noop", "a", "noop", "b", None)]
        model = _parse(both, got)
        assert not isinstance(model, str)
        whole = _parse(both)
        assert not isinstance(whole, str)
        assert model_view(model) == model_view(whole)
        assert [(e.from_id, e.to_id) for e in model.edges] == [("noop[a]", "noop[b]")]
    # a block scalar at the very end of the file: as the whole file reads it
    for last in ("|", "|+", "|-", ">"):
        end_text = f"graph: g\nresources:\n  noop:\n  - name: a\n    comment: {last}\n"
        section = early.parse_section(end_text)
        assert section is not None
        model = _parse(end_text, section)
        whole = _parse(end_text)
        assert not isinstance(model, str)
        assert not isinstance(whole, str)
        assert model_view(model) == model_view(whole)


@pytest.mark.parametrize(
    "text",
    [
        "graph: g\nresources:\n  noop:\n  - &a {name: a}\n  - *a\n",  # an alias
        "graph: g\nresources:\n  noop:\n  - {name: a}\nresources:\n  noop: []\n",  # twice
        "graph: g\r\nresources:\r\n  noop:\r\n  - {name: a}\r\n",  # CRs
        "%YAML 1.2\n---\ngraph: g\nresources:\n  noop:\n  - {name: a}\n",  # a directive
        "graph: g\nresources:\n\tnoop: []\n",  # a tab at a line's start
        "graph: g\nresources: {noop: [{name: a}]}\n",  # flow style on its line
        "graph: g\nresources:\n  noop:\n  - {name: a}",  # no line break at the end
        "graph: g\n  resources:\n  noop: []\n",  # not at column 0
    ],
)
def test_what_does_not_cut_for_certain_is_parsed_whole(text: str) -> None:
    assert early.parse_section(text) is None


def test_a_rest_that_does_not_hold_an_empty_resources_is_parsed_whole() -> None:
    """The parent's side checks what it parsed: a section handed over for another
    text (positions that do not cut out `resources:`'s lines) is not used."""
    text = "graph: g\nresources:\n  noop:\n  - {name: a}\ncomment: x\n"
    wrong = (0, 0, {"noop": [{"name": "planted"}]}, None)
    model = _parse(text, wrong)
    assert not isinstance(model, str)
    assert list(model.resources) == ["noop[a]"]


# -- the helper, as the console script forks it ------------------------------------------

#: a process that forks the helper for FILE as the console script does, then reads
#: FILE (or OTHER) as the YAML frontend does and takes what the helper made
TAKER = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path
    from evergraph.frontends import early
    from evergraph.frontends.base import read_graph_bytes
    path = sys.argv[1]
    early.start(["run", path, "--converged-exit"])
    forked = early._helper is not None
    helper = early._helper[0] if forked else None
    # the run's own read: of FILE, or of OTHER (the file as rewritten since)
    got = early.take(read_graph_bytes(Path(sys.argv[-1])))
    try:
        os.waitpid(helper, os.WNOHANG)
        reaped = False
    except (ChildProcessError, TypeError):
        reaped = True
    print(json.dumps({"forked": forked, "reaped": reaped,
                      "got": None if got is None else [got[0], got[1], len(got[2]["noop"])]}))
    """
)


def _big(path: Path, tag: str = "a", n: int = 15_000) -> str:
    rows = "".join(f'  - {{name: r{i}, comment: "{tag} {i:06}"}}\n' for i in range(n))
    text = f"graph: big\nresources:\n  noop:\n{rows}comment: end\n"
    path.write_text(text)
    assert len(text) >= early.EARLY_MIN
    return text


def _python(script: str, *args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True, timeout=60
    )


def _take(*args: Path) -> dict[str, object]:
    r = _python(TAKER, *args)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)  # type: ignore[no-any-return]


def test_the_helper_parses_the_section_of_a_large_file_and_is_reaped(tmp_path: Path) -> None:
    text = _big(tmp_path / "big.yaml")
    got = _take(tmp_path / "big.yaml")
    assert got["forked"]
    assert got["reaped"]
    begin = text.index("\n", text.index("resources:")) + 1
    assert got["got"] == [begin, text.index("comment: end"), 15_000]


def test_the_helper_of_other_bytes_is_not_used(tmp_path: Path) -> None:
    """The file rewritten between the helper's read and the run's, with the same
    size: the run's bytes are not those the helper parsed (nothing but the bytes
    tells: no size, no mtime)."""
    _big(tmp_path / "big.yaml", "a")
    _big(tmp_path / "other.yaml", "b")
    got = _take(tmp_path / "big.yaml", tmp_path / "other.yaml")
    assert got["forked"]
    assert got["reaped"]
    assert got["got"] is None


def test_no_helper_for_a_small_file_or_a_fifo(tmp_path: Path) -> None:
    (tmp_path / "small.yaml").write_text("graph: g\nresources:\n  noop:\n  - {name: a}\n")
    got = _take(tmp_path / "small.yaml")
    assert not got["forked"]
    assert got["got"] is None
    os.mkfifo(tmp_path / "fifo.yaml")
    script = "from evergraph.frontends import early; import sys; early.start(sys.argv[1:]);"
    script += "print(early._helper is None)"
    r = _python(script, tmp_path / "fifo.yaml")
    assert r.stdout.strip() == "True", r.stderr


def test_a_helper_not_needed_is_killed_and_reaped(tmp_path: Path) -> None:
    """`drop` (a parse cache hit, an error before the parse): nothing is left, and
    the work meant for a wait (`meanwhile`) is not done."""
    _big(tmp_path / "big.yaml")
    script = textwrap.dedent(
        """
        import os, sys
        from evergraph.frontends import early
        early.start([sys.argv[1]])
        pid = early._helper[0]
        early.meanwhile(lambda: print("meanwhile ran"))
        early.drop()
        early.take(b"")  # (nothing to take, nothing to do)
        try:
            os.waitpid(pid, os.WNOHANG)
            print("not reaped")
        except ChildProcessError:
            print("reaped")
        """
    )
    r = _python(script, tmp_path / "big.yaml")
    assert r.stdout.strip() == "reaped", r.stderr


def _entry(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*ENTRY, *map(str, args)], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("where", ["resources", "edges"])
def test_a_large_graph_run_converges_and_errors_name_the_same_place(
    tmp_path: Path, where: str
) -> None:
    """The console script with the helper: a valid large graph converges; one with
    an error says what a whole parse says, at the same `file:line:col`."""
    path = tmp_path / "big.yaml"
    rows = "".join(
        f"  - {{name: f{i}, path: {json.dumps(str(tmp_path / 'out' / f'f{i}.txt'))}, "
        f'content: "file {i:06} of the large graph\\n"}}\n'
        for i in range(5000)
    )
    text = f"graph: big\nresources:\n  file:\n  - {{name: d, path: {tmp_path / 'out'}/}}\n{rows}"
    assert len(text) >= early.EARLY_MIN
    path.write_text(text)
    r = _entry("run", path, "--converged-exit", "--state-dir", tmp_path / "state", "-v")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "its resources: parsed beside the command's start" in r.stderr
    assert (tmp_path / "out" / "f4999.txt").read_text() == "file 004999 of the large graph\n"
    if where == "resources":
        bad = text.replace("{name: f4000, path:", "{name: f4000, mode: 99999, path:")
    else:
        bad = text + "edges:\n- from: {kind: file, name: f1}\n  to: {kind: file, name: nosuch}\n"
    path.write_text(bad)
    r = _entry("run", path, "--converged-exit", "--state-dir", tmp_path / "state2")
    assert r.returncode == 2
    try:
        parse_yaml(bad, str(path), REG)
    except InputError as e:
        expected = f"{e.where}: {e.message}"
    else:
        raise AssertionError("the graph should be refused")
    assert r.stderr.strip().endswith(expected), r.stderr
    assert not (tmp_path / "state2" / "made-ahead").exists()


# -- what the parse cache holds: the helper leaves it -----------------------------------


def test_the_cache_notes_a_large_file_and_the_helper_then_leaves_it(tmp_path: Path) -> None:
    """A run's parse cache entry of a large file notes the file's hash (`RECENT`):
    the next run's helper reads and hashes the file, finds it there, and parses
    nothing (that run takes its model from the cache). With the entry gone and the
    note left, the run parses the file itself, and converges all the same."""
    path = tmp_path / "big.yaml"
    rows = "".join(f'  - {{name: r{i}, comment: "n {i:06}"}}\n' for i in range(15_000))
    path.write_text(f"graph: big\nresources:\n  noop:\n{rows}")
    assert path.stat().st_size >= early.EARLY_MIN
    state = tmp_path / "state"
    r = _entry("run", path, "--converged-exit", "--state-dir", state, "-v")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "its resources: parsed beside the command's start" in r.stderr
    cache = state / early.CACHE_SUBDIR
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert (cache / early.RECENT).read_text().split() == [digest]
    assert early._known(str(cache), digest)
    for entry in cache.iterdir():
        if entry.name not in (early.RECENT, ".key"):
            entry.unlink()
    r = _entry("run", path, "--converged-exit", f"--state-dir={state}", "-v")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "parsed beside the command's start" not in r.stderr
    assert "graph big loaded:" in r.stderr


def test_the_note_keeps_the_last_files_and_is_never_pruned_nor_waited_on(
    tmp_path: Path,
) -> None:
    from evergraph.frontends import cache as parse_cache

    tmp_path.chmod(0o700)
    dfd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        digests = [f"{i:064x}" for i in range(parse_cache.MAX_ENTRIES + 5)]
        for d in digests:
            parse_cache._remember(dfd, d)
        parse_cache._remember(dfd, digests[-3])  # (seen again: last)
        kept = (tmp_path / early.RECENT).read_text().split()
        assert len(kept) == parse_cache.MAX_ENTRIES
        assert kept[-1] == digests[-3]
        assert digests[0] not in kept
        assert digests[-1] in kept
        for i in range(parse_cache.MAX_ENTRIES + 2):  # (entries to prune)
            (tmp_path / f"{i:064x}e").write_bytes(b"x")
        parse_cache.ParseCache(tmp_path)._prune(dfd, "")
        assert (tmp_path / early.RECENT).exists()
    finally:
        os.close(dfd)
    (tmp_path / early.RECENT).unlink()
    os.mkfifo(tmp_path / early.RECENT)
    assert not early._known(str(tmp_path), digests[-1])  # (a FIFO: not opened for long)
