"""The cluster CA: node and host certificates, signed records, revocation."""

from __future__ import annotations

import ssl
import stat
from pathlib import Path

import pytest
from cryptography import x509

from evergraph.cluster.ca import (
    CAError,
    ClusterCA,
    fingerprint_pem,
    new_node_key,
    read_host_cert,
    serial_of,
    url_hosts,
)
from evergraph.cluster.hostkeys import HostKeys


def test_a_saved_ca_loads_with_its_key_private(tmp_path: Path) -> None:
    ca = ClusterCA.new("c1")
    ca.save(tmp_path)
    assert stat.S_IMODE((tmp_path / "ca.key").stat().st_mode) == 0o600
    back = ClusterCA.load(tmp_path)
    assert back is not None
    assert back.can_sign
    assert back.fingerprint == ca.fingerprint
    assert fingerprint_pem(ca.cert_pem) == ca.fingerprint
    assert ClusterCA.load(tmp_path / "none") is None
    (tmp_path / "ca.key").write_bytes(ClusterCA.new("other").key_pem)
    with pytest.raises(CAError, match="does not belong"):
        ClusterCA.load(tmp_path)


def test_a_node_certificate_serves_tls_for_its_addresses(tmp_path: Path) -> None:
    ca = ClusterCA.new("c1")
    public = new_node_key(tmp_path / "node.key")
    assert stat.S_IMODE((tmp_path / "node.key").stat().st_mode) == 0o600
    assert new_node_key(tmp_path / "node.key") == public  # kept, not replaced
    hosts = url_hosts(["https://10.9.0.1:2379", "https://10.9.0.1:2380", "https://n1.example:1"])
    assert hosts == ["10.9.0.1", "n1.example"]
    (tmp_path / "node.crt").write_bytes(ca.issue_node("n1", public, hosts))
    (tmp_path / "ca.crt").write_bytes(ca.cert_pem)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=tmp_path / "ca.crt")
    ctx.load_cert_chain(tmp_path / "node.crt", tmp_path / "node.key")  # key matches
    assert ca.issued(x509.load_pem_x509_certificate((tmp_path / "node.crt").read_bytes())) is None
    with pytest.raises(CAError, match="not a PEM public key"):
        ca.issue_node("n1", b"garbage", hosts)


def test_host_certificates_bind_a_hostname_to_both_keys(tmp_path: Path) -> None:
    ca, other = ClusterCA.new("c1"), ClusterCA.new("c2")
    keys = HostKeys(tmp_path / "a")
    pem = ca.issue_host("alpha", keys.public, keys.verify)
    hc = read_host_cert(pem)
    assert (hc.hostname, hc.public, hc.verify) == ("alpha", keys.public, keys.verify)
    assert ca.check_host_cert(pem, "alpha", keys.public, keys.verify) is None
    attacker = HostKeys(tmp_path / "b")
    assert ca.check_host_cert(pem, "beta", keys.public, keys.verify) == (
        "the certificate is for host 'alpha'"
    )
    assert ca.check_host_cert(pem, "alpha", attacker.public, keys.verify) == (
        "the certificate is for another key"
    )
    assert ca.check_host_cert(pem, "alpha", keys.public, attacker.verify) == (
        "the certificate is for another key"
    )
    forged = other.issue_host("alpha", attacker.public, attacker.verify)
    assert "another CA" in (
        ca.check_host_cert(forged, "alpha", attacker.public, attacker.verify) or ""
    )
    assert ca.check_host_cert(pem, "alpha", keys.public, keys.verify, revoked=[serial_of(pem)]) == (
        "the certificate was revoked"
    )
    assert "not a" in (ca.check_host_cert(b"junk", "alpha", keys.public, keys.verify) or "")
    # a node (TLS) certificate is no host certificate
    node = ca.issue_node("alpha", new_node_key(tmp_path / "k"), ["10.0.0.1"])
    assert "not a host certificate" in (
        ca.check_host_cert(node, "alpha", keys.public, keys.verify) or ""
    )


def test_records_signed_by_the_ca_and_only_by_it() -> None:
    ca, other = ClusterCA.new("c1"), ClusterCA.new("c2")
    sig = ca.sign(b"size=3")
    assert ca.check_signature(b"size=3", sig)
    assert not ca.check_signature(b"size=1", sig)
    assert not ca.check_signature(b"size=3", other.sign(b"size=3"))
    public_only = ClusterCA.from_pem(ca.cert_pem)
    assert public_only.check_signature(b"size=3", sig)
    assert not public_only.can_sign
    with pytest.raises(CAError, match="does not hold"):
        public_only.sign(b"x")


def test_a_revocation_list_names_the_serials(tmp_path: Path) -> None:

    ca = ClusterCA.new("c1")
    crl = x509.load_pem_x509_crl(ca.crl([5, 7, 5]))
    assert sorted(r.serial_number for r in crl) == [5, 7]
    assert crl.is_signature_valid(ca.cert.public_key())  # type: ignore[arg-type]
