"""What the tests of packages share: the version dpkg has installed."""

from __future__ import annotations

import subprocess


def installed(pkg: str) -> str | None:
    """The installed version of pkg, None if not (fully) installed."""
    r = subprocess.run(
        ["dpkg-query", "-W", "-f=${db:Status-Abbrev}\t${Version}", pkg],
        capture_output=True,
        text=True,
    )
    status, _, version = r.stdout.partition("\t")
    return version if r.returncode == 0 and status[1:2] == "i" else None
