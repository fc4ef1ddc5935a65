"""The one path from plain data to a Resource: YAML, Python graphs, collected
exports and persisted reversals all build resources here, so a parameter is
typed, defaulted and reported the same way whichever way it came in.

Errors name `kind[name].field` (and, through `fail`, the caller's place: a
YAML node's `file:line:col`, a Python caller's `file:line`, an export's key).
"""

from __future__ import annotations

import re
import types
import typing
from collections.abc import Callable
from typing import Annotated, Any, Literal

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
    import difflib  # (an error's hint: not on the way of a good graph)

    close = difflib.get_close_matches(word, kinds, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"(known: {', '.join(kinds)}){hint}"


def _declared_type(cls: type, sub: tuple[PathPart, ...]) -> object:
    """The type declared for the data path `sub` below a `cls` (`Annotated` and
    `Optional` removed), or None when the path leaves the declared fields."""
    t: object = cls
    for part in sub:
        if isinstance(part, int):
            args = typing.get_args(t)
            if typing.get_origin(t) is not list or not args:
                return None
            t = args[0]
            continue
        if not isinstance(t, type) or not issubclass(t, msgspec.Struct):
            return None
        t = next((f.type for f in msgspec.structs.fields(t) if f.name == part), None)
        if t is None:
            return None
        if typing.get_origin(t) is Annotated:
            t = typing.get_args(t)[0]
    args = typing.get_args(t)
    if (isinstance(t, types.UnionType) or typing.get_origin(t) is typing.Union) and (
        len(args) == 2 and type(None) in args
    ):
        t = next(a for a in args if a is not type(None))
    return t


def _value_at(item: object, sub: tuple[PathPart, ...]) -> object:
    """The value at the data path `sub` in `item`, or None."""
    for part in sub:
        in_list = isinstance(part, int) and isinstance(item, list) and part < len(item)
        if not in_list and not (isinstance(item, dict) and part in item):
            return None
        item = item[part]  # type: ignore[index]
    return item


def _type_hint(declared: object, value: object, field: str) -> str:
    """What to add to a type error: a Literal's valid values; a number or a boolean
    given where text is wanted is to be quoted (YAML reads `mode: 0644` as the
    number 644, `on` as text but `true` as a boolean)."""
    if typing.get_origin(declared) is Literal:
        # no "did you mean": the closest spelling of `present` is `absent`
        return f" (valid values: {', '.join(repr(v) for v in typing.get_args(declared))})"
    if declared is str and isinstance(value, bool | int) and field:
        text = str(value).lower() if isinstance(value, bool) else str(value)
        return f': quote it, e.g. {field}: "{text}"'
    if declared is str and isinstance(value, float):
        return ": quote it (as text, exactly as written)"
    return ""


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
            import difflib

            close = difflib.get_close_matches(field, fields, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            dotted = ".".join(str(p) for p in (*sub, field))
            raise fail(
                f"{ident}.{dotted}: unknown parameter{hint}", (*path, *sub, field), key=True
            ) from None
        dotted = ".".join(str(p) for p in sub)
        reason = reason.replace("Expected", "expected").replace("`", "")
        value = _value_at(item, sub)
        if isinstance(value, int) and value.bit_length() > 64:
            value = None  # too long to quote back
        if reason.startswith("expected") and isinstance(value, bool | int | float):
            reason += f" {value!r}"
        field = next((p for p in reversed(sub) if isinstance(p, str)), "")
        reason += _type_hint(_declared_type(cls, sub), value, field)
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
