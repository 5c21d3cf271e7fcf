"""The notebook's folder on hosts that do not share its disk: its modules and small files, as the notebook
packed them (``shipping.workdir``), unpacked into a directory of the host's own that becomes its working
directory and comes first on ``sys.path``, so ``import mylib`` and ``open("config.yaml")`` work there as they
do in the notebook.

The archive is encrypted under a key derived from the job's key (``runner.encryption``), then sealed like every
record, so a bucket reader learns its size only. A host reads it only when its listed size is one a folder
within the caps can make, verifies, decrypts, and unpacks it counting the bytes it actually inflates (a zip's
declared sizes can lie): a member over :data:`MAX_FILE_BYTES`, more than :data:`MAX_TOTAL_BYTES` in all, more
than :data:`MAX_FILES` members, or a path outside the directory is refused in one line, with nothing left on
disk. The copy lies below the agent's scratch directory (:data:`SCRATCH_DIR_ENV`), which the agent removes
when it ends, so a host that ends, is stopped, or is killed leaves no copy behind.

Host-safe: the standard library and ``cryptography`` (through ``runner.encryption``).
"""

from __future__ import annotations

import atexit
import io
import os
import shutil
import sys
import tempfile
import zipfile
import zlib

from kinetic_nb.errors import ObjectNotFoundError, PlanError
from kinetic_nb.runner import encryption, envelope
from kinetic_nb.storage import Storage

__all__ = ["ENCRYPTION_PURPOSE", "MAX_FILES", "MAX_FILE_BYTES", "MAX_STORED_BYTES", "MAX_TOTAL_BYTES",
           "SCRATCH_DIR_ENV", "enter_workdir", "store_workdir"]

#: A file larger than this stays behind (data belongs in storage the hosts read, not in the folder shipped);
#: a host refuses a member that inflates past it.
MAX_FILE_BYTES = 10 << 20
#: The most a folder may ship in all, in bytes and in files; a host refuses an archive that inflates past them.
MAX_TOTAL_BYTES = 64 << 20
MAX_FILES = 5000
#: What the folder's archive is encrypted for (the key derived from the job's for this purpose only).
ENCRYPTION_PURPOSE = "workdir"
#: Set by the host's agent: the directory (its scratch, removed when the agent ends) the copy is unpacked in.
SCRATCH_DIR_ENV = "KINETIC_SCRATCH_DIR"
#: The longest relative path a member can have (Linux's PATH_MAX).
_PATH_MAX = 4096
#: A member's fixed costs: its local header (30 bytes), its central directory entry (46), deflate's own bound
#: per stream, and slack.
_MEMBER_OVERHEAD = 30 + 46 + 64
#: The zip's end record, with room for its 64-bit form.
_END_BYTES = 22 + 56 + 20
#: The largest stored archive a folder within the caps makes: every byte deflated at worst (deflate stays within
#: 1/1000 of its input), every member's two headers with the longest path, the end record, the encryption and
#: the seal. Anything listed larger was not made by kinetic_nb, and is refused before a byte of it is read.
MAX_STORED_BYTES = (MAX_TOTAL_BYTES + MAX_TOTAL_BYTES // 1000 + MAX_FILES * (_MEMBER_OVERHEAD + 2 * _PATH_MAX)
                    + _END_BYTES + encryption.OVERHEAD_BYTES + envelope.TRAILER_BYTES)
#: Members are inflated in pieces this large, each counted before it is written.
_CHUNK_BYTES = 1 << 20


def store_workdir(storage: Storage, name: str, key: bytes, archive: bytes) -> None:
    """Store the folder's ``archive`` as ``name``: encrypted under ``key``, then sealed, written once."""
    encrypted = encryption.encrypt(key, ENCRYPTION_PURPOSE, name, archive)
    envelope.write_sealed(storage, name, key, encrypted, exclusive=True)


def enter_workdir(storage: Storage, key: bytes, name: str, job_id: str) -> str:
    """Unpack the archive ``name`` into a new directory, make it the working directory and put it first on
    ``sys.path``; the directory.

    Raises
    ------
    IntegrityError
        The archive was not stored, or not encrypted, by this job's notebook, or the stored object is larger than
        any folder within the caps makes (refused before any of it is read).
    PlanError
        One line: the archive inflates past a cap or names a path outside the directory (never written by
        kinetic_nb's own packing).
    """
    archive = encryption.decrypt(key, ENCRYPTION_PURPOSE, name, _read_bounded(storage, name, key))
    directory = _new_directory(job_id)
    try:
        _unpack(archive, directory)
    except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError, RuntimeError) as error:
        shutil.rmtree(directory, ignore_errors=True)
        raise PlanError(f"the notebook's folder is not an archive kinetic_nb makes ({error}): refused") from None
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    os.chdir(directory)
    sys.path.insert(0, directory)
    return directory


def _read_bounded(storage: Storage, name: str, key: bytes) -> bytes:
    """The verified body of ``name``, read only when its listed size is within :data:`MAX_STORED_BYTES` (a
    planted giant is refused without a request for its bytes), and never more than that even if it grew since."""
    listed = next((info for info in storage.list(name) if info.name == name), None)
    if listed is None:
        raise ObjectNotFoundError(f"{storage.uri}/{name} does not exist")
    data = envelope.read_limited(storage, name, max_bytes=MAX_STORED_BYTES, listed_size=listed.size)
    return envelope.unseal(key, name, data, where=f"{storage.uri}/{name}")


def _new_directory(job_id: str) -> str:
    """A fresh 0700 directory below the agent's scratch; without an agent (a host run by hand), one below the
    system's temporary directory, removed when this process exits."""
    scratch = os.environ.get(SCRATCH_DIR_ENV)
    if scratch and os.path.isdir(scratch):
        return os.path.realpath(tempfile.mkdtemp(prefix="workdir-", dir=scratch))
    directory = os.path.realpath(tempfile.mkdtemp(prefix=f"kinetic-{job_id}-workdir-"))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return directory


def _unpack(archive: bytes, root: str) -> None:
    """Write ``archive``'s members below ``root``, counting what each actually inflates to."""
    with zipfile.ZipFile(io.BytesIO(archive)) as opened:
        members = opened.infolist()
        if len(members) > MAX_FILES:
            raise PlanError(f"the notebook's folder holds {len(members)} files, more than {MAX_FILES}: refused")
        total = 0
        for member in members:
            target = _target(root, member.filename)
            if member.is_dir():
                os.makedirs(target, mode=0o700, exist_ok=True)
                continue
            os.makedirs(os.path.dirname(target), mode=0o700, exist_ok=True)
            mode = 0o700 if (member.external_attr >> 16) & 0o100 else 0o600
            written = 0
            with opened.open(member) as source, \
                    open(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode), "wb") as out:
                while chunk := source.read(_CHUNK_BYTES):
                    written += len(chunk)
                    total += len(chunk)
                    if written > MAX_FILE_BYTES:
                        raise PlanError(f"the notebook's folder holds {member.filename!r}, which inflates past "
                                        f"{MAX_FILE_BYTES} bytes: refused")
                    if total > MAX_TOTAL_BYTES:
                        raise PlanError(f"the notebook's folder inflates past {MAX_TOTAL_BYTES} bytes: refused")
                    out.write(chunk)


def _target(root: str, filename: str) -> str:
    """Where member ``filename`` goes: below ``root``, or refused."""
    target = os.path.normpath(os.path.join(root, filename))
    if os.path.isabs(filename) or not target.startswith(root + os.sep):
        raise PlanError(f"the notebook's folder names {filename!r}, outside the folder: refused")
    return target
