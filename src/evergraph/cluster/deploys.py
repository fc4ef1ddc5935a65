"""Deploys: code published to the World as numbered, hash-chained, signed records
(SPEC §4.4).

World layout:

- `deploys/files/<sha256hex>`: the raw bytes of one blob, content-addressed and
  write-once (identical content in any deploy is stored once). A file is one
  blob, or several of at most `CHUNK_BYTES` each: a blob is one World value,
  and etcd refuses requests over 1.5 MiB;
- `deploys/<n>` (`n` zero-padded to 10 digits): the JSON `Deploy` record. It is
  what makes deploy `n` exist: it is created with `cas(expect=0)`, so of two
  deployers that both computed `n`, exactly one gets it; the other re-reads,
  re-runs its checks and tries `n + 1`;
- `deploys/head`: the same bytes as the newest record, for followers to watch.
  Moved forward only, with `cas` on its mod revision. It is written after the
  record, so it can lag for a moment (or for good, if a deployer died in
  between); readers take it as a hint and look for newer records after it;
- `deploys/by/<sha256 hex of the signer's key>`: the same bytes as that
  signer's newest record (written after the record, before the head, forward
  only). Anyone who can write the World can publish records signed by keys of
  their own, as many as they like: a follower finds its trusted deployers'
  newest deploys here, so no number of untrusted records can hide them.

A record holds `n`, `parent` (the previous record's hash, "" for deploy 1),
`hash` (sha256 over a canonical encoding of every other field but the
signature), `entry` (the graph file, relative to the deploy's root), `files`
(relative path -> `File`: sha256, size, mode 0644/0755, blob keys), `git` (the
commit deployed, or None), `by` (user@host), `time`, `signer` (the deployer's
Ed25519 verify key, base64) and `signature` (base64, by `signer` over the hash).
A record that does not decode, verify or carry a good signature is refused
everywhere. Whose signature a follower accepts is its `Trust`: deployers named
explicitly, or the first signer seen, pinned in the state dir's pins.json.

What goes into a deploy (git, the filesystem walk, ignore patterns) is decided
by `evergraph.frontends.bundle`; this module only stores and reads records.

Public API (DeployError is the one error for bad input or a bad World record;
the World's own failures are `WorldError`):

- `await publish(kv, entry, files, key=, git=, by=, check_parent=) -> Deploy`;
- `await latest(kv)`, `await get(kv, n)`, `await history(kv)`;
- `await fetch(kv, deploy, dest) -> dest / entry`: materialise a deploy, modes too;
- `follow(kv, trust, after=)`: async iterator of the newest trusted deploy and each
  newer one (never one older than `after`, the high-water mark);
- `newer(d, than)`: whether `d` may replace deploy `than` (no going back);
- `Trust(keys=, pins=)`: whose deploys a follower runs;
- `decode_record(value, where) -> Deploy`: decode and verify one record;
  `verify(deploy, where)`, `record_hash(...)`, `file_ref(data, mode)`;
- `read_signing_key(path)`, `verify_key_of(key)`, `mode_of(st_mode)`;
- `whoami() -> "user@host"`, `record_key(n)`, `blob_key(sha)`, `signer_key(signer)`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from pathlib import Path

import msgspec
import nacl.signing

from evergraph._util.atomic import fsync_dir, make_dirs, temp_name
from evergraph.cluster.deploy_record import (
    _COMMIT,
    _HASH_TAG,
    _SHA,
    _SIG_TAG,
    BY,
    CHUNK_BYTES,
    FILES,
    HEAD,
    LOOKBACK,
    MAX_ATTEMPTS,
    MAX_BYTES,
    MAX_FILES,
    MODES,
    PREFIX,
    SUFFIXES,
    Content,
    Deploy,
    DeployError,
    File,
    _check_file,
    _check_files,
    _chunked,
    _hash_of,
    _path_problem,
    _sha256,
    _signed_bytes,
    blob_key,
    canonical_key,
    decode_record,
    file_ref,
    mode_of,
    newer,
    read_signing_key,
    record_hash,
    record_key,
    sign,
    signed_deploy,
    signer_key,
    verify,
    verify_key_of,
    whoami,
)
from evergraph.cluster.hostkeys import fingerprint
from evergraph.cluster.pins import Pins, PinsError
from evergraph.world.follow import Tombstone, watch_one
from evergraph.world.kv import KV, KeyValue, WorldError

#: the record's format is deploy_record.py's, re-exported here with the rest
__all__ = [
    "BY",
    "CHUNK_BYTES",
    "FILES",
    "HEAD",
    "LOOKBACK",
    "MAX_ATTEMPTS",
    "MAX_BYTES",
    "MAX_FILES",
    "MODES",
    "PREFIX",
    "SUFFIXES",
    "_COMMIT",
    "_HASH_TAG",
    "_SHA",
    "_SIG_TAG",
    "Content",
    "Deploy",
    "DeployError",
    "File",
    "Trust",
    "_check_file",
    "_check_files",
    "_chunked",
    "_hash_of",
    "_path_problem",
    "_sha256",
    "_signed_bytes",
    "blob_key",
    "canonical_key",
    "decode_record",
    "fetch",
    "file_ref",
    "follow",
    "get",
    "history",
    "latest",
    "mode_of",
    "newer",
    "publish",
    "read_signing_key",
    "record_hash",
    "record_key",
    "sign",
    "signer_key",
    "verify",
    "verify_key_of",
    "whoami",
]

log = logging.getLogger("evergraph.deploys")

# -- trust --------------------------------------------------------------------------------


class Trust:
    """Whose deploys a follower runs: only the `keys` given (base64 verify keys), or
    else the deployers pinned in `pins`; with none pinned yet, the signer of the
    first deploy checked is pinned (trust on first use) and logged.

    Also remembers what it refused, so that each refused record is logged once
    however often the World shows it again (`refuse`)."""

    #: refused records remembered (then forgotten all at once: logged again, rarely)
    _REMEMBER = 4096

    def __init__(self, keys: Sequence[str] = (), pins: Pins | None = None) -> None:
        self.keys = [canonical_key(k) for k in keys]
        if not self.keys and pins is None:
            raise ValueError("Trust: give deployer keys, or pins to pin the first one")
        self.pins = None if self.keys else pins
        self._refused: set[str] = set()

    def trusted(self) -> list[str]:
        """The keys trusted now (PinsError if the pins file went bad)."""
        if self.pins is None:
            return list(self.keys)
        return [canonical_key(k) for k in self.pins.trusted_deployers()]

    def check(self, d: Deploy, where: str) -> Deploy:
        """`d` if its (verified) signer is trusted, pinning it if nobody is yet;
        DeployError naming `where` otherwise."""
        try:
            keys = self.trusted()
            if not keys and self.pins is not None:
                self.pins.add_deployer(d.signer)
                log.warning(
                    "deploys: pinned deployer %s (%s), the signer of deploy %d: from now on "
                    "only its deploys run here (trust on first use; kept in %s; "
                    "`run --deployer KEY` names deployers instead)",
                    d.signer,
                    fingerprint(d.signer),
                    d.n,
                    self.pins.path,
                )
                return d
        except (PinsError, ValueError) as e:
            raise DeployError(f"{where}: cannot check the deployer: {e}") from None
        if d.signer not in keys:
            raise DeployError(
                f"{where}: deploy {d.n} is signed by {fingerprint(d.signer)} ({d.signer}), "
                f"not by a trusted deployer ({', '.join(fingerprint(k) for k in keys)}): refused"
            )
        return d

    def refuse(self, message: str, record: bytes | None) -> None:
        """Log `message` about `record` (its bytes), unless this record was refused
        before."""
        seen = _sha256(record if record is not None else message.encode())
        if seen in self._refused:
            return
        if len(self._refused) >= self._REMEMBER:
            self._refused.clear()
        self._refused.add(seen)
        log.warning("deploys: %s; skipped", message)


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


async def _newest_trusted(kv: KV, trust: Trust) -> Deploy | None:
    """The newest deploy `trust` accepts: the newest of its trusted signers' own
    records (`deploys/by/...`) and of the newest LOOKBACK records (None if there
    is none); each refused record is logged through `trust.refuse`."""
    found = await _by_signers(kv, trust)
    n = await _newest_n(kv)
    for i in range(n, max(0, n - LOOKBACK), -1):
        if found is not None and found.n >= i:
            break
        key = record_key(i)
        item = await kv.get(key)
        if item is None:
            continue
        try:
            d = decode_record(item.value, key)
            if d.n != i:
                raise DeployError(f"{key}: the record says it is deploy {d.n}")
            return trust.check(d, key)
        except DeployError as e:
            trust.refuse(str(e), item.value)
    return found


async def _by_signers(kv: KV, trust: Trust) -> Deploy | None:
    """The newest of the trusted signers' own newest records (`deploys/by/...`),
    or None; a bad one is logged through `trust.refuse`."""
    try:
        keys = trust.trusted()
    except (PinsError, ValueError):
        return None  # Trust.check says why, on the records themselves
    best: Deploy | None = None
    for k in keys:
        where = signer_key(k)
        item = await kv.get(where)
        if item is None:
            continue
        try:
            d = _signer_record(item.value, k, trust)
        except DeployError as e:
            trust.refuse(str(e), item.value)
            continue
        if best is None or d.n > best.n:
            best = d
    return best


def _signer_record(value: bytes, signer: str, trust: Trust) -> Deploy:
    """The deploy in `deploys/by/<signer>`'s value: verified, signed by `signer`,
    trusted; DeployError naming the key otherwise."""
    where = signer_key(signer)
    d = decode_record(value, where)
    if d.signer != signer:
        raise DeployError(f"{where}: deploy {d.n} is not signed by {fingerprint(signer)}")
    return trust.check(d, where)


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


async def _advance_signer(kv: KV, d: Deploy, value: bytes) -> None:
    """Point `deploys/by/<signer>` at `d`, unless it names a newer deploy of its signer."""
    key = signer_key(d.signer)
    while True:
        cur = await kv.get(key)
        if cur is not None:
            try:
                old = decode_record(cur.value, key)
                if old.signer == d.signer and old.n >= d.n:
                    return
            except DeployError:
                pass  # a bad record: ours replaces it
        if await kv.cas(key, value, expect=cur.mod_revision if cur else 0):
            return


async def next_slot(kv: KV) -> tuple[int, Deploy | None]:
    """The newest deploy's number and record (0, None: none yet): the next deploy
    is number n + 1 and chains to it."""
    n = await _newest_n(kv)
    try:
        return n, (await _record_at(kv, n) if n else None)
    except DeployError as e:
        raise DeployError(
            f"{e}; the next deploy cannot chain to it (delete it by hand to deploy "
            f"after deploy {n - 1})"
        ) from None


async def put_blobs(kv: KV, contents: Iterable[bytes]) -> None:
    """Every chunk of `contents` as a blob (each distinct chunk once), before the
    record that names them."""
    written: set[str] = set()
    for data in contents:
        for sha, part in _chunked(data):
            if sha not in written:
                await _put_blob(kv, sha, part)
                written.add(sha)


async def claim(kv: KV, d: Deploy, value: bytes) -> bool:
    """Write the signed record `value` (of `d`) if its number is still free, then
    the signer's record and the head; False if another deployer took the number.
    Whoever writes it, the record is the signer's: agents check its signature."""
    if not await kv.cas(record_key(d.n), value, expect=0):
        return False
    await _advance_signer(kv, d, value)
    await _advance_head(kv, d, value)
    return True


async def publish(
    kv: KV,
    entry: str,
    files: Mapping[str, Content],
    *,
    key: nacl.signing.SigningKey,
    git: str | None,
    by: str,
    check_parent: Callable[[Deploy | None], Awaitable[None]] | None = None,
) -> Deploy:
    """Publish `files` as the next deploy, signed by `key`, and return its record.

    `check_parent(previous deploy or None)` runs before each attempt to claim a
    number and may refuse with DeployError (the CLI's git ancestry check).
    Blobs are written first, then the record (which claims the number), then
    the signer's record (`deploys/by/...`), then the head."""
    if git is not None and not _COMMIT.fullmatch(git):
        raise DeployError(f"git {git!r} is not a commit id")
    _check_files(entry, list(files), "deploy")
    refs: dict[str, File] = {}
    for p, c in sorted(files.items()):
        try:
            refs[p] = file_ref(c.data, c.mode)
        except ValueError as e:
            raise DeployError(f"{p}: {e}") from None
    if sum(f.size for f in refs.values()) > MAX_BYTES:
        raise DeployError(f"deploy: more than {MAX_BYTES} bytes of files")
    blobs_written = False
    for _ in range(MAX_ATTEMPTS):
        n, prev = await next_slot(kv)
        if check_parent is not None:
            await check_parent(prev)
        if not blobs_written:
            await put_blobs(kv, [files[p].data for p in refs])
            blobs_written = True
        d = signed_deploy(
            key,
            n=n + 1,
            parent=prev.hash if prev else "",
            entry=entry,
            files=refs,
            git=git,
            by=by,
            time=time.time(),
        )
        if await claim(kv, d, msgspec.json.encode(d)):
            return d
        log.info("deploys: deploy %d was taken by another deployer; trying again", d.n)
    raise DeployError(
        f"other deploys kept taking the next number ({MAX_ATTEMPTS} tries); try again"
    )


# -- fetching -----------------------------------------------------------------------------


async def _blob(kv: KV, sha: str, what: str) -> bytes:
    item = await kv.get(blob_key(sha))
    if item is None:
        raise DeployError(f"{blob_key(sha)}: missing ({what})")
    if _sha256(item.value) != sha:
        raise DeployError(f"{blob_key(sha)}: its content does not match its hash ({what})")
    return item.value


async def fetch(kv: KV, deploy: Deploy, dest: Path) -> Path:
    """Write the deploy's files under `dest` (which must not exist; made at once,
    by renaming a finished temporary sibling), each with its mode, and return the
    entry's path. The record (hash, signature) and every blob are checked first."""
    verify(deploy, record_key(deploy.n))
    if dest.exists() or dest.is_symlink():
        raise DeployError(f"{dest}: already exists")
    parts: dict[str, bytes] = {}
    contents: dict[str, bytes] = {}
    for p, f in sorted(deploy.files.items()):
        if f.sha in contents:
            continue
        what = f"file {p} of deploy {deploy.n}"
        for sha in f.chunks:
            if sha not in parts:
                parts[sha] = await _blob(kv, sha, what)
        data = b"".join(parts[sha] for sha in f.chunks)
        if len(data) != f.size or _sha256(data) != f.sha:
            raise DeployError(f"{p}: its blobs do not make its content (deploy {deploy.n})")
        contents[f.sha] = data
    try:
        make_dirs(dest.parent)
        # `.<name>.<hex>.tmp` (the agent sweeps those at start); mkdir never follows
        tmp = dest.parent / temp_name(dest.name)
        tmp.mkdir(mode=0o700)
    except OSError as e:
        raise DeployError(f"{dest}: {e.strerror}") from None
    try:
        made = {tmp}
        for p, f in deploy.files.items():
            target = tmp / p
            for d in reversed(target.parents):
                if d not in made and d.is_relative_to(tmp):
                    d.mkdir(exist_ok=True)
                    made.add(d)
            # O_EXCL|O_NOFOLLOW: the names were checked, but never write through a link
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as out:
                out.write(contents[f.sha])
                out.flush()
                os.fchmod(out.fileno(), f.mode)  # exactly the mode, whatever the umask
                os.fsync(out.fileno())  # on disk before the tree gets its name
        for d in made:
            fsync_dir(d)
        os.rename(tmp, dest)
        fsync_dir(dest.parent)
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


async def _checked(
    read: Callable[[], Awaitable[Deploy | None]], trust: Trust, value: bytes | None
) -> Deploy | None:
    """`read()`'s deploy (None: none), retrying World errors a few times; bad and
    untrusted records are logged (once each, by `trust`: `value` names the record
    for that), not raised."""
    delay = 0.05
    for attempt in range(_FOLLOW_RETRIES + 1):
        try:
            return await read()
        except DeployError as e:
            trust.refuse(str(e), value)
            return None
        except WorldError as e:
            if attempt == _FOLLOW_RETRIES:
                raise
            log.warning("deploys: reading the deploy failed (%s); retrying", e)
            await asyncio.sleep(delay)
            delay *= 2
    return None  # unreachable


def _reader(
    kv: KV, trust: Trust, key: str, value: bytes, signers: Mapping[str, str]
) -> Callable[[], Awaitable[Deploy]]:
    """Reads the trusted deploy in `value`, the head's or a signer's record (`key`)."""

    async def read() -> Deploy:
        if key == HEAD:
            return trust.check(await _head_deploy(kv, value), HEAD)
        return _signer_record(value, signers[key], trust)

    return read


def _trusted_now(trust: Trust) -> list[str]:
    try:
        return trust.trusted()
    except (PinsError, ValueError):
        return []


async def follow(kv: KV, trust: Trust, after: Deploy | None = None) -> AsyncIterator[Deploy]:
    """The newest deploy `trust` accepts now (if any), then each newer one as it is
    published. A record that is unsigned, wrongly signed, malformed or signed by an
    untrusted key is logged once and skipped.

    `after`: the newest deploy this follower ran before (its high-water mark, kept
    across restarts): nothing that is not `newer` than it, or than what was
    yielded since, is yielded, and a trusted deploy older than it (a record
    deleted and the head pointed back, an old World put back) is refused, logged
    once.

    First looks for the newest trusted record (the head may lag it; each trusted
    signer's own newest record is read too, so untrusted records, however many,
    cannot hide it), then watches `deploys/head` and the trusted signers'
    `deploys/by/...` (resuming after a broken watch, re-reading after a
    compaction). A bad head (garbage, wrong schema or hash, or not the record it
    names) is logged as a warning and skipped. After the World was replaced
    (`kv.epoch` changed) its newest trusted deploy is looked for again (`newer`
    accepts a World numbered afresh by the deploys' signing times). Ends when
    `kv` is closed."""
    mark = after
    epoch = kv.epoch
    first = True
    queue: asyncio.Queue[tuple[str, KeyValue | Tombstone | BaseException | None]]
    queue = asyncio.Queue()
    watched: dict[str, asyncio.Task[None]] = {}

    async def pump(key: str) -> None:
        try:
            async with contextlib.aclosing(watch_one(kv, key)) as snaps:
                async for snap in snaps:
                    await queue.put((key, snap))
        except Exception as e:
            await queue.put((key, e))
            return
        await queue.put((key, None))

    #: `deploys/by/...` key -> the trusted signer it is for
    signers: dict[str, str] = {}

    def watch_signers() -> None:
        for k in _trusted_now(trust):
            signers.setdefault(signer_key(k), k)
        for key in [HEAD, *signers]:
            if key not in watched:
                watched[key] = asyncio.create_task(pump(key), name=f"deploys-watch {key}")

    watch_signers()
    try:
        while True:
            key, snap = await queue.get()
            if snap is None:  # the World was closed
                return
            if isinstance(snap, BaseException):
                raise snap
            if kv.epoch != epoch:  # a new World: look for its newest deploy
                epoch, first = kv.epoch, True
            found: list[Deploy | None] = []
            # a signer's own newest record older than the mark is no alarm: with
            # several deployers, the others' newest are older than the newest
            quiet = not first and key != HEAD
            if first:
                # the newest record, even if the head lags it or is bad
                found.append(await _checked(lambda: _newest_trusted(kv, trust), trust, None))
                first = False
            elif not isinstance(snap, Tombstone):
                value = snap.value

                found.append(await _checked(_reader(kv, trust, key, value, signers), trust, value))
            watch_signers()  # a signer pinned meanwhile (trust on first use)
            best = max((d for d in found if d is not None), key=lambda d: d.n, default=None)
            if best is None:
                continue
            if newer(best, mark):
                mark = best
                yield best
            elif mark is not None and best.hash != mark.hash and not quiet:
                trust.refuse(
                    f"deploy {best.n} ({best.hash[:12]}) is older than deploy {mark.n} "
                    f"({mark.hash[:12]}), the newest run here: refused (a follower never "
                    "goes back to an older deploy)",
                    best.hash.encode(),
                )
    finally:
        for t in watched.values():
            t.cancel()
        for t in watched.values():
            with contextlib.suppress(asyncio.CancelledError):
                await t
