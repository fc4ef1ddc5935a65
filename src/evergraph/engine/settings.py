"""The one settings object of an engine run, passed explicitly."""

# (no `from __future__ import annotations`: the Settings annotations are evaluated
# with the class, from bytecode; as strings, `flags()` compiled each of them in every
# `evergraph run`'s start-up, ~1 ms)

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import msgspec

from evergraph.engine.contract import seconds_problem
from evergraph.errors import InputError


def default_state_dir() -> Path:
    if os.geteuid() == 0:
        return Path("/var/lib/evergraph")
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return Path(base) / "evergraph"


class Flag:
    """What one run setting is on the command line: its flags, `--help` text, the
    click type it is read with (`kind`: flag, count, text, int, float, path (a file),
    dir, choice; `low`/`high`/`low_open`: the range click checks), and the name of
    its parameter. A `Settings` field carries one in its annotation
    (`Annotated[T, Flag(...)]`); the options `evergraph run` has beyond the engine's
    are declared with it in cli/options.py. The click command is generated from
    them (cli/main.py), so each setting is spelled once, here."""

    __slots__ = (
        "choices",
        "default",
        "flags",
        "help",
        "high",
        "invert",
        "kind",
        "low",
        "low_open",
        "metavar",
        "multiple",
        "param",
        "show_default",
    )

    def __init__(
        self,
        *flags: str,
        help: str,
        kind: str = "text",
        param: str = "",
        default: object = None,
        invert: bool = False,
        choices: tuple[str, ...] = (),
        low: float | None = None,
        high: float | None = None,
        low_open: bool = False,
        metavar: str | None = None,
        multiple: bool = False,
        show_default: bool = False,
    ) -> None:
        self.flags = flags
        self.help = help
        self.kind = kind
        #: the command line's parameter (click's); "": the field's name
        self.param = param
        #: the command line's default (a field's: set from the field's default)
        self.default = default
        #: a flag that sets the field False (`--no-watch`: watch=False)
        self.invert = invert
        self.choices = choices
        self.low = low
        self.high = high
        self.low_open = low_open
        self.metavar = metavar
        self.multiple = multiple
        self.show_default = show_default

    def __repr__(self) -> str:
        return f"Flag({', '.join(self.flags)} -> {self.param})"


class Settings(msgspec.Struct, frozen=True, kw_only=True):
    """The settings of one engine run: what `evergraph run`'s flags set (each field's
    `Flag`), what `evergraph.run(**settings)` takes, what the agent and the engine
    read. (A Struct, not a dataclass: a dataclass's generated methods are compiled at
    import, ~1.5 ms of every start; its annotations are read only for the command
    line's options, see `flags()`.)"""

    state_dir: Annotated[
        Path,
        Flag(
            "--state-dir",
            kind="dir",
            help="Where vertex state lives. [default: /var/lib/evergraph as root, "
            "else ~/.local/state/evergraph]",
        ),
    ]
    hostname: Annotated[
        str,
        Flag(
            "--hostname",
            help="This host's name in the cluster. [default: the system hostname]",
        ),
    ] = ""
    noop: Annotated[
        bool,
        Flag(
            "--noop",
            kind="flag",
            help="Check only; report what would change, with diffs, and whom it would notify; "
            "change nothing. User commands: exec's guards (ifcmd, nifcmd) and watchcmd still "
            "run, as in mgmt and Salt (they decide what would change); cmd and donecmd never do.",
        ),
    ] = False
    #: False (`--noop-no-commands`): a noop run runs no user command at all, not even
    #: the guards (`ifcmd`, `nifcmd`, `watchcmd`); what they decide is "unknown"
    noop_commands: Annotated[
        bool,
        Flag(
            "--noop-no-commands",
            kind="flag",
            invert=True,
            help="--noop, and run no user command at all, not even the guards: an exec whose "
            "guards would decide is reported 'unknown' in the recap (exit 3 like a change).",
        ),
    ] = True
    #: log what each run changed with diffs on real runs too (noop runs always do)
    diff: Annotated[
        bool,
        Flag(
            "--diff",
            kind="flag",
            help="Log what each change changed with diffs on real runs too (as --noop does).",
        ),
    ] = False
    #: global bound on concurrent check_apply calls; 0 = none
    sema: Annotated[
        int,
        Flag(
            "--sema",
            kind="int",
            low=0,
            high=1_000_000,
            show_default=True,
            help="At most N check_apply calls at once (0 = no bound).",
        ),
    ] = 0
    #: False: check once, never watch, exit once converged (`--no-watch`)
    watch: Annotated[
        bool,
        Flag(
            "--no-watch",
            kind="flag",
            invert=True,
            help="Check each resource once, do not watch; exit once converged "
            "(as --converged-exit).",
        ),
    ] = True
    autoedges: Annotated[
        bool,
        Flag(
            "--no-autoedges",
            kind="flag",
            invert=True,
            help="No automatic edges (file after its parent directory, ...).",
        ),
    ] = True
    autogroup: Annotated[
        bool,
        Flag(
            "--no-autogroup",
            kind="flag",
            invert=True,
            help="No automatic grouping of groupable resources.",
        ),
    ] = True
    #: seconds idle and clean before "converged"; None = never
    converged_timeout: Annotated[
        float | None,
        Flag(
            "--converged-timeout",
            kind="float",
            help="Seconds all vertices must stay clean and idle to count as converged "
            "(fractions allowed). [default: never, or 0 with --converged-exit]",
        ),
    ] = None
    converged_exit: Annotated[
        bool,
        Flag(
            "--converged-exit",
            kind="flag",
            help="Exit once converged: status 0 if every vertex is clean, 1 if any failed; "
            "with --noop, 3 if something would change.",
        ),
    ] = False
    converged_status_file: Annotated[
        Path | None,
        Flag(
            "--converged-status-file",
            kind="path",
            help="Append `true`/`false` to this file on each converged transition.",
        ),
    ] = None
    #: each converged transition on stdout, for `evergraph remote`'s initiator, which
    #: runs its agents with a converged-timeout of 0 and ends them (engine/converger.py)
    converged_report: Annotated[
        bool,
        Flag(
            "--converged-report",
            kind="flag",
            help="Write `evergraph-converged: true`/`false` on stdout on each converged "
            "transition, for whoever ends the run (`evergraph remote`): with --noop, "
            "exit 3 if something would change, as with --converged-exit.",
        ),
    ] = False
    max_runtime: Annotated[
        float | None,
        Flag(
            "--max-runtime",
            kind="float",
            help="Stop after this many seconds, cancelling applies still running (0.001 to a "
            "year); exit 1 if no graph was loaded by then.",
        ),
    ] = None
    #: a resource that failed for good (its retries spent) is tried again at its next
    #: event, or after a backoff that doubles from 1 s up to this many seconds;
    #: 0: never by timer (events still revive it)
    repair_backoff_max: Annotated[
        float,
        Flag(
            "--repair-backoff-max",
            kind="float",
            show_default=True,
            help="A resource whose retries are spent stays failed only until its next event "
            "or a timer: 1 s, doubling up to this many seconds (0: events only).",
        ),
    ] = 300.0
    #: write the running graph as dot here after each swap
    graphviz: Annotated[
        Path | None,
        Flag(
            "--graphviz",
            kind="path",
            help="Write the running graph as Graphviz dot to this file (on each swap).",
        ),
    ] = None
    #: seconds a stop request lets in-flight applies finish before cancelling them
    #: (no flag: `evergraph.run(stop_grace=...)` and the engine's tests)
    stop_grace: float = 30.0

    def __post_init__(self) -> None:
        check_times(self.converged_timeout, self.max_runtime)
        if why := seconds_problem(self.stop_grace, zero=True):
            raise InputError(why, "stop_grace")
        if why := seconds_problem(self.repair_backoff_max, zero=True):
            raise InputError(why, "--repair-backoff-max")

    @property
    def one_shot(self) -> bool:
        """The run ends the moment it converges (`--converged-exit` with a
        converged-timeout of 0): it sets up no passive watches (the engine's
        `one_shot`) and follows no later graph (the agent)."""
        return ends_when_converged(self.watch, self.converged_exit, self.converged_timeout)

    def host(self) -> str:
        return self.hostname or os.uname().nodename  # (gethostname(2)'s: no socket import)


def one_shot(settings: Mapping[str, Any]) -> bool:
    """`run`'s keywords `settings` make a run that ends the moment it converges
    (`Settings.one_shot`; `converged_exit` without a timeout is a timeout of 0, as
    `run` makes it)."""
    exits = bool(settings.get("converged_exit"))
    timeout = settings.get("converged_timeout")
    return ends_when_converged(
        bool(settings.get("watch", True)), exits, 0.0 if exits and timeout is None else timeout
    )


def ends_when_converged(watch: bool, converged_exit: bool, converged_timeout: float | None) -> bool:
    """The one-shot rule (`Settings.one_shot`): watching, told to exit once
    converged, with no time after that to repair drift in."""
    return watch and converged_exit and converged_timeout == 0


def check_times(converged_timeout: float | None, max_runtime: float | None) -> None:
    """Refuse run durations that make no sense (NaN, infinite, negative, absurdly
    small or large), naming the flag and the valid range."""
    if converged_timeout is not None and (why := seconds_problem(converged_timeout, zero=True)):
        raise InputError(why, "--converged-timeout")
    if max_runtime is not None and (why := seconds_problem(max_runtime)):
        raise InputError(why, "--max-runtime")


def flags() -> list[tuple[str, Flag]]:
    """(field, its Flag) for every `Settings` field set on the command line, in the
    order of `evergraph run --help`; each Flag's `param` and `default` filled in (the
    command line's: an inverted flag's default is False, `--state-dir`'s None)."""
    from typing import get_type_hints

    hints = get_type_hints(Settings, include_extras=True)
    defaults = dict(
        zip(
            Settings.__struct_fields__[-len(Settings.__struct_defaults__) :],
            Settings.__struct_defaults__,
            strict=True,
        )
    )
    out: list[tuple[str, Flag]] = []
    for field in Settings.__struct_fields__:
        flag = next((m for m in getattr(hints[field], "__metadata__", ()) if type(m) is Flag), None)
        if flag is None:
            continue
        if not flag.param:
            flag.param = flag.flags[0].lstrip("-").replace("-", "_") if flag.invert else field
            if flag.kind in ("flag", "count") or flag.multiple:
                flag.default = False if flag.kind == "flag" else (0 if flag.kind == "count" else ())
            elif not flag.invert:
                flag.default = defaults.get(field)
        out.append((field, flag))
    return out


def run_keywords() -> tuple[str, ...]:
    """The settings `evergraph.run()` takes as keywords: every field but the state
    dir (its own keyword, prepared by the agent)."""
    return tuple(f for f in Settings.__struct_fields__ if f != "state_dir")
