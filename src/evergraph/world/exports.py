"""Exported resources: records `exported/<to>/<from>/<kind>/<name>` in the World.

A record holds the resource's parameters as JSON. Directed exports (to one
host) are sealed to the target's public key, so no other host can read them;
every record is signed by the exporter over its routing fields and payload,
so nobody can forge or alter one. A record that fails any check is rejected
with a warning naming its key, never applied.

`to` is a hostname or `*` (every host; signed, not encrypted).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, unquote

import msgspec

from evergraph.world.hostkeys import HostKeys, KeyError_
from evergraph.world.kv import KeyValue

EXPORTED = "exported/"
EVERYONE = "*"


class ExportRecord(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    v: int = 1
    src: str
    to: str
    kind: str
    name: str
    sealed: bool
    #: base64: the JSON parameters, sealed to `to` when `sealed`
    payload: str
    #: base64 Ed25519 signature by `src` over `signed_bytes(...)`
    sig: str


@dataclass(frozen=True, slots=True)
class Exported:
    """A checked, readable export."""

    src: str
    to: str
    kind: str
    name: str
    params: dict[str, Any]


_decoder = msgspec.json.Decoder(ExportRecord)


def export_key(to: str, src: str, kind: str, name: str) -> str:
    return f"{EXPORTED}{to}/{src}/{kind}/{quote(name, safe='')}"


def _signed_bytes(src: str, to: str, kind: str, name: str, payload: bytes) -> bytes:
    head = msgspec.json.encode([src, to, kind, name])
    return head + b"\n" + payload


def make_record(
    keys: HostKeys,
    src: str,
    to: str,
    kind: str,
    name: str,
    params: dict[str, Any],
    target_public: str | None,
) -> bytes:
    """The record's bytes; `target_public` is required for a directed export."""
    body = msgspec.json.encode(params)
    if to != EVERYONE:
        if not target_public:
            raise KeyError_(f"no public key known for host {to!r}")
        body = keys.seal_to(target_public, body)
    rec = ExportRecord(
        src=src,
        to=to,
        kind=kind,
        name=name,
        sealed=to != EVERYONE,
        payload=base64.b64encode(body).decode(),
        sig=base64.b64encode(keys.sign(_signed_bytes(src, to, kind, name, body))).decode(),
    )
    return msgspec.json.encode(rec)


def parse_key(key: str) -> tuple[str, str, str, str] | None:
    """(to, src, kind, name) of a record key, or None if it is not one."""
    parts = key[len(EXPORTED) :].split("/") if key.startswith(EXPORTED) else []
    if len(parts) != 4 or not all(parts):
        return None
    return parts[0], parts[1], parts[2], unquote(parts[3])


def open_record(keys: HostKeys, me: str, item: KeyValue, verify_key: str | None) -> Exported:
    """Check and read an export meant for `me`; ValueError with the reason otherwise.

    `verify_key` is the exporter's signature key (from its host key record).
    """
    where = parse_key(item.key)
    if where is None:
        raise ValueError(f"{item.key}: not an export key")
    try:
        rec = _decoder.decode(item.value)
    except msgspec.DecodeError as e:
        raise ValueError(f"{item.key}: not an export record: {e}") from None
    if (rec.to, rec.src, rec.kind, rec.name) != where:
        raise ValueError(f"{item.key}: record does not match its key (moved or forged)")
    if rec.to not in (me, EVERYONE):
        raise ValueError(f"{item.key}: meant for {rec.to!r}, not this host")
    if rec.sealed != (rec.to != EVERYONE):
        raise ValueError(f"{item.key}: a directed export must be sealed")
    if not verify_key:
        raise ValueError(f"{item.key}: no key known for exporter {rec.src!r}")
    try:
        body = base64.b64decode(rec.payload, validate=True)
        sig = base64.b64decode(rec.sig, validate=True)
    except ValueError:
        raise ValueError(f"{item.key}: payload or signature is not base64") from None
    signed = _signed_bytes(rec.src, rec.to, rec.kind, rec.name, body)
    if not HostKeys.check_signature(verify_key, signed, sig):
        raise ValueError(f"{item.key}: bad signature: not signed by {rec.src!r}")
    if rec.sealed:
        try:
            body = keys.unseal(body)
        except KeyError_ as e:
            raise ValueError(f"{item.key}: {e}") from None
    try:
        params = msgspec.json.decode(body)
    except msgspec.DecodeError as e:
        raise ValueError(f"{item.key}: parameters are not JSON: {e}") from None
    if not isinstance(params, dict):
        raise ValueError(f"{item.key}: parameters are not an object")
    return Exported(rec.src, rec.to, rec.kind, rec.name, params)
