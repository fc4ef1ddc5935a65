"""API tokens of the farm's users, stored in the World only as hashes.

`farm/tokens/<sha256 of the token>` holds `{name, groups, admin, fragment,
created}` (`fragment`: the right to send a request with a graph fragment, which
a worker applies as root; admins have it anyway): the
token itself is shown once, when created, and never stored; a presented token is
hashed and looked up in one read. Tokens are 256 random bits, so a plain sha256
is enough (no password-style stretching needed).
"""

from __future__ import annotations

import hashlib
import re
import secrets
import time

import msgspec

from evergraph.world.kv import KV

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


async def create(kv: KV, name: str, groups: list[str], admin: bool, fragment: bool = False) -> str:
    """A new token for `name` (returned once; only its hash is stored). `fragment`:
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
    await kv.put(_key(token), msgspec.json.encode(user))
    return token


async def lookup(kv: KV, token: str) -> User | None:
    """The user a presented token belongs to, or None (unknown or malformed)."""
    if not token.startswith("egt_") or len(token) > 200:
        return None
    item = await kv.get(_key(token))
    if item is None:
        return None
    try:
        return _decoder.decode(item.value)
    except msgspec.DecodeError:
        return None


async def users(kv: KV) -> list[tuple[str, User]]:
    """(token hash prefix, user) of every token, for `farm token list`."""
    items, _ = await kv.range(PREFIX)
    out = []
    for item in items:
        try:
            out.append((item.key[len(PREFIX) :][:12], _decoder.decode(item.value)))
        except msgspec.DecodeError:
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
