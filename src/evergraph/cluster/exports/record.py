"""An export record, `exported/<to>/<from>/<kind>/<name>`: the resource's
parameters as JSON, sealed to the target's public key when directed to one host
(`to` is a hostname or `*`, every host: signed, not encrypted), and signed by the
exporter over its routing fields, its sequence and its payload, so nobody can forge
or alter one. The sequence comes from the exporter's `SeqCounter`, which only grows
(across restarts too), so that collectors can refuse an older record put back.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

import msgspec

from evergraph._util.atomic import atomic_write
from evergraph.cluster.hostkeys import HostKeys, KeyError_
from evergraph.world.kv import KeyValue

EXPORTED = "exported/"
EVERYONE = "*"
#: the file in the state dir holding the export sequence reserved so far
SEQ_FILE = "export-seq"


class ExportRecord(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    v: int = 2
    src: str
    to: str
    kind: str
    name: str
    #: the exporter's sequence number when it wrote this record (0: a v1 record,
    #: which no index names: never applied)
    seq: int = 0
    sealed: bool
    #: base64: the JSON parameters, sealed to `to` when `sealed`
    payload: str
    #: base64 Ed25519 signature by `src` over `signed_bytes(...)`
    sig: str


class Exported(msgspec.Struct, frozen=True):
    """A checked, readable export. (A Struct: a dataclass's generated methods are
    compiled at import.)"""

    src: str
    to: str
    kind: str
    name: str
    params: dict[str, Any]


@functools.cache
def _decoder() -> msgspec.json.Decoder[ExportRecord]:
    """Made on first use: a decoder resolves its type's annotations (~0.3 ms of
    every run's start-up), and a run that is sent no export decodes none."""
    return msgspec.json.Decoder(ExportRecord)


def export_key(to: str, src: str, kind: str, name: str) -> str:
    return f"{EXPORTED}{to}/{src}/{kind}/{quote(name, safe='')}"


def _signed_bytes(src: str, to: str, kind: str, name: str, seq: int, payload: bytes) -> bytes:
    head = msgspec.json.encode([src, to, kind, name, seq])
    return head + b"\n" + payload


def make_record(
    keys: HostKeys,
    src: str,
    to: str,
    kind: str,
    name: str,
    params: dict[str, Any],
    target_public: str | None,
    seq: int,
) -> bytes:
    """The record's bytes; `target_public` is required for a directed export. `seq`:
    the exporter's sequence number (see `SeqCounter`)."""
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
        seq=seq,
        sealed=to != EVERYONE,
        payload=base64.b64encode(body).decode(),
        sig=base64.b64encode(keys.sign(_signed_bytes(src, to, kind, name, seq, body))).decode(),
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
    return open_record_seq(keys, me, item, verify_key)[0]


def open_record_seq(
    keys: HostKeys | None,
    me: str | None,
    item: KeyValue,
    verify_key: str | None,
    vouched: bool = False,
) -> tuple[Exported, int]:
    """`open_record` and the record's sequence number. Without `keys` (a listing
    that cannot unseal) a sealed record is checked but its parameters are empty;
    without `me` a record for any target is accepted. `vouched`: the record's
    bytes have the digest a verified index of its exporter names (its signature
    is not checked again)."""
    where = parse_key(item.key)
    if where is None:
        raise ValueError(f"{item.key}: not an export key")
    try:
        rec = _decoder().decode(item.value)
    except msgspec.DecodeError as e:
        raise ValueError(f"{item.key}: not an export record: {e}") from None
    if (rec.to, rec.src, rec.kind, rec.name) != where:
        raise ValueError(f"{item.key}: record does not match its key (moved or forged)")
    if me is not None and rec.to not in (me, EVERYONE):
        raise ValueError(f"{item.key}: meant for {rec.to!r}, not this host")
    if rec.sealed != (rec.to != EVERYONE):
        raise ValueError(f"{item.key}: a directed export must be sealed")
    if not verify_key and not vouched:
        raise ValueError(f"{item.key}: no key known for exporter {rec.src!r}")
    try:
        body = base64.b64decode(rec.payload, validate=True)
        sig = base64.b64decode(rec.sig, validate=True)
    except ValueError:
        raise ValueError(f"{item.key}: payload or signature is not base64") from None
    if not vouched:
        assert verify_key is not None
        signed = _signed_bytes(rec.src, rec.to, rec.kind, rec.name, rec.seq, body)
        if not HostKeys.check_signature(verify_key, signed, sig):
            raise ValueError(f"{item.key}: bad signature: not signed by {rec.src!r}")
    if rec.sealed and keys is None:
        return Exported(rec.src, rec.to, rec.kind, rec.name, {}), rec.seq
    if rec.sealed:
        assert keys is not None
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
    return Exported(rec.src, rec.to, rec.kind, rec.name, params), rec.seq


class SeqCounter:
    """This host's export sequence: grows with every record and index written, across
    restarts too. It starts at the larger of the time in microseconds and what the
    state dir's `export-seq` reserved; a block is reserved (one small write) each
    time the counter passes the reservation, so a clock stepped back does not make
    an exporter's new records look older than its old ones."""

    BLOCK = 1 << 16

    def __init__(self, state_dir: Path | None = None) -> None:
        self.path = state_dir / SEQ_FILE if state_dir is not None else None
        start = time.time_ns() // 1000
        if self.path is not None:
            with contextlib.suppress(OSError, ValueError):
                start = max(start, int(self.path.read_text().strip() or 0))
        self._next = start
        self._reserved = start

    def next(self) -> int:
        n = self._next
        self._next += 1
        if self.path is not None and n >= self._reserved:
            self._reserved = n + self.BLOCK
            atomic_write(self.path, f"{self._reserved}\n".encode(), mode=0o600)
        return n
