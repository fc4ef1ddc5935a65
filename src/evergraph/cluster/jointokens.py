"""Join tokens: what lets a new host join a self-forming etcd World (SPEC 4.8).

`evergraph cluster token` makes one; the joining agent reads it from
`--join-token-file F` or `EVERGRAPH_JOIN_TOKEN` and presents it to a member's
join service (cluster/joinwire.py), which checks it here before certifying the
joiner. A token is one line:

    egj1.<CA fingerprint: sha256 hex, 64>.<id: 12 hex>.<secret: 43 base64url>

The fingerprint lets the joiner check that the seed it reached belongs to the
cluster that issued the token (before sending the secret). The World holds
only a record per token under `cluster/tokens/<id>`: sha256 of the secret,
created, expires, revoked, signed by the CA key. A record without a valid
signature counts as unknown, so whoever can write the World but does not hold
the CA key cannot mint tokens. The secret itself never reaches the World or a
log, and no error message repeats it.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import hmac
import logging
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from evergraph._util.clock import SYSTEM, Clock
from evergraph.cluster.ca import ClusterCA
from evergraph.world.kv import KV, Compare, Delete

log = logging.getLogger("evergraph.cluster.tokens")

TOKENS = "cluster/tokens/"
#: the first part of a token: its format's version
TOKEN_PREFIX = "egj1"
#: where an agent finds a token when `--join-token-file` is not given
TOKEN_ENV = "EVERGRAPH_JOIN_TOKEN"
#: what a record's signature covers starts with this, so that no other record the
#: CA signs (ideal size, invites) can be passed off as a token record
_SIGNED_AS = b"evergraph join token record v1\n"

_FINGERPRINT = re.compile(r"[0-9a-f]{64}")
_ID = re.compile(r"[0-9a-f]{12}")
_SECRET = re.compile(r"[A-Za-z0-9_-]{43}")
_FORMAT = "egj1.<CA fingerprint>.<id>.<secret>"


class TokenError(Exception):
    """A join token is missing, malformed, wrong, expired, revoked, unknown or for
    another cluster; the message is one line saying which (never the secret)."""


@dataclass(frozen=True)
class JoinToken:
    """A parsed token. Its repr leaves the secret out."""

    ca_fingerprint: str
    id: str
    secret: str = field(repr=False)

    def text(self) -> str:
        return f"{TOKEN_PREFIX}.{self.ca_fingerprint}.{self.id}.{self.secret}"


class TokenRecord(msgspec.Struct, frozen=True):
    """`cluster/tokens/<id>`: what the World knows of a token."""

    id: str
    #: sha256 of the secret, hex
    hash: str
    #: unix seconds
    created: float
    expires: float
    revoked: bool = False
    #: the CA's ECDSA signature of every other field (base64)
    sig: str = ""

    def signed_bytes(self) -> bytes:
        # floats, whatever the record was built with: a time written as 5 is read
        # back as 5.0, and must sign the same
        times = [float(self.created), float(self.expires)]
        fields = [self.id, self.hash, *times, self.revoked]
        return _SIGNED_AS + msgspec.json.encode(fields)


def _utc(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _short(fp: str) -> str:
    return f"{fp[:16]}…"


def _hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def need_token(seed: str) -> TokenError:
    """The error of an agent that must join a cluster but was given no token."""
    return TokenError(
        f"joining cluster at {seed} needs a join token: --join-token-file F or {TOKEN_ENV}"
    )


def another_cluster(token_fp: str, cluster_fp: str, whose: str = "this cluster's") -> TokenError:
    return TokenError(
        f"this token is for another cluster (CA {_short(token_fp)}), "
        f"{whose} CA is {_short(cluster_fp)}"
    )


def parse_token(text: str) -> JoinToken:
    """The token in `text` (surrounding blanks ignored); TokenError("malformed join
    token: ...") saying which part is wrong, without repeating any of it."""
    parts = text.strip().split(".")
    if len(parts) != 4 or parts[0] != TOKEN_PREFIX:
        raise TokenError(f"malformed join token: expected {_FORMAT}")
    _, fp, token_id, secret = parts
    if not _FINGERPRINT.fullmatch(fp):
        raise TokenError("malformed join token: the CA fingerprint is not 64 lower-case hex digits")
    if not _ID.fullmatch(token_id):
        raise TokenError("malformed join token: the id is not 12 lower-case hex digits")
    if not _SECRET.fullmatch(secret):
        raise TokenError("malformed join token: the secret is not 43 base64url characters")
    return JoinToken(fp, token_id, secret)


def _check_id(token_id: str) -> str:
    if not _ID.fullmatch(token_id):
        raise TokenError("malformed join token: the id is not 12 lower-case hex digits")
    return token_id


def _sign(ca: ClusterCA, record: TokenRecord) -> TokenRecord:
    sig = base64.b64encode(ca.sign(record.signed_bytes())).decode()
    return msgspec.structs.replace(record, sig=sig)


def _verified(ca: ClusterCA, key: str, value: bytes) -> TokenRecord | None:
    """The record in `value` if the CA signed it and it is stored under its own id."""
    try:
        record = msgspec.json.decode(value, type=TokenRecord)
        sig = base64.b64decode(record.sig, validate=True)
    except (msgspec.DecodeError, ValueError):
        log.warning("%s: not a join token record: ignored", key)
        return None
    if key != TOKENS + record.id or not ca.check_signature(record.signed_bytes(), sig):
        log.warning("%s: not signed by the cluster CA: ignored", key)
        return None
    return record


async def _load(kv: KV, ca: ClusterCA, token_id: str) -> tuple[TokenRecord, int] | None:
    key = TOKENS + _check_id(token_id)
    kv_ = await kv.get(key)
    if kv_ is None:
        return None
    record = _verified(ca, key, kv_.value)
    return None if record is None else (record, kv_.mod_revision)


async def create_token(kv: KV, ca: ClusterCA, ttl: float, clock: Clock = SYSTEM) -> JoinToken:
    """A new token valid for `ttl` seconds; its signed record is written to the
    World (this node must hold the CA key)."""
    if not ttl > 0:
        raise TokenError(f"a join token's lifetime must be positive, not {ttl}")
    secret = base64.urlsafe_b64encode(secrets.token_bytes(32)).rstrip(b"=").decode()
    now = clock.time()
    await prune_tokens(kv, ca, now)
    while True:
        token_id = secrets.token_hex(6)
        record = _sign(ca, TokenRecord(token_id, _hash(secret), now, now + ttl))
        if await kv.cas(TOKENS + token_id, msgspec.json.encode(record), expect=0):
            return JoinToken(ca.fingerprint, token_id, secret)


#: how long a dead token's record stays listed (`cluster token` shows it expired)
KEEP_DEAD = 7 * 86400.0


async def prune_tokens(kv: KV, ca: ClusterCA, now: float) -> int:
    """Delete the records of tokens that expired more than KEEP_DEAD ago (each
    token made prunes: the records never pile up); how many went. Only records
    the CA signed: each is deleted only as it was read (a compare on its revision)."""
    kvs, _ = await kv.range(TOKENS)
    gone = 0
    for item in kvs:
        record = _verified(ca, item.key, item.value)
        if record is not None and record.expires + KEEP_DEAD < now:
            gone += (
                await kv.txn([Compare(item.key, item.mod_revision)], [Delete(item.key)]) is not None
            )
    return gone


def _id_of(ca: ClusterCA, which: str) -> str:
    if which.strip().startswith(TOKEN_PREFIX + "."):
        token = parse_token(which)
        if token.ca_fingerprint != ca.fingerprint:
            raise another_cluster(token.ca_fingerprint, ca.fingerprint)
        return token.id
    return _check_id(which.strip())


async def revoke_token(kv: KV, ca: ClusterCA, which: str) -> str:
    """Revoke the token `which` (its id or the whole token); returns its id.
    Revoking a revoked token is no error; an unknown one is."""
    token_id = _id_of(ca, which)
    while True:
        found = await _load(kv, ca, token_id)
        if found is None:
            raise TokenError(f"unknown join token id {token_id}")
        record, rev = found
        if record.revoked:
            return token_id
        revoked = _sign(ca, msgspec.structs.replace(record, revoked=True))
        if await kv.cas(TOKENS + token_id, msgspec.json.encode(revoked), expect=rev):
            return token_id


async def list_tokens(kv: KV, ca: ClusterCA) -> list[TokenRecord]:
    """Every token record the CA signed, oldest first."""
    kvs, _ = await kv.range(TOKENS)
    records = [r for r in (_verified(ca, k.key, k.value) for k in kvs) if r is not None]
    return sorted(records, key=lambda r: (r.created, r.id))


async def check_token(kv: KV, ca: ClusterCA, token: JoinToken, clock: Clock = SYSTEM) -> None:
    """Return if `token` lets its holder join now; TokenError saying why not.

    The secret is compared before revocation and expiry are told, so that only
    who holds the secret learns what became of the token."""
    if token.ca_fingerprint != ca.fingerprint:
        raise another_cluster(token.ca_fingerprint, ca.fingerprint)
    found = await _load(kv, ca, token.id)
    if found is None:
        raise TokenError(f"unknown join token id {token.id}")
    record, _ = found
    if not hmac.compare_digest(record.hash.encode(), _hash(token.secret).encode()):
        raise TokenError(f"wrong secret for join token {token.id}")
    if record.revoked:
        raise TokenError(f"join token {token.id} was revoked")
    if clock.time() >= record.expires:
        raise TokenError(f"join token {token.id} expired at {_utc(record.expires)}")


def read_token_source(file: Path | None, env: Mapping[str, str]) -> JoinToken | None:
    """The token in `file` (its first non-blank line) or else in the environment's
    EVERGRAPH_JOIN_TOKEN; None if neither is given."""
    if file is not None:
        try:
            text = Path(file).read_text(errors="replace")
        except OSError as e:
            raise TokenError(f"join token file {file}: {e.strerror}") from None
        line = next((ln for ln in text.splitlines() if ln.strip()), None)
        if line is None:
            raise TokenError(f"join token file {file}: no token in it")
        try:
            return parse_token(line)
        except TokenError as e:
            raise TokenError(f"join token file {file}: {e}") from None
    value = env.get(TOKEN_ENV, "")
    if not value.strip():
        return None
    try:
        return parse_token(value)
    except TokenError as e:
        raise TokenError(f"{TOKEN_ENV}: {e}") from None
