"""Bad input: exit 2, one clear line naming file:line, no traceback, nothing changed."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_cli

CASES = {
    "syntax": (
        "graph: g\nresources:\n  file:\n  - name: a\n    path: [/x,\n    mode: 1\n",
        6,
        "YAML syntax error",
    ),
    "unknown-kind": (
        "graph: g\nresources:\n  fiel:\n  - name: a\n",
        3,
        "unknown resource kind 'fiel'",
    ),
    "unknown-param": (
        "graph: g\nresources:\n  file:\n  - name: a\n    path: SENTINEL\n    contnet: x\n",
        6,
        "file[a].contnet: unknown parameter; did you mean 'content'?",
    ),
    "ill-typed-param": (
        "graph: g\nresources:\n  file:\n  - name: a\n    path: SENTINEL\n    content: 5.5\n",
        6,
        "file[a].content: expected str | null, got float",
    ),
    "ill-typed-meta": (
        "graph: g\nresources:\n  file:\n  - name: a\n    path: SENTINEL\n"
        "    meta:\n      retry: many\n",
        7,
        "file[a].meta.retry: expected int, got str",
    ),
    "unquoted-mode": (  # the source text "0999", as mgmt reads it: not octal
        "graph: g\nresources:\n  file:\n  - name: a\n    path: SENTINEL\n    mode: 0999\n",
        6,
        "file[a].mode: '0999' is neither octal",
    ),
    "bad-mode-value": (
        "graph: g\nresources:\n  file:\n  - name: a\n    path: SENTINEL\n    mode: 'rwx'\n",
        6,
        "file[a].mode",
    ),
    "duplicate-identity": (
        "graph: g\nresources:\n  file:\n  - name: a\n    path: SENTINEL\n"
        "  - name: a\n    path: /elsewhere\n",
        6,
        "file[a] is declared twice",
    ),
    "cycle": (
        "graph: g\nresources:\n  noop:\n  - name: a\n  - name: b\n  - name: c\n"
        "  file:\n  - name: s\n    path: SENTINEL\n"
        "edges:\n"
        "- {from: {kind: noop, name: a}, to: {kind: noop, name: b}}\n"
        "- {from: {kind: noop, name: b}, to: {kind: noop, name: c}}\n"
        "- {from: {kind: noop, name: c}, to: {kind: noop, name: a}}\n",
        13,
        "cycle: noop[a] -> noop[b] -> noop[c] -> noop[a]",
    ),
    "edge-to-nowhere": (
        "graph: g\nresources:\n  file:\n  - name: s\n    path: SENTINEL\n"
        "edges:\n- {from: {kind: file, name: s}, to: {kind: exec, name: ghost}}\n",
        7,
        "exec[ghost], which is not a resource",
    ),
    "relative-path": (
        "graph: g\nresources:\n  file:\n  - name: a\n    path: relative/x\n",
        5,
        "file[a].path: 'relative/x' is not an absolute path",
    ),
    "exec-empty-cmd": (
        "graph: g\nresources:\n  exec:\n  - name: e\n    creates: SENTINEL\n",
        4,
        "exec[e].cmd: is empty",
    ),
    "not-a-mapping": ("- just\n- a list\n", 1, "top level must be a mapping"),
    "unknown-top-key": ("graph: g\nresource:\n  file: []\n", 2, "unknown top-level key"),
    "duplicate-key": (
        "graph: g\nresources:\n  file:\n  - name: a\n    path: SENTINEL\n    path: /b\n",
        6,
        "duplicate mapping key",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("command", ["run", "check"])
def test_bad_graph_is_rejected_with_its_place(tmp_path: Path, case: str, command: str) -> None:
    text, line, needle = CASES[case]
    sentinel = tmp_path / "must-not-exist"
    f = tmp_path / "bad.yaml"
    f.write_text(text.replace("SENTINEL", str(sentinel)))
    state = tmp_path / "state"
    r = (
        run_cli(command, f, "--state-dir", state, "--converged-exit")
        if command == "run"
        else (run_cli(command, f))
    )
    assert r.returncode == 2, r.stderr
    err = r.stderr.strip()
    assert "Traceback" not in r.stderr
    assert len(err.splitlines()) == 1, err
    assert f"{f}:{line}:" in err, err
    assert needle in err, err
    assert not sentinel.exists()
    assert not state.exists(), "a rejected graph must not even create the state dir"


def test_missing_file_and_wrong_suffix(tmp_path: Path) -> None:
    r = run_cli("run", tmp_path / "nope.yaml", "--converged-exit")
    assert r.returncode == 2
    assert "nope.yaml: no such file" in r.stderr
    other = tmp_path / "graph.txt"
    other.write_text("graph: g\n")
    r = run_cli("check", other)
    assert r.returncode == 2
    assert "unsupported graph file type '.txt'" in r.stderr


def test_bad_flags_are_usage_errors(tmp_path: Path) -> None:
    r = run_cli("run", "x.yaml", "--converged-timeout", "-1")
    assert r.returncode == 2
    assert "--converged-timeout" in r.stderr
    r = run_cli("run", "x.yaml", "--log-format", "xml")
    assert r.returncode == 2
