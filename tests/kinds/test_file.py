"""file: source, fragments, owner/group, recurse, force, purge; their watches and bad inputs."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

import evergraph.resources  # noqa: F401  (declares the built-in kinds)
from evergraph.engine.build import build
from evergraph.engine.contract import default_registry
from evergraph.testing.kinds import (
    Apply,
    Call,
    ExpectClean,
    FakeHandle,
    Start,
    Step,
    graph_error,
    run_steps,
)
from tests.conftest import Agent, run_cli, wait_for

NOBODY, NOGROUP = 65534, 65534


def graph(tmp_path: Path, body: str, edges: str = "") -> Path:
    g = tmp_path / "g.yaml"
    g.write_text("graph: f\nresources:\n  file:\n" + body + edges)
    return g


def steps(tmp_path: Path, params: dict[str, object], *then: Step) -> FakeHandle:
    """One file resource, started and taken through `then`, in process."""
    res = build(default_registry, "file", params)
    return run_steps(res, [Start(), *then], state_dir=tmp_path / "s")


def converge(tmp_path: Path, g: Path) -> str:
    r = run_cli("run", g, "--state-dir", tmp_path / "s", "--converged-exit")
    assert r.returncode == 0, r.stderr
    return r.stderr


def test_source_file_fragments_and_owner(tmp_path: Path) -> None:
    src = tmp_path / "src.conf"
    src.write_text("from source\n")
    frags = tmp_path / "conf.d"
    frags.mkdir()
    (frags / "20-b").write_text("b\n")
    (frags / "10-a").write_text("a\n")
    head = tmp_path / "head"
    head.write_text("head\n")
    copy, joined = tmp_path / "out" / "copy", tmp_path / "out" / "joined"
    copied = {"name": str(copy), "source": str(src), "owner": "nobody"}
    copied.update(group=str(NOGROUP), mode="0640")
    fragments = {"name": str(joined), "fragments": [str(head), str(frags)]}

    def chown() -> None:
        os.chown(copy, 0, 0)

    def owned() -> None:
        assert copy.stat().st_uid == NOBODY

    def looks() -> None:
        assert copy.read_text() == "from source\n"
        st = copy.stat()
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (NOBODY, NOGROUP, 0o640)

    # applied, then clean; after a chown only the owner is repaired
    steps(tmp_path, copied, Apply(), Call(looks), ExpectClean(), Call(chown))
    steps(tmp_path, copied, Apply(changes=["owner", "group"]), Call(owned), ExpectClean())
    steps(tmp_path, fragments, Apply(), ExpectClean())
    assert joined.read_text() == "head\na\nb\n"  # a directory gives its files in name order


def test_watch_follows_source_and_fragments(tmp_path: Path, agents) -> None:  # type: ignore[no-untyped-def]
    src = tmp_path / "src"
    src.write_text("v1\n")
    frags = tmp_path / "frags"
    frags.mkdir()
    (frags / "a").write_text("a\n")
    copy, joined = tmp_path / "copy", tmp_path / "joined"
    g = graph(
        tmp_path,
        f"  - {{name: {copy}, source: {src}}}\n  - {{name: {joined}, fragments: [{frags}]}}\n",
    )
    agent: Agent = agents(g, tmp_path / "s")
    agent.wait_converged()
    src.write_text("v2\n")
    wait_for(lambda: copy.read_text() == "v2\n", what="copy follows its source")
    (frags / "b").write_text("b\n")  # a new fragment in the directory
    wait_for(lambda: joined.read_text() == "a\nb\n", what="new fragment joined")
    (frags / "a").unlink()
    wait_for(lambda: joined.read_text() == "b\n", what="removed fragment dropped")
    copy.write_text("drift\n")
    wait_for(lambda: copy.read_text() == "v2\n", what="copy repaired")
    assert agent.stop() == 0


def test_missing_source_is_a_runtime_failure_naming_it(tmp_path: Path) -> None:
    out = tmp_path / "out"
    why = f"source {tmp_path}/nope: no such file"
    steps(tmp_path, {"name": str(out), "source": f"{tmp_path}/nope"}, Apply(raises=why))
    assert not out.exists()


def make_tree(root: Path) -> None:
    (root / "sub" / "deep").mkdir(parents=True)
    (root / "top.txt").write_text("top\n")
    (root / "sub" / "mid.txt").write_text("mid\n")
    (root / "sub" / "deep" / "low.txt").write_text("low\n")
    (root / "link").symlink_to("top.txt")


def listing(root: Path) -> dict[str, str]:
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        try:
            if p.is_symlink():
                out[rel] = "->" + os.readlink(p)
            elif p.is_dir():
                out[rel] = "dir"
            else:
                out[rel] = p.read_text()
        except FileNotFoundError:
            out[rel] = "(vanished while listing)"  # the agent is purging it right now
    return out


def test_recursive_copy_purge_keeps_other_resources_files(tmp_path: Path, agents) -> None:  # type: ignore[no-untyped-def]
    src, dst = tmp_path / "src", tmp_path / "dst"
    make_tree(src)
    dst.mkdir()
    (dst / "stale.txt").write_text("old\n")
    (dst / "olddir").mkdir()
    (dst / "olddir" / "x").write_text("x\n")
    g = graph(
        tmp_path,
        f"  - {{name: tree, path: {dst}/, source: {src}/, recurse: true, purge: true}}\n"
        f'  - {{name: extra, path: {dst}/keep/me.conf, content: "mine\\n"}}\n',
    )
    converge(tmp_path, g)
    want = listing(src) | {"keep": "dir", "keep/me.conf": "mine\n"}
    assert listing(dst) == want  # stale entries purged, the other resource's file kept
    assert ": applied" not in converge(tmp_path, g)

    agent: Agent = agents(g, tmp_path / "s")
    agent.wait_converged()
    (dst / "sub" / "deep" / "low.txt").write_text("drift\n")  # deep drift: seen with recurse
    (dst / "intruder").write_text("x\n")  # an unmanaged entry: purged
    wait_for(lambda: listing(dst) == want, what="tree repaired and purged")
    (src / "sub" / "new.txt").write_text("new\n")  # the source tree grows
    want["sub/new.txt"] = "new\n"
    wait_for(lambda: listing(dst) == want, what="new source file copied")
    assert agent.stop() == 0


def test_recurse_applies_owner_and_mode_to_the_tree(tmp_path: Path) -> None:
    d = tmp_path / "d"
    make_tree(d)
    tree = {"name": f"{d}/", "recurse": True, "owner": "nobody", "mode": "0640"}
    steps(tmp_path, tree, Apply(), ExpectClean())
    for p in [d / "top.txt", d / "sub", d / "sub" / "deep" / "low.txt"]:
        st = p.lstat()
        want = 0o750 if p.is_dir() else 0o640  # directories get x where r is given
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (NOBODY, want), p


def test_force_replaces_what_is_in_the_way(tmp_path: Path) -> None:
    f, d = tmp_path / "was-a-dir", tmp_path / "was-a-file"
    (f / "inner").mkdir(parents=True)
    d.write_text("x")
    a_file = {"name": str(f), "content": "now a file\n"}
    a_dir = {"name": f"{d}/"}
    steps(tmp_path, a_file, Apply(raises=rf"{f} exists and is a directory \(force: true replaces"))
    steps(tmp_path, a_dir, Apply(raises=rf"{d} exists and is not a directory \(force: true"))
    assert (f / "inner").is_dir()
    assert d.is_file()
    steps(tmp_path, {**a_file, "force": True}, Apply(), ExpectClean())
    steps(tmp_path, {**a_dir, "force": True}, Apply(), ExpectClean())
    assert f.read_text() == "now a file\n"
    assert d.is_dir()


def test_reverse_restores_owner(tmp_path: Path) -> None:
    f = tmp_path / "owned"
    f.write_text("x\n")
    g = graph(tmp_path, f"  - {{name: {f}, owner: nobody, meta: {{reverse: true}}}}\n")
    converge(tmp_path, g)
    assert f.stat().st_uid == NOBODY
    g.write_text("graph: f\nresources: {}\n")
    converge(tmp_path, g)
    assert f.stat().st_uid == 0
    assert f.read_text() == "x\n"


BAD_PARAMS = [
    ("content: a, source: /etc/hostname", "source", "cannot be combined with content"),
    ("source: relative/x", "source", "is not an absolute path"),
    ("fragments: [/a, b]", "fragments", "'b' is not an absolute path"),
    ("purge: true", "purge", "only a directory"),
    ("recurse: true", "recurse", "only a directory"),
    ("owner: ''", "owner", "is not a name or a numeric id"),
    ("group: 'a:b'", "group", "is not a name or a numeric id"),
    ("owner: 5.5", "owner", "quote it"),  # (an integer is its source text, as in mgmt)
    ("state: absent, source: /etc/hostname", "state", "absent cannot be combined"),
]


@pytest.mark.parametrize(("params", "field", "why"), BAD_PARAMS)
def test_bad_params_are_rejected_at_load(tmp_path: Path, params: str, field: str, why: str) -> None:
    out = tmp_path / "out"
    g = graph(tmp_path, f"  - {{name: {out}, {params}}}\n")
    err = graph_error(g)  # as `evergraph check` loads it, in process
    assert f"file[{out}].{field}" in err
    assert why in err
    if (params, field, why) != BAD_PARAMS[0]:
        return  # one of them end to end: exit 2, nothing written
    r = run_cli("run", g, "--state-dir", tmp_path / "s", "--converged-exit")
    assert r.returncode == 2, r.stderr
    assert f"file[{out}].{field}" in r.stderr
    assert why in r.stderr
    assert "Traceback" not in r.stderr
    assert not out.exists()


def test_directory_source_needs_recurse(tmp_path: Path) -> None:
    err = graph_error(graph(tmp_path, f"  - {{name: {tmp_path}/d/, source: /etc/}}\n"))
    assert f"file[{tmp_path}/d/].source: copying a directory needs recurse: true" in err


def test_leftovers_of_killed_writes_are_swept_at_each_start_in_one_process(
    tmp_path: Path,
) -> None:
    # many files of one directory share its listing within a start; a second run in
    # the same process (another event loop) lists it again and finds new leftovers
    import evergraph

    d = tmp_path / "d"
    d.mkdir()
    names = [f"f{i}" for i in range(30)] + ["L" * 210]  # a long name: its temp name is cut
    g = graph(tmp_path, "".join(f"  - {{name: {d / n}, content: x}}\n" for n in names))
    common = {"state_dir": tmp_path / "s", "converged_exit": True, "world": "memory"}
    common["handle_signals"] = False

    def leave() -> list[Path]:
        left = [d / f".{n[:200]}.0123456789ab.tmp" for n in names]
        left.append(d / f".{names[3]}.evergraph-4242")  # an earlier version's name
        for p in left:
            p.write_text("half")
        return left

    for _ in range(2):
        left = leave()
        (d / ".unmanaged.0123456789ab.tmp").write_text("not ours to sweep")
        assert evergraph.run(g, **common) == 0  # type: ignore[arg-type]
        assert [p.name for p in left if p.exists()] == []
        assert (d / ".unmanaged.0123456789ab.tmp").exists()
        assert all((d / n).read_text() == "x" for n in names)


def test_a_vertex_started_again_in_one_run_does_not_list_its_directory_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Leftovers come from a kill, so a run sweeps each path once: a changed resource
    (a collector's changed export, next to 10k others) does not re-list the directory."""
    import asyncio
    import contextlib
    from collections.abc import Callable

    import evergraph.resources._leftovers as leftovers
    import evergraph.resources.file  # noqa: F401  (registers the file kind)
    from evergraph.engine.build import build
    from evergraph.engine.contract import default_registry
    from evergraph.engine.engine import Engine
    from evergraph.engine.model import GraphModel
    from evergraph.engine.settings import Settings
    from evergraph.watch import InotifyHub

    d = tmp_path / "d"
    d.mkdir()
    listed: list[str] = []
    real = leftovers.sweep_leftovers_of

    def spy(path: str, listed_now: object = None) -> list[str]:
        listed.append(path)
        return real(path, listed_now)  # type: ignore[arg-type]

    monkeypatch.setattr(leftovers, "sweep_leftovers_of", spy)

    def model(content: str) -> GraphModel:
        m = GraphModel(name="g")
        for name in ("a", "b"):
            m.add(build(default_registry, "file", {"name": f"{d}/{name}", "content": content}))
        m.check()
        return m

    async def main(plant: bool) -> None:
        s = Settings(state_dir=tmp_path / "s", hostname="t", converged_timeout=None)
        async with InotifyHub() as hub:
            pump = asyncio.create_task(hub.run())
            eng = Engine(s, watcher=hub)
            task = asyncio.create_task(eng.run(model("1\n")))
            await wait_for(lambda: all(read(d / n) == "1\n" for n in "ab"))
            if plant:
                (d / ".a.0123456789ab.tmp").write_text("planted after the start")
            await eng.swap(model("2\n"))  # both vertices replaced
            await wait_for(lambda: all(read(d / n) == "2\n" for n in "ab"))
            eng.request_stop()
            await asyncio.wait_for(task, 10)
            pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pump

    def read(p: Path) -> str | None:
        try:
            return p.read_text()
        except FileNotFoundError:
            return None

    async def wait_for(cond: Callable[[], bool]) -> None:
        async with asyncio.timeout(20):
            while not cond():
                await asyncio.sleep(0.01)  # (the engine writes in this loop: polled)

    asyncio.run(main(plant=True))
    assert sorted(listed) == [f"{d}/a", f"{d}/b"]  # once each, at the first start
    assert (d / ".a.0123456789ab.tmp").exists()  # not ours to find within the run
    listed.clear()
    asyncio.run(main(plant=False))  # a new run sweeps again
    assert sorted(listed) == [f"{d}/a", f"{d}/b"]
    assert not (d / ".a.0123456789ab.tmp").exists()


def test_files_told_of_no_managed_paths_share_one_empty_set(tmp_path: Path) -> None:
    """Memory: a started file told of no managed paths holds the one shared empty
    set (a `frozenset()` of its own is 216 bytes: 2 MB for 10k files); a purge
    told of some holds those."""
    made = []
    for name in ("a", "b"):
        res = build(default_registry, "file", {"name": name, "path": f"{tmp_path}/{name}"})
        run_steps(res, [Start()], state_dir=tmp_path / "s")
        made.append(res)
    a, b = made
    assert a._others == frozenset()  # type: ignore[attr-defined]
    assert a._others is b._others  # type: ignore[attr-defined]
    told = build(default_registry, "file", {"name": "p", "path": f"{tmp_path}/p/", "purge": True})
    told.know_managed(frozenset({f"{tmp_path}/p/x"}))  # type: ignore[attr-defined]
    run_steps(told, [Start()], state_dir=tmp_path / "s")
    assert told._others == {f"{tmp_path}/p/x"}  # type: ignore[attr-defined]
