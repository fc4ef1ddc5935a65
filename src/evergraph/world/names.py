"""Names the World is keyed by. A hostname becomes part of keys (`members/<host>`,
`exported/<to>/<from>/...`), so it may not hold `/` or anything that would let
one host's records pass for another's."""

from __future__ import annotations

import re

_HOSTNAME = re.compile(r"[a-z0-9][a-z0-9.-]*")


def hostname_problem(name: str) -> str | None:
    """Why `name` cannot be a hostname in the World, or None."""
    if not _HOSTNAME.fullmatch(name) or len(name) > 253:
        return (
            f"{name!r} is not a valid hostname: lower-case letters, digits, '.' and '-', "
            "starting with a letter or digit"
        )
    return None
