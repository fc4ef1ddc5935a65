"""The `evergraph` console script. `evergraph check FILE` and `evergraph run FILE`
with a few common flags (cli/runner.py's `parse_fast`), the commands whose
start-up is much of their time, are answered without importing click (~20 ms);
every other command line, `--help` included, goes to the click application in
cli/main.py, whose `check` and `run` say and do the same."""

from __future__ import annotations

import gc
import os
import sys
from typing import NoReturn

from evergraph.cli.common import check_summary, collector_on, error_line, load_for_check
from evergraph.errors import InputError


def _plain_file(arg: str) -> bool:
    """An argument click would take as `check`'s FILE unchanged: not an option, not
    a directory (click's own error), printable (click strips escapes on a pipe)."""
    return (
        bool(arg)
        and not arg.startswith("-")
        and arg.isprintable()
        and arg.isascii()
        and not os.path.isdir(arg)
    )


def _check(arg: str) -> NoReturn:
    from pathlib import Path

    try:
        model = load_for_check(arg)
    except InputError as e:
        print(error_line(e), file=sys.stderr, flush=True)
        sys.exit(2)
    except KeyboardInterrupt:
        print("\nAborted!", file=sys.stderr, flush=True)  # as click says it
        sys.exit(1)
    try:
        print(check_summary(Path(arg), model), flush=True)
    except BrokenPipeError:  # as click: exit 1, nothing more said
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
    sys.exit(0)


def main() -> None:
    # No cyclic GC while the modules load: the imports of a `run` allocate enough
    # objects for ~60 collections, which find next to nothing (~5 ms of its start
    # here). `run` turns it on once its modules are in (`collector_on`), the click
    # application before it runs; `check` leaves before it would matter.
    gc.disable()
    argv = sys.argv[1:]
    if len(argv) == 2 and argv[0] == "check" and _plain_file(argv[1]):
        _check(argv[1])
    if argv and argv[0] == "run":
        # a large YAML graph's resources parsed on the other core meanwhile
        from evergraph.frontends import early

        early.start(argv[1:])
        from evergraph.cli import runner

        params = runner.parse_fast(argv[1:])
        if params is not None:
            try:
                runner.run_command(params)
            except (KeyboardInterrupt, EOFError):  # as click says it (before the loop)
                print("\nAborted!", file=sys.stderr, flush=True)
                sys.exit(1)
            except BrokenPipeError:  # as click: exit 1, nothing more said
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
                sys.exit(1)
    from evergraph.cli.main import main as click_main

    collector_on()
    click_main()


if __name__ == "__main__":
    main()
