"""Work run ahead (engine/ahead.py): a one-shot run forks children that tell
which resources are already in their state, and make the missing ones they may;
the engine records those clean, or changed, with no init and no check. It may
change what a run costs, never what it does: on random graphs (seeded) the run
with verdicts ahead gives the same statuses, exit status, recap and observer
events as the run without, every resource not found ahead is checked as before,
a verdict is dropped where something upstream changed or a refresh, a value or
a secret is due, a resource is made ahead only after all it depends on and
never where anything but an order ties it, and children that die, answer only
in part, or are stopped early leave their resources to the usual checks and
what they made reported."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import select
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import pytest

from evergraph._util.atomic import OpenDirs, Pending, prepare
from evergraph.engine import Edge, GraphModel
from evergraph.engine import ahead as ahead_module
from evergraph.engine.ahead import CREATED, OTHER, PENDING, Ahead, Chore, report_made
from evergraph.engine.autoedge import automatic_edges
from evergraph.engine.contract import Handle, Meta, Registry, Resource, register
from evergraph.engine.engine import Engine
from tests.kit.engine import run_observed

registry = Registry()


class Probe(Resource, kw_only=True, dict=True, forbid_unknown_fields=True):
    """Eager, finishes inline. `clean`: what its check finds; `ahead`: what it
    tells ahead (True only where its check would find it clean)."""

    eager = True
    clean: bool = True
    fail_times: int = 0
    ahead: bool | None = None
    value: str = ""
    sends: ClassVar[dict[str, Any]] = {"out": str}
    #: (name, what) of every init and check, in order (reset by each run)
    log: ClassVar[list[tuple[str, str]]] = []

    def sent(self) -> dict[str, object]:
        return {"out": f"from-{self.name}"}

    def ahead_check(self, seen: dict[str, Any]) -> bool | None:
        seen[self.name] = True
        return self.ahead

    async def init(self, handle: Handle) -> None:
        self.handle = handle
        Probe.log.append((self.name, "init"))

    async def check_apply(self, apply: bool) -> bool:
        runs = sum(1 for n, w in Probe.log if n == self.name and w.startswith("check"))
        refresh = self.handle.refresh()
        Probe.log.append((self.name, f"check refresh={refresh} value={self.value}"))
        if runs < self.fail_times:
            raise RuntimeError(f"planned failure {runs + 1}")
        return self.clean and not refresh


register("probe", registry=registry)(Probe)


@register("plain", registry=registry)
class Plain(Resource, kw_only=True, dict=True, forbid_unknown_fields=True):
    """A kind that cannot tell ahead (the default `ahead_check`)."""

    eager = True

    async def check_apply(self, apply: bool) -> bool:
        Probe.log.append((self.name, "check"))
        return True


def random_graph(seed: int, n: int = 90) -> GraphModel:
    rng = random.Random(seed)
    model = GraphModel(name=f"ahead-{seed}")
    res: list[Resource] = []
    for i in range(n):
        if rng.random() < 0.1:
            r: Resource = Plain(name=f"r{i}")
        else:
            fails = rng.choice((0, 0, 0, 0, 0, 1))
            clean = rng.random() < 0.75
            # telling ahead is a promise: True only where the check finds it clean
            told = rng.choice((True, True, True, False, None)) if clean and not fails else False
            meta = Meta(retry=1, delay=0) if fails else Meta(hidden=rng.random() < 0.04)
            r = Probe(name=f"r{i}", clean=clean, fail_times=fails, ahead=told, meta=meta)
        res.append(r)
        model.add(r)
    random_edges(model, res, rng, counts=(0, 1, 1, 2), notify=0.12, send=0.2)
    model.check()
    return model


def random_edges(
    model: GraphModel,
    res: list[Resource],
    rng: random.Random,
    *,
    counts: tuple[int, ...],
    notify: float,
    send: float,
    near: int | None = None,
) -> None:
    """Random edges, each from an earlier resource (within `near` places, if
    given): `counts` edges into each (chosen among), a share `notify` of them
    notifying, up to `send` sending a value between probes, the rest orders."""
    for b in range(1, len(res)):
        for _ in range(rng.choice(counts)):
            a = rng.randrange(b) if near is None else rng.randrange(max(0, b - near), b)
            roll = rng.random()
            if roll < notify:
                edge = Edge(res[a].ident, res[b].ident, notify=True)
            elif roll < send and isinstance(res[a], Probe) and isinstance(res[b], Probe):
                edge = Edge(res[a].ident, res[b].ident, send="out", recv="value")
            else:
                edge = Edge(res[a].ident, res[b].ident)
            if all((e.from_id, e.to_id) != (edge.from_id, edge.to_id) for e in model.edges):
                model.connect(edge)


def found_ahead(name: str, n: int) -> GraphModel:
    """`n` probes `p0`... that their checks ahead find in their state, no edge."""
    model = GraphModel(name=name)
    for i in range(n):
        model.add(Probe(name=f"p{i}", ahead=True))
    return model


def run(
    tmp_path: Path, model: GraphModel, caplog: pytest.LogCaptureFixture, **kw: object
) -> tuple[dict[str, Any], Engine]:
    Probe.log = []
    out, engine = run_observed(tmp_path, model, caplog, registry, **kw)
    if model.ahead is not None:
        model.ahead.stop()  # (as the run's end does, cli/runner.py: the children reaped)
    return {**out, "log": list(Probe.log)}, engine


async def _all_verdicts(ahead: Ahead) -> None:
    """Wait (polling the pipe, as the lane does) until the child has answered
    for every resource, so that a test knows which verdicts the engine sees."""
    while ahead._fd >= 0:
        ahead.poll()
        await asyncio.sleep(0.001)


def ahead_of(model: GraphModel, whole: bool = True, **kw: Any) -> Ahead:
    model.auto = automatic_edges(model)  # (as a parse leaves them: frontends/cache.py)
    ahead = Ahead.start(model, at_least=1, **kw)
    assert ahead is not None
    if whole:
        ahead.go()  # (the engine's swap says it too: once is enough)
        asyncio.run(_all_verdicts(ahead))
    model.ahead = ahead
    return ahead


@pytest.mark.parametrize("seed", range(10))
def test_verdicts_ahead_change_nothing_a_run_does(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, seed: int
) -> None:
    plain, p_engine = run(tmp_path / "p", random_graph(seed), caplog)
    model = random_graph(seed)
    ahead_of(model)
    told, a_engine = run(tmp_path / "a", model, caplog)
    assert p_engine.ahead_runs == 0
    assert a_engine.ahead_runs > 0  # verdicts were used
    for key in ("status", "views", "recap", "events"):
        assert told[key] == plain[key], key
    # what was not found ahead was initialised and checked as before (its init
    # later: when it was due); what was, neither
    skipped = {n for n, _ in plain["log"]} - {n for n, _ in told["log"]}
    assert len(skipped) == a_engine.ahead_runs
    checks = [e for e in plain["log"] if e[0] not in skipped and e[1] != "init"]
    assert [e for e in told["log"] if e[1] != "init"] == checks
    inits = sorted(e for e in plain["log"] if e[0] not in skipped and e[1] == "init")
    assert sorted(e for e in told["log"] if e[1] == "init") == inits
    for name in skipped:
        r = model.resources[f"probe[{name}]"]
        assert isinstance(r, Probe)
        assert r.ahead is True


def test_a_verdict_is_dropped_below_a_change_a_refresh_or_a_value(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """a (changes) -> b -> c: b and c are checked although found ahead, since a
    changed something upstream of them; d is refreshed by a notify edge from a;
    e receives a value from f (clean); g is on its own: the only one skipped."""
    model = GraphModel(name="drop")
    for name, clean in (("a", False), *((n, True) for n in "bcdefg")):
        model.add(Probe(name=name, clean=clean, ahead=clean))
    model.connect(Edge("probe[a]", "probe[b]"))
    model.connect(Edge("probe[b]", "probe[c]"))
    model.connect(Edge("probe[a]", "probe[d]", notify=True))
    model.connect(Edge("probe[f]", "probe[e]", send="out", recv="value"))
    model.check()
    ahead_of(model)
    out, engine = run(tmp_path, model, caplog)
    inited = sorted({n for n, w in out["log"] if w == "init"})  # (e again, with its value)
    assert inited == ["a", "b", "c", "d", "e", "f"]
    assert ("d", "check refresh=True value=") in out["log"]
    assert ("e", "check refresh=False value=from-f") in out["log"]
    assert engine.ahead_runs == 1
    assert out["status"] == 0


def test_a_child_that_dies_leaves_every_resource_to_its_check(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = found_ahead("dies", 50)
    model.check()
    ahead = ahead_of(model, whole=False)
    os.kill(ahead.pids[0], signal.SIGKILL)  # before (or while) it answers
    out, engine = run(tmp_path, model, caplog)
    # whatever it said before dying was used; the rest was checked: all clean
    assert out["status"] == 0
    checked = {n for n, w in out["log"] if w.startswith("check")}
    assert len(checked) + engine.ahead_runs == 50
    assert {s.state for s in engine.status()} == {"clean"}
    with pytest.raises(ChildProcessError):
        os.waitpid(ahead.pids[0], os.WNOHANG)  # reaped: no zombie left


def test_a_child_that_answers_in_part_is_used_for_that_part(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A child that ended with no word on some resources (as if it died there):
    those are initialised and checked, the others found ahead."""
    model = found_ahead("half", 40)
    model.check()
    ahead = ahead_of(model)
    ahead.verdicts[:20] = bytes([PENDING]) * 20  # (as if they had not come)
    out, engine = run(tmp_path, model, caplog)
    assert engine.ahead_runs == 20
    assert sorted(int(n[1:]) for n, w in out["log"] if w == "init") == list(range(20))


def test_no_child_for_a_graph_whose_kinds_cannot_tell(tmp_path: Path) -> None:
    model = GraphModel(name="none")
    for i in range(300):
        model.add(Plain(name=f"p{i}"))
    assert Ahead.start(model, at_least=1) is None
    few = GraphModel(name="few")
    for i in range(10):
        few.add(Probe(name=f"q{i}"))
    assert Ahead.start(few) is None  # below MIN_RESOURCES: a fork costs more


def test_a_vertex_that_does_not_run_inline_is_initialised_and_checked_as_usual(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A vertex that must not run inline (a semaphore) takes no verdict: it is
    initialised as it starts and checked (the general path), even if found ahead;
    a refreshed one (found ahead too) is initialised by `_start` before its check
    (see the test above: d)."""
    model = GraphModel(name="general")
    model.add(Probe(name="s", ahead=True, meta=Meta(sema=["one:1"])))
    model.add(Probe(name="t", ahead=True))
    model.check()
    ahead_of(model)
    out, engine = run(tmp_path, model, caplog)
    assert [w for n, w in out["log"] if n == "s"] == ["init", "check refresh=False value="]
    assert [w for n, w in out["log"] if n == "t"] == []
    assert engine.ahead_runs == 1


def test_unobserved_vertices_found_ahead_are_clean_with_a_duration_of_their_own(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """With no observer (the lane sets states itself), a vertex found ahead is
    clean and its duration is its own step's, not the clock's whole reading."""
    model = found_ahead("quiet", 30)
    model.check()
    ahead_of(model)
    out, engine = run(tmp_path, model, caplog, observe=False, express=False)
    assert engine.ahead_runs == 30
    assert out["log"] == []  # neither initialised nor checked
    for s in engine.status():
        assert s.state == "clean"
        assert 0 <= s.duration < 60, s


def _wait_for_path(path: str) -> None:
    """(a child's: a file the test makes when it may go on)"""
    deadline = time.monotonic() + 60
    while path and not os.path.exists(path):
        assert time.monotonic() < deadline, path
        time.sleep(0.002)


@register("mark", registry=registry)
class Mark(Resource, kw_only=True, dict=True, forbid_unknown_fields=True):
    """A marker file, in its state when `path` exists; made ahead (`ahead_create`:
    at once, or with `write` a `Pending` write the child commits) or by its check.
    Each making appends `<name> <by>` to `journal` (O_APPEND: a line each, in the
    order made, whichever process made it)."""

    eager = True
    path: str = ""
    journal: str = ""
    write: bool = False
    #: its making ahead fails (after its check said it is missing)
    fails_ahead: bool = False
    #: its check, and its making, ahead wait until this path exists ("": they do not)
    check_gate: str = ""
    make_gate: str = ""

    def ahead_check(self, seen: dict[str, Any]) -> bool | None:
        _wait_for_path(self.check_gate)
        return os.path.exists(self.path)

    def ahead_create(self, seen: dict[str, Any], dirs: OpenDirs) -> Pending | bool:
        if self.fails_ahead:
            raise OSError("no room")
        _wait_for_path(self.make_gate)
        self._note("ahead")
        if self.write:
            return prepare(self.path, b"", mode=0o644, dirs=dirs, fresh=True)
        Path(self.path).touch(exist_ok=False)
        return True

    def ahead_created(self, handle: Handle) -> None:
        handle.changed("state", None, "made")

    async def init(self, handle: Handle) -> None:
        self.handle = handle
        Probe.log.append((self.name, "init"))

    async def check_apply(self, apply: bool) -> bool:
        Probe.log.append((self.name, "check"))
        if os.path.exists(self.path):
            return True
        self.handle.changed("state", None, "made")
        if apply:
            self._note("check")
            Path(self.path).touch(exist_ok=False)
        return False

    def _note(self, by: str) -> None:
        fd = os.open(self.journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, f"{self.name} {by}\n".encode())
        finally:
            os.close(fd)


def marks_graph(seed: int, root: Path, n: int = 80) -> GraphModel:
    """Mostly marks (some there already, some written through a Pending, a few with
    a meta that keeps them from being made ahead), probes and kinds that cannot
    tell; edges plain, notify or sending, always from an earlier resource."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    journal = str(root / "journal")
    model = GraphModel(name=f"marks-{seed}")
    res: list[Resource] = []
    for i in range(n):
        roll = rng.random() if i >= 3 else 1.0  # (the first ones: marks)
        if roll < 0.1:
            r: Resource = Plain(name=f"r{i}")
        elif roll < 0.25:
            clean = rng.random() < 0.8
            r = Probe(name=f"r{i}", clean=clean, ahead=rng.choice((True, None)) if clean else False)
        else:
            path = root / f"m{i}"
            if rng.random() < 0.3:
                path.touch()
            metas = (Meta(), Meta(), Meta(), Meta(), Meta(noop=True), Meta(sema=["s:2"]))
            meta = rng.choice(metas) if i >= 3 else Meta()
            r = Mark(
                name=f"r{i}", path=str(path), journal=journal, write=rng.random() < 0.5, meta=meta
            )
        res.append(r)
        model.add(r)
    random_edges(model, res, rng, counts=(0, 1, 1, 1, 2), notify=0.08, send=0.12, near=12)
    model.check()
    return model


def journal(root: Path) -> list[tuple[str, str]]:
    path = root / "journal"
    lines = path.read_text().splitlines() if path.exists() else []
    return [(name, by) for name, by in (line.split() for line in lines)]


def ancestors(model: GraphModel, ident: str) -> set[str]:
    up: dict[str, list[str]] = {}
    for e in model.edges:
        up.setdefault(e.to_id, []).append(e.from_id)
    seen: set[str] = set()
    stack = [ident]
    while stack:
        for p in up.get(stack.pop(), []):
            if p not in seen:
                seen.add(p)
                stack.append(p)
    return seen


def declared_backwards(model: GraphModel) -> GraphModel:
    """`model` with its resources declared in the reverse order: each edge goes
    back in it (the children's order is then worked out, not the declared one)."""
    back = GraphModel(
        name=model.name,
        resources=dict(reversed(model.resources.items())),
        edges=list(model.edges),
    )
    back.check()
    return back


@pytest.mark.parametrize("backwards", [False, True])
@pytest.mark.parametrize("seed", range(8))
def test_what_is_made_ahead_is_made_as_the_run_would_make_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, seed: int, backwards: bool
) -> None:
    def graph(root: Path) -> GraphModel:
        model = marks_graph(seed, root)
        return declared_backwards(model) if backwards else model

    plain, p_engine = run(tmp_path / "p", graph(tmp_path / "pm"), caplog)
    model = graph(tmp_path / "am")
    told_to = tmp_path / "made-ahead"
    # (odd seeds: the lane waits for the verdicts as they come, from two children)
    ahead_of(model, whole=seed % 2 == 0, children=1 + seed % 2, journal=told_to)
    told, a_engine = run(tmp_path / "a", model, caplog)
    assert p_engine.ahead_made == 0
    assert a_engine.ahead_made > 0
    for key in ("status", "views", "recap", "events"):
        assert told[key] == plain[key], key
    # the same marks exist, each made once, and after everything it depends on
    made = journal(tmp_path / "am")
    assert sorted(n for n, _ in made) == sorted(n for n, _ in journal(tmp_path / "pm"))
    assert len({n for n, _ in made}) == len(made)
    when = {f"mark[{n}]": k for k, (n, _) in enumerate(made)}
    for ident, k in when.items():
        assert all(when.get(p, -1) < k for p in ancestors(model, ident)), ident
    # made ahead: neither initialised nor checked here; all it depends on could
    # tell ahead, and only orders tie it
    ahead = {n for n, by in made if by == "ahead"}
    assert len(ahead) == a_engine.ahead_made
    # each said in the journal before the next was made: all of them, once
    said = told_to.read_text().splitlines()
    assert sorted(said) == sorted(f"mark[{n}]" for n in ahead)
    assert not ahead & {n for n, _ in told["log"]}
    tied = {e.to_id for e in model.edges if e.notify or e.recv} | {
        e.from_id for e in model.edges if e.notify or e.send
    }
    for name in ahead:
        ident = f"mark[{name}]"
        r = model.resources[ident]
        assert ident not in tied
        assert r.meta == Meta()
        assert not any(p.startswith("plain[") for p in ancestors(model, ident))


@pytest.mark.parametrize("seed", range(20))
def test_the_plan_puts_parents_first_and_a_connected_part_in_one_child(
    tmp_path: Path, seed: int
) -> None:
    rng = random.Random(seed)
    model = marks_graph(seed, tmp_path / "m", n=rng.randint(5, 90))
    if seed % 2:
        model = declared_backwards(model)
    model.auto = automatic_edges(model)
    listed = list(model.resources.values())
    n = len(listed)
    parents, _, order = ahead_module._plan(model, listed, True)
    assert order is not None
    assert sorted(order) == list(range(n))
    place = {ident: i for i, ident in enumerate(model.resources)}
    at = {i: k for k, i in enumerate(order)}
    pairs = [(place[e.from_id], place[e.to_id]) for e in model.edges]
    for a, b in pairs:
        assert at[a] < at[b]
        assert a in parents[b]
    if all(a < b for a, b in pairs):
        assert order == list(range(n))  # (the declared order, which is one)
    # each connected part whole in one child; the parts, by their first resource,
    # each to the child with the least so far
    part = list(range(n))
    linked = {i: set() for i in range(n)}
    for a, b in pairs:
        linked[a].add(b)
        linked[b].add(a)
    for i in range(n):
        if part[i] == i:
            stack = [i]
            while stack:
                for j in linked[stack.pop()]:
                    if part[j] != i:
                        part[j] = i
                        stack.append(j)
    for of in (1, 2, 3):
        owner = ahead_module._owners(parents, n, of)
        load = [0] * of
        want: dict[int, int] = {}
        for first in sorted(set(part)):
            want[first] = load.index(min(load))
            load[want[first]] += part.count(first)
        assert list(owner) == [want[part[i]] for i in range(n)], of


@pytest.mark.parametrize("creates", [False, True])
def test_nothing_is_made_ahead_without_creates_or_a_journal(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, creates: bool
) -> None:
    """Under noop (or a global semaphore, or in a worker: cli/runner.py), or with
    no journal to say it in, the children only check: what is missing is left to
    the run."""
    model = marks_graph(3, tmp_path / "m")
    ahead_of(model, creates=creates, journal=None if creates else tmp_path / "made-ahead")
    _, engine = run(tmp_path / "a", model, caplog)
    assert engine.ahead_made == 0
    assert {by for _, by in journal(tmp_path / "m")} == {"check"}


def _marks_to_make(tmp_path: Path, name: str) -> tuple[GraphModel, Path]:
    """3,000 independent marks to make (1,500 for each child) in `tmp_path`/m."""
    model = GraphModel(name=name)
    root = tmp_path / "m"
    root.mkdir()
    for i in range(3000):
        model.add(
            Mark(name=f"r{i}", path=str(root / f"m{i}"), journal=str(tmp_path / "j"), write=True)
        )
    model.check()
    model.auto = automatic_edges(model)
    return model, root


def test_a_making_is_said_then_told_after_its_rename_and_nothing_is_synced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The children make new files only: each is renamed into place with no sync
    (atomic's fsync policy for `fresh` writes: no syncfs, no fsync), then said in
    the journal, then told, in batches that double from BATCH_FIRST (the children
    record when they rename, sync and say: the patched functions are theirs once
    forked)."""
    from evergraph._util import atomic

    model, _ = _marks_to_make(tmp_path, "durable")
    events = tmp_path / "events"

    def note(line: str) -> None:
        fd = os.open(events, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, f"{os.getpid()} {time.monotonic_ns()} {line}\n".encode())
        finally:
            os.close(fd)

    real_syncfs, real_fsync = atomic.syncfs, os.fsync
    real_rename, real_journal = os.rename, ahead_module._journal

    def syncfs(fd: int) -> None:
        note("sync fs")
        real_syncfs(fd)

    def fsync(fd: int) -> None:
        note("sync file")
        real_fsync(fd)

    def rename(src: Any, dst: Any, **kw: Any) -> None:
        real_rename(src, dst, **kw)
        note(f"rename {dst}")

    def journal(fd: int, resources: list[Resource], made: list[int]) -> None:
        note(f"batch {len(made)}")
        for i in made:
            note(f"said {resources[i].name}")
        real_journal(fd, resources, made)

    monkeypatch.setattr(atomic, "syncfs", syncfs)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(ahead_module, "_journal", journal)
    ahead = Ahead.start(model, at_least=1, journal=tmp_path / "made-ahead")
    assert ahead is not None
    ahead.go()
    while ahead._fd >= 0:  # (to the end: the children exit once all is done)
        select.select([ahead._fd], [], [])
        ahead.poll()
    made = ahead.stop()  # (the places of those made: none was taken)
    monkeypatch.undo()
    assert len(made) == 3000
    renamed: dict[str, tuple[str, int]] = {}
    said: dict[str, tuple[str, int]] = {}
    batches: dict[str, list[int]] = {}
    for line in events.read_text().splitlines():
        pid, at, what, arg = line.split()
        assert what not in ("sync", "syncfs"), line  # (nothing synced: new files)
        if what == "rename":
            renamed["r" + arg[1:]] = (pid, int(at))  # (m<i>: mark r<i>)
        elif what == "said":
            assert arg not in said
            said[arg] = (pid, int(at))
        else:
            assert what == "batch"
            batches.setdefault(pid, []).append(int(arg))
    assert said.keys() == renamed.keys() == {f"r{i}" for i in range(3000)}
    for name, (pid, at) in said.items():
        by, when = renamed[name]
        assert by == pid, name
        assert when < at, name
    # each child's batches double from BATCH_FIRST (1500 marks a child)
    want, left, limit = [], 1500, ahead_module.BATCH_FIRST
    while left:
        want.append(min(limit, left))
        left -= want[-1]
        limit = min(limit * 2, ahead_module.BATCH_MAX)
    assert list(batches.values()) == [want, want]


def test_stop_tells_what_was_made_and_leaves_no_half_write(tmp_path: Path) -> None:
    """Stopped while it works, each child finishes the batch it commits, drops the
    one it prepares (its temporary files removed), and tells what it made: every
    mark on disk is told made (for the engine to log), none is half written."""
    model, root = _marks_to_make(tmp_path, "stop")
    ahead = Ahead.start(model, at_least=1, journal=tmp_path / "made-ahead")
    assert ahead is not None
    assert len(ahead.pids) == 2  # (SPLIT_MIN: two children)
    ahead.go()
    while ahead._fd >= 0 and CREATED not in ahead.verdicts:
        select.select([ahead._fd], [], [])
        ahead.poll()
    made = ahead.stop()
    assert made  # (one came before the stop, at least)
    on_disk = sorted(int(p.name[1:]) for p in root.iterdir() if p.name.startswith("m"))
    assert sorted(made) == on_disk
    assert [p.name for p in root.iterdir() if not p.name.startswith("m")] == []  # no temp
    assert ahead.stop() == []  # (told once)
    said = (tmp_path / "made-ahead").read_text().splitlines()
    assert sorted(said) == sorted(f"mark[r{i}]" for i in made)  # (the journal too)
    ahead.forget()
    assert not (tmp_path / "made-ahead").exists()
    for pid in ahead.pids:
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)


def _recorder(root: Path, calls: Path) -> Callable[[str], None]:
    """What a child's chore does, said: `<pid> <name> <marks on disk>` appended to
    `calls`."""

    def record(name: str) -> None:
        on_disk = sum(1 for p in root.iterdir() if p.name.startswith("m"))
        with open(calls, "a") as f:
            f.write(f"{os.getpid()} {name} {on_disk}\n")

    return record


def _recorded_chore(root: Path, calls: Path) -> Chore:
    """A chore whose work (in one step) and write each say so (`_recorder`)."""
    record = _recorder(root, calls)

    def work(until: Callable[[], bool] | None) -> bool:
        record("work")
        return True

    return work, lambda: record("write")


@pytest.mark.parametrize("go", ["first", "later", "never"])
def test_the_chore_is_done_by_one_child_its_writes_after_its_making_and_never_without_the_go(
    tmp_path: Path, go: str
) -> None:
    """The chore (the parse cache entry: frontends/cache.py) is done once, by one
    child, whichever takes it first: its work (CPU alone) once its checks are done,
    while it waits for the go (after its making if the go came before); its writes
    after the go, once that child's making is done (the engine waits for the
    making, not for the chore). A run that never gives the go never has them
    written."""
    model, root = _marks_to_make(tmp_path, "chore")
    calls = tmp_path / "calls"

    chore = _recorded_chore(root, calls)
    ahead = Ahead.start(model, at_least=1, journal=tmp_path / "made-ahead", chore=chore)
    assert ahead is not None
    assert len(ahead.pids) == 2
    if go == "later":  # once the chore's work is done, which it does while it waits
        deadline = time.monotonic() + 60
        while not (calls.exists() and calls.read_text()):
            assert time.monotonic() < deadline, "no chore while the children wait for the go"
            time.sleep(0.01)
    if go != "never":
        ahead.go()
        while ahead._fd >= 0:  # (to the end: the children exit once all is done)
            select.select([ahead._fd], [], [])
            ahead.poll()
    ahead.stop()  # (no go: it closes the pipe they wait on)
    lines = [line.split() for line in calls.read_text().splitlines()] if calls.exists() else []
    assert {int(pid) for pid, _, _ in lines} <= set(ahead.pids)
    if go == "never":
        assert [name for _, name, _ in lines] in ([], ["work"])
        assert not any(root.iterdir())
        return
    assert [name for _, name, _ in lines] == ["work", "write"]
    assert lines[0][0] == lines[1][0]  # (one child, the one that took it)
    # its work before anything was made (the go came after it), or after its making
    # (the go came first: unless that child was done checking before the go came)
    worked_at = int(lines[0][2])
    assert worked_at == 0 if go == "later" else worked_at == 0 or worked_at >= 1500
    assert int(lines[1][2]) >= 1500  # (its own part, at least, made by then)
    assert sum(1 for _ in root.iterdir()) == 3000


def test_children_making_when_the_go_came_leave_the_chore_to_the_first_done(
    tmp_path: Path,
) -> None:
    """The go came before the children were done checking: the chore is not taken
    by the first done checking, but by the first done making (the run's end waits
    for the chore; a child that makes has the go's work to do first)."""
    model, root = _marks_to_make(tmp_path, "chore")
    checked, slow = tmp_path / "checked", tmp_path / "slow"
    marks = list(model.resources.values())
    # (independent marks: child k has every other one from r<k>. The first check
    # of each waits for the go; child 0's last check waits for child 1's first
    # making, so child 1 is the first done checking; its last making waits for
    # `slow`, so child 0 is the first done making)
    for r in marks[:2]:
        r.check_gate = str(checked)  # type: ignore[attr-defined]
    marks[-2].check_gate = marks[1].path  # type: ignore[attr-defined]
    marks[-1].make_gate = str(slow)  # type: ignore[attr-defined]
    calls = tmp_path / "calls"

    chore = _recorded_chore(root, calls)
    ahead = Ahead.start(model, at_least=1, journal=tmp_path / "made-ahead", chore=chore)
    assert ahead is not None
    assert len(ahead.pids) == 2
    assert list(ahead_module._planned(model, marks, True, 2).owner[:4]) == [0, 1, 0, 1]
    ahead.go()
    checked.touch()
    deadline = time.monotonic() + 60
    while not (calls.exists() and calls.read_text()):  # (child 1 waits on `slow`)
        assert time.monotonic() < deadline, "the chore waits for the slower maker"
        time.sleep(0.01)
    slow.touch()
    while ahead._fd >= 0:  # (to the end: the children exit once all is done)
        select.select([ahead._fd], [], [])
        ahead.poll()
    ahead.stop()
    lines = [line.split() for line in calls.read_text().splitlines()]
    assert [name for _, name, _ in lines] == ["work", "write"]
    assert {int(pid) for pid, _, _ in lines} == {ahead.pids[0]}  # (child 0: the first done)
    assert int(lines[0][2]) >= 1500  # (after its making: its own part, at least)
    assert sum(1 for _ in root.iterdir()) == 3000


def test_the_go_stops_the_chores_work_between_two_steps_and_the_making_comes_first(
    tmp_path: Path,
) -> None:
    """The chore's work is done in steps while its child waits for the go; the go
    stops it between two steps: that child makes its part first, then finishes the
    work, then writes (the engine waits for the making, not for the chore)."""
    model, root = _marks_to_make(tmp_path, "chore")
    calls, gate = tmp_path / "calls", tmp_path / "gate"
    steps = 6
    done = [0]  # (the child's own copy: what it did of the work so far)

    record = _recorder(root, calls)

    def work(until: Callable[[], bool] | None) -> bool:
        while done[0] < steps:
            if until is not None and until():
                return False
            if done[0] == 1:  # (step 1 ends once the go was given)
                deadline = time.monotonic() + 60
                while not gate.exists():
                    assert time.monotonic() < deadline
                    time.sleep(0.005)
            record(f"work{done[0]}")
            done[0] += 1
        return True

    ahead = Ahead.start(
        model, at_least=1, journal=tmp_path / "made-ahead", chore=(work, lambda: record("write"))
    )
    assert ahead is not None
    deadline = time.monotonic() + 60
    while not (calls.exists() and calls.read_text()):  # step 0 done: the go now
        assert time.monotonic() < deadline, "no chore while the children wait for the go"
        time.sleep(0.01)
    ahead.go()
    gate.touch()
    while ahead._fd >= 0:  # (to the end: the children exit once all is done)
        select.select([ahead._fd], [], [])
        ahead.poll()
    ahead.stop()
    lines = [line.split() for line in calls.read_text().splitlines()]
    assert [name for _, name, _ in lines] == [*(f"work{k}" for k in range(steps)), "write"]
    assert len({pid for pid, _, _ in lines}) == 1  # (one child, the one that took it)
    on_disk = [int(n) for _, _, n in lines]
    # (step 0 before the go; step 1 ends after it, while the other child may make)
    assert on_disk[0] == 0
    # the rest after that child's making: its own part, at least, made by then
    assert all(n >= 1500 for n in on_disk[2:]), on_disk
    assert sum(1 for _ in root.iterdir()) == 3000


def test_a_child_still_at_the_chore_finishes_it_while_the_run_ends(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Every verdict taken, the engine stops without waiting for the child at the
    chore (the parse cache entry): it finishes while the agent stops, and `stop`,
    at the run's end, waits for it and reaps both children."""
    model, _ = _marks_to_make(tmp_path, "chore")
    calls, gate = tmp_path / "calls", tmp_path / "gate"

    def write() -> None:
        with open(calls, "a") as f:
            f.write(f"{os.getpid()} at\n")
        deadline = time.monotonic() + 60
        while not gate.exists():  # (until the engine's run is over)
            assert time.monotonic() < deadline
            time.sleep(0.005)
        with open(calls, "a") as f:
            f.write(f"{os.getpid()} done\n")

    ahead = ahead_of(
        model, whole=False, journal=tmp_path / "made-ahead", chore=(lambda until: True, write)
    )
    out, engine = run_observed(tmp_path / "a", model, caplog, registry)
    assert out["status"] == 0
    assert engine.ahead_made == 3000
    # the engine did not wait for the chore: the child is at it, not done
    deadline = time.monotonic() + 60
    while not (calls.exists() and calls.read_text()):
        assert time.monotonic() < deadline
        time.sleep(0.005)
    pid, at = calls.read_text().split()
    assert at == "at"
    assert os.waitpid(int(pid), os.WNOHANG) == (0, 0)
    gate.touch()
    ahead.stop()
    assert calls.read_text().split() == [pid, "at", pid, "done"]
    for pid in ahead.pids:
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)


@register("stuck", registry=registry)
class Stuck(Resource, kw_only=True, dict=True, forbid_unknown_fields=True):
    """Its check ahead waits for a writer on the FIFO `path` (never comes)."""

    eager = True
    path: str = ""

    def ahead_check(self, seen: dict[str, Any]) -> bool | None:
        with open(self.path, "rb"):
            return True

    async def check_apply(self, apply: bool) -> bool:
        return True


def stuck(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> GraphModel:
    """A graph of one resource whose check ahead never returns (a child `stop` kills
    after STOP_S, made short)."""
    monkeypatch.setattr(ahead_module, "STOP_S", 0.1)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    model = GraphModel(name="stuck")
    model.add(Stuck(name="s", path=str(fifo)))
    model.check()
    return model


def test_a_child_stuck_in_a_check_is_killed_by_stop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = stuck(tmp_path, monkeypatch)
    ahead = Ahead.start(model, at_least=1)
    assert ahead is not None
    assert ahead.stop() == []
    assert ahead.take(0) == OTHER
    with pytest.raises(ChildProcessError):
        os.waitpid(ahead.pids[0], os.WNOHANG)


def test_what_a_killed_run_made_is_logged_by_the_next_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The journal of a run killed before it logged what its children made: the
    next run logs each as applied (an effect: written through), then removes it."""
    told_to = tmp_path / "made-ahead"
    told_to.write_text("file[a]\nfile[b]\n")
    with caplog.at_level(logging.INFO, logger="evergraph.engine"):
        assert report_made(told_to) == 2
    lines = [r for r in caplog.records if "killed before it logged" in r.getMessage()]
    assert [r.getMessage().split(":")[0] for r in lines] == ["file[a]", "file[b]"]
    assert all(r.__dict__.get("effect") for r in lines)
    assert not told_to.exists()
    assert report_made(told_to) == 0  # (none: nothing to say)


def test_nothing_is_made_before_the_engine_runs_the_graph(tmp_path: Path) -> None:
    """The children check at once, but make nothing until the engine runs the graph
    (`go`): a run refused before that (bad input) leaves the machine as it was."""
    model = GraphModel(name="refused")
    root = tmp_path / "m"
    root.mkdir()
    for i in range(300):
        model.add(Mark(name=f"r{i}", path=str(root / f"m{i}"), journal=str(tmp_path / "j")))
    model.check()
    model.auto = automatic_edges(model)
    ahead = Ahead.start(model, at_least=1, journal=tmp_path / "made-ahead")
    assert ahead is not None
    assert ahead.stop() == []  # (no go: told all it found, made nothing)
    assert list(root.iterdir()) == []
    assert not (tmp_path / "made-ahead").exists()
    assert {ahead.take(i) for i in range(300)} == {OTHER}


def test_nothing_is_made_below_a_making_that_failed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """a (its making ahead fails) -> b (found in its state ahead) -> c (missing):
    c is not made ahead (all above it is not in its state), and b's verdict is
    dropped; the run makes a, then checks b and makes c, in order."""
    root = tmp_path / "m"
    root.mkdir()
    model = GraphModel(name="failed")
    j = str(root / "journal")
    model.add(Mark(name="a", path=str(root / "a"), journal=j, fails_ahead=True))
    model.add(Probe(name="b", ahead=True))
    model.add(Mark(name="c", path=str(root / "c"), journal=j))
    model.add(Mark(name="d", path=str(root / "d"), journal=j))  # (on its own: made ahead)
    model.connect(Edge("mark[a]", "probe[b]"))
    model.connect(Edge("probe[b]", "mark[c]"))
    model.check()
    ahead_of(model, journal=tmp_path / "made-ahead")
    out, engine = run(tmp_path / "e", model, caplog)
    assert out["status"] == 0
    assert journal(root) == [("d", "ahead"), ("a", "check"), ("c", "check")]
    assert engine.ahead_made == 1
    assert [n for n, w in out["log"] if w.startswith("check")] == ["a", "b", "c"]


@pytest.mark.parametrize("planted", ["fifo", "symlink"])
def test_a_journal_that_is_not_a_regular_file_is_not_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, planted: str
) -> None:
    """A FIFO, or a symlink to a file of idents, where the journal should be: one
    warning, no wait for a writer, nothing logged as applied, left as it is."""
    told_to = tmp_path / "made-ahead"
    if planted == "fifo":
        os.mkfifo(told_to)
    else:
        (tmp_path / "elsewhere").write_text("file[forged]\n")
        told_to.symlink_to(tmp_path / "elsewhere")
    with caplog.at_level(logging.INFO, logger="evergraph.engine"):
        assert report_made(told_to) == 0
    assert any("made-ahead" in r.getMessage() for r in caplog.records)  # (the warning)
    assert not any("forged" in r.getMessage() for r in caplog.records)
    assert told_to.is_symlink() or told_to.exists()
