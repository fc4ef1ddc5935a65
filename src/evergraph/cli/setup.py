"""`evergraph setup systemd`: run the agent as a systemd service.

The unit is generated here from one template (not shipped as a data file) because
its `ExecStart=` must name the evergraph that generates it: the absolute path of
this executable (or this Python with `-m`), so a virtualenv install works as is.

The service is a configuration-management agent running as root: it writes /etc,
installs packages, manages users, services and files anywhere. So the usual
sandboxing (ProtectSystem, ProtectHome, PrivateTmp, NoNewPrivileges,
RestrictSUIDSGID, ProtectKernelTunables...) is left off on purpose: each would
break a kind of resource. What is on costs a root agent nothing.
"""

from __future__ import annotations

import errno
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path

import click

from evergraph._version import __version__
from evergraph.errors import InputError

#: where the unit goes (below --root)
UNIT_PATH = "etc/systemd/system/evergraph.service"
DEFAULT_STATE_DIR = Path("/var/lib/evergraph")
#: loopback: the farm API and /metrics are not for the network until an operator says so
DEFAULT_HTTP = "127.0.0.1:9233"
#: seconds a stop may take: the first SIGTERM lets in-flight applies (a package
#: install) finish; then systemd kills what is left
STOP_TIMEOUT = 180

_TEMPLATE = """\
# {path}: written by `evergraph setup systemd` (evergraph {version}).
# Change it by running that again (see --help); local changes are overwritten.
[Unit]
Description=evergraph configuration agent (keeps this host in its declared state)
Wants=network-online.target
After=network-online.target

[Service]
Type=exec
ExecStart={exec_start}
Restart=on-failure
RestartSec=5s
# SIGTERM to evergraph alone: it finishes in-flight applies and stops the commands
# it started (they are tied to it); whatever is left gets SIGKILL after that.
KillMode=mixed
TimeoutStopSec={stop_timeout}
{state_directory}UMask=0022
LimitNOFILE=65536
SyslogIdentifier=evergraph
# Hardening that does not get in the way of a root agent managing the whole host
# (writing /etc, installing packages, managing users and services): no
# ProtectSystem, ProtectHome, PrivateTmp or NoNewPrivileges, on purpose.
LockPersonality=yes
RestrictRealtime=yes

[Install]
WantedBy=multi-user.target
"""

#: an ExecStart= word that needs no quoting
_PLAIN = re.compile(r"[A-Za-z0-9_./:=@,+-]+\Z")


def systemd_word(arg: str) -> str:
    """One ExecStart= argument, quoted for systemd: `%` and `$` are doubled (no
    specifier or variable expansion), anything but plain characters is put in
    double quotes with `\\` and `"` escaped."""
    if any(c in arg for c in "\n\r\0"):
        raise InputError(f"{arg!r}: a service's command line cannot hold a newline or NUL")
    arg = arg.replace("%", "%%").replace("$", "$$")
    if arg and _PLAIN.match(arg):
        return arg
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'


def evergraph_command() -> list[str]:
    """How to start this very evergraph from a unit: its script's absolute path, or
    this Python with `-m` (when run as `python -m evergraph.cli.main`)."""
    argv0 = sys.argv[0] if sys.argv else ""
    if os.path.basename(argv0) == "evergraph" and os.access(argv0, os.X_OK):
        return [os.path.abspath(argv0)]
    return [os.path.abspath(sys.executable), "-m", "evergraph.cli.main"]


def unit_text(
    file: Path | None,
    state_dir: Path,
    http: str | None,
    run_args: Sequence[str] = (),
    command: Sequence[str] | None = None,
) -> str:
    """The unit that runs `evergraph run [--http ADDR] --state-dir DIR [run_args] [FILE]`."""
    argv = [*(command or evergraph_command()), "run", "--state-dir", str(state_dir)]
    if http:
        argv += ["--http", http]
    argv += run_args
    if file is not None:
        argv.append(str(file))
    # systemd creates and owns /var/lib/<name> (mode 0700) when the state dir is there
    state_directory = ""
    if state_dir.parent == Path("/var/lib"):
        state_directory = f"StateDirectory={state_dir.name}\nStateDirectoryMode=0700\n"
    return _TEMPLATE.format(
        path="/" + UNIT_PATH,
        version=__version__,
        exec_start=" ".join(systemd_word(a) for a in argv),
        stop_timeout=STOP_TIMEOUT,
        state_directory=state_directory,
    )


def _run_args(run: click.Command, args: Sequence[str]) -> list[str]:
    """The `run` options after `--`, checked by `run`'s own parser (InputError)."""
    if not args:
        return []
    if any(a in ("-h", "--help") for a in args):
        raise InputError("`--help` is not a run option for the service", "--")
    try:
        ctx = run.make_context("run", list(args), resilient_parsing=False)
    except click.UsageError as e:
        raise InputError(f"not a run option: {e.format_message()}", "--") from None
    params = ctx.params
    for name, flag in (("state_dir", "--state-dir"), ("http_addr", "--http"), ("file", "FILE")):
        if params.get(name) is not None:
            raise InputError(f"give {flag} to `evergraph setup systemd` itself (before `--`)", "--")
    for p in run.params:
        value = params.get(p.name or "")
        if isinstance(p.type, click.Path) and value is not None:
            for v in value if isinstance(value, tuple) else (value,):
                if not Path(str(v)).is_absolute():
                    raise InputError(
                        f"{v} is relative, and the service runs in /: give an absolute path",
                        "/".join(p.opts),
                    )
    return list(args)


def register(cli: click.Group) -> None:
    ctx = {"help_option_names": ["-h", "--help"], "max_content_width": 100}

    @cli.group(context_settings=ctx)
    def setup() -> None:
        """Set this host up to run evergraph (as a service)."""

    @setup.command(context_settings=ctx)
    # one argument: after `--` click would hand the first run option to FILE
    @click.argument("args", nargs=-1, type=click.UNPROCESSED, metavar="[FILE] [-- RUN_OPTION...]")
    @click.option("--print", "print_only", is_flag=True, help="Print the unit; install nothing.")
    @click.option(
        "--state-dir",
        type=click.Path(file_okay=False, path_type=Path),
        default=DEFAULT_STATE_DIR,
        show_default=True,
        help="The service's state dir (an absolute path).",
    )
    @click.option(
        "--http",
        "http_addr",
        metavar="ADDR",
        default=DEFAULT_HTTP,
        show_default=True,
        help="Where the service serves its HTTP API (health, /metrics, the farm); loopback "
        "unless you say otherwise.",
    )
    @click.option("--no-http", is_flag=True, help="No HTTP API.")
    @click.option(
        "--root",
        type=click.Path(file_okay=False, path_type=Path),
        default=Path("/"),
        show_default=True,
        help=f"Install below this directory (ROOT/{UNIT_PATH}), e.g. an image being built.",
    )
    def systemd(
        args: tuple[str, ...],
        print_only: bool,
        state_dir: Path,
        http_addr: str,
        no_http: bool,
        root: Path,
    ) -> None:
        """Install a systemd unit that runs `evergraph run` at boot and restarts it on
        failure: /etc/systemd/system/evergraph.service (replaced atomically).

        The service runs this evergraph (by its absolute path) as root:
        `run --state-dir DIR --http ADDR`, the run options given after `--`,
        and FILE (made absolute). Without FILE the service follows the deploys
        signed by a trusted deployer. Nothing calls systemctl: the command
        prints what to run next.

        \b
        Exit status: 0 written (or unchanged), 1 could not write, 2 bad input.
        \b
        Examples:
          evergraph setup systemd --print /etc/evergraph/site.yaml
          evergraph setup systemd /etc/evergraph/site.yaml
          evergraph setup systemd -- --seeds https://10.0.0.1:2379 --etcd-ca /etc/evergraph/ca.pem
          evergraph setup systemd --root /mnt/image --no-http /etc/evergraph/site.yaml
        """
        from evergraph.cli.main import _die

        try:
            if not state_dir.is_absolute():
                raise InputError(f"{state_dir} is not an absolute path", "--state-dir")
            http = None if no_http else http_addr
            if http is not None:
                from evergraph.http.server import parse_addr

                parse_addr(http)
            file = None
            if args and not args[0].startswith("-"):
                file, args = _graph_file(Path(args[0]), root), args[1:]
            run_cmd = cli.commands["run"]
            text = unit_text(file, state_dir, http, _run_args(run_cmd, args))
        except InputError as e:
            _die(e)
        if print_only:
            click.echo(text, nl=False)
            return
        _install(root, text)


def _graph_file(file: Path, root: Path) -> Path:
    """FILE as the service will name it: absolute. On this system it must exist;
    below another --root it is a path of that system (maybe not there yet)."""
    if file.suffix not in (".yaml", ".yml", ".py"):
        raise InputError(f"{file}: expected a .yaml, .yml or .py graph", "FILE")
    if root.resolve() != Path("/"):
        if not file.is_absolute():
            raise InputError(
                f"{file}: with --root, give the path the installed system sees", "FILE"
            )
        return file
    if not file.is_file():
        raise InputError(f"no such file: {file}", "FILE")
    return file.absolute()


def _install(root: Path, text: str) -> None:
    from evergraph._util.atomic import atomic_write

    target = root / UNIT_PATH
    try:
        before: bytes | None = target.read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        before = None  # a file in the way of the directory: the write says so
    except OSError as e:
        click.echo(f"evergraph: cannot read {target}: {e.strerror}", err=True)
        sys.exit(1)
    if before == text.encode():
        click.echo(f"{target} is unchanged")
        return
    try:
        atomic_write(target, text.encode(), mode=0o644, dir_mode=0o755)
    except OSError as e:
        hint = (
            " (run as root, or print it with --print)"
            if e.errno in (errno.EPERM, errno.EACCES)
            else ""
        )
        click.echo(f"evergraph: cannot write {target}: {e.strerror}{hint}", err=True)
        sys.exit(1)
    click.echo(f"{'replaced' if before is not None else 'wrote'} {target}")
    if root.resolve() != Path("/"):
        click.echo("once this root is the running system, enable the service:")
        click.echo("  systemctl enable --now evergraph")
        return
    click.echo("next, as root:")
    if before is None:
        click.echo("  systemctl daemon-reload && systemctl enable --now evergraph")
    else:
        click.echo("  systemctl daemon-reload && systemctl restart evergraph")
