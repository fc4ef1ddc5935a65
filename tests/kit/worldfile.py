"""Reads of a sqlite World file straight from the disk, as any process may read
it: what the tests of agents check the World's content with."""

from __future__ import annotations

import contextlib
import json
import sqlite3
from pathlib import Path
from typing import Any


def query(db: Path, sql: str, *args: object) -> list[tuple[Any, ...]]:
    """Rows of a read of the sqlite World file, as any process may read it."""
    with contextlib.closing(sqlite3.connect(db)) as c:
        return c.execute(sql, args).fetchall()


def record(db: Path, key: str) -> tuple[bytes, int] | None:
    """(value, lease) of `key` in the sqlite World, or None."""
    rows = query(db, "SELECT value, lease FROM kv WHERE key = ?", key)
    return (bytes(rows[0][0]), int(rows[0][1])) if rows else None


def member(db: Path, host: str) -> dict[str, Any] | None:
    """The membership record of `host`, decoded, or None."""
    got = record(db, f"members/{host}")
    return json.loads(got[0]) if got is not None else None


def revision(db: Path) -> int:
    """The sqlite World's current revision."""
    return int(query(db, "SELECT v FROM meta WHERE k = 'revision'")[0][0])


def deletions(db: Path, key: str, after: int) -> int:
    """Delete events of `key` in the World's history after revision `after`
    (expiry of a lease, withdrawal: every deletion is one)."""
    sql = "SELECT COUNT(*) FROM log WHERE key = ? AND type = 1 AND rev > ?"
    return int(query(db, sql, key, after)[0][0])
