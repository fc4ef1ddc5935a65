"""`cluster remove NAME`: a host out of the cluster, its certificates revoked.

The revocation list lives in the World at `cluster/crl` (a CRL is signed by the
CA, so a World writer can neither forge nor shorten one without it being seen:
`read_crl` accepts only a list the CA signed). Every member's seat writes it to
`<state>/cluster/crl.pem`, which etcd checks at each TLS handshake, and hands
its serials to the host-key book, which drops a revoked host's key at once.
"""

from __future__ import annotations

import contextlib
import logging

from cryptography import x509

from evergraph.cluster.ca import CAError, ClusterCA, serial_of
from evergraph.cluster.hostbook import HOSTKEYS, decode_hostkeys
from evergraph.cluster.roster import CANDIDATES, INVITES, decode_candidate
from evergraph.world.etcd import EtcdKV
from evergraph.world.etcd_cluster import NoSuchMember, member_list, member_remove
from evergraph.world.kv import Compare, KeyValue, Put, WorldError

log = logging.getLogger("evergraph.cluster")

CRL_KEY = "cluster/crl"


def crl_serials(ca: ClusterCA, pem: bytes) -> set[int] | None:
    """The revoked serials of a CRL the CA signed; None if it is not one."""
    try:
        crl = x509.load_pem_x509_crl(pem)
    except ValueError:
        return None
    public = ca.cert.public_key()
    if crl.issuer != ca.cert.subject or not crl.is_signature_valid(public):  # type: ignore[arg-type]
        return None
    return {r.serial_number for r in crl}


def read_crl(ca: ClusterCA, kv: KeyValue | None) -> set[int] | None:
    if kv is None:
        return set()
    return crl_serials(ca, kv.value)


async def remove_host(kv: EtcdKV, ca: ClusterCA, name: str) -> str:
    """Remove `name`'s etcd member (if it is one), revoke its host certificate (and
    node certificate, from its candidate record), drop its candidate record; a line
    saying what was done. LookupError if the cluster knows no such host."""
    done: list[str] = []
    members = await member_list(kv)
    for m in members:
        if m.name == name:
            with contextlib.suppress(NoSuchMember):
                await member_remove(kv, m.id)
            done.append("removed its member")
    serials: set[int] = set()
    cand = await kv.get(CANDIDATES + name)
    if cand is not None:
        c = decode_candidate(ca, cand)
        if c is not None:
            with contextlib.suppress(CAError):
                serials.add(serial_of(c.cert.encode()))
        await kv.delete(CANDIDATES + name)
    hk = await kv.get(HOSTKEYS + name)
    if hk is not None:
        with contextlib.suppress(ValueError, CAError):
            cert = decode_hostkeys(hk).cert
            if cert:
                serials.add(serial_of(cert.encode()))
    with contextlib.suppress(WorldError):
        await kv.delete(INVITES + name)
    if not done and not serials:
        raise LookupError(f"no host {name!r} in this cluster (not a member, no certificate)")
    if serials:
        while True:
            cur = await kv.get(CRL_KEY)
            known = read_crl(ca, cur) or set()
            new = ca.crl(known | serials)
            expect = cur.mod_revision if cur is not None else 0
            if await kv.txn([Compare(CRL_KEY, expect)], [Put(CRL_KEY, new)]) is not None:
                break
        done.append(f"revoked {len(serials)} certificate(s)")
    line = f"{name}: {', '.join(done)}"
    log.info("cluster: %s", line)
    return line
