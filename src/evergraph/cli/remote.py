"""`evergraph remote FILE HOST...`: converge hosts over SSH that run nothing of
evergraph (issue 26). A thin adapter over evergraph.remote."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from pathlib import Path

import click

from evergraph.errors import InputError


def register(cli: click.Group, world_options: Callable[..., Callable[..., None]]) -> None:
    del world_options  # the World of a remote run is its own (remote/runner.py)
    ctx = {"help_option_names": ["-h", "--help"], "max_content_width": 100}

    @cli.command(context_settings=ctx)
    @click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
    @click.argument("hosts", nargs=-1, required=True, metavar="HOST...")
    @click.option(
        "--ssh-key",
        "ssh_keys",
        multiple=True,
        type=click.Path(dir_okay=False, path_type=Path),
        help="A private key to log in with (repeatable). [default: ssh-agent and ~/.ssh/id_*]",
    )
    @click.option(
        "--known-hosts",
        type=click.Path(dir_okay=False, path_type=Path),
        default=Path("~/.ssh/known_hosts"),
        show_default=True,
        help="The trusted host keys: a host whose key is not there fails (never a prompt).",
    )
    @click.option(
        "--accept-new-host-keys",
        is_flag=True,
        help="Trust a host seen for the first time and record its key in --known-hosts "
        "(a changed key still fails).",
    )
    @click.option(
        "--parallel",
        type=click.IntRange(1, 1024),
        default=32,
        show_default=True,
        help="Hosts worked on at once.",
    )
    @click.option(
        "--converged-timeout",
        type=click.FloatRange(0, min_open=True),
        default=5.0,
        show_default=True,
        help="Seconds a host's graph stays unchanged before its agent counts it converged "
        "and exits.",
    )
    @click.option("--noop", is_flag=True, help="Change nothing; say what would change.")
    def remote(
        file: Path,
        hosts: tuple[str, ...],
        ssh_keys: tuple[Path, ...],
        known_hosts: Path,
        accept_new_host_keys: bool,
        parallel: int,
        converged_timeout: float,
        noop: bool,
    ) -> None:
        """Converge the graph in FILE on each HOST over SSH, then leave.

        HOST is [user@]host[:port]. A host needs sshd and python3 (the same minor
        version as here) and nothing else: evergraph is installed into a
        content-addressed directory under /var/lib/evergraph/remote on first contact
        (a later run sends only hashes). The hosts share a World the initiator owns
        for the run, reached through each host's SSH connection. A remote agent lives
        exactly as long as its SSH session.

        \b
        Exit status: 0 every host converged clean, 1 a resource failed somewhere,
        2 bad input (the graph is checked here before any connection), 3 with --noop:
        something would change, 4 a host could not be reached or set up.
        \b
        Examples:
          evergraph remote site.yaml web1 web2 root@db:2222
          evergraph remote site.py 10.0.0.5 --ssh-key ~/.ssh/deploy --accept-new-host-keys
        """
        from evergraph.cli.common import load_for_check
        from evergraph.cli.main import _die
        from evergraph.remote.runner import RemoteRun, exit_status, total_line
        from evergraph.remote.session import AgentArgs, SshOptions
        from evergraph.remote.target import Target

        try:
            targets = [Target.parse(h) for h in hosts]
            for key in ssh_keys:
                if not key.expanduser().is_file():
                    raise InputError("no such file", f"--ssh-key {key}")
            load_for_check(file)
        except InputError as e:
            _die(e)
        run = RemoteRun(
            file,
            targets,
            ssh=SshOptions(
                keys=[k.expanduser() for k in ssh_keys],
                known_hosts=known_hosts,
                accept_new_host_keys=accept_new_host_keys,
            ),
            agent=AgentArgs(converged_timeout=converged_timeout, noop=noop),
            parallel=parallel,
        )
        width = max(len(t.label) for t in targets)

        def emit(label: str, line: str) -> None:
            click.echo(f"{label:<{width}} | {line}")

        try:
            outcomes = asyncio.run(run.run(emit))
        except KeyboardInterrupt:
            sys.exit(130)
        for o in outcomes:
            click.echo(o.line)
        click.echo(total_line(outcomes))
        sys.exit(exit_status(outcomes))
