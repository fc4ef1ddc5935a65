"""Deploys (SPEC §4.4): `evergraph deploy` / `deploys` on a real sqlite World, real git
repositories in tmp_path, the bundle rules (frontends/bundle.py) on real directories,
and the cluster.deploys library (records, signatures, trust) on the memory World."""

from __future__ import annotations

import asyncio
import base64
import itertools
import logging
import os
import re
import socket
import stat
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import msgspec
import nacl.signing
import pytest

from evergraph.cluster import deploys as dp
from evergraph.cluster.hostkeys import HostKeys, fingerprint
from evergraph.cluster.pins import Pins
from evergraph.frontends import bundle as bd
from evergraph.world.kv import KV
from evergraph.world.memory import MemoryKV, MemoryStore
from evergraph.world.sqlite import SQLiteKV
from tests.conftest import EVERGRAPH, run_cli
from tests.kit.git import git

T = TypeVar("T")
LINE = re.compile(
    r"^deploy (\d+) ([0-9a-f]{12}) \((\d+) files, (\d+) bytes(?:, git ([0-9a-f]{12}))?"
    r"(?:, (\d+) left out)?\); signed by (\S+) \((SHA256:[A-Za-z0-9+/]+)\)$"
)


# -- helpers ----------------------------------------------------------------------------


def commit_all(repo: Path, msg: str) -> str:
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", msg)
    return git(repo, "rev-parse", "HEAD")


def deploy(state: Path, file: Path, *extra: str | Path) -> subprocess.CompletedProcess[str]:
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


async def blobs(kv: KV) -> list[bytes]:
    items, _ = await kv.range(dp.FILES)
    return [i.value for i in items]


def site(root: Path, files: dict[str, str | bytes]) -> Path:
    for rel, content in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            p.write_bytes(content)
        else:
            p.write_text(content)
    return root


def new_key(path: Path) -> str:
    """Write a fresh signing key file (the format of STATE/keys/sign.key); its verify key."""
    key = nacl.signing.SigningKey.generate()
    path.write_bytes(base64.b64encode(bytes(key)) + b"\n")
    return dp.verify_key_of(key)


def state_signer(state: Path) -> str:
    return HostKeys(state).verify


GRAPH = "graph: g\nresources:\n  noop:\n  - name: n\n"


# -- CLI on the sqlite World -----------------------------------------------------------------


def test_deploys_chain_dedup_signature_and_fetch(tmp_path: Path) -> None:
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
    assert first.group(6) == "3"  # .secret, __pycache__/, conf/.hidden/
    # signed by the state dir's key, printed with its fingerprint
    signer = state_signer(state)
    assert first.group(7, 8) == (signer, fingerprint(signer))
    (src / "main.yaml").write_text(GRAPH.replace("name: n", "name: m"))
    second = parse(deploy(state, src / "main.yaml", "--no-git"))
    assert second.group(1) == "2"

    async def read(kv: KV) -> tuple[list[dp.Deploy], dp.Deploy | None, int]:
        return await dp.history(kv), await dp.latest(kv), len(await blobs(kv))

    hist, newest, nblobs = in_world(state, read)
    d1, d2 = hist
    assert (d1.n, d1.parent, d2.n, d2.parent) == (1, "", 2, d1.hash)
    assert d1.hash.startswith(first.group(2))
    assert d2.hash.startswith(second.group(2))
    assert newest == d2
    assert (d1.signer, d2.signer) == (signer, signer)
    assert HostKeys.check_signature(
        signer, b"evergraph-deploy/2 signature\n" + d1.hash.encode(), base64.b64decode(d1.signature)
    )
    assert sorted(d1.files) == ["bin/blob", "conf/a.txt", "conf/b.txt", "main.yaml"]
    assert d1.files["conf/a.txt"] == d1.files["conf/b.txt"]
    assert d1.files["bin/blob"] == d2.files["bin/blob"]
    assert {f.mode for f in d1.files.values()} == {0o644}
    # a.txt = b.txt, bin/blob shared by both deploys: main.yaml twice + 2 = 4 blobs
    assert nblobs == 4
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
    assert [(r[0], r[1], r[2], r[5], r[6]) for r in rows] == [
        ("1", d1.hash[:12], "-", "main.yaml", fingerprint(signer)),
        ("2", d2.hash[:12], "-", "main.yaml", fingerprint(signer)),
    ]


def test_key_flag_signs_and_a_bad_key_file_exits_2(tmp_path: Path) -> None:
    state = tmp_path / "state"
    src = site(tmp_path / "site", {"main.yaml": GRAPH})
    mine = new_key(tmp_path / "deployer.key")
    m = parse(deploy(state, src / "main.yaml", "--no-git", "--key", tmp_path / "deployer.key"))
    assert m.group(7, 8) == (mine, fingerprint(mine))
    assert in_world(state, dp.latest).signer == mine  # type: ignore[union-attr]

    bad = {
        "missing.key": None,
        "text.key": b"this is not a key\n",
        "short.key": base64.b64encode(b"\1" * 31) + b"\n",
        "long.key": base64.b64encode(b"\1" * 64) + b"\n",
    }
    for name, content in bad.items():
        if content is not None:
            (tmp_path / name).write_bytes(content)
        r = deploy(state, src / "main.yaml", "--no-git", "--key", tmp_path / name)
        assert r.returncode == 2, (name, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert r.stderr.startswith(f"evergraph: deploy: --key: {tmp_path / name}: "), r.stderr
        assert r.stdout == ""
    assert [d.n for d in in_world(state, dp.history)] == [1]  # nothing more published


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
    # a change outside the deployed directory does not count; an untracked file neither,
    # and an untracked file is not sent
    (repo / "README").write_text("changed\n")
    (repo / "site" / "new.txt").write_text("untracked\n")
    one = parse(deploy(state, entry))
    assert one.group(1, 3) == ("1", "1")
    assert one.group(5) == a[:12]
    assert list(in_world(state, dp.latest).files) == ["main.yaml"]  # type: ignore[union-attr]
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
    # an untracked entry cannot be deployed from git
    (other / "new.yaml").write_text(GRAPH)
    r = deploy(state, other / "new.yaml", "--force")
    assert r.returncode == 2
    assert "not tracked at HEAD" in r.stderr


def test_git_bundle_is_the_tracked_files_at_head(tmp_path: Path) -> None:
    state = tmp_path / "deployer"
    repo = site(
        tmp_path / "repo",
        {
            "site/main.yaml": GRAPH,
            "site/bin/run.sh": "#!/bin/sh\necho hi\n",
            "site/notes.tmp": "tracked, but ignored\n",
            "site/.evergraphignore": "*.tmp\n",
            "site/.gitignore": "state/\n",
            "site/keys/tracked.key": "a key someone committed\n",
            "site/conf/app.conf": "x = 1\n",
        },
    )
    (repo / "site" / "bin" / "run.sh").chmod(0o755)
    (repo / "site" / "link.conf").symlink_to("conf/app.conf")
    (repo / "site" / "env.conf").symlink_to(".env")  # a link to a left-out file
    (repo / "site" / ".env").write_text("SECRET=1\n")
    git(repo, "init", "-q")
    head = commit_all(repo, "a")
    # untracked: a state dir next to the graph (an agent's keys and World)
    HostKeys(repo / "site" / "state")
    (repo / "site" / "untracked.txt").write_text("not sent\n")
    # not in the work tree: git says unchanged, so the HEAD version is what is sent
    git(repo, "update-index", "--assume-unchanged", "site/conf/app.conf")
    (repo / "site" / "conf" / "app.conf").write_text("x = 2 (work tree only)\n")

    b = bd.collect(repo / "site" / "main.yaml")
    assert b.git == head
    assert {p: (c.mode, c.data) for p, c in b.files.items()} == {
        "main.yaml": (0o644, GRAPH.encode()),
        "bin/run.sh": (0o755, b"#!/bin/sh\necho hi\n"),
        "conf/app.conf": (0o644, b"x = 1\n"),
        "link.conf": (0o644, b"x = 1\n"),
    }
    assert {lo.path: lo.notable for lo in b.left_out} == {
        ".env": False,
        ".evergraphignore": False,
        ".gitignore": False,
        "env.conf": True,
        "keys/": True,
        "notes.tmp": False,
    }
    assert any("ignored by .evergraphignore:1 (*.tmp)" in lo.why for lo in b.left_out)

    r = deploy(state, repo / "site" / "main.yaml", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert "send\t0755\t18\tbin/run.sh" in r.stdout.splitlines()
    assert "leave out\tkeys/\ta keys/ directory" in r.stdout
    m = parse(deploy(state, repo / "site" / "main.yaml"))
    assert m.group(3, 5, 6) == ("4", head[:12], "6")
    assert "left out keys/: a keys/ directory" in deploy(state, repo / "site" / "main.yaml").stderr

    d = in_world(state, dp.latest)
    assert d is not None
    out = in_world(state, lambda kv: dp.fetch(kv, d, tmp_path / "out"))
    assert stat.S_IMODE((out.parent / "bin" / "run.sh").stat().st_mode) == 0o755
    assert stat.S_IMODE((out.parent / "main.yaml").stat().st_mode) == 0o644
    run = subprocess.run([out.parent / "bin" / "run.sh"], capture_output=True, text=True)
    assert run.stdout == "hi\n"  # the script kept its exec bit


def test_no_git_bundle_leaves_out_state_keys_and_specials(tmp_path: Path) -> None:
    src = site(
        tmp_path / "site",
        {
            "main.py": "def graph(g, world): pass\n",
            "lib/mod.py": "y = 2\n",
            "lib/keys/id_ed25519": "private\n",
            "other/pins.json": "{}\n",
            "other/x.txt": "in a dir that looks like a state dir\n",
            "agent2/vertices/v": "vertex state\n",
            "big.bin": b"\0" * 2000,
            "run.sh": "#!/bin/sh\n",
        },
    )
    (src / "run.sh").chmod(0o750)
    keys = HostKeys(src / "state")  # an agent's state dir inside the graph's directory
    (src / "lib" / "alias.py").symlink_to("mod.py")  # inside the tree: sent as a file
    (src / "stolen.key").symlink_to("state/keys/sign.key")
    (src / ".env").write_text("SECRET=1\n")
    (src / "env").symlink_to(".env")
    os.mkfifo(src / "fifo")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(src / "sock"))
    try:
        b = bd.collect(src / "main.py", use_git=False, max_file_size=1000)
    finally:
        sock.close()
    assert b.git is None
    assert {p: c.mode for p, c in b.files.items()} == {
        "main.py": 0o644,
        "lib/mod.py": 0o644,
        "lib/alias.py": 0o644,
        "run.sh": 0o755,
    }
    why = {lo.path: lo.why for lo in b.left_out}
    assert why == {
        "agent2/": why["agent2/"],
        ".env": "a dot entry",
        "big.bin": "2000 bytes, over the 1000-byte limit (--max-file-size)",
        "env": "a symlink to .env, which is left out: a dot entry",
        "fifo": "a FIFO",
        "lib/keys/": "a keys/ directory (private keys are never deployed)",
        "other/": why["other/"],
        "sock": "a socket",
        "state/": why["state/"],
        "stolen.key": why["stolen.key"],
    }
    assert why["state/"].startswith("an evergraph state dir")
    assert why["other/"].startswith("an evergraph state dir")
    assert why["agent2/"].startswith("an evergraph state dir")
    assert why["stolen.key"].startswith("a symlink into an evergraph state dir")
    assert all(lo.notable for lo in b.left_out if lo.path != ".env")
    secret = (src / "state" / "keys" / "sign.key").read_bytes()
    assert keys.verify
    assert all(secret not in c.data for c in b.files.values())

    # symlinks: a loop and a way out are errors, not silent cuts
    (src / "lib" / "loop").symlink_to("..")
    with pytest.raises(dp.DeployError, match="symlink loop"):
        bd.collect(src / "main.py", use_git=False)
    (src / "lib" / "loop").unlink()
    (src / "passwd").symlink_to("/etc/passwd")
    with pytest.raises(dp.DeployError, match="passwd: a symlink leaving the deployed directory"):
        bd.collect(src / "main.py", use_git=False)
    # a dot-named entry is still sent; a directory as entry is not a file
    hidden = site(tmp_path / "h", {".hidden.yaml": GRAPH, ".env": "z\n"})
    b = bd.collect(hidden / ".hidden.yaml", use_git=False)
    assert list(b.files) == [".hidden.yaml"]
    (tmp_path / "dir.yaml").mkdir()
    with pytest.raises(dp.DeployError, match="not a regular file"):
        bd.collect(tmp_path / "dir.yaml", use_git=False)
    # the graph's own directory being a state dir: refused outright
    HostKeys(tmp_path / "h")
    with pytest.raises(dp.DeployError, match="is an evergraph state dir"):
        bd.collect(hidden / ".hidden.yaml", use_git=False)


def test_ignore_patterns() -> None:
    ig = bd.Ignore()
    ig.add(
        "",
        "# a comment\n"
        "\n"
        "*.log\n"
        "!keep.log\n"
        "/build\n"
        "doc/*.txt\n"
        "**/cache\n"
        "a/**/b\n"
        "out/\n"
        "[ab].dat\n"
        "[!ab].bin\n"
        "\\#literal\n"
        "trail\\ \n"
        "gone/\n"
        "!gone/back\n"
        "!.env\n",
    )
    ig.add("sub", "*.dat\n/only-here\n")
    cases = {
        ("a.log", False): True,
        ("x/y/a.log", False): True,
        ("a.logx", False): False,
        ("keep.log", False): False,
        ("x/keep.log", False): False,
        ("build", True): True,
        ("build/x", False): True,
        ("x/build", True): False,
        ("doc/a.txt", False): True,
        ("doc/x/a.txt", False): False,
        ("cache", True): True,
        ("p/q/cache", False): True,
        ("a/b", False): True,
        ("a/x/y/b", False): True,
        ("out", True): True,
        ("out/f", False): True,
        ("out", False): False,
        ("a.dat", False): True,
        ("c.dat", False): False,
        ("c.bin", False): True,
        ("a.bin", False): False,
        ("#literal", False): True,
        ("trail ", False): True,
        ("trail", False): False,
        ("gone/back", False): True,  # a file under an excluded directory stays out
        ("sub/x.dat", False): True,
        ("sub/only-here", False): True,
        ("sub/deeper/only-here", False): False,
        ("only-here", False): False,
        ("x.txt", False): False,
        # built-ins: dot entries and __pycache__ (a user pattern re-includes)
        (".git2", True): True,
        ("p/.hidden", False): True,
        (".env", False): False,
        ("p/__pycache__", True): True,
        ("p/__pycache__", False): False,
    }
    wrong = {k: v for k, v in cases.items() if (ig.why(*k) is not None) != v}
    assert wrong == {}
    assert ig.why("x/a.log", False) == "ignored by .evergraphignore:3 (*.log)"
    assert ig.why("sub/x.dat", False) == "ignored by sub/.evergraphignore:1 (*.dat)"
    assert ig.why("p/.hidden", False) == "a dot entry"


def test_ignore_files_on_disk(tmp_path: Path) -> None:
    src = site(
        tmp_path / "s",
        {
            "main.yaml": GRAPH,
            ".evergraphignore": "*.log\ntests/\n!.well-known/\n",
            "app.log": "x\n",
            "tests/t.py": "x\n",
            ".well-known/a": "sent\n",
            "sub/.evergraphignore": "*.bak\n!important.log\n",
            "sub/x.bak": "x\n",
            "sub/important.log": "sent\n",
            "sub/other.log": "x\n",
            "x.bak": "sent: the pattern is sub's\n",
        },
    )
    b = bd.collect(src / "main.yaml", use_git=False)
    assert sorted(b.files) == [
        ".well-known/a",
        "main.yaml",
        "sub/important.log",
        "x.bak",
    ]
    assert sorted(lo.path for lo in b.left_out) == [
        ".evergraphignore",
        "app.log",
        "sub/.evergraphignore",
        "sub/other.log",
        "sub/x.bak",
        "tests/",
    ]
    assert not any(lo.notable for lo in b.left_out)


def test_dry_run_sends_nothing(tmp_path: Path) -> None:
    state = tmp_path / "state"
    src = site(
        tmp_path / "site",
        {"main.yaml": GRAPH, "run.sh": "#!/bin/sh\n", "big": b"\1" * 5000, ".env": "x\n"},
    )
    (src / "run.sh").chmod(0o755)
    r = deploy(state, src / "main.yaml", "--no-git", "--dry-run", "--max-file-size", "4K")
    assert r.returncode == 0, r.stderr
    signer = state_signer(state)
    assert r.stdout.splitlines() == [
        f"send\t0644\t{len(GRAPH)}\tmain.yaml",
        "send\t0755\t10\trun.sh",
        "leave out\t.env\ta dot entry",
        "leave out\tbig\t5000 bytes, over the 4096-byte limit (--max-file-size)",
        f"dry run: would deploy 2 files, {len(GRAPH) + 10} bytes, 2 left out; "
        f"signed by {signer} ({fingerprint(signer)}); nothing sent",
    ]
    assert not (state / "world.sqlite").exists()  # the World was never opened


def test_big_files_are_stored_in_parts_or_left_out(tmp_path: Path) -> None:
    state = tmp_path / "state"
    big = os.urandom(dp.CHUNK_BYTES * 2 + 12345)
    src = site(tmp_path / "site", {"main.yaml": GRAPH, "big.bin": big})
    parse(deploy(state, src / "main.yaml", "--no-git"))
    d = in_world(state, dp.latest)
    assert d is not None
    f = d.files["big.bin"]
    assert (f.size, len(f.chunks), f.sha) == (len(big), 3, dp.file_ref(big, 0o644).sha)
    assert max(len(v) for v in in_world(state, blobs)) == dp.CHUNK_BYTES  # one World value
    out = in_world(state, lambda kv: dp.fetch(kv, d, tmp_path / "out"))
    assert (out.parent / "big.bin").read_bytes() == big
    # over --max-file-size: left out, and said so on stderr
    r = deploy(state, src / "main.yaml", "--no-git", "--max-file-size", "1M")
    m = parse(r)
    assert m.group(3, 6) == ("1", "1")
    assert r.stderr == (
        f"evergraph: deploy: left out big.bin: {len(big)} bytes, over the 1048576-byte "
        "limit (--max-file-size)\n"
    )
    for bad in ("ten", "-1", "1X", ""):
        r = deploy(state, src / "main.yaml", "--no-git", "--max-file-size", bad)
        assert r.returncode == 2
        assert r.stderr.startswith("evergraph: deploy: --max-file-size: "), r.stderr
        assert len(r.stderr.strip().splitlines()) == 1


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
    HostKeys(state)  # and the signing key
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
            argv = [
                "deploy",
                str(src / "main.yaml"),
                "--no-git",
                "--world-db",
                str(db),
                "--state-dir",
                str(state),
            ]
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
    assert len({d.files["main.yaml"].sha for d in hist}) == 4


def test_follow_sees_a_deploy_from_another_process(tmp_path: Path) -> None:
    state = tmp_path / "state"
    src = site(tmp_path / "site", {"main.yaml": GRAPH})
    first = parse(deploy(state, src / "main.yaml", "--no-git"))
    trust = dp.Trust(keys=[state_signer(state)])

    async def body(kv: KV) -> None:
        it = dp.follow(kv, trust).__aiter__()
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
    trust = dp.Trust(keys=[state_signer(state)])

    async def body(kv: KV) -> None:
        it = dp.follow(kv, trust).__aiter__()
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
        key = dp.blob_key(d2.files["data.txt"].sha)
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
    huge = site(tmp_path / "huge", {"main.yml": GRAPH + "#" * (11 << 20)})
    cases.append((huge / "main.yml", "over the 10485760-byte limit"))
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
    r = run_cli(
        "deploy",
        src / "main.yaml",
        "--no-git",
        "--world-db",
        blocker / "w.sqlite",
        "--state-dir",
        tmp_path / "state",
    )
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


KEY = nacl.signing.SigningKey(b"\1" * 32)
OTHER = nacl.signing.SigningKey(b"\2" * 32)
ME = dp.verify_key_of(KEY)
FILES = {"main.yaml": GRAPH.encode(), "lib/x.txt": b"x\n"}


async def pub(
    kv: KV, files: dict[str, bytes] = FILES, key: nacl.signing.SigningKey = KEY
) -> dp.Deploy:
    contents = {p: dp.Content(b, 0o644) for p, b in files.items()}
    return await dp.publish(kv, "main.yaml", contents, key=key, git=None, by="t@h")


def record(
    n: int,
    parent: str = "",
    key: nacl.signing.SigningKey = KEY,
    files: dict[str, dp.File] | None = None,
    **kw: object,
) -> dp.Deploy:
    """A signed record made by hand."""
    fields: dict[str, object] = {
        "n": n,
        "parent": parent,
        "entry": "main.yaml",
        "files": files if files is not None else {"main.yaml": dp.file_ref(b"x", 0o644)},
        "git": None,
        "by": "u",
        "time": 1.0,
        "signer": dp.verify_key_of(key),
        **kw,
    }
    digest = dp.record_hash(**fields)  # type: ignore[arg-type]
    return dp.Deploy(hash=digest, signature=dp.sign(key, digest), **fields)  # type: ignore[arg-type]


def rehashed(d: dp.Deploy) -> dp.Deploy:
    """`d` with its hash made to match again (the signature left as it was)."""
    return msgspec.structs.replace(d, hash=dp._hash_of(d))


def test_verify_rejects_bad_records() -> None:
    good = record(1)
    dp.verify(good, "k")
    assert dp.decode_record(msgspec.json.encode(good), "k") == good
    f = dp.file_ref(b"x", 0o644)

    def resigned(**kw: object) -> dp.Deploy:
        d = msgspec.structs.replace(good, **kw)
        d = msgspec.structs.replace(d, hash=dp._hash_of(d))
        return msgspec.structs.replace(d, signature=dp.sign(KEY, d.hash))

    raw_sig = base64.b64decode(good.signature)
    bad_sig = base64.b64encode(bytes([raw_sig[0] ^ 1]) + raw_sig[1:]).decode()
    rehashed_unsigned = rehashed(msgspec.structs.replace(good, by="other"))
    bad = {
        "is absolute": resigned(files={"main.yaml": f, "/etc/x": f}),
        "'..' component": resigned(files={"main.yaml": f, "a/../../x": f}),
        "not one of the files": resigned(entry="b.yaml"),
        "not a .yaml, .yml or .py": resigned(entry="x.sh", files={"x.sh": f}),
        "not positive": resigned(n=0),
        "deploy 1 names a parent": resigned(parent="1" * 64),
        "not a sha256": resigned(files={"main.yaml": msgspec.structs.replace(f, sha="xyz")}),
        "has mode 4755": resigned(files={"main.yaml": msgspec.structs.replace(f, mode=0o4755)}),
        "blobs for": resigned(files={"main.yaml": msgspec.structs.replace(f, chunks=())}),
        "its one blob is not its content": resigned(
            files={"main.yaml": msgspec.structs.replace(f, chunks=("0" * 64,))}
        ),
        "both a file and a directory": resigned(files={"main.yaml": f, "main.yaml/b": f}),
        "hash does not match": msgspec.structs.replace(good, by="other"),
        # the signature: tampered, over another hash, by another key than named, absent
        "bad signature": msgspec.structs.replace(good, signature=bad_sig),
        "bad signature: deploy 1 is not signed": rehashed_unsigned,
        "not signed by the key it names": resigned(signer=dp.verify_key_of(OTHER)),
        "signature is not base64": msgspec.structs.replace(good, signature="!!"),
        "signer is not a verify key": resigned(signer=""),
    }
    for why, d in bad.items():
        with pytest.raises(dp.DeployError, match=why):
            dp.verify(d, "k")
    extra = msgspec.json.encode(good)[:-1] + b',"more":1}'
    with pytest.raises(dp.DeployError, match="not a deploy record"):
        dp.decode_record(extra, "k")
    with pytest.raises(dp.DeployError, match="not a deploy record"):
        dp.decode_record(msgspec.json.encode(good).replace(b'"n":1', b'"n":"1"'), "k")
    # an unsigned record of the old schema (files as plain hashes, no signer)
    old = {k: v for k, v in msgspec.to_builtins(good).items() if k not in ("signer", "signature")}
    old["files"] = {"main.yaml": f.sha}
    with pytest.raises(dp.DeployError, match="not a deploy record"):
        dp.decode_record(msgspec.json.encode(old), "k")
    old["files"] = {"main.yaml": msgspec.to_builtins(f)}
    with pytest.raises(dp.DeployError, match="missing required field `signer`"):
        dp.decode_record(msgspec.json.encode(old), "k")


def test_lagging_head_and_bad_head_records() -> None:
    async def body(kv: KV) -> None:
        d1 = await pub(kv)
        # a deployer that died after writing record 2 but before moving the head
        f2 = {"main.yaml": dp.file_ref(b"two", 0o644)}
        d2 = record(2, d1.hash, files=f2, by="x", time=2.0)
        await kv.put(dp.record_key(2), msgspec.json.encode(d2))
        assert await dp.latest(kv) == d2
        it = dp.follow(kv, dp.Trust(keys=[ME])).__aiter__()
        try:  # follow starts from the newest record, not the lagging head
            assert await asyncio.wait_for(it.__anext__(), 5) == d2
        finally:
            await it.aclose()  # type: ignore[attr-defined]
        d3 = await pub(kv)
        assert (d3.n, d3.parent) == (3, d2.hash)
        # a head forged with a valid-looking record that is not deploys/<n>: ignored
        fake = record(99, "b" * 64)
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


def test_fetch_modes_refuses_existing_dest_and_follow_skips_older(tmp_path: Path) -> None:
    async def body(kv: KV) -> None:
        d1 = await pub(kv)
        dest = tmp_path / "d"
        dest.mkdir()
        with pytest.raises(dp.DeployError, match="already exists"):
            await dp.fetch(kv, d1, dest)
        entry = await dp.fetch(kv, d1, tmp_path / "new" / "d1")
        assert entry.read_bytes() == FILES["main.yaml"]
        assert (entry.parent / "lib/x.txt").read_bytes() == b"x\n"
        # modes travel: a script keeps its exec bit whatever the umask; empty files too
        script = b"#!/bin/sh\necho ran\n"
        files = {
            "main.yaml": dp.Content(b"graph: s\n", 0o644),
            "bin/run": dp.Content(script, 0o755),
            "empty": dp.Content(b"", 0o644),
        }
        ds = await dp.publish(kv, "main.yaml", files, key=KEY, git=None, by="t")
        assert ds.files["bin/run"].mode == 0o755
        old = os.umask(0o077)
        try:
            got = await dp.fetch(kv, ds, tmp_path / "s")
        finally:
            os.umask(old)
        assert stat.S_IMODE((got.parent / "bin/run").stat().st_mode) == 0o755
        assert stat.S_IMODE(got.stat().st_mode) == 0o644
        assert (got.parent / "empty").read_bytes() == b""
        ran = await asyncio.create_subprocess_exec(
            got.parent / "bin/run", stdout=asyncio.subprocess.PIPE
        )
        stdout, _ = await ran.communicate()
        assert stdout == b"ran\n"
        with pytest.raises(dp.DeployError, match="mode 600 is not 644 or 755"):
            await dp.publish(
                kv, "main.yaml", {"main.yaml": dp.Content(b"", 0o600)}, key=KEY, git=None, by="t"
            )

        seen: list[int] = []
        got_two = asyncio.Event()

        async def consume(it: AsyncIterator[dp.Deploy]) -> None:
            async for d in it:
                seen.append(d.n)
                if d.n >= 3:
                    got_two.set()

        task = asyncio.create_task(consume(dp.follow(kv, dp.Trust(keys=[ME]))))
        try:
            await asyncio.wait_for(_until(lambda: seen == [2]), 5)
            d3 = await pub(kv, {**FILES, "main.yaml": b"graph: three\n"})
            await asyncio.wait_for(got_two.wait(), 5)
            # the head moved back to deploy 1 by hand: no rollback is yielded
            await kv.put(dp.HEAD, msgspec.json.encode(d1))
            await pub(kv, {**FILES, "main.yaml": b"graph: four\n"})
            await asyncio.wait_for(_until(lambda: seen[-1] == 4), 5)
            assert seen == [2, 3, 4]
            assert d3.n == 3
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    run_mem(body)


async def _until(pred: Callable[[], bool]) -> None:
    while not pred():
        await asyncio.sleep(0.001)


class Follower:
    """`dp.follow` in a task, collecting what it yields."""

    def __init__(self, kv: KV, trust: dp.Trust, after: dp.Deploy | None = None) -> None:
        self.seen: list[dp.Deploy] = []
        self.task = asyncio.create_task(self._run(dp.follow(kv, trust, after=after)))

    @classmethod
    def after(cls, kv: KV, trust: dp.Trust, mark: dp.Deploy) -> Follower:
        return cls(kv, trust, mark)

    async def _run(self, it: AsyncIterator[dp.Deploy]) -> None:
        async for d in it:
            self.seen.append(d)

    async def until(self, n: int) -> None:
        await asyncio.wait_for(_until(lambda: bool(self.seen) and self.seen[-1].n == n), 5)

    async def stop(self) -> None:
        self.task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await self.task


@pytest.fixture
def warnings(caplog: pytest.LogCaptureFixture) -> Callable[[str], int]:
    caplog.set_level(logging.INFO, logger="evergraph.deploys")
    return lambda text: sum(text in r.getMessage() for r in caplog.records)


def test_trust_pins_the_first_signer_and_refuses_others_once(
    tmp_path: Path, warnings: Callable[[str], int]
) -> None:
    pins = Pins(tmp_path)

    async def body(kv: KV) -> None:
        d1 = await pub(kv)
        f = Follower(kv, dp.Trust(pins=pins))
        try:
            await f.until(1)
            assert pins.trusted_deployers() == [ME]  # pinned, and said so
            assert warnings(f"pinned deployer {ME} ({fingerprint(ME)})") == 1
            # another key's deploy: refused, logged once however often the head shows it
            d2 = await pub(kv, key=OTHER)
            other = fingerprint(dp.verify_key_of(OTHER))
            await asyncio.wait_for(_until(lambda: warnings(f"signed by {other}") == 1), 5)
            head = await kv.get(dp.HEAD)
            assert head is not None
            for _ in range(3):
                await kv.put(dp.HEAD, head.value)
            # forged records: a tampered signature, a tampered field (hash mismatch), a
            # re-hashed record under the old signature, garbage, an unsigned old-schema one
            mine = record(3, d2.hash)
            sig = base64.b64decode(mine.signature)
            forged = {
                f"not signed by the key it names ({fingerprint(ME)})": msgspec.structs.replace(
                    mine, signature=base64.b64encode(sig[:-1] + bytes([sig[-1] ^ 1])).decode()
                ),
                "hash does not match": msgspec.structs.replace(mine, by="mallory@x"),
                # names another key (re-hashed): the signature is not that key's
                f"not signed by the key it names ({other})": rehashed(
                    msgspec.structs.replace(mine, signer=dp.verify_key_of(OTHER))
                ),
            }
            for why, d in forged.items():
                value = msgspec.json.encode(d)
                await kv.put(dp.record_key(3), value)
                await kv.put(dp.HEAD, value)
                await asyncio.wait_for(_until(lambda w=why: warnings(w) == 1), 5)  # type: ignore[misc]
            await kv.put(dp.record_key(3), b'{"garbage": true')
            await kv.put(dp.HEAD, b'{"garbage": true')
            await asyncio.wait_for(_until(lambda: warnings("not a deploy record") == 1), 5)
            unsigned = {"n": 3, "parent": d2.hash, "hash": "0" * 64, "entry": "main.yaml"}
            await kv.put(dp.HEAD, msgspec.json.encode(unsigned))
            await asyncio.wait_for(_until(lambda: warnings("not a deploy record") == 2), 5)
            await kv.delete(dp.record_key(3))
            # the pinned key deploys again: run; nothing refused was yielded
            d3 = await pub(kv)
            await f.until(3)
            assert [d.n for d in f.seen] == [1, 3]
            assert f.seen[-1] == d3
            assert warnings(f"signed by {other}") == 1
            for why in forged:
                assert warnings(why) == 1, why
        finally:
            await f.stop()
        assert d1.signer == ME

        # a restarted follower with the pin: starts from the newest trusted deploy,
        # passing over a newer untrusted one (logged once)
        d4 = await pub(kv, key=OTHER)
        g = Follower(kv, dp.Trust(pins=Pins(tmp_path)))
        try:
            await g.until(3)
            assert [d.n for d in g.seen] == [3]
            assert d4.n == 4
            assert warnings("deploys/0000000004: deploy 4 is signed by") == 1
        finally:
            await g.stop()

    run_mem(body)


def test_trust_with_named_deployers(tmp_path: Path, warnings: Callable[[str], int]) -> None:
    third = nacl.signing.SigningKey(b"\3" * 32)
    with pytest.raises(ValueError, match="not base64"):
        dp.Trust(keys=["not a key!"])
    with pytest.raises(ValueError, match="give deployer keys"):
        dp.Trust()

    async def body(kv: KV) -> None:
        await pub(kv, key=OTHER)  # deploy 1, by a key not named
        trust = dp.Trust(keys=[ME, dp.verify_key_of(third)])
        f = Follower(kv, trust)
        try:
            await asyncio.wait_for(_until(lambda: warnings("deploy 1 is signed by") == 1), 5)
            await pub(kv, key=third)
            await f.until(2)
            await pub(kv, key=OTHER)
            await asyncio.wait_for(_until(lambda: warnings("deploy 3 is signed by") == 1), 5)
            await pub(kv, key=KEY)
            await f.until(4)
            assert [d.n for d in f.seen] == [2, 4]
        finally:
            await f.stop()
        assert not (tmp_path / "pins.json").exists()

    run_mem(body)


def test_spam_by_untrusted_signers_cannot_hide_a_trusted_deploy(
    tmp_path: Path, warnings: Callable[[str], int]
) -> None:
    """Anyone who can write the World can publish deploys signed by keys of their own:
    150 of them after the trusted one (more than the LOOKBACK) still leave it found,
    at start and live, through the signer's own record (`deploys/by/...`)."""
    spam = 150
    assert spam > dp.LOOKBACK
    pins = Pins(tmp_path)
    pins.add_deployer(ME)

    async def body(kv: KV) -> None:
        d1 = await pub(kv)
        for i in range(spam):
            await pub(kv, key=nacl.signing.SigningKey(i.to_bytes(2, "big") * 16))
        for trust in (dp.Trust(keys=[ME]), dp.Trust(pins=pins)):
            f = Follower(kv, trust)
            try:
                await f.until(1)
                assert f.seen == [d1]
            finally:
                await f.stop()
        # live: a trusted deploy, at once buried under more spam that moves the head on
        f = Follower(kv, dp.Trust(keys=[ME]))
        try:
            await f.until(1)
            d2 = await pub(kv)
            for i in range(3):
                await pub(kv, key=nacl.signing.SigningKey(bytes([9, i]) * 16))
            await f.until(d2.n)
            assert f.seen == [d1, d2]
        finally:
            await f.stop()
        # the signer's record damaged: logged once, and it hides nothing the walk finds
        by = dp.signer_key(ME)
        mine = await kv.get(by)
        assert mine is not None
        assert dp.decode_record(mine.value, by) == d2
        await kv.put(by, b"garbage")
        f = Follower(kv, dp.Trust(keys=[ME]))
        try:
            await f.until(d2.n)
            assert warnings(f"{by}: not a deploy record") == 1
        finally:
            await f.stop()

    run_mem(body)


def test_a_follower_never_goes_back(warnings: Callable[[str], int]) -> None:
    """`after` (the high-water mark): a record deleted and the head pointed back, or
    an old World put back, is refused (logged once); a deploy signed later in a
    World numbered afresh runs."""

    async def body(kv: KV) -> None:
        d1 = await pub(kv)
        d2 = await pub(kv, {"main.yaml": GRAPH.encode(), "two": b"2\n"})
        # the attacker deletes deploy 2 (record and the signer's record), points the head back
        old = msgspec.json.encode(d1)
        await kv.delete(dp.record_key(2))
        await kv.put(dp.signer_key(ME), old)
        await kv.put(dp.HEAD, old)
        f = Follower.after(kv, dp.Trust(keys=[ME]), d2)
        try:
            why = f"deploy 1 ({d1.hash[:12]}) is older than deploy 2 ({d2.hash[:12]})"
            await asyncio.wait_for(_until(lambda: warnings(why) == 1), 5)
            for _ in range(3):  # shown again: logged once
                await kv.put(dp.HEAD, old)
            assert f.seen == []
            # a genuine newer deploy (number 2 again, signed later) runs
            d2b = await pub(kv)
            assert (d2b.n, d2b.parent) == (2, d1.hash)
            await f.until(2)
            assert f.seen == [d2b]
            assert warnings(why) == 1
        finally:
            await f.stop()
        assert not dp.newer(d1, d2)
        assert dp.newer(d2b, d2)
        assert not dp.newer(d2, d2)

    run_mem(body)

    async def fresh(kv: KV) -> None:
        mark = record(5, "a" * 64, time=100.0)
        # a new World: deploy 1 signed before the mark is an old one put back; after it, new
        for when, runs in ((50.0, False), (150.0, True)):
            d = record(1, time=when)
            value = msgspec.json.encode(d)
            await kv.put(dp.record_key(1), value)
            await kv.put(dp.HEAD, value)
            f = Follower.after(kv, dp.Trust(keys=[ME]), mark)
            try:
                if runs:
                    await f.until(1)
                else:
                    await asyncio.wait_for(
                        _until(lambda: warnings("is older than deploy 5") == 1), 5
                    )
                assert f.seen == ([d] if runs else [])
            finally:
                await f.stop()

    run_mem(fresh)
