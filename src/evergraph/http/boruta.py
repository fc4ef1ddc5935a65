"""Boruta's HTTP API v1 on the wire: what the farm routes read and write. Pure.

The farm's routes (SPEC §5.2) are wire-compatible with SamsungSLAV/boruta's REST
API v1; the reference is Boruta's golden responses in `shared/boruta-ref/`. This
module knows that wire and nothing else (no I/O, no Starlette, no World): the
routes parse a body here, call the farm, and encode the answer here.

- **Out**: `req_info`, `worker_info`, `access_info`, `req_id`, `version` build
  the JSON objects, in Go's field order; `dumps` writes them as Go's
  `json.Marshal` does (no spaces, `<>&` escaped, no trailing newline), so a body
  is byte-identical to Boruta's. Times are RFC 3339 as Go's `time.Time`
  marshals them (UTC `Z`, fraction trimmed); the zero time
  `0001-01-01T00:00:00Z` means unset (`0.0` in the farm's records).
- **In**: `parse_new_request`, `parse_update_request`, `parse_set_state`,
  `parse_set_groups`, `parse_requests_list`, `parse_workers_list` read a body as
  Go's `json.Decoder` does (first value only, field names case-insensitive,
  unknown fields ignored, Go's messages for syntax and type errors) and raise
  `WireError` with Boruta's status and message.
- **Lists**: `list_requests` / `list_workers` filter, sort and page (Boruta's
  keyset paginator: the page after or before the item with a given ID in the
  sorted list), `list_headers` gives the `Boruta-List-*` headers.

Errors are `{"message": ...}`: 404 `<What> not found`, 400 `invalid request:
<reason>` (Boruta's `NewServerError`), 400 `no body provided in HTTP request`.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol, TypeVar

from evergraph._version import __version__
from evergraph.farm.model import (
    HIGHEST_PRIORITY,
    IDLE,
    IN_PROGRESS,
    LOWEST_PRIORITY,
    MAINTENANCE,
    UUID_CAP,
    WAITING,
    Request,
    Worker,
)

__all__ = [
    "API_STATE",
    "API_VERSION",
    "CONTENT_TYPE",
    "MAX_PAGE_LIMIT",
    "ZERO_TIME",
    "NewRequestSpec",
    "RequestsFilter",
    "RequestsListSpec",
    "RequestsPaginator",
    "Sorter",
    "TimeError",
    "UpdateSpec",
    "WireError",
    "WorkersFilter",
    "WorkersListSpec",
    "WorkersPaginator",
    "access_info",
    "check_new_request",
    "check_update_request",
    "dumps",
    "error",
    "format_time",
    "format_time_header",
    "invalid_request",
    "list_headers",
    "list_requests",
    "list_workers",
    "no_body",
    "not_found",
    "parse_new_request",
    "parse_req_id",
    "parse_requests_list",
    "parse_set_groups",
    "parse_set_state",
    "parse_time",
    "parse_update_request",
    "parse_worker_uuid",
    "parse_workers_list",
    "req_id",
    "req_info",
    "request_headers",
    "version",
    "version_headers",
    "worker_caps",
    "worker_headers",
    "worker_info",
]

CONTENT_TYPE: Final = "application/json"
API_VERSION: Final = "v1"
API_STATE: Final = "devel"
MAX_PAGE_LIMIT: Final = 65535
"""Boruta's `MaxPageLimit`: a page holds at most this many items, and a limit of 0
(or none, or more) means this many."""
ZERO_TIME: Final = "0001-01-01T00:00:00Z"
"""Go's zero `time.Time`: Boruta's "unset"; the farm's records say 0.0."""
SET_STATE_BODY: Final = b"null"
"""The body of setstate's 202 (Boruta marshals its nil error)."""

# Boruta's messages (its errors' texts), for the routes and for `invalid_request`.
BAD_ID: Final = "ID provided in URL isn't valid"
BAD_UUID: Final = "ID provided in URL isn't valid UUID"
ID_MISMATCH: Final = "request ID set in JSON doesn't match ID from URL"
NO_BODY: Final = "no body provided in HTTP request"
ERR_PRIORITY: Final = "requested priority out of bounds"
ERR_INVALID_TIME_RANGE: Final = "requested time range illegal - ValidAfter must be before Deadline"
ERR_DEADLINE_IN_THE_PAST: Final = "deadline in the past"
ERR_WORKER_NOT_ASSIGNED: Final = "worker not assigned"
ERR_MODIFICATION_FORBIDDEN: Final = "action cannot be executed in current state"
ERR_WRONG_SORT_ITEM: Final = "unknown name of item by which list should be sorted"
ERR_WRONG_SORT_ORDER: Final = "unknown sort order (valid: ascending or descending)"
ERR_WRONG_LIST_DIRECTION: Final = "unknown list direction (valid: forward or backward)"
ERR_WRONG_STATE_ARGUMENT: Final = "Only state changes to IDLE and MAINTENANCE are allowed"
ERR_FORBIDDEN_STATE_CHANGE: Final = "Invalid state transition was requested"
ERR_NOT_IN_FAIL_OR_MAINTENANCE: Final = "Worker is not in FAIL or MAINTENANCE state"
ERR_INTERNAL: Final = "internal server error"

# The headers Boruta sets (as Go canonicalises them on the wire).
LIST_TOTAL: Final = "Boruta-List-Total"
LIST_REMAINING: Final = "Boruta-List-Remaining"
LIST_BATCH_SIZE: Final = "Boruta-List-Batch-Size"
REQUEST_STATE: Final = "Boruta-Request-State"
JOB_TIMEOUT: Final = "Boruta-Job-Timeout"
WORKER_STATE: Final = "Boruta-Worker-State"
SERVER_VERSION: Final = "Boruta-Server-Version"
API_VERSION_HEADER: Final = "Boruta-Api-Version"
API_STATE_HEADER: Final = "Boruta-Api-State"


# ---------------------------------------------------------------- errors


class WireError(Exception):
    """An answer that is an error: HTTP `status` and Boruta's `message`."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message

    def body(self) -> bytes:
        """The response body: `{"message": ...}`."""
        return dumps(error(self.message))

    def __repr__(self) -> str:
        return f"WireError({self.status}, {self.message!r})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, WireError):
            return NotImplemented
        return (self.status, self.message) == (other.status, other.message)

    def __hash__(self) -> int:
        return hash((self.status, self.message))


def error(message: str) -> dict[str, Any]:
    """An error body's object."""
    return {"message": message}


def invalid_request(reason: str) -> WireError:
    """400 `invalid request: <reason>`: what Boruta answers for any refused input."""
    return WireError(400, f"invalid request: {reason}")


def not_found(what: str) -> WireError:
    """404 `<what> not found` (Boruta says `Request`, `Worker`, and lowercase
    `request` / `worker` for an unknown paginator ID)."""
    return WireError(404, f"{what} not found")


def no_body() -> WireError:
    """400 for an empty body where one is needed."""
    return WireError(400, NO_BODY)


# ---------------------------------------------------------------- JSON out

_HTML_ESCAPES = (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"))
_LINE_SEPARATORS = (("\u2028", "\\u2028"), ("\u2029", "\\u2029"))
_SURROGATE = re.compile("[\ud800-\udfff]")


def dumps(obj: Any) -> bytes:
    """`obj` as Go's `json.Marshal` writes it: no spaces, non-ASCII as UTF-8,
    `<`, `>`, `&`, U+2028 and U+2029 escaped, no trailing newline.

    Dicts keep their order (a Go struct's field order); a Go map's keys are
    sorted, which the encoders here do themselves. Boruta's objects hold no
    floats; a float is written as Python writes it.
    """
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    # These characters can only occur inside strings, so replacing them in the
    # whole text escapes exactly the string contents, as Go does.
    for raw, escaped in _HTML_ESCAPES:
        if raw in text:
            text = text.replace(raw, escaped)
    for raw, escaped in _LINE_SEPARATORS:
        if raw in text:
            text = text.replace(raw, escaped)
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: Go writes U+FFFD for it
        return _SURROGATE.sub("\ufffd", text).encode("utf-8")


# ---------------------------------------------------------------- times

_SECONDS_PER_DAY = 86400
_ZERO_EPOCH: Final = -62135596800
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
            if whole == _ZERO_EPOCH and not (digits and digits.strip("0")):
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


# ---------------------------------------------------------------- encoders


def _wire_state(state: str) -> str:
    return IN_PROGRESS if state in ("IN_PROGRESS", "INPROGRESS") else state


def _go_map(mapping: Mapping[str, str]) -> dict[str, str] | None:
    """A Go map as Go marshals it: keys sorted; empty is null (Boruta's records
    hold nil maps until something is set)."""
    return {key: mapping[key] for key in sorted(mapping)} if mapping else None


def req_info(r: Request) -> dict[str, Any]:
    """Boruta's `ReqInfo` of a request: `{"ID", "Priority", "Owner": {"Groups"},
    "Deadline", "ValidAfter", "State", "Job": {"WorkerUUID", "Timeout"} | null,
    "Caps"}`. No groups / no caps are null, as in Boruta's records."""
    job = r.job
    return {
        "ID": r.id,
        "Priority": r.priority,
        "Owner": {"Groups": list(r.groups) or None},
        "Deadline": format_time(r.deadline),
        "ValidAfter": format_time(r.valid_after),
        "State": _wire_state(r.state),
        "Job": (
            None if job is None else {"WorkerUUID": job.worker, "Timeout": format_time(job.timeout)}
        ),
        "Caps": _go_map(r.caps),
    }


def worker_caps(w: Worker) -> dict[str, str]:
    """A worker's caps as Boruta shows them: its UUID among them."""
    return {**w.caps, UUID_CAP: w.uuid}


def worker_info(w: Worker) -> dict[str, Any]:
    """Boruta's `WorkerInfo`: `{"WorkerUUID", "State", "Groups", "Caps"}`; the caps
    hold `UUID` too (as Boruta's do); no groups is null."""
    return {
        "WorkerUUID": w.uuid,
        "State": w.state,
        "Groups": list(w.groups) or None,
        "Caps": _go_map(worker_caps(w)),
    }


def _ip_text(ip: str) -> tuple[str, str]:
    """(address as Go's `net.IP` writes it, IPv6 zone)."""
    import ipaddress  # only acquire_worker needs it

    address, _, zone = ip.partition("%")
    if not address:
        return "", zone
    parsed = ipaddress.ip_address(address)
    if isinstance(parsed, ipaddress.IPv6Address) and parsed.ipv4_mapped is not None:
        return str(parsed.ipv4_mapped), zone  # Go prints a v4-in-v6 address as v4
    return str(parsed), zone


def access_info(ip: str, port: int, key_pem: str, username: str) -> dict[str, Any]:
    """Boruta's acquire_worker answer (`AccessInfo2`): where to ssh and as whom,
    with the job's private key in PEM (`-----BEGIN RSA PRIVATE KEY-----`...):
    `{"Addr": {"IP", "Port", "Zone"}, "Key", "Username"}`. An IPv6 zone may
    follow the address (`fe80::1%eth0`)."""
    address, zone = _ip_text(ip)
    return {
        "Addr": {"IP": address, "Port": port, "Zone": zone},
        "Key": key_pem,
        "Username": username,
    }


def req_id(rid: int) -> dict[str, Any]:
    """A created request's answer (201): `{"ReqID": n}`."""
    return {"ReqID": rid}


def version(server: str = __version__) -> dict[str, Any]:
    """`GET /api/v1/version`'s body: `{"Server", "API_Version", "API_State"}`."""
    return {"Server": server, "API_Version": API_VERSION, "API_State": API_STATE}


# ---------------------------------------------------------------- headers


def version_headers(server: str = __version__) -> dict[str, str]:
    """The headers `GET /api/v1/version` adds."""
    return {
        API_STATE_HEADER: API_STATE,
        API_VERSION_HEADER: API_VERSION,
        SERVER_VERSION: server,
    }


def request_headers(r: Request) -> dict[str, str]:
    """The headers of an answer carrying one request: its state, and its job's
    timeout while IN PROGRESS."""
    state = _wire_state(r.state)
    headers = {REQUEST_STATE: state}
    if state == IN_PROGRESS and r.job is not None:
        headers[JOB_TIMEOUT] = format_time_header(r.job.timeout)
    return headers


def worker_headers(w: Worker) -> dict[str, str]:
    """The header of an answer carrying one worker: its state."""
    return {WORKER_STATE: w.state}


def list_headers(total: int | None, remaining: int | None, batch: int) -> dict[str, str]:
    """The headers of a list's answer: how many items match (`total`), how many
    are left after this page in its direction (`remaining`) and how many it holds
    (`batch`). Boruta leaves total and remaining out when it has no such
    information (None here)."""
    headers = {LIST_BATCH_SIZE: str(batch)}
    if total is not None and remaining is not None:
        headers[LIST_REMAINING] = str(remaining)
        headers[LIST_TOTAL] = str(total)
    return headers


# ---------------------------------------------------------------- JSON in: Go's scanner


class _EOF(Exception):
    """The body holds no JSON value (Go's io.EOF)."""


class _Abort(Exception):
    """Decoding stops here: Go returns this error at once (a syntax error, or
    an UnmarshalJSON / UnmarshalText method's error)."""


_SPACE = frozenset(b" \t\r\n")
#: a run of JSON white space; the next byte a string literal must look at (its end,
#: an escape, a control character): runs between are skipped at C speed, so a
#: body of a megabyte of spaces or of one long string costs milliseconds
_SPACES = re.compile(rb"[ \t\r\n]*")
_STRING_STOP = re.compile(rb'["\\\x00-\x1f]')
#: values (of any kind) one body may hold: Boruta's hold a few dozen; past this a
#: body is refused (a 400) before its reading costs the agent's loop anything
MAX_VALUES = 10_000
_NAMED_ESCAPES = {7: "\\a", 8: "\\b", 9: "\\t", 10: "\\n", 11: "\\v", 12: "\\f", 13: "\\r"}
_STRING_ESCAPES = {
    ord('"'): '"',
    ord("\\"): "\\",
    ord("/"): "/",
    ord("b"): "\b",
    ord("f"): "\f",
    ord("n"): "\n",
    ord("r"): "\r",
    ord("t"): "\t",
}
_HEX = frozenset(b"0123456789abcdefABCDEF")


def _quote_char(c: int) -> str:
    """A byte as Go's JSON scanner names it in an error: `'x'`, `'\\n'`, `'\\x01'`."""
    if c == ord("'"):
        return "'\\''"
    if c == ord('"'):
        return "'\"'"
    if c in _NAMED_ESCAPES:
        return f"'{_NAMED_ESCAPES[c]}'"
    if c == ord("\\"):
        return "'\\\\'"
    if c < 0x20 or c == 0x7F:
        return f"'\\x{c:02x}'"
    if 0x80 <= c <= 0xA0 or c == 0xAD:
        return f"'\\u{c:04x}'"
    return f"'{chr(c)}'"


class _Node:
    """One JSON value as Go's decoder sees it: its kind (`string`, `number`,
    `bool`, `null`, `array`, `object`), its value, and its raw text (a time is
    parsed from the raw text between the quotes, as Go does)."""

    __slots__ = ("kind", "raw", "value")

    def __init__(self, kind: str, value: Any, raw: str = "") -> None:
        self.kind = kind
        self.value = value
        self.raw = raw


#: arrays and objects nested deeper than this are refused (`exceeded max depth`)
MAX_DEPTH = 64


class _Scanner:
    """Reads the first JSON value of a body as Go's `json.Decoder` does: bytes
    after it are never looked at; a value cut short is `unexpected EOF`; a bad
    byte is Go's `invalid character ...` message."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0
        #: arrays and objects open around the value being read
        self.depth = 0
        #: values read so far (see MAX_VALUES)
        self.values = 0

    def fail(self, context: str) -> _Abort:
        if self.pos >= len(self.data):
            return _Abort("unexpected EOF")
        return _Abort(f"invalid character {_quote_char(self.data[self.pos])} {context}")

    def skip_space(self) -> None:
        m = _SPACES.match(self.data, self.pos)
        assert m is not None  # (`*`: it always matches)
        self.pos = m.end()

    def peek(self) -> int:
        return self.data[self.pos] if self.pos < len(self.data) else -1

    def top(self) -> _Node:
        self.skip_space()
        if self.pos >= len(self.data):
            raise _EOF
        return self.value()

    def value(self) -> _Node:
        self.skip_space()
        self.values += 1
        if self.values > MAX_VALUES:
            raise _Abort(f"more than {MAX_VALUES} values in one body")
        c = self.peek()
        if c == ord("{") or c == ord("["):
            # Go stops at 10,000 levels; this reader recurses, so it stops sooner
            # (Boruta's bodies are three levels deep): a 400, never a RecursionError
            if self.depth >= MAX_DEPTH:
                raise _Abort("exceeded max depth")
            self.depth += 1
            try:
                return self.object() if c == ord("{") else self.array()
            finally:
                self.depth -= 1
        if c == ord('"'):
            text, raw = self.string()
            return _Node("string", text, raw)
        if c == ord("-") or ord("0") <= c <= ord("9"):
            return self.number()
        for word, node in ((b"true", _Node("bool", True)), (b"false", _Node("bool", False))):
            if c == word[0]:
                self.literal(word)
                return node
        if c == ord("n"):
            self.literal(b"null")
            return _Node("null", None)
        raise self.fail("looking for beginning of value")

    def literal(self, word: bytes) -> None:
        for expected in word:
            if self.peek() != expected:
                raise self.fail(f"in literal {word.decode()} (expecting {_quote_char(expected)})")
            self.pos += 1

    def number(self) -> _Node:
        data, start = self.data, self.pos

        def digits() -> None:
            while self.pos < len(data) and 0x30 <= data[self.pos] <= 0x39:
                self.pos += 1

        if self.peek() == ord("-"):
            self.pos += 1
            if not 0x30 <= self.peek() <= 0x39:
                raise self.fail("in numeric literal")
        if self.peek() == ord("0"):
            self.pos += 1
        else:
            digits()
        if self.peek() == ord("."):
            self.pos += 1
            if not 0x30 <= self.peek() <= 0x39:
                raise self.fail("after decimal point in numeric literal")
            digits()
        if self.peek() in (ord("e"), ord("E")):
            self.pos += 1
            if self.peek() in (ord("+"), ord("-")):
                self.pos += 1
            if not 0x30 <= self.peek() <= 0x39:
                raise self.fail("in exponent of numeric literal")
            digits()
        text = data[start : self.pos].decode("ascii")
        return _Node("number", text, text)

    def string(self) -> tuple[str, str]:
        data = self.data
        self.pos += 1  # the opening quote
        start = self.pos
        parts: list[str] = []
        run = start
        while True:
            stop = _STRING_STOP.search(data, self.pos)
            if stop is None:
                self.pos = len(data)
                raise _Abort("unexpected EOF")
            self.pos = stop.start()
            c = data[self.pos]
            if c == ord('"'):
                parts.append(data[run : self.pos].decode("utf-8", "replace"))
                raw = data[start : self.pos].decode("utf-8", "replace")
                self.pos += 1
                return "".join(parts), raw
            if c < 0x20:
                raise self.fail("in string literal")
            parts.append(data[run : self.pos].decode("utf-8", "replace"))
            self.pos += 1
            c = self.peek()
            if c in _STRING_ESCAPES:
                parts.append(_STRING_ESCAPES[c])
                self.pos += 1
            elif c == ord("u"):
                self.pos += 1
                parts.append(chr(self.hex4()))
            else:
                raise self.fail("in string escape code")
            run = self.pos

    def hex4(self) -> int:
        """The character of a `\\uXXXX` escape (the `\\u` read): a surrogate pair
        makes one character; a lone half is U+FFFD, as in Go."""
        code = self.raw_hex4()
        if 0xD800 <= code < 0xDC00:
            save = self.pos
            if self.data[self.pos : self.pos + 2] == b"\\u":
                self.pos += 2
                low = self.raw_hex4()
                if 0xDC00 <= low < 0xE000:
                    return 0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)
                self.pos = save  # not a pair: the next escape stands alone
            return 0xFFFD
        return 0xFFFD if 0xDC00 <= code < 0xE000 else code

    def raw_hex4(self) -> int:
        start = self.pos
        for _ in range(4):
            if self.peek() not in _HEX:
                raise self.fail("in \\u hexadecimal character escape")
            self.pos += 1
        return int(self.data[start : self.pos], 16)

    def object(self) -> _Node:
        self.pos += 1
        members: list[tuple[str, _Node]] = []
        self.skip_space()
        if self.peek() == ord("}"):
            self.pos += 1
            return _Node("object", members)
        while True:
            self.skip_space()
            if self.peek() != ord('"'):
                raise self.fail("looking for beginning of object key string")
            key, _ = self.string()
            self.skip_space()
            if self.peek() != ord(":"):
                raise self.fail("after object key")
            self.pos += 1
            members.append((key, self.value()))
            self.skip_space()
            if self.peek() == ord(","):
                self.pos += 1
                continue
            if self.peek() == ord("}"):
                self.pos += 1
                return _Node("object", members)
            raise self.fail("after object key:value pair")

    def array(self) -> _Node:
        self.pos += 1
        items: list[_Node] = []
        self.skip_space()
        if self.peek() == ord("]"):
            self.pos += 1
            return _Node("array", items)
        while True:
            items.append(self.value())
            self.skip_space()
            if self.peek() == ord(","):
                self.pos += 1
                continue
            if self.peek() == ord("]"):
                self.pos += 1
                return _Node("array", items)
            raise self.fail("after array element")


# ---------------------------------------------------------------- JSON in: Go's types


class _Context:
    """Where the decoder is (for Go's type error text) and the first type error
    (Go keeps decoding after one, and reports the first)."""

    def __init__(self) -> None:
        self.struct = ""
        self.fields: list[str] = []
        self.saved: str | None = None

    def type_error(self, value: str, go_type: str) -> None:
        if self.saved is not None:
            return
        if self.struct or self.fields:
            where = f"Go struct field {self.struct}.{'.'.join(self.fields)}"
        else:
            where = "Go value"
        self.saved = f"json: cannot unmarshal {value} into {where} of type {go_type}"

    def type_error_text(self, message: str) -> None:
        """Another error Go saves and goes on (it reports the first)."""
        if self.saved is None:
            self.saved = message


class _Type:
    """A Go type a JSON value is decoded into."""

    go_type = ""

    def zero(self) -> Any:
        return None

    def decode(self, node: _Node, ctx: _Context) -> Any:
        raise NotImplementedError


class _String(_Type):
    def __init__(self, go_type: str) -> None:
        self.go_type = go_type

    def zero(self) -> Any:
        return ""

    def decode(self, node: _Node, ctx: _Context) -> Any:
        if node.kind == "string":
            return node.value
        if node.kind != "null":
            ctx.type_error(node.kind, self.go_type)
        return ""


class _Uint(_Type):
    def __init__(self, go_type: str, bits: int) -> None:
        self.go_type = go_type
        self.limit = 1 << bits

    def zero(self) -> Any:
        return 0

    def decode(self, node: _Node, ctx: _Context) -> Any:
        if node.kind == "number":
            text = node.value
            if text.isdigit() and int(text) < self.limit:
                return int(text)
            ctx.type_error(f"number {text}", self.go_type)
        elif node.kind != "null":
            ctx.type_error(node.kind, self.go_type)
        return 0


class _Time(_Type):
    go_type = "time.Time"

    def zero(self) -> Any:
        return 0.0

    def decode(self, node: _Node, ctx: _Context) -> Any:
        if node.kind == "null":
            return 0.0
        if node.kind != "string":
            raise _Abort("Time.UnmarshalJSON: input is not a JSON string")
        try:
            return parse_time(node.raw)
        except TimeError as exc:
            raise _Abort(str(exc)) from None


class _Text(_Type):
    """A type with Go's `UnmarshalText` (SortOrder, ListDirection)."""

    def __init__(self, go_type: str, parse: Callable[[str], bool]) -> None:
        self.go_type = go_type
        self.parse = parse

    def zero(self) -> Any:
        return False

    def decode(self, node: _Node, ctx: _Context) -> Any:
        if node.kind == "string":
            return self.parse(node.value)
        if node.kind != "null":
            ctx.type_error(node.kind, self.go_type)
        return False


class _Slice(_Type):
    def __init__(self, go_type: str, elem: _Type) -> None:
        self.go_type = go_type
        self.elem = elem

    def decode(self, node: _Node, ctx: _Context) -> Any:
        if node.kind == "array":
            return [self.elem.decode(item, ctx) for item in node.value]
        if node.kind != "null":
            ctx.type_error(node.kind, self.go_type)
        return None


class _Bytes(_Slice):
    """A slice of a uint8 type (Boruta's `[]Priority`): Go also reads (and its
    clients write) it as a base64 string."""

    _ALPHABET = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/")

    def decode(self, node: _Node, ctx: _Context) -> Any:
        if node.kind != "string":
            return super().decode(node, ctx)
        text = node.value.replace("\r", "").replace("\n", "")
        try:
            return list(base64.b64decode(text, validate=True))
        except binascii.Error:
            # Go's CorruptInputError names the first byte it could not take
            bad = next(
                (i for i, c in enumerate(text) if c not in self._ALPHABET and c != "="),
                len(text) - len(text) % 4,
            )
            ctx.type_error_text(f"illegal base64 data at input byte {bad}")
            return None


class _Map(_Type):
    def __init__(self, go_type: str, elem: _Type) -> None:
        self.go_type = go_type
        self.elem = elem

    def decode(self, node: _Node, ctx: _Context) -> Any:
        if node.kind == "object":
            return {key: self.elem.decode(value, ctx) for key, value in node.value}
        if node.kind != "null":
            ctx.type_error(node.kind, self.go_type)
        return None


class _Struct(_Type):
    """A Go struct: fields matched by name, exactly or else case-insensitively;
    unknown names ignored; a repeated name: the last one counts."""

    def __init__(self, go_type: str, fields: Sequence[tuple[str, _Type]]) -> None:
        self.go_type = go_type
        self.name = go_type.rpartition(".")[2]
        self.fields = dict(fields)
        self.folded = {name.lower(): name for name in self.fields}

    def zero(self) -> Any:
        return {name: kind.zero() for name, kind in self.fields.items()}

    def decode(self, node: _Node, ctx: _Context) -> Any:
        result = self.zero()
        if node.kind == "null":
            return result
        if node.kind != "object":
            ctx.type_error(node.kind, self.go_type)
            return result
        outer = ctx.struct
        for key, value in node.value:
            name = key if key in self.fields else self.folded.get(key.lower())
            if name is None:
                continue
            ctx.fields.append(name)
            ctx.struct = self.name
            result[name] = self.fields[name].decode(value, ctx)
            ctx.fields.pop()
            ctx.struct = outer
        return result


class _Pointer(_Type):
    """A pointer to a struct: null is nil (None), anything else the struct."""

    def __init__(self, target: _Struct) -> None:
        self.go_type = target.go_type
        self.target = target

    def decode(self, node: _Node, ctx: _Context) -> Any:
        return None if node.kind == "null" else self.target.decode(node, ctx)


def _sort_order(text: str) -> bool:
    """Boruta's SortOrder: "ascending" (or empty) / "descending", any case;
    True is descending. (`asc` / `desc` are accepted too.)"""
    order = text.lower()
    if order in ("", "ascending", "asc"):
        return False
    if order in ("descending", "desc"):
        return True
    raise _Abort(ERR_WRONG_SORT_ORDER)


def _direction(text: str) -> bool:
    """Boruta's ListDirection: "forward" (or empty) / "backward", any case;
    True is backward."""
    direction = text.lower()
    if direction in ("", "forward"):
        return False
    if direction == "backward":
        return True
    raise _Abort(ERR_WRONG_LIST_DIRECTION)


_TIME = _Time()
_REQ_ID = _Uint("boruta.ReqID", 64)
_PRIORITY = _Uint("boruta.Priority", 8)
_GROUPS = _Slice("boruta.Groups", _String("boruta.Group"))
_CAPS = _Map("boruta.Capabilities", _String("string"))
_REQ_INFO = _Struct(
    "boruta.ReqInfo",
    [
        ("ID", _REQ_ID),
        ("Priority", _PRIORITY),
        ("Owner", _Struct("boruta.UserInfo", [("Groups", _GROUPS)])),
        ("Deadline", _TIME),
        ("ValidAfter", _TIME),
        ("State", _String("boruta.ReqState")),
        (
            "Job",
            _Pointer(
                _Struct(
                    "boruta.JobInfo",
                    [("WorkerUUID", _String("boruta.WorkerUUID")), ("Timeout", _TIME)],
                )
            ),
        ),
        ("Caps", _CAPS),
        # evergraph's addition (ignored by Boruta): a graph fragment for the job
        ("Fragment", _String("string")),
    ],
)
_SORTER = _Pointer(
    _Struct(
        "boruta.SortInfo",
        [("Item", _String("string")), ("Order", _Text("boruta.SortOrder", _sort_order))],
    )
)
_DIRECTION = _Text("boruta.ListDirection", _direction)
_LIMIT = _Uint("uint16", 16)
_REQUESTS_LIST = _Struct(
    "http.RequestsListSpec",
    [
        (
            "Filter",
            _Pointer(
                _Struct(
                    "filter.Requests",
                    [
                        ("IDs", _Slice("[]boruta.ReqID", _REQ_ID)),
                        ("Priorities", _Bytes("[]boruta.Priority", _PRIORITY)),
                        ("States", _Slice("[]boruta.ReqState", _String("boruta.ReqState"))),
                    ],
                )
            ),
        ),
        ("Sorter", _SORTER),
        (
            "Paginator",
            _Pointer(
                _Struct(
                    "boruta.RequestsPaginator",
                    [("ID", _REQ_ID), ("Direction", _DIRECTION), ("Limit", _LIMIT)],
                )
            ),
        ),
    ],
)
_WORKERS_LIST = _Struct(
    "http.WorkersListSpec",
    [
        (
            "Filter",
            _Pointer(_Struct("filter.Workers", [("Groups", _GROUPS), ("Capabilities", _CAPS)])),
        ),
        ("Sorter", _SORTER),
        (
            "Paginator",
            _Pointer(
                _Struct(
                    "boruta.WorkersPaginator",
                    [
                        ("ID", _String("boruta.WorkerUUID")),
                        ("Direction", _DIRECTION),
                        ("Limit", _LIMIT),
                    ],
                )
            ),
        ),
    ],
)
_WORKER_STATE_PACK = _Struct(
    "http.WorkerStatePack", [("WorkerState", _String("boruta.WorkerState"))]
)


def _decode(body: bytes, kind: _Type, *, empty_ok: bool) -> Any:
    """`body` decoded into `kind` as Go's `json.NewDecoder(body).Decode` does.

    An empty body is `kind`'s zero value where `empty_ok` (Boruta's list
    handlers), else 400 `no body provided in HTTP request`. Any other failure is
    400 `invalid request: <Go's message>`."""
    try:
        node = _Scanner(body).top()
        ctx = _Context()
        value = kind.decode(node, ctx)
    except _EOF:
        if empty_ok:
            return kind.zero()
        raise no_body() from None
    except _Abort as exc:
        raise invalid_request(str(exc)) from None
    if ctx.saved is not None:
        raise invalid_request(ctx.saved)
    return value


# ---------------------------------------------------------------- request bodies


def parse_req_id(text: str) -> int:
    """A request ID from a URL (Go's `strconv.ParseUint(s, 10, 64)`); else 400."""
    if text.isascii() and text.isdigit() and int(text) < 1 << 64:
        return int(text)
    raise invalid_request(BAD_ID)


_UUID_RE = re.compile(r"[0-9a-f]{8}-(?:[0-9a-f]{4}-){3}[0-9a-f]{12}")


def parse_worker_uuid(text: str) -> str:
    """A worker UUID from a URL (lowercase hex, Boruta's pattern); else 400."""
    if _UUID_RE.fullmatch(text) is None:
        raise invalid_request(BAD_UUID)
    return text


@dataclass(frozen=True)
class NewRequestSpec:
    """A `POST /api/v1/reqs/` body: what Boruta's NewRequest takes from it (the
    owner comes from the caller's token, never the body)."""

    priority: int
    caps: dict[str, str] = field(default_factory=dict)
    valid_after: float = 0.0
    """0 = unset (Boruta: now)."""
    deadline: float = 0.0
    """0 = unset (Boruta: a month from now)."""
    fragment: str = ""
    """evergraph's addition: YAML applied on the worker for the job's lifetime."""


def check_new_request(spec: NewRequestSpec, now: float) -> None:
    """Boruta's NewRequest checks, in its order: a set deadline not in the past,
    valid_after not after a set deadline, priority 1..16. Raises 400."""
    if spec.deadline and spec.deadline < now:
        raise invalid_request(ERR_DEADLINE_IN_THE_PAST)
    if spec.deadline and spec.valid_after and spec.valid_after > spec.deadline:
        raise invalid_request(ERR_INVALID_TIME_RANGE)
    if not HIGHEST_PRIORITY <= spec.priority <= LOWEST_PRIORITY:
        raise invalid_request(ERR_PRIORITY)


def parse_new_request(body: bytes, now: float | None = None) -> NewRequestSpec:
    """Read a create body (a `ReqInfo`; only Priority, Caps, ValidAfter and
    Deadline count). With `now`, also `check_new_request`."""
    info = _decode(body, _REQ_INFO, empty_ok=False)
    spec = NewRequestSpec(
        priority=info["Priority"],
        caps=dict(info["Caps"] or {}),
        valid_after=info["ValidAfter"],
        deadline=info["Deadline"],
        fragment=info["Fragment"],
    )
    if now is not None:
        check_new_request(spec, now)
    return spec


@dataclass(frozen=True)
class UpdateSpec:
    """A `POST /api/v1/reqs/{id}` body; 0 in a field = leave it as it is."""

    id: int
    priority: int = 0
    valid_after: float = 0.0
    deadline: float = 0.0

    @property
    def empty(self) -> bool:
        """Nothing to change: Boruta answers 204 without looking the request up."""
        return not self.priority and not self.valid_after and not self.deadline


def parse_update_request(body: bytes, url_id: int) -> UpdateSpec:
    """Read an update body (a `ReqInfo`: Priority, ValidAfter, Deadline; an ID, if
    set, must be the URL's: else 400 `invalid request: request ID set in JSON
    doesn't match ID from URL`)."""
    info = _decode(body, _REQ_INFO, empty_ok=False)
    if info["ID"] and info["ID"] != url_id:
        raise invalid_request(ID_MISMATCH)
    return UpdateSpec(
        id=url_id,
        priority=info["Priority"],
        valid_after=info["ValidAfter"],
        deadline=info["Deadline"],
    )


def check_update_request(spec: UpdateSpec, req: Request, now: float) -> bool:
    """Boruta's UpdateRequest checks against the stored request, in its order
    (the caller answers 404 for a missing request first, unless `spec.empty`):
    only a WAITING request (else `action cannot be executed in current state`),
    priority 0 or 1..16, a set deadline not in the past, a set valid_after not
    after the (new or kept) deadline. Raises 400; returns whether anything
    changes."""
    if spec.empty:
        return False
    if _wire_state(req.state) != WAITING:
        raise invalid_request(ERR_MODIFICATION_FORBIDDEN)
    if (spec.priority, spec.valid_after, spec.deadline) == (
        req.priority,
        req.valid_after,
        req.deadline,
    ):
        return False
    if spec.priority and not HIGHEST_PRIORITY <= spec.priority <= LOWEST_PRIORITY:
        raise invalid_request(ERR_PRIORITY)
    deadline = req.deadline
    if spec.deadline:
        if spec.deadline < now:
            raise invalid_request(ERR_DEADLINE_IN_THE_PAST)
        deadline = spec.deadline
    if spec.valid_after and deadline and spec.valid_after > deadline:
        raise invalid_request(ERR_INVALID_TIME_RANGE)
    return True


def parse_set_state(body: bytes) -> str:
    """Read a setstate body `{"WorkerState": "IDLE" | "MAINTENANCE"}`; another
    state is 400 (Boruta refuses it before looking the worker up)."""
    state = _decode(body, _WORKER_STATE_PACK, empty_ok=False)["WorkerState"]
    if state not in (IDLE, MAINTENANCE):
        raise invalid_request(ERR_WRONG_STATE_ARGUMENT)
    return str(state)


def parse_set_groups(body: bytes) -> list[str]:
    """Read a setgroups body: a JSON list of group names (null: none)."""
    groups = _decode(body, _GROUPS, empty_ok=False)
    return list(groups or [])


# ---------------------------------------------------------------- list bodies


@dataclass(frozen=True)
class Sorter:
    """What to sort a list by (Boruta's SortInfo), the item lowercased; ties are
    broken by ID (UUID), in the same order."""

    item: str = ""
    descending: bool = False


@dataclass(frozen=True)
class RequestsFilter:
    """Requests whose ID, priority and state are each among the given ones (an
    empty tuple does not filter). States are compared uppercased."""

    ids: tuple[int, ...] = ()
    priorities: tuple[int, ...] = ()
    states: tuple[str, ...] = ()

    def matches(self, r: Request) -> bool:
        return (
            (not self.ids or r.id in self.ids)
            and (not self.priorities or r.priority in self.priorities)
            and (not self.states or _wire_state(r.state) in self.states)
        )


@dataclass(frozen=True)
class WorkersFilter:
    """Workers in any of the groups (none: any) that have every capability with
    exactly the value given (Boruta's list filter; the UUID is a capability)."""

    groups: tuple[str, ...] = ()
    caps: Mapping[str, str] = field(default_factory=dict)

    def matches(self, w: Worker) -> bool:
        if self.groups and not any(group in self.groups for group in w.groups):
            return False
        caps = worker_caps(w)
        return all(caps.get(key) == value for key, value in self.caps.items())


@dataclass(frozen=True)
class RequestsPaginator:
    """A page of `limit` requests after (or, `backward`, before) the request
    `id` in the sorted list; id 0 = from the start (backward: the end)."""

    id: int = 0
    backward: bool = False
    limit: int = MAX_PAGE_LIMIT


@dataclass(frozen=True)
class WorkersPaginator:
    """As `RequestsPaginator`, by worker UUID ("" = from the start / the end)."""

    id: str = ""
    backward: bool = False
    limit: int = MAX_PAGE_LIMIT


@dataclass(frozen=True)
class RequestsListSpec:
    filter: RequestsFilter | None = None
    sorter: Sorter | None = None
    paginator: RequestsPaginator | None = None


@dataclass(frozen=True)
class WorkersListSpec:
    filter: WorkersFilter | None = None
    sorter: Sorter | None = None
    paginator: WorkersPaginator | None = None


REQUEST_SORT_ITEMS: Final = frozenset({"", "id", "priority", "deadline", "validafter", "state"})
WORKER_SORT_ITEMS: Final = frozenset({"", "uuid", "state", "groups"})


def _sorter(raw: dict[str, Any] | None, items: frozenset[str]) -> Sorter | None:
    if raw is None:
        return None
    item = str(raw["Item"]).lower()
    if item not in items:
        raise invalid_request(ERR_WRONG_SORT_ITEM)
    return Sorter(item=item, descending=bool(raw["Order"]))


def _limit(limit: int) -> int:
    return limit if 0 < limit <= MAX_PAGE_LIMIT else MAX_PAGE_LIMIT


def parse_requests_list(body: bytes) -> RequestsListSpec:
    """Read a `POST /api/v1/reqs/list` body `{"Filter": {"IDs", "Priorities",
    "States"}, "Sorter": {"Item", "Order"}, "Paginator": {"ID", "Direction",
    "Limit"}}`, any part null or missing; an empty body lists everything.
    Sort items: id (default), priority, deadline, validafter, state."""
    raw = _decode(body, _REQUESTS_LIST, empty_ok=True)
    flt, pag = raw["Filter"], raw["Paginator"]
    return RequestsListSpec(
        filter=None
        if flt is None
        else RequestsFilter(
            ids=tuple(flt["IDs"] or ()),
            priorities=tuple(flt["Priorities"] or ()),
            states=tuple(str(s).strip().upper() for s in flt["States"] or ()),
        ),
        sorter=_sorter(raw["Sorter"], REQUEST_SORT_ITEMS),
        paginator=None
        if pag is None
        else RequestsPaginator(
            id=pag["ID"], backward=bool(pag["Direction"]), limit=_limit(pag["Limit"])
        ),
    )


def parse_workers_list(body: bytes) -> WorkersListSpec:
    """Read a `POST /api/v1/workers/list` body `{"Filter": {"Groups",
    "Capabilities"}, "Sorter": {"Item", "Order"}, "Paginator": {"ID",
    "Direction", "Limit"}}`, any part null or missing; an empty body lists
    everything. Sort items: uuid (default), state, groups."""
    raw = _decode(body, _WORKERS_LIST, empty_ok=True)
    flt, pag = raw["Filter"], raw["Paginator"]
    return WorkersListSpec(
        filter=None
        if flt is None
        else WorkersFilter(groups=tuple(flt["Groups"] or ()), caps=dict(flt["Capabilities"] or {})),
        sorter=_sorter(raw["Sorter"], WORKER_SORT_ITEMS),
        paginator=None
        if pag is None
        else WorkersPaginator(
            id=pag["ID"], backward=bool(pag["Direction"]), limit=_limit(pag["Limit"])
        ),
    )


# ---------------------------------------------------------------- listing


_Item = TypeVar("_Item")
_Item_contra = TypeVar("_Item_contra", contravariant=True)


def _time_key(t: float) -> float:
    return t if t else float(_ZERO_EPOCH)


_REQUEST_KEYS: dict[str, Callable[[Request], Any]] = {
    "": lambda r: r.id,
    "id": lambda r: r.id,
    "priority": lambda r: (r.priority, r.id),
    "deadline": lambda r: (_time_key(r.deadline), r.id),
    "validafter": lambda r: (_time_key(r.valid_after), r.id),
    "state": lambda r: (_wire_state(r.state), r.id),
}
_WORKER_KEYS: dict[str, Callable[[Worker], Any]] = {
    "": lambda w: w.uuid,
    "uuid": lambda w: w.uuid,
    "state": lambda w: (w.state, w.uuid),
    "groups": lambda w: (list(w.groups), w.uuid),
}


def _page(
    matching: list[_Item],
    pivot: _Item | None,
    pivot_matches: bool,
    backward: bool,
    limit: int,
) -> tuple[list[_Item], int, int]:
    """Boruta's paging of a sorted list that holds the pivot (the item whose ID
    the paginator names), whether or not it matches the filter."""
    count = len(matching)
    if not count:
        return [], 0, 0
    index = 0
    if pivot is not None:
        index = next(i for i, item in enumerate(matching) if item is pivot)
    if backward:
        if pivot is None:
            index = count
        size = min(limit, index)
        remaining = index - size
        index -= size
    else:
        if pivot is not None:
            index += 1
        size = min(limit, count - index)
        remaining = count - index - size
    total = count if pivot_matches else count - 1
    return matching[index : index + size], total, remaining


class _Filter(Protocol[_Item_contra]):
    def matches(self, item: _Item_contra) -> bool: ...


def _list(
    items: Iterable[_Item],
    ident: Callable[[_Item], object],
    pid: object,
    filter: _Filter[_Item] | None,
    key: Callable[[_Item], Any],
    descending: bool,
    backward: bool,
    limit: int,
    what: str,
) -> tuple[list[_Item], int, int]:
    """One page of `items` matching `filter`, sorted by `key`; the pivot `pid`
    (falsy: none) is kept even if the filter drops it. 404 `<what> not found` for
    an unknown pivot."""
    pivot: _Item | None = None
    matching: list[_Item] = []
    for item in items:
        if pid and ident(item) == pid:
            pivot = item
            matching.append(item)
        elif filter is None or filter.matches(item):
            matching.append(item)
    if pid and pivot is None:
        raise not_found(what)
    matching.sort(key=key, reverse=descending)
    kept = pivot is None or filter is None or filter.matches(pivot)
    return _page(matching, pivot, kept, backward, limit)


def list_requests(
    items: Iterable[Request],
    filter: RequestsFilter | None = None,
    sorter: Sorter | None = None,
    paginator: RequestsPaginator | None = None,
) -> tuple[list[Request], int, int]:
    """One page of the requests matching `filter`, sorted: (page, total matching,
    remaining after the page in its direction). `items` are all the requests the
    caller may see; a paginator naming none of them is 404 `request not found`."""
    sorter = sorter or Sorter()
    return _list(
        items,
        lambda r: r.id,
        paginator.id if paginator is not None else 0,
        filter,
        _REQUEST_KEYS[sorter.item],
        sorter.descending,
        paginator is not None and paginator.backward,
        _limit(paginator.limit) if paginator is not None else MAX_PAGE_LIMIT,
        "request",
    )


def list_workers(
    items: Iterable[Worker],
    filter: WorkersFilter | None = None,
    sorter: Sorter | None = None,
    paginator: WorkersPaginator | None = None,
) -> tuple[list[Worker], int, int]:
    """As `list_requests`, for workers (paged by UUID; an unknown one is 404
    `worker not found`)."""
    sorter = sorter or Sorter()
    return _list(
        items,
        lambda w: w.uuid,
        paginator.id if paginator is not None else "",
        filter,
        _WORKER_KEYS[sorter.item],
        sorter.descending,
        paginator is not None and paginator.backward,
        _limit(paginator.limit) if paginator is not None else MAX_PAGE_LIMIT,
        "worker",
    )
