"""The documentation stays true: the committed resource reference is what the code
generates, every `evergraph ...` command shown in the docs names commands and flags
that exist, every complete graph shown loads, and every relative link leads to a
file."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import click
import pytest

from evergraph.cli.main import cli
from tests.conftest import REPO, run_cli

DOCS = [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md"]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"`(evergraph [^`]+)`")


def _name(p: Path) -> str:
    return str(p.relative_to(REPO))


def test_the_committed_resource_reference_is_generated() -> None:
    r = run_cli("docs", "resources")
    assert r.returncode == 0, r.stderr
    committed = (REPO / "docs" / "resources.md").read_text()
    assert committed == r.stdout, (
        "docs/resources.md is stale: regenerate it with "
        "`evergraph docs resources > docs/resources.md`"
    )


# -- commands and flags ---------------------------------------------------------------


def _command_lines(text: str) -> list[str]:
    """Every command line in shell blocks (continuations joined, comments dropped)
    and every inline `evergraph ...` span, split at `&&`, `;` and `|`."""
    lines: list[str] = []
    for lang, body in FENCE.findall(text):
        if lang not in ("sh", "bash", "shell", ""):
            continue
        for line in body.replace("\\\n", " ").splitlines():
            lines.append(line)
    lines += INLINE.findall(text)
    out = []
    for line in lines:
        try:
            words = shlex.split(line, comments=True)
        except ValueError:  # an unbalanced quote inside prose
            continue
        segment: list[str] = []
        for w in [*words, ";"]:
            if w in ("&&", "||", ";", "|"):
                if segment and segment[0] == "evergraph":
                    out.append(shlex.join(segment))
                segment = []
            else:
                segment.append(w)
    return out


def _flags(cmd: click.Command) -> set[str]:
    return {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)} | {"-h", "--help"}


def _check(words: list[str]) -> None:
    """`words` (after `evergraph`) name an existing command and its existing flags."""
    cmd: click.Command = cli
    i = 0
    while isinstance(cmd, click.Group) and i < len(words) and not words[i].startswith("-"):
        if words[i] == "..." or words[i].isupper():
            return  # a placeholder for any command (`evergraph COMMAND --help`)
        sub = cmd.get_command(click.Context(cmd), words[i])  # the top level loads lazily
        if sub is None:
            if getattr(cmd, "invoke_without_command", False):
                break  # a positional of the group itself
            raise AssertionError(f"no command {words[i]!r} in {cmd.name!r}")
        cmd, i = sub, i + 1
    flags = _flags(cmd)
    rest = words[i:]
    if "--" in rest:
        cut = rest.index("--")
        rest, after = rest[:cut], rest[cut + 1 :]
        if cmd.name == "systemd":  # `setup systemd ... -- RUN_OPTIONS`
            _check(["run", *after])
    for w in rest:
        if w.startswith("--"):
            assert w.split("=", 1)[0] in flags, f"{cmd.name}: no flag {w}"
        elif re.fullmatch(r"-[A-Za-z]+", w):
            for c in w[1:]:
                assert f"-{c}" in flags, f"{cmd.name}: no flag -{c}"


CASES = [(doc, line) for doc in DOCS for line in _command_lines(doc.read_text())]


def test_the_docs_show_commands() -> None:
    per_doc = {doc: sum(1 for d, _ in CASES if d == doc) for doc in DOCS}
    for name in ("getting-started.md", "operations.md", "yaml.md"):
        assert per_doc[REPO / "docs" / name] >= 3, per_doc


@pytest.mark.parametrize(("doc", "line"), CASES, ids=[f"{_name(d)}: {c}" for d, c in CASES])
def test_every_command_in_the_docs_exists(doc: Path, line: str) -> None:
    _check(shlex.split(line)[1:])


def test_the_check_catches_a_wrong_flag() -> None:
    with pytest.raises(AssertionError, match="no flag --nope"):
        _check(["graph", "x.yaml", "--nope"])
    with pytest.raises(AssertionError, match="no command 'nope'"):
        _check(["farm", "nope"])
    with pytest.raises(AssertionError, match="no flag --bogus"):
        _check(["setup", "systemd", "--", "--bogus"])


# -- graphs ------------------------------------------------------------------------------


def _graphs() -> list[tuple[Path, int, str, str]]:
    """(doc, index, suffix, text) of every complete graph shown: YAML with a `graph:`
    line, Python defining `graph(g, world)`."""
    out = []
    for doc in DOCS:
        for i, (lang, body) in enumerate(FENCE.findall(doc.read_text())):
            if lang == "yaml" and re.search(r"^graph:", body, re.M) and "\n---" not in body:
                out.append((doc, i, ".yaml", body))
            elif lang == "python" and "def graph(g, world)" in body:
                out.append((doc, i, ".py", body))
    return out


GRAPHS = _graphs()


@pytest.mark.parametrize(
    ("doc", "index", "suffix", "text"), GRAPHS, ids=[f"{_name(d)}#{i}" for d, i, _, _ in GRAPHS]
)
def test_every_graph_in_the_docs_loads(
    tmp_path: Path, doc: Path, index: int, suffix: str, text: str
) -> None:
    f = tmp_path / f"example{suffix}"
    f.write_text(text)
    r = run_cli("check", f)
    assert r.returncode == 0, f"{_name(doc)} block {index}: {r.stderr}"


# -- links -------------------------------------------------------------------------------


@pytest.mark.parametrize("doc", DOCS, ids=_name)
def test_relative_links_lead_to_files(doc: Path) -> None:
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
        if "://" in target:
            continue
        assert (doc.parent / target).exists(), f"{_name(doc)} links to missing {target}"
