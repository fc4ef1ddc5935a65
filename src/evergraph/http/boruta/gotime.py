"""Go's `time.Time` in JSON and in headers, emulated: strict RFC 3339 parsing and
formatting as Go's `time` package does it, byte for byte, with Go's error
messages. Pure; knows nothing of Boruta or HTTP (the wire format in
`http/boruta/` uses it, as `gojson.Time` does).

Times are floats, seconds since the epoch; Go's zero time
`0001-01-01T00:00:00Z` is 0.0 ("unset"). A float holds microseconds, so finer
fractions are lost.
"""

from __future__ import annotations

import math
import re
from typing import Final

__all__ = [
    "RFC3339",
    "ZERO_EPOCH",
    "ZERO_TIME",
    "TimeError",
    "format_time",
    "format_time_header",
    "parse_time",
]

ZERO_TIME: Final = "0001-01-01T00:00:00Z"
"""Go's zero `time.Time` (Boruta's "unset"; 0.0 here)."""

_SECONDS_PER_DAY = 86400
ZERO_EPOCH: Final = -62135596800
"""0001-01-01T00:00:00Z in seconds since the epoch (Go's zero time)."""
RFC3339: Final = "2006-01-02T15:04:05Z07:00"


class TimeError(ValueError):
    """A time that is not strict RFC 3339; the message is Go's."""


def _days_from_civil(year: int, month: int, day: int) -> int:
    """Days since 1970-01-01 of a proleptic Gregorian date (any year)."""
    year -= month <= 2
    era = year // 400
    year_of_era = year - era * 400
    day_of_year = (153 * (month - 3 if month > 2 else month + 9) + 2) // 5 + day - 1
    day_of_era = year_of_era * 365 + year_of_era // 4 - year_of_era // 100 + day_of_year
    return era * 146097 + day_of_era - 719468


def _civil_from_days(days: int) -> tuple[int, int, int]:
    """The proleptic Gregorian (year, month, day) of days since 1970-01-01."""
    days += 719468
    era = days // 146097
    day_of_era = days - era * 146097
    year_of_era = (
        day_of_era - day_of_era // 1460 + day_of_era // 36524 - day_of_era // 146096
    ) // 365
    day_of_year = day_of_era - (365 * year_of_era + year_of_era // 4 - year_of_era // 100)
    mp = (5 * day_of_year + 2) // 153
    day = day_of_year - (153 * mp + 2) // 5 + 1
    month = mp + 3 if mp < 10 else mp - 9
    return year_of_era + era * 400 + (month <= 2), month, day


def _days_in(month: int, year: int) -> int:
    if month == 2:
        leap = year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)
        return 29 if leap else 28
    return 30 if month in (4, 6, 9, 11) else 31


def _split(t: float) -> tuple[int, int]:
    """(whole seconds, microseconds) of `t`; a float carries no finer time."""
    if not math.isfinite(t):
        raise ValueError(f"not a time: {t!r}")
    whole = math.floor(t)
    micros = round((t - whole) * 1_000_000)
    if micros == 1_000_000:
        whole, micros = whole + 1, 0
    return int(whole), micros


def _format(t: float, fraction: bool) -> str:
    if t == 0:
        return ZERO_TIME
    whole, micros = _split(t)
    days, secs = divmod(whole, _SECONDS_PER_DAY)
    year, month, day = _civil_from_days(days)
    if not 0 <= year <= 9999:
        raise ValueError(f"Time.MarshalJSON: year outside of range [0,9999]: {t!r}")
    text = (
        f"{year:04d}-{month:02d}-{day:02d}T{secs // 3600:02d}:{secs // 60 % 60:02d}:{secs % 60:02d}"
    )
    if fraction and micros:
        text += "." + f"{micros:06d}".rstrip("0")
    return text + "Z"


def format_time(t: float) -> str:
    """`t` (seconds since the epoch; 0 = unset) as Go marshals a `time.Time` in
    JSON: RFC 3339 in UTC, the fraction trimmed of zeros and left out when 0
    (`2222-12-31T00:00:00Z`, `2100-01-01T04:05:06.5Z`); 0 is `0001-01-01T00:00:00Z`."""
    return _format(t, fraction=True)


def format_time_header(t: float) -> str:
    """`t` as Boruta writes it in a header (Go's `time.RFC3339`: whole seconds)."""
    return _format(t, fraction=False)


_RFC3339_RE = re.compile(
    r"([0-9]{4})-([0-9]{2})-([0-9]{2})T([0-9]{2}):([0-9]{2}):([0-9]{2})"
    r"(?:\.([0-9]+))?(?:Z|([+-])([0-9]{2}):([0-9]{2}))"
)


def parse_time(text: str) -> float:
    """A strict RFC 3339 time (what Go's `time.Time` accepts in JSON) as seconds
    since the epoch; Go's zero time is 0.0 (unset). Refused with Go's message
    (`TimeError`), e.g. `parsing time "2100-13-01T00:00:00Z": month out of range`.
    Finer than microseconds is lost (a float cannot hold it)."""
    found = _RFC3339_RE.fullmatch(text)
    if found is not None:
        year, month, day, hour, minute, second = (int(found.group(i)) for i in range(1, 7))
        digits, sign = found.group(7), found.group(8)
        off_hour = int(found.group(9)) if sign else 0
        off_minute = int(found.group(10)) if sign else 0
        if (
            1 <= month <= 12
            and 1 <= day <= _days_in(month, year)
            and hour <= 23
            and minute <= 59
            and second <= 59
            and off_hour <= 23
            and off_minute <= 59
        ):
            whole = (
                _days_from_civil(year, month, day) * _SECONDS_PER_DAY
                + hour * 3600
                + minute * 60
                + second
            )
            if sign:
                offset = off_hour * 3600 + off_minute * 60
                whole -= offset if sign == "+" else -offset
            if whole == ZERO_EPOCH and not (digits and digits.strip("0")):
                return 0.0
            nanos = int((digits or "0")[:9].ljust(9, "0"))
            return whole + nanos / 1e9
    raise TimeError(_time_error(text))


def _go_quote(text: str) -> str:
    """Go's `time` package quoting: `"` and `\\` escaped, other than printable
    ASCII as `\\x..` per UTF-8 byte."""
    out = ['"']
    for char in text:
        if char < " " or char >= "\x80":
            out.extend(f"\\x{b:02x}" for b in char.encode("utf-8", "surrogatepass"))
        else:
            out.append("\\" + char if char in '"\\' else char)
    out.append('"')
    return "".join(out)


def _time_error(value: str) -> str:
    """Go's error for a time its strict RFC 3339 parser refused: what `time.Parse`
    with the RFC 3339 layout says, or, where Parse is laxer, the strict check's."""
    quoted = _go_quote(value)

    def cannot(elem_value: str, elem_layout: str) -> str:
        return (
            f"parsing time {quoted} as {_go_quote(RFC3339)}: "
            f"cannot parse {_go_quote(elem_value)} as {_go_quote(elem_layout)}"
        )

    def out_of_range(what: str) -> str:
        return f"parsing time {quoted}: {what} out of range"

    def digit(s: str, i: int) -> bool:
        return len(s) > i and "0" <= s[i] <= "9"

    def number(s: str, fixed: bool) -> tuple[int, str] | None:
        if not digit(s, 0):
            return None
        if not digit(s, 1):
            return None if fixed else (int(s[0]), s[1:])
        return int(s[:2]), s[2:]

    rest = value
    if len(rest) < 4 or not digit(rest, 0) or not rest[:4].isdigit() or not rest[:4].isascii():
        return cannot(rest, "2006")
    year, rest = int(rest[:4]), rest[4:]
    values: dict[str, int] = {}
    for separator, elem, name, fixed, limit in (
        ("-", "01", "month", True, 12),
        ("-", "02", "day", True, 0),
        ("T", "15", "hour", False, 23),
        (":", "04", "minute", True, 59),
        (":", "05", "second", True, 59),
    ):
        if not rest.startswith(separator):
            return cannot(rest, separator)
        rest = rest[1:]
        got = number(rest, fixed)
        if got is None:
            return cannot(rest, elem)
        values[name], rest = got
        if name == "month" and not 1 <= values[name] <= 12:
            return out_of_range("month")
        if limit and name != "month" and values[name] > limit:
            return out_of_range(name)
    if len(rest) >= 2 and rest[0] in ".," and digit(rest, 1):
        end = 2
        while digit(rest, end):
            end += 1
        rest = rest[end:]
    if rest.startswith("Z"):
        rest = rest[1:]
    else:
        if len(rest) < 6 or rest[3] != ":":
            return cannot(rest, "Z07:00")
        hours = number(rest[1:3], True)
        minutes = number(rest[4:6], True) if hours is not None else None
        # Go checks the ranges before it looks at the sign (the last check wins)
        if minutes is not None and minutes[0] > 60:
            return out_of_range("time zone offset minute")
        if hours is not None and hours[0] > 24:
            return out_of_range("time zone offset hour")
        if hours is None or minutes is None or rest[0] not in "+-":
            return cannot(rest, "Z07:00")
        rest = rest[6:]
    if rest:
        return f"parsing time {quoted}: extra text: {_go_quote(rest)}"
    if not 1 <= values["day"] <= _days_in(values["month"], year):
        return f"parsing time {quoted}: day out of range"
    # time.Parse accepted it: one of the strict checks Go adds for RFC 3339.
    if value[12] == ":":
        return cannot(value[11:12], "15")
    if value[19] == ",":
        return cannot(",", ".")
    if not value.endswith("Z"):
        if int(value[-5:-3]) >= 24:
            return f"parsing time {quoted}: timezone hour out of range"
        if int(value[-2:]) >= 60:
            return f"parsing time {quoted}: timezone minute out of range"
    return cannot(value, RFC3339)  # pragma: no cover - Go's "should not occur"
