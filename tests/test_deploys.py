"""Deploys (SPEC §4.4): `evergraph deploy` / `deploys` on a real sqlite World, real git
repositories in tmp_path, and the world.deploys library on the memory World."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import msgspec
import pytest

from evergraph.world import deploys as dp
from evergraph.world.kv import KV
from evergraph.world.memory import MemoryKV, MemoryStore
from evergraph.world.sqlite import SQLiteKV

from .conftest import EVERGRAPH, run_cli

T = TypeVar("T")
LINE = re.compile(
    r"^deploy (\d+) ([0-9a-f]{12}) \((\d+) files, (\d+) bytes(?:, git ([0-9a-f]{12}))?\)$"
)


# -- helpers ----------------------------------------------------------------------------


def git(repo: Path, *args: str) -> str:
    r = subprocess.run(
        [
            "git",
            "-c",
            "user.name=Test",
            "-c",
            "user.email=test@example.com",
            "-c",
            "init.defaultBranch=main",
            "-c",
            "commit.gpgsign=false",
            *args,
        ],
        cwd=repo,
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def commit_all(repo: Path, msg: str) -> str:
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", msg)
    return git(repo, "rev-parse", "HEAD")


def deploy(state: Path, file: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return run_cli("deploy", file, "--state-dir", state, *extra)


def parse(r: subprocess.CompletedProcess[str]) -> re.Match[str]:
    assert r.returncode == 0, r.stderr
    m = LINE.match(r.stdout.strip())
    assert m, r.stdout
    return m


def in_world(state: Path, body: Callable[[KV], Awaitable[T]]) -> T:
    """Run `body` on the sqlite World of `state` (the one the CLI used)."""

    async def main() -> T:
        kv = SQLiteKV(state / "world.sqlite")
        try:
            return await asyncio.wait_for(body(kv), 30)
        finally:
            await kv.close()

    return asyncio.run(main())


async def blob_count(kv: KV) -> int:
    items, _ = await kv.range(dp.FILES)
    return len(items)


def site(root: Path, files: dict[str, str | bytes]) -> Path:
    for rel, content in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            p.write_bytes(content)
        else:
            p.write_text(content)
    return root


GRAPH = "graph: g\nresources:\n  noop:\n  - name: n\n"


# -- CLI on the sqlite World -----------------------------------------------------------------


def test_deploys_chain_dedup_and_fetch(tmp_path: Path) -> None:
    state = tmp_path / "state"
    src = site(
        tmp_path / "site",
        {
            "main.yaml": GRAPH,
            "conf/a.txt": "same content\n",
            "conf/b.txt": "same content\n",
            "bin/blob": bytes(range(256)),
            ".secret": "not published\n",
            "__pycache__/x.pyc": "not published\n",
            "conf/.hidden/y": "not published\n",
        },
    )
    first = parse(deploy(state, src / "main.yaml", "--no-git"))
    assert first.group(1, 3, 4) == ("1", "4", str(len(GRAPH) + 26 + 256))
    assert first.group(5) is None
    (src / "main.yaml").write_text(GRAPH.replace("name: n", "name: m"))
    second = parse(deploy(state, src / "main.yaml", "--no-git"))
    assert second.group(1) == "2"

    async def read(kv: KV) -> tuple[list[dp.Deploy], dp.Deploy | None, int]:
        return await dp.history(kv), await dp.latest(kv), await blob_count(kv)

    hist, newest, blobs = in_world(state, read)
    d1, d2 = hist
    assert (d1.n, d1.parent, d2.n, d2.parent) == (1, "", 2, d1.hash)
    assert d1.hash.startswith(first.group(2))
    assert d2.hash.startswith(second.group(2))
    assert newest == d2
    assert sorted(d1.files) == ["bin/blob", "conf/a.txt", "conf/b.txt", "main.yaml"]
    assert d1.files["conf/a.txt"] == d1.files["conf/b.txt"]
    assert d1.files["bin/blob"] == d2.files["bin/blob"]
    # a.txt = b.txt, bin/blob shared by both deploys: main.yaml twice + 2 = 4 blobs
    assert blobs == 4
    # the head is the newest record, byte for byte, as `world get` shows
    head = run_cli("world", "get", "--state-dir", state, dp.HEAD)
    rec2 = run_cli("world", "get", "--state-dir", state, dp.record_key(2))
    assert head.returncode == 0
    assert head.stdout == rec2.stdout
    assert msgspec.json.decode(rec2.stdout)["parent"] == d1.hash

    # fetch materialises deploy 1 exactly (the old main.yaml), and nothing else
    out = tmp_path / "out" / "d1"
    entry = in_world(state, lambda kv: dp.fetch(kv, d1, out))
    assert entry == out / "main.yaml"
    assert entry.read_text() == GRAPH
    assert (out / "bin/blob").read_bytes() == bytes(range(256))
    got = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert got == sorted(d1.files)
    assert os.listdir(out.parent) == ["d1"]  # the temporary sibling was renamed

    listing = run_cli("deploys", "--state-dir", state)
    assert listing.returncode == 0, listing.stderr
    rows = [line.split("\t") for line in listing.stdout.splitlines()]
    assert [(r[0], r[1], r[2], r[5]) for r in rows] == [
        ("1", d1.hash[:12], "-", "main.yaml"),
        ("2", d2.hash[:12], "-", "main.yaml"),
    ]


def test_git_checks(tmp_path: Path) -> None:
    state = tmp_path / "state"
    repo = site(tmp_path / "repo", {"site/main.yaml": GRAPH, "README": "x\n"})
    entry = repo / "site" / "main.yaml"

    r = deploy(state, entry)
    assert r.returncode == 2, r.stderr
    assert "not in a git repository" in r.stderr
    assert "--no-git" in r.stderr
    assert in_world(state, dp.latest) is None  # nothing published

    git(repo, "init", "-q")
    a = commit_all(repo, "a")
    (repo / "site" / "main.yaml").write_text(GRAPH + "# edited\n")
    r = deploy(state, entry)
    assert r.returncode == 2
    assert "site/main.yaml has uncommitted changes" in r.stderr
    git(repo, "checkout", "-q", "--", ".")
    # a change outside the deployed directory does not count; an untracked file neither
    (repo / "README").write_text("changed\n")
    (repo / "site" / "new.txt").write_text("untracked\n")
    one = parse(deploy(state, entry))
    assert one.group(1) == "1"
    assert one.group(5) == a[:12]
    (repo / "README").write_text("x\n")

    (repo / "site" / "more.txt").write_text("b\n")
    b = commit_all(repo, "b")
    two = parse(deploy(state, entry))
    assert two.group(1) == "2"
    assert two.group(5) == b[:12]
    assert in_world(state, lambda kv: dp.get(kv, 2)).git == b

    # a branch off `a`: not a descendant of deploy 2's commit `b`
    git(repo, "switch", "-q", "-c", "side", a)
    (repo / "site" / "main.yaml").write_text(GRAPH + "# side\n")
    c = commit_all(repo, "c")
    r = deploy(state, entry)
    assert r.returncode == 2
    assert f"commit {c[:12]} is not a descendant of deploy 2's commit {b[:12]}" in r.stderr
    assert "--force" in r.stderr
    three = parse(deploy(state, entry, "--force"))
    assert three.group(1) == "3"
    assert three.group(5) == c[:12]
    # a --no-git deploy has no commit: the next git deploy has nothing to descend from
    assert parse(deploy(state, entry, "--no-git")).group(1, 5) == ("4", None)
    git(repo, "switch", "-q", "main")
    assert parse(deploy(state, entry)).group(1, 5) == ("5", b[:12])
    hist = in_world(state, dp.history)
    assert [d.git for d in hist] == [a, b, c, None, b]
    assert all(x.hash == y.parent for x, y in itertools.pairwise(hist))
    # another repository does not hold deploy 5's commit: refused unless --force
    other = site(tmp_path / "other", {"main.yaml": GRAPH})
    git(other, "init", "-q")
    commit_all(other, "o")
    r = deploy(state, other / "main.yaml")
    assert r.returncode == 2
    assert f"deploy 5's commit {b[:12]} is not in the repository" in r.stderr
    assert parse(deploy(state, other / "main.yaml", "--force")).group(1) == "6"


#: the real CLI, started once imported: it says "ready" and deploys when told to
STARTER = (
    "import sys\n"
    "from evergraph.cli.main import main\n"
    "print('ready', flush=True)\n"
    "sys.stdin.readline()\n"
    "main()\n"
)


def test_concurrent_deploys_get_consecutive_numbers(tmp_path: Path) -> None:
    state = tmp_path / "state"
    db = state / "world.sqlite"
    in_world(state, dp.latest)  # create the World file before the race
    procs: list[subprocess.Popen[str]] = []
    try:
        for i in range(4):
            # 2 MiB of blobs each: writing them keeps each deployer busy between
            # reading the newest deploy and claiming the next number
            src = site(
                tmp_path / f"site{i}",
                {
                    "main.yaml": GRAPH + f"# {i}\n",
                    "a.bin": os.urandom(1 << 20),
                    "b.bin": os.urandom(1 << 20),
                },
            )
            argv = ["deploy", str(src / "main.yaml"), "--no-git", "--world-db", str(db)]
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", STARTER, *argv],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        for p in procs:
            assert p.stdout is not None
            assert p.stdout.readline() == "ready\n"
        for p in procs:  # go, all at once
            assert p.stdin is not None
            p.stdin.write("\n")
            p.stdin.flush()
        outs = []
        for p in procs:
            out, err = p.communicate(timeout=60)
            assert p.returncode == 0, err
            outs.append(out.strip())
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    numbers = sorted(int(LINE.match(o).group(1)) for o in outs)  # type: ignore[union-attr]
    assert numbers == [1, 2, 3, 4]
    hist = in_world(state, dp.history)
    assert [d.n for d in hist] == [1, 2, 3, 4]
    assert [d.parent for d in hist] == ["", *(d.hash for d in hist[:3])]
    assert in_world(state, dp.latest) == hist[-1]
    # each deploy holds the content of exactly one of the four sites
    assert len({d.files["main.yaml"] for d in hist}) == 4


def test_follow_sees_a_deploy_from_another_process(tmp_path: Path) -> None:
    state = tmp_path / "state"
    src = site(tmp_path / "site", {"main.yaml": GRAPH})
    first = parse(deploy(state, src / "main.yaml", "--no-git"))

    async def body(kv: KV) -> None:
        it = dp.follow(kv).__aiter__()
        try:
            now = await asyncio.wait_for(it.__anext__(), 10)
            assert now.n == 1
            assert now.hash.startswith(first.group(2))
            (src / "main.yaml").write_text(GRAPH + "# 2\n")
            proc = await asyncio.create_subprocess_exec(
                *EVERGRAPH,
                "deploy",
                str(src / "main.yaml"),
                "--no-git",
                "--state-dir",
                str(state),
                stdout=asyncio.subprocess.PIPE,
            )
            out, _ = await proc.communicate()
            assert proc.returncode == 0
            new = await asyncio.wait_for(it.__anext__(), 10)
            assert new.n == 2
            assert new.parent == now.hash
            assert out.decode().startswith(f"deploy 2 {new.hash[:12]} ")
        finally:
            await it.aclose()  # type: ignore[attr-defined]

    in_world(state, body)


def test_bad_head_and_tampered_blob_are_rejected(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state = tmp_path / "state"
    src = site(tmp_path / "site", {"main.yaml": GRAPH, "data.txt": "data\n"})
    parse(deploy(state, src / "main.yaml", "--no-git"))
    r = run_cli("world", "put", "--state-dir", state, dp.HEAD, "garbage {")
    assert r.returncode == 0, r.stderr
    caplog.set_level(logging.WARNING, logger="evergraph.deploys")

    async def body(kv: KV) -> None:
        it = dp.follow(kv).__aiter__()
        try:
            # the garbage head is skipped with a warning; the newest record is found
            d1 = await asyncio.wait_for(it.__anext__(), 10)
            assert d1.n == 1
            assert "deploys/head: not a deploy record" in caplog.text
            # a record with a wrong hash (edited by hand), and one of the wrong schema
            forged = msgspec.json.encode(msgspec.structs.replace(d1, by="mallory@x"))
            await kv.put(dp.HEAD, forged)
            await kv.put(dp.HEAD, b'{"n": 9}')
            proc = await asyncio.create_subprocess_exec(
                *EVERGRAPH, "deploy", str(src / "main.yaml"), "--no-git", "--state-dir", str(state)
            )
            assert await proc.wait() == 0
            d2 = await asyncio.wait_for(it.__anext__(), 10)  # neither bad head was yielded
            assert d2.n == 2
            assert d2.parent == d1.hash
        finally:
            await it.aclose()  # type: ignore[attr-defined]
        assert "deploys/head: the record's hash does not match its content" in caplog.text
        assert "deploys/head: not a deploy record: Object missing required field" in caplog.text
        # the deployer replaced the bad head
        assert (await dp.latest(kv)) == d2
        head = await kv.get(dp.HEAD)
        assert head is not None
        assert dp.decode_record(head.value, "head") == d2

        # a tampered blob: fetch refuses, names the key, leaves nothing behind
        key = dp.blob_key(d2.files["data.txt"])
        await kv.put(key, b"evil\n")
        out = tmp_path / "out"
        with pytest.raises(dp.DeployError, match=f"{key}: its content does not match its hash"):
            await dp.fetch(kv, d2, out / "d2")
        assert not out.exists() or os.listdir(out) == []
        await kv.delete(key)
        with pytest.raises(dp.DeployError, match=f"{key}: missing"):
            await dp.fetch(kv, d2, out / "d2")

    in_world(state, body)


def test_bad_inputs_exit_2_and_publish_nothing(tmp_path: Path) -> None:
    state = tmp_path / "state"
    cases: list[tuple[Path, str]] = []
    cases.append((tmp_path / "none" / "missing.yaml", "No such file or directory"))
    txt = site(tmp_path / "txt", {"graph.txt": GRAPH})
    cases.append((txt / "graph.txt", "must be a .yaml, .yml or .py file"))
    many = site(tmp_path / "many", {"main.yaml": GRAPH})
    for i in range(dp.MAX_FILES):
        (many / f"f{i:04d}").write_text("x")
    cases.append((many / "main.yaml", "more than 1000 files"))
    big = site(tmp_path / "big", {"main.py": "def graph(g, world): pass\n"})
    for i in range(17):
        (big / f"part{i:02d}").write_bytes(os.urandom(1 << 20))
    cases.append((big / "main.py", f"more than {16 << 20} bytes"))
    huge = site(tmp_path / "huge", {"main.yml": GRAPH, "one": b"\0" * (dp.MAX_FILE_BYTES + 1)})
    cases.append((huge / "main.yml", "one file may hold at most"))
    link = site(tmp_path / "link", {"main.yaml": GRAPH})
    (link / "passwd").symlink_to("/etc/passwd")
    cases.append((link / "main.yaml", "passwd: a symlink leaving the deployed directory"))
    for file, msg in cases:
        r = deploy(state, file, "--no-git")
        assert r.returncode == 2, (file, r.stderr)
        assert msg in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert r.stdout == ""
    r = run_cli("deploy", "--state-dir", state)
    assert r.returncode == 2
    assert "Missing argument 'FILE'" in r.stderr
    assert not (state / "world.sqlite").exists()  # no deploy ever opened the World


def test_world_unreachable_exits_1(tmp_path: Path) -> None:
    src = site(tmp_path / "site", {"main.yaml": GRAPH})
    blocker = tmp_path / "file"
    blocker.write_text("")  # a file where the World's directory should be
    r = run_cli("deploy", src / "main.yaml", "--no-git", "--world-db", blocker / "w.sqlite")
    assert r.returncode == 1, r.stderr
    assert r.stderr.startswith("evergraph: world:")


# -- the library on the memory World -------------------------------------------------------


def run_mem(body: Callable[[KV], Awaitable[None]]) -> None:
    async def main() -> None:
        kv = MemoryKV(MemoryStore())
        try:
            await asyncio.wait_for(body(kv), 10)
        finally:
            await kv.close()

    asyncio.run(main())


FILES = {"main.yaml": GRAPH.encode(), "lib/x.txt": b"x\n"}


async def pub(kv: KV, files: dict[str, bytes] = FILES) -> dp.Deploy:
    return await dp.publish(kv, "main.yaml", files, git=None, force=False, by="t@h", repo=None)


def test_verify_rejects_bad_records() -> None:
    good = dp.Deploy(
        n=1,
        parent="",
        hash=dp.record_hash(
            n=1, parent="", entry="a.yaml", files={"a.yaml": "0" * 64}, git=None, by="u", time=1.0
        ),
        entry="a.yaml",
        files={"a.yaml": "0" * 64},
        git=None,
        by="u",
        time=1.0,
    )
    dp.verify(good, "k")
    assert dp.decode_record(msgspec.json.encode(good), "k") == good

    def rehashed(**kw: object) -> dp.Deploy:
        d = msgspec.structs.replace(good, **kw)
        return msgspec.structs.replace(d, hash=dp._hash_of(d))

    bad = {
        "is absolute": rehashed(files={"a.yaml": "0" * 64, "/etc/x": "0" * 64}),
        "'..' component": rehashed(files={"a.yaml": "0" * 64, "a/../../x": "0" * 64}),
        "not one of the files": rehashed(entry="b.yaml"),
        "not a .yaml, .yml or .py": rehashed(entry="x.sh", files={"x.sh": "0" * 64}),
        "not positive": rehashed(n=0),
        "deploy 1 names a parent": rehashed(parent="1" * 64),
        "not a sha256": rehashed(files={"a.yaml": "xyz"}),
        "both a file and a directory": rehashed(files={"a.yaml": "0" * 64, "a.yaml/b": "0" * 64}),
        "hash does not match": msgspec.structs.replace(good, by="other"),
    }
    for why, d in bad.items():
        with pytest.raises(dp.DeployError, match=why):
            dp.verify(d, "k")
    extra = msgspec.json.encode(good)[:-1] + b',"more":1}'
    with pytest.raises(dp.DeployError, match="not a deploy record"):
        dp.decode_record(extra, "k")
    with pytest.raises(dp.DeployError, match="not a deploy record"):
        dp.decode_record(msgspec.json.encode(good).replace(b'"n":1', b'"n":"1"'), "k")


def test_lagging_head_and_bad_head_records() -> None:
    async def body(kv: KV) -> None:
        d1 = await pub(kv)
        # a deployer that died after writing record 2 but before moving the head
        f2 = {"main.yaml": "a" * 64}
        h2 = dp.record_hash(
            n=2, parent=d1.hash, entry="main.yaml", files=f2, git=None, by="x", time=2.0
        )
        d2 = dp.Deploy(
            n=2, parent=d1.hash, hash=h2, entry="main.yaml", files=f2, git=None, by="x", time=2.0
        )
        await kv.put(dp.record_key(2), msgspec.json.encode(d2))
        assert await dp.latest(kv) == d2
        it = dp.follow(kv).__aiter__()
        try:  # follow starts from the newest record, not the lagging head
            assert await asyncio.wait_for(it.__anext__(), 5) == d2
        finally:
            await it.aclose()  # type: ignore[attr-defined]
        d3 = await pub(kv)
        assert (d3.n, d3.parent) == (3, d2.hash)
        # a head forged with a valid-looking record that is not deploys/<n>: ignored
        fake = msgspec.structs.replace(d3, n=99, parent="b" * 64)
        fake = msgspec.structs.replace(fake, hash=dp._hash_of(fake))
        await kv.put(dp.HEAD, msgspec.json.encode(fake))
        d4 = await pub(kv)
        assert d4.n == 4
        head = await kv.get(dp.HEAD)
        assert head is not None
        assert head.value == msgspec.json.encode(d4)
        assert [d.n for d in await dp.history(kv)] == [1, 2, 3, 4]
        assert await dp.get(kv, 2) == d2
        with pytest.raises(dp.DeployError, match="deploys/0000000005: no such deploy"):
            await dp.get(kv, 5)
        # a damaged newest record stops the chain with a clear message
        await kv.put(dp.record_key(4), b"{}")
        with pytest.raises(
            dp.DeployError, match=r"deploys/0000000004: not a deploy record.*delete"
        ):
            await pub(kv)

    run_mem(body)


def test_fetch_refuses_existing_dest_and_follow_skips_older(tmp_path: Path) -> None:
    async def body(kv: KV) -> None:
        d1 = await pub(kv)
        dest = tmp_path / "d"
        dest.mkdir()
        with pytest.raises(dp.DeployError, match="already exists"):
            await dp.fetch(kv, d1, dest)
        entry = await dp.fetch(kv, d1, tmp_path / "new" / "d1")
        assert entry.read_bytes() == FILES["main.yaml"]
        assert (entry.parent / "lib/x.txt").read_bytes() == b"x\n"

        seen: list[int] = []
        got_two = asyncio.Event()

        async def consume(it: AsyncIterator[dp.Deploy]) -> None:
            async for d in it:
                seen.append(d.n)
                if d.n >= 2:
                    got_two.set()

        task = asyncio.create_task(consume(dp.follow(kv)))
        try:
            await asyncio.wait_for(_until(lambda: seen == [1]), 5)
            d2 = await pub(kv, {**FILES, "main.yaml": b"graph: two\n"})
            await asyncio.wait_for(got_two.wait(), 5)
            # the head moved back to deploy 1 by hand: no rollback is yielded
            await kv.put(dp.HEAD, msgspec.json.encode(d1))
            await pub(kv, {**FILES, "main.yaml": b"graph: three\n"})
            await asyncio.wait_for(_until(lambda: seen[-1] == 3), 5)
            assert seen == [1, 2, 3]
            assert d2.n == 2
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    run_mem(body)


async def _until(pred: Callable[[], bool]) -> None:
    while not pred():
        await asyncio.sleep(0.001)


def test_collect(tmp_path: Path) -> None:
    src = site(tmp_path / "s", {"main.py": "x = 1\n", "pkg/mod.py": "y = 2\n", ".env": "z\n"})
    (src / "pkg" / "alias.py").symlink_to("mod.py")  # inside the tree: published as a file
    (src / "pkg" / "loop").symlink_to("..")
    with pytest.raises(dp.DeployError, match="symlink loop"):
        dp.collect(src / "main.py")
    (src / "pkg" / "loop").unlink()
    entry, files = dp.collect(src / "main.py")
    assert entry == "main.py"
    assert files == {"main.py": b"x = 1\n", "pkg/mod.py": b"y = 2\n", "pkg/alias.py": b"y = 2\n"}
    # a dot-named entry is still published
    (src / ".hidden.yaml").write_text(GRAPH)
    entry, files = dp.collect(src / ".hidden.yaml")
    assert entry == ".hidden.yaml"
    assert ".env" not in files
    assert entry in files
    (tmp_path / "dir.yaml").mkdir()
    with pytest.raises(dp.DeployError, match="not a regular file"):
        dp.collect(tmp_path / "dir.yaml")
