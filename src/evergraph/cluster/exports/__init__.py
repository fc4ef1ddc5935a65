"""Exported resources: records `exported/<to>/<from>/<kind>/<name>` in the World.

A record holds the resource's parameters as JSON. Directed exports (to one
host) are sealed to the target's public key, so no other host can read them;
every record is signed by the exporter over its routing fields and payload,
so nobody can forge or alter one. A record that fails any check is rejected
with a warning naming its key, never applied.

`to` is a hostname or `*` (every host; signed, not encrypted).

Identities come from `hostkeys/<host>` only through a `HostKeyBook`, which
checks them against this host's pins (cluster/pins.py): a swapped key in the
World is refused, never used to seal or to verify.

`Publisher` keeps this host's records level-triggered: it holds the set the
graph wants and reconciles the World to it until the World acknowledges (a
change made during an outage is published when the World returns), every
record under the agent's lease. `Collector` follows `exported/<host>/` and
`exported/*/` with `follow()`: one change costs one record verified, and no
record is missed between the first read and the watch.

No replay: every record carries its exporter's sequence number (`seq`, from a
counter that only grows, kept in the state dir), covered by its signature, and
each exporter keeps a signed index per target, `exported/<to>/<from>/index` (split
in buckets `index.<b>` past `PER_BUCKET` entries a bucket, so that a change
rewrites and verifies one small record), naming the sequence and digest of every
record it exports there now (written in the same transaction as the records,
under the same lease; a record whose bytes have the digest a verified index names
needs no signature check of its own).
A collector applies a record only when its sequence is the one the newest index
it verified names: an older record put back, a withdrawn one put back without a
lease, or an older index put back is refused (logged once); a record an attacker
deletes while the index still lists it keeps its last verified value until its
exporter withdraws it (a new index without it, or the lease ending, which takes
the index and the records).

The package, by subject: `record` (the record's format, signing and sequence),
`index` (the signed index and its buckets), `pairindex` (one index as a collector
follows it), `publisher`, `collector`; the host key book is `cluster/hostbook.py`.
This module gathers their public names.
"""

from evergraph.cluster.exports.collector import MARKS_FILE, Collector, encode_marks, load_marks
from evergraph.cluster.exports.index import (
    INDEX,
    PER_BUCKET,
    Entry,
    ExportIndex,
    Index,
    Pair,
    bucket_key,
    entry_name,
    index_key,
    is_index_key,
    make_bucket,
    make_index,
    open_bucket,
    open_index,
    parse_bucket_key,
    parse_index_key,
    record_digest,
    verified_entries,
)
from evergraph.cluster.exports.publisher import RECHECK, TXN_OPS, ExportItem, Publisher
from evergraph.cluster.exports.record import (
    EVERYONE,
    EXPORTED,
    SEQ_FILE,
    Exported,
    ExportRecord,
    SeqCounter,
    export_key,
    make_record,
    open_record,
    open_record_seq,
    parse_key,
)
from evergraph.cluster.hostbook import (
    HOSTKEYS,
    HostKeyBook,
    HostKeyRecord,
    decode_hostkeys,
    publish_hostkeys,
)

__all__ = [
    "EVERYONE",
    "EXPORTED",
    "HOSTKEYS",
    "INDEX",
    "MARKS_FILE",
    "PER_BUCKET",
    "RECHECK",
    "SEQ_FILE",
    "TXN_OPS",
    "Collector",
    "Entry",
    "ExportIndex",
    "ExportItem",
    "ExportRecord",
    "Exported",
    "HostKeyBook",
    "HostKeyRecord",
    "Index",
    "Pair",
    "Publisher",
    "SeqCounter",
    "bucket_key",
    "decode_hostkeys",
    "encode_marks",
    "entry_name",
    "export_key",
    "index_key",
    "is_index_key",
    "load_marks",
    "make_bucket",
    "make_index",
    "make_record",
    "open_bucket",
    "open_index",
    "open_record",
    "open_record_seq",
    "parse_bucket_key",
    "parse_index_key",
    "parse_key",
    "publish_hostkeys",
    "record_digest",
    "verified_entries",
]
