"""One spelling of "what: the OS's reason" for a failed system call."""

from __future__ import annotations

from evergraph.errors import ResourceError


def os_error(where: str, e: OSError) -> ResourceError:
    """`ResourceError("<where>: <strerror>")` for `e` (its text where it has no
    strerror); `where` is the path, or what was being done to it. Raise it
    `from None`: the message says all a user needs."""
    return ResourceError(f"{where}: {e.strerror or e}")
