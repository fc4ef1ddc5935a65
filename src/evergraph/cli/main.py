"""`evergraph` commands. Every user error is one line on stderr and exit status 2."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import click

from evergraph._version import __version__
from evergraph.cli.entry import CHECK_TIMEOUT, check_summary, error_line, load_for_check, one_line
from evergraph.cli.runner import ETCD_PASSWORD_ENV, run_command, world_opts
from evergraph.errors import InputError

if TYPE_CHECKING:
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


def world_options(f: Callable[..., None]) -> Callable[..., None]:
    """The options that say which World to use (shared by run, world, members, exports)."""
    opts = [
        click.option(
            "--world",
            "world_backend",
            type=click.Choice(["sqlite", "memory", "etcd"]),
            default="sqlite",
            show_default=True,
            help="Where shared state lives: sqlite (a file in the state dir), memory "
            "(this process only), etcd (--seeds or --etcd embedded).",
        ),
        click.option(
            "--world-db",
            type=click.Path(dir_okay=False, path_type=Path),
            default=None,
            help="The sqlite World's file. [default: STATE_DIR/world.sqlite]",
        ),
        click.option(
            "--seeds",
            default="",
            metavar="URL,...",
            help="etcd client URLs, e.g. https://10.0.0.1:2379 (implies --world etcd).",
        ),
        click.option(
            "--etcd",
            "etcd_mode",
            type=click.Choice(["embedded"]),
            default=None,
            help="Start an etcd server as a child process, data under the state dir.",
        ),
        click.option(
            "--etcd-ca",
            type=click.Path(dir_okay=False, path_type=Path),
            default=None,
            help="CA certificate that signed the etcd servers' certificates.",
        ),
        click.option(
            "--etcd-cert",
            type=click.Path(dir_okay=False, path_type=Path),
            default=None,
            help="Client certificate for etcd (with --etcd-key).",
        ),
        click.option(
            "--etcd-key",
            type=click.Path(dir_okay=False, path_type=Path),
            default=None,
            help="Client key for etcd.",
        ),
        click.option("--etcd-user", default=None, help="etcd user name (auth enabled)."),
        click.option(
            "--etcd-password-file",
            type=click.Path(dir_okay=False, path_type=Path),
            default=None,
            help=f"Read the etcd password from this file (or set {ETCD_PASSWORD_ENV}).",
        ),
        click.option(
            "--etcd-password",
            default=None,
            help="etcd password; visible to every user in `ps`: prefer --etcd-password-file.",
        ),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


@cli.command(context_settings=CONTEXT)
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path), required=False)
@click.option(
    "--state-dir",
    # a str: an empty value must be told from "." (see runner.check_path)
    type=click.Path(file_okay=False),
    help="Where vertex state lives. [default: /var/lib/evergraph as root, "
    "else ~/.local/state/evergraph]",
)
@click.option(
    "--hostname", default="", help="This host's name in the cluster. [default: the system hostname]"
)
@click.option(
    "--noop",
    is_flag=True,
    help="Check only; report what would change, with diffs, and whom it would notify; "
    "change nothing. User commands: exec's guards (ifcmd, nifcmd) and watchcmd still run, "
    "as in mgmt and Salt (they decide what would change); cmd and donecmd never do.",
)
@click.option(
    "--noop-no-commands",
    is_flag=True,
    help="--noop, and run no user command at all, not even the guards: an exec whose "
    "guards would decide is reported 'unknown' in the recap (exit 3 like a change).",
)
@click.option(
    "--diff",
    is_flag=True,
    help="Log what each change changed with diffs on real runs too (as --noop does).",
)
@click.option(
    "--sema",
    type=click.IntRange(min=0, max=1_000_000),
    default=0,
    show_default=True,
    help="At most N check_apply calls at once (0 = no bound).",
)
@click.option(
    "--no-watch",
    is_flag=True,
    help="Check each resource once, do not watch; exit once converged (as --converged-exit).",
)
@click.option(
    "--no-autoedges",
    is_flag=True,
    help="No automatic edges (file after its parent directory, ...).",
)
@click.option("--no-autogroup", is_flag=True, help="No automatic grouping of groupable resources.")
@click.option(
    "--converged-timeout",
    type=float,
    default=None,
    help="Seconds all vertices must stay clean and idle to count as converged "
    "(fractions allowed). [default: never, or 0 with --converged-exit]",
)
@click.option(
    "--converged-exit",
    is_flag=True,
    help="Exit once converged: status 0 if every vertex is clean, 1 if any failed; "
    "with --noop, 3 if something would change.",
)
@click.option(
    "--converged-status-file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Append `true`/`false` to this file on each converged transition.",
)
@click.option(
    "--max-runtime",
    type=float,
    default=None,
    help="Stop after this many seconds, cancelling applies still running (0.001 to a year); "
    "exit 1 if no graph was loaded by then.",
)
@click.option(
    "--repair-backoff-max",
    type=float,
    default=300.0,
    show_default=True,
    help="A resource whose retries are spent stays failed only until its next event or "
    "a timer: 1 s, doubling up to this many seconds (0: events only).",
)
@click.option(
    "--graphviz",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write the running graph as Graphviz dot to this file (on each swap).",
)
@click.option(
    "--log-format",
    type=click.Choice(["text", "json"]),
    default="text",
    show_default=True,
    help="Log lines as text or as one JSON object per line.",
)
@click.option(
    "--http",
    "http_addr",
    metavar="ADDR",
    help="Serve the HTTP API on ADDR (HOST:PORT, e.g. 127.0.0.1:9233): health, graph status.",
)
@click.option(
    "--http-socket",
    "http_socket",
    metavar="PATH",
    help="Serve the HTTP API on a Unix socket at PATH too (mode 0666): root's "
    "connections (SO_PEERCRED) read a vertex's parameters without a token; others, "
    "as on --http, need an admin token.",
)
@click.option(
    "--http-max-body",
    type=click.IntRange(min=1024, max=1 << 30),
    default=1 << 20,
    show_default=True,
    metavar="BYTES",
    help="With --http: a request body over this many bytes is refused (413) unread.",
)
@click.option(
    "--farm-anonymous",
    metavar="GROUP",
    help="With --http: serve tokenless (legacy Boruta) clients as a non-admin user of GROUP.",
)
@click.option("--worker", is_flag=True, help="Lease this host to farm users (a farm worker).")
@click.option(
    "--cap",
    "caps",
    multiple=True,
    metavar="K=V",
    help="A capability of this worker (repeatable); arch, os, cpus, memory_mb and hostname "
    "are discovered.",
)
@click.option("--group", "groups", multiple=True, help="A farm group of this worker (repeatable).")
@click.option(
    "--ssh-port",
    type=click.IntRange(1, 65535),
    default=22,
    show_default=True,
    help="The sshd port farm users reach this worker on.",
)
@click.option(
    "--ssh-user",
    default="root",
    show_default=True,
    help="The account farm users log in as (their job's key is authorized for it).",
)
@click.option(
    "--authorized-keys",
    type=click.Path(dir_okay=False, path_type=Path),
    help="The authorized_keys file a job's key goes to. [default: the --ssh-user's own]",
)
@click.option(
    "--farm-server",
    "farm_servers",
    multiple=True,
    metavar="NAME=KEY",
    help="A farm server (an agent with --http) this worker or API server trusts "
    "(repeatable; this host always is one): KEY as `evergraph hosts key` prints it on "
    "NAME, pinned explicitly. Only farm servers sign the records a worker acts on and "
    "receive its job keys; API servers accept tokens signed by them. NAME alone: only "
    "if `evergraph hosts trust NAME KEY` pinned it already.",
)
@click.option(
    "--fragment-kinds",
    metavar="KIND,...",
    help="The resource kinds a request's graph fragment may use on this worker (e.g. "
    "file,pkg); a fragment with another kind is refused, the job runs without it. "
    "[default: any kind]",
)
@click.option(
    "--farm-job-period",
    type=click.FloatRange(0, min_open=True),
    metavar="S",
    help="With --http: a job's length, and what one prolong adds. [default: 3600]",
)
@click.option(
    "--farm-max-prolong",
    type=click.IntRange(0),
    metavar="N",
    help="With --http: how many times a job may be prolonged. [default: 3]",
)
@click.option(
    "--farm-invalid-grace",
    type=click.FloatRange(0),
    metavar="S",
    help="With --http: a waiting request becomes INVALID only after no registered worker "
    "could serve it for S seconds. [default: 60]",
)
@click.option(
    "--farm-alive-grace",
    type=click.FloatRange(0),
    metavar="S",
    help="With --http: a worker whose agent's lease expired becomes FAILED only after S "
    "seconds more (a slow World fails no live worker). [default: 10]",
)
@click.option(
    "--farm-election-ttl",
    type=click.FloatRange(0.5),
    metavar="S",
    help="With --http: the farm election's lease; a dead leader's matcher is taken over "
    "within about S seconds. [default: 10]",
)
@click.option(
    "--replace",
    is_flag=True,
    help="Take the hostname over from another live agent (which then stops).",
)
@world_options
@click.option(
    "--deployer",
    "deployers",
    multiple=True,
    metavar="KEY",
    help="Without FILE: run only deploys signed by this verify key (base64, as `evergraph "
    "deploy` prints it; repeatable). [default: the first signer seen, pinned]",
)
@click.option(
    "-v",
    "--verbose",
    count=True,
    help="More log output: -v each check and how long it took, -vv also commands' output.",
)
def run(
    file: Path | None,
    state_dir: Path | None,
    hostname: str,
    noop: bool,
    noop_no_commands: bool,
    diff: bool,
    sema: int,
    no_watch: bool,
    no_autoedges: bool,
    no_autogroup: bool,
    converged_timeout: float | None,
    converged_exit: bool,
    converged_status_file: Path | None,
    max_runtime: float | None,
    repair_backoff_max: float,
    graphviz: Path | None,
    log_format: str,
    replace: bool,
    http_addr: str | None,
    http_socket: str | None,
    http_max_body: int,
    farm_anonymous: str | None,
    worker: bool,
    caps: tuple[str, ...],
    groups: tuple[str, ...],
    ssh_port: int,
    ssh_user: str,
    authorized_keys: Path | None,
    farm_servers: tuple[str, ...],
    fragment_kinds: str | None,
    farm_job_period: float | None,
    farm_max_prolong: int | None,
    farm_invalid_grace: float | None,
    farm_alive_grace: float | None,
    farm_election_ttl: float | None,
    verbose: int,
    deployers: tuple[str, ...],
    **world: object,
) -> None:
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
    params = dict(locals())
    params.update(params.pop("world"))
    # the console script's fast path calls the same (cli/entry.py)
    run_command(params)


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
