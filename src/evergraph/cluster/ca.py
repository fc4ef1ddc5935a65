"""The cluster CA: what a self-forming etcd World roots its identities in (SPEC 4.8).

The first embedded member makes the CA (`ClusterCA.create`); every member that
joins receives it over the verified join connection (cluster/joinwire.py), so
whichever member is elected curator can certify the next one. The CA issues:

- **node certificates**: this node's TLS identity for etcd's client and peer
  ports, the agent's etcd client and the join service (EC P-256; serverAuth and
  clientAuth; the addresses of the node's URLs, 127.0.0.1 and localhost as
  subject alternative names);
- **host certificates**: the CA's word that `hostname` owns an evergraph key
  pair. The certified key is the host's ed25519 verify key; the x25519 key that
  exports are sealed to travels in an extension of ours. A host certificate
  carries no TLS usage, so it opens no etcd port;
- **signed records**: `sign(data)` for the World records the curator acts on
  (ideal size, join tokens, invites): who can write the World without the CA's
  key can forge none of them;
- **revocation lists** (`crl`), for `cluster remove NAME`.

Files live in `<state>/cluster/` (directory 0700, private keys 0600), all
written with the one atomic write.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID, ObjectIdentifier

from evergraph._util.atomic import atomic_write

#: `<state>/cluster/`: what this node knows of its cluster
CLUSTER_DIR = "cluster"
CA_CERT, CA_KEY = "ca.crt", "ca.key"
NODE_CERT, NODE_KEY = "node.crt", "node.key"
HOST_CERT = "host.crt"
CRL = "crl.pem"

#: the extension of a host certificate that holds the host's x25519 public key
#: (base64, as in `hostkeys/<host>`), and the usage that marks the certificate
#: as certifying an evergraph host key (and nothing else)
OID_BOX_KEY = ObjectIdentifier("1.3.6.1.4.1.58888.25.1")
OID_HOST_KEY_USAGE = ObjectIdentifier("1.3.6.1.4.1.58888.25.2")

#: how long what the CA issues is valid (revocation ends it sooner)
CA_DAYS = 3650
CERT_DAYS = 1825
#: clocks of two hosts may differ: certificates are valid from a little earlier
_SKEW = datetime.timedelta(minutes=10)


class CAError(Exception):
    """A CA file is missing, unreadable or damaged, or a certificate is refused;
    the message is one line naming the file or the host."""


def cluster_dir(state_dir: Path) -> Path:
    return Path(state_dir) / CLUSTER_DIR


def fingerprint_pem(pem: bytes) -> str:
    """SHA-256 of a certificate's DER, lowercase hex (what a join token names)."""
    return fingerprint_der(_load_cert(pem, "certificate").public_bytes(serialization.Encoding.DER))


def fingerprint_der(der: bytes) -> str:
    return hashlib.sha256(der).hexdigest()


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _load_cert(pem: bytes, what: str) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(pem)
    except ValueError as e:
        raise CAError(f"{what}: not a PEM certificate ({e})") from None


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise CAError(f"{path}: {e.strerror}") from None


def url_hosts(urls: Iterable[str]) -> list[str]:
    """The hosts (IP addresses or names) of URLs, each once, in order."""
    out: list[str] = []
    for url in urls:
        host = urlsplit(url).hostname
        if host and host not in out:
            out.append(host)
    return out


def _san(hosts: Sequence[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for h in [*hosts, "127.0.0.1", "localhost"]:
        try:
            ip = ipaddress.ip_address(h)
        except ValueError:
            gn: x509.GeneralName = x509.DNSName(h)
        else:
            gn = x509.IPAddress(ip)
        if gn not in names:
            names.append(gn)
    return x509.SubjectAlternativeName(names)


def new_node_key(path: Path) -> bytes:
    """Make this node's TLS key (0600) unless one is there; its public key, PEM."""
    if not path.exists():
        new = ec.generate_private_key(ec.SECP256R1())
        pem = new.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        atomic_write(path, pem, mode=0o600, exclusive=True)
    try:
        key = serialization.load_pem_private_key(_read(path), None)
    except ValueError as e:
        raise CAError(f"{path}: damaged node key ({e}): remove it to make a new one") from None
    return key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )


@dataclass(frozen=True)
class HostCert:
    """What a valid host certificate says."""

    hostname: str
    public: str
    verify: str
    serial: int


def read_host_cert(pem: bytes) -> HostCert:
    """The names and keys a host certificate states (not yet verified): CAError if
    it is not one."""
    cert = _load_cert(pem, "host certificate")
    try:
        eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        box = cert.extensions.get_extension_for_oid(OID_BOX_KEY).value
        cns = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        subject_key = cert.public_key()
    except (x509.ExtensionNotFound, ValueError) as e:
        raise CAError(f"not a host certificate ({e})") from None
    if OID_HOST_KEY_USAGE not in eku or not isinstance(box, x509.UnrecognizedExtension):
        raise CAError("not a host certificate (no host-key usage)")
    if not isinstance(subject_key, ed25519.Ed25519PublicKey) or len(cns) != 1:
        raise CAError("not a host certificate (its key is not an ed25519 verify key)")
    verify = base64.b64encode(
        subject_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    ).decode()
    return HostCert(
        str(cns[0].value), box.value.decode(errors="replace"), verify, cert.serial_number
    )


class ClusterCA:
    """The cluster's CA certificate, and its key where this node holds it."""

    def __init__(self, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey | None) -> None:
        self.cert = cert
        self._key = key

    # -- making and keeping ---------------------------------------------------------
    @classmethod
    def new(cls, cluster_name: str) -> ClusterCA:
        key = ec.generate_private_key(ec.SECP256R1())
        now = _now()
        name = _name(f"evergraph cluster CA {cluster_name}")
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _SKEW)
            .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(key, hashes.SHA256())
        )
        return cls(cert, key)

    @classmethod
    def from_pem(cls, cert_pem: bytes, key_pem: bytes | None = None) -> ClusterCA:
        cert = _load_cert(cert_pem, "cluster CA")
        key = None
        if key_pem is not None:
            try:
                loaded = serialization.load_pem_private_key(key_pem, None)
            except ValueError as e:
                raise CAError(f"cluster CA key: not a PEM private key ({e})") from None
            if not isinstance(loaded, ec.EllipticCurvePrivateKey):
                raise CAError("cluster CA key: not an EC key")
            if loaded.public_key() != cert.public_key():
                raise CAError("cluster CA key does not belong to the CA certificate")
            key = loaded
        return cls(cert, key)

    @classmethod
    def load(cls, directory: Path) -> ClusterCA | None:
        """The CA in `directory` (with its key if there); None if there is none."""
        cert_path = Path(directory) / CA_CERT
        if not cert_path.exists():
            return None
        key_path = Path(directory) / CA_KEY
        key_pem = _read(key_path) if key_path.exists() else None
        try:
            return cls.from_pem(_read(cert_path), key_pem)
        except CAError as e:
            raise CAError(f"{directory}: {e}") from None

    def save(self, directory: Path) -> None:
        """ca.crt and (if held) ca.key, 0600, atomically."""
        if self._key is not None:
            atomic_write(Path(directory) / CA_KEY, self.key_pem, mode=0o600)
        atomic_write(Path(directory) / CA_CERT, self.cert_pem, mode=0o644)

    # -- what it is -------------------------------------------------------------------
    @property
    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    @property
    def key_pem(self) -> bytes:
        return self._signer().private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    @property
    def fingerprint(self) -> str:
        return fingerprint_der(self.cert.public_bytes(serialization.Encoding.DER))

    @property
    def can_sign(self) -> bool:
        return self._key is not None

    def _signer(self) -> ec.EllipticCurvePrivateKey:
        if self._key is None:
            raise CAError("this node does not hold the cluster CA's key")
        return self._key

    # -- issuing ------------------------------------------------------------------------
    def _builder(self, subject: str, days: int) -> x509.CertificateBuilder:
        now = _now()
        return (
            x509.CertificateBuilder()
            .subject_name(_name(subject))
            .issuer_name(self.cert.subject)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _SKEW)
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        )

    def issue_node(
        self, name: str, public_key_pem: bytes, hosts: Sequence[str], days: int = CERT_DAYS
    ) -> bytes:
        """A TLS certificate (PEM) for node `name` reachable at `hosts`."""
        try:
            public = serialization.load_pem_public_key(public_key_pem)
        except ValueError as e:
            raise CAError(f"node {name}: not a PEM public key ({e})") from None
        if not isinstance(public, ec.EllipticCurvePublicKey):
            raise CAError(f"node {name}: a node key is an EC key")
        usage = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
        try:
            san = _san(hosts)
        except ValueError as e:
            raise CAError(f"node {name}: bad address ({e})") from None
        cert = (
            self._builder(name, days)
            .public_key(public)
            .add_extension(x509.ExtendedKeyUsage(usage), critical=False)
            .add_extension(san, critical=False)
            .sign(self._signer(), hashes.SHA256())
        )
        return cert.public_bytes(serialization.Encoding.PEM)

    def issue_host(self, hostname: str, public: str, verify: str, days: int = CERT_DAYS) -> bytes:
        """A host certificate (PEM): `hostname` owns verify key `verify` (ed25519,
        base64) and box key `public` (x25519, base64)."""
        try:
            raw = base64.b64decode(verify, validate=True)
            key = ed25519.Ed25519PublicKey.from_public_bytes(raw)
        except ValueError as e:
            raise CAError(f"host {hostname}: not an ed25519 verify key ({e})") from None
        cert = (
            self._builder(hostname, days)
            .public_key(key)
            .add_extension(x509.ExtendedKeyUsage([OID_HOST_KEY_USAGE]), critical=False)
            .add_extension(x509.UnrecognizedExtension(OID_BOX_KEY, public.encode()), critical=False)
            .sign(self._signer(), hashes.SHA256())
        )
        return cert.public_bytes(serialization.Encoding.PEM)

    def crl(self, serials: Iterable[int]) -> bytes:
        """A revocation list (PEM) of these serials."""
        now = _now()
        b = (
            x509.CertificateRevocationListBuilder()
            .issuer_name(self.cert.subject)
            .last_update(now - _SKEW)
            .next_update(now + datetime.timedelta(days=CA_DAYS))
        )
        for serial in sorted(set(serials)):
            b = b.add_revoked_certificate(
                x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(now).build()
            )
        return b.sign(self._signer(), hashes.SHA256()).public_bytes(serialization.Encoding.PEM)

    # -- signing records ------------------------------------------------------------------
    def sign(self, data: bytes) -> bytes:
        return self._signer().sign(data, ec.ECDSA(hashes.SHA256()))

    def check_signature(self, data: bytes, signature: bytes) -> bool:
        public = self.cert.public_key()
        assert isinstance(public, ec.EllipticCurvePublicKey)
        try:
            public.verify(signature, data, ec.ECDSA(hashes.SHA256()))
        except InvalidSignature:
            return False
        return True

    # -- checking -------------------------------------------------------------------------
    def issued(self, cert: x509.Certificate, now: datetime.datetime | None = None) -> str | None:
        """Why `cert` is not a currently valid certificate of this CA; None if it is."""
        if cert.issuer != self.cert.subject:
            return "issued by another CA"
        try:
            cert.verify_directly_issued_by(self.cert)
        except (ValueError, TypeError, InvalidSignature):
            return "not signed by this cluster's CA"
        t = now or _now()
        if t < cert.not_valid_before_utc:
            return "not valid yet"
        if t > cert.not_valid_after_utc:
            return f"expired on {cert.not_valid_after_utc:%Y-%m-%d}"
        return None

    def check_host_cert(
        self,
        pem: bytes,
        hostname: str,
        public: str,
        verify: str,
        revoked: Iterable[int] = (),
        now: datetime.datetime | None = None,
    ) -> str | None:
        """Why `pem` does not certify that `hostname` owns (public, verify); None if
        it does."""
        try:
            hc = read_host_cert(pem)
        except CAError as e:
            return str(e)
        why = self.issued(_load_cert(pem, "host certificate"), now)
        if why:
            return f"host certificate {why}"
        if hc.hostname != hostname:
            return f"the certificate is for host {hc.hostname!r}"
        if hc.verify != verify or hc.public != public:
            return "the certificate is for another key"
        if hc.serial in set(revoked):
            return "the certificate was revoked"
        return None


def serial_of(pem: bytes) -> int:
    return _load_cert(pem, "certificate").serial_number
