"""A host named on `evergraph remote`'s command line, ``[user@]host[:port]``, or
in its inventory (remote/inventory.py), which may add a key and a hostname.

Parsed once, before anything connects, so a typo is bad input (exit 2) and not a
host that "could not be reached".
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from evergraph.errors import InputError

# a DNS name or IPv4 address, or an IPv6 address in brackets ([::1]:2222)
_HOST = re.compile(r"(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<name>[A-Za-z0-9][A-Za-z0-9.-]*))")
_USER = re.compile(r"[A-Za-z_][A-Za-z0-9._-]*")


@dataclass(frozen=True)
class Target:
    """Where to connect: a host, its SSH port and the user (None: the local user);
    from an inventory also a private key tried first for this host, and the
    hostname its agent runs with (None: `host`)."""

    host: str
    port: int = 22
    user: str | None = None
    key: Path | None = None
    hostname: str | None = None

    @property
    def agent_hostname(self) -> str:
        """What the host's agent is run with as `--hostname`."""
        return self.hostname or self.host

    @property
    def label(self) -> str:
        """How the host is named in output: its inventory hostname, else ``host``
        or ``host:port``."""
        if self.hostname:
            return self.hostname
        return self.host if self.port == 22 else f"{self.host}:{self.port}"

    @classmethod
    def parse(cls, text: str) -> Target:
        """``[user@]host[:port]``; InputError naming the argument otherwise."""
        user, host, port = parse_address(text, f"host {text!r}")
        return cls(host, port, user)


def parse_address(text: str, where: str) -> tuple[str | None, str, int]:
    """(user or None, host in lower case, port) of ``[user@]host[:port]``;
    InputError naming `where` otherwise."""
    user: str | None = None
    rest = text
    if "@" in rest:
        user, _, rest = rest.rpartition("@")
        if not _USER.fullmatch(user):
            raise InputError(f"{user!r} is not a user name", where)
    port = 22
    m = _HOST.match(rest)
    if m is None:
        raise InputError("expected [user@]host[:port]", where)
    host = m.group("v6") or m.group("name")
    tail = rest[m.end() :]
    if tail:
        if not tail.startswith(":") or not tail[1:].isdigit():
            raise InputError("expected [user@]host[:port]", where)
        port = int(tail[1:])
        if not 1 <= port <= 65535:
            raise InputError(f"port {port} is not in 1-65535", where)
    return user, host.lower(), port


def parse_host(text: str, where: str) -> str:
    """A host alone (a DNS name, an IPv4 address, an IPv6 one with or without
    brackets), in lower case; InputError naming `where` otherwise."""
    m = _HOST.fullmatch(text) or _HOST.fullmatch(f"[{text}]")
    if m is None:
        raise InputError(f"{text!r} is not a host name or address", where)
    return (m.group("v6") or m.group("name")).lower()


def user_problem(text: str) -> str | None:
    """Why `text` is not a user name, or None."""
    return None if _USER.fullmatch(text) else f"{text!r} is not a user name"
