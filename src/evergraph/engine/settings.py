"""The one settings object of an engine run, passed explicitly."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import msgspec

from evergraph.engine.contract import seconds_problem
from evergraph.errors import InputError


def default_state_dir() -> Path:
    if os.geteuid() == 0:
        return Path("/var/lib/evergraph")
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return Path(base) / "evergraph"


class Settings(msgspec.Struct, frozen=True):
    """(A Struct, not a dataclass: a dataclass's generated methods are compiled at
    import, ~1.5 ms of every start.)"""

    state_dir: Path
    hostname: str = ""
    noop: bool = False
    #: False (`--noop-no-commands`): a noop run runs no user command at all, not even
    #: the guards (`ifcmd`, `nifcmd`, `watchcmd`); what they decide is "unknown"
    noop_commands: bool = True
    #: log what each run changed with diffs on real runs too (noop runs always do)
    diff: bool = False
    #: global bound on concurrent check_apply calls; 0 = none
    sema: int = 0
    #: False: check once, never watch, exit once converged (`--no-watch`)
    watch: bool = True
    #: seconds idle and clean before "converged"; None = never
    converged_timeout: float | None = None
    converged_exit: bool = False
    converged_status_file: Path | None = None
    max_runtime: float | None = None
    #: seconds a stop request lets in-flight applies finish before cancelling them
    stop_grace: float = 30.0
    #: write the running graph as dot here after each swap
    graphviz: Path | None = None
    autoedges: bool = True
    autogroup: bool = True
    #: a resource that failed for good (its retries spent) is tried again at its next
    #: event, or after a backoff that doubles from 1 s up to this many seconds;
    #: 0: never by timer (events still revive it)
    repair_backoff_max: float = 300.0

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
        return self.watch and self.converged_exit and self.converged_timeout == 0

    def host(self) -> str:
        return self.hostname or socket.gethostname()


def check_times(converged_timeout: float | None, max_runtime: float | None) -> None:
    """Refuse run durations that make no sense (NaN, infinite, negative, absurdly
    small or large), naming the flag and the valid range."""
    if converged_timeout is not None and (why := seconds_problem(converged_timeout, zero=True)):
        raise InputError(why, "--converged-timeout")
    if max_runtime is not None and (why := seconds_problem(max_runtime)):
        raise InputError(why, "--max-runtime")
