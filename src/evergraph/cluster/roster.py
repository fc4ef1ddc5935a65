"""The records a self-forming etcd cluster keeps in its World (SPEC 4.8).

- `cluster/size`: the ideal number of voters, signed by the cluster CA (a World
  writer without the CA's key cannot shrink the cluster to one) and dated: the
  curator keeps the newest it has seen (`SizeSeen`, in the state dir), so an
  older signed record written back, or the record deleted, changes nothing;
- `cluster/candidates/<name>`: every agent started with `--etcd embedded`
  (voter or standby), under its member lease, signed by its host key and
  carrying its host certificate: the curator considers only certified hosts;
- `cluster/invites/<name>`: the curator's word to a standby that it was added
  as a learner (its member id and the `--initial-cluster` to start with),
  signed by the CA;
- `cluster/leaving/<name>`: under the lease of a voter that stops cleanly and
  asks to be replaced first;
- `cluster/last-change`: the curator's line for its last membership change
  (what and why; `cluster watch` prints it). Told, not trusted: nothing acts
  on it.

Decoders return None for a record that does not verify (the caller logs it).
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Iterable
from pathlib import Path

import msgspec

from evergraph.cluster.ca import ClusterCA
from evergraph.cluster.hostkeys import HostKeys
from evergraph.world.kv import KV, KeyValue

log = logging.getLogger("evergraph.cluster")

SIZE_KEY = "cluster/size"
CANDIDATES = "cluster/candidates/"
INVITES = "cluster/invites/"
LEAVING = "cluster/leaving/"
LAST_CHANGE = "cluster/last-change"

DEFAULT_SIZE = 3
VALID_SIZES = (1, 3, 5, 7, 9)


def size_problem(n: int) -> str | None:
    if n not in VALID_SIZES:
        return f"{n} is not a valid cluster size: pick one of {', '.join(map(str, VALID_SIZES))}"
    return None


class _Signed(msgspec.Struct, frozen=True, kw_only=True):
    sig: str = ""


def _body(rec: msgspec.Struct) -> bytes:
    """What a signature covers: the record without its signature, canonical JSON."""
    fields = {f: getattr(rec, f) for f in rec.__struct_fields__ if f != "sig"}
    return type(rec).__name__.encode() + b"\0" + msgspec.json.encode(fields, order="sorted")


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def _unb64(text: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except ValueError:
        return b""


# -- ideal size ---------------------------------------------------------------------------
class SizeRecord(_Signed, frozen=True, kw_only=True):
    size: int
    set_at: float = 0.0


def encode_size(ca: ClusterCA, size: int, now: float) -> bytes:
    rec = SizeRecord(size=size, set_at=now)
    return msgspec.json.encode(msgspec.structs.replace(rec, sig=_b64(ca.sign(_body(rec)))))


def decode_size_record(ca: ClusterCA, kv: KeyValue) -> SizeRecord | None:
    """The record if the cluster CA signed it (and its size is valid), else None."""
    try:
        rec = msgspec.json.decode(kv.value, type=SizeRecord)
    except msgspec.DecodeError:
        return None
    if size_problem(rec.size) or not ca.check_signature(_body(rec), _unb64(rec.sig)):
        return None
    return rec


def decode_size(ca: ClusterCA, kv: KeyValue | None) -> int:
    """The ideal size a valid record states; the default for none, and for one that
    does not verify (logged)."""
    if kv is None:
        return DEFAULT_SIZE
    rec = decode_size_record(ca, kv)
    if rec is None:
        log.error("cluster: %s is not signed by the cluster CA: ignored (ideal size 3)", kv.key)
        return DEFAULT_SIZE
    return rec.size


class SizeSeen:
    """The newest signed size record this host has seen, kept in a file: the
    curator acts on it, never on an older one a World writer puts back (a replay
    of a signed `size 1` from long ago), nor on the record's absence."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.newest: SizeRecord | None = None
        if path is not None:
            try:
                self.newest = msgspec.json.decode(path.read_bytes(), type=SizeRecord)
            except FileNotFoundError:
                pass
            except (OSError, msgspec.DecodeError) as e:
                log.warning("cluster: %s unreadable (%s): starting from the World's size", path, e)

    def size(self, ca: ClusterCA, kv: KeyValue | None) -> int:
        """The ideal size to act on, given the World's record now."""
        rec = None if kv is None else decode_size_record(ca, kv)
        if kv is not None and rec is None:
            log.error("cluster: %s is not signed by the cluster CA: ignored", kv.key)
        known = self.newest
        if rec is None:
            return known.size if known is not None else DEFAULT_SIZE
        if known is not None and rec.set_at < known.set_at:
            log.error(
                "cluster: %s is older (set at %.0f) than one seen before (set at %.0f): "
                "a replay, ignored (ideal size %d)",
                SIZE_KEY,
                rec.set_at,
                known.set_at,
                known.size,
            )
            return known.size
        if known is None or rec.set_at > known.set_at:
            self.newest = rec
            if self.path is not None:
                from evergraph._util.atomic import atomic_write

                try:
                    atomic_write(self.path, msgspec.json.encode(rec), mode=0o600)
                except OSError as e:
                    log.warning("cluster: cannot keep %s: %s", self.path, e)
        return rec.size


async def read_size(kv: KV, ca: ClusterCA) -> int:
    return decode_size(ca, await kv.get(SIZE_KEY))


# -- candidates ---------------------------------------------------------------------------
class Candidate(_Signed, frozen=True, kw_only=True):
    name: str
    peer_url: str
    client_url: str
    public: str
    verify: str
    cert: str


def encode_candidate(keys: HostKeys, name: str, peer: str, client: str, cert: bytes) -> bytes:
    rec = Candidate(
        name=name,
        peer_url=peer,
        client_url=client,
        public=keys.public,
        verify=keys.verify,
        cert=cert.decode(),
    )
    return msgspec.json.encode(msgspec.structs.replace(rec, sig=_b64(keys.sign(_body(rec)))))


def decode_candidate(
    ca: ClusterCA, kv: KeyValue, revoked: Iterable[int] = (), prefix: str = CANDIDATES
) -> Candidate | None:
    """The candidate at `kv` if it is certified by the CA (its certificate not among
    the `revoked` serials: a host `cluster remove`d is no candidate, though its
    agent still runs and writes its record) and signed by its host. A voter asking
    to be replaced writes the same record under `prefix` LEAVING."""
    try:
        rec = msgspec.json.decode(kv.value, type=Candidate)
    except msgspec.DecodeError:
        return None
    if kv.key != prefix + rec.name:
        return None
    if ca.check_host_cert(rec.cert.encode(), rec.name, rec.public, rec.verify, revoked) is not None:
        return None
    if not HostKeys.check_signature(rec.verify, _body(rec), _unb64(rec.sig)):
        return None
    return rec


def leaving_names(
    ca: ClusterCA, items: Iterable[KeyValue], revoked: Iterable[int] = ()
) -> frozenset[str]:
    """The voters asking to be replaced: only records their own host signed count (a
    World writer cannot have a voter removed by writing its name)."""
    out = set()
    for item in items:
        rec = decode_candidate(ca, item, revoked, prefix=LEAVING)
        if rec is None:
            log.error("cluster: %s is not signed by its certified host: ignored", item.key)
        else:
            out.add(rec.name)
    return frozenset(out)


# -- the last change ---------------------------------------------------------------------
class Change(msgspec.Struct, frozen=True, kw_only=True):
    """A membership change, as the curator that made it tells it."""

    line: str
    by: str = ""
    at: float = 0.0


def encode_change(line: str, by: str, at: float) -> bytes:
    return msgspec.json.encode(Change(line=line, by=by, at=at))


def decode_change(kv: KeyValue | None) -> Change | None:
    if kv is None:
        return None
    try:
        return msgspec.json.decode(kv.value, type=Change)
    except msgspec.DecodeError:
        return None


# -- invites ------------------------------------------------------------------------------
class Invite(_Signed, frozen=True, kw_only=True):
    name: str
    member_id: int
    peer_url: str
    initial_cluster: str


def encode_invite(ca: ClusterCA, inv: Invite) -> bytes:
    return msgspec.json.encode(msgspec.structs.replace(inv, sig=_b64(ca.sign(_body(inv)))))


def decode_invite(ca: ClusterCA, kv: KeyValue) -> Invite | None:
    try:
        rec = msgspec.json.decode(kv.value, type=Invite)
    except msgspec.DecodeError:
        return None
    if kv.key != INVITES + rec.name or not ca.check_signature(_body(rec), _unb64(rec.sig)):
        return None
    return rec
