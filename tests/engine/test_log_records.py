"""A changed vertex's log record and the recap's, made cheaply (issue 28: recording a
first apply of 10k files): under the CLI's logging set-up the engine makes them
directly (`changes.log_data`), not through `Logger.info`, and their structured
`data` is made only when a handler reads it (JSON does; text never does). What
handlers see is the same as before: the same record attributes, messages, `effect`
flag and data, the same text and JSON lines."""

from __future__ import annotations

import asyncio
import io
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from evergraph.cli import logs
from evergraph.engine import changes, recap
from evergraph.engine.changes import DataRecord, log_batch, log_data
from evergraph.engine.engine import Engine
from evergraph.engine.prepare import prepare
from evergraph.engine.recap import Recaps
from evergraph.engine.settings import Settings
from evergraph.frontends.open import builtin_registry
from evergraph.frontends.yaml import parse_yaml

#: what differs between two records made at two moments
WHEN = {"created", "msecs", "relativeCreated"}


class _Keep(logging.Handler):
    """Keeps each record and its formatted line."""

    def __init__(self, formatter: logging.Formatter) -> None:
        super().__init__()
        self.setFormatter(formatter)
        self.records: list[logging.LogRecord] = []
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        self.lines.append(self.format(record))


@pytest.fixture
def cli_logging() -> Iterator[None]:
    """The CLI's logging set-up (`setup_logging`), undone after the test."""
    saved = (
        logging._srcfile,
        logging.logThreads,
        logging.logProcesses,
        logging.logMultiprocessing,
    )
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    made: list[logging.Handler] = []
    globals_ = (logs._buffered, logs._terminal)
    try:
        logs.setup_logging("text", 0)
        made = root.handlers[:]
        yield
    finally:
        for h in made:
            h.close()
            if isinstance(h, logging.StreamHandler):
                h.stream.close()  # (its own copy of stderr's descriptor)
        logs._buffered, logs._terminal = globals_
        root.handlers[:] = handlers
        root.setLevel(level)
        (
            logging._srcfile,
            logging.logThreads,
            logging.logProcesses,
            logging.logMultiprocessing,
        ) = saved


def _use(*handlers: logging.Handler) -> None:
    logging.getLogger().handlers[:] = list(handlers)


def _plain(record: logging.LogRecord) -> dict[str, Any]:
    out = {k: v for k, v in record.__dict__.items() if k not in WHEN and not k.startswith("_")}
    out.pop("data", None)
    return out


@pytest.mark.usefixtures("cli_logging")
@pytest.mark.parametrize("effect", [True, False, None])
def test_a_record_made_directly_is_the_one_logger_info_makes(effect: bool | None) -> None:
    text, js = _Keep(logs.TextFormatter()), _Keep(logs.JsonFormatter())
    _use(text, js)
    log = logging.getLogger("evergraph.engine")
    data = changes.record_data("file[a]", False, (), ["exec[r]"], [])
    extra: dict[str, Any] = {"data": data}
    if effect is not None:
        extra["effect"] = effect
    log.info("%s: %s", "file[a]", "applied", extra=extra)
    log_data(log, "%s: %s", ("file[a]", "applied"), lambda: dict(data), effect=effect)
    before, after = text.records
    assert type(after) is DataRecord  # made directly: the CLI's set-up allows it
    assert _plain(after) == _plain(before)
    assert after.__dict__.get("effect") == before.__dict__.get("effect")
    assert after.data == before.data == data  # type: ignore[attr-defined]
    assert after.getMessage() == before.getMessage() == "file[a]: applied"
    # the lines written: text (after the time) and JSON (but its time) alike
    assert text.lines[1].split(" ", 1)[1] == text.lines[0].split(" ", 1)[1]
    one, two = (json.loads(line) for line in js.lines)
    one.pop("ts")
    two.pop("ts")
    assert one == two
    assert one["notify"] == ["exec[r]"]
    assert one["event"] == "changed"


@pytest.mark.usefixtures("cli_logging")
def test_the_data_is_made_only_for_a_handler_that_reads_it() -> None:
    made: list[int] = []

    def data() -> dict[str, Any]:
        made.append(1)
        return {"event": "recap", "changed": []}

    log = logging.getLogger("evergraph.engine")
    stream = io.StringIO()
    buffered = logs.BufferedHandler(stream)
    buffered.setFormatter(logs.TextFormatter())
    _use(buffered)
    log_data(log, "%s", ("recap: nothing changed or failed, 0 clean",), data, effect=True)
    assert stream.getvalue().endswith(" recap: nothing changed or failed, 0 clean\n")
    assert made == [], "a text log never reads the data"
    first, second = _Keep(logs.JsonFormatter()), _Keep(logs.JsonFormatter())
    _use(first, second)
    log_data(log, "%s", ("recap: x",), data)
    assert made == [1], "made once, whoever reads it"
    assert json.loads(first.lines[0])["event"] == "recap"
    assert first.lines == second.lines
    # below the logger's level: no record at all
    log.setLevel(logging.WARNING)
    try:
        log_data(log, "%s", ("dropped",), data)
    finally:
        log.setLevel(logging.NOTSET)
    assert len(first.records) == 1


class _Drop(logging.Filter):
    """Drops the records whose message holds `word`."""

    def __init__(self, word: str) -> None:
        super().__init__()
        self.word = word

    def filter(self, record: logging.LogRecord) -> bool:
        return self.word not in record.getMessage()


def _entries(n: int) -> list[changes.Entry]:
    return [
        (
            "%s",
            (f"file[f{i}]: applied: state, content, mode",),
            lambda i=i: changes.record_data(f"file[f{i}]", False, (), [], []),  # type: ignore[misc]
        )
        for i in range(n)
    ]


@pytest.mark.usefixtures("cli_logging")
@pytest.mark.parametrize("where", ["none", "logger", "handler"])
def test_a_batch_gives_every_handler_what_each_record_alone_would(where: str) -> None:
    """`log_batch` (the lines of what the children made, one write) against
    `log_data` of each entry: the same records, text and JSON lines, in order, to a
    handler that takes them together (BufferedHandler) and to one that does not; a
    filter (the logger's, a handler's) and a handler's level still apply."""
    log = logging.getLogger("evergraph.engine.batch")
    outs: dict[str, tuple[io.StringIO, io.StringIO, _Keep, _Keep]] = {}
    for how in ("each", "batch"):
        text_out, json_out = io.StringIO(), io.StringIO()
        text, js = logs.BufferedHandler(text_out), logs.BufferedHandler(json_out)
        text.setFormatter(logs.TextFormatter())
        js.setFormatter(logs.JsonFormatter())
        keep, quiet = _Keep(logs.TextFormatter()), _Keep(logs.TextFormatter())
        quiet.setLevel(logging.WARNING)  # given none of them
        if where == "handler":
            text.addFilter(_Drop("f3]"))
            keep.addFilter(_Drop("f3]"))
        _use(text, js, keep, quiet)
        if where == "logger":
            log.addFilter(_Drop("f3]"))
        try:
            if how == "each":
                for msg, args, data in _entries(7):
                    log_data(log, msg, args, data, effect=False, event="changed")
            else:
                log_batch(log, _entries(7), event="changed")
        finally:
            log.filters.clear()
        outs[how] = (text_out, json_out, keep, quiet)
    (t1, j1, k1, q1), (t2, j2, k2, q2) = outs["each"], outs["batch"]
    after_time = [line.split(" ", 1)[1] for line in t1.getvalue().splitlines()]
    assert [line.split(" ", 1)[1] for line in t2.getvalue().splitlines()] == after_time
    want = [f"file[f{i}]: applied: state, content, mode" for i in range(7)]
    if where != "none":
        want.remove("file[f3]: applied: state, content, mode")
    assert after_time == want
    one = [json.loads(x) for x in j1.getvalue().splitlines()]
    two = [json.loads(x) for x in j2.getvalue().splitlines()]
    for x in (*one, *two):
        x.pop("ts")
    assert one == two
    assert len(one) == (6 if where == "logger" else 7)
    assert [_plain(r) for r in k2.records] == [_plain(r) for r in k1.records]
    assert all(r.__dict__["effect"] is False for r in k2.records)
    assert q1.records == q2.records == []


@pytest.mark.parametrize(
    "created", [1_800_000_000.0, 1_800_000_000.9995, 1_800_000_059.001], ids=["0ms", "999ms", "1ms"]
)
def test_a_text_handler_writes_a_batch_as_its_formatter_writes_each_record(
    created: float,
) -> None:
    """The lines of a batch written with no record made (`handle_entries`) are what
    the text formatter makes of each record made at that time: the same time stamp
    and, for names with control characters, line breaks or other unprintable text,
    the same escapes. A handler with another formatter or a filter takes none."""
    names = ["f0", "evil\x1b[2J", "two\nlines", "cr\rhere", "tab\tkept", "sep\u2028x", "ünï"]
    entries: list[tuple[str, tuple[object, ...]]] = [
        ("%s: %s", (f"file[{n}]", "applied")) for n in names
    ]
    entries.append(("%s", (f"file[{names[1]}]: applied: state, content, mode",)))
    entries.append(("plain, no args", ()))
    out = io.StringIO()
    handler = logs.BufferedHandler(out)
    handler.setFormatter(logs.TextFormatter())
    assert handler.handle_entries(created, entries)
    want = []
    for msg, args in entries:
        record = logging.LogRecord("evergraph.engine", logging.INFO, "", 0, msg, args, None)
        record.created, record.msecs = created, int((created - int(created)) * 1000) + 0.0
        want.append(logs.TextFormatter().format(record) + "\n")
    assert out.getvalue() == "".join(want)
    assert "\x1b" not in out.getvalue()
    assert "\r" not in out.getvalue()
    json_handler = logs.BufferedHandler(io.StringIO())
    json_handler.setFormatter(logs.JsonFormatter())
    assert not json_handler.handle_entries(created, [("%s", ("x",))])
    handler.addFilter(_Drop("x"))
    assert not handler.handle_entries(created, [("%s", ("x",))])
    assert json_handler.stream.getvalue() == ""
    assert out.getvalue() == "".join(want)


def _first_apply(tmp_path: Path, n: int) -> Engine:
    body = "".join(
        f'  - {{name: f{i}, path: {tmp_path}/t/f{i}, content: "{"x" * (i % 3)}\\n"}}\n'
        for i in range(n)
    )
    model = prepare(
        parse_yaml(f"graph: g\nresources:\n  file:\n{body}", "g.yaml", builtin_registry())
    )
    (tmp_path / "t").mkdir(parents=True)
    settings = Settings(
        state_dir=tmp_path / "s",
        hostname="test",
        converged_timeout=0,
        converged_exit=True,
        watch=False,
    )
    engine = Engine(settings)
    assert asyncio.run(engine.run(model)) == 0
    return engine


@pytest.mark.usefixtures("cli_logging")
def test_a_first_apply_logs_the_same_data_and_the_text_never_builds_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    built: list[int] = []
    real = recap._changed_list

    def counted(changed: list[Any]) -> list[dict[str, Any]]:
        built.append(len(changed))
        return real(changed)

    monkeypatch.setattr(recap, "_changed_list", counted)
    text = _Keep(logs.TextFormatter())
    _use(text)
    engine = _first_apply(tmp_path / "text", 7)
    assert built == [], "a text log builds no recap data"
    # the recap's text is the one the recap makes of the vertices as they are
    named, others = engine._recap_statuses()
    again, _ = Recaps().take(named, "converged", False, others)
    logged = next(r.getMessage() for r in text.records if r.getMessage().startswith("recap"))
    assert logged == again
    built.clear()  # (take made the data: it is eager)

    # JSON: every changed vertex's data and the recap's are those made eagerly
    js = _Keep(logs.JsonFormatter())
    _use(js)
    engine = _first_apply(tmp_path / "json", 7)
    assert built == [7]
    lines = [json.loads(line) for line in js.lines]
    named, others = engine._recap_statuses()
    _, expected = Recaps().take(named, "converged", False, others)
    [logged_recap] = [x for x in lines if x.get("event") == "recap"]
    assert {k: logged_recap[k] for k in expected} == expected
    assert len(expected["changed"]) == 7
    for v in engine.vertices.values():
        [rec] = [x for x in lines if x.get("event") == "changed" and x["resource"] == v.ident]
        want = changes.record_data(v.ident, False, v.changes, [], [])
        assert {k: rec[k] for k in want} == want
        assert rec["msg"] == f"{v.ident}: applied: state, content"


@pytest.mark.usefixtures("cli_logging")
def test_an_effect_is_written_through_and_other_lines_wait_for_a_flush() -> None:
    raw = io.BytesIO()
    stream = io.TextIOWrapper(io.BufferedWriter(raw, 1 << 16), encoding="utf-8")
    buffered = logs.BufferedHandler(stream)
    buffered.setFormatter(logs.TextFormatter())
    _use(buffered)
    log = logging.getLogger("evergraph.engine")
    log.info("graph g loaded: 2 vertices")
    assert raw.getvalue() == b"", "a plain line waits for the flusher"
    log_data(log, "%s: %s", ("file[a]", "applied"), dict, effect=True)
    lines = raw.getvalue().decode().splitlines()
    assert [line.split(" ", 1)[1] for line in lines] == [
        "graph g loaded: 2 vertices",
        "file[a]: applied",
    ], "an effect is written through, after what came before it"
    log_data(log, "%s", ("recap: 1 changed, 0 failed, 0 clean",), dict)
    assert len(raw.getvalue().decode().splitlines()) == 2
    buffered.flush_now()
    assert raw.getvalue().decode().endswith(" recap: 1 changed, 0 failed, 0 clean\n")


@pytest.mark.usefixtures("cli_logging")
def test_a_terminal_colours_the_recap_without_making_its_data() -> None:
    from rich.console import Console

    made: list[int] = []

    def data() -> dict[str, Any]:
        made.append(1)
        return {"event": "recap"}

    terminal = logs.TerminalHandler(Console(file=io.StringIO(), force_terminal=True))
    _use(terminal)
    terminal.hold()
    text = "recap: 1 changed, 1 failed, 0 clean\n  changed file[a]: content\n  failed exec[b]: boom"
    log_data(logging.getLogger("evergraph.engine"), "%s", (text,), data, event="recap")
    held = terminal.take()
    assert held is not None
    assert [style for _, style in held.lines] == ["", "yellow", "red"]
    assert made == []
