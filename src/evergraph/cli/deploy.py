"""`evergraph deploy FILE` and `evergraph deploys`: publish code to the World, list deploys."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import click

from evergraph.cli.world import state_dir_option, with_world
from evergraph.world.kv import KV


def register(cli: click.Group, world_options: Callable[..., Callable[..., None]]) -> None:
    ctx = {"help_option_names": ["-h", "--help"], "max_content_width": 100}

    @cli.command(context_settings=ctx)
    @click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
    @click.option(
        "--no-git",
        is_flag=True,
        help="Do not require FILE to be in a git repository with its changes committed.",
    )
    @click.option(
        "--force",
        is_flag=True,
        help="Deploy even if HEAD does not descend from the previous deploy's commit.",
    )
    @state_dir_option
    @world_options
    def deploy(
        file: Path, no_git: bool, force: bool, state_dir: Path | None, **opts: object
    ) -> None:
        """Publish FILE and the files next to it to the World as the next deploy.

        FILE is a YAML graph (.yaml/.yml) or a Python graph (.py). Every file
        under FILE's directory is published with it (except dot-entries such as
        .git and __pycache__; at most 1000 files, 16 MiB). Agents started
        without a FILE run the newest deploy and swap to each new one live.

        Unless --no-git, FILE must be in a git repository whose tracked files
        under FILE's directory are committed; the commit is recorded, and must
        descend from the previous deploy's commit (--force skips that check).

        \b
        Prints: deploy N HASH (K files, B bytes, git COMMIT)
        Exit status: 0 deployed, 1 the World failed, 2 bad input or a failed check.
        \b
        Examples:
          evergraph deploy site/main.yaml                    # sqlite World of this host
          evergraph deploy site/main.py --seeds http://10.0.0.1:2379
          evergraph deploy /tmp/try/graph.yaml --no-git
          evergraph deploy site/main.yaml --force            # after a rebase
        """
        from evergraph.world import deploys as dp

        try:
            entry, files = dp.collect(file)
            commit = None if no_git else dp.git_head(file)
        except dp.DeployError as e:
            _fail(e)
        by = dp.whoami()
        repo = file.absolute().parent

        async def body(kv: KV) -> dp.Deploy:
            return await dp.publish(kv, entry, files, git=commit, force=force, by=by, repo=repo)

        try:
            d = with_world(state_dir, opts, body)
        except dp.DeployError as e:
            _fail(e)
        size = sum(len(b) for b in files.values())
        extra = f", git {d.git[:12]}" if d.git else ""
        click.echo(f"deploy {d.n} {d.hash[:12]} ({len(files)} files, {size} bytes{extra})")

    @cli.command(context_settings=ctx)
    @click.option("--json", "as_json", is_flag=True, help="One JSON record per deploy.")
    @state_dir_option
    @world_options
    def deploys(as_json: bool, state_dir: Path | None, **opts: object) -> None:
        """List the deploys in the World, oldest first.

        \b
        Columns: n  hash  git  by  time  entry
        Example:
          evergraph deploys --seeds http://10.0.0.1:2379
        """
        import logging

        import msgspec

        from evergraph.world import deploys as dp

        # bad records are reported by warnings: show them on stderr
        logging.basicConfig(format="evergraph: %(message)s", level=logging.WARNING)

        async def body(kv: KV) -> list[dp.Deploy]:
            return await dp.history(kv)

        for d in with_world(state_dir, opts, body):
            if as_json:
                click.echo(msgspec.json.encode(d).decode())
                continue
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(d.time))
            git = d.git[:12] if d.git else "-"
            click.echo(f"{d.n}\t{d.hash[:12]}\t{git}\t{d.by}\t{when}\t{d.entry}")
        sys.exit(0)


def _fail(e: Exception) -> NoReturn:
    click.echo(f"evergraph: deploy: {e}", err=True)
    sys.exit(2)
