"""Debian packages for the pkg kind: names, versions, and the apt/dpkg backend.

Checks ask dpkg directly (`dpkg-query -W`, one call for any number of
packages, ~13 ms for 100) and, for `newest` only, apt's candidate
(`apt-cache policy`). Changes run `apt-get` non-interactively, one command for
all packages that need the same change, so a group of packages is one apt
transaction (one entry in /var/log/apt/history.log).
"""

from __future__ import annotations

import asyncio
import glob
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from evergraph.errors import ResourceError
from evergraph.resources import _proc

#: dpkg's database of installed packages; dpkg replaces it by rename after changes
STATUS = "/var/lib/dpkg/status"
INFO_DIR = "/var/lib/dpkg/info"

# Debian policy §5.6.1: lower case letters, digits, + - . ; at least two
# characters, starting with an alphanumeric. `:arch` selects an architecture.
_NAME = re.compile(r"[a-z0-9][a-z0-9+.-]+(?::[a-z0-9][a-z0-9-]*)?")
# Debian policy §5.6.12: [epoch:]upstream[-revision]; upstream starts with a digit.
_VERSION = re.compile(r"(?:[0-9]+:)?[0-9][A-Za-z0-9.+~]*(?:-[A-Za-z0-9.+~-]*[A-Za-z0-9.+~])?")


def name_problem(name: str) -> str | None:
    """Why `name` is not a Debian package name (None: it is one)."""
    if not name:
        return "is empty: say which package"
    if not _NAME.fullmatch(name):
        return (
            f"{name!r} is not a package name (lower case letters, digits, '+', '-', '.';"
            " optionally ':arch')"
        )
    return None


def is_version(text: str) -> bool:
    return _VERSION.fullmatch(text) is not None


# -- version comparison (dpkg's algorithm, for backends that only list versions) --


def _order(c: str) -> int:
    if c == "~":
        return -1  # sorts before everything, even the end of the string
    if "a" <= c.lower() <= "z":
        return ord(c)
    return ord(c) + 256


def _compare_part(a: str, b: str) -> int:
    """dpkg's verrevcmp: alternate non-digit runs (by `_order`) and numbers."""
    i = j = 0
    digits = "0123456789"
    while i < len(a) or j < len(b):
        while (i < len(a) and a[i] not in digits) or (j < len(b) and b[j] not in digits):
            ac = _order(a[i]) if i < len(a) and a[i] not in digits else 0
            bc = _order(b[j]) if j < len(b) and b[j] not in digits else 0
            if ac != bc:
                return ac - bc
            i += 1
            j += 1
        start_i = i
        while i < len(a) and a[i] in digits:
            i += 1
        start_j = j
        while j < len(b) and b[j] in digits:
            j += 1
        na = int(a[start_i:i] or "0")
        nb = int(b[start_j:j] or "0")
        if na != nb:
            return -1 if na < nb else 1
    return 0


def compare_versions(a: str, b: str) -> int:
    """<0, 0, >0 as Debian version `a` sorts before, equal to, after `b`."""

    def split(v: str) -> tuple[int, str, str]:
        epoch, sep, rest = v.partition(":")
        if not sep:
            epoch, rest = "0", v
        upstream, dash, revision = rest.rpartition("-")
        if not dash:
            upstream, revision = rest, ""
        return int(epoch or "0"), upstream, revision

    ea, ua, ra = split(a)
    eb, ub, rb = split(b)
    if ea != eb:
        return -1 if ea < eb else 1
    return _compare_part(ua, ub) or _compare_part(ra, rb)


# -- what is installed ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Found:
    """A package as the backend sees it."""

    installed: str | None  # installed version; None: not (fully) installed
    candidate: str | None = None  # version an install/upgrade would bring; None: unknown


def base_name(name: str) -> str:
    return name.partition(":")[0]


async def query(names: Sequence[str], candidates: bool) -> dict[str, Found]:
    """Installed versions of `names` (one dpkg-query), and apt's candidates if asked."""
    done = await _run(
        [
            "dpkg-query",
            "-W",
            "-f=${Package}\t${Architecture}\t${db:Status-Abbrev}\t${Version}\n",
            "--",
            *names,
        ]
    )
    # exit 1 with "no packages found matching X" is the normal answer for a
    # package dpkg never heard of; anything else on stderr is a real failure
    if done.returncode not in (0, 1) or (
        done.returncode == 1 and "no packages found matching" not in done.stderr
    ):
        raise ResourceError(f"dpkg-query failed: {_tail(done)}")
    rows: dict[str, list[tuple[str, str, str]]] = {}
    for line in done.stdout.splitlines():
        parts = line.split("\t")
        if len(parts) == 4:
            pkg, arch, status, version = parts
            rows.setdefault(pkg, []).append((arch, status, version))
    cand = await policy_candidates(names) if candidates else {}
    found: dict[str, Found] = {}
    for name in names:
        base, _, want_arch = name.partition(":")
        installed = None
        for arch, status, version in rows.get(base, ()):
            # second letter of the abbreviated status: 'i' = fully installed
            # ('c' config-files only, 'U' unpacked, 'F' half-configured, ...)
            if len(status) >= 2 and status[1] == "i" and (not want_arch or arch == want_arch):
                installed = version
                break
        found[name] = Found(installed, cand.get(name))
    return found


async def policy_candidates(names: Sequence[str]) -> dict[str, str | None]:
    """apt's candidate version per name (one `apt-cache policy`); absent: apt knows none."""
    done = await _run(["apt-cache", "policy", "--", *names])
    if done.returncode != 0:
        raise ResourceError(f"apt-cache policy failed: {_tail(done)}")
    by_header: dict[str, str | None] = {}
    current = ""
    for line in done.stdout.splitlines():
        if line and not line[0].isspace() and line.endswith(":"):
            current = line[:-1]
        elif current and line.strip().startswith("Candidate:"):
            value = line.split(":", 1)[1].strip()
            by_header[current] = None if value == "(none)" else value
    out: dict[str, str | None] = {}
    for name in names:
        # apt prints `libc6:` for `libc6:amd64` on the native architecture
        for key in (name, base_name(name)):
            if key in by_header:
                out[name] = by_header[key]
                break
    return out


# -- changes -------------------------------------------------------------------

LOCK_TIMEOUT = 120


def apt_argv(
    action: str, specs: Iterable[str], allowuntrusted: bool, downgrades: bool = False
) -> list[str]:
    argv = [
        "apt-get",
        action,
        "-y",
        "-q",
        "-o",
        f"DPkg::Lock::Timeout={LOCK_TIMEOUT}",
        # keep the admin's edited config files, never ask
        "-o",
        "Dpkg::Options::=--force-confdef",
        "-o",
        "Dpkg::Options::=--force-confold",
    ]
    if allowuntrusted:
        argv.append("--allow-unauthenticated")
    if downgrades:
        argv.append("--allow-downgrades")
    argv.append("--")
    argv.extend(specs)
    return argv


_SUMMARY = re.compile(r"^\d+ upgraded, .*$", re.MULTILINE)


async def apt_get(argv: list[str], lock: asyncio.Lock) -> str:
    """Run one apt-get command; its summary line, or ResourceError with apt's last words.
    dpkg takes one lock per machine: our own changes queue on `lock` (the agent's)
    instead of failing on it; other writers are waited for by apt (DPkg::Lock::Timeout)."""
    env = dict(os.environ)
    env.update(DEBIAN_FRONTEND="noninteractive", APT_LISTCHANGES_FRONTEND="none")
    async with lock:
        done = await _run(argv, _proc.RunAs(env=env))
    shown = " ".join(a for a in argv if not a.startswith(("-", "DPkg::", "Dpkg::")))
    if done.returncode != 0:
        raise ResourceError(f"{shown} failed (exit {done.returncode}): {_tail(done)}")
    m = _SUMMARY.search(done.stdout)
    return f"{shown}: {m.group(0).rstrip('.') if m else 'done'}"


def _tail(done: _proc.Completed, lines: int = 3) -> str:
    text = done.stderr.strip() or done.stdout.strip()
    # apt's warnings about its unstable CLI are noise, not the reason
    kept = [ln for ln in text.splitlines() if "does not have a stable CLI" not in ln and ln]
    return " | ".join(kept[-lines:]) or "no output"


async def _run(argv: list[str], how: _proc.RunAs | None = None) -> _proc.Completed:
    try:
        return await _proc.run(argv, how or _proc.RunAs())
    except FileNotFoundError:
        raise ResourceError(f"{argv[0]} not found: is this a Debian system?") from None


# -- files of a package (for automatic edges) -------------------------------------

#: package name -> (dpkg status file mtime when read, its non-directory paths)
_files_cache: dict[str, tuple[int, tuple[str, ...]]] = {}


def installed_files(name: str) -> tuple[str, ...]:
    """Paths of the non-directory entries `dpkg -L name` lists; () when not installed.

    Reads dpkg's own list file (what `dpkg -L` prints, without a process per
    package), cached until the dpkg database changes.
    """
    try:
        stamp = os.stat(STATUS).st_mtime_ns
    except OSError:
        return ()
    cached = _files_cache.get(name)
    if cached is not None and cached[0] == stamp:
        return cached[1]
    entries: list[str] = []
    candidates = [f"{INFO_DIR}/{name}.list"]
    if ":" not in name:  # a Multi-Arch: same package keeps NAME:ARCH.list
        candidates.extend(sorted(glob.glob(f"{INFO_DIR}/{glob.escape(name)}:*.list")))
    for path in candidates:
        try:
            with open(path, encoding="utf-8", errors="surrogateescape") as f:
                entries = [ln.rstrip("\n") for ln in f if ln.strip() and ln != "/.\n"]
            break
        except FileNotFoundError:
            continue
        except OSError:
            break
    # a listed path that is the parent of another listed path is a directory
    parents = {p.rpartition("/")[0] for p in entries}
    files = tuple(p for p in entries if p not in parents)
    _files_cache[name] = (stamp, files)
    return files
