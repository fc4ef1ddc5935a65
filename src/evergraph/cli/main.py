"""`evergraph` commands. Every user error is one line on stderr and exit status 2."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import click

from evergraph._version import __version__
from evergraph.cli.entry import check_summary, error_line, one_line
from evergraph.errors import InputError

if TYPE_CHECKING:
    from evergraph.agent.run import Agent, FarmOptions, Service
    from evergraph.world.open import WorldOptions

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}
#: where the etcd password may come from, rather than a command line
ETCD_PASSWORD_ENV = "EVERGRAPH_ETCD_PASSWORD"


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


def _farm_options(
    worker: bool,
    caps: tuple[str, ...],
    groups: tuple[str, ...],
    ssh_port: int,
    ssh_user: str,
    authorized_keys: Path | None,
    farm_servers: tuple[str, ...],
    http_addr: str | None,
) -> FarmOptions | None:
    if not worker and (caps or groups or farm_servers or authorized_keys):
        raise InputError(
            "--cap, --group, --authorized-keys and --farm-server describe a worker: add --worker",
            "--worker",
        )
    if not worker and not http_addr:
        return None
    # imported here: an agent outside the farm does not load the farm package
    from evergraph.agent.run import FarmOptions
    from evergraph.farm.facts import parse_caps
    from evergraph.world.names import hostname_problem

    try:
        parsed = parse_caps(caps)
    except ValueError as e:
        raise InputError(str(e), "--cap") from None
    for h in farm_servers:
        why = hostname_problem(h)
        if why:
            raise InputError(why, "--farm-server")
    return FarmOptions(
        worker=worker,
        caps=parsed,
        groups=list(groups),
        ssh_port=ssh_port,
        ssh_user=ssh_user,
        authorized_keys=str(authorized_keys.absolute()) if authorized_keys else "",
        key_servers=tuple(farm_servers),
        matcher=bool(http_addr),
    )


def _http_service(addr: str, anonymous: str | None) -> Service:
    """The HTTP server as an agent service; the socket is bound now (InputError)."""
    from evergraph.http.server import HttpServer, bind

    sock = bind(addr)

    async def serve(agent: Agent) -> None:
        from evergraph.farm.service import Farm
        from evergraph.http.app import create_app
        from evergraph.http.farm_api import FarmApi
        from evergraph.http.observe import AgentView

        farm = None
        if agent.kv is not None:
            farm = Farm(agent.kv, host=agent.settings.host(), collector=agent.collector)
        view = AgentView(agent, farm=farm is not None)
        app = create_app(agent.status, FarmApi(farm, anonymous), view)
        await view.serve(HttpServer(app, sock, on_stop=view.close))

    serve.observes = True  # type: ignore[attr-defined]  # metrics and the live view
    return serve


def _etcd_password(world: dict[str, object]) -> str | None:
    """From --etcd-password-file, else the environment, else --etcd-password (warned:
    a command line is visible to every user of the host)."""
    # Taken out of the environment: the commands the agent runs inherit it.
    env = os.environ.pop(ETCD_PASSWORD_ENV, None)
    given, file = world.get("etcd_password"), world.get("etcd_password_file")
    if given is not None and file is not None:
        raise InputError(
            "give --etcd-password-file or --etcd-password, not both", "--etcd-password"
        )
    if file is not None:
        try:
            with open(str(file), "rb") as f:
                data = f.read(65537)
        except OSError as e:
            raise InputError(f"cannot read {file}: {e.strerror}", "--etcd-password-file") from None
        if len(data) > 65536:
            raise InputError(f"{file} is over 64 KiB: not a password", "--etcd-password-file")
        try:
            password = data.decode().rstrip("\r\n")  # one line, as `echo` writes it
        except UnicodeDecodeError:
            raise InputError(f"{file} is not UTF-8 text", "--etcd-password-file") from None
        if not password:
            raise InputError(f"{file} is empty", "--etcd-password-file")
        return password
    if given is not None:
        click.echo(
            "evergraph: warning: --etcd-password is visible to every user of this host "
            f"(ps): use --etcd-password-file FILE or {ETCD_PASSWORD_ENV}",
            err=True,
        )
        return str(given) or None
    return env or None


def _world_opts(world: dict[str, object]) -> WorldOptions:
    from evergraph.world.open import WorldOptions, seed_problem

    seeds = tuple(u.strip() for u in str(world.get("seeds") or "").split(",") if u.strip())
    for url in seeds:
        why = seed_problem(url)
        if why:
            raise InputError(why, "--seeds")
    for flag in ("etcd_ca", "etcd_cert", "etcd_key"):
        p = world.get(flag)
        if p is not None and not Path(str(p)).is_file():
            raise InputError(f"no such file: {p}", "--" + flag.replace("_", "-"))
    if (world.get("etcd_cert") is None) != (world.get("etcd_key") is None):
        raise InputError("give both --etcd-cert and --etcd-key, or neither", "--etcd-cert")

    def path(k: str) -> Path | None:
        v = world.get(k)
        return Path(str(v)) if v is not None else None

    return WorldOptions(
        backend=str(world.get("world_backend") or "sqlite"),
        db=path("world_db"),
        seeds=seeds,
        embedded=world.get("etcd_mode") == "embedded",
        ca=path("etcd_ca"),
        cert=path("etcd_cert"),
        key=path("etcd_key"),
        user=str(world["etcd_user"]) if world.get("etcd_user") else None,
        password=_etcd_password(world),
    )


@cli.command(context_settings=CONTEXT)
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path), required=False)
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
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
    "change nothing.",
)
@click.option(
    "--diff",
    is_flag=True,
    help="Log what each change changed with diffs on real runs too (as --noop does).",
)
@click.option(
    "--sema",
    type=click.IntRange(min=0),
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
    help="Stop after this many seconds, cancelling applies still running (0.001 to a year).",
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
    metavar="HOST",
    help="An agent serving the farm API that may receive this worker's job keys "
    "(repeatable; this host always may).",
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
    diff: bool,
    sema: int,
    no_watch: bool,
    no_autoedges: bool,
    no_autogroup: bool,
    converged_timeout: float | None,
    converged_exit: bool,
    converged_status_file: Path | None,
    max_runtime: float | None,
    graphviz: Path | None,
    log_format: str,
    replace: bool,
    http_addr: str | None,
    farm_anonymous: str | None,
    worker: bool,
    caps: tuple[str, ...],
    groups: tuple[str, ...],
    ssh_port: int,
    ssh_user: str,
    authorized_keys: Path | None,
    farm_servers: tuple[str, ...],
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
    from evergraph.agent.api import frontend_for
    from evergraph.agent.api import run as run_graph
    from evergraph.cli.logs import flush_logs, flusher, setup_logging, terminal_handler
    from evergraph.cli.progress import service as progress_service
    from evergraph.engine.settings import check_times

    setup_logging(log_format, verbose)
    try:
        check_times(converged_timeout, max_runtime)
        frontend = frontend_for(file)
        if deployers:
            from evergraph.frontends.deploy import trust_deployers

            trust_deployers(frontend, deployers)
        frontend.preload()
        world_opts = _world_opts(world)
        services = [_http_service(http_addr, farm_anonymous)] if http_addr else []
        # the live display on a terminal; "still running" lines in a pipe
        services.append(progress_service(terminal_handler()))
        services.append(flusher)  # a pipe's buffered lines, written soon after they come
        farm = _farm_options(
            worker, caps, groups, ssh_port, ssh_user, authorized_keys, farm_servers, http_addr
        )
    except InputError as e:
        _die(e)
    try:
        status = run_graph(
            frontend,
            state_dir=state_dir,
            hostname=hostname,
            noop=noop,
            diff=diff,
            sema=sema,
            watch=not no_watch,
            autoedges=not no_autoedges,
            autogroup=not no_autogroup,
            converged_timeout=converged_timeout,
            converged_exit=converged_exit,
            converged_status_file=converged_status_file,
            max_runtime=max_runtime,
            graphviz=graphviz,
            world=world_opts,
            replace=replace,
            deployers=list(deployers),
            services=services,
            farm=farm,
        )
    finally:
        flush_logs()
    # The agent has stopped: its World is closed, its children are gone, its writes
    # are on disk. Skip the interpreter's teardown, which would free a big graph
    # object by object (0.6 s for 50k vertices) after SIGTERM asked us to go.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


@cli.command(context_settings=CONTEXT)
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
def check(file: Path) -> None:
    """Load and validate FILE, print a summary; change nothing.

    \b
    Example:
      evergraph check site.yaml && evergraph run site.yaml
    """
    from evergraph.frontends.open import open_graph_file

    try:
        model = open_graph_file(file).load()
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
