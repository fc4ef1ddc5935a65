"""Local users and groups for the tests of the user and group kinds: the
/etc/passwd and /etc/group entries read directly (as the resources read them),
and `Accounts`, unique names and free ids whose users and groups are removed
when the test ends (the `accounts` fixture checks none is left behind)."""

from __future__ import annotations

import random
import secrets
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


def passwd(name: str) -> list[str] | None:
    """The /etc/passwd fields of `name` (read directly, as the resource does)."""
    for line in Path("/etc/passwd").read_text().splitlines():
        fields = line.split(":")
        if fields[0] == name:
            return fields
    return None


def group(name: str) -> list[str] | None:
    for line in Path("/etc/group").read_text().splitlines():
        fields = line.split(":")
        if fields[0] == name:
            return fields
    return None


def members(name: str) -> set[str]:
    g = group(name)
    return set(filter(None, g[3].split(","))) if g else set()


class Accounts:
    """Unique test names and free ids; removes what it named at the end."""

    def __init__(self) -> None:
        self.tag = secrets.token_hex(3)
        self.users: list[str] = []
        self.groups: list[str] = []

    def user(self, stem: str) -> str:
        name = f"egtest-{self.tag}-{stem}"
        self.users.append(name)
        return name

    def group(self, stem: str) -> str:
        name = f"egtest-{self.tag}-{stem}"
        self.groups.append(name)
        return name

    @staticmethod
    def ids(n: int) -> list[int]:
        """n consecutive ids free as uid and gid (below 65534, where lastlog stays small)."""
        used = {int(f.split(":")[2]) for f in Path("/etc/passwd").read_text().splitlines() if f}
        used |= {int(f.split(":")[2]) for f in Path("/etc/group").read_text().splitlines() if f}
        while True:
            base = random.randrange(61000, 65000 - n)
            if not used & set(range(base, base + n)):
                return list(range(base, base + n))

    def cleanup(self) -> None:
        for u in self.users:
            if passwd(u) is not None:
                subprocess.run(["userdel", "-r", u], capture_output=True)
        # user groups made by useradd go with userdel; anything left goes here
        for g in [*self.groups, *self.users]:
            if group(g) is not None:
                subprocess.run(["groupdel", g], capture_output=True)


@pytest.fixture
def accounts() -> Iterator[Accounts]:
    """An `Accounts` for the test; fails it if any of its users or groups is left."""
    acc = Accounts()
    try:
        yield acc
    finally:
        acc.cleanup()
        left = [n for n in acc.users if passwd(n)] + [n for n in acc.groups if group(n)]
        assert not left, f"test accounts left behind: {left}"
