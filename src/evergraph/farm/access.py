"""Per-job access: a fresh RSA-2048 key pair for each job.

The private key is PEM `RSA PRIVATE KEY` (PKCS#1, unencrypted): the form Boruta's
Go client parses (`x509.ParsePKCS1PrivateKey`). The public key is an OpenSSH
`ssh-rsa` line for authorized_keys. Generated on the worker; the private key
leaves it only sealed to the agent that serves it to the request's owner.
"""

from __future__ import annotations

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa


def new_key_pair() -> tuple[bytes, str]:
    """(private key PEM, PKCS#1), public key as an OpenSSH line without comment)."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    private = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.TraditionalOpenSSL,  # PKCS#1: BEGIN RSA PRIVATE KEY
        serialization.NoEncryption(),
    )
    public = key.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    )
    return private, public.decode()
