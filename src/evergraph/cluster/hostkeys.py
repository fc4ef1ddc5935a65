"""Host keys: one encryption key pair and one signing key pair per state dir.

Stored in `<state>/keys/` (directory 0700, files 0600), created on first use
with an atomic write so a crash never leaves half a key. Used for:

- directed exports: sealed to the target's public key, signed by the exporter;
- secrets a resource saves on disk (e.g. `password.saved`): encrypted with a
  symmetric key derived from the host's private key, never plaintext.
"""

from __future__ import annotations

import base64
import os
from pathlib import Path

import nacl.encoding
import nacl.exceptions
import nacl.hash
import nacl.public
import nacl.secret
import nacl.signing
import nacl.utils

from evergraph._util.atomic import atomic_write


class KeyError_(Exception):
    """A key file is unreadable or a ciphertext does not open with our key."""


#: what to do about a damaged key file (the rest of its one-line message)
_REPAIR = (
    "restore it from a backup, or remove it to make a new one (hosts that pinned the "
    "old key then refuse this one until they `evergraph hosts forget` it, and secrets "
    "sealed with it are lost)"
)


def _damaged(path: Path, why: str) -> KeyError_:
    return KeyError_(f"{path}: damaged host key ({why}): {_REPAIR}")


def _load_or_create(path: Path) -> bytes:
    try:
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            # exclusive: if another process created it first, theirs wins
            for attempt in range(3):
                try:
                    seed = base64.b64encode(nacl.utils.random(32)) + b"\n"
                    atomic_write(path, seed, exclusive=True)
                    break
                except FileNotFoundError:
                    # an agent starting on this state dir swept our temporary file
                    # (it removes what an interrupted write left): write it again
                    if attempt == 2:
                        raise
            raw = path.read_bytes()
    except OSError as e:
        raise KeyError_(
            f"{path}: cannot read or create this host's key: {e.strerror} (the state "
            "directory must be readable and writable by the agent's user)"
        ) from None
    if len(raw) > 1024:
        raise _damaged(path, f"{len(raw)} bytes; a key file holds 45")
    try:
        seed = base64.b64decode(raw.strip(), validate=True)
    except ValueError:
        raise _damaged(path, "not base64") from None
    if len(seed) != 32:
        raise _damaged(path, f"a key is 32 bytes, this one is {len(seed)}")
    return seed


class HostKeys:
    """The host's key pairs. `public`/`verify` go into the member record."""

    def __init__(self, state_dir: Path) -> None:
        d = state_dir / "keys"
        try:
            d.mkdir(parents=True, exist_ok=True, mode=0o700)
            os.chmod(d, 0o700)
        except OSError as e:
            raise KeyError_(
                f"{d}: cannot make the host key directory: {e.strerror} (the state "
                "directory must be writable by the agent's user)"
            ) from None
        self.dir = d
        self.box_key = nacl.public.PrivateKey(_load_or_create(d / "box.key"))
        self.sign_key = nacl.signing.SigningKey(_load_or_create(d / "sign.key"))
        # a symmetric key for local secrets, derived so it is never stored apart
        local = nacl.hash.blake2b(
            bytes(self.box_key),
            key=b"evergraph-local-secrets",
            digest_size=nacl.secret.SecretBox.KEY_SIZE,
            encoder=nacl.encoding.RawEncoder,
        )
        self._local = nacl.secret.SecretBox(local)

    @property
    def public(self) -> str:
        """The encryption public key, base64."""
        return base64.b64encode(bytes(self.box_key.public_key)).decode()

    @property
    def verify(self) -> str:
        """The signature verification key, base64."""
        return base64.b64encode(bytes(self.sign_key.verify_key)).decode()

    # local secrets ---------------------------------------------------------
    def seal_local(self, plaintext: bytes) -> bytes:
        return base64.b64encode(self._local.encrypt(plaintext))

    def open_local(self, token: bytes) -> bytes:
        try:
            return self._local.decrypt(base64.b64decode(token.strip(), validate=True))
        except (ValueError, nacl.exceptions.CryptoError):
            raise KeyError_("does not open with this host's key") from None

    # directed exports --------------------------------------------------------
    def seal_to(self, public_b64: str, plaintext: bytes) -> bytes:
        """Encrypt to another host's public key (only its private key opens it)."""
        try:
            pk = nacl.public.PublicKey(base64.b64decode(public_b64, validate=True))
        except (ValueError, nacl.exceptions.CryptoError):
            raise KeyError_("not a valid public key") from None
        return nacl.public.SealedBox(pk).encrypt(plaintext)

    def unseal(self, ciphertext: bytes) -> bytes:
        try:
            return nacl.public.SealedBox(self.box_key).decrypt(ciphertext)
        except nacl.exceptions.CryptoError:
            raise KeyError_("not sealed to this host") from None

    def pair(self) -> tuple[str, str]:
        """(public, verify): what `hostkeys/<host>` names."""
        return self.public, self.verify

    def sign(self, data: bytes) -> bytes:
        return self.sign_key.sign(data).signature

    @staticmethod
    def check_signature(verify_b64: str, data: bytes, signature: bytes) -> bool:
        try:
            vk = nacl.signing.VerifyKey(base64.b64decode(verify_b64, validate=True))
            vk.verify(data, signature)
        except (ValueError, nacl.exceptions.BadSignatureError, nacl.exceptions.CryptoError):
            return False
        return True


def fingerprint(key_b64: str) -> str:
    """A short, stable name for a public key (as ssh prints them): `SHA256:` and the
    unpadded base64 of the key bytes' sha256."""
    try:
        raw = base64.b64decode(key_b64, validate=True)
    except ValueError:
        raw = key_b64.encode()
    digest = nacl.hash.sha256(raw, encoder=nacl.encoding.RawEncoder)
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def identity(public: str, verify: str) -> str:
    """A host's identity as one string, `<box public>:<verify key>` (base64 each):
    what `evergraph hosts` prints and `hosts trust NAME KEY` takes."""
    return f"{public}:{verify}"


def parse_identity(text: str) -> tuple[str, str]:
    """(public, verify) of an identity string; ValueError naming what is wrong."""
    public, sep, verify = text.strip().partition(":")
    if not sep:
        raise ValueError("a host key is '<public>:<verify>' (see `evergraph hosts key`)")
    for what, k in (("public", public), ("verify", verify)):
        try:
            raw = base64.b64decode(k, validate=True)
        except ValueError:
            raise ValueError(f"the {what} part is not base64") from None
        if len(raw) != 32:
            raise ValueError(f"the {what} part is {len(raw)} bytes; a key is 32")
    return public, verify


def check_verify_key(key_b64: str) -> str:
    """`key_b64` if it is a base64 Ed25519 verify key; ValueError otherwise."""
    try:
        raw = base64.b64decode(key_b64.strip(), validate=True)
    except ValueError:
        raise ValueError("not base64") from None
    if len(raw) != 32:
        raise ValueError(f"{len(raw)} bytes; a key is 32")
    return key_b64.strip()
