"""Error messages of `evergraph check` that tell what to do: the real types of a
send/recv mismatch, a quoted value where YAML read a number, every valid value of
a choice. Each through the CLI: exit 2, one line naming `file:line` and
`kind[name].field`."""

from __future__ import annotations

import subprocess
import typing
from pathlib import Path

import msgspec
import pytest

from evergraph.frontends.open import builtin_registry
from tests.conftest import run_cli


def check_fails(tmp_path: Path, text: str, suffix: str = ".yaml") -> str:
    f = tmp_path / f"site{suffix}"
    f.write_text(text)
    r: subprocess.CompletedProcess[str] = run_cli("check", f)
    assert r.returncode == 2, (r.stdout, r.stderr)
    err = r.stderr.strip()
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"evergraph: {f}:"), err
    return err.removeprefix(f"evergraph: {f}:")


# -- (a) send/recv types -------------------------------------------------------------

SEND = """\
graph: g
resources:
  exec:
  - {{name: a, cmd: "echo hi"}}
  - {{name: b, cmd: "echo hi"}}
edges:
- {{from: {{kind: exec, name: a, send: output}}, to: {{kind: exec, name: b, recv: {recv}}}}}
"""


@pytest.mark.parametrize(
    ("recv", "declared"),
    [("refresh_only", "bool"), ("watchfiles", "list[str]"), ("env", "dict[str, str]")],
)
def test_send_recv_mismatch_names_the_real_types(tmp_path: Path, recv: str, declared: str) -> None:
    err = check_fails(tmp_path, SEND.format(recv=recv))
    assert err.startswith("7:"), err
    assert err.endswith(
        f"edge exec[a].output -> exec[b].{recv}: type mismatch: exec.output is str, "
        f"exec.{recv} takes {declared}"
    ), err
    assert "Annotated" not in err


def test_send_recv_into_an_optional_field_is_accepted(tmp_path: Path) -> None:
    f = tmp_path / "ok.yaml"
    f.write_text(
        "graph: g\nresources:\n  exec:\n  - {name: a, cmd: 'echo hi'}\n"
        f"  file:\n  - {{name: f, path: {tmp_path}/x}}\nedges:\n"
        "- {from: {kind: exec, name: a, send: output}, to: {kind: file, name: f, recv: content}}\n"
    )
    r = run_cli("check", f)
    assert r.returncode == 0, r.stderr


# -- (b) numbers where text is wanted -------------------------------------------------

FILE = "graph: g\nresources:\n  file:\n  - name: f\n    path: /tmp/evergraph-never\n    {line}\n"


@pytest.mark.parametrize(
    ("line", "said"),
    [
        # (an integer takes its source text, as in mgmt: tests/frontends/test_mgmt_compat.py)
        ("owner: true", 'owner: expected str | null, got bool True: quote it, e.g. owner: "true"'),
        ("content: 1.10", "content: expected str | null, got float 1.1: quote it (as text"),
    ],
)  # fmt: skip
def test_a_number_for_text_says_to_quote_it(tmp_path: Path, line: str, said: str) -> None:
    err = check_fails(tmp_path, FILE.format(line=line))
    assert err.startswith("6:"), err
    assert f"file[f].{said}" in err, err


def test_the_quoted_suggestion_is_valid(tmp_path: Path) -> None:
    f = tmp_path / "site.yaml"
    f.write_text(FILE.format(line='mode: "644"'))
    r = run_cli("check", f)
    assert r.returncode == 0, r.stderr


def test_a_python_graph_gets_the_same_advice(tmp_path: Path) -> None:
    err = check_fails(
        tmp_path,
        "def graph(g, world):\n    g.add('file', 'f', path='/tmp/evergraph-never', mode=644)\n",
        ".py",
    )
    assert err == '2: file[f].mode: expected str | null, got int 644: quote it, e.g. mode: "644"'


def test_a_huge_number_is_not_quoted_back(tmp_path: Path) -> None:
    err = check_fails(
        tmp_path,
        "def graph(g, world):\n"
        f"    g.add('file', 'f', path='/tmp/evergraph-never', content={'9' * 200})\n",
        ".py",
    )
    assert err.endswith("file[f].content: expected str | null, got int"), err


# -- (c) a choice lists its valid values, for every kind --------------------------------


def _choices() -> list[tuple[str, str, tuple[str, ...]]]:
    """(kind, field, valid values) of every Literal parameter of every built-in kind."""
    out = []
    registry = builtin_registry()
    for kind in registry.kinds():
        cls = registry.get(kind)
        assert cls is not None
        for field in msgspec.structs.fields(cls):
            t = field.type
            if typing.get_origin(t) is typing.Annotated:
                t = typing.get_args(t)[0]
            if typing.get_origin(t) is typing.Literal:
                out.append((kind, field.name, typing.get_args(t)))
    return out


CHOICES = _choices()


def test_the_kinds_with_choices_are_found() -> None:
    found = {(k, f) for k, f, _ in CHOICES}
    assert {("file", "state"), ("svc", "state"), ("svc", "startup"), ("user", "state")} <= found


@pytest.mark.parametrize(
    ("kind", "field", "valid"), CHOICES, ids=[f"{k}.{f}" for k, f, _ in CHOICES]
)
def test_a_bad_choice_lists_the_valid_values(
    tmp_path: Path, kind: str, field: str, valid: tuple[str, ...]
) -> None:
    err = check_fails(
        tmp_path, f"graph: g\nresources:\n  {kind}:\n  - name: x\n    {field}: present\n"
    )
    listed = ", ".join(repr(v) for v in valid)
    assert err.startswith("5:"), err
    assert err.endswith(
        f"{kind}[x].{field}: Invalid enum value 'present' (valid values: {listed})"
    ), err


def test_a_choice_given_a_number_lists_the_valid_values_too(tmp_path: Path) -> None:
    err = check_fails(tmp_path, FILE.format(line="state: 1"))
    assert err.endswith(
        "file[f].state: Invalid enum value '1' (valid values: 'exists', 'absent')"
    ), err
