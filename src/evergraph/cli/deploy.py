"""`evergraph deploy FILE` and `evergraph deploys`: publish code to the World, list deploys."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import click

from evergraph.cli.world import state_dir_option, with_world
from evergraph.world.kv import KV

if TYPE_CHECKING:
    import nacl.signing


def register(cli: click.Group, world_options: Callable[..., Callable[..., None]]) -> None:
    ctx = {"help_option_names": ["-h", "--help"], "max_content_width": 100}

    @cli.command(context_settings=ctx)
    @click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
    @click.option(
        "--no-git",
        is_flag=True,
        help="Send FILE's directory as it is on disk, not the files tracked at git HEAD "
        "(the same things are left out).",
    )
    @click.option(
        "--force",
        is_flag=True,
        help="Deploy even if HEAD does not descend from the previous deploy's commit.",
    )
    @click.option(
        "--key",
        "key_file",
        type=click.Path(dir_okay=False, path_type=Path),
        default=None,
        help="Sign with the key in this file (a base64 32-byte Ed25519 seed, as "
        "STATE/keys/sign.key). [default: this host's key in the state dir]",
    )
    @click.option(
        "--dry-run",
        is_flag=True,
        help="List what would be sent (path, mode, size) and what is left out; send nothing.",
    )
    @click.option(
        "--max-file-size",
        default="10M",
        show_default=True,
        metavar="SIZE",
        help="Leave out files larger than this (bytes, or with a K, M or G suffix).",
    )
    @state_dir_option
    @world_options
    def deploy(
        file: Path,
        no_git: bool,
        force: bool,
        key_file: Path | None,
        dry_run: bool,
        max_file_size: str,
        state_dir: Path | None,
        **opts: object,
    ) -> None:
        """Publish FILE and the files next to it to the World as the next deploy,
        signed by this host's key (or --key).

        FILE is a YAML graph (.yaml/.yml) or a Python graph (.py). In a git work
        tree, what is sent is the files tracked at HEAD under FILE's directory
        (read from git, not the work tree; a tracked file with uncommitted
        changes stops the deploy); the commit is recorded, and must descend
        from the previous deploy's commit (--force skips that check). With
        --no-git, it is FILE's directory as it is on disk.

        Never sent, either way: an evergraph state dir, keys/ directories,
        sockets, FIFOs, devices, files over --max-file-size, dot entries,
        __pycache__ and what .evergraphignore files exclude (gitignore syntax;
        `!name` sends a dot file). At most 1000 files, 16 MiB. --dry-run lists
        it all.

        Agents started without a FILE run the newest deploy signed by a
        deployer they trust (`run --deployer KEY`, or the first signer they
        see) and swap to each new one live.

        \b
        Prints: deploy N HASH (K files, B bytes, git COMMIT, L left out); signed by KEY (FP)
        Exit status: 0 deployed, 1 the World failed, 2 bad input or a failed check.
        \b
        Examples:
          evergraph deploy site/main.yaml                    # sqlite World of this host
          evergraph deploy site/main.py --seeds http://10.0.0.1:2379
          evergraph deploy site/main.yaml --dry-run          # what would be sent?
          evergraph deploy /tmp/try/graph.yaml --no-git --key ~/deployer.key
          evergraph deploy site/main.yaml --force            # after a rebase
        """
        from evergraph.cluster import deploys as dp
        from evergraph.cluster.hostkeys import fingerprint
        from evergraph.frontends import bundle as bd

        limit = _size(max_file_size)
        try:
            b = bd.collect(file, use_git=not no_git, max_file_size=limit)
        except dp.DeployError as e:
            _fail(e)
        key = _signing_key(key_file, state_dir)
        signer = dp.verify_key_of(key)
        signed = f"{signer} ({fingerprint(signer)})"
        git = f", git {b.git[:12]}" if b.git else ""
        left = f", {len(b.left_out)} left out" if b.left_out else ""
        if dry_run:
            for rel, c in sorted(b.files.items()):
                click.echo(f"send\t{c.mode:04o}\t{len(c.data)}\t{rel}")
            for lo in b.left_out:
                click.echo(f"leave out\t{lo.path}\t{lo.why}")
            click.echo(
                f"dry run: would deploy {len(b.files)} files, {b.size} bytes{git}{left}; "
                f"signed by {signed}; nothing sent"
            )
            sys.exit(0)
        for lo in b.left_out:
            if lo.notable:
                click.echo(f"evergraph: deploy: left out {lo.path}: {lo.why}", err=True)
        check = None if force or b.git is None else bd.descends_from(b.root, b.git)
        by = dp.whoami()

        async def body(kv: KV) -> dp.Deploy:
            return await dp.publish(
                kv, b.entry, b.files, key=key, git=b.git, by=by, check_parent=check
            )

        try:
            d = with_world(state_dir, opts, body)
        except dp.DeployError as e:
            _fail(e)
        click.echo(
            f"deploy {d.n} {d.hash[:12]} ({len(b.files)} files, {b.size} bytes{git}{left}); "
            f"signed by {signed}"
        )

    @cli.command(context_settings=ctx)
    @click.option("--json", "as_json", is_flag=True, help="One JSON record per deploy.")
    @state_dir_option
    @world_options
    def deploys(as_json: bool, state_dir: Path | None, **opts: object) -> None:
        """List the deploys in the World, oldest first.

        \b
        Columns: n  hash  git  by  time  entry  signer (fingerprint)
        Example:
          evergraph deploys --seeds http://10.0.0.1:2379
        """
        import logging

        import msgspec

        from evergraph.cluster import deploys as dp
        from evergraph.cluster.hostkeys import fingerprint

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
            signer = fingerprint(d.signer)
            click.echo(f"{d.n}\t{d.hash[:12]}\t{git}\t{d.by}\t{when}\t{d.entry}\t{signer}")
        sys.exit(0)


_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def _size(text: str) -> int:
    """Bytes in `10M`, `512K`, `1048576` (K, M, G: powers of 1024); exit 2 if bad."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = t[-1:] if t[-1:] in _UNITS else ""
    digits = t[: len(t) - len(unit)]
    if not digits.isdigit():
        click.echo(
            f"evergraph: deploy: --max-file-size: {text!r} is not a size (e.g. 10M, 512K, 4096)",
            err=True,
        )
        sys.exit(2)
    return int(digits) * _UNITS[unit]


def _signing_key(key_file: Path | None, state_dir: Path | None) -> nacl.signing.SigningKey:
    """The key to sign with: --key's file, or this host's (created on first use)."""
    from evergraph.cluster import deploys as dp

    if key_file is not None:
        try:
            return dp.read_signing_key(key_file)
        except dp.DeployError as e:
            click.echo(f"evergraph: deploy: --key: {e}", err=True)
            sys.exit(2)
    from evergraph.agent.run import prepare_state_dir
    from evergraph.cli.main import _die
    from evergraph.cluster.hostkeys import HostKeys, KeyError_
    from evergraph.errors import InputError

    try:
        return HostKeys(prepare_state_dir(state_dir)).sign_key
    except InputError as e:
        _die(e)
    except (KeyError_, OSError) as e:
        click.echo(f"evergraph: deploy: this host's signing key: {e}", err=True)
        sys.exit(2)


def _fail(e: Exception) -> NoReturn:
    click.echo(f"evergraph: deploy: {e}", err=True)
    sys.exit(2)
