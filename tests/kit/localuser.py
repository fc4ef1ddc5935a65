"""A real unprivileged local user for the tests that play one (the HTTP API's
parameters, a symlink race in a managed tree): made with useradd, removed
with userdel when the test ends."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

#: the system's Python (readable by everyone, unlike the test venv's under /root)
SYSTEM_PYTHON = "/usr/bin/python3"


def needs_root() -> pytest.MarkDecorator:
    return pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("useradd") is None or shutil.which("runuser") is None,
        reason="needs root, useradd and runuser",
    )


@contextlib.contextmanager
def local_user() -> Iterator[str]:
    """The name of a new unprivileged user (no home, no login shell)."""
    name = "egt" + secrets.token_hex(4)
    subprocess.run(
        ["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
        check=True,
        capture_output=True,
    )
    try:
        yield name
    finally:
        subprocess.run(["userdel", name], capture_output=True)


def as_user(name: str, *cmd: str | Path) -> list[str]:
    """`cmd` run as user `name` (no shell, no environment of ours)."""
    return ["runuser", "-u", name, "--", *map(str, cmd)]


@contextlib.contextmanager
def shared_dir() -> Iterator[Path]:
    """A fresh directory every user can reach (pytest's tmp_path is root's alone)."""
    d = Path(tempfile.mkdtemp(prefix="evergraph-local-"))
    d.chmod(0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)
