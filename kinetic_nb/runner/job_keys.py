"""A job's key: 32 random bytes per job, bound to the job's kind and id, and how a host receives it.

Every MAC of a job (``runner.envelope``) is made under its bound key
(:func:`job_key`). The secret never enters storage: the client keeps it in a
0600 file, and hands the bound key to the hosts' agent out of band (a pipe
locally and on Ray, a mounted Secret file on GKE). In memory a key is a
:class:`JobKey`, whose repr is masked, so no traceback prints it.

Host-safe: the standard library only.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from typing import Any

from kinetic_nb.errors import IntegrityError

#: The variable that carries a job's key (hex) to a host started by hand (``python -m kinetic_nb.runner``),
#: and the name of the key in a GKE job's Secret. An agent never takes its key from its environment.
KEY_ENV = "KINETIC_JOB_KEY"
#: The variable that names the file holding a job's key (hex): a GKE pod's mounted Secret.
KEY_FILE_ENV = "KINETIC_JOB_KEY_FILE"
#: 256 bits: HMAC-SHA256's own strength.
KEY_BYTES = 32
#: The two kinds of job a key is bound to: a one-shot job (``kn-...``) and a session (``ks-...``).
JOB = "job"
SESSION = "session"


class JobKey(bytes):
    """A key in memory: the bytes themselves, with a masked repr.

    Locals and arguments are printed by verbose tracebacks (``%xmode
    Verbose``), debuggers and logs; a ``JobKey`` shows as ``JobKey(***)`` there.
    Only :meth:`hex` (for the hosts' out-of-band channel) spells it out.
    """

    def __repr__(self) -> str:
        return "JobKey(***)"

    __str__ = __repr__

    def __reduce__(self) -> Any:
        raise TypeError("a job's key is never pickled: it travels only out of band")


def new_key() -> bytes:
    """A fresh random secret for one job (or session); :func:`job_key` binds it to the job."""
    return secrets.token_bytes(KEY_BYTES)


def job_key(secret: bytes, kind: str, job_id: str) -> JobKey:
    """The key every MAC of job ``job_id`` is made with: ``secret`` bound to the job's kind and id.

    ``kind`` is :data:`JOB` or :data:`SESSION`, as the caller knows it (never
    read from storage): a job's records copied under ``sessions/`` (or another
    job's directory) are then verified under another key, and fail.
    """
    if kind not in (JOB, SESSION):
        raise ValueError(f"a key is bound to a {JOB} or a {SESSION}, not {kind!r}")
    return JobKey(hmac.new(secret, b"kinetic-nb/job\0" + kind.encode() + b"\0" + job_id.encode(),
                           hashlib.sha256).digest())


def derived_key(key: bytes, purpose: str) -> JobKey:
    """A key for one part of a job (a session's cell: ``"cells/000003"``), so its records cannot be
    replayed onto another part under the same names."""
    return JobKey(hmac.new(key, b"kinetic-nb/derive\0" + purpose.encode(), hashlib.sha256).digest())


def key_from_text(text: str, *, where: str) -> JobKey:
    """A (bound) key from the hex its agent was given; ``IntegrityError`` naming ``where`` if it is not one."""
    key = parse_key(text)
    if key is None:
        raise IntegrityError(f"{where} holds no kinetic_nb key ({KEY_BYTES * 2} hex digits)")
    return JobKey(key)


def key_from_environment(environ: dict[str, str] | os._Environ = os.environ, *, remove: bool = True) -> JobKey | None:
    """The job's key from :data:`KEY_ENV` (removed from ``environ`` by default), or None when there is none."""
    raw = environ.pop(KEY_ENV, None) if remove else environ.get(KEY_ENV)
    if not raw:
        return None
    return key_from_text(raw, where=KEY_ENV)


def key_from_file(environ: dict[str, str] | os._Environ = os.environ) -> JobKey | None:
    """The job's key from the file :data:`KEY_FILE_ENV` names (the name removed from ``environ``), or None when
    none is named; ``IntegrityError`` naming the file when it cannot be read or holds no key."""
    path = environ.pop(KEY_FILE_ENV, None)
    if not path:
        return None
    try:
        with open(path, "rb") as file:
            text = file.read(4 * KEY_BYTES).decode("ascii", errors="replace")
    except OSError as error:
        raise IntegrityError(f"cannot read the job's key file {path}: {error.strerror}") from None
    return key_from_text(text, where=f"the job's key file {path}")


def parse_key(text: str) -> bytes | None:
    """A key from its hex form (as the environment and key files hold it), or None if ``text`` is not one."""
    try:
        key = bytes.fromhex(text.strip())
    except ValueError:
        return None
    return key if len(key) == KEY_BYTES else None


__all__ = ["JOB", "KEY_BYTES", "KEY_ENV", "KEY_FILE_ENV", "SESSION", "JobKey", "derived_key", "job_key", "key_from_environment", "key_from_file", "key_from_text", "new_key", "parse_key"]
