"""The self-forming cluster's World records, as an attacker who can write the World
sees them: forged, copied or re-addressed records are refused (the curator and the
seats act only on what the CA or a certified host signed)."""

from __future__ import annotations

from pathlib import Path

import msgspec

from evergraph.cluster.ca import ClusterCA, serial_of
from evergraph.cluster.hostkeys import HostKeys
from evergraph.cluster.revoke import crl_serials
from evergraph.cluster.roster import (
    CANDIDATES,
    INVITES,
    LEAVING,
    SIZE_KEY,
    Invite,
    SizeSeen,
    decode_candidate,
    decode_invite,
    decode_size,
    encode_candidate,
    encode_invite,
    encode_size,
    leaving_names,
)
from evergraph.world.kv import KeyValue


def kv(key: str, value: bytes) -> KeyValue:
    return KeyValue(key=key, value=value, mod_revision=5, create_revision=5, lease=0)


def test_a_size_record_counts_only_signed_by_the_cluster_ca() -> None:
    ca, other = ClusterCA.new("c"), ClusterCA.new("evil")
    assert decode_size(ca, kv(SIZE_KEY, encode_size(ca, 5, 1.0))) == 5
    assert decode_size(ca, None) == 3
    # another CA's, an unsigned one, a signature moved onto another size, garbage
    assert decode_size(ca, kv(SIZE_KEY, encode_size(other, 1, 1.0))) == 3
    assert decode_size(ca, kv(SIZE_KEY, b'{"size": 1}')) == 3
    signed = msgspec.json.decode(encode_size(ca, 5, 1.0))
    assert decode_size(ca, kv(SIZE_KEY, msgspec.json.encode({**signed, "size": 1}))) == 3
    assert decode_size(ca, kv(SIZE_KEY, b"\xff")) == 3


def test_a_candidate_counts_only_certified_and_signed_by_its_host(tmp_path: Path) -> None:
    ca, other = ClusterCA.new("c"), ClusterCA.new("evil")
    keys, attacker = HostKeys(tmp_path / "h1"), HostKeys(tmp_path / "x")
    cert = ca.issue_host("h1", keys.public, keys.verify)
    good = encode_candidate(keys, "h1", "https://10.0.0.1:2380", "https://10.0.0.1:2379", cert)
    rec = decode_candidate(ca, kv(CANDIDATES + "h1", good))
    assert rec is not None
    assert rec.peer_url == "https://10.0.0.1:2380"
    # copied under another name; revoked; certified by another CA; the attacker's
    # own keys with h1's certificate; a URL changed after signing
    assert decode_candidate(ca, kv(CANDIDATES + "h2", good)) is None
    assert decode_candidate(ca, kv(CANDIDATES + "h1", good), revoked=[serial_of(cert)]) is None
    evil_cert = other.issue_host("h1", attacker.public, attacker.verify)
    forged = encode_candidate(attacker, "h1", "https://10.6.6.6:2380", "https://x:1", evil_cert)
    assert decode_candidate(ca, kv(CANDIDATES + "h1", forged)) is None
    stolen = encode_candidate(attacker, "h1", "https://10.6.6.6:2380", "https://x:1", cert)
    assert decode_candidate(ca, kv(CANDIDATES + "h1", stolen)) is None
    moved = msgspec.json.encode({**msgspec.json.decode(good), "peer_url": "https://10.6.6.6:2380"})
    assert decode_candidate(ca, kv(CANDIDATES + "h1", moved)) is None


def test_only_a_voters_own_signed_record_asks_for_its_replacement(tmp_path: Path) -> None:
    ca = ClusterCA.new("c")
    keys = HostKeys(tmp_path / "h1")
    cert = ca.issue_host("h1", keys.public, keys.verify)
    own = encode_candidate(keys, "h1", "https://10.0.0.1:2380", "https://10.0.0.1:2379", cert)
    items = [
        kv(LEAVING + "h1", own),  # h1's own: counts
        kv(LEAVING + "h2", b"{}"),  # a World writer names a voter: ignored
        kv(LEAVING + "h3", own),  # h1's record copied under h3: ignored
        kv(CANDIDATES + "h1", own),  # (a candidate key is not a leaving one)
    ]
    assert leaving_names(ca, items) == frozenset({"h1"})
    assert leaving_names(ca, items[:1], revoked=[serial_of(cert)]) == frozenset()


def test_an_invite_counts_only_signed_by_the_cluster_ca() -> None:
    ca, other = ClusterCA.new("c"), ClusterCA.new("evil")
    inv = Invite(name="h1", member_id=7, peer_url="https://10.0.0.1:2380", initial_cluster="a=b")
    signed = encode_invite(ca, inv)
    got = decode_invite(ca, kv(INVITES + "h1", signed))
    assert got is not None
    assert (got.name, got.member_id, got.initial_cluster) == ("h1", 7, "a=b")
    assert decode_invite(ca, kv(INVITES + "h1", encode_invite(other, inv))) is None
    assert decode_invite(ca, kv(INVITES + "h2", encode_invite(ca, inv))) is None
    evil = msgspec.json.encode(
        {**msgspec.json.decode(signed), "initial_cluster": "h1=https://10.6.6.6:1"}
    )
    assert decode_invite(ca, kv(INVITES + "h1", evil)) is None


def test_a_revocation_list_counts_only_from_the_cluster_ca() -> None:
    ca, other = ClusterCA.new("c"), ClusterCA.new("evil")
    assert crl_serials(ca, ca.crl([3, 4])) == {3, 4}
    assert crl_serials(ca, other.crl([])) is None  # another CA's (e.g. an empty list)
    assert crl_serials(ca, b"junk") is None


def test_a_replayed_older_size_record_or_its_deletion_changes_nothing(tmp_path: Path) -> None:
    """A World writer cannot sign, but it can write back a signed record from long
    ago (`size 1`) or delete the record: the curator keeps the newest it has seen,
    across a restart of its agent too."""
    ca = ClusterCA.new("c")
    seen_file = tmp_path / "size-seen.json"
    seen = SizeSeen(seen_file)
    old = kv(SIZE_KEY, encode_size(ca, 1, 100.0))
    new = kv(SIZE_KEY, encode_size(ca, 5, 200.0))
    assert seen.size(ca, None) == 3  # nothing seen, no record: the default
    assert seen.size(ca, old) == 1
    assert seen.size(ca, new) == 5
    assert seen.size(ca, old) == 5  # the replay
    assert seen.size(ca, None) == 5  # the deletion
    assert seen.size(ca, kv(SIZE_KEY, encode_size(ClusterCA.new("evil"), 1, 300.0))) == 5
    again = SizeSeen(seen_file)  # the agent restarted
    assert again.size(ca, old) == 5
    assert again.size(ca, kv(SIZE_KEY, encode_size(ca, 3, 300.0))) == 3  # a newer one counts
    assert seen_file.stat().st_mode & 0o777 == 0o600
