"""ssh_authorized_key: one line per key, other lines untouched, user mode safe and strict."""

from __future__ import annotations

import base64
import os
import random
import secrets
import shutil
import stat
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from evergraph.testing.kinds import graph_error
from tests.conftest import Agent, run_cli, wait_for
from tests.kit.machine import MACHINE_WIDE

pytestmark = MACHINE_WIDE


def crafted(kind: str = "ssh-ed25519") -> str:
    """A well-formed public key blob: the type string, then a 32-byte key."""
    t, raw = kind.encode(), secrets.token_bytes(32)
    return base64.b64encode(
        len(t).to_bytes(4, "big") + t + len(raw).to_bytes(4, "big") + raw
    ).decode()


def keygen(tmp_path: Path, kind: str = "ed25519") -> tuple[str, str]:
    """(type, blob) of a real key from ssh-keygen, or a crafted one without it."""
    if shutil.which("ssh-keygen") is None:
        if kind != "ed25519":
            pytest.skip("ssh-keygen is not installed")
        return "ssh-ed25519", crafted()
    out = tmp_path / f"key-{secrets.token_hex(3)}"
    subprocess.run(["ssh-keygen", "-q", "-t", kind, "-N", "", "-C", "gen", "-f", out], check=True)
    typ, blob, _ = out.with_suffix(".pub").read_text().split(" ", 2)
    return typ, blob


def fingerprints(path: Path) -> list[str]:
    """What OpenSSH's own parser makes of the file: one comment per key line."""
    r = subprocess.run(["ssh-keygen", "-l", "-f", path], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return [line.split(" ", 2)[2].rsplit(" (", 1)[0] for line in r.stdout.splitlines()]


def replace(path: Path, text: str) -> None:
    """Edit by hand the way editors save: a new file renamed over the old one (an
    in-place rewrite could race with the agent's repair between truncate and write)."""
    tmp = path.with_name(path.name + ".hand")
    tmp.write_text(text)
    os.replace(tmp, path)


def write(tmp_path: Path, body: str) -> Path:
    g = tmp_path / "g.yaml"
    g.write_text("graph: keys\nresources:\n" + body)
    return g


def run(g: Path, state: Path, *extra: str) -> tuple[int, str]:
    r = run_cli("run", g, "--state-dir", state, "--converged-exit", *extra)
    return r.returncode, r.stderr


def key_res(name: str, where: str, typ: str, blob: str, extra: str = "") -> str:
    return f"  - {{name: {name}, {where}, type: {typ}, key: {blob}{extra}}}\n"


def passwd_uid(name: str) -> int | None:
    for line in Path("/etc/passwd").read_text().splitlines():
        fields = line.split(":")
        if fields[0] == name:
            return int(fields[2])
    return None


@pytest.fixture
def new_user() -> Iterator[str]:
    """A unique name for a user the test's graph makes; removed afterwards.
    (Request it before `agents`: the agent must stop before the clean-up.)"""
    name = f"egtest-{secrets.token_hex(3)}-n"
    try:
        yield name
    finally:
        subprocess.run(["userdel", "-r", name], capture_output=True)
        subprocess.run(["groupdel", name], capture_output=True)
        shutil.rmtree(f"/home/{name}", ignore_errors=True)
        assert passwd_uid(name) is None


@pytest.fixture
def login(tmp_path: Path) -> Iterator[tuple[str, int]]:
    """A real user with a home directory, removed afterwards: (name, uid)."""
    name = f"egtest-{secrets.token_hex(3)}-k"
    used = {int(ln.split(":")[2]) for ln in Path("/etc/passwd").read_text().splitlines() if ln}
    used |= {int(ln.split(":")[2]) for ln in Path("/etc/group").read_text().splitlines() if ln}
    uid = random.choice([i for i in range(61000, 65000) if i not in used])
    subprocess.run(["useradd", "-m", "-u", str(uid), "-U", name], check=True, capture_output=True)
    try:
        yield name, uid
    finally:
        subprocess.run(["userdel", "-r", name], capture_output=True)
        subprocess.run(["groupdel", name], capture_output=True)  # if userdel left it


def test_one_line_per_key_other_lines_untouched_second_run_clean(tmp_path: Path) -> None:
    typ, ours = keygen(tmp_path)
    otyp, other = keygen(tmp_path, "ecdsa")
    ak = tmp_path / "ak"
    before = [
        "# keys of the team: edit below\n",
        f"{otyp} {other} colleague@host\n",
        f'command="echo old",no-pty {typ} {ours} old-comment\n',
        "\n",
        f"{typ} {ours} duplicate\n",
        " ".join(keygen(tmp_path, "ecdsa")) + " last line without newline",
    ]
    ak.write_text("".join(before))
    ak.chmod(0o640)
    res = key_res(
        "k",
        f"file: {ak}",
        typ,
        ours,
        ", options: [no-pty, 'command=\"/bin/echo a, b\"'], comment: me@laptop",
    )
    g = write(tmp_path, "  ssh_authorized_key:\n" + res)
    rc, err = run(g, tmp_path / "s")
    assert rc == 0, err
    # replaced in its place, the duplicate gone, everything else byte for byte
    want = f'no-pty,command="/bin/echo a, b" {typ} {ours} me@laptop\n'
    assert ak.read_text() == "".join([*before[:2], want, before[3], before[5]])
    assert stat.S_IMODE(ak.stat().st_mode) == 0o640  # file mode: its mode is kept
    if shutil.which("ssh-keygen"):
        # OpenSSH's own parser reads every key line, options and all
        assert fingerprints(ak) == ["colleague@host", "me@laptop", "last line without newline"]
    assert not [p for p in tmp_path.iterdir() if ".evergraph-" in p.name]  # no temp left

    rc, err = run(g, tmp_path / "s")
    assert rc == 0, err
    assert ": applied" not in err, err


def test_new_file_and_directory_get_private_modes(tmp_path: Path) -> None:
    typ, ours = keygen(tmp_path)
    ak = tmp_path / "root" / ".ssh" / "authorized_keys"
    g = write(tmp_path, "  ssh_authorized_key:\n" + key_res("k", f"file: {ak}", typ, ours))
    rc, err = run(g, tmp_path / "s")
    assert rc == 0, err
    assert ak.read_text() == f"{typ} {ours}\n"
    assert stat.S_IMODE(ak.stat().st_mode) == 0o600
    assert stat.S_IMODE(ak.parent.stat().st_mode) == 0o700


def test_user_mode_creates_ssh_dir_and_file_owned_by_the_user(
    tmp_path: Path, login: tuple[str, int]
) -> None:
    user, uid = login
    typ, ours = keygen(tmp_path)
    g = write(
        tmp_path,
        "  ssh_authorized_key:\n"
        + key_res("k", f"user: {user}", typ, ours, ", comment: job-42, options: [no-pty]"),
    )
    rc, err = run(g, tmp_path / "s")
    assert rc == 0, err
    ssh = Path(f"/home/{user}/.ssh")
    ak = ssh / "authorized_keys"
    assert ak.read_text() == f"no-pty {typ} {ours} job-42\n"
    gid = Path(f"/home/{user}").stat().st_gid  # the user's primary group
    for p, mode in ((ssh, 0o700), (ak, 0o600)):
        st = p.stat()
        assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (mode, uid, gid)
    rc, err = run(g, tmp_path / "s")
    assert rc == 0, err
    assert ": applied" not in err, err


def test_user_made_in_the_same_graph_comes_first(tmp_path: Path, new_user: str) -> None:
    user = new_user
    typ, ours = keygen(tmp_path)
    g = write(
        tmp_path,
        f"  user:\n  - {{name: {user}, managehome: true}}\n"
        "  ssh_authorized_key:\n" + key_res("k", f"user: {user}", typ, ours),
    )
    rc, err = run(g, tmp_path / "s")
    assert rc == 0, err
    assert Path(f"/home/{user}/.ssh/authorized_keys").read_text() == f"{typ} {ours}\n"


def test_an_account_removed_by_hand_comes_back_with_its_key(
    tmp_path: Path, new_user: str, agents: Callable[..., Agent]
) -> None:
    # The key's check may run on the /etc/passwd event before the user resource
    # has re-made the account (or its home): it waits for them, it does not fail.
    user = new_user
    typ, ours = keygen(tmp_path)
    ak = Path(f"/home/{user}/.ssh/authorized_keys")
    g = write(
        tmp_path,
        f"  user:\n  - {{name: {user}, managehome: true}}\n"
        "  ssh_authorized_key:\n" + key_res("k", f"user: {user}", typ, ours),
    )

    def restored() -> bool:
        uid = passwd_uid(user)
        try:
            st, text = ak.stat(), ak.read_text()
        except FileNotFoundError:
            return False
        return uid is not None and st.st_uid == uid and text == f"{typ} {ours}\n"

    agent = agents(g, tmp_path / "s")
    agent.wait_converged()
    for _ in range(3):
        seen = agent.converged_count()
        # 12: the home could not be removed: the agent was already re-making it
        done = subprocess.run(["userdel", "-r", user], capture_output=True)
        assert done.returncode in (0, 12), done.stderr
        wait_for(restored, what="account and key back")
    agent.wait_converged(seen + 1)
    assert agent.stop() == 0, agent.log.read_text()


def test_a_missing_user_is_a_clear_failure(tmp_path: Path) -> None:
    typ, ours = keygen(tmp_path)
    user = f"egtest-{secrets.token_hex(3)}-none"
    g = write(tmp_path, "  ssh_authorized_key:\n" + key_res("k", f"user: {user}", typ, ours))
    rc, err = run(g, tmp_path / "s")
    assert rc == 1
    assert f"ssh_authorized_key[k]: no such user '{user}'" in err, err


def test_drift_is_repaired_while_an_agent_runs(
    tmp_path: Path, login: tuple[str, int], agents: Callable[..., Agent]
) -> None:
    user, uid = login
    typ, ours = keygen(tmp_path)
    line = f"no-pty {typ} {ours} me\n"
    g = write(
        tmp_path,
        "  ssh_authorized_key:\n"
        + key_res("k", f"user: {user}", typ, ours, ", comment: me, options: [no-pty]"),
    )
    ssh = Path(f"/home/{user}/.ssh")
    ak = ssh / "authorized_keys"
    agent = agents(g, tmp_path / "s")
    agent.wait_converged()
    assert ak.read_text() == line

    # ours removed by hand, and a line added that must stay through every repair
    mine = f"ssh-ed25519 {crafted()} added-by-hand\n"
    replace(ak, mine)
    wait_for(lambda: ak.read_text() == mine + line, what="removed line restored")
    assert ak.stat().st_uid == uid  # our hand edit made it root's: given back

    replace(ak, mine + f"{typ} {ours} me\n")  # options altered
    wait_for(lambda: ak.read_text() == mine + line, what="altered line repaired")

    ak.chmod(0o644)
    wait_for(lambda: stat.S_IMODE(ak.stat().st_mode) == 0o600, what="file mode repaired")
    assert ak.stat().st_uid == uid

    ssh.chmod(0o755)
    wait_for(lambda: stat.S_IMODE(ssh.stat().st_mode) == 0o700, what=".ssh mode repaired")

    # .ssh removed in one step (an rmtree races with the repair it triggers)
    gone = ssh.with_name(".ssh-gone")
    ssh.rename(gone)
    shutil.rmtree(gone)
    wait_for(lambda: ak.exists() and ak.read_text() == line, what=".ssh recreated")
    assert ak.stat().st_uid == uid
    assert agent.stop() == 0


def test_many_keys_share_one_file_without_losing_lines(tmp_path: Path) -> None:
    ak = tmp_path / "ak"
    ak.write_text("# shared\n")
    blobs = [crafted() for _ in range(24)]
    g = write(
        tmp_path,
        "  ssh_authorized_key:\n"
        + "".join(
            key_res(f"k{i}", f"file: {ak}", "ssh-ed25519", b, f", comment: c{i}")
            for i, b in enumerate(blobs)
        ),
    )
    rc, err = run(g, tmp_path / "s")
    assert rc == 0, err
    # each applied once: no write lost a sibling's line (the watch would redo it)
    assert err.count(": applied") == len(blobs), err
    lines = ak.read_text().splitlines()
    assert lines[0] == "# shared"
    assert sorted(lines[1:]) == sorted(f"ssh-ed25519 {b} c{i}" for i, b in enumerate(blobs))
    rc, err = run(g, tmp_path / "s")
    assert rc == 0, err
    assert ": applied" not in err, err


def test_absent_removes_every_copy_and_keeps_the_rest(tmp_path: Path) -> None:
    typ, ours = keygen(tmp_path)
    keep = f"# note\nssh-ed25519 {crafted()} keep\n"
    ak = tmp_path / "ak"
    ak.write_text(f"{typ} {ours} a\n{keep}no-pty {typ} {ours} b\n")
    missing = tmp_path / "none" / "ak"
    g = write(
        tmp_path,
        "  ssh_authorized_key:\n"
        + key_res("k", f"file: {ak}", typ, ours, ", state: absent")
        + key_res("m", f"file: {missing}", typ, ours, ", state: absent"),
    )
    rc, err = run(g, tmp_path / "s")
    assert rc == 0, err
    assert ak.read_text() == keep
    assert not missing.parent.exists()  # nothing to remove: nothing made
    rc, err = run(g, tmp_path / "s")
    assert rc == 0, err
    assert ": applied" not in err, err


def test_noop_changes_nothing(tmp_path: Path) -> None:
    typ, ours = keygen(tmp_path)
    ak = tmp_path / "d" / "ak"
    g = write(tmp_path, "  ssh_authorized_key:\n" + key_res("k", f"file: {ak}", typ, ours))
    rc, err = run(g, tmp_path / "s", "--noop")
    assert rc == 3, err  # something would change
    assert not ak.parent.exists()


def test_reverse_restores_the_line_as_it_was(tmp_path: Path) -> None:
    t1, k1 = keygen(tmp_path)
    t2, k2 = keygen(tmp_path)
    ak = tmp_path / "ak"
    before = f'# x\ncommand="/bin/old",no-pty {t2} {k2} old\n'
    ak.write_text(before)
    g = write(
        tmp_path,
        "  ssh_authorized_key:\n"
        + key_res("new", f"file: {ak}", t1, k1, ", meta: {reverse: true}")
        + key_res("chg", f"file: {ak}", t2, k2, ", comment: new, meta: {reverse: true}"),
    )
    rc, err = run(g, tmp_path / "s")
    assert rc == 0, err
    assert ak.read_text() == f"# x\n{t2} {k2} new\n{t1} {k1}\n"
    g.write_text("graph: keys\nresources: {}\n")
    rc, err = run(g, tmp_path / "s")
    assert rc == 0, err
    assert ak.read_text() == before


def test_symlinks_in_a_users_ssh_dir_are_refused(tmp_path: Path, login: tuple[str, int]) -> None:
    user, _ = login
    typ, ours = keygen(tmp_path)
    secret = tmp_path / "secret"
    secret.write_text("root-only\n")
    secret.chmod(0o600)
    ssh = Path(f"/home/{user}/.ssh")
    ssh.mkdir(mode=0o700)
    os.chown(ssh, *(lambda s: (s.st_uid, s.st_gid))(Path(f"/home/{user}").stat()))
    (ssh / "authorized_keys").symlink_to(secret)
    g = write(tmp_path, "  ssh_authorized_key:\n" + key_res("k", f"user: {user}", typ, ours))
    rc, err = run(g, tmp_path / "s")
    assert rc == 1
    assert "is a symlink: refusing to follow it" in err, err
    assert secret.read_text() == "root-only\n"
    assert (ssh / "authorized_keys").is_symlink()

    shutil.rmtree(ssh)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o755)
    ssh.symlink_to(elsewhere)  # the whole .ssh pointing elsewhere
    rc, err = run(g, tmp_path / "s")
    assert rc == 1
    assert "is not a directory (a symlink?)" in err, err
    assert list(elsewhere.iterdir()) == []
    st = elsewhere.stat()
    assert (stat.S_IMODE(st.st_mode), st.st_uid) == (0o755, 0)  # not chmod/chown-ed


BAD_PARAMS = [
    ("file: FILE, type: ssh-ed25519, key: 'AAAA#not!base64'", "k].key: is not valid base64"),
    ("file: FILE, type: ssh-rsa, key: ED", "k].type: is 'ssh-rsa' but the key is of type"),
    ("type: ssh-ed25519, key: ED", "k].file: is empty: give `file` (a path) or `user`"),
    ("file: FILE, user: root, type: ssh-ed25519, key: ED", "k].user: cannot be used with"),
    ("file: rel/ak, type: ssh-ed25519, key: ED", "k].file: 'rel/ak' is not an absolute"),
    ("file: FILE, type: ssh-ed2559, key: ED", "k].type: 'ssh-ed2559' is not a key type"),
    ("file: FILE, type: ssh-ed25519, key: ED, options: ['a b']", "k].options: 'a b' is not"),
    ("file: FILE, type: ssh-ed25519, key: ED, state: maybe", "k].state: Invalid enum value"),
    ("file: FILE, type: ssh-ed25519, key: AAAAC3NzaC1lZDI1NTE5", "k].key: is not an ssh-ed"),
]


@pytest.mark.parametrize(("params", "needle"), BAD_PARAMS)
def test_bad_parameters_are_load_errors_and_change_nothing(
    tmp_path: Path, params: str, needle: str
) -> None:
    first = (params, needle) == BAD_PARAMS[0]
    ak = tmp_path / "ak"
    ok = tmp_path / "ok"
    params = params.replace("FILE", str(ak)).replace("ED", crafted())
    g = write(
        tmp_path,
        f"  ssh_authorized_key:\n  - {{name: k, {params}}}\n"
        + key_res("fine", f"file: {ok}", "ssh-ed25519", crafted()),
    )
    err = graph_error(g)  # as `evergraph check` loads it, in process
    assert f"ssh_authorized_key[{needle}" in err, err
    assert f"{g}:4:" in err, err
    if not first:
        return  # one of them end to end: exit 2, nothing changed
    rc, err = run(g, tmp_path / "s")
    assert rc == 2, err
    assert f"ssh_authorized_key[{needle}" in err, err
    assert f"{g}:4:" in err, err
    assert not ak.exists()
    assert not ok.exists()
