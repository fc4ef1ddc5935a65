"""user and group: real accounts made by shadow-utils, drift repaired, bad input refused.

Every account is named `egtest-<random>-…` with ids from a free high range,
and removed in a finalizer (userdel -r, groupdel) whatever the outcome.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import Agent, run_cli, wait_for
from tests.kit.accounts import Accounts, group, members, passwd
from tests.kit.machine import MACHINE_WIDE

pytestmark = MACHINE_WIDE


def write(tmp_path: Path, body: str, name: str = "g.yaml") -> Path:
    g = tmp_path / name
    g.write_text("graph: users\nresources:\n" + body)
    return g


def run(g: Path, state: Path, *extra: str) -> tuple[int, str]:
    r = run_cli("run", g, "--state-dir", state, "--converged-exit", *extra)
    return r.returncode, r.stderr


def graph_body(acc: Accounts) -> tuple[str, str, str, str, int, int]:
    user, g1, g2 = acc.user("u"), acc.group("g1"), acc.group("g2")
    uid, gid1, gid2 = acc.ids(3)
    body = (
        "  user:\n"
        f"  - {{name: {user}, uid: {uid}, gid: {g1}, groups: [{g2}],"
        f" home: /home/{user}, shell: /bin/bash, managehome: true}}\n"
        "  group:\n"
        f"  - {{name: {g1}, gid: {gid1}}}\n"
        f"  - {{name: {g2}, gid: {gid2}}}\n"
    )
    return body, user, g1, g2, uid, gid1


def test_apply_from_scratch_orders_groups_first_and_second_run_is_clean(
    tmp_path: Path, accounts: Accounts
) -> None:
    body, user, g1, g2, uid, gid1 = graph_body(accounts)
    g = write(tmp_path, body)
    # the user wants its primary and supplementary groups: automatic edges
    r = run_cli("graph", g, "--format", "json")
    assert r.returncode == 0, r.stderr
    edges = {(e["from"], e["to"]) for e in json.loads(r.stdout)["edges"] if e["auto"]}
    assert edges == {(f"group[{g1}]", f"user[{user}]"), (f"group[{g2}]", f"user[{user}]")}

    rc, err = run(g, tmp_path / "s")
    assert rc == 0, err
    pw = passwd(user)
    assert pw is not None
    assert pw[2:] == [str(uid), str(gid1), "", f"/home/{user}", "/bin/bash"]
    assert members(g2) == {user}
    assert Path(f"/home/{user}").is_dir()  # managehome
    # useradd -g would have failed had the group not been made first
    lines = err.splitlines()
    order = [
        next(i for i, ln in enumerate(lines) if f"{x}: applied" in ln)
        for x in (f"group[{g1}]", f"user[{user}]")
    ]
    assert order == sorted(order), err

    rc, err = run(g, tmp_path / "s")
    assert rc == 0, err
    assert ": applied" not in err, err


def test_drift_is_repaired_while_an_agent_runs(
    tmp_path: Path, accounts: Accounts, agents: Callable[..., Agent]
) -> None:
    body, user, g1, g2, uid, gid1 = graph_body(accounts)
    agent = agents(write(tmp_path, body), tmp_path / "s")
    agent.wait_converged()
    assert passwd(user) is not None

    subprocess.run(["usermod", "-s", "/bin/sh", user], check=True)
    wait_for(lambda: passwd(user)[6] == "/bin/bash", what="shell repaired")  # type: ignore[index]

    subprocess.run(["gpasswd", "-d", user, g2], check=True, capture_output=True)
    wait_for(lambda: members(g2) == {user}, what="supplementary group repaired")

    # a deleted group comes back, and the user is put back in it
    subprocess.run(["groupdel", g2], check=True)
    wait_for(lambda: members(g2) == {user}, what="group recreated with its member")

    # groupmod renumbers the group (and the primary gid of its users): both come back
    subprocess.run(["groupmod", "-g", str(accounts.ids(1)[0]), g1], check=True)
    wait_for(
        lambda: group(g1)[2] == passwd(user)[3] == str(gid1),  # type: ignore[index]
        what="group gid and primary gid repaired",
    )

    # managehome: a home removed by hand (in one step) is made again from /etc/skel
    home = Path(f"/home/{user}")
    gone = home.with_name(home.name + ".gone")
    home.rename(gone)
    shutil.rmtree(gone)
    wait_for(lambda: home.is_dir() and home.stat().st_uid == uid, what="home recreated")
    st = home.stat()
    assert (st.st_uid, st.st_gid) == (uid, gid1)
    skel = sorted(p.name for p in Path("/etc/skel").iterdir())
    assert sorted(p.name for p in home.iterdir()) == skel
    assert all(p.lstat().st_uid == uid for p in home.iterdir())

    seen = agent.converged_count()
    subprocess.run(["userdel", user], check=True, capture_output=True)
    wait_for(lambda: passwd(user) is not None, what="deleted user recreated")
    assert passwd(user)[2] == str(uid)  # type: ignore[index]
    agent.wait_converged(seen + 1)
    assert agent.stop() == 0, agent.log.read_text()


def test_a_group_named_like_the_user_becomes_its_primary_group(
    tmp_path: Path, accounts: Accounts
) -> None:
    user = accounts.user("p")
    (gid,) = accounts.ids(1)
    g = write(
        tmp_path, f"  user:\n  - {{name: {user}}}\n  group:\n  - {{name: {user}, gid: {gid}}}\n"
    )
    rc, err = run(g, tmp_path / "s")
    assert rc == 0, err
    assert passwd(user)[3] == str(gid)  # type: ignore[index]


@pytest.mark.slow  # the failure case waits out the grace time
def test_a_group_that_appears_a_moment_later_is_waited_for(
    tmp_path: Path, accounts: Accounts
) -> None:
    # As when a group resource re-makes a group while the user already runs on
    # an older event: the user waits for /etc/group a moment instead of failing.
    user, grp, never = accounts.user("w"), accounts.group("w2"), accounts.group("nx")
    (gid,) = accounts.ids(1)
    pidfile = tmp_path / "later.pid"
    later = f"(sleep 0.3; groupadd -g {gid} {grp}) >/dev/null 2>&1 & echo $! > {pidfile}"
    g = write(
        tmp_path,
        f'  exec:\n  - {{name: later, shell: /bin/sh, cmd: "{later}"}}\n'
        f"  user:\n  - {{name: {user}, gid: {grp}}}\n"
        "edges:\n- {from: {kind: exec, name: later}, to: {kind: user, name: " + user + "}}\n",
    )
    try:
        rc, err = run(g, tmp_path / "s")
    finally:
        # the background groupadd must be over before the clean-up runs
        if pidfile.exists():
            pid = int(pidfile.read_text())
            wait_for(lambda: not Path(f"/proc/{pid}").exists(), what="background groupadd")
    assert rc == 0, err
    assert passwd(user)[3] == str(gid)  # type: ignore[index]

    # one that never comes is a clear failure (after the grace time)
    g = write(tmp_path, f"  user:\n  - {{name: {user}, groups: [{never}]}}\n", "g2.yaml")
    rc, err = run(g, tmp_path / "s2")
    assert rc == 1, err
    assert f"user[{user}]: group '{never}' in groups does not exist" in err, err
    assert members(never) == set()


def test_absent_removes_and_is_then_clean(tmp_path: Path, accounts: Accounts) -> None:
    user, grp = accounts.user("x"), accounts.group("y")
    subprocess.run(["groupadd", grp], check=True)
    subprocess.run(["useradd", "-M", user], check=True)
    g = write(
        tmp_path,
        f"  user:\n  - {{name: {user}, state: absent}}\n"
        f"  group:\n  - {{name: {grp}, state: absent}}\n",
    )
    rc, err = run(g, tmp_path / "s")
    assert rc == 0, err
    assert passwd(user) is None
    assert group(grp) is None
    rc, err = run(g, tmp_path / "s")
    assert rc == 0, err
    assert ": applied" not in err, err


def test_noop_reports_and_changes_nothing(tmp_path: Path, accounts: Accounts) -> None:
    body, user, g1, g2, _, _ = graph_body(accounts)
    r = run_cli(
        "run", write(tmp_path, body), "--state-dir", tmp_path / "s", "--noop", "--converged-exit"
    )
    assert r.returncode == 3, r.stderr  # something would change
    assert f"user[{user}]: would change (noop)" in r.stderr, r.stderr
    assert passwd(user) is None
    assert group(g1) is None
    assert group(g2) is None


def test_reverse_undoes_what_was_made_when_it_leaves_the_graph(
    tmp_path: Path, accounts: Accounts
) -> None:
    user, grp, new = accounts.user("r"), accounts.group("s"), accounts.group("t")
    gid, gid2 = accounts.ids(2)
    subprocess.run(["groupadd", "-g", str(gid), grp], check=True)  # existed before: kept
    g = write(
        tmp_path,
        f"  user:\n  - {{name: {user}, shell: /bin/sh, meta: {{reverse: true}}}}\n"
        f"  group:\n  - {{name: {grp}, gid: {gid2}, meta: {{reverse: true}}}}\n"
        f"  - {{name: {new}, meta: {{reverse: true}}}}\n",
    )
    rc, err = run(g, tmp_path / "s")
    assert rc == 0, err
    assert passwd(user) is not None
    assert (group(grp) or [])[2:3] == [str(gid2)]
    assert group(new) is not None
    g.write_text("graph: users\nresources: {}\n")
    rc, err = run(g, tmp_path / "s")
    assert rc == 0, err
    assert f"user[{user}]: left the graph: reversed" in err, err
    assert passwd(user) is None
    assert (group(grp) or [])[2:3] == [str(gid)]  # its gid as it was
    assert group(new) is None


@pytest.mark.parametrize(
    ("resource", "needle"),
    [
        ("  user:\n  - {name: NAME, uid: -5}\n", "user[NAME].uid: -5 is not between 0 and"),
        ("  user:\n  - {name: NAME, state: maybe}\n", "user[NAME].state: Invalid enum value"),
        ("  user:\n  - {name: NAME, shell: bash}\n", "user[NAME].shell: 'bash' is not an absolute"),
        ("  user:\n  - {name: NAME, groups: ['a b']}\n", "user[NAME].groups: 'a b' is not a valid"),
        ("  user:\n  - {name: NAME, gid: 4294967295}\n", "user[NAME].gid: 4294967295 is not"),
        ("  user:\n  - {name: NAME, home: '/x:y'}\n", "user[NAME].home: '/x:y' contains `:`"),
        ("  group:\n  - {name: NAME, gid: -1}\n", "group[NAME].gid: -1 is not between"),
        ("  group:\n  - {name: '123'}\n", "group[123].name: '123' is not a valid name"),
    ],
)
def test_bad_parameters_are_load_errors_and_change_nothing(
    tmp_path: Path, accounts: Accounts, resource: str, needle: str
) -> None:
    name, other = accounts.user("bad"), accounts.group("ok")
    # a valid group in the same graph must not be made either
    body = resource.replace("NAME", name)
    if "  group:" in body:
        body = body.replace("  group:\n", f"  group:\n  - {{name: {other}}}\n")
    else:
        body += f"  group:\n  - {{name: {other}}}\n"
    g = write(tmp_path, body)
    rc, err = run(g, tmp_path / "s")
    assert rc == 2, err
    assert needle.replace("NAME", name) in err, err
    assert f"{g}:" in err
    assert passwd(name) is None
    assert group(other) is None
    assert group(name) is None
