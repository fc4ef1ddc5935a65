"""Safe writes: one atomic write (random O_EXCL|O_NOFOLLOW temporary file, fsync
before rename, directory fsync after) for state and managed files; what a kill
leaves is swept at start; any resource name maps to its own state directory."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from evergraph._util import atomic
from evergraph._util.atomic import TEMP_GRACE
from evergraph.engine.store import encode_name, vertex_dir, vertex_name
from tests.conftest import run_cli

NOBODY = 65534


@pytest.fixture
def public() -> Iterator[Path]:
    """A world-writable sticky dir (like /tmp) that `nobody` can reach."""
    d = Path(tempfile.mkdtemp(prefix="evergraph-test-"))
    os.chmod(d, 0o1777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def secret(public: Path) -> Iterator[Path]:
    """A root-owned 0600 file out of nobody's reach."""
    d = Path(tempfile.mkdtemp(prefix="evergraph-test-secret-"))
    f = d / "shadow"
    f.write_text("secret\n")
    os.chmod(f, 0o600)
    yield f
    shutil.rmtree(d, ignore_errors=True)


def as_nobody(*argv: str) -> None:
    subprocess.run(argv, user=NOBODY, group=NOBODY, check=True, capture_output=True)


# -- the symlink attack ---------------------------------------------------------------

ATTACK = textwrap.dedent("""
    import os, subprocess, sys
    import evergraph
    from evergraph._util import atomic
    from evergraph.resources.file import File

    pub, secret, state, src = sys.argv[1:5]
    PLANTED = "000000000000"

    def plant(where, names):
        for n in names:  # as the attacker: user nobody
            subprocess.run(["ln", "-s", secret, os.path.join(where, n)],
                           user=65534, group=65534, check=True)

    # The attacker knows the temporary names: the ones earlier versions used
    # (pid, object id) and, here, the random one (forced, for the test).
    real = atomic.temp_name
    seen = set()
    def temp_name(name):
        if name in seen:
            return real(name)
        seen.add(name)
        return f".{name}.{PLANTED}.tmp"
    atomic.temp_name = temp_name

    original = File.init
    async def init(self, handle):
        await original(self, handle)
        base = os.path.basename(self._path)
        if base == "managed":
            plant(pub, [f".managed.evergraph-{os.getpid()}-{id(self):x}"])
    File.init = init
    plant(pub, [f".managed.{PLANTED}.tmp"])
    plant(os.path.join(pub, "tree"), [f".item.evergraph-{os.getpid()}", f".item.{PLANTED}.tmp"])

    g = evergraph.Graph("attack")
    g.add("file", "managed", path=os.path.join(pub, "managed"), content="new\\n", mode="0666")
    g.add("file", "tree", path=os.path.join(pub, "tree") + "/", source=src + "/", recurse=True)
    sys.exit(evergraph.run(g, state_dir=state, converged_exit=True, world=None))
""")


def test_symlinks_planted_at_every_temp_name_are_never_followed(
    tmp_path: Path, public: Path, secret: Path
) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "item").write_text("copied\n")
    (public / "tree").mkdir()
    os.chmod(public / "tree", 0o1777)
    script = tmp_path / "attack.py"
    script.write_text(ATTACK)
    r = subprocess.run(
        [sys.executable, script, public, secret, tmp_path / "s", src],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    # the root-owned 0600 target is untouched: content, mode, owner
    assert secret.read_text() == "secret\n"
    st = secret.stat()
    assert (stat.S_IMODE(st.st_mode), st.st_uid) == (0o600, 0)
    # the managed files are written, as real files
    managed = public / "managed"
    assert not managed.is_symlink()
    assert managed.read_text() == "new\n"
    assert stat.S_IMODE(managed.stat().st_mode) == 0o666
    item = public / "tree" / "item"
    assert not item.is_symlink()
    assert item.read_text() == "copied\n"
    # the planted links were neither followed nor taken as ours
    planted = [p for d in (public, public / "tree") for p in d.iterdir() if p.is_symlink()]
    assert len(planted) == 4
    assert all(os.readlink(p) == str(secret) for p in planted)


def test_the_graphviz_file_is_not_written_through_a_planted_link(
    tmp_path: Path, public: Path, secret: Path
) -> None:
    as_nobody("ln", "-s", str(secret), str(public / ".g.dot.tmp"))  # the old fixed name
    g = tmp_path / "g.yaml"
    g.write_text("graph: t\nresources:\n  noop:\n  - name: n\n")
    dot = public / "g.dot"
    r = run_cli(
        "run", g, "--state-dir", tmp_path / "s", "--converged-exit", "--world", "memory",
        "--graphviz", dot,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert secret.read_text() == "secret\n"
    assert not dot.is_symlink()
    assert "digraph" in dot.read_text()


def test_atomic_write_skips_a_planted_temp_name(
    public: Path, secret: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    suffixes = iter(["aaaaaaaaaaaa", "bbbbbbbbbbbb"])
    monkeypatch.setattr(atomic, "_suffix", lambda: next(suffixes))
    as_nobody("ln", "-s", str(secret), str(public / ".f.aaaaaaaaaaaa.tmp"))
    atomic.atomic_write(public / "f", b"data", mode=0o644)
    assert (public / "f").read_bytes() == b"data"
    assert secret.read_text() == "secret\n"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert (public / ".f.aaaaaaaaaaaa.tmp").is_symlink()  # not ours: left alone
    assert not (public / ".f.bbbbbbbbbbbb.tmp").exists()


def test_fsync_policy_file_before_rename_directory_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[str] = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd: int) -> None:
        events.append("fsync dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync file")
        real_fsync(fd)

    def rename(*a: object, **k: object) -> None:
        events.append("rename")
        real_rename(*a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    atomic.atomic_write(tmp_path / "f", b"x")
    assert events == ["fsync file", "rename", "fsync dir"]
    events.clear()
    atomic.atomic_write(tmp_path / "new" / "g", b"x")  # a new directory: fsynced in
    assert events == ["fsync dir", "fsync file", "rename", "fsync dir"]
    events.clear()
    atomic.atomic_write(tmp_path / "h", b"x", durable=False)
    assert events == ["rename"]


# -- leftovers of a kill --------------------------------------------------------------


def test_leftovers_in_the_state_dir_are_swept_at_start(tmp_path: Path) -> None:
    state = tmp_path / "s"
    v = state / "vertices" / "noop" / "n"
    v.mkdir(parents=True)
    gone = [
        v / ".refresh.tmp",  # an earlier version's fixed temporary name
        v / ".refresh.0123456789ab.tmp",
        v / ".reversal.json.0123456789ab.tmp",
        state / ".pins.json.0123456789ab.tmp",
    ]
    for p in gone:
        p.write_text("half")
    fetch = state / "deploys" / ".7-abcdef.0123456789ab.tmp"  # an interrupted fetch
    (fetch / "sub").mkdir(parents=True)
    (fetch / "sub" / "g.yaml").write_text("half")
    # a kill's leftovers are older than the sweep's grace (a fresh temporary
    # file may be another process's write in flight: spared)
    old = time.time() - 2 * TEMP_GRACE
    for p in [*gone, fetch, fetch / "sub", fetch / "sub" / "g.yaml"]:
        os.utime(p, (old, old))
    fresh = state / ".pins.json.fedcba987654.tmp"  # another process's write in flight
    fresh.write_text("in flight")
    kept = [
        state / "deploys" / "7-abcdef" / ".x.0123456789ab.tmp",  # a deploy's own file
        state / "etcd" / ".member.tmp",  # etcd's, not ours
        v / "password.sealed",
    ]
    for p in kept:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("keep")
    g = tmp_path / "g.yaml"
    g.write_text("graph: t\nresources:\n  noop:\n  - name: n\n")
    r = run_cli("run", g, "--state-dir", state, "--converged-exit", "--world", "memory")
    assert r.returncode == 0, r.stderr
    assert [p for p in gone if p.exists()] == []
    assert not fetch.exists()
    assert all(p.read_text() == "keep" for p in kept)
    assert fresh.read_text() == "in flight"


def test_leftovers_next_to_managed_files_are_swept(tmp_path: Path, public: Path) -> None:
    d = public
    src = tmp_path / "src"
    src.mkdir()
    (src / "item").write_text("copied\n")
    tree = d / "tree"
    tree.mkdir()
    ours = [
        d / ".managed.0123456789ab.tmp",
        d / ".managed.evergraph-4242-7f00aa",  # an earlier version's names
        d / ".managed.evergraph-4242",
        tree / ".item.0123456789ab.tmp",
    ]
    for p in ours:
        p.write_text("half")
    others = [d / ".managed.111111111111.tmp", d / ".unmanaged.222222222222.tmp"]
    for p in others:
        p.write_text("not ours")
    os.chown(others[0], NOBODY, NOBODY)  # another user's: never removed
    as_nobody("ln", "-s", "/etc/passwd", str(d / ".managed.333333333333.tmp"))
    g = tmp_path / "g.yaml"
    g.write_text(
        "graph: t\nresources:\n  file:\n"
        f"  - {{name: {d}/managed, content: x}}\n"
        f"  - {{name: {tree}/, source: {src}/, recurse: true}}\n"
    )
    r = run_cli("run", g, "--state-dir", tmp_path / "s", "--converged-exit", "--world", "memory")
    assert r.returncode == 0, r.stderr
    assert [p for p in ours if p.exists()] == []
    assert all(p.read_text() == "not ours" for p in others)
    assert (d / ".managed.333333333333.tmp").is_symlink()
    assert (d / "managed").read_text() == "x"


# -- names of any form ----------------------------------------------------------------

NAMES = ["..", ".", "/", "a/b", "/etc/x", "nul\0byte", "x" * 300, "é" * 200, "%~", "%2E", "~"]


def test_every_name_maps_to_its_own_safe_reversible_directory(tmp_path: Path) -> None:
    names = [*NAMES, "x" * 301, "%", "%25", ".hidden", "\udc80", "a" * 100 + "%"]
    seen: dict[str, str] = {}
    for name in names:
        enc = encode_name(name)
        assert enc not in (".", "..")
        assert "/" not in enc
        assert "\0" not in enc
        assert len(enc.encode()) <= 200
        assert enc not in seen, (name, seen.get(enc))
        seen[enc] = name
        d = vertex_dir(tmp_path, "exec", name)
        assert d.parent == tmp_path / "vertices" / "exec"
        assert vertex_name(d) == name


@pytest.mark.parametrize("name", NAMES)
def test_an_owed_refresh_is_found_again_whatever_the_name(tmp_path: Path, name: str) -> None:
    # what a kill leaves: the child's refresh flag written, its apply not run
    state = tmp_path / "s"
    atomic.atomic_write(vertex_dir(state, "exec", name) / "refresh", b"1\n")
    ran = tmp_path / "ran"
    g = tmp_path / "g.yaml"
    g.write_text(
        "graph: t\nresources:\n  exec:\n"
        f"  - {{name: {json.dumps(name)}, cmd: 'touch {ran}', refresh_only: true}}\n"
    )
    r = run_cli("run", g, "--state-dir", state, "--converged-exit", "--world", "memory")
    assert r.returncode == 0, r.stderr
    assert ran.exists(), f"the refresh owed to exec[{name!r}] was lost:\n{r.stderr}"
    assert not (vertex_dir(state, "exec", name) / "refresh").exists()
