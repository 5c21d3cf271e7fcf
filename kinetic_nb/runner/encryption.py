"""Encryption of what carries the user's data out of the notebook: authenticated (AES-256-GCM), under keys
derived from the job's key, so a bucket reader or a network peer learns sizes only.

Signing (``runner.envelope``) says who wrote an object; this says nobody else can read it. An encrypted object
is ``MAGIC || nonce || ciphertext+tag``: the nonce is random (96 bits, as GCM wants; a job encrypts few
objects under one key), the key is the job's key derived for the object's purpose, and the object's name is
the associated data, so a ciphertext moved to another name, job or session does not decrypt. Sealing an
encrypted object as well is harmless and keeps one rule for every stored object: verify, then read.

Host-safe: the standard library and ``cryptography`` (a well-kept library; never a hand-rolled cipher).
"""

from __future__ import annotations

import secrets

from kinetic_nb.errors import IntegrityError
from kinetic_nb.runner.job_keys import derived_key

__all__ = ["OVERHEAD_BYTES", "decrypt", "encrypt"]

#: Marks an object of this format, and its version: one of another format is refused, never guessed at.
_MAGIC = b"KNE1"
_NONCE_BYTES = 12
_TAG_BYTES = 16
#: What encryption adds to an object's size.
OVERHEAD_BYTES = len(_MAGIC) + _NONCE_BYTES + _TAG_BYTES


def load_cipher() -> None:
    """Import the cipher now (about 8 ms): a warm agent does while it waits, so the hosts it forks later decrypt
    without paying for it (imported on first use otherwise: a local host never needs it)."""
    import cryptography.exceptions  # noqa: F401
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM  # noqa: F401


def _cipher(key: bytes, purpose: str):
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    return AESGCM(bytes(derived_key(key, "encrypt/" + purpose)))


def encrypt(key: bytes, purpose: str, name: str, plaintext: bytes) -> bytes:
    """``plaintext`` encrypted and authenticated under ``key`` derived for ``purpose``, bound to ``name``."""
    nonce = secrets.token_bytes(_NONCE_BYTES)
    return _MAGIC + nonce + _cipher(key, purpose).encrypt(nonce, plaintext, name.encode())


def decrypt(key: bytes, purpose: str, name: str, data: bytes) -> bytes:
    """The plaintext of :func:`encrypt`'s ``data``; ``IntegrityError`` for anything it did not make for ``name``
    under this key."""
    from cryptography.exceptions import InvalidTag

    if len(data) < OVERHEAD_BYTES or not data.startswith(_MAGIC):
        raise IntegrityError(f"{name} is not encrypted for this job: refused")
    nonce = data[len(_MAGIC):len(_MAGIC) + _NONCE_BYTES]
    try:
        return _cipher(key, purpose).decrypt(nonce, data[len(_MAGIC) + _NONCE_BYTES:], name.encode())
    except InvalidTag:
        raise IntegrityError(f"{name} does not decrypt under this job's key (altered, or another job's): "
                             "refused") from None
