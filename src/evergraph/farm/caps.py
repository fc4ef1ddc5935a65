"""Capability matching: what a request wants against what a worker has. Pure.

A request's wanted value takes one of five forms (checked in this order):

- `>=N` / `<=N`: the worker's value is a number at least / at most N;
- `a|b|c`: any-of, the worker's value equals one of the alternatives (each
  alternative is stripped of surrounding blanks and compared exactly);
- `N-M`: an inclusive numeric range (`2.9-3.6`; blanks around `-` allowed);
- anything else: the worker's value equals it exactly.

Numbers are decimal floats (`3`, `-1.5`, `.5`, `1e3`); `nan`, `inf` and the like
are not numbers. A worker value that is not a number never satisfies a numeric
form. A worker satisfies a request's caps when it has every wanted key and each
value matches; extra keys on the worker do not matter.

Malformed wanted values (refused at request creation): a comparison without a
number (`>=x`), a bare `>` or `<` (only `>=` and `<=` exist), an empty
alternative (`a||b`, `a|`), an empty range (`3.6-2.9`), an empty capability name.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping
from functools import lru_cache

Predicate = Callable[[str], bool]
"""Tells whether a worker's value for one key satisfies one wanted value."""

_NUM = r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?"
_NUMBER = re.compile(_NUM)
_BOUND = re.compile(rf"(>=|<=)\s*({_NUM})")
_RANGE = re.compile(rf"\s*({_NUM})\s*-\s*({_NUM})\s*")


class MalformedCap(ValueError):
    """A wanted value in none of the forms it looks like; `reason` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@lru_cache(maxsize=8192)
def number(text: str) -> float | None:
    """`text` as a finite float (surrounding blanks allowed), or None."""
    if _NUMBER.fullmatch(text.strip()) is None:
        return None
    value = float(text)
    return value if math.isfinite(value) else None


def _finite(text: str, value: str) -> float:
    n = number(text)
    if n is None:
        raise MalformedCap(f"bad value {value!r}: {text} is too large")
    return n


@lru_cache(maxsize=8192)
def parse_wanted(value: str) -> Predicate:
    """The predicate a wanted value stands for; raises `MalformedCap`."""
    s = value.strip()
    if s.startswith((">=", "<=")):
        m = _BOUND.fullmatch(s)
        if m is None:
            raise MalformedCap(f"bad value {value!r}: expected a number after {s[:2]!r}")
        bound = _finite(m[2], value)
        if m[1] == ">=":

            def at_least(have: str) -> bool:
                n = number(have)
                return n is not None and n >= bound

            return at_least

        def at_most(have: str) -> bool:
            n = number(have)
            return n is not None and n <= bound

        return at_most
    if s.startswith((">", "<")):
        raise MalformedCap(f"bad value {value!r}: the comparisons are '>=N' and '<=N'")
    if "|" in value:
        options = [a.strip() for a in value.split("|")]
        if "" in options:
            raise MalformedCap(f"bad value {value!r}: an empty alternative in an any-of list")
        return frozenset(options).__contains__
    m = _RANGE.fullmatch(value)
    if m is not None:
        lo, hi = _finite(m[1], value), _finite(m[2], value)
        if lo > hi:
            raise MalformedCap(f"bad value {value!r}: an empty range ({m[1]} is above {m[2]})")

        def within(have: str) -> bool:
            n = number(have)
            return n is not None and lo <= n <= hi

        return within

    def exactly(have: str) -> bool:
        return have == value

    return exactly


def wanted_error(value: str) -> str | None:
    """Why a wanted value is malformed, or None when it is well-formed."""
    try:
        parse_wanted(value)
    except MalformedCap as e:
        return e.reason
    return None


def is_well_formed(value: str) -> bool:
    """Whether a wanted value is in one of the forms (see the module docstring)."""
    return wanted_error(value) is None


#: what a request's caps may hold (each is kept, signed and matched on every pass)
MAX_CAPS = 64
MAX_CAP_NAME = 64
MAX_CAP_VALUE = 256


def caps_error(wanted: Mapping[str, str]) -> str | None:
    """The first problem in a request's caps, naming the key, or None.

    E.g. `capability 'cpus': bad value '>=x': expected a number after '>='`.
    """
    if len(wanted) > MAX_CAPS:
        return f"{len(wanted)} capabilities: at most {MAX_CAPS}"
    for key in sorted(wanted):
        if not key.strip():
            return "an empty capability name"
        if len(key) > MAX_CAP_NAME or len(wanted[key]) > MAX_CAP_VALUE:
            return (
                f"capability {key[:40]!r}: a name is at most {MAX_CAP_NAME} characters and a "
                f"value at most {MAX_CAP_VALUE}"
            )
        reason = wanted_error(wanted[key])
        if reason is not None:
            return f"capability {key!r}: {reason}"
    return None


def value_matches(wanted: str, have: str) -> bool:
    """Whether a worker's value satisfies one wanted value (malformed: never)."""
    try:
        return parse_wanted(wanted)(have)
    except MalformedCap:
        return False


CapsPredicate = Callable[[Mapping[str, str]], bool]
"""Tells whether a worker's whole caps satisfy a request's caps."""


def compile_caps(wanted: Mapping[str, str]) -> CapsPredicate:
    """One predicate over a worker's caps for all of `wanted` (parsed once).

    A malformed wanted value makes a predicate that nothing satisfies.
    """
    try:
        checks = [(key, parse_wanted(v)) for key, v in wanted.items()]
    except MalformedCap:
        return lambda _have: False

    def satisfied(have: Mapping[str, str]) -> bool:
        for key, check in checks:
            value = have.get(key)
            if value is None or not check(value):
                return False
        return True

    return satisfied


def satisfies(have: Mapping[str, str], wanted: Mapping[str, str]) -> bool:
    """Whether a worker with caps `have` satisfies a request wanting `wanted`."""
    return compile_caps(wanted)(have)


def groups_overlap(request_groups: Iterable[str], worker_groups: Iterable[str]) -> bool:
    """Whether a request and a worker share a group; either side empty = any."""
    mine = set(request_groups)
    if not mine:
        return True
    theirs = set(worker_groups)
    return not theirs or not mine.isdisjoint(theirs)
