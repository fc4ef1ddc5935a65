"""`evergraph` commands. Every user error is one line on stderr and exit status 2."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import click

from evergraph._version import __version__
from evergraph.cli.common import CHECK_TIMEOUT, check_summary, error_line, load_for_check, one_line
from evergraph.cli.options import WORLD_OPTIONS, run_options
from evergraph.cli.runner import run_command, world_opts
from evergraph.errors import InputError

if TYPE_CHECKING:
    from evergraph.engine.settings import Flag
    from evergraph.world.open import WorldOptions

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


def _die(e: InputError) -> NoReturn:
    click.echo(error_line(e), err=True)
    sys.exit(2)


#: command name -> the module (evergraph.cli.<module>) whose `register` adds it: imported
#: only when that command is used (or listed with its help), so that `check` and `run`
#: do not import the World's client commands (asyncio, the etcd client, nacl, ...)
LAZY_COMMANDS = {
    "world": "world",
    "members": "world",
    "exports": "world",
    "deploy": "deploy",
    "deploys": "deploy",
    "hosts": "hosts",
    "schedule": "schedule",
    "farm": "farm",
    "setup": "setup",
    "cluster": "cluster",
    "remote": "remote",
}


class _LazyGroup(click.Group):
    """The top-level group: its commands from other modules registered on first use."""

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        module = LAZY_COMMANDS.get(cmd_name)
        if module is not None and cmd_name not in self.commands:
            mod = importlib.import_module(f"evergraph.cli.{module}")
            if module == "setup":
                mod.register(self)  # needs the run command only
            else:
                mod.register(self, world_options)
        return super().get_command(ctx, cmd_name)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.commands, *LAZY_COMMANDS})


@click.group(cls=_LazyGroup, context_settings=CONTEXT)
@click.version_option(__version__, "--version", prog_name="evergraph")
def cli() -> None:
    """evergraph keeps machines in their declared state, continuously.

    Declare resources (files, commands, ...) and their dependencies as a graph
    in YAML or Python; evergraph converges the graph in parallel, then watches
    every resource and repairs drift the moment it happens.

    \b
    Examples:
      evergraph check site.yaml                      # validate, change nothing
      evergraph run site.yaml                        # converge, then keep watching
      evergraph run site.yaml --converged-timeout 1 --converged-exit   # one-shot
      evergraph run site.py                          # a reactive Python graph
      evergraph deploy site.yaml                     # ship it to agents run without FILE
    """


def _world_opts(world: dict[str, object]) -> WorldOptions:
    """The World's options from the command line's (cli/world.py's commands too)."""
    return world_opts(world)


def click_option(o: Flag) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """The click option of one setting (engine/settings.py's `Flag`)."""
    kw: dict[str, Any] = {"help": o.help}
    if o.kind == "flag":
        kw["is_flag"] = True
    elif o.kind == "count":
        kw["count"] = True
    elif o.multiple:
        kw["multiple"] = True
    else:
        ranged = o.low is not None or o.high is not None
        if o.kind == "int":
            kw["type"] = click.IntRange(o.low, o.high) if ranged else int  # type: ignore[arg-type]
        elif o.kind == "float":
            kw["type"] = click.FloatRange(o.low, o.high, min_open=o.low_open) if ranged else float
        elif o.kind == "choice":
            kw["type"] = click.Choice(list(o.choices))
        elif o.kind == "path":
            kw["type"] = click.Path(dir_okay=False, path_type=Path)
        elif o.kind == "dir":
            # a str: an empty value must be told from "." (see runner.check_path)
            kw["type"] = click.Path(file_okay=False)
        if o.default is not None:
            kw["default"] = o.default
    if o.show_default:
        kw["show_default"] = True
    if o.metavar is not None:
        kw["metavar"] = o.metavar
    return click.option(*o.flags, o.param, **kw)


def _with(options: Iterable[Flag], f: Callable[..., None]) -> Callable[..., None]:
    for o in reversed(list(options)):
        f = click_option(o)(f)
    return f


def world_options(f: Callable[..., None]) -> Callable[..., None]:
    """The options that say which World to use (shared by run, world, members, exports)."""
    return _with(WORLD_OPTIONS, f)


def run(file: Path | None, **params: Any) -> None:
    """Converge the graph in FILE, then keep it converged.

    FILE is a YAML graph (.yaml/.yml) or a Python module (.py) defining
    `def graph(g, world)`. Saving FILE while the agent runs swaps the graph
    live: unchanged resources keep running untouched. A Python graph also runs
    again when a World value it read changes. Without FILE the agent follows
    the newest deploy in the World (see `evergraph deploy`).

    \b
    Exit status: 0 all clean, 1 a resource failed, 2 bad input;
    3 with --noop and --converged-exit (or --no-watch): something would change.
    \b
    Examples:
      evergraph run examples/hello.yaml
      evergraph run examples/motd.py
      evergraph run --seeds http://10.0.0.1:2379            # follow deploys
      evergraph run site.yaml --noop --converged-exit       # what would change? (3: some)
      evergraph run site.yaml --diff                        # show each change's diff
      evergraph run site.yaml --converged-timeout 5 --converged-status-file /run/eg.status
    """
    # the console script's fast path calls the same (cli/entry.py)
    run_command({"file": file, **params})


# its options, generated from their one spelling (cli/options.py, engine/settings.py)
run = cli.command(context_settings=CONTEXT)(
    click.argument("file", type=click.Path(dir_okay=False, path_type=Path), required=False)(
        _with(run_options(), run)
    )
)


def _check_timeout(_ctx: click.Context, _param: click.Parameter, value: float) -> float:
    from evergraph.engine.contract import seconds_problem

    why = seconds_problem(value)
    if why:
        _die(InputError(why, "--timeout"))
    return value


@cli.command(context_settings=CONTEXT)
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--timeout",
    type=float,
    default=CHECK_TIMEOUT,
    show_default=True,
    callback=_check_timeout,
    help="Seconds to wait for the graph to load: a Python graph() that has not returned "
    "by then is an error (exit 2).",
)
def check(file: Path, timeout: float) -> None:
    """Load and validate FILE, print a summary; change nothing.

    \b
    Example:
      evergraph check site.yaml && evergraph run site.yaml
    """
    try:
        model = load_for_check(file, timeout)
    except InputError as e:
        _die(e)
    click.echo(check_summary(file, model))  # cli/entry.py answers `check FILE` alone


@cli.command(context_settings=CONTEXT)
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["dot", "svg", "png", "json"]),
    default="dot",
    show_default=True,
    help="Graphviz dot, a picture (svg, png: drawn by Graphviz's `dot` program), or JSON "
    "for scripts.",
)
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write to this file (replaced atomically) instead of standard output; needed for "
    "png on a terminal.",
)
@click.option("--no-autoedges", is_flag=True, help="Without automatic edges.")
@click.option("--no-autogroup", is_flag=True, help="Without automatic grouping.")
def graph(
    file: Path, fmt: str, output: Path | None, no_autoedges: bool, no_autogroup: bool
) -> None:
    """Print the graph in FILE as the engine would run it (after automatic
    edges and grouping); change nothing.

    Resources are ellipses (boxes for groups, dashed if hidden); auto edges
    are dotted; notify and send/recv edges are labelled.

    \b
    Exit status: 0 ok; 1 Graphviz's `dot` is missing (install the graphviz
    package) or failed, or the output could not be written; 2 bad input.
    \b
    Examples:
      evergraph graph site.yaml -o site.svg --format svg
      evergraph graph site.yaml --format png -o site.png
      evergraph graph site.yaml | dot -Tpdf > site.pdf
      evergraph graph site.yaml --format json | jq '.edges[] | select(.auto)'
    """
    from evergraph.engine.prepare import prepare
    from evergraph.engine.render import GraphvizError, to_dot, to_image, to_json
    from evergraph.frontends.open import open_graph_file

    try:
        if output is not None and not output.parent.is_dir():
            raise InputError(f"no such directory: {output.parent}", "--output")
        if output is None and fmt == "png" and sys.stdout.isatty():
            raise InputError(
                "png is binary and would garble the terminal: give -o FILE.png "
                "(or redirect standard output)",
                "--format png",
            )
        model = open_graph_file(file).load()
        prepare(model, autoedges=not no_autoedges, autogroup=not no_autogroup)
    except InputError as e:
        _die(e)
    if fmt in ("dot", "json"):
        data = (to_dot(model) if fmt == "dot" else to_json(model)).encode()
    else:
        try:
            data = to_image(to_dot(model), fmt)
        except GraphvizError as e:
            click.echo(f"evergraph: {one_line(str(e))}", err=True)
            sys.exit(1)
    if output is None:
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
        return
    from evergraph._util.atomic import atomic_write

    try:  # readable by others, as a file a shell redirect would make
        atomic_write(output, data, mode=0o644)
    except OSError as e:
        click.echo(f"evergraph: cannot write {output}: {e.strerror or e}", err=True)
        sys.exit(1)


@cli.group(context_settings=CONTEXT)
def docs() -> None:
    """Reference documentation, generated from the code.

    \b
    Example:
      evergraph docs resources | less
    """


@docs.command("resources", context_settings=CONTEXT)
def docs_resources() -> None:
    """Every resource kind with its parameters, types, defaults and meaning."""
    from evergraph.engine.docs import resources_reference
    from evergraph.frontends.open import builtin_registry

    click.echo(resources_reference(builtin_registry()), nl=False)


@cli.command(context_settings=CONTEXT)
def version() -> None:
    """Print the version of evergraph."""
    click.echo(f"evergraph {__version__}")


def main() -> None:
    cli(prog_name="evergraph")


if __name__ == "__main__":
    main()
