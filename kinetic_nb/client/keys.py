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
from kinetic_nb.runner.job_keys import KEY_BYTES, JobKey, job_key, new_key, parse_key
from kinetic_nb.storage.defaults import user_directory

__all__ = ["create_key", "delete_key", "key_path", "load_key", "read_key_file"]


def key_path(job_id: str) -> Path:
    """The file that holds ``job_id``'s key (it may not exist)."""
    return user_directory("keys") / f"{job_id}.key"


def create_key(job_id: str, kind: str) -> JobKey:
    """A fresh secret for ``job_id``, kept in its 0600 file before anything of the job is stored; the key
    bound to the job's ``kind`` (``job_keys.JOB`` or ``job_keys.SESSION``) and id."""
    secret = new_key()
    path = key_path(job_id)
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as file:
        file.write(secret.hex() + "\n")
    return job_key(secret, kind, job_id)


def read_key_file(path: str | os.PathLike, job_id: str, kind: str) -> JobKey:
    """The key of ``job_id`` (a ``kind``) from a file written by :func:`create_key` (or a copy); one-line errors."""
    try:
        text = Path(path).read_text().strip()
    except OSError as error:
        raise KineticError(f"cannot read the key file {path}: {error.strerror or error}") from None
    secret = parse_key(text)
    if secret is None:
        raise KineticError(f"{path} holds no kinetic_nb key (expected {KEY_BYTES * 2} hex digits)")
    return job_key(secret, kind, job_id)


def load_key(job_id: str, kind: str) -> JobKey | None:
    """``job_id``'s key (bound to its ``kind`` and id) from this user's keys, or None when this user lacks it."""
    path = key_path(job_id)
    return read_key_file(path, job_id, kind) if path.exists() else None


def delete_key(job_id: str) -> None:
    """Forget ``job_id``'s key (with its job); a key that is not there is fine."""
    key_path(job_id).unlink(missing_ok=True)
