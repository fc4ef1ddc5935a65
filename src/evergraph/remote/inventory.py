"""`evergraph remote --inventory FILE`: the hosts of a run read from a file, checked
whole before anything connects (an error is one line `FILE:LINE: ...`, exit 2).

Two forms, told apart by the first line with content:

* **plain**: one host per line, ``[user@]host[:port]``; ``#`` starts a comment,
  blank lines are skipped.
* **YAML**: a first line ``hosts:`` (a mapping at the top level). ``hosts`` maps
  each host's name to its fields, all optional:

      hosts:
        web1:                 # the name: the agent's hostname, and the address
          host: 10.0.0.5      #   unless `host` is given
          user: root          # [default: the local user]
          port: 2222          # [default: 22]
          key: ~/.ssh/deploy  # tried before --ssh-key (relative: to FILE's directory)
          hostname: web1.lan  # the agent's --hostname [default: the name]
        db:                   # nothing but the name

Two entries may not reach the same host and port, nor give their agents the same
hostname (both would write the same World keys).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from evergraph.errors import InputError
from evergraph.remote.target import Target, parse_address, parse_host, user_problem

#: a YAML inventory's first line with content: a mapping key
_MAPPING = re.compile(r"[^\s#'\"-][^#]*?:(?:\s|$)")
#: an agent's hostname: a DNS name (it names World keys and files of graphs)
_HOSTNAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,252})")
#: the fields of a YAML entry
FIELDS = ("host", "user", "port", "key", "hostname")


def read_inventory(path: Path) -> list[Target]:
    """The hosts in the inventory at `path`, in its order (InputError naming
    `FILE:LINE` otherwise)."""
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise InputError("not a text file (UTF-8)", str(path)) from None
    except OSError as e:
        raise InputError(e.strerror or str(e), f"--inventory {path}") from None
    return parse_inventory(text, str(path), base=path.parent)


def parse_inventory(text: str, filename: str, *, base: Path = Path()) -> list[Target]:
    """The hosts of an inventory's `text` (see the module doc); `base`: where a
    relative key path starts."""
    first = next(
        (s for s in (ln.strip() for ln in text.splitlines()) if s and not s.startswith("#")), ""
    )
    if _MAPPING.match(first):
        targets = _parse_yaml(text, filename, base)
    else:
        targets = _parse_lines(text, filename)
    if not targets:
        raise InputError("no host in the inventory", filename)
    return targets


def _parse_lines(text: str, filename: str) -> list[Target]:
    targets: list[Target] = []
    wheres: list[str] = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.partition("#")[0].strip()
        if not line:
            continue
        where = f"{filename}:{n}"
        if len(line.split()) > 1:
            raise InputError("one host per line: [user@]host[:port]", where)
        user, host, port = parse_address(line, where)
        targets.append(Target(host, port, user))
        wheres.append(where)
    _check_unique(targets, wheres)
    return targets


def _parse_yaml(text: str, filename: str, base: Path) -> list[Target]:
    from evergraph.frontends.yaml_load import Locator, load_text

    loc = Locator(filename, text)
    doc = load_text(text, filename, loc)
    if not isinstance(doc, dict):
        raise InputError("expected a mapping with `hosts:`", filename)
    for k in doc:
        if k != "hosts":
            raise InputError(
                f"unknown key {k!r}: an inventory has `hosts:` only", loc.at((k,), True)
            )
    hosts = doc.get("hosts")
    if not isinstance(hosts, dict) or not hosts:
        raise InputError(
            "`hosts:` must map each host's name to its fields (host, user, port, key, hostname)",
            loc.at(("hosts",)),
        )
    targets: list[Target] = []
    wheres: list[str] = []
    for name, fields in hosts.items():
        where = loc.at(("hosts", name), True)
        targets.append(_entry(name, fields, where, loc, base))
        wheres.append(where)
    _check_unique(targets, wheres)
    return targets


def _entry(name: Any, fields: Any, where: str, loc: Any, base: Path) -> Target:
    if not isinstance(name, str):
        raise InputError(f"a host's name must be text, not {name!r}", where)
    if fields is None:
        fields = {}
    if not isinstance(fields, dict):
        raise InputError(f"{name}: expected a mapping of {', '.join(FIELDS)}", where)

    def at(field: str) -> str:
        return str(loc.at(("hosts", name, field)))

    for k in fields:
        if k not in FIELDS:
            raise InputError(
                f"{name}: unknown field {k!r} (expected {', '.join(FIELDS)})",
                loc.at(("hosts", name, k), True),
            )
    for k in ("host", "user", "key", "hostname"):
        if k in fields and not isinstance(fields[k], str):
            raise InputError(f"{name}.{k}: expected text, not {fields[k]!r}", at(k))
    host = parse_host(fields.get("host", name), at("host") if "host" in fields else where)
    user = fields.get("user")
    if user is not None and (why := user_problem(user)):
        raise InputError(f"{name}.user: {why}", at("user"))
    port = fields.get("port", 22)
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise InputError(f"{name}.port: {port!r} is not a port (1-65535)", at("port"))
    key: Path | None = None
    if "key" in fields:
        key = base / Path(fields["key"]).expanduser()
        if not key.is_file():
            raise InputError(f"{name}.key: no such file: {key}", at("key"))
    hostname = fields.get("hostname", name)
    if not _HOSTNAME.fullmatch(hostname):
        raise InputError(
            f"{name}.hostname: {hostname!r} is not a host name (letters, digits, . _ -)",
            at("hostname") if "hostname" in fields else where,
        )
    return Target(host, port, user, key, hostname)


def _check_unique(targets: Sequence[Target], wheres: Sequence[str]) -> None:
    seen: dict[tuple[str, int], int] = {}
    names: dict[str, int] = {}
    for i, t in enumerate(targets):
        j = seen.setdefault((t.host, t.port), i)
        if j != i:
            addr = t.host if t.port == 22 else f"{t.host}:{t.port}"
            raise InputError(f"{addr} is given twice (first at {wheres[j]})", wheres[i])
        j = names.setdefault(t.agent_hostname, i)
        if j != i:
            raise InputError(
                f"hostname {t.agent_hostname!r} is given twice (first at {wheres[j]})", wheres[i]
            )


def merge(given: Sequence[Target], listed: Sequence[Target]) -> list[Target]:
    """The HOST arguments then the inventory's hosts; a host (or an agent's
    hostname) in both is bad input, as is no host at all."""
    out = [*given, *listed]
    if not out:
        raise InputError("no host: give HOST... or --inventory FILE", "HOST")
    _check_unique(out, [f"host {t.label!r}" for t in given] + ["--inventory"] * len(listed))
    return out
