"""Where this user keeps each job's key: a 0600 file per job in a 0700 directory, never in storage.

``%kinetic attach`` from another kernel of the same user finds the key here;
from another machine, the key file is copied there and named explicitly
(``attach(..., key_file=...)``); on GKE it can also be read back from the
job's Secret while the job exists.
"""

from __future__ import annotations

import os
from pathlib import Path

from kinetic_nb.errors import KineticError
from kinetic_nb.runner.envelope import KEY_BYTES, new_key, parse_key
from kinetic_nb.storage.defaults import user_directory

__all__ = ["create_key", "delete_key", "key_path", "load_key", "read_key_file"]


def key_path(job_id: str) -> Path:
    """The file that holds ``job_id``'s key (it may not exist)."""
    return user_directory("keys") / f"{job_id}.key"


def create_key(job_id: str) -> bytes:
    """A fresh key for ``job_id``, kept in its 0600 file before anything of the job is stored."""
    key = new_key()
    path = key_path(job_id)
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as file:
        file.write(key.hex() + "\n")
    return key


def read_key_file(path: str | os.PathLike) -> bytes:
    """A key from a file written by :func:`create_key` (or exported from one); one-line errors."""
    try:
        text = Path(path).read_text().strip()
    except OSError as error:
        raise KineticError(f"cannot read the key file {path}: {error.strerror or error}") from None
    key = parse_key(text)
    if key is None:
        raise KineticError(f"{path} holds no kinetic_nb key (expected {KEY_BYTES * 2} hex digits)")
    return key


def load_key(job_id: str) -> bytes | None:
    """``job_id``'s key from this user's keys, or None when this user does not have it."""
    path = key_path(job_id)
    return read_key_file(path) if path.exists() else None


def delete_key(job_id: str) -> None:
    """Forget ``job_id``'s key (with its job); a key that is not there is fine."""
    key_path(job_id).unlink(missing_ok=True)
