"""The one path from plain data to a Resource: YAML, Python graphs, collected
exports and persisted reversals all build resources here, so a parameter is
typed, defaulted and reported the same way whichever way it came in.

Errors name `kind[name].field` (and, through `fail`, the caller's place: a
YAML node's `file:line:col`, a Python caller's `file:line`, an export's key).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable
from typing import Any

import msgspec

from evergraph.engine.contract import Meta, Registry, Resource
from evergraph.errors import InputError

PathPart = str | int
#: builds the error for a message and the data path it concerns (`key`: the path
#: names a mapping key rather than its value)
Fail = Callable[..., InputError]

_MSGSPEC_PATH = re.compile(r" - at `\$(?P<path>[^`]*)`$")
_PATH_PART = re.compile(r"\.(\w+)|\[(\d+)\]")


def msgspec_path(message: str) -> tuple[str, tuple[PathPart, ...]]:
    """(reason, data path) of a msgspec validation message."""
    m = _MSGSPEC_PATH.search(message)
    if not m:
        return message, ()
    parts: list[PathPart] = []
    for name, idx in _PATH_PART.findall(m.group("path")):
        parts.append(int(idx) if idx else name)
    return message[: m.start()], tuple(parts)


def known_kinds_hint(kinds: list[str], word: str) -> str:
    """`(known: ...)` and the closest kind name, for an unknown kind's message."""
    close = difflib.get_close_matches(word, kinds, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"(known: {', '.join(kinds)}){hint}"


def _where(where: str) -> Fail:
    def fail(msg: str, *_: object, **__: object) -> InputError:
        return InputError(msg, where)

    return fail


def build_resource(
    cls: type[Resource],
    kind: str,
    item: object,
    path: tuple[PathPart, ...] = (),
    fail: Fail | None = None,
) -> Resource:
    """`item` (a mapping with `name`) as a `cls`, typed strictly; not yet validated."""
    fail = fail or _where("")
    if not isinstance(item, dict):
        raise fail(f"each {kind} resource must be a mapping with at least `name:`", path)
    name = item.get("name")
    if not isinstance(name, str) or not name:
        raise fail(f"{kind} resource without a `name:` (a non-empty string)", path)
    ident = f"{kind}[{name}]"
    try:
        return msgspec.convert(item, cls, strict=True)
    except msgspec.ValidationError as e:
        reason, sub = msgspec_path(str(e))
        m = re.match(r"Object contains unknown field `(.+)`$", reason)
        if m:
            field = m[1]
            fields = [f.name for f in msgspec.structs.fields(cls)]
            if sub == ("meta",):
                fields = [f.name for f in msgspec.structs.fields(Meta)]
            close = difflib.get_close_matches(field, fields, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            dotted = ".".join(str(p) for p in (*sub, field))
            raise fail(
                f"{ident}.{dotted}: unknown parameter{hint}", (*path, *sub, field), key=True
            ) from None
        dotted = ".".join(str(p) for p in sub)
        reason = reason.replace("Expected", "expected").replace("`", "")
        raise fail(
            f"{ident}.{dotted}: {reason}" if dotted else f"{ident}: {reason}", (*path, *sub)
        ) from None


def build(registry: Registry, kind: str, data: dict[str, Any], where: str = "") -> Resource:
    """A validated resource of `kind` from plain data (a collected export, a stored
    reversal); InputError naming `where` and `kind[name].field` otherwise."""
    cls = registry.get(kind)
    if cls is None:
        raise InputError(f"unknown resource kind {kind!r} on this host", where)
    res = build_resource(cls, kind, data, (), _where(where))
    res.validate()
    return res
