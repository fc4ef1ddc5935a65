"""What the tests of secrets share: the password an agent generated, read back."""

from __future__ import annotations

from pathlib import Path

from evergraph.cluster.hostkeys import HostKeys


def password_of(state: Path, name: str = "p") -> str:
    """The password `password[name]` generated, opened with the agent's host key."""
    sealed = state / "vertices" / "password" / name / "password.sealed"
    return HostKeys(state).open_local(sealed.read_bytes()).decode()
