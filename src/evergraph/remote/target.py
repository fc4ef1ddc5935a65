"""A host named on `evergraph remote`'s command line: ``[user@]host[:port]``.

Parsed once, before anything connects, so a typo is bad input (exit 2) and not a
host that "could not be reached".
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from evergraph.errors import InputError

# a DNS name or IPv4 address, or an IPv6 address in brackets ([::1]:2222)
_HOST = re.compile(r"(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<name>[A-Za-z0-9][A-Za-z0-9.-]*))")
_USER = re.compile(r"[A-Za-z_][A-Za-z0-9._-]*")


@dataclass(frozen=True)
class Target:
    """Where to connect: a host, its SSH port and the user (None: the local user)."""

    host: str
    port: int = 22
    user: str | None = None

    @property
    def label(self) -> str:
        """How the host is named in output (``host`` or ``host:port``)."""
        return self.host if self.port == 22 else f"{self.host}:{self.port}"

    @classmethod
    def parse(cls, text: str) -> Target:
        """``[user@]host[:port]``; InputError naming the argument otherwise."""
        user: str | None = None
        rest = text
        if "@" in rest:
            user, _, rest = rest.rpartition("@")
            if not _USER.fullmatch(user):
                raise InputError(f"{user!r} is not a user name", f"host {text!r}")
        port = 22
        m = _HOST.match(rest)
        if m is None:
            raise InputError("expected [user@]host[:port]", f"host {text!r}")
        host = m.group("v6") or m.group("name")
        tail = rest[m.end() :]
        if tail:
            if not tail.startswith(":") or not tail[1:].isdigit():
                raise InputError("expected [user@]host[:port]", f"host {text!r}")
            port = int(tail[1:])
            if not 1 <= port <= 65535:
                raise InputError(f"port {port} is not in 1-65535", f"host {text!r}")
        return cls(host.lower(), port, user)
