"""What a run changed, or would change: from what resources report to `Change`s.

A resource reports each difference it finds through `handle.changed(field, old,
new)` at the point it decides something differs, before applying (so a noop
run reports too). The vertex keeps the raw reports of the run under way; only
when the run turns out to have changed something does the engine make them
`Change`s here: values as text, secrets masked, and for content a unified diff.
A run that changed nothing costs nothing here.

Diffs are built when someone will read them: under noop (global or
`meta.noop`) and with `run --diff`. A plain real run records content changes
as sizes only: 10k files written at start-up would otherwise pay for 10k
diffs nobody asked for.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from functools import lru_cache
from typing import Any

from evergraph.engine.masking import MASK
from evergraph.engine.status import Change

#: a content diff is cut after this many lines, or this many bytes
DIFF_MAX_LINES = 200
DIFF_MAX_BYTES = 64 * 1024
#: content larger than this is not compared: difflib's time grows faster than its input
DIFF_INPUT_MAX = 4 * 1024 * 1024
#: a value shown as text is cut after this many characters
VALUE_MAX = 4096

#: one report of a run: (field, old, new, content)
Report = tuple[str, object, object, bool]


def value_text(value: object) -> str | None:
    """A reported value as text: None stays None (absent or unset), a bool is
    `true`/`false`, a list its items joined by `, `; cut past `VALUE_MAX`."""
    if value is None:
        return None
    if isinstance(value, str):
        text = value
    elif isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, bytes):
        text = value.decode("utf-8", "replace")
    elif isinstance(value, list | tuple | set | frozenset):
        text = ", ".join(str(x) for x in value)
    else:
        text = str(value)
    if len(text) > VALUE_MAX:
        text = f"{text[:VALUE_MAX]}… ({len(text) - VALUE_MAX} more characters)"
    return text


def _text(value: object) -> str | None:
    """`value_text`, with the common case (a short str) first: 10k files apply at once."""
    if type(value) is str and len(value) <= VALUE_MAX:
        return value
    return value_text(value)


def _as_bytes(data: object) -> bytes | None:
    if data is None:
        return None
    if isinstance(data, bytes):
        return data
    return str(data).encode("utf-8", "surrogateescape")


def size_text(data: bytes | None) -> str | None:
    """Content as its size, `12 bytes` (None: there is none)."""
    if data is None:
        return None
    return "1 byte" if len(data) == 1 else f"{len(data)} bytes"


def _lines(data: bytes) -> list[str] | None:
    """Text lines (ends kept), or None for binary content (a NUL, or not UTF-8)."""
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8").splitlines(keepends=True)
    except UnicodeDecodeError:
        return None


def content_diff(old: bytes | None, new: bytes | None, label: str) -> str:
    """A unified diff from `old` to `new` (None: absent), cut past `DIFF_MAX_LINES`
    lines or `DIFF_MAX_BYTES` bytes with a `… N more lines` marker. Binary content
    is summed up as `binary, N bytes → M bytes` instead."""
    a, b = old or b"", new or b""
    la, lb = _lines(a), _lines(b)
    if la is None or lb is None:
        return f"binary, {size_text(a)} → {size_text(b)}"
    if len(a) > DIFF_INPUT_MAX or len(b) > DIFF_INPUT_MAX:
        return f"too large to compare, {size_text(a)} → {size_text(b)}"
    import difflib  # only where a diff is wanted

    out: list[str] = []
    size = more = 0
    before = f"{label} (current)" if old is not None else "/dev/null"
    after = f"{label} (declared)" if new is not None else "/dev/null"
    for line in difflib.unified_diff(la, lb, before, after):
        shown = [line[:-1]] if line.endswith("\n") else [line, "\\ No newline at end of file"]
        if more or len(out) + len(shown) > DIFF_MAX_LINES or size + len(line) > DIFF_MAX_BYTES:
            more += 1
            continue
        out.extend(shown)
        size += len(line)
    if more:
        out.append(f"… {more} more lines")
    return "\n".join(out)


#: (the `_change` and `_changes` memos below: a vertex keeps what its last change
#: changed, and a first apply of 10k files makes as many `content` and `mode` changes
#: from none to the same few sizes and one mode: equal values are one object, shared
#: (they are immutable), not 10k; ~270 bytes a changed vertex)
MEMO_SIZE = 1024
#: values longer than this are not memoised (`_change`)
_SHORT = 64


@lru_cache(maxsize=MEMO_SIZE)
def _change(field: str, old: str | None, new: str | None) -> Change:
    return Change(field, old, new)


@lru_cache(maxsize=MEMO_SIZE)
def _changes(changes: tuple[Change, ...]) -> tuple[Change, ...]:
    return changes


def build(
    reports: Iterable[Report],
    secret_fields: Collection[str],
    mask: Callable[[str], str],
    diffs: bool,
) -> tuple[Change, ...]:
    """The `Change`s of a run's reports. A field holding a received secret shows
    as `MASK` whole (never a diff of it); every other text goes through `mask`
    (the secrets the vertex knows). `diffs`: build unified diffs of content."""
    out = []
    alike = True  # every Change is a memoised one: so may the tuple be
    for field, old, new, content in reports:
        if field in secret_fields:
            out.append(_change(field, None if old is None else MASK, None if new is None else MASK))
            continue
        if content:
            a, b = _as_bytes(old), _as_bytes(new)
            if diffs:
                out.append(
                    Change(field, size_text(a), size_text(b), mask(content_diff(a, b, field)))
                )
                alike = False
            else:
                out.append(_change(field, size_text(a), size_text(b)))
            continue
        o, n = _text(old), _text(new)
        if (o is None or len(o) <= _SHORT) and (n is None or len(n) <= _SHORT):
            out.append(
                _change(field, None if o is None else mask(o), None if n is None else mask(n))
            )
        else:  # (long values are rarely alike: not memoised, nor kept alive by the memo)
            out.append(
                Change(field, None if o is None else mask(o), None if n is None else mask(n))
            )
            alike = False
    return _changes(tuple(out)) if alike else tuple(out)


def shape(reports: Sequence[Report], diffs: bool) -> tuple[object, ...]:
    """What `build` makes of `reports` depends on, with no secret field and no mask:
    two reports of one shape build equal `Change`s. A content's value is only its
    size there (no diff wanted): 10k files made apply alike, each content other."""
    if diffs:
        return tuple(reports)
    out: list[object] = []
    for field, old, new, content in reports:
        if content:
            a, b = _as_bytes(old), _as_bytes(new)
            out.append((field, None if a is None else len(a), None if b is None else len(b), True))
        else:
            out.append((field, old, new, False))
    return tuple(out)


def _shown(text: str | None, keep: str = "") -> str:
    """A value on one log line: absent as `(none)`; line breaks and other
    unprintable characters (but those in `keep`) escaped, so that no content
    can drive the terminal."""
    if text is None:
        return "(none)"
    if text.isprintable():
        return text
    return "".join(
        c if c.isprintable() or c in keep else c.encode("unicode_escape").decode() for c in text
    )


#: fields named on a vertex's "applied" line, at most
SUMMARY_MAX = 8


#: the last tuple `summary` was given, and its summary: the changes of a first
#: apply's files are one tuple, shared (`_changes`)
_summarised: tuple[tuple[Change, ...], str] | None = None


def summary(changes: Sequence[Change]) -> str:
    """The fields changed, once each, in order: `content, mode` (`… N more` past
    `SUMMARY_MAX`)."""
    global _summarised
    last = _summarised
    if last is not None and last[0] is changes:
        return last[1]
    fields = [c.field for c in changes]
    if len(fields) <= SUMMARY_MAX and len(set(fields)) == len(fields):
        text = ", ".join(fields)  # the common case, kept lean
        if not text.isprintable():
            text = _shown(text)
    else:
        fields = list(dict.fromkeys(fields))
        text = ", ".join(_shown(f) for f in fields[:SUMMARY_MAX])
        if len(fields) > SUMMARY_MAX:
            text = f"{text}, … {len(fields) - SUMMARY_MAX} more"
    if type(changes) is tuple:  # (immutable: the same object, the same summary)
        _summarised = (changes, text)
    return text


def lines(changes: Sequence[Change], *, diffs: bool) -> list[str]:
    """Log lines for `changes`, indented under the vertex's line: `field: old → new`,
    then (with `diffs`) the content diff indented once more."""
    out = []
    for c in changes:
        out.append(f"  {_shown(c.field)}: {_shown(c.old)} → {_shown(c.new)}")
        if diffs and c.diff:
            out.extend("    " + _shown(line, keep="\t") for line in c.diff.split("\n"))
    return out


def record_data(
    ident: str, noop: bool, changes: Sequence[Change], notify: list[str], send: list[str]
) -> dict[str, Any]:
    """The structured form of a vertex's "applied" or "would change" log record (its
    `extra={"data": ...}`, which JSON logs carry as fields): `event` "changed",
    `resource`, `noop`, `changes` (field, old, new, and diff when there is one),
    `notify` (idents refreshed by the change), `send` (`value → ident.field`)."""
    return {
        "event": "changed",
        "resource": ident,
        "noop": noop,
        "changes": [
            {"field": c.field, "old": c.old, "new": c.new, "diff": c.diff}
            if c.diff is not None
            else {"field": c.field, "old": c.old, "new": c.new}
            for c in changes
        ],
        "notify": notify,
        "send": send,
    }


# -- log records with structured data ----------------------------------------------
class DataRecord(logging.LogRecord):
    """A log record whose structured `data` (what `extra={"data": ...}` gives a plain
    record: JSON logs carry it as fields) is made when first read: a text log never
    reads it, and a first apply of 10k files logs 10k changes and a recap of 10k."""

    @property
    def data(self) -> dict[str, Any]:
        made: dict[str, Any] | None = self.__dict__.get("_data")
        if made is None:
            made = self.__dict__["_data"] = self.__dict__["_make_data"]()
        return made

    @property
    def data_event(self) -> str | None:
        """The data's `event` ("changed", "recap"), said without making the data (a
        terminal colours a recap's lines by it)."""
        event: str | None = self.__dict__.get("_event")
        return event


_alike: dict[str, Any] | None = None


def _record_alike() -> dict[str, Any]:
    """What every record made by `log_data` holds alike: a record `LogRecord` made
    once, with no caller, thread nor process looked up (as `setup_logging` asks),
    so that every attribute this Python's records have is there."""
    global _alike
    if _alike is None:
        made = logging.LogRecord("", logging.INFO, "(unknown file)", 0, "", (), None)
        _alike = {**made.__dict__, "funcName": "(unknown function)"}  # (as Logger.info's)
    return _alike


def _plain_records() -> bool:
    """Whether a record made here is what `Logger.info` would make: no caller,
    thread or process looked up (`cli/logs.setup_logging`), and no other record
    factory or logger class."""
    return (
        logging._srcfile is None
        and not logging.logThreads
        and not logging.logProcesses
        and not logging.logMultiprocessing
        and logging.getLogRecordFactory() is logging.LogRecord
    )


#: a record for `log_batch`: `log_data`'s msg, args and data
Entry = tuple[str, tuple[object, ...], Callable[[], dict[str, Any]]]


def log_data(
    logger: logging.Logger,
    msg: str,
    args: tuple[object, ...],
    data: Callable[[], dict[str, Any]],
    effect: bool | None = None,
    event: str | None = None,
) -> None:
    """`logger.info(msg, *args, extra={"data": data(), "effect": effect})` (no
    `effect` key when None), the record made directly (`DataRecord`, whose
    `data_event` is `event`, the data's own) when the logging set-up allows, its
    `data()` called only if a handler reads it: a
    changed vertex logs one such record, and `Logger.info` made up a sixth of the
    CPU of a first apply of 10k files. Level, filters, handlers and propagation are
    `Logger.handle`'s, as for any record."""
    if not logger.isEnabledFor(logging.INFO):
        return
    if type(logger).makeRecord is not logging.Logger.makeRecord or not _plain_records():
        extra: dict[str, Any] = {"data": data()}  # (in-process tests: the general path)
        if effect is not None:
            extra["effect"] = effect
        logger.info(msg, *args, extra=extra)
        return
    logger.handle(_record(_base(logger, effect, event), msg, args, data))


def log_batch(logger: logging.Logger, entries: Sequence[Entry], event: str | None = None) -> None:
    """`log_data` of each entry, in order, none of them an effect (not written
    through): the changes a child made ahead, 10k at a first apply, whose logging
    was a third of the parent's CPU while the children made them. Each handler that
    takes records together (`handle_many`, cli/logs.py: one write for them all) is
    given them so; the others, `handle` of each. Level, filters, handlers and
    propagation are those `Logger.handle` applies to each record."""
    if not entries or not logger.isEnabledFor(logging.INFO):
        return
    handlers = _handlers(logger)
    if (
        handlers is None
        or type(logger).makeRecord is not logging.Logger.makeRecord
        or not _plain_records()
    ):
        for msg, args, data in entries:
            log_data(logger, msg, args, data, effect=False, event=event)
        return
    # a handler that writes text lines of its own (`handle_entries`: cli/logs.py)
    # takes the messages alone, at one time, with no record made for it
    created = time.time()
    lines = [(msg, args) for msg, args, _ in entries]
    rest = []
    for h in handlers:
        take = getattr(h, "handle_entries", None)
        if take is None or h.filters or not take(created, lines):
            rest.append(h)
    if not rest:
        return
    base = _base(logger, False, event)
    records = [_record(base, msg, args, data) for msg, args, data in entries]
    for h in rest:
        many = getattr(h, "handle_many", None)
        if many is not None and not h.filters:
            many(records)
            continue
        for record in records:
            h.handle(record)


def _handlers(logger: logging.Logger) -> list[logging.Handler] | None:
    """The handlers `Logger.handle` gives an INFO record of `logger` (None: the
    logger is disabled or filters records, or no handler takes it, so that
    `logging.lastResort` would: each record goes through `handle`)."""
    if logger.disabled or logger.filters:
        return None
    found: list[logging.Handler] = []
    c: logging.Logger | None = logger
    while c is not None:
        found.extend(h for h in c.handlers if h.level <= logging.INFO)
        if not c.propagate:
            break
        c = c.parent
    return found or None


#: `_base` per logger name, effect, event and INFO's level name (a few: kept)
_bases: dict[tuple[str, bool | None, str | None, str], dict[str, Any]] = {}


def _base(logger: logging.Logger, effect: bool | None, event: str | None) -> dict[str, Any]:
    """What the INFO records of `logger` made by `_record` with this `effect` and
    `event` hold alike (all but their message, data and time); never changed."""
    levelname = logging.getLevelName(logging.INFO)
    key = (logger.name, effect, event, levelname)
    base = _bases.get(key)
    if base is None:
        base = dict(_record_alike())
        base["name"] = logger.name
        base["levelname"] = levelname
        base["levelno"] = logging.INFO
        base["_make_data"] = None
        base["_event"] = event
        if effect is not None:
            base["effect"] = effect
        if len(_bases) < 64:
            _bases[key] = base
    return base


def _record(
    base: dict[str, Any],
    msg: str,
    args: tuple[object, ...],
    data: Callable[[], dict[str, Any]],
) -> DataRecord:
    """The INFO record `logger.info` would make (`_plain_records`) from its `_base`,
    its data made when read."""
    created = time.time()
    record = DataRecord.__new__(DataRecord)
    d = record.__dict__
    d.update(base)
    d["msg"] = msg
    d["args"] = args
    d["created"] = created
    d["msecs"] = int((created - int(created)) * 1000) + 0.0
    d["relativeCreated"] = (created - logging._startTime) * 1000  # type: ignore[attr-defined]
    d["_make_data"] = data
    return record
