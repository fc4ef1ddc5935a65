"""Farm API tokens: printed once, stored only as a hash, looked up, revoked."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

from evergraph.cluster.hostkeys import HostKeys
from evergraph.farm import tokens
from evergraph.farm.signed import FarmTrust
from evergraph.world.sqlite import SQLiteKV
from tests.conftest import run_cli


def test_token_create_list_lookup_revoke(tmp_path: Path) -> None:
    s = tmp_path / "s"
    r = run_cli("farm", "token", "create", "alice", "--group", "lab", "--state-dir", s)
    assert r.returncode == 0, r.stderr
    token = r.stdout.strip()
    assert token.startswith("egt_")
    assert len(token) > 40
    # the World holds its hash, never the token
    with sqlite3.connect(s / "world.sqlite") as c:
        rows = [bytes(v) for (v,) in c.execute("SELECT value FROM kv")]
        keys = [k for (k,) in c.execute("SELECT key FROM kv")]
    assert not any(token.encode() in v for v in rows)
    assert not any(token in k for k in keys)

    async def find(t: str) -> tokens.User | None:
        kv = SQLiteKV(s / "world.sqlite")
        try:
            # the API server of this state dir: it trusts its own key
            return await tokens.lookup(kv, t, FarmTrust(HostKeys(s), "srv"))
        finally:
            await kv.close()

    user = asyncio.run(find(token))
    assert user is not None
    assert (user.name, user.groups, user.admin) == ("alice", ["lab"], False)
    assert asyncio.run(find(token + "x")) is None
    assert asyncio.run(find("not-a-token")) is None
    r = run_cli("farm", "token", "list", "--state-dir", s)
    assert r.returncode == 0, r.stderr
    [line] = r.stdout.splitlines()
    prefix, name, groups, admin = line.split("\t")
    assert (name, groups, admin) == ("alice", "lab", "-")
    assert token not in r.stdout
    r = run_cli("farm", "token", "revoke", prefix, "--state-dir", s)
    assert r.returncode == 0, r.stderr
    assert asyncio.run(find(token)) is None
    r = run_cli("farm", "token", "revoke", prefix, "--state-dir", s)
    assert r.returncode == 1


def test_bad_token_names_are_refused_and_nothing_is_created(tmp_path: Path) -> None:
    for args in (["a b"], ["alice", "--group", "x/y"], [""]):
        r = run_cli("farm", "token", "create", *args, "--state-dir", tmp_path / "s")
        assert r.returncode == 2
        assert r.stderr.count("\n") == 1
    assert not (tmp_path / "s").exists()
    r = run_cli("farm", "token", "revoke", "abc", "--state-dir", tmp_path / "s")
    assert r.returncode == 2
