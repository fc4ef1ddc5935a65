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
import re
import select
import signal
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest

import evergraph.resources  # noqa: F401  (declares the built-in kinds)
from evergraph._util.atomic import OpenDirs, commit, temp_name
from evergraph.engine import changes
from evergraph.engine.ahead import BATCH_FIRST, BATCH_MAX, JOURNAL
from evergraph.engine.build import build
from evergraph.engine.contract import default_registry
from evergraph.resources.file import File
from evergraph.testing.kinds import Apply, FakeHandle, Start, run_steps
from tests.conftest import EVERGRAPH, run_cli

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
    if told:
        assert clean
    in_state = what in ("in state", "empty") or (what == "other mode" and mode is None)
    # a plain file: its kind tells in its state, absent (may be made ahead), or there
    # but not in its state (None: the engine checks it, without a making tried first)
    assert told is (True if in_state else False if what == "missing" else None), what
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
        {"path": "/tmp/evergraph-ahead-dir/", "content": None, "purge": True},
        {"path": "/tmp/evergraph-ahead-dir/", "content": None, "owner": "root"},
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


def made_ahead(path: str, params: dict[str, Any]) -> tuple[bool, list[Any]]:
    """`params` at `path` made ahead as the child makes it (its check, then
    `ahead_create`, then the commit of its write): (made, what `ahead_created`
    reports)."""
    res = build(default_registry, "file", {**params, "name": "x", "path": path})
    seen: dict[str, Any] = {}
    if res.ahead_check(seen) is not False:
        return False, []
    dirs = OpenDirs()
    try:
        made = res.ahead_create(seen, dirs)
        if made is False:
            return False, []
        if made is not True:
            assert commit([made]) == [None]
    finally:
        dirs.close()
    handle = FakeHandle()
    res.ahead_created(handle)  # type: ignore[arg-type]
    return True, handle.changes


def made_by_check(path: str, params: dict[str, Any], state: Path) -> list[Any]:
    """What init + check_apply(apply=True) report making `params` at `path`."""
    res = build(default_registry, "file", {**params, "name": "x", "path": path})
    run_steps(res, [Start(), Apply()], state_dir=state)
    return list(res.handle.changes)  # type: ignore[attr-defined]


def on_disk(root: Path) -> list[tuple[str, str, int, bytes]]:
    out = []
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        kind = "link" if p.is_symlink() else "dir" if p.is_dir() else "other"
        data = p.read_bytes() if stat.S_ISREG(st.st_mode) else b""
        out.append((str(p.relative_to(root)), kind, st.st_mode & 0o7777, data))
    return out


@pytest.mark.parametrize("what", [*SHAPES, "no directory"])
@pytest.mark.parametrize(
    "params",
    [
        {"content": CONTENT, "mode": "0640"},
        {"content": CONTENT},
        {"content": "", "mode": "0600"},
        {"dir": True, "mode": "0750"},
        {"dir": True},
    ],
    ids=["file-0640", "file", "empty-0600", "dir-0750", "dir"],
)
def test_made_ahead_only_where_nothing_is_and_as_the_check_makes_it(
    tmp_path: Path, what: str, params: dict[str, Any]
) -> None:
    """Made ahead exactly where nothing is at the path (with or without its
    directory): the same file or directory, mode and content as init + the check
    make, and the same changes reported. Anything else there: nothing touched."""
    params = dict(params)
    slash = "/" if params.pop("dir", False) else ""
    sides = {}
    for side in ("ahead", "check"):
        path = tmp_path / side / "sub" / "f"
        if what == "no directory":
            path = tmp_path / side / "new" / "sub" / "f"
            (tmp_path / side).mkdir()
        else:
            shape(path, what)
        sides[side] = path
    before = on_disk(tmp_path / "ahead")
    made, reported = made_ahead(f"{sides['ahead']}{slash}", params)
    assert made is (what in ("missing", "no directory"))
    if not made:
        assert on_disk(tmp_path / "ahead") == before
        return
    assert reported == made_by_check(f"{sides['check']}{slash}", params, tmp_path / "s")
    assert on_disk(tmp_path / "ahead") == on_disk(tmp_path / "check")


def test_files_of_one_alike_key_report_changes_of_one_shape() -> None:
    """`ahead_alike`: a one-shot run asks `ahead_created` of the first file made of
    each key and takes its changes for the others (engine/express.py). On random
    files (directories, contents of colliding sizes in ASCII and in multi-byte
    text, modes written two ways), any two of one key report changes of one shape
    (a content by its size: what a change line shows without a diff). Keys are
    shared by files of other contents (the memo is used), and each of these plain
    files has one (none is left to be asked each time)."""
    rng = random.Random(28)
    contents = ["", "a", "ab", "é", "abc", "€", "x\n", "日本", "abcdef", "ééé"]
    modes = [None, "0640", "640", "0600", "u=rw,g=r,o="]
    shapes: dict[object, set[tuple[object, ...]]] = {}
    texts: dict[object, set[str | None]] = {}
    for i in range(400):
        params: dict[str, Any] = {"name": f"f{i}", "mode": rng.choice(modes)}
        if rng.random() < 0.2:
            params["path"] = f"/x/d{i}/"
        else:
            params["path"] = f"/x/f{i}"
            params["content"] = rng.choice(contents)
        res = build(default_registry, "file", {k: v for k, v in params.items() if v is not None})
        key = res.ahead_alike()
        assert key is not None, params
        handle = FakeHandle()
        res.ahead_created(handle)  # type: ignore[arg-type]
        reported = [(c.field, c.old, c.new, c.content) for c in handle.changes]
        shapes.setdefault(key, set()).add(changes.shape(reported, False))
        texts.setdefault(key, set()).add(params.get("content"))
    assert all(len(s) == 1 for s in shapes.values()), shapes
    assert sum(len(t) > 1 for t in texts.values()) >= 5  # ("ab" and "é": 2 bytes each)


def test_files_that_ahead_create_cannot_make_have_no_alike_key() -> None:
    """A file of no content (a source, fragments) or a directory with content (refused
    by the check anyway) has no key: asked each time."""
    for params in (
        {"path": "/x/f", "source": "/etc/hosts"},
        {"path": "/x/f", "fragments": ["/etc/hosts"]},
    ):
        res = build(default_registry, "file", {"name": "f", **params})
        assert res.ahead_alike() is None


def file(path: str) -> File:
    res = build(default_registry, "file", {"name": "f", "path": path, "content": CONTENT})
    assert isinstance(res, File)
    return res


def test_below_a_directory_found_missing_nothing_that_appeared_since_is_replaced(
    tmp_path: Path,
) -> None:
    """A file below a directory found missing is told missing without a look of its
    own (whatever is there now); it is made without looking only below a directory
    this very child made: one that appeared since, with a file in it, is left as
    it is (its directory is not made, and the file is looked at)."""
    d = tmp_path / "d"
    directory = build(default_registry, "file", {"name": "d", "path": f"{d}/"})
    f = file(f"{d}/f")
    seen: dict[str, Any] = {}
    assert directory.ahead_check(seen) is False
    d.mkdir()  # (someone else's, since)
    (d / "f").write_text("theirs\n")
    assert f.ahead_check(seen) is False
    dirs = OpenDirs()
    try:
        assert directory.ahead_create(seen, dirs) is False
        assert f.ahead_create(seen, dirs) is False
    finally:
        dirs.close()
    assert (d / "f").read_text() == "theirs\n"
    assert sorted(p.name for p in d.iterdir()) == ["f"]
    # below a directory it made, a file is made (with no look: nothing was there)
    e = tmp_path / "e"
    directory = build(default_registry, "file", {"name": "e", "path": f"{e}/"})
    f = file(f"{e}/f")
    seen = {}
    assert directory.ahead_check(seen) is False
    assert f.ahead_check(seen) is False
    dirs = OpenDirs()
    try:
        assert directory.ahead_create(seen, dirs) is True
        pending = f.ahead_create(seen, dirs)
        assert not isinstance(pending, bool)
        assert commit([pending]) == [None]
    finally:
        dirs.close()
    assert (e / "f").read_text() == CONTENT


def test_a_link_planted_below_a_world_writable_directory_just_made_is_replaced(
    tmp_path: Path,
) -> None:
    """Attack: the child made a world-writable directory (mode 0777, as declared)
    and writes below it without a look (`made`); anyone may plant a symlink (to a
    file they want overwritten) at the file's path meanwhile. The rename replaces
    the link: the target is untouched, the path is our file."""
    victim = tmp_path / "victim"
    victim.write_text("root's\n")
    d = tmp_path / "shared"
    directory = build(default_registry, "file", {"name": "d", "path": f"{d}/", "mode": "0777"})
    f = file(f"{d}/f")
    seen: dict[str, Any] = {}
    assert directory.ahead_check(seen) is False
    assert f.ahead_check(seen) is False
    dirs = OpenDirs()
    try:
        assert directory.ahead_create(seen, dirs) is True
        assert stat.S_IMODE(d.stat().st_mode) == 0o777
        (d / "f").symlink_to(victim)  # (the attacker's, between the two makings)
        pending = f.ahead_create(seen, dirs)
        assert not isinstance(pending, bool)
        assert commit([pending]) == [None]
    finally:
        dirs.close()
    assert victim.read_text() == "root's\n"
    assert not (d / "f").is_symlink()
    assert (d / "f").read_text() == CONTENT


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


def tree(tmp_path: Path, n: int, dirs: int = 3) -> Path:
    """A graph of `dirs` directories (0750) and `n` files (0640) spread among them,
    each file with an explicit edge from its directory, as mgmt graphs are written."""
    lines = ["graph: tree", "resources:", "  file:"]
    lines += [f'  - {{name: d{d}, path: "{tmp_path}/t/d{d}/", mode: "0750"}}' for d in range(dirs)]
    lines += [
        f'  - {{name: f{i}, path: "{tmp_path}/t/d{i % dirs}/f{i}", content: "{i}\\n",'
        ' mode: "0640"}'
        for i in range(n)
    ]
    lines.append("edges:")
    for i in range(n):
        lines += [
            f"- name: e{i}",
            f"  from: {{kind: file, name: d{i % dirs}}}",
            f"  to: {{kind: file, name: f{i}}}",
        ]
    g = tmp_path / "g.yaml"
    g.write_text("\n".join(lines) + "\n")
    return g


def tree_is_right(tmp_path: Path, n: int, dirs: int = 3) -> None:
    """Every directory and file in its state, and nothing else there (no leftover)."""
    t = tmp_path / "t"
    assert sorted(p.name for p in t.iterdir()) == sorted(f"d{d}" for d in range(dirs))
    for d in range(dirs):
        assert (t / f"d{d}").stat().st_mode & 0o7777 == 0o750
        names = sorted(p.name for p in (t / f"d{d}").iterdir())
        assert names == sorted(f"f{i}" for i in range(d, n, dirs)), d
    for i in range(n):
        f = t / f"d{i % dirs}" / f"f{i}"
        assert f.read_text() == f"{i}\n"
        assert f.stat().st_mode & 0o7777 == 0o640


def told(log: str) -> tuple[int, int]:
    """(found in their state ahead, made ahead), from the run's debug line."""
    line = next(x for x in log.splitlines() if "found in their state ahead" in x)
    words = line.split("debug: ")[1].split()
    return int(words[0]), int(words[7])


def test_a_first_apply_is_made_ahead_and_logged_as_the_run_makes_it(tmp_path: Path) -> None:
    g = tree(tmp_path, N)
    log = run(tmp_path, g)
    tree_is_right(tmp_path, N)
    assert told(log) == (0, N + 3)
    for d in range(3):
        assert f"file[d{d}]: applied: state, mode" in log
    for i in range(N):
        assert f"file[f{i}]: applied: state, content, mode\n" in log
    # the parse's cache entry, written by a child after the go and its making
    (entry,) = [p for p in (tmp_path / "s" / "parse-cache").iterdir() if p.name[0] != "."]
    assert entry.stat().st_size > 0
    again = run(tmp_path, g)
    assert told(again) == (N + 3, 0)
    assert ": applied" not in again


#: what differs between two runs' lines: the clock, and how long each thing took
_WHEN = re.compile(r"^[0-9:.]+ |\([0-9.]+ m?s\)|after [0-9.]+s")


def drift(t: Path, what: str) -> None:
    if what == "a few files":
        (t / "d0" / "f3").write_text("drifted\n")
        (t / "d1" / "f7").chmod(0o644)
        (t / "d2" / "f11").write_text("xx\n")  # (the same size)
    else:  # a directory's mode: everything below it is checked again
        (t / "d1").chmod(0o755)
        (t / "d2" / "f5").write_text("drifted\n")


@pytest.mark.parametrize("what", ["a few files", "a directory"])
def test_drift_is_repaired_and_said_as_the_lane_says_it(tmp_path: Path, what: str) -> None:
    """A one-shot run without -v leaves what drifted (and all below it) to the
    lane and decides the rest on the verdicts alone (engine/express.py); with -v
    the lane runs the whole graph. Both repair the same and say the same, but for
    -v's debug lines."""
    g = tree(tmp_path, N)
    run(tmp_path, g)
    said = {}
    for verbose in (False, True):
        drift(tmp_path / "t", what)
        args = ["run", g, "--state-dir", tmp_path / "s", "--converged-exit"]
        r = run_cli(*args, *(["-v"] if verbose else []), timeout=120)
        assert r.returncode == 0, r.stderr
        tree_is_right(tmp_path, N)
        said[verbose] = [_WHEN.sub("", x) for x in r.stderr.splitlines() if "debug: " not in x]
    assert said[False] == said[True]
    changed = 3 if what == "a few files" else 2
    assert f"converged: {N + 3} vertices clean, {changed} changed, " in said[False]


def mixed(root: Path, n: int) -> Path:
    """A graph of directories and files made alike and not: contents of a few sizes
    (ASCII, and multi-byte text of the same byte sizes), modes written two ways, none."""
    rng = random.Random(n)
    contents = ["ab", "é", "abc", "€", "", "x y z\\n", "日本"]
    modes = ["", ', mode: "0640"', ', mode: "640"', ', mode: "0600"']
    lines = ["graph: mixed", "resources:", "  file:"]
    lines += [f'  - {{name: d{d}, path: "{root}/t/d{d}/"{modes[d % 2]}}}' for d in range(3)]
    lines += [
        f'  - {{name: f{i}, path: "{root}/t/d{i % 3}/f{i}", content: "{rng.choice(contents)}"'
        f"{rng.choice(modes)}}}"
        for i in range(n)
    ]
    g = root / "g.yaml"
    g.write_text("\n".join(lines) + "\n")
    return g


def test_a_first_apply_of_files_made_alike_and_not_is_said_as_the_lane_says_it(
    tmp_path: Path,
) -> None:
    """Without -v a first apply takes the changes of the files made alike once
    (`ahead_alike`, engine/express.py); with -v the lane asks each file. On two
    fresh trees of one graph, both make the same files and say the same lines
    (the lane's order of files independent of each other may differ: here they
    depend on their directory alone, by automatic edges), the same converged line
    and the same recap."""
    said = {}
    for verbose in (False, True):
        root = tmp_path / ("v" if verbose else "q")
        root.mkdir()
        g = mixed(root, N)
        args = ["run", g, "--state-dir", root / "s", "--converged-exit"]
        r = run_cli(*args, *(["-v"] if verbose else []), timeout=120)
        assert r.returncode == 0, r.stderr
        said[verbose] = [_WHEN.sub("", x) for x in r.stderr.splitlines() if "debug: " not in x]
    assert sorted(said[False]) == sorted(said[True])
    assert on_disk(tmp_path / "q" / "t") == on_disk(tmp_path / "v" / "t")
    assert f"converged: {N + 3} vertices clean, {N + 3} changed, " in said[False]
    assert sum("applied: state, content, mode" in x for x in said[False]) > N // 2


def test_the_lines_of_what_was_made_ahead_come_once_each_and_in_order(tmp_path: Path) -> None:
    """Without -v the run logs the lines of what the children made together (a
    batch at a time, engine/scheduling.py); each still comes once, after those of
    what it depends on, and before the line of a change made after it (a file
    repaired by the run itself, whose line is written through at once)."""
    g = tree(tmp_path, N)
    late = tmp_path / "late"
    late.write_text("other\n")
    g.write_text(
        g.read_text().replace(
            "edges:\n",
            f'  - {{name: late, path: "{late}", content: "late\\n"}}\nedges:\n',
        )
        + f"- name: el\n  from: {{kind: file, name: f{N - 1}}}\n  to: {{kind: file, name: late}}\n"
    )
    r = run_cli("run", g, "--state-dir", tmp_path / "s", "--converged-exit", timeout=120)
    assert r.returncode == 0, r.stderr
    tree_is_right(tmp_path, N)
    assert late.read_text() == "late\n"
    applied = [m.group(1) for m in re.finditer(r"^\S+ (file\[\w+\]): applied: ", r.stderr, re.M)]
    want = {f"file[d{d}]" for d in range(3)} | {f"file[f{i}]" for i in range(N)}
    assert sorted(applied) == sorted(want | {"file[late]"}), "each line once"
    at = {ident: k for k, ident in enumerate(applied)}
    for i in range(N):
        assert at[f"file[d{i % 3}]"] < at[f"file[f{i}]"]
    assert at[f"file[f{N - 1}]"] < at["file[late]"]
    assert r.stderr.index("file[late]: applied") < r.stderr.index("converged:")


def spawn_run(tmp_path: Path, g: Path, crash: str) -> subprocess.Popen[str]:
    """`run` in a session of its own, killed at the crash point `crash`."""
    return subprocess.Popen(
        [*EVERGRAPH, "run", str(g), "--state-dir", str(tmp_path / "s"), "--converged-exit"],
        env={**os.environ, "EVERGRAPH_CRASH_AT": crash},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def session_members(sid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat_line = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat_line.rpartition(")")[2].split()
            if int(fields[3]) == sid:  # (state, ppid, pgrp, session)
                out.append(int(entry))
    return out


def test_the_children_die_with_a_killed_run_and_the_next_run_converges(tmp_path: Path) -> None:
    """kill -9 of the run right after it forked its two children (3000 files: two
    children, SPLIT_MIN): they are killed with it (PR_SET_PDEATHSIG), whatever
    they were making; the next run sweeps what a cut write left and converges."""
    n = 3000
    g = tree(tmp_path, n)
    p = spawn_run(tmp_path, g, "ahead-forked")
    _, err = p.communicate(timeout=120)
    assert p.returncode == -signal.SIGKILL, err
    for pid in session_members(p.pid):
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        try:
            assert select.select([fd], [], [], 30)[0], f"child {pid} outlived its run"
        finally:
            os.close(fd)
    run(tmp_path, g)
    tree_is_right(tmp_path, n)


def test_a_child_killed_after_a_commit_leaves_the_rest_to_the_run(tmp_path: Path) -> None:
    """The child killed after its second batch is durable but before it told it:
    the run makes the rest itself (those made are found in their state)."""
    g = tree(tmp_path, N)
    r = subprocess.run(
        [*EVERGRAPH, "run", str(g), "--state-dir", str(tmp_path / "s"), "--converged-exit"],
        env={**os.environ, "EVERGRAPH_CRASH_AT": "ahead-committed:2"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    tree_is_right(tmp_path, N)
    # what the child made after the directories and before its death went untold
    applied = r.stderr.count(": applied: state")
    assert N + 3 - applied == 2 * BATCH_FIRST  # (its second batch: the first was told)


def test_what_the_children_made_is_logged_after_a_kill_9(tmp_path: Path) -> None:
    """kill -9 of the run while it logs what its children made (at its 50th
    change): each child said what it made in the journal before it made more, and
    the next run logs it. Logged by either run: all made but a batch being made
    when the children were killed (as the engine's own committer, a batch)."""
    n = 3000
    g = tree(tmp_path, n)
    p = spawn_run(tmp_path, g, "parent-changed:50")
    _, first = p.communicate(timeout=120)
    assert p.returncode == -signal.SIGKILL, first
    t = tmp_path / "t"
    made = {f"file[d{d}]" for d in range(3) if (t / f"d{d}").is_dir()}
    made |= {f"file[{f.name}]" for d in t.iterdir() for f in d.iterdir() if f.name[0] == "f"}
    log = run(tmp_path, g)
    late = set(re.findall(r"(file\[\w+\]): applied \(made by an earlier run", log))
    assert late <= made
    logged = set(re.findall(r"(file\[\w+\]): applied", first))
    assert len(made - late - logged) <= 2 * BATCH_MAX
    assert len(late) >= 50  # (the children had made more than the run logged)
    assert not (tmp_path / "s" / JOURNAL).exists()
    tree_is_right(tmp_path, n)


def test_a_run_refused_for_bad_input_makes_nothing_ahead(tmp_path: Path) -> None:
    """The graph parses and the children start, then the agent refuses a flag: exit
    2, and no file, directory nor state dir made (the children wait for the engine
    to run the graph before they make anything)."""
    g = tree(tmp_path, N)
    state = tmp_path / "s"
    r = run_cli("run", g, "--state-dir", state, "--converged-exit", "--hostname", "under_score")
    assert r.returncode == 2, r.stderr
    assert "under_score" in r.stderr
    assert not (tmp_path / "t").exists()
    assert not state.exists()


def test_a_hostile_journal_line_is_logged_escaped(tmp_path: Path) -> None:
    """A journal left in the state dir is logged by the next run, a line each: a
    terminal escape in it is written escaped, never raw; the journal is removed."""
    g = tree(tmp_path, 5)
    state = tmp_path / "s"
    state.mkdir(mode=0o700)
    (state / JOURNAL).write_text("file[x\x1b]0;pwned\x07]\nfile[d0]\n")
    log = run(tmp_path, g)
    assert "\x1b" not in log
    assert "\x07" not in log
    assert "file[x\\x1b]0;pwned\\x07]: applied (made by an earlier run" in log
    assert "file[d0]: applied (made by an earlier run" in log
    assert not (state / JOURNAL).exists()
