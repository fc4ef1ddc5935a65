"""A deploy record's format (cluster/deploys.py has the rest): the record (`Deploy`:
the files by path, each by content hash and mode, with the deployer's signature
over a hash of it all), the World keys, the bounds a record must keep, and its
checks (`verify`, `decode_record`), signing and hashing. Pure: no World, no I/O but
reading a signing key file.
"""

from __future__ import annotations

import base64
import getpass
import hashlib
import math
import os
import re
import socket
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import NamedTuple

import msgspec
import nacl.signing

from evergraph.cluster.hostkeys import HostKeys, check_verify_key, fingerprint

PREFIX = "deploys/"
HEAD = "deploys/head"
FILES = "deploys/files/"
#: each signer's newest record, under the sha256 (hex) of its verify key
BY = "deploys/by/"
SUFFIXES = (".yaml", ".yml", ".py")
MAX_FILES = 1000
MAX_BYTES = 16 << 20
#: one blob's size: a blob is one World value, and etcd refuses requests over
#: 1.5 MiB by default (--max-request-bytes); larger files are stored in parts
CHUNK_BYTES = 1 << 20
#: the modes a deployed file may have: the exec bits travel, nothing else
MODES = (0o644, 0o755)
#: how many lost races (another deployer took the number) before giving up
MAX_ATTEMPTS = 50
#: at start, how many records before the newest a follower looks through for a
#: trusted one (the newest may be refused)
LOOKBACK = 100
_HASH_TAG = "evergraph-deploy/2"
#: what is signed: this tag and the record's hash (never valid as an export's signature)
_SIG_TAG = b"evergraph-deploy/2 signature\n"
_SHA = re.compile(r"[0-9a-f]{64}")
_COMMIT = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")


class DeployError(Exception):
    """A deploy cannot be made or read: bad input, a failed check, a bad record.
    The message is one line; the CLI prints it and exits with status 2."""


class Content(NamedTuple):
    """One file to publish: its bytes and its mode (0644 or 0755)."""

    data: bytes
    mode: int


class File(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    #: sha256 (hex) of the whole content
    sha: str
    size: int
    #: 0o644 or 0o755 (JSON: 420 or 493)
    mode: int
    #: the blobs holding the content, in order: `[sha]` for a file up to
    #: CHUNK_BYTES, none for an empty file, else one per CHUNK_BYTES part
    chunks: tuple[str, ...]


class Deploy(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    n: int
    #: hash of deploy n-1's record; "" for deploy 1
    parent: str
    #: sha256 (hex) over the canonical encoding of every other field but `signature`
    hash: str
    #: the graph file, relative to the deploy's root
    entry: str
    #: relative path -> its content (sha256, size, mode, blobs)
    files: dict[str, File]
    #: the git commit deployed, if checked
    git: str | None
    #: user@host
    by: str
    #: seconds since the epoch
    time: float
    #: the deployer's Ed25519 verify key (base64)
    signer: str
    #: base64 Ed25519 signature by `signer` over the tag and `hash`
    signature: str


_decoder = msgspec.json.Decoder(Deploy)  # strict: no type coercion, no unknown fields


def record_key(n: int) -> str:
    return f"{PREFIX}{n:010d}"


def blob_key(sha: str) -> str:
    return f"{FILES}{sha}"


def signer_key(signer: str) -> str:
    """`deploys/by/<sha256 hex of the key's bytes>`: `signer`'s newest record."""
    try:
        raw = base64.b64decode(signer, validate=True)
    except ValueError:
        raw = signer.encode()
    return f"{BY}{_sha256(raw)}"


def newer(d: Deploy, than: Deploy | None) -> bool:
    """Whether a follower that ran (or verified) `than` may run `d`: not the same
    deploy, and a higher number or, for a World whose deploys were numbered
    afresh (recreated), signed later. A record numbered at or below `than` and
    signed before it is older: never run again (rollback)."""
    if than is None:
        return True
    return d.hash != than.hash and (d.n > than.n or d.time > than.time)


def whoami() -> str:
    """`user@host` for a record's `by`."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry and no $USER
        user = str(os.getuid())
    return f"{user}@{socket.gethostname()}"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def mode_of(st_mode: int) -> int:
    """The mode a file is deployed with: 0755 if any exec bit is set, else 0644."""
    return 0o755 if st_mode & 0o111 else 0o644


def file_ref(data: bytes, mode: int) -> File:
    """The record entry for `data` (mode must be one of MODES)."""
    if mode not in MODES:
        raise ValueError(f"mode {mode:o} is not 644 or 755")
    chunks = tuple(sha for sha, _ in _chunked(data))
    return File(sha=_sha256(data), size=len(data), mode=mode, chunks=chunks)


def _chunked(data: bytes) -> list[tuple[str, bytes]]:
    """(sha256, bytes) of each CHUNK_BYTES part of `data` (none if it is empty)."""
    parts = [data[i : i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)]
    return [(_sha256(p), p) for p in parts]


def canonical_key(key_b64: str) -> str:
    """A base64 verify key in its one canonical spelling; ValueError if it is not one."""
    raw = base64.b64decode(check_verify_key(key_b64), validate=True)
    return base64.b64encode(raw).decode()


def record_hash(
    *,
    n: int,
    parent: str,
    entry: str,
    files: Mapping[str, File],
    git: str | None,
    by: str,
    time: float,
    signer: str,
) -> str:
    """The sha256 of a record's fields but `hash` and `signature`: a JSON array in a
    fixed order (files sorted by path), so the same record always hashes the same."""
    canon = [
        _HASH_TAG,
        n,
        parent,
        entry,
        [[p, f.sha, f.size, f.mode, list(f.chunks)] for p, f in sorted(files.items())],
        git,
        by,
        time,
        signer,
    ]
    return _sha256(msgspec.json.encode(canon))


def _hash_of(d: Deploy) -> str:
    return record_hash(
        n=d.n,
        parent=d.parent,
        entry=d.entry,
        files=d.files,
        git=d.git,
        by=d.by,
        time=d.time,
        signer=d.signer,
    )


def _signed_bytes(digest: str) -> bytes:
    return _SIG_TAG + digest.encode()


def sign(key: nacl.signing.SigningKey, digest: str) -> str:
    """The base64 signature of a record hash."""
    return base64.b64encode(key.sign(_signed_bytes(digest)).signature).decode()


def signed_deploy(
    key: nacl.signing.SigningKey,
    *,
    n: int,
    parent: str,
    entry: str,
    files: dict[str, File],
    git: str | None,
    by: str,
    time: float,
) -> Deploy:
    """Deploy `n` after `parent`, hashed and signed by `key`."""
    signer = verify_key_of(key)
    digest = record_hash(
        n=n, parent=parent, entry=entry, files=files, git=git, by=by, time=time, signer=signer
    )
    return Deploy(
        n=n,
        parent=parent,
        hash=digest,
        entry=entry,
        files=files,
        git=git,
        by=by,
        time=time,
        signer=signer,
        signature=sign(key, digest),
    )


def verify_key_of(key: nacl.signing.SigningKey) -> str:
    """The base64 verify key of a signing key (what records name as `signer`)."""
    return base64.b64encode(bytes(key.verify_key)).decode()


def read_signing_key(path: Path) -> nacl.signing.SigningKey:
    """The signing key in `path`: a base64 32-byte Ed25519 seed, the format of
    STATE/keys/sign.key. DeployError naming the file if it is not one."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DeployError(f"{path}: cannot read the key: {e.strerror}") from None
    try:
        seed = base64.b64decode(raw.strip(), validate=True)
    except ValueError:
        raise DeployError(
            f"{path}: not a signing key (a base64 32-byte Ed25519 seed, as STATE/keys/sign.key)"
        ) from None
    if len(seed) != 32:
        raise DeployError(
            f"{path}: not a signing key: {len(seed)} bytes where a seed has 32 "
            "(the format of STATE/keys/sign.key)"
        )
    return nacl.signing.SigningKey(seed)


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


def _check_file(p: str, f: File, where: str) -> None:
    for sha in (f.sha, *f.chunks):
        if not _SHA.fullmatch(sha):
            raise DeployError(f"{where}: file {p!r} names {sha!r}, not a sha256")
    if f.mode not in MODES:
        raise DeployError(f"{where}: file {p!r} has mode {f.mode:o}, not 644 or 755")
    if f.size < 0 or f.size > MAX_BYTES:
        raise DeployError(f"{where}: file {p!r} has size {f.size}")
    if len(f.chunks) != -(-f.size // CHUNK_BYTES):
        raise DeployError(f"{where}: file {p!r}: {len(f.chunks)} blobs for {f.size} bytes")
    if len(f.chunks) == 1 and f.chunks[0] != f.sha:
        raise DeployError(f"{where}: file {p!r}: its one blob is not its content")


def verify(d: Deploy, where: str) -> None:
    """Raise DeployError (naming `where`) unless the record is well-formed, its hash
    matches and `signer` signed it. (Whether the signer is trusted is `Trust`'s call.)"""
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
    for p, f in d.files.items():
        _check_file(p, f, where)
    if sum(f.size for f in d.files.values()) > MAX_BYTES:
        raise DeployError(f"{where}: more than {MAX_BYTES} bytes of files")
    _check_files(d.entry, list(d.files), where)
    if _hash_of(d) != d.hash:
        raise DeployError(f"{where}: the record's hash does not match its content")
    try:
        if canonical_key(d.signer) != d.signer:
            raise ValueError("not in canonical base64")
    except ValueError as e:
        raise DeployError(f"{where}: signer is not a verify key ({e})") from None
    try:
        sig = base64.b64decode(d.signature, validate=True)
    except ValueError:
        raise DeployError(f"{where}: the signature is not base64") from None
    if not HostKeys.check_signature(d.signer, _signed_bytes(d.hash), sig):
        raise DeployError(
            f"{where}: bad signature: deploy {d.n} is not signed by the key it names "
            f"({fingerprint(d.signer)})"
        )


def decode_record(value: bytes, where: str) -> Deploy:
    """The verified deploy in a record's bytes; DeployError naming `where` if bad."""
    try:
        d = _decoder.decode(value)
    except msgspec.DecodeError as e:
        raise DeployError(f"{where}: not a deploy record: {e}") from None
    verify(d, where)
    return d
