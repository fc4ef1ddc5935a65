"""`evergraph remote FILE HOST...`: converge hosts over SSH that run nothing of
evergraph (issue 26). A thin adapter over evergraph.remote."""

from __future__ import annotations

import asyncio
import contextlib
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
    @click.argument("hosts", nargs=-1, metavar="[HOST]...")
    @click.option(
        "--inventory",
        type=click.Path(dir_okay=False, path_type=Path),
        metavar="FILE",
        help="Hosts from FILE (besides any HOST): one [user@]host[:port] a line (# comments), "
        "or YAML `hosts:` mapping each name to host, user, port, key, hostname (see below).",
    )
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
        default=None,
        help="Each host's agent exits once its graph has stayed unchanged this many seconds "
        "(the hosts end one by one). [default: the session ends as soon as every host is "
        "converged and the run's World has had no write for 0.5 s (no export on its way); "
        "with --seeds: 5]",
    )
    @click.option("--noop", is_flag=True, help="Change nothing; say what would change.")
    @click.option("--diff", is_flag=True, help="Show each change's diff (as `run --diff`).")
    @click.option(
        "--converged-exit",
        is_flag=True,
        help="Accepted for `run`'s sake: a remote agent always exits once converged "
        "(with or without it: see --converged-timeout), and the run ends when every "
        "host did.",
    )
    @click.option(
        "--seeds",
        metavar="URL,...",
        help="The hosts use this etcd cluster (client URLs, as the hosts reach them) as "
        "their World: no World is started here and none is forwarded. "
        "[default: a World of this run's own, reached through each host's SSH connection]",
    )
    @click.option(
        "--log-format",
        type=click.Choice(["text", "json"]),
        default="text",
        show_default=True,
        help="text: each host's lines prefixed by its name (on a terminal under a live "
        "table of the hosts), then a recap; json: one JSON object per line (a host's log "
        "record with its `host`, a `recap` per host, then the `total`).",
    )
    @click.option(
        "--install",
        is_flag=True,
        help="Leave an agent running on each HOST as a service: the hosts form a TLS "
        "cluster (the first host forms it, the others join) and follow FILE, deployed "
        "signed by --key. This machine's etcd goes with the bundle (a host's own etcd, "
        "if it has one, is used first).",
    )
    @click.option(
        "--uninstall",
        is_flag=True,
        help="Stop and remove what --install left (service, unit, launcher, join token); "
        "the state dir /var/lib/evergraph/state is kept unless --purge. FILE is not read.",
    )
    @click.option(
        "--key",
        "key_file",
        type=click.Path(dir_okay=False, path_type=Path),
        default=None,
        help="With --install: the deploy key the hosts trust and FILE is signed with (as "
        "`deploy --key`). [default: this host's key in its state dir]",
    )
    @click.option(
        "--purge",
        is_flag=True,
        help="With --uninstall: also remove the state dir (keys, cluster CA, World data) "
        "and the installed bundles.",
    )
    def remote(
        file: Path,
        hosts: tuple[str, ...],
        inventory: Path | None,
        ssh_keys: tuple[Path, ...],
        known_hosts: Path,
        accept_new_host_keys: bool,
        parallel: int,
        converged_timeout: float | None,
        noop: bool,
        diff: bool,
        converged_exit: bool,
        seeds: str | None,
        log_format: str,
        install: bool,
        uninstall: bool,
        key_file: Path | None,
        purge: bool,
    ) -> None:
        """Converge the graph in FILE on each HOST over SSH, then leave.

        HOST is [user@]host[:port]; --inventory FILE gives hosts too (HOST or
        --inventory: at least one). A host needs sshd and python3 (the same minor
        version as here) and nothing else: evergraph is installed into a
        content-addressed directory under /var/lib/evergraph/remote on first contact
        (a later run sends only hashes). The hosts share a World the initiator owns
        for the run, reached through each host's SSH connection (with --seeds: that
        cluster). A remote agent lives exactly as long as its SSH session.

        The session ends the moment every host is converged (every resource clean
        and idle) and the World has been quiet for 0.5 s with no host busy again
        (an export from one host to another is applied first): then each agent is
        told to exit. With --converged-timeout N each agent exits by itself once
        converged N seconds instead; with --seeds that is the default (5 s).

        \b
        A YAML inventory (a first line `hosts:`; every field optional):
          hosts:
            web1:                 # the name: the agent's --hostname, and the
              host: 10.0.0.5      #   address unless `host` is given
              user: root          # [default: the local user]
              port: 2222          # [default: 22]
              key: ~/.ssh/deploy  # tried before --ssh-key (relative: to the inventory's dir)
              hostname: web1.lan  # the agent's --hostname [default: the name]
            db:
        An error in it is one line FILE:LINE and exit 2, before any connection.

        With --install the agents stay, as services (systemd's; without systemd,
        the unit's command is started directly and its PID kept): see --install,
        --uninstall.

        \b
        Exit status: 0 every host converged clean, 1 a resource failed somewhere,
        2 bad input (the graph is checked here before any connection), 3 with --noop:
        something would change, 4 a host could not be reached or set up.
        \b
        Examples:
          evergraph remote site.yaml web1 web2 root@db:2222
          evergraph remote site.py 10.0.0.5 --ssh-key ~/.ssh/deploy --accept-new-host-keys
          evergraph remote site.yaml --inventory hosts.yaml --diff
          evergraph remote site.yaml --inventory hosts.txt --log-format json | jq .
          evergraph remote site.yaml web1 web2 --seeds http://10.0.0.1:2379
          evergraph remote site.yaml 10.0.0.1 10.0.0.2 10.0.0.3 --install --key ~/deployer.key
          evergraph remote site.yaml 10.0.0.1 10.0.0.2 10.0.0.3 --uninstall
        """
        from evergraph.cli.common import load_for_check
        from evergraph.cli.logs import escape
        from evergraph.cli.main import _die
        from evergraph.remote.inventory import merge, read_inventory
        from evergraph.remote.progress import Json, Live, Plain
        from evergraph.remote.runner import RemoteRun, exit_status
        from evergraph.remote.session import AgentArgs, SshOptions
        from evergraph.remote.target import Target
        from evergraph.world.open import seed_problem

        del converged_exit  # always so (see its help)
        try:
            targets = merge(
                [Target.parse(h) for h in hosts],
                read_inventory(inventory) if inventory is not None else [],
            )
            for key in ssh_keys:
                if not key.expanduser().is_file():
                    raise InputError("no such file", f"--ssh-key {key}")
            seed_urls = [u.strip() for u in (seeds or "").split(",") if u.strip()]
            if seeds is not None and not seed_urls:
                raise InputError("no URL given", "--seeds")
            for url in seed_urls:
                if why := seed_problem(url):
                    raise InputError(why, "--seeds")
            if install and uninstall:
                raise InputError("give one of --install and --uninstall", "--install")
            if not uninstall:
                load_for_check(file)
            if purge and not uninstall:
                raise InputError("--purge goes with --uninstall", "--purge")
            if install:
                from evergraph.remote.bundle import BundleError
                from evergraph.remote.install import local_etcd

                try:
                    local_etcd()
                except BundleError as e:
                    raise InputError(str(e).split(": ", 1)[1], "--install") from None
        except InputError as e:
            _die(e)
        ssh = SshOptions(
            keys=[k.expanduser() for k in ssh_keys],
            known_hosts=known_hosts,
            accept_new_host_keys=accept_new_host_keys,
        )
        if install or uninstall:
            from evergraph.cli.deploy import _signing_key
            from evergraph.remote import install as ri

            signing_key = _signing_key(key_file, None) if install else None
            job = ri.Install(file, targets, key=signing_key, ssh=ssh, purge=purge)
            sys.exit(ri.main(job, uninstall=uninstall, echo=click.echo))
        run = RemoteRun(
            file,
            targets,
            ssh=ssh,
            agent=AgentArgs(
                converged_timeout=converged_timeout, noop=noop, diff=diff, log_format=log_format
            ),
            parallel=parallel,
            seeds=seed_urls,
        )
        labels = [t.label for t in targets]

        def clean(text: str) -> str:
            return escape(text, lines=False)

        output: Json | Live | Plain
        if log_format == "json":
            output = Json()
        elif sys.stdout.isatty():
            output = Live(labels, clean)
        else:
            output = Plain(labels, clean)
        try:
            with output if isinstance(output, Live) else contextlib.nullcontext():
                outcomes = asyncio.run(run.run(output.emit, output.report))
        except KeyboardInterrupt:
            sys.exit(130)
        output.finish(outcomes)
        sys.exit(exit_status(outcomes))
