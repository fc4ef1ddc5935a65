"""Explicit edges in mgmt's block layout are read by a regular expression
(`frontends/yaml_edges.py`), not the YAML parser (issue 28): every graph must
be exactly the one the general path gives — the same resources in the same
order with the same parameters, the same edges (notify, send/recv, names),
the same groups after `prepare`, the same warnings, and errors with the same
`file:line:col` — on mgmt's corpus and on seeded random graphs, and the fast
path must be the one taken where it can be."""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from evergraph.engine.model import GraphModel
from evergraph.errors import InputError
from evergraph.frontends import yaml as yaml_frontend
from evergraph.frontends.open import builtin_registry
from evergraph.frontends.yaml import Entries, parse_yaml
from evergraph.frontends.yaml_edges import MARK, split_edges
from tests.kit.models import model_groups, model_view

REG = builtin_registry()
F = "/g/graph.yaml"
MGMT_YAML = Path("/work/shared/mgmt-yaml")


def _parse(text: str) -> GraphModel | str:
    """The model, or the error as `where: message`."""
    try:
        return parse_yaml(text, F, REG)
    except InputError as e:
        return f"{e.where}: {e.message}"


def _general(text: str, monkeypatch: pytest.MonkeyPatch) -> GraphModel | str:
    """`_parse` with the fast path for edges off: the whole text to the YAML parser."""
    with monkeypatch.context() as m:
        m.setattr(yaml_frontend, "_with_fast_edges", lambda text: (None, None))
        return _parse(text)


def _fast_taken(text: str) -> bool:
    return yaml_frontend._with_fast_edges(text)[1] is not None


def _same(text: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    caplog.clear()
    fast = _parse(text)
    fast_log = [(r.levelno, r.getMessage()) for r in caplog.records]
    caplog.clear()
    general = _general(text, monkeypatch)
    general_log = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert fast_log == general_log
    if isinstance(fast, str) or isinstance(general, str):
        assert fast == general
        return
    assert model_view(fast) == model_view(general)
    assert model_groups(fast) == model_groups(general)


# -- mgmt's corpus ----------------------------------------------------------------------


def _corpus() -> Iterator[Path]:
    if not MGMT_YAML.is_dir():
        pytest.skip(f"{MGMT_YAML} is absent (mgmt's examples are not part of this repository)")
    yield from sorted(MGMT_YAML.glob("*.yaml"))


def test_mgmt_corpus_gives_the_same_graphs_and_the_fast_path_reads_its_edges(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    with_edges = []
    for path in _corpus():
        text = path.read_text()
        _same(text, monkeypatch, caplog)
        if "\nedges:\n-" in text:
            # every file of the corpus with edges writes them in mgmt's layout
            assert _fast_taken(text), path.name
            with_edges.append(path.name)
    assert len(with_edges) >= 10, with_edges  # 21 at mgmt's 60c024dd


# -- random graphs ----------------------------------------------------------------------

#: names a YAML parser reads as text when plain, and ones it reads otherwise or
#: that need quoting or escapes (the general path must take those)
NAMES = [
    "a", "n1", "web-1", "x.y", "/etc/hosts", "a:b", "pkg:file", "A_B", "true", "null",
    "False", "yes", "no", "on", "_1", "1", "0x1f", ".inf", "x y", "é", "a#b", "foo:",
    "it's", 'say "hi"', "back\\slash", "", "@@exp", "-", "~", "t\tab",
]  # fmt: skip
KINDS = ["noop", "print", "msg", "nosuch"]


def _scalar(rng: random.Random, value: str) -> str:
    """`value` as YAML: plain, single- or double-quoted (JSON's escapes)."""
    style = rng.choice(["plain", "plain", "plain", "single", "double"])
    if style == "single":
        return "'" + value.replace("'", "''") + "'"
    if style == "double":
        return json.dumps(value)
    return value


#: names the fast path reads in any of the three styles
SAFE = ["web-1", "x.y", "/etc/hosts", "a:b", "A_B", "truex"]


def _edge_block(rng: random.Random, d: str, names: list[str], spoil: float) -> str:
    """One edge in mgmt's layout; with probability ~`spoil` per choice, written
    in a way the fast path leaves to the YAML parser (or invalid)."""

    # mostly forward in `names` (a DAG), else any way (cycles, edges to themselves)
    i, j = sorted(rng.sample(range(len(names)), 2))
    if rng.random() < 0.1:
        i, j = rng.randrange(len(names)), rng.randrange(len(names))
    ends = {"from": names[i], "to": names[j]}

    def end(side: str) -> str:
        kind = rng.choice(KINDS) if rng.random() < 0.1 else rng.choice(["noop", "print"])
        name = ends[side] if rng.random() >= spoil else rng.choice(NAMES)
        lines = [f"kind: {_scalar(rng, kind)}", f"name: {_scalar(rng, name)}"]
        if rng.random() < spoil / 3:
            lines.reverse()
        if rng.random() < spoil / 3:
            lines.append("send: value" if side == "from" else "recv: comment")
        return "".join(f"{d}    {line}\n" for line in lines)

    keys = []
    if rng.random() < 0.8:
        pool = ["e", "e1", "edge-2", *SAFE] + (NAMES if rng.random() < spoil else [])
        keys.append(f"name: {_scalar(rng, rng.choice(pool))}\n")
    keys.append(f"from:\n{end('from')}")
    keys.append(f"to:\n{end('to')}")
    if rng.random() < 0.3:
        pool = ["true", "false"] + (["yes", "1"] if rng.random() < spoil else [])
        keys.append(f"notify: {rng.choice(pool)}\n")
    if rng.random() < spoil / 3:
        rng.shuffle(keys)
    text = f"{d}- " + f"{d}  ".join(keys)
    r = rng.random() * 10
    if r < spoil:
        text += f"{d}# a comment\n"
    elif r < 2 * spoil:
        text += "\n"
    elif r < 3 * spoil:
        text = text.replace("\n", " \n", 1)
    elif r < 4 * spoil:
        a, b = rng.choice(names), rng.choice(names)
        text = f"{d}- {{from: {{kind: noop, name: {a}}}, to: {{kind: noop, name: {b}}}}}\n"
    return text


def _random_graph(rng: random.Random) -> str:
    spoil = rng.choice([0.0, 0.0, 0.05, 0.3])
    plain = [f"r{i}" for i in range(rng.randint(1, 12))]
    names = plain + rng.sample(SAFE, 2) + (rng.sample(NAMES, 4) if spoil else [])
    rows = []
    for kind in ("noop", "print"):
        rows.append(f"  {kind}:\n")
        for name in names:
            if name and rng.random() >= spoil:
                rows.append(f"  - {{name: {json.dumps(name)}}}\n")
    resources = "resources:\n" + "".join(rows)
    d = rng.choice(["", "", "  "])
    edges = "".join(_edge_block(rng, d, names, spoil) for _ in range(rng.randint(1, 15)))
    edges_key = "edges:\n"
    if rng.random() < spoil:
        edges_key = rng.choice(["edges: \n", "edges:  # mgmt's\n"])
    parts = ["graph: g\n", resources, edges_key + edges]
    if rng.random() < 0.3:
        parts[1], parts[2] = parts[2], parts[1]
    if rng.random() < 0.2:
        parts.append(rng.choice(["comment: after\n", "# the end\n", "comment: |\n  x\n"]))
    text = "".join(parts)
    r = rng.random()
    if r < 0.1:
        text = "---\n" + text
    elif r < 0.1 + spoil / 2:
        text = rng.choice(
            [
                text.replace("\n", "\r\n"),
                text + "---\ngraph: h\n",
                "%YAML 1.2\n---\n" + text,
                text + f"comment: {MARK}\n",
                text + "edges: []\n",
            ]
        )
    return text


def test_random_graphs_give_the_same_graph_or_error_either_way(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    rng = random.Random(28)
    taken = models = 0
    n = 600
    for _ in range(n):
        text = _random_graph(rng)
        try:
            _same(text, monkeypatch, caplog)
        except AssertionError:
            print(text)
            raise
        taken += _fast_taken(text)
        models += not isinstance(_parse(text), str)
    # both paths and both outcomes are exercised
    assert n // 5 < taken < n - n // 10, taken
    assert n // 10 < models < n - n // 10, models


# -- what the fast path reads, and what it leaves ---------------------------------------


def test_the_cut_is_the_edges_value_and_everything_else_stays() -> None:
    text = (
        "---\ngraph: g\nresources:\n  noop:\n  - name: a\n  - name: b\n"
        "edges:\n- name: e1\n  from:\n    kind: noop\n    name: a\n"
        "  to:\n    kind: noop\n    name: b\n  notify: true\n"
        "- from:\n    kind: noop\n    name: 'b'\n  to:\n    kind: msg\n    name: \"c d\"\n"
        "comment: after\n"
    )
    got = split_edges(text)
    assert got is not None
    skeleton, edges = got[0], list(got[1])
    assert skeleton == text[: text.index("edges:\n") + 7] + f"- {MARK}\ncomment: after\n"
    assert edges == [
        ("e1", "noop", "a", "noop", "b", "true"),
        (None, "noop", "b", "msg", "c d", None),
    ]


@pytest.mark.parametrize(
    "section",
    [
        "- name: e\n  from:\n    kind: noop\n    name: a\n  to:\n    kind: noop\n    name: b\n"
        "# a comment\n",
        "- name: true\n  from:\n    kind: noop\n    name: a\n  to:\n    kind: noop\n    name: b\n",
        "- name: e\n  from:\n    kind: noop\n    name: a:\n  to:\n    kind: noop\n    name: b\n",
        "- name: e\n  from:\n    kind: noop\n    name: a\n  to:\n    kind: noop\n"
        '    name: "b\\n"\n',
        "- name: e\n  from:\n    name: a\n    kind: noop\n  to:\n    kind: noop\n    name: b\n",
        "- {from: {kind: noop, name: a}, to: {kind: noop, name: b}}\n",
        "[]\n",
    ],
)
def test_what_the_fast_path_does_not_read_goes_to_the_yaml_parser(section: str) -> None:
    text = "graph: g\nresources:\n  noop:\n  - name: a\n  - name: b\nedges:\n" + section
    assert split_edges(text) is None


def test_a_live_edit_reads_the_edges_the_same_way(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A live frontend's re-parse (`Entries`) reads mgmt's edges on the fast path
    too, and gives what a whole parse on the general path gives."""
    rows = "".join(f'  - {{name: r{i}, comment: "v0 {i}"}}\n' for i in range(40))
    edges = "".join(
        f"- name: e{i}\n  from:\n    kind: noop\n    name: r{i}\n"
        f"  to:\n    kind: noop\n    name: r{i + 1}\n" + ("  notify: true\n" if i % 3 else "")
        for i in range(39)
    )
    old = f"graph: g\nresources:\n  noop:\n{rows}edges:\n{edges}"
    new = old.replace('"v0 7"', '"v1 7"')
    entries = Entries()
    assert not isinstance(parse_yaml(old, F, REG, entries=entries), str)
    found = entries.reuse(new)
    assert found is not None
    assert found[3] is not None
    edited = parse_yaml(new, F, REG, entries=entries)
    whole = _general(new, monkeypatch)
    assert not isinstance(whole, str)
    assert model_view(edited) == model_view(whole)
    assert len(edited.edges) == 39
    assert sum(e.notify for e in edited.edges) == 26
