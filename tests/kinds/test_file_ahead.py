"""file's check run ahead (`File.ahead_check`, engine/ahead.py): told from the
parameters alone, before init, in a forked child. It may say "in its state"
only where init and the check would find nothing to do: on every shape a path
can take (missing, other content of the same size, other mode, a directory, a
symlink to a good copy, a FIFO, a leftover of a killed write beside it) it
never says so where the check does not, and it does say so for a plain file in
its state. Whole runs: a one-shot run uses the verdicts, still repairs drift,
sweeps leftovers, does not hang on a FIFO, and checks again a file that an
upstream resource changed during the run."""

from __future__ import annotations

import asyncio
import os
import random
from pathlib import Path
from typing import Any

import pytest

import evergraph.resources  # noqa: F401  (declares the built-in kinds)
from evergraph._util.atomic import temp_name
from evergraph.engine.build import build
from evergraph.engine.contract import default_registry
from evergraph.resources.file import File
from evergraph.testing.kinds import Start, run_steps
from tests.conftest import run_cli

CONTENT = "key = value\n"
SHAPES = (
    "missing",
    "in state",
    "other mode",
    "same size, other content",
    "other size",
    "directory",
    "symlink to a good copy",
    "fifo",
    "in state, a leftover beside",
    "empty",
)


def shape(path: Path, what: str, content: str = CONTENT) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if what == "missing":
        return
    if what == "directory":
        path.mkdir()
    elif what == "fifo":
        os.mkfifo(path)
    elif what == "symlink to a good copy":
        good = path.parent / f"good-{path.name}"
        good.write_text(content)
        good.chmod(0o640)
        path.symlink_to(good)
    else:
        text = {
            "same size, other content": content.upper(),
            "other size": content + "more\n",
            "empty": "",
        }.get(what, content)
        path.write_text(text)
        path.chmod(0o600 if what == "other mode" else 0o640)
        if what == "in state, a leftover beside":
            (path.parent / temp_name(path.name)).write_text("half a write")


def verdict_and_check(tmp_path: Path, params: dict[str, Any]) -> tuple[bool | None, bool]:
    """(what it tells ahead, what init + check_apply(apply=False) finds)."""
    told = build(default_registry, "file", params).ahead_check({})
    res = build(default_registry, "file", params)
    run_steps(res, [Start()], state_dir=tmp_path / "s")
    return told, asyncio.run(res.check_apply(False))


@pytest.mark.parametrize("what", SHAPES)
@pytest.mark.parametrize("mode", ["0640", None])
def test_in_state_ahead_only_where_the_check_finds_it_so(
    tmp_path: Path, what: str, mode: str | None
) -> None:
    path = tmp_path / "d" / "f"
    content = "" if what == "empty" else CONTENT
    shape(path, what, content)
    params: dict[str, Any] = {"name": str(path), "content": content}
    if mode is not None:
        params["mode"] = mode
    told, clean = verdict_and_check(tmp_path, params)
    assert told is not None  # a plain file: its kind can tell
    if told:
        assert clean
    in_state = what in ("in state", "empty") or (what == "other mode" and mode is None)
    assert told is in_state, what
    if what == "in state, a leftover beside":
        # not in its state ahead: init's sweep has to run, and it did
        assert [p.name for p in path.parent.iterdir()] == ["f"]


def test_random_trees_never_told_in_state_where_they_are_not(tmp_path: Path) -> None:
    rng = random.Random(28)
    told_in_state = 0
    for i in range(120):
        what = rng.choice(SHAPES)
        content = "" if what == "empty" else f"line {i}\n" * rng.randint(1, 3)
        path = tmp_path / f"t{i}" / "f"
        shape(path, what, content)
        told, clean = verdict_and_check(
            tmp_path / f"s{i}", {"name": str(path), "content": content, "mode": "0640"}
        )
        if told:
            told_in_state += 1
            assert clean, what
    assert told_in_state > 10  # (the comparison proves something)


@pytest.mark.parametrize(
    "params",
    [
        {"owner": "root"},
        {"group": "root"},
        {"state": "absent", "content": None},
        {"path": "/tmp/evergraph-ahead-dir/", "content": None},
        {"symlink": True, "source": "/etc/hostname", "content": None},
        {"source": "/etc/hostname", "content": None},
        {"content": None},
    ],
)
def test_files_that_are_not_plain_cannot_be_told_ahead(
    tmp_path: Path, params: dict[str, Any]
) -> None:
    base: dict[str, Any] = {"name": str(tmp_path / "f"), "content": CONTENT, **params}
    res = build(default_registry, "file", {k: v for k, v in base.items() if v is not None})
    assert isinstance(res, File)
    assert res.ahead_check({}) is None


N = 300  # above engine.ahead.MIN_RESOURCES: the run forks its child


def graph(tmp_path: Path, extra: str = "") -> Path:
    lines = ["graph: ahead", "resources:", "  file:"]
    lines += [
        f'  - {{name: f{i}, path: "{tmp_path}/t/f{i}", content: "{i}\\n", mode: "0640"}}'
        for i in range(N)
    ]
    g = tmp_path / "g.yaml"
    g.write_text("\n".join(lines) + "\n" + extra)
    return g


def run(tmp_path: Path, g: Path, failed: bool = False) -> str:
    r = run_cli("run", g, "--state-dir", tmp_path / "s", "--converged-exit", "-v", timeout=120)
    assert (r.returncode != 0) is failed, r.stderr
    return r.stderr


def found_ahead(log: str) -> int:
    line = next(x for x in log.splitlines() if "found in their state ahead" in x)
    return int(line.split("debug: ")[1].split()[0])


def test_a_one_shot_run_repairs_drift_and_sweeps_leftovers_with_verdicts_ahead(
    tmp_path: Path,
) -> None:
    g = graph(tmp_path)
    run(tmp_path, g)
    t = tmp_path / "t"
    (t / "f3").write_text("drifted\n")
    (t / "f7").chmod(0o644)
    (t / "f11").unlink()
    (t / "f13").unlink()
    os.mkfifo(t / "f13")  # a FIFO in place: the child must not block on it
    leftover = t / temp_name("f17")
    leftover.write_text("half a write")
    log = run(tmp_path, g, failed=True)  # (f13: a FIFO is not replaced without force)
    for i in range(N):
        if i != 13:
            assert (t / f"f{i}").read_text() == f"{i}\n"
            assert (t / f"f{i}").stat().st_mode & 0o7777 == 0o640
    assert not leftover.exists()
    assert "file[f13]: " in log
    assert "not a regular file" in log
    found = found_ahead(log)
    assert N - 5 - 64 <= found <= N - 5  # the run took the child's word for most of them


def test_a_file_an_upstream_resource_changed_is_checked_again(tmp_path: Path) -> None:
    """exec (changes every run) -> file[f5]: the child found f5 in its state before
    the run, then the exec wrote over it; the verdict is dropped and f5 repaired."""
    target = tmp_path / "t" / "f5"
    extra = (
        "  exec:\n"
        f'  - {{name: spoil, cmd: "printf spoiled > {target}", shell: /bin/sh}}\n'
        "edges:\n"
        "- name: e\n  from:\n    kind: exec\n    name: spoil\n"
        "  to:\n    kind: file\n    name: f5\n"
    )
    g = graph(tmp_path, extra)
    run(tmp_path, g)
    log = run(tmp_path, g)
    assert target.read_text() == "5\n"
    assert "file[f5]" in log.split("recap")[-1]  # changed in this run: the recap says so
    assert found_ahead(log) <= N - 1
