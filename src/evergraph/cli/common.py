"""What the console script (cli/entry.py), the click application (cli/main.py) and
`run`'s work (cli/runner.py) share: how an error is said, `check`'s loading and
summary, the collector turned back on. A leaf: it imports no other module of cli/,
so that entry -> main -> runner -> common point one way (an import-linter contract
keeps it so)."""

from __future__ import annotations

import gc
import os
import sys
from typing import TYPE_CHECKING, Any

from evergraph.errors import InputError

if TYPE_CHECKING:
    from pathlib import Path

    from evergraph.engine.model import GraphModel


def one_line(text: str) -> str:
    """`text` with every unprintable character escaped (`\\n`, `\\x1b`, `\\u2028`): a
    message quoting the user's input stays one line, and cannot drive the terminal."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)


def error_line(e: InputError) -> str:
    """What a bad input prints (on stderr, then exit 2)."""
    return f"evergraph: {one_line(str(e))}"


def check_summary(file: Path | str, model: GraphModel) -> str:
    """`check`'s line for a valid graph."""
    kinds: dict[str, int] = {}
    for r in model.resources.values():
        kinds[r.kind] = kinds.get(r.kind, 0) + 1
    per_kind = ", ".join(f"{k}: {n}" for k, n in sorted(kinds.items()))
    return (
        f"{file}: graph {model.name or '(unnamed)'!r} is valid: "
        f"{len(model.resources)} resources ({per_kind or 'none'}), {len(model.edges)} edges"
    )


#: seconds `check` waits for a graph to load (a Python graph() may never return)
CHECK_TIMEOUT = 30.0


def load_for_check(file: Path | str, timeout: float = CHECK_TIMEOUT) -> GraphModel:
    """FILE's graph, loaded in a daemon thread (InputError as loading raises). One that
    has not loaded within `timeout` seconds (a Python graph() that never returns)
    ends the process here: one line naming the file and the timeout, exit 2. The
    thread cannot be stopped, so the exit does not wait for it (`os._exit`)."""
    import threading
    from pathlib import Path

    from evergraph.frontends.open import open_graph_file

    frontend = open_graph_file(Path(file))
    outcome: list[tuple[bool, Any]] = []
    done = threading.Event()

    def body() -> None:
        try:
            outcome.append((True, frontend.load()))
        except BaseException as e:  # handed to the caller as it is
            outcome.append((False, e))
        finally:
            done.set()

    threading.Thread(target=body, name="check", daemon=True).start()
    if not done.wait(timeout):
        what = "graph() did not return" if str(file).endswith(".py") else "the graph did not load"
        err = InputError(f"{what} within {timeout:g} s (check --timeout S waits longer)", str(file))
        sys.stdout.flush()
        print(error_line(err), file=sys.stderr, flush=True)
        os._exit(2)
    ok, value = outcome[0]
    if not ok:
        raise value
    model: GraphModel = value
    return model


def collector_on() -> None:
    """The cyclic GC on again after `main` paused it for the imports, what they made
    moved to the oldest generation first (long-lived: modules, classes, functions),
    as `_util/gc.py` does after a build."""
    if not gc.isenabled():
        gc.freeze()
        gc.unfreeze()
        gc.enable()
