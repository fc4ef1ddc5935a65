"""Deploys: code published to the World as numbered, hash-chained records (SPEC §4.4).

World layout:

- `deploys/files/<sha256hex>`: the raw bytes of one file, content-addressed and
  write-once (identical content in any deploy is stored once);
- `deploys/<n>` (`n` zero-padded to 10 digits): the JSON `Deploy` record. It is
  what makes deploy `n` exist: it is created with `cas(expect=0)`, so of two
  deployers that both computed `n`, exactly one gets it; the other re-reads,
  re-runs its checks and tries `n + 1`;
- `deploys/head`: the same bytes as the newest record, for followers to watch.
  Moved forward only, with `cas` on its mod revision. It is written after the
  record, so it can lag for a moment (or for good, if a deployer died in
  between); readers take it as a hint and look for newer records after it.

A record holds `n`, `parent` (the previous record's hash, "" for deploy 1),
`hash` (sha256 over a canonical encoding of every other field), `entry` (the
graph file, relative to the deploy's root), `files` (relative path -> blob
sha256), `git` (the HEAD commit deployed, or None), `by` (user@host), `time`.
The hash is a checksum, not a signature: whoever may write the World may
deploy; it catches damaged and hand-edited records.

Public API (DeployError is the one error for bad input or a bad World record;
the World's own failures are `WorldError`):

- `collect(path) -> (entry, {relative path: bytes})`: what `deploy FILE` publishes;
- `git_head(path) -> commit`: HEAD of the repository holding `path`, which must
  have no uncommitted changes to tracked files under `path`'s directory;
- `await publish(kv, entry, files, git=, force=, by=, repo=) -> Deploy`;
- `await latest(kv)`, `await get(kv, n)`, `await history(kv)`;
- `await fetch(kv, deploy, dest) -> dest / entry`: materialise a deploy;
- `follow(kv)`: async iterator of the newest deploy and each newer one;
- `decode_record(value, where) -> Deploy`: decode and verify one record;
  `verify(deploy, where)`, `record_hash(n=, parent=, entry=, files=, git=, by=, time=)`;
- `whoami() -> "user@host"`, `record_key(n)`, `blob_key(sha)`.
"""

from __future__ import annotations

import asyncio
import contextlib
import getpass
import hashlib
import logging
import math
import os
import re
import shutil
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path, PurePosixPath

import msgspec

from evergraph.world.follow import Tombstone, watch_one
from evergraph.world.kv import KV, KeyValue, WorldError

log = logging.getLogger("evergraph.deploys")

PREFIX = "deploys/"
HEAD = "deploys/head"
FILES = "deploys/files/"
SUFFIXES = (".yaml", ".yml", ".py")
MAX_FILES = 1000
MAX_BYTES = 16 << 20
#: one file's limit: a blob is one World value, and etcd refuses requests over
#: 1.5 MiB by default (--max-request-bytes)
MAX_FILE_BYTES = 1 << 20
#: how many lost races (another deployer took the number) before giving up
MAX_ATTEMPTS = 50
_HASH_TAG = "evergraph-deploy/1"
_SHA = re.compile(r"[0-9a-f]{64}")
_COMMIT = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")


class DeployError(Exception):
    """A deploy cannot be made or read: bad input, a failed check, a bad record.
    The message is one line; the CLI prints it and exits with status 2."""


class Deploy(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    n: int
    #: hash of deploy n-1's record; "" for deploy 1
    parent: str
    #: sha256 (hex) over the canonical encoding of every other field
    hash: str
    #: the graph file, relative to the deploy's root
    entry: str
    #: relative path -> sha256 (hex) of its content (the blob's key)
    files: dict[str, str]
    #: the git commit deployed, if checked
    git: str | None
    #: user@host
    by: str
    #: seconds since the epoch
    time: float


_decoder = msgspec.json.Decoder(Deploy)  # strict: no type coercion, no unknown fields


def record_key(n: int) -> str:
    return f"{PREFIX}{n:010d}"


def blob_key(sha: str) -> str:
    return f"{FILES}{sha}"


def whoami() -> str:
    """`user@host` for a record's `by`."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry and no $USER
        user = str(os.getuid())
    return f"{user}@{socket.gethostname()}"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def record_hash(
    *,
    n: int,
    parent: str,
    entry: str,
    files: dict[str, str],
    git: str | None,
    by: str,
    time: float,
) -> str:
    """The sha256 of a record's other fields: a JSON array in a fixed order (files
    sorted by path), so the same record always hashes the same."""
    canon = [_HASH_TAG, n, parent, entry, sorted(files.items()), git, by, time]
    return _sha256(msgspec.json.encode(canon))


def _hash_of(d: Deploy) -> str:
    return record_hash(
        n=d.n, parent=d.parent, entry=d.entry, files=d.files, git=d.git, by=d.by, time=d.time
    )


def _path_problem(p: str) -> str | None:
    """Why `p` is not a safe relative file name in a deploy, or None."""
    if not p or "\0" in p:
        return "is empty or holds a NUL"
    if p.startswith("/"):
        return "is absolute"
    parts = p.split("/")
    if any(part in ("", ".", "..") for part in parts):
        return "is not a plain relative path (empty, '.' or '..' component)"
    return None


def _check_files(entry: str, paths: list[str], where: str) -> None:
    for p in paths:
        why = _path_problem(p)
        if why:
            raise DeployError(f"{where}: file name {p!r} {why}")
    if entry not in paths:
        raise DeployError(f"{where}: the entry {entry!r} is not one of the files")
    if not entry.endswith(SUFFIXES):
        raise DeployError(f"{where}: the entry {entry!r} is not a .yaml, .yml or .py file")
    if len(paths) > MAX_FILES:
        raise DeployError(f"{where}: {len(paths)} files; at most {MAX_FILES}")
    # "a" and "a/b" cannot both be files
    names = set(paths)
    for p in paths:
        for parent in PurePosixPath(p).parents:
            if str(parent) in names:
                raise DeployError(f"{where}: {parent!s} is both a file and a directory")


def verify(d: Deploy, where: str) -> None:
    """Raise DeployError (naming `where`) unless the record is well-formed and its
    hash matches."""
    if d.n <= 0:
        raise DeployError(f"{where}: deploy number {d.n} is not positive")
    if d.n == 1 and d.parent != "":
        raise DeployError(f"{where}: deploy 1 names a parent")
    if d.n > 1 and not _SHA.fullmatch(d.parent):
        raise DeployError(f"{where}: parent {d.parent!r} is not a sha256")
    if d.git is not None and not _COMMIT.fullmatch(d.git):
        raise DeployError(f"{where}: git {d.git!r} is not a commit id")
    if not math.isfinite(d.time):
        raise DeployError(f"{where}: time is not a finite number")
    for p, sha in d.files.items():
        if not _SHA.fullmatch(sha):
            raise DeployError(f"{where}: file {p!r} names {sha!r}, not a sha256")
    _check_files(d.entry, list(d.files), where)
    if _hash_of(d) != d.hash:
        raise DeployError(f"{where}: the record's hash does not match its content")


def decode_record(value: bytes, where: str) -> Deploy:
    """The verified deploy in a record's bytes; DeployError naming `where` if bad."""
    try:
        d = _decoder.decode(value)
    except msgspec.DecodeError as e:
        raise DeployError(f"{where}: not a deploy record: {e}") from None
    verify(d, where)
    return d


# -- collecting files -----------------------------------------------------------------


def collect(path: Path) -> tuple[str, dict[str, bytes]]:
    """The entry's name and every file to publish with it: each regular file under
    `path`'s directory, except dot-entries (.git, .venv, ...) and `__pycache__`.
    A symlink is published as the file it names, which must be inside the tree."""
    if not path.name.endswith(SUFFIXES):
        raise DeployError(f"{path}: a deploy's entry must be a .yaml, .yml or .py file")
    try:
        st = path.stat()
    except OSError as e:
        raise DeployError(f"{path}: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise DeployError(f"{path}: not a regular file")
    root_link = path.absolute().parent
    root = root_link.resolve()
    out: dict[str, bytes] = {}
    total = 0

    def inside(real: Path) -> bool:
        return real == root or root in real.parents

    def add(rel: str, real: Path, size: int) -> None:
        nonlocal total
        if len(out) >= MAX_FILES:
            raise DeployError(
                f"{root_link}: more than {MAX_FILES} files to deploy; "
                "deploy from a directory holding only the graph and its files"
            )
        if size > MAX_FILE_BYTES:
            raise DeployError(f"{rel}: {size} bytes; one file may hold at most {MAX_FILE_BYTES}")
        total += size
        if total > MAX_BYTES:
            raise DeployError(
                f"{root_link}: more than {MAX_BYTES} bytes to deploy (at {rel}); "
                "deploy from a directory holding only the graph and its files"
            )
        try:
            data = real.read_bytes()
        except OSError as e:
            raise DeployError(f"{rel}: cannot read: {e.strerror}") from None
        out[rel] = data

    def walk(real_dir: Path, rel_dir: str, stack: frozenset[Path]) -> None:
        try:
            entries = sorted(os.scandir(real_dir), key=lambda e: e.name)
        except OSError as e:
            raise DeployError(f"{rel_dir or '.'}: cannot list: {e.strerror}") from None
        for ent in entries:
            name = ent.name
            if name.startswith(".") or name == "__pycache__":
                continue
            rel = f"{rel_dir}{name}"
            try:
                rel.encode()
            except UnicodeEncodeError:
                raise DeployError(f"{rel_dir or '.'}: a file name is not UTF-8") from None
            real = Path(ent.path)
            if ent.is_symlink():
                target = real.resolve()
                if not inside(target):
                    raise DeployError(
                        f"{rel}: a symlink leaving the deployed directory (to {target})"
                    )
                real = target
            try:
                st = real.stat()
            except OSError as e:
                raise DeployError(f"{rel}: {e.strerror}") from None
            if stat.S_ISDIR(st.st_mode):
                if real in stack:  # a symlink to an ancestor
                    raise DeployError(f"{rel}: a symlink loop")
                walk(real, rel + "/", stack | {real})
            elif stat.S_ISREG(st.st_mode):
                add(rel, real, st.st_size)
            # sockets, fifos, devices: not code, skipped

    walk(root, "", frozenset({root}))
    entry = path.name
    if entry not in out:  # a dot-named entry, skipped by the walk
        real = path.resolve()
        if not inside(real):
            raise DeployError(f"{entry}: a symlink leaving the deployed directory (to {real})")
        add(entry, real, real.stat().st_size)
    _check_files(entry, list(out), str(root_link))
    return entry, out


# -- git ---------------------------------------------------------------------------------


def _git(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            ["git", *args],
            cwd=cwd,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=60,
            check=False,
        )
    except FileNotFoundError:
        raise DeployError("git is not installed (install it, or deploy with --no-git)") from None
    except subprocess.TimeoutExpired:
        raise DeployError(f"git {args[0]} in {cwd} took over 60 s") from None


def _first_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[0].strip() if lines else "failed"


def git_head(path: Path) -> str:
    """The HEAD commit of the git repository holding `path`. DeployError when
    `path` is not in a repository or a tracked file under its directory has
    uncommitted (staged or unstaged) changes."""
    d = path.absolute().parent
    if not d.is_dir():
        raise DeployError(f"{d}: no such directory")
    r = _git(d, "rev-parse", "--show-toplevel")
    if r.returncode != 0:
        if "not a git repository" in r.stderr:
            raise DeployError(
                f"{d} is not in a git repository (deploy with --no-git to skip the git check)"
            )
        raise DeployError(f"git in {d}: {_first_line(r.stderr)}")
    r = _git(d, "rev-parse", "--verify", "--quiet", "HEAD^{commit}")
    if r.returncode != 0:
        raise DeployError(f"the git repository holding {d} has no commit yet")
    head = r.stdout.strip()
    # `-- .`: only files under the deployed directory count
    r = _git(d, "status", "--porcelain=v1", "-z", "--untracked-files=no", "--", ".")
    if r.returncode != 0:
        raise DeployError(f"git status in {d}: {_first_line(r.stderr)}")
    changed = [e for e in r.stdout.split("\0") if len(e) > 3]
    if changed:
        name = changed[0][3:]
        more = f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""
        raise DeployError(
            f"{name} has uncommitted changes{more}: commit them first "
            "(or deploy with --no-git to skip the git check)"
        )
    return head


async def _is_ancestor(repo: Path, old: str, new: str) -> bool | None:
    """Whether commit `old` is an ancestor of (or equal to) `new`; None if `old`
    is not in the repository."""
    try:
        proc = await asyncio.create_subprocess_exec(
            "git",
            "merge-base",
            "--is-ancestor",
            old,
            new,
            cwd=repo,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
    except FileNotFoundError:
        raise DeployError("git is not installed (install it, or deploy with --no-git)") from None
    _, err = await proc.communicate()
    if proc.returncode == 0:
        return True
    if proc.returncode == 1:
        return False
    if b"not a valid commit" in err or b"bad object" in err or b"Not a valid" in err:
        return None
    raise DeployError(f"git merge-base in {repo}: {_first_line(err.decode(errors='replace'))}")


# -- reading ------------------------------------------------------------------------------


async def _record_at(kv: KV, n: int) -> Deploy:
    key = record_key(n)
    item = await kv.get(key)
    if item is None:
        raise DeployError(f"{key}: no such deploy")
    d = decode_record(item.value, key)
    if d.n != n:
        raise DeployError(f"{key}: the record says it is deploy {d.n}")
    return d


async def _records(kv: KV) -> list[KeyValue]:
    """Every record key (`deploys/<digits>`), in order; blobs and head excluded."""
    out: list[KeyValue] = []
    for digit in "0123456789":
        items, _ = await kv.range(f"{PREFIX}{digit}")
        out.extend(i for i in items if i.key[len(PREFIX) :].isdigit())
    return out


async def _head_deploy(kv: KV, value: bytes) -> Deploy:
    """The deploy `deploys/head` names; it must be the same bytes as its record."""
    d = decode_record(value, HEAD)
    item = await kv.get(record_key(d.n))
    if item is None or item.value != value:
        raise DeployError(f"{HEAD}: deploy {d.n} is not the record {record_key(d.n)}")
    return d


async def _newest_n(kv: KV) -> int:
    """The highest deploy number with a record (0: none). The head is the hint;
    records after it (the head lags its record) are found by probing."""
    n = 0
    head = await kv.get(HEAD)
    if head is not None:
        try:
            n = (await _head_deploy(kv, head.value)).n
        except DeployError as e:
            log.warning("deploys: %s; looking for the newest record", e)
    if n == 0:
        items = await _records(kv)
        n = int(items[-1].key[len(PREFIX) :]) if items else 0
    while await kv.get(record_key(n + 1)) is not None:
        n += 1
    return n


async def latest(kv: KV) -> Deploy | None:
    """The newest deploy, or None if there is none; DeployError if its record is bad."""
    n = await _newest_n(kv)
    return await _record_at(kv, n) if n else None


async def get(kv: KV, n: int) -> Deploy:
    """Deploy `n`; DeployError if it does not exist or its record is bad."""
    if n <= 0:
        raise DeployError(f"deploy numbers start at 1, not {n}")
    return await _record_at(kv, n)


async def history(kv: KV) -> list[Deploy]:
    """Every readable deploy, oldest first. A bad record, or one that does not
    chain to the record before it, is logged as a warning (and a bad one skipped)."""
    out: list[Deploy] = []
    for item in await _records(kv):
        try:
            d = decode_record(item.value, item.key)
            if record_key(d.n) != item.key:
                raise DeployError(f"{item.key}: the record says it is deploy {d.n}")
        except DeployError as e:
            log.warning("deploys: %s", e)
            continue
        if out and (out[-1].n + 1, out[-1].hash) != (d.n, d.parent):
            log.warning("deploys: %s does not chain to deploy %d", item.key, out[-1].n)
        out.append(d)
    return out


# -- publishing ---------------------------------------------------------------------------


async def _put_blob(kv: KV, sha: str, data: bytes) -> None:
    """Write a blob unless it is there; a damaged one (its content does not match
    its key) is replaced, as only these bytes can belong under this key."""
    key = blob_key(sha)
    while True:
        cur = await kv.get(key)
        if cur is not None and _sha256(cur.value) == sha:
            return
        if cur is not None:
            log.warning("deploys: %s was damaged; writing it again", key)
        if await kv.cas(key, data, expect=cur.mod_revision if cur else 0):
            return


async def _advance_head(kv: KV, d: Deploy, value: bytes) -> None:
    """Point the head at `d`, unless it already names a newer deploy."""
    while True:
        cur = await kv.get(HEAD)
        if cur is not None:
            try:
                if (await _head_deploy(kv, cur.value)).n >= d.n:
                    return
            except DeployError:
                pass  # a bad head: ours replaces it
        if await kv.cas(HEAD, value, expect=cur.mod_revision if cur else 0):
            return


async def publish(
    kv: KV,
    entry: str,
    files: dict[str, bytes],
    *,
    git: str | None,
    force: bool,
    by: str,
    repo: Path | None,
) -> Deploy:
    """Publish `files` (from `collect`) as the next deploy and return its record.

    With `git` (the commit being deployed; `repo` is a directory of its
    repository), the previous deploy's commit, if it has one, must be an
    ancestor of `git`, unless `force`. Blobs are written first, then the record
    (which claims the number), then the head."""
    if git is not None and not _COMMIT.fullmatch(git):
        raise DeployError(f"git {git!r} is not a commit id")
    if git is not None and repo is None:
        raise ValueError("publish: `repo` is needed with `git`")
    _check_files(entry, list(files), "deploy")
    shas = {p: _sha256(data) for p, data in files.items()}
    blobs_written = False
    for _ in range(MAX_ATTEMPTS):
        n = await _newest_n(kv)
        try:
            prev = await _record_at(kv, n) if n else None
        except DeployError as e:
            raise DeployError(
                f"{e}; the next deploy cannot chain to it (delete it by hand to deploy "
                f"after deploy {n - 1})"
            ) from None
        if prev is not None and prev.git and git and not force:
            assert repo is not None
            ok = await _is_ancestor(repo, prev.git, git)
            if ok is False:
                raise DeployError(
                    f"commit {git[:12]} is not a descendant of deploy {prev.n}'s commit "
                    f"{prev.git[:12]}; use --force to deploy it anyway"
                )
            if ok is None:
                raise DeployError(
                    f"deploy {prev.n}'s commit {prev.git[:12]} is not in the repository at "
                    f"{repo}, so {git[:12]} cannot be checked to descend from it; "
                    "use --force to deploy it anyway"
                )
        if not blobs_written:
            for p, sha in shas.items():
                await _put_blob(kv, sha, files[p])
            blobs_written = True
        parent = prev.hash if prev else ""
        now = time.time()
        digest = record_hash(
            n=n + 1, parent=parent, entry=entry, files=shas, git=git, by=by, time=now
        )
        d = Deploy(
            n=n + 1,
            parent=parent,
            hash=digest,
            entry=entry,
            files=dict(sorted(shas.items())),
            git=git,
            by=by,
            time=now,
        )
        value = msgspec.json.encode(d)
        if await kv.cas(record_key(d.n), value, expect=0):
            await _advance_head(kv, d, value)
            return d
        log.info("deploys: deploy %d was taken by another deployer; trying again", d.n)
    raise DeployError(
        f"other deploys kept taking the next number ({MAX_ATTEMPTS} tries); try again"
    )


# -- fetching -----------------------------------------------------------------------------


async def fetch(kv: KV, deploy: Deploy, dest: Path) -> Path:
    """Write the deploy's files under `dest` (which must not exist; made at once,
    by renaming a finished temporary sibling) and return the entry's path.
    Every blob and the record's hash are checked first."""
    verify(deploy, record_key(deploy.n))
    if dest.exists() or dest.is_symlink():
        raise DeployError(f"{dest}: already exists")
    blobs: dict[str, bytes] = {}
    for p, sha in sorted(deploy.files.items()):
        if sha in blobs:
            continue
        item = await kv.get(blob_key(sha))
        if item is None:
            raise DeployError(f"{blob_key(sha)}: missing (file {p} of deploy {deploy.n})")
        if _sha256(item.value) != sha:
            raise DeployError(
                f"{blob_key(sha)}: its content does not match its hash (file {p} of deploy "
                f"{deploy.n})"
            )
        blobs[sha] = item.value
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent))
    except OSError as e:
        raise DeployError(f"{dest}: {e.strerror}") from None
    try:
        for p, sha in deploy.files.items():
            target = tmp / p
            target.parent.mkdir(parents=True, exist_ok=True)
            # O_EXCL|O_NOFOLLOW: the names were checked, but never write through a link
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            with os.fdopen(fd, "wb") as f:
                f.write(blobs[sha])
        os.rename(tmp, dest)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise DeployError(f"{dest}: cannot write deploy {deploy.n}: {e.strerror or e}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest / deploy.entry


# -- following ----------------------------------------------------------------------------

#: World errors while checking one head before `follow` gives up (backoff 0.05 s .. 0.8 s)
_FOLLOW_RETRIES = 5


async def _checked(kv: KV, value: bytes | None) -> Deploy | None:
    """The deploy a head snapshot names (None: no head, or fall back to the newest
    record), retrying World errors a few times; bad records are logged, not raised."""
    delay = 0.05
    for attempt in range(_FOLLOW_RETRIES + 1):
        try:
            if value is None:
                return await latest(kv)
            return await _head_deploy(kv, value)
        except DeployError as e:
            log.warning("deploys: %s; skipped", e)
            return None
        except WorldError as e:
            if attempt == _FOLLOW_RETRIES:
                raise
            log.warning("deploys: reading the deploy failed (%s); retrying", e)
            await asyncio.sleep(delay)
            delay *= 2
    return None  # unreachable


async def follow(kv: KV) -> AsyncIterator[Deploy]:
    """The newest deploy now (if any), then each newer one as it is published.

    First looks for the newest record (the head may lag it), then watches
    `deploys/head` (resuming after a broken watch, re-reading after a
    compaction). A bad head (garbage, wrong schema or hash, or not the record it
    names) is logged as a warning and skipped; a head naming an older deploy
    than one already yielded is ignored. Ends when `kv` is closed."""
    last = 0
    first = True
    async with contextlib.aclosing(watch_one(kv, HEAD)) as snaps:
        async for snap in snaps:
            value = None if isinstance(snap, Tombstone) else snap.value
            d = None
            if first:
                # the newest record, even if the head lags it or is bad
                d = await _checked(kv, None)
                first = False
            if d is None and value is not None:
                d = await _checked(kv, value)
            if d is not None and d.n > last:
                last = d.n
                yield d
