"""API tokens of the farm's users, stored in the World only as hashes.

`farm/tokens/<sha256 of the token>` holds `{name, groups, admin, fragment,
created}` (`fragment`: the right to send a request with a graph fragment, which
a worker applies as root; admins have it anyway): the
token itself is shown once, when created, and never stored; a presented token is
hashed and looked up in one read. Tokens are 256 random bits, so a plain sha256
is enough (no password-style stretching needed).

A token record is a signed envelope (`farm.signed`), made by the host that ran
`farm token create` (its state dir's key). An API server accepts a token only if
its record is signed by its own key or by the key of a farm server it pins
(`--farm-server NAME=KEY`): whoever can write the World, but holds none of these
keys, cannot make an admin (a refused record is logged once, answered 401).
"""

from __future__ import annotations

import hashlib
import re
import secrets
import time

import msgspec

from evergraph.cluster.hostkeys import HostKeys
from evergraph.farm.signed import FarmTrust, Untrusted, open_envelope, seal
from evergraph.world.kv import KV, KeyValue

PREFIX = "farm/tokens/"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")
_GROUP = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class User(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    groups: list[str] = []
    admin: bool = False
    #: may send requests with a graph fragment (`token create --fragment`)
    fragment: bool = False
    created: float = 0.0


_decoder = msgspec.json.Decoder(User)


def _key(token: str) -> str:
    return PREFIX + hashlib.sha256(token.encode()).hexdigest()


def check_names(name: str, groups: list[str]) -> None:
    """ValueError naming the bad user or group name."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"{name!r} is not a user name (letters, digits, '._@-', at most 64)")
    for g in groups:
        if not _GROUP.fullmatch(g):
            raise ValueError(f"{g!r} is not a group name (letters, digits, '._-', at most 64)")


async def create(
    kv: KV,
    name: str,
    groups: list[str],
    admin: bool,
    keys: HostKeys,
    signer: str = "",
    fragment: bool = False,
) -> str:
    """A new token for `name` (returned once; only its hash is stored), its record
    signed with `keys` (`signer`: the signing host's name, if known). `fragment`:
    the token may send graph fragments."""
    check_names(name, groups)
    token = "egt_" + secrets.token_urlsafe(32)
    user = User(
        name=name,
        groups=sorted(set(groups)),
        admin=admin,
        fragment=fragment,
        created=time.time(),
    )
    key = _key(token)
    await kv.put(key, seal(keys, signer, key, msgspec.json.encode(user)))
    return token


def open_token(item: KeyValue, trust: FarmTrust | None) -> User:
    """The user of a token record, checked against `trust` (None: only decoded, for
    listing); Untrusted with the reason otherwise."""
    env = open_envelope(item.key, item.value)
    if trust is not None and env.key not in trust.trusted_keys():
        raise Untrusted(
            f"signed by {env.signer or 'a key'} this API server does not trust "
            "(its own, or a --farm-server NAME=KEY)"
        )
    try:
        return _decoder.decode(env.body)
    except msgspec.DecodeError as e:
        raise Untrusted(f"not a token record: {e}") from None


async def lookup(kv: KV, token: str, trust: FarmTrust | None) -> User | None:
    """The user a presented token belongs to, or None (unknown, malformed, or its
    record not signed by a key `trust` trusts: logged once; None trusts nothing)."""
    if not token.startswith("egt_") or len(token) > 200:
        return None
    item = await kv.get(_key(token))
    if item is None or trust is None:
        return None
    try:
        return open_token(item, trust)
    except Untrusted as e:
        trust.refuse(item, str(e))
        return None


async def users(kv: KV) -> list[tuple[str, User]]:
    """(token hash prefix, user) of every token, for `farm token list` (records
    that are not signed tokens are left out)."""
    items, _ = await kv.range(PREFIX)
    out = []
    for item in items:
        try:
            out.append((item.key[len(PREFIX) :][:12], open_token(item, None)))
        except Untrusted:
            continue
    return out


async def revoke(kv: KV, hash_prefix: str) -> int:
    """Delete the tokens whose hash starts with `hash_prefix` (at least 8 characters)."""
    if len(hash_prefix) < 8 or not re.fullmatch(r"[0-9a-f]+", hash_prefix):
        raise ValueError("give at least 8 hex characters of the token's hash (farm token list)")
    items, _ = await kv.range(PREFIX + hash_prefix)
    n = 0
    for item in items:
        n += await kv.delete(item.key)
    return n
