"""A live edit re-parses only the resource entries whose text changed
(`frontends.yaml.Entries`), and the keys of automatic edges and the claims of
unchanged resources are kept: every result must be exactly that of a whole
parse (the same resources in the same order, edges, errors with the same
`file:line:col`), and the entry-wise path must be the one taken where it can be.
"""

from __future__ import annotations

import logging
import random

import msgspec
import pytest

from evergraph.engine.autoedge import add_autoedges
from evergraph.engine.model import GraphModel
from evergraph.engine.prepare import prepare
from evergraph.errors import InputError
from evergraph.frontends.open import builtin_registry
from evergraph.frontends.yaml import Entries, parse_yaml, split_entries

REG = builtin_registry()
F = "/g/graph.yaml"


def _flow(i: int, tag: str = "v0") -> str:
    return (
        f'  - {{name: f{i}, path: /srv/w/d{i % 3}/f{i}.txt, content: "{tag} {i}\\n", mode: "0644"}}'
    )


def _doc(rows: list[str], head: str = "graph: g\n", tail: str = "") -> str:
    return head + "resources:\n  file:\n" + "\n".join(rows) + "\n" + tail


def _parse(text: str, entries: Entries | None = None, valid: object = None) -> GraphModel | str:
    """The model, or the error as `where: message`."""
    try:
        return parse_yaml(text, F, REG, entries=entries, valid=valid)  # type: ignore[arg-type]
    except InputError as e:
        return f"{e.where}: {e.message}"


def _same(a: GraphModel | str, b: GraphModel | str) -> None:
    if isinstance(a, str) or isinstance(b, str):
        assert a == b
        return
    assert a.name == b.name
    assert list(a.resources) == list(b.resources)
    for ident, res in a.resources.items():
        other = b.resources[ident]
        assert type(res) is type(other)
        assert msgspec.to_builtins(res) == msgspec.to_builtins(other), ident
    assert a.edges == b.edges
    assert a.collect == b.collect
    assert a.origins == b.origins


def _edit(old: str, new: str) -> bool:
    """Parse `old` then `new` with one Entries, as the live frontend does; the
    result of `new` must be a whole parse's. Whether entries were reused."""
    entries = Entries()
    first = _parse(old, entries)
    if isinstance(first, str):
        entries = Entries()  # the frontend keeps the last good text's
    reused = entries.reuse(new) is not None
    _same(_parse(new, entries), _parse(new))
    return reused


def test_an_edit_an_insertion_a_deletion_reuse_entries_and_match_a_whole_parse() -> None:
    rows = [_flow(i) for i in range(30)]
    old = _doc(rows)
    edited = rows.copy()
    edited[7] = _flow(7, "v1")
    assert _edit(old, _doc(edited))
    assert _edit(old, _doc([*rows[:5], _flow(99), *rows[5:]]))
    assert _edit(old, _doc(rows[:5] + rows[6:]))
    assert _edit(old, _doc(rows[::-1]))  # the order of resources follows the text
    assert _edit(
        old,
        _doc(rows, tail="edges:\n- {from: {kind: file, name: f1}, to: {kind: file, name: f2}}\n"),
    )
    # a new kind, comments and blank lines among entries, block-style entries
    block = (
        "  exec:\n  # a comment\n\n  - name: e1\n    cmd: /bin/true\n\n    # between keys\n"
        "  - name: e2\n    cmd: |\n      echo hi\n      echo there\n"
    )
    assert _edit(old, _doc(rows) + block)
    assert _edit(_doc(rows) + block, _doc(rows) + block.replace("there", "you"))
    # indented entries (`- ` below the kind's key), and back
    assert _edit(old, _doc([" " * 2 + r for r in rows]))


def test_a_live_graph_gets_new_objects_never_the_state_of_the_last_ones() -> None:
    entries = Entries()
    rows = [_flow(i) for i in range(10)]
    first = parse_yaml(_doc(rows), F, REG, entries=entries)
    a = first.resources["file[f3]"]
    # what the engine and prepare do to a graph's objects: state, received values
    a.content = "received"  # type: ignore[attr-defined]
    a._path = "/state"  # type: ignore[attr-defined]
    prepare(first)
    rows[0] = _flow(0, "v1")
    second = parse_yaml(_doc(rows), F, REG, entries=entries, valid=first.validated())
    b = second.resources["file[f3]"]
    assert b is not a
    assert b.content == "v0 3\n"  # type: ignore[attr-defined]
    assert not b.__dict__
    assert second.resources["file[f0]"].content == "v1 0\n"  # type: ignore[attr-defined]
    third = parse_yaml(_doc(rows), F, REG, entries=entries)
    assert all(third.resources[i] is not r for i, r in second.resources.items())


def test_errors_in_a_changed_entry_are_those_of_a_whole_parse() -> None:
    rows = [_flow(i) for i in range(12)]
    old = _doc(rows)
    cases = [
        '  - {name: f3, path: /srv/x, content: "unterminated}',  # syntax
        '  - {name: f3, path: /srv/x, mode: "9999"}',  # invalid value
        "  - {name: f3, path: /srv/x, colour: red}",  # unknown parameter
        "  - {name: f4, path: /srv/x}",  # declared twice
        "  - {name: f3, path: /srv/w/d1/f4.txt, content: other}",  # claims f4's file
        "  - {path: /srv/x}",  # no name
        "  - {name: f3, path: /srv/x, mode: 0741}",  # an integer for text: its source text
        "  - {name: f3, path: /srv/x, content: {a: 1}}",
        "  - {name: f3, {a: 1}: x}",
        "  - {name: f3, path: /srv/x, path: /srv/y}",  # a duplicate key
        "  - 12",
        "  -",
        "  - - nested",
    ]
    for bad in cases:
        new = rows.copy()
        new[3] = bad
        _edit(old, _doc(new))
    # and the error of a whole parse is what a changed entry's is, line and all
    new = rows.copy()
    new[3] = '  - {name: f3, path: /srv/x, mode: "9999"}'
    entries = _entries_of(old)
    assert entries.reuse(_doc(new)) is not None
    assert _parse(_doc(new), entries) == (
        f"{F}:7:36: file[f3].mode: '9999' is neither octal (e.g. '0644') nor symbolic "
        "(e.g. 'u=rw,g=r,o=')"
    )


def _entries_of(text: str) -> Entries:
    entries = Entries()
    parse_yaml(text, F, REG, entries=entries)
    return entries


def test_what_cannot_be_split_for_certain_is_parsed_whole() -> None:
    rows = [_flow(i) for i in range(6)]
    old = _doc(rows)
    # an alias reaching into an entry: the anchor changes, the entry's text does not
    anchored = "comment: &d {content: one}\n"
    aliased = [*rows, "  - {<<: *d, name: m, path: /srv/m}"]
    assert not _edit(
        _doc(aliased, head=anchored), _doc(aliased, head=anchored.replace("one", "two"))
    )
    # an anchor in one entry, its alias in another
    inner = [
        *rows,
        "  - &x {name: a1, path: /srv/a1, content: one}",
        "  - {<<: *x, name: a2, path: /srv/a2}",
    ]
    changed = inner.copy()
    changed[-2] = "  - &x {name: a1, path: /srv/a1, content: two}"
    assert not _edit(_doc(inner), _doc(changed))
    # a `*` inside a word is no alias: still entry-wise
    assert _edit(old, _doc([*rows, '  - {name: g, path: /srv/g, content: "/tmp/*.log"}']))
    # more documents, flow style, CRs, tabs, a directive, no newline at the end
    assert not _edit(old, old + "---\nresources:\n  file:\n  - {name: z, path: /z}\n")
    assert not _edit(old, old.replace("graph: g\n", "---\ngraph: g\n") + "...\n---\n{}\n")
    flow = "{graph: g, resources: {file: [{name: a, path: /srv/a}]}}\n"
    assert not _edit(old, flow)
    assert not _edit(flow, old)
    assert not _edit(old, old.replace("\n", "\r\n"))
    assert not _edit(old, old.replace("  - {name: f2", "\t- {name: f2"))
    assert not _edit(old, "%YAML 1.2\n---\n" + old)
    assert not _edit(old, old[:-1])
    # something under `resources:` that is not a kind's list of entries
    assert not _edit(old, old.replace("  file:\n", "  file: []\n  exec:\n"))
    assert not _edit(old, old.replace("  file:\n", "  file:\n    name: x\n"))
    assert not _edit(old, old + "  - {name: late, path: /late}\n  junk\n")
    assert not _edit(old, old.replace("resources:\n", "resources:\n  - x\n"))
    _edit(old, old + "resources:\n  exec: []\n")  # a duplicate top-level key
    _edit(old, old.replace("  file:\n", "  file:\n  file:\n"))  # a duplicate kind
    # a quoted scalar running over lines that look like entries
    _edit(old, old.replace('content: "v0 2\\n"', 'content: "v0 2\n  - {name: q}"'))
    # a block scalar keeping its final line break before the next kind
    keep = "  exec:\n  - name: k\n    cmd: |+\n      echo\n\n  noop:\n  - {name: z}\n"
    assert _edit(old, _doc(rows) + keep)
    assert _edit(_doc(rows) + keep, (_doc(rows) + keep).replace("echo", "echo 2"))


def test_exports_and_mgmt_keys_behave_as_in_a_whole_parse(caplog: pytest.LogCaptureFixture) -> None:
    rows = [_flow(i) for i in range(5)]
    exported = [*rows, "  - {name: '@@shared', path: /srv/shared, content: x}"]
    collect = "collect:\n- {kind: file}\n"
    # the exported entry's text is unchanged; a collect spec makes it applied here
    assert _edit(_doc(exported), _doc(exported, head="graph: g\n" + collect))
    assert _edit(_doc(exported, head="graph: g\n" + collect), _doc(exported))
    # an `@` written as an escape is seen too
    escaped = [*rows, '  - {name: "\\x40@esc", path: /srv/esc, content: x}']
    _edit(_doc(rows), _doc(escaped))
    model = parse_yaml(_doc(escaped), F, REG, entries=_entries_of(_doc(rows)))
    assert model.resources["file[esc]"].meta.hidden
    # a key mgmt's code dropped: warned on every parse, as the whole parse does
    ex = "  exec:\n  - {name: e, cmd: /bin/true, timeout: 5}\n"
    entries = _entries_of(_doc(rows) + ex)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="evergraph.frontend.yaml"):
        parse_yaml(_doc(rows[:4]) + ex, F, REG, entries=entries)
    assert [r.getMessage() for r in caplog.records] == [
        f"{F}:9:31: exec[e].timeout: ignored (mgmt's own code no longer has it); "
        "for a deadline use meta: {timeout: SECONDS}"
    ]


def test_split_entries_cuts_entries_out_of_the_text() -> None:
    text = (
        "graph: g\nresources:\n  file:\n  - {name: a}\n  # c\n  - name: b\n    x: 1\n"
        "  exec:\nedges: []\n"
    )
    split = split_entries(text)
    assert split is not None
    skeleton, kinds, last_at_end = split
    assert not last_at_end
    assert skeleton == "graph: g\nresources:\n  file:\n  exec:\nedges: []\n"
    assert kinds == [("file", 2, [" {name: a}\n  # c", " name: b\n    x: 1"]), ("exec", -1, [])]


def test_random_edits_match_a_whole_parse() -> None:
    """Lines deleted, copied, swapped and changed a character at a time, from a
    graph with flow and block entries, comments, block scalars and edges: each
    new text gives what a whole parse gives (the model or its exact error)."""
    base = (
        "graph: g\n"
        "comment: |\n  text\n"
        "resources:\n"
        "  file:\n"
        '  - {name: a, path: /srv/a, content: "x\\n", mode: "0644"}\n'
        "  - name: b\n    path: /srv/b/\n    mode: '0755'\n"
        "  # a comment\n"
        "  - name: c\n    path: /srv/b/c\n    content: |\n      line 1\n      line 2\n\n"
        "  - {name: d, path: /srv/d, state: absent}\n"
        "  exec:\n"
        "    - name: e\n      cmd: /bin/true\n"
        "    - {name: f, cmd: 'echo [x]'}\n"
        "edges:\n"
        "- {from: {kind: file, name: a}, to: {kind: exec, name: e}}\n"
    )
    alphabet = " -:#{}[],'\"|>&*!\n\tax0"
    rng = random.Random(15)
    reused = 0
    for _ in range(400):
        lines = base.splitlines(keepends=True)
        for _ in range(rng.randint(1, 2)):
            i = rng.randrange(len(lines))
            op = rng.randrange(4)
            if op == 0 and len(lines) > 1:
                del lines[i]
            elif op == 1:
                lines.insert(rng.randrange(len(lines)), lines[i])
            elif op == 2:
                j = rng.randrange(len(lines))
                lines[i], lines[j] = lines[j], lines[i]
            else:
                line = lines[i]
                at = rng.randrange(len(line))
                lines[i] = line[:at] + rng.choice(alphabet) + line[at + rng.randint(0, 1) :]
        reused += _edit(base, "".join(lines))
    assert reused > 100  # most edits keep the layout: the entry-wise path is the one taken


def test_unchanged_resources_keep_their_claims_and_autoedge_keys() -> None:
    rows = [_flow(i) for i in range(10)]
    entries = Entries()
    first = parse_yaml(_doc(rows), F, REG, entries=entries)
    prepare(first)
    # a new resource fighting an unchanged one over a file is still refused
    clash = _doc([*rows, "  - {name: other, path: /srv/w/d1/f1.txt, content: other}"])
    with pytest.raises(InputError, match=r"manages file:/srv/w/d1/f1\.txt"):
        parse_yaml(clash, F, REG, entries=entries, valid=first.validated())
    # a managed directory added later: the unchanged files below it follow it
    rows.append("  - {name: dir, path: /srv/w/d1/}")
    second = parse_yaml(_doc(rows), F, REG, entries=entries, valid=first.validated())
    assert add_autoedges(second) == 3
    assert {(e.from_id, e.to_id) for e in second.edges} == {
        ("file[dir]", f"file[f{i}]") for i in (1, 4, 7)
    }
    # keys come from the parameters as parsed, not as received since: the engine
    # sets a received value on its object, the next graph declares that value
    second.resources["file[f2]"].path = "/srv/w/d1/f2.txt"  # type: ignore[attr-defined]
    rows[2] = _flow(2).replace("/d2/", "/d1/")
    rows[7] = "  - {name: f7, path: /srv/w/d2/f7.txt}"  # moved away from dir
    third = parse_yaml(
        _doc(rows) + "  exec:\n  - {name: run, cmd: /srv/w/d1/f2.txt}\n", F, REG, entries=entries
    )
    assert add_autoedges(third) == 4
    assert {(e.from_id, e.to_id) for e in third.edges} == {
        ("file[dir]", "file[f1]"),
        ("file[dir]", "file[f4]"),
        ("file[dir]", "file[f2]"),
        ("file[f2]", "exec[run]"),
    }
