"""An exporter's signed index of what it exports to one target now: which records,
each at which sequence and with which digest of its bytes. Collectors apply a
record only at the sequence the newest verified index names (no replay), and a
record whose bytes have the digest the index names needs no signature check of
its own (one signature check per change).

The index is split in buckets so that a change rewrites, signs and verifies one
small record, not one that names every export to the target:

- the head, `exported/<to>/<from>/index`, carries the exporter's sequence and the
  bucket count `of` (a power of two). With `of == 1` it holds the entries itself
  (an exporter with a few exports writes one index record, as before buckets).
- with `of > 1`, bucket `b` is `exported/<to>/<from>/index.<b>`, for every `b` in
  `0..of-1` (an empty one too: a bucket missing under its head is an attack, not
  a withdrawal), and holds the entries whose name hashes to `b`; each bucket
  carries its own sequence, covered by its signature.

The exporter grows `of` when the buckets average more than `PER_BUCKET` entries
and shrinks it when it is more than four times what the count needs; the head
only changes then. A collector keeps the highest sequence seen for the head and for
each bucket (`PairIndex`): an older head or bucket put back is refused, a bucket
of another layout is not used, a head or bucket deleted while the head (or the
records) remain keeps its last verified value until the exporter withdraws it
(its head and records gone together: withdrawn, or its lease ended).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import logging
from collections.abc import Iterable, Mapping

import msgspec

from evergraph.cluster.exports.record import EXPORTED
from evergraph.cluster.hostkeys import HostKeys
from evergraph.world.kv import KeyValue

log = logging.getLogger("evergraph.exports")

#: the last segment of an exporter's index key: `exported/<to>/<from>/index`; its
#: buckets are `index.<b>`
INDEX = "index"
#: the entries a bucket holds on average before the exporter doubles the buckets
PER_BUCKET = 16

#: an index entry: (the record's sequence, `record_digest` of its bytes)
Entry = tuple[int, str]
#: what an index record says, to compare with what was written: (of, bucket, entries);
#: the head is bucket -1
Content = tuple[int, int, dict[str, Entry]]
#: (to, src) of an exporter's records for one target
Pair = tuple[str, str]


class ExportIndex(
    msgspec.Struct,
    frozen=True,
    kw_only=True,
    forbid_unknown_fields=True,
    omit_defaults=True,
):
    """`exported/<to>/<src>/index`, the head: the sequence, the bucket count and,
    with one bucket, the entries, each `<kind>/<quoted name>` with the sequence and
    digest of its current record (`entries`, a JSON object kept as its exporter
    wrote it: the signature covers those bytes, so checking it needs no
    re-encoding)."""

    v: int = 1
    src: str
    to: str
    seq: int
    #: the number of buckets (1: the entries are here; omitted when 1, so a head of
    #: one bucket is the index of before buckets, byte for byte)
    of: int = 1
    entries: msgspec.Raw
    #: base64 Ed25519 signature by `src` over `_index_bytes(...)`
    sig: str


class ExportBucket(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`exported/<to>/<src>/index.<b>`: the entries of bucket `b` of `of`."""

    v: int = 1
    src: str
    to: str
    seq: int
    of: int
    b: int
    entries: msgspec.Raw
    #: base64 Ed25519 signature by `src` over `_bucket_bytes(...)`
    sig: str


class Index(msgspec.Struct, frozen=True):
    """A verified head."""

    src: str
    to: str
    seq: int
    #: entry -> (sequence, digest of the record's bytes); empty when `of > 1`
    entries: dict[str, Entry]
    of: int = 1


class Bucket(msgspec.Struct, frozen=True):
    """A verified bucket."""

    seq: int
    of: int
    b: int
    entries: dict[str, Entry]


@functools.cache
def _index_decoder() -> msgspec.json.Decoder[ExportIndex]:
    """Made on first use (as `_bucket_decoder`): a decoder resolves its type's
    annotations (~0.1 ms of every run's start-up each), and a run that is sent no
    export decodes no index."""
    return msgspec.json.Decoder(ExportIndex)


@functools.cache
def _bucket_decoder() -> msgspec.json.Decoder[ExportBucket]:
    return msgspec.json.Decoder(ExportBucket)


_entries_decoder = msgspec.json.Decoder(dict[str, tuple[int, str]])


def record_digest(value: bytes) -> str:
    """What an index names a record's bytes by (BLAKE2b, 128 bits, base64)."""
    return base64.b64encode(hashlib.blake2b(value, digest_size=16).digest()).decode()


def entry_name(key: str) -> str:
    """The index entry of a record key: `<kind>/<quoted name>`."""
    return key.split("/", 3)[3]


@functools.lru_cache(maxsize=1 << 16)
def bucket_of(name: str, of: int) -> int:
    """The bucket of an entry name among `of` (a power of two)."""
    if of == 1:
        return 0
    h = hashlib.blake2b(name.encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") & (of - 1)


def layout(n: int, cur: int | None = None) -> int:
    """The bucket count for `n` entries: the smallest power of two whose buckets
    average at most `PER_BUCKET` entries, or the current count while it is between
    that and four times that (no flapping)."""
    need = 1
    while need * PER_BUCKET < n:
        need *= 2
    if cur is not None and need <= cur <= 4 * need:
        return cur
    return need


def _power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def index_key(to: str, src: str) -> str:
    return f"{EXPORTED}{to}/{src}/{INDEX}"


def bucket_key(to: str, src: str, b: int) -> str:
    return f"{EXPORTED}{to}/{src}/{INDEX}.{b}"


def parse_index_key(key: str) -> Pair | None:
    """(to, src) of an index head's key, or None if it is not one."""
    parts = key[len(EXPORTED) :].split("/") if key.startswith(EXPORTED) else []
    if len(parts) != 3 or parts[2] != INDEX or not parts[0] or not parts[1]:
        return None
    return parts[0], parts[1]


def parse_bucket_key(key: str) -> tuple[str, str, int] | None:
    """(to, src, bucket) of an index bucket's key, or None if it is not one."""
    parts = key[len(EXPORTED) :].split("/") if key.startswith(EXPORTED) else []
    if len(parts) != 3 or not parts[0] or not parts[1]:
        return None
    name, dot, num = parts[2].partition(".")
    if name != INDEX or not dot or not num.isdigit() or (num != "0" and num[0] == "0"):
        return None
    return parts[0], parts[1], int(num)


def is_index_key(key: str) -> bool:
    """Whether `key` is an index head or bucket."""
    return parse_index_key(key) is not None or parse_bucket_key(key) is not None


def _index_bytes(src: str, to: str, seq: int, of: int, entries: bytes) -> bytes:
    head: list[object] = ["index", src, to, seq]
    if of != 1:
        head.append(of)
    return msgspec.json.encode(head) + b"\n" + entries


def _bucket_bytes(src: str, to: str, seq: int, of: int, b: int, entries: bytes) -> bytes:
    return msgspec.json.encode(["bucket", src, to, seq, of, b]) + b"\n" + entries


def make_index(
    keys: HostKeys, src: str, to: str, seq: int, entries: Mapping[str, Entry], of: int = 1
) -> bytes:
    """The head; with `of > 1` its `entries` must be empty (they are in buckets)."""
    assert _power_of_two(of)
    assert of == 1 or not entries
    raw = msgspec.json.encode(entries)
    sig = keys.sign(_index_bytes(src, to, seq, of, raw))
    rec = ExportIndex(
        src=src,
        to=to,
        seq=seq,
        of=of,
        entries=msgspec.Raw(raw),
        sig=base64.b64encode(sig).decode(),
    )
    return msgspec.json.encode(rec)


def make_bucket(
    keys: HostKeys, src: str, to: str, seq: int, of: int, b: int, entries: Mapping[str, Entry]
) -> bytes:
    raw = msgspec.json.encode(entries)
    sig = keys.sign(_bucket_bytes(src, to, seq, of, b, raw))
    rec = ExportBucket(
        src=src,
        to=to,
        seq=seq,
        of=of,
        b=b,
        entries=msgspec.Raw(raw),
        sig=base64.b64encode(sig).decode(),
    )
    return msgspec.json.encode(rec)


def index_contents(to: str, src: str, entries: Mapping[str, Entry], of: int) -> dict[str, Content]:
    """The index records (key -> content) an exporter writes for `entries` in `of`
    buckets: the head, and with `of > 1` every bucket."""
    if of == 1:
        return {index_key(to, src): (1, -1, dict(entries))}
    groups: list[dict[str, Entry]] = [{} for _ in range(of)]
    for name, entry in entries.items():
        groups[bucket_of(name, of)][name] = entry
    out: dict[str, Content] = {index_key(to, src): (of, -1, {})}
    for b, group in enumerate(groups):
        out[bucket_key(to, src, b)] = (of, b, group)
    return out


def make_content(keys: HostKeys, src: str, to: str, seq: int, content: Content) -> bytes:
    """The signed record of one index content (see `index_contents`)."""
    of, b, entries = content
    if b < 0:
        return make_index(keys, src, to, seq, entries, of)
    return make_bucket(keys, src, to, seq, of, b, entries)


def _decode_entries(key: str, raw: bytes) -> dict[str, Entry]:
    try:
        return _entries_decoder.decode(raw)
    except msgspec.DecodeError as e:
        raise ValueError(f"{key}: entries are not [sequence, digest] by record: {e}") from None


def _signature(key: str, sig: str) -> bytes:
    try:
        return base64.b64decode(sig, validate=True)
    except ValueError:
        raise ValueError(f"{key}: signature is not base64") from None


def open_index(item: KeyValue, verify_key: str) -> Index:
    """Check an index head against its exporter's key; ValueError otherwise."""
    where = parse_index_key(item.key)
    if where is None:
        raise ValueError(f"{item.key}: not an export index key")
    try:
        rec = _index_decoder().decode(item.value)
    except msgspec.DecodeError as e:
        raise ValueError(f"{item.key}: not an export index: {e}") from None
    if (rec.to, rec.src) != where:
        raise ValueError(f"{item.key}: index does not match its key (moved or forged)")
    if not _power_of_two(rec.of):
        raise ValueError(f"{item.key}: bucket count {rec.of} is not a power of two")
    sig = _signature(item.key, rec.sig)
    raw = bytes(rec.entries)
    if not HostKeys.check_signature(
        verify_key, _index_bytes(rec.src, rec.to, rec.seq, rec.of, raw), sig
    ):
        raise ValueError(f"{item.key}: bad signature: not signed by {rec.src!r}")
    entries = _decode_entries(item.key, raw)
    if rec.of > 1 and entries:
        raise ValueError(f"{item.key}: a head of {rec.of} buckets names entries")
    return Index(rec.src, rec.to, rec.seq, entries, rec.of)


def open_bucket(item: KeyValue, verify_key: str) -> Bucket:
    """Check an index bucket against its exporter's key; ValueError otherwise."""
    where = parse_bucket_key(item.key)
    if where is None:
        raise ValueError(f"{item.key}: not an export index bucket key")
    try:
        rec = _bucket_decoder().decode(item.value)
    except msgspec.DecodeError as e:
        raise ValueError(f"{item.key}: not an export index bucket: {e}") from None
    if (rec.to, rec.src, rec.b) != where:
        raise ValueError(f"{item.key}: bucket does not match its key (moved or forged)")
    if not _power_of_two(rec.of) or rec.of == 1 or not 0 <= rec.b < rec.of:
        raise ValueError(f"{item.key}: bucket {rec.b} of {rec.of} is not a bucket")
    sig = _signature(item.key, rec.sig)
    raw = bytes(rec.entries)
    signed = _bucket_bytes(rec.src, rec.to, rec.seq, rec.of, rec.b, raw)
    if not HostKeys.check_signature(verify_key, signed, sig):
        raise ValueError(f"{item.key}: bad signature: not signed by {rec.src!r}")
    return Bucket(rec.seq, rec.of, rec.b, _decode_entries(item.key, raw))


def verified_entries(
    items: Iterable[KeyValue], verify_key: Mapping[str, str | None]
) -> dict[Pair, dict[str, Entry] | None]:
    """Each pair's entries as its verified head and buckets name them (None: a head
    that fails verification, or of an exporter whose key is not known); for a
    listing (`evergraph exports`), not for a collector (no replay marks)."""
    heads: dict[Pair, Index | None] = {}
    buckets: dict[Pair, dict[int, Bucket]] = {}
    for item in items:
        pair = parse_index_key(item.key)
        bwhere = parse_bucket_key(item.key) if pair is None else None
        src = pair[1] if pair is not None else bwhere[1] if bwhere is not None else None
        if src is None:
            continue
        key = verify_key.get(src)
        try:
            if pair is not None:
                heads[pair] = open_index(item, key) if key else None
            elif bwhere is not None and key:
                bk = open_bucket(item, key)
                buckets.setdefault((bwhere[0], bwhere[1]), {})[bk.b] = bk
        except ValueError:
            if pair is not None:
                heads[pair] = None
    out: dict[Pair, dict[str, Entry] | None] = {}
    for pair, head in heads.items():
        if head is None or head.of == 1:
            out[pair] = head.entries if head is not None else None
            continue
        merged: dict[str, Entry] = {}
        for b, bk in buckets.get(pair, {}).items():
            if bk.of == head.of:
                merged.update((n, e) for n, e in bk.entries.items() if bucket_of(n, bk.of) == b)
        out[pair] = merged
    return out
