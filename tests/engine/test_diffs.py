"""Structured diffs (issue 14, item 1): every kind reports what it changed, or would
change under noop, as `Change(field, old, new, diff)`; file content as a unified diff
(cut past a size, binary summed up); secrets never shown; `--noop` and `--diff` print
them, with whom a change would notify or feed.

Kinds run for real: through the engine API on real files, commands, a memory World
and real host keys (the `Change`s are read from the status snapshots), and through
the CLI for what the operator reads. Kinds that need system state use the harness of
their own tests: test accounts (user, group), a not-installed package in noop (pkg),
a private `systemd --user` (svc).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import json
import os
import random
import re
import subprocess
from pathlib import Path

import pytest

from evergraph.cluster.hostkeys import HostKeys
from evergraph.engine import changes as ch
from evergraph.engine.engine import Engine
from evergraph.engine.masking import MASK
from evergraph.engine.prepare import prepare
from evergraph.engine.settings import Settings
from evergraph.engine.status import Change, VertexStatus
from evergraph.frontends.open import builtin_registry
from evergraph.frontends.yaml import parse_yaml
from evergraph.watch.inotify import InotifyHub
from evergraph.world.kv import KV
from evergraph.world.memory import MemoryKV
from tests.conftest import run_cli
from tests.kit.accounts import Accounts
from tests.kit.machine import MACHINE_WIDE
from tests.kit.systemd import UserManager, needs_user_manager

pytestmark = MACHINE_WIDE

# -- harness -----------------------------------------------------------------------------


async def _converge(
    state: Path,
    body: str,
    *,
    noop: bool = False,
    diff: bool = False,
    world: KV | None = None,
    until_changed: str | None = None,
) -> dict[str, VertexStatus]:
    """Run the graph `body` once through the engine (with a real inotify hub, a World
    and host keys) until converged, or with `until_changed` until that vertex changed;
    the vertices' final status by ident."""
    model = prepare(parse_yaml(f"graph: g\nresources:\n{body}", "g.yaml", builtin_registry()))
    state.mkdir(parents=True, exist_ok=True)
    settings = Settings(
        state_dir=state,
        hostname="test",
        noop=noop,
        diff=diff,
        converged_timeout=None if until_changed else 0,
        converged_exit=until_changed is None,
    )
    engine: Engine

    def observe(s: VertexStatus) -> None:
        if s.ident == until_changed and s.state == "changed":
            engine.request_stop()

    async with InotifyHub() as hub:
        pump = asyncio.create_task(hub.run())
        try:
            engine = Engine(
                settings,
                observe,
                watcher=hub,
                world=world if world is not None else MemoryKV(),
                keys=functools.cache(lambda: HostKeys(state)),
            )
            await asyncio.wait_for(engine.run(model), 30)
        finally:
            pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pump
    return {s.ident: s for s in engine.status()}


def converge(state: Path, body: str, **kw: object) -> dict[str, VertexStatus]:
    return asyncio.run(_converge(state, body, **kw))  # type: ignore[arg-type]


def changes_of(status: dict[str, VertexStatus], ident: str) -> dict[str, Change]:
    s = status[ident]
    assert s.error is None, s.error
    assert s.last_changed is not None, s  # (may be pending again: its own write's event)
    return {c.field: c for c in s.changes}


def graph(tmp_path: Path, body: str, edges: str = "") -> Path:
    g = tmp_path / "g.yaml"
    g.write_text(f"graph: g\nresources:\n{body}" + (f"edges:\n{edges}" if edges else ""))
    return g


def noop(g: Path, state: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return run_cli("run", g, "--state-dir", state, "--converged-exit", "--noop", *extra)


def ed25519(seed: int) -> str:
    """The base64 blob of a well-formed ssh-ed25519 public key."""
    t = b"ssh-ed25519"
    raw = len(t).to_bytes(4, "big") + t + (32).to_bytes(4, "big") + bytes([seed]) * 32
    return base64.b64encode(raw).decode()


# -- pure: diffs and values ----------------------------------------------------------------


def test_content_diff_is_unified_cut_and_binary_summed_up() -> None:
    d = ch.content_diff(b"a\nb\nc\n", b"a\nB\nc", "content")
    assert d.splitlines() == [
        "--- content (current)",
        "+++ content (declared)",
        "@@ -1,3 +1,3 @@",
        " a",
        "-b",
        "-c",
        "+B",
        "+c",
        "\\ No newline at end of file",
    ]
    assert ch.content_diff(None, b"x\n", "c").splitlines()[:2] == [
        "--- /dev/null",
        "+++ c (declared)",
    ]
    many = "".join(f"line {i}\n" for i in range(1000)).encode()
    cut = ch.content_diff(many, b"", "c").splitlines()
    assert len(cut) == ch.DIFF_MAX_LINES + 1
    assert cut[-1] == f"… {1000 + 3 - ch.DIFF_MAX_LINES} more lines"
    wide = ("x" * 1000 + "\n") * 100  # 100 KB in 100 lines: cut by bytes, not lines
    cut = ch.content_diff(None, wide.encode(), "c").splitlines()
    assert len("\n".join(cut[:-1])) <= ch.DIFF_MAX_BYTES
    assert re.fullmatch(r"… \d+ more lines", cut[-1])
    assert ch.content_diff(b"\0\1\2\3", b"abc", "c") == "binary, 4 bytes → 3 bytes"
    assert ch.content_diff(b"\xff\xfe", b"x", "c") == "binary, 2 bytes → 1 byte"


def test_build_masks_secrets_and_diffs_only_when_asked() -> None:
    secret = "hunter2-very-secret"
    reports = [
        ("content", b"old\n", f"pw={secret}\n".encode(), True),
        ("cmd", None, f"mysql -p{secret}", False),
        ("groups", ["a"], ["a", "b"], False),
        ("value", "x", "y", False),
    ]
    mask = functools.partial(lambda s, t: t.replace(s, MASK), secret)
    out = ch.build(reports, {"value"}, mask, diffs=True)
    assert out[0].old == "4 bytes"
    assert out[0].new == f"{len(secret) + 4} bytes"
    assert out[0].diff is not None
    assert f"+pw={MASK}" in out[0].diff
    assert secret not in out[0].diff
    assert out[1] == Change("cmd", None, f"mysql -p{MASK}")
    assert out[2] == Change("groups", "a", "a, b")
    assert out[3] == Change("value", MASK, MASK), "a received secret field shows as MASK whole"
    assert ch.build(reports, (), mask, diffs=False)[0].diff is None


def test_reports_of_one_shape_build_the_same_changes() -> None:
    # express (engine/express.py) builds the changes of a shape once: that is sound
    # only if build's output is a function of the shape (no secret field, no mask)
    rng = random.Random(28)
    contents: list[object] = [None, b"", b"a", b"ab", "ab", "é", b"\xc3\xa9", b"\0\1", "x" * 70]
    values: list[object] = [None, "a", "b", 7, True, ["a", "b"], ("a", "b"), "y" * 80]

    def reports() -> list[ch.Report]:
        out: list[ch.Report] = []
        for field in rng.sample(["content", "mode", "state", "owner"], rng.randint(1, 3)):
            if field == "content":
                out.append((field, rng.choice(contents), rng.choice(contents), True))
            else:
                out.append((field, rng.choice(values), rng.choice(values), False))
        return out

    seen: dict[tuple[bool, tuple[object, ...]], tuple[Change, ...]] = {}
    alike = 0
    for _ in range(3000):
        r = reports()
        for diffs in (False, True):
            made = ch.build(r, (), str, diffs)
            shape = (diffs, ch.shape(r, diffs))
            try:
                hash(shape)
            except TypeError:  # (a list: express does not memoise those)
                continue
            if shape in seen:
                assert seen[shape] == made, r
                alike += 1
            seen[shape] = made
    assert alike > 1000  # (shapes did repeat: the property was tried)
    # a content's size is its shape without diffs; with diffs, its bytes
    a = [("content", None, b"abc", True)]
    b = [("content", None, b"xyz", True)]
    assert ch.shape(a, False) == ch.shape(b, False)
    assert ch.shape(a, True) != ch.shape(b, True)
    assert ch.shape(a, False) != ch.shape([("content", None, b"abcd", True)], False)


# -- every kind, through the engine ----------------------------------------------------------


def test_file_reports_content_mode_owner_group_and_state(tmp_path: Path) -> None:
    d = tmp_path / "d"
    d.mkdir()
    (d / "edit").write_text("keep\nold\n")
    os.chmod(d / "edit", 0o644)
    (d / "gone").write_text("bye\n")
    os.symlink("/nowhere", d / "link")
    body = f"""  file:
  - {{name: new, path: {d}/new, content: "hello\\n", mode: "0600"}}
  - {{name: edit, path: {d}/edit, content: "keep\\nnew\\n", mode: "0640",
     owner: "12345", group: "23456"}}
  - {{name: gone, path: {d}/gone, state: absent}}
  - {{name: link, path: {d}/link, content: "x", force: true}}
  - {{name: dir, path: {d}/sub/, mode: "0750"}}
"""
    status = converge(tmp_path / "s", body, noop=True)
    new = changes_of(status, "file[new]")
    assert new["state"] == Change("state", None, "file")
    assert new["content"].old is None
    assert new["content"].new == "6 bytes"
    assert new["content"].diff is not None
    assert "+hello" in new["content"].diff.splitlines()
    assert new["mode"] == Change("mode", None, "0600")
    edit = changes_of(status, "file[edit]")
    assert edit["content"].diff is not None
    assert edit["content"].diff.splitlines()[2:] == ["@@ -1,2 +1,2 @@", " keep", "-old", "+new"]
    assert edit["mode"] == Change("mode", "0644", "0640")
    assert edit["owner"] == Change("owner", "root (0)", "12345")
    assert edit["group"] == Change("group", "root (0)", "23456")
    assert changes_of(status, "file[gone]") == {"state": Change("state", "file", None)}
    assert changes_of(status, "file[link]")["state"] == Change(
        "state", "symlink → /nowhere", "file"
    )
    assert changes_of(status, "file[dir]")["state"] == Change("state", None, "directory")
    assert changes_of(status, "file[dir]")["mode"] == Change("mode", None, "0750")
    # noop changed nothing
    assert (d / "edit").read_text() == "keep\nold\n"
    assert (d / "gone").exists()
    assert not (d / "new").exists()


def test_file_tree_copy_and_purge_report_each_entry(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text("one\n")
    (src / "sub" / "b.txt").write_text("two\n")
    dst.mkdir()
    (dst / "a.txt").write_text("uno\n")
    (dst / "stray").write_text("?\n")
    body = f"  file:\n  - {{name: t, path: {dst}/, source: {src}/, recurse: true, purge: true}}\n"
    got = changes_of(converge(tmp_path / "s", body), "file[t]")
    assert got["a.txt"].diff is None, "a real run without --diff builds no diff"
    assert (got["a.txt"].old, got["a.txt"].new) == ("4 bytes", "4 bytes")
    assert got["sub"] == Change("sub", None, "directory")
    assert got["stray"] == Change("stray", "file", None)
    assert (dst / "sub" / "b.txt").read_text() == "two\n"
    # with diffs (noop), each copied file's content is a diff
    (dst / "a.txt").write_text("eins\n")
    got = changes_of(converge(tmp_path / "s", body, noop=True), "file[t]")
    assert got["a.txt"].diff is not None
    assert "-eins" in got["a.txt"].diff.splitlines()


def test_exec_reports_the_command_with_its_arguments(tmp_path: Path) -> None:
    body = """  exec:
  - {name: e, cmd: echo, args: ["a b", "c"]}
  - {name: guarded, cmd: "echo no", creates: /}
"""
    status = converge(tmp_path / "s", body, noop=True)
    assert status["exec[e]"].changes == (Change("cmd", None, "echo 'a b' c"),)
    assert status["exec[guarded]"].state == "clean"
    assert status["exec[guarded]"].changes == ()
    status = converge(tmp_path / "s", body)
    assert status["exec[e]"].changes == (Change("cmd", None, "echo 'a b' c"),)


def test_kv_reports_old_and_new_value(tmp_path: Path) -> None:
    world = MemoryKV()
    one = "  kv:\n  - {name: k, value: v1}\n"
    assert changes_of(converge(tmp_path / "s", one, world=world), "kv[k]") == {
        "value": Change("value", None, "v1")
    }
    two = one.replace("v1", "v2")
    assert changes_of(converge(tmp_path / "s", two, world=world, noop=True), "kv[k]") == {
        "value": Change("value", "v1", "v2")
    }


def test_password_says_what_happened_never_the_value(tmp_path: Path) -> None:
    state = tmp_path / "s"
    body = "  password:\n  - {name: p, length: 16}\n"
    got = changes_of(converge(state, body, noop=True), "password[p]")
    assert got["password"] == Change("password", None, "generated")
    converge(state, body)
    sealed = state / "vertices" / "password" / "p" / "password.sealed"
    first = HostKeys(state).open_local(sealed.read_bytes()).decode()
    got = changes_of(converge(state, body.replace("16", "20")), "password[p]")
    assert got["length"] == Change("length", "16", "20")
    assert got["password"] == Change("password", "kept", "generated")
    second = HostKeys(state).open_local(sealed.read_bytes()).decode()
    shown = repr(got)
    assert first not in shown
    assert second not in shown


def test_timer_reports_its_tick(tmp_path: Path) -> None:
    status = converge(
        tmp_path / "s", "  timer:\n  - {name: t, interval: 0.05}\n", until_changed="timer[t]"
    )
    assert status["timer[t]"].changes == (Change("tick", None, "0.05 s elapsed"),)


def test_schedule_reports_volunteering(tmp_path: Path) -> None:
    status = converge(tmp_path / "s", "  schedule:\n  - {name: web}\n", noop=True)
    assert status["schedule[web]"].changes == (Change("volunteer", None, "test for web"),)


def test_ssh_authorized_key_reports_the_file_diff(tmp_path: Path) -> None:
    ak = tmp_path / "ak"
    other = f"ssh-ed25519 {ed25519(1)} someone\n"
    ak.write_text(other)
    body = (
        "  ssh_authorized_key:\n"
        f"  - {{name: k, file: {ak}, type: ssh-ed25519, key: {ed25519(2)}, comment: me}}\n"
    )
    got = changes_of(converge(tmp_path / "s", body, noop=True), "ssh_authorized_key[k]")
    diff = got["content"].diff
    assert diff is not None
    assert f" {other.strip()}" in diff.splitlines()
    assert f"+ssh-ed25519 {ed25519(2)} me" in diff.splitlines()
    assert ak.read_text() == other


def test_print_and_noop_never_change(tmp_path: Path) -> None:
    body = "  print:\n  - {name: p, msg: hello}\n  noop:\n  - {name: n}\n"
    status = converge(tmp_path / "s", body, noop=True)
    for ident in ("print[p]", "noop[n]"):
        assert status[ident].state == "clean"
        assert status[ident].changes == ()


def test_user_and_group_report_their_fields(tmp_path: Path, accounts: Accounts) -> None:
    user, grp, grp2 = accounts.user("u"), accounts.group("g"), accounts.group("h")
    uid, gid, gid2, other = accounts.ids(4)
    subprocess.run(["groupadd", "-g", str(other), grp2], check=True)
    body = (
        "  user:\n"
        f"  - {{name: {user}, uid: {uid}, gid: {grp}, shell: /bin/sh}}\n"
        "  group:\n"
        f"  - {{name: {grp}, gid: {gid}}}\n"
        f"  - {{name: {grp2}, gid: {gid2}}}\n"
    )
    status = converge(tmp_path / "s", body, noop=True)
    u = changes_of(status, f"user[{user}]")
    assert u["state"] == Change("state", None, "exists")
    assert u["gid"] == Change("gid", None, f"{grp} (does not exist yet)")
    assert changes_of(status, f"group[{grp}]") == {
        "state": Change("state", None, "exists"),
        "gid": Change("gid", None, str(gid)),
    }
    assert changes_of(status, f"group[{grp2}]") == {"gid": Change("gid", str(other), str(gid2))}
    # once the groups exist, the user's own fields
    subprocess.run(["groupadd", "-g", str(gid), grp], check=True)
    u = changes_of(converge(tmp_path / "s", body, noop=True), f"user[{user}]")
    assert u["uid"] == Change("uid", None, str(uid))
    assert u["gid"] == Change("gid", None, str(gid))
    assert u["shell"] == Change("shell", None, "/bin/sh")


@pytest.mark.skipif(
    os.geteuid() != 0 or not Path("/usr/bin/dpkg-query").exists(), reason="needs root on Debian"
)
def test_pkg_reports_versions_in_noop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.kit.pkg import installed

    if installed("hello") or installed("tree"):
        pytest.skip("hello or tree is installed here already")
    monkeypatch.setenv("EVERGRAPH_PKG_BACKEND", "apt")
    one = converge(tmp_path / "s", "  pkg:\n  - {name: hello}\n", noop=True)
    assert one["pkg[hello]"].changes == (Change("version", None, "the candidate"),)
    two = converge(tmp_path / "s", "  pkg:\n  - {name: hello}\n  - {name: tree}\n", noop=True)
    grouped = [s for s in two.values() if s.changes]
    assert len(grouped) == 1, "a group reports each member's package"
    assert {c.field for c in grouped[0].changes} == {"hello version", "tree version"}
    assert installed("hello") is None


@needs_user_manager
def test_svc_reports_state_and_startup_in_noop(tmp_path: Path, manager: UserManager) -> None:
    body = "  svc:\n  - {name: eg, state: running, startup: enabled, session: true}\n"
    got = changes_of(converge(tmp_path / "s", body, noop=True), "svc[eg]")
    assert got == {
        "startup": Change("startup", "disabled", "enabled"),
        "state": Change("state", "inactive", "running"),
    }
    assert manager.systemctl("is-active", "eg") == "inactive"


# -- what the operator reads -------------------------------------------------------------------


def test_noop_prints_the_diff_and_whom_it_would_notify(tmp_path: Path) -> None:
    f = tmp_path / "motd"
    f.write_text("welcome\nold news\n")
    g = graph(
        tmp_path,
        f'  file:\n  - {{name: motd, path: {f}, content: "welcome\\nnew news\\n"}}\n'
        f"  - {{name: copy, path: {tmp_path}/copy}}\n"
        '  exec:\n  - {name: reload, cmd: "true", refresh_only: true}\n',
        "- {from: {kind: file, name: motd}, to: {kind: exec, name: reload}, notify: true}\n"
        "- {from: {kind: file, name: motd}, to: {kind: file, name: copy}}\n",
    )
    r = noop(g, tmp_path / "s")
    assert r.returncode == 3, r.stderr
    lines = r.stderr.splitlines()
    head = next(i for i, ln in enumerate(lines) if "file[motd]: would change (noop): content" in ln)
    block = "\n".join(lines[head : head + 12])
    for want in (
        "content: 17 bytes → 17 bytes",
        "-old news",
        "+new news",
        "would notify exec[reload]",
    ):
        assert want in block, r.stderr
    assert re.search(r"^\s+-old news$", block, re.M), "diff lines are indented"
    assert f.read_text() == "welcome\nold news\n"


def test_noop_shows_what_a_change_would_send(tmp_path: Path) -> None:
    g = graph(
        tmp_path,
        '  exec:\n  - {name: e, cmd: "echo hi"}\n'
        f"  file:\n  - {{name: out, path: {tmp_path}/out}}\n",
        "- {from: {kind: exec, name: e, send: stdout},\n"
        "   to: {kind: file, name: out, recv: content}}\n",
    )
    r = noop(g, tmp_path / "s")
    assert r.returncode == 3, r.stderr
    assert "exec[e]: would change (noop): cmd" in r.stderr
    assert "cmd: (none) → echo hi" in r.stderr
    assert "would send stdout → file[out].content" in r.stderr


def test_diff_shows_diffs_on_a_real_run_and_only_then(tmp_path: Path) -> None:
    f = tmp_path / "f"
    g = graph(tmp_path, f'  file:\n  - {{name: f, path: {f}, content: "one\\n"}}\n')
    r = run_cli("run", g, "--state-dir", tmp_path / "s", "--converged-exit")
    assert r.returncode == 0, r.stderr
    assert "file[f]: applied: state, content" in r.stderr
    assert "+one" not in r.stderr
    assert "@@" not in r.stderr, "no --diff, no diff"
    g.write_text(g.read_text().replace("one", "two"))
    r = run_cli("run", g, "--state-dir", tmp_path / "s", "--converged-exit", "--diff")
    assert r.returncode == 0, r.stderr
    assert "file[f]: applied: content" in r.stderr
    assert re.search(r"^\s+-one$", r.stderr, re.M)
    assert re.search(r"^\s+\+two$", r.stderr, re.M)
    assert f.read_text() == "two\n"


def test_big_and_binary_content_in_noop(tmp_path: Path) -> None:
    big, blob, src = tmp_path / "big", tmp_path / "blob", tmp_path / "src.bin"
    big.write_text("".join(f"old {i}\n" for i in range(1000)))
    blob.write_bytes(b"\0\1\2\3")
    src.write_bytes(b"\0\1\2")
    text = "".join(f"new {i}\\n" for i in range(1000))
    g = graph(
        tmp_path,
        f'  file:\n  - {{name: big, path: {big}, content: "{text}"}}\n'
        f"  - {{name: blob, path: {blob}, source: {src}}}\n",
    )
    r = noop(g, tmp_path / "s")
    assert r.returncode == 3, r.stderr
    assert re.search(r"^\s+… \d+ more lines$", r.stderr, re.M), r.stderr
    assert sum(1 for ln in r.stderr.splitlines() if re.match(r"^\s+[-+](old|new) \d+$", ln)) < 200
    assert "binary, 4 bytes → 3 bytes" in r.stderr


def test_a_secret_sent_into_a_file_never_shows_in_a_diff(tmp_path: Path) -> None:
    out, state = tmp_path / "out", tmp_path / "s"
    out.write_text("what was here before\n")
    g = graph(
        tmp_path,
        f"  password:\n  - {{name: p, length: 24}}\n  file:\n  - {{name: out, path: {out}}}\n",
        "- {from: {kind: password, name: p, send: password},\n"
        "   to: {kind: file, name: out, recv: content}}\n",
    )
    seen, secrets = [], []
    # generated (text log), then replaced (JSON log): both passwords reach the file
    for length, fmt in (("24", "text"), ("32", "json")):
        g.write_text(g.read_text().replace("length: 24", f"length: {length}"))
        r = run_cli(
            "run", g, "--state-dir", state, "--converged-exit", "--diff", "--log-format", fmt
        )
        assert r.returncode == 0, r.stderr
        assert "file[out]: applied: content" in r.stderr, r.stderr
        seen.append(r.stderr)
        secrets.append(out.read_text())
        assert len(secrets[-1]) == int(length)
    assert f"content: {MASK} → {MASK}" in seen[0], seen[0]
    assert "what was here before" not in seen[0], "the old content of a secret field is hidden"
    for text in seen:
        for secret in secrets:
            assert secret not in text


def test_json_logs_carry_the_changes_as_fields(tmp_path: Path) -> None:
    f = tmp_path / "f"
    g = graph(
        tmp_path,
        f'  file:\n  - {{name: f, path: {f}, content: "x\\n"}}\n'
        '  exec:\n  - {name: r, cmd: "true", refresh_only: true}\n',
        "- {from: {kind: file, name: f}, to: {kind: exec, name: r}, notify: true}\n",
    )
    r = noop(g, tmp_path / "s", "--log-format", "json")
    assert r.returncode == 3, r.stderr
    records = [json.loads(line) for line in r.stderr.splitlines()]
    rec = next(x for x in records if x.get("event") == "changed")
    assert rec["msg"] == "file[f]: would change (noop): state, content"
    assert rec["resource"] == "file[f]"
    assert rec["noop"] is True
    assert rec["notify"] == ["exec[r]"]
    assert rec["send"] == []
    content = next(c for c in rec["changes"] if c["field"] == "content")
    assert content["old"] is None
    assert content["new"] == "2 bytes"
    assert content["diff"].splitlines()[-1] == "+x"
    # a real run without --diff: one text line, and the fields, without a diff
    r = run_cli("run", g, "--state-dir", tmp_path / "s", "--converged-exit", "--log-format", "json")
    assert r.returncode == 0, r.stderr
    records = [json.loads(line) for line in r.stderr.splitlines()]
    rec = next(x for x in records if x.get("event") == "changed" and x["resource"] == "file[f]")
    assert rec["msg"] == "file[f]: applied: state, content"
    assert rec["noop"] is False
    assert rec["changes"] == [
        {"field": "state", "old": None, "new": "file"},
        {"field": "content", "old": None, "new": "2 bytes"},
    ]
