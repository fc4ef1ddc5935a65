"""Signed farm records: every farm record a host acts on names its signer and is
checked before any effect (SPEC 4.6).

A record in the World is an envelope around the record's JSON:

    {"signer": "api1", "key": <verify key>, "term": 7, "prev": 41,
     "body": "<the record's JSON>", "sig": <Ed25519 signature>}

The signature covers the World key the record is stored under, the signer, its
key, the term, `prev` and the body: a record cannot be moved to another key, nor
its term or body changed. `term` is the `farm` election's term (the leader key's
mod revision) for the elected matcher's writes, 0 for every other writer. `prev`
is the mod revision of the record the writer replaced (0: created), so a worker
that saw a newer version refuses an older one put back (replay).

Who is trusted (`FarmTrust`): a host's own key, and the farm servers pinned
explicitly with `--farm-server NAME=KEY`. A worker's own registration is signed by
the worker's host, checked against that host's pinned key (`host_key`).
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Callable, Mapping

import msgspec

from evergraph.cluster.hostkeys import HostKeys
from evergraph.world.kv import KeyValue

log = logging.getLogger("evergraph.farm")

_DOMAIN = "evergraph-farm-record-v1"
#: refusals remembered (key, mod revision) so each is logged once; then forgotten
_MAX_LOGGED = 10_000


class Envelope(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    signer: str
    key: str
    term: int = 0
    prev: int = 0
    body: str
    sig: str


class Untrusted(ValueError):
    """A record that is not acted on; the message says why (one line)."""


class UnknownSigner(Untrusted):
    """Signed by a host whose key this host has not seen yet: not acted on now, but
    checked again later (its `hostkeys/` record may come in a moment)."""


_dec = msgspec.json.Decoder(Envelope)


def _signed_bytes(where: str, signer: str, key: str, term: int, prev: int, body: str) -> bytes:
    head = msgspec.json.encode([_DOMAIN, where, signer, key, term, prev])
    return head + b"\n" + body.encode()


def seal(
    keys: HostKeys, signer: str, where: str, body: bytes, term: int = 0, prev: int = 0
) -> bytes:
    """The envelope of `body` (a record's JSON) for World key `where`."""
    text = body.decode()
    sig = keys.sign(_signed_bytes(where, signer, keys.verify, term, prev, text))
    env = Envelope(
        signer=signer,
        key=keys.verify,
        term=term,
        prev=prev,
        body=text,
        sig=base64.b64encode(sig).decode(),
    )
    return msgspec.json.encode(env)


def open_envelope(where: str, value: bytes) -> Envelope:
    """The envelope stored at `where` if its signature holds (by the key it names:
    whether that key is trusted is the caller's question); Untrusted otherwise."""
    try:
        env = _dec.decode(value)
    except msgspec.DecodeError:
        raise Untrusted("not a signed farm record") from None
    try:
        sig = base64.b64decode(env.sig, validate=True)
    except ValueError:
        raise Untrusted("its signature is not base64") from None
    signed = _signed_bytes(where, env.signer, env.key, env.term, env.prev, env.body)
    if not HostKeys.check_signature(env.key, signed, sig):
        raise Untrusted("bad signature (not made by the key it names, or moved from another key)")
    return env


class FarmTrust:
    """This host's farm signer and the keys it trusts.

    `servers`: farm server name -> verify key (base64), the explicit pins of
    `--farm-server NAME=KEY`; this host is always one. `host_key(host)`: the pinned
    verify key of any host (for a worker's own registration), or None."""

    def __init__(
        self,
        keys: HostKeys,
        me: str,
        servers: Mapping[str, str] | None = None,
        host_key: Callable[[str], str | None] | None = None,
    ) -> None:
        self.keys = keys
        self.me = me
        self.servers: dict[str, str] = {**(servers or {}), me: keys.verify}
        self.host_key = host_key
        self._logged: set[tuple[str, int]] = set()

    def seal(self, where: str, body: bytes, term: int = 0, prev: int = 0) -> bytes:
        return seal(self.keys, self.me, where, body, term, prev)

    def is_server(self, env: Envelope) -> bool:
        """Signed by a farm server this host pins (or by itself)."""
        return self.servers.get(env.signer) == env.key

    def is_host(self, env: Envelope, host: str) -> bool:
        """Signed by `host` with its pinned key; UnknownSigner if no key is known
        for `host` yet."""
        if env.signer != host or not host:
            return False
        if self.servers.get(host) == env.key:
            return True
        key = self.host_key(host) if self.host_key is not None else None
        if key is None:
            raise UnknownSigner(f"signed by {host!r}, whose key this host has not seen yet")
        return key == env.key

    def trusted_keys(self) -> set[str]:
        """The keys whose farm tokens this host accepts."""
        return set(self.servers.values())

    def refuse(self, item: KeyValue, why: str) -> None:
        """Log a refused record once per revision: one line naming the key and why."""
        mark = (item.key, item.mod_revision)
        if mark in self._logged:
            return
        if len(self._logged) >= _MAX_LOGGED:
            self._logged.clear()
        self._logged.add(mark)
        log.warning("farm: %s (revision %d) refused: %s", item.key, item.mod_revision, why)
