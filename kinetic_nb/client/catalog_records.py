"""Reading what a listing shows of a job or session, safely, from a root other users may write.

A shared root (a 0777 directory, a bucket others may write) can hold anything
under a job's name: a FIFO or a link to ``/dev/zero`` called ``handle.json``, a
gigabyte of zeros, a record whose fields have the wrong types or carry
newlines. A listing reads each record here: only a regular file, opened
without blocking or following a link, at most :data:`RECORD_MAX_BYTES`; it
checks every field it shows, and never prints a control character. What
fails is reported for that entry alone (:class:`~kinetic_nb.errors.StorageError`,
one line), never for the whole listing.
"""

from __future__ import annotations

import dataclasses
import errno
import math
import os
import re
import stat
import unicodedata
from typing import Any

from kinetic_nb.errors import ObjectNotFoundError, StorageError
from kinetic_nb.runner import protocol
from kinetic_nb.runner.protocol.limits import record_limit
from kinetic_nb.storage import Storage

__all__ = ["RECORD_MAX_BYTES", "ListedFields", "listed_fields", "listed_ids", "owned_here", "printable", "read_record_bytes"]

#: A handle or plan is a few hundred bytes (a few KiB with many ``-e`` names or backend options):
#: anything larger was not written by kinetic_nb, and reading it whole could take the kernel's memory.
#: The protocol's one table of limits says so (``runner.protocol.limits``); a listing reads no more.
RECORD_MAX_BYTES = max(record_limit(protocol.HANDLE)[1], record_limit(protocol.PLAN)[1])
#: The last time a listing can show as a date in any time zone (9999-12-31 00:00 UTC: ``datetime`` stops at
#: year 9999); a time past it, or before 1970, is not a submission time.
_LATEST_TIME_S = 253402214400.0
#: A cell's name in a listing (``In[12345]``): a longer one was not written by kinetic_nb, and is cut there.
CELL_CHARS = 32
#: What a control character (``unicodedata.category`` ``C*``: newlines, escapes, bidi overrides) or a line or
#: paragraph separator (``Zl``, ``Zp``: ``str.splitlines`` and terminals break lines there too) is shown as.
_REPLACEMENT = "?"
_UNPRINTED_CATEGORIES = ("C", "Zl", "Zp")
#: Opens a record without waiting on a FIFO or device, and without following a link planted in its place.
_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def printable(text: str) -> str:
    """``text`` with every control character replaced: what storage says can never draw a row of its own.

    Parameters
    ----------
    text : str
        A field read from storage.

    Returns
    -------
    str
        The same text, each character whose Unicode category starts with ``C`` (or is ``Zl``, ``Zp``)
        replaced by ``?``.
    """
    return "".join(_REPLACEMENT if unicodedata.category(char).startswith(_UNPRINTED_CATEGORIES) else char
                   for char in text)


def _read_local_file(path: str, where: str) -> bytes:
    try:
        descriptor = os.open(path, _OPEN_FLAGS)
    except (FileNotFoundError, NotADirectoryError):
        raise ObjectNotFoundError(f"{where} does not exist") from None
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise StorageError(f"{where} is a symbolic link, and a record is never read through one") from None
        raise StorageError(f"cannot read {where}: {error.strerror or error}") from None
    try:
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode):
            raise StorageError(f"{where} is not a regular file")
        if info.st_size > RECORD_MAX_BYTES:
            raise StorageError(f"{where} is {info.st_size} bytes, over the {RECORD_MAX_BYTES} a record may be")
        os.set_blocking(descriptor, True)
        chunks, left = [], RECORD_MAX_BYTES + 1
        while left > 0:  # a file that grows while it is read is still cut off at the cap
            chunk = os.read(descriptor, left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    except OSError as error:
        raise StorageError(f"cannot read {where}: {error.strerror or error}") from None
    finally:
        os.close(descriptor)
    data = b"".join(chunks)
    if len(data) > RECORD_MAX_BYTES:
        raise StorageError(f"{where} grew past the {RECORD_MAX_BYTES} bytes a record may be while it was read")
    return data


def read_record_bytes(storage: Storage, name: str, *, listed_size: int | None = None) -> bytes:
    """The bytes of a small record (``handle.json``, ``plan.json``), read so that nothing planted can hang
    or exhaust the reader.

    Parameters
    ----------
    storage : Storage
        The job's (or session's) storage.
    name : str
        The record's name below it.
    listed_size : int, optional
        Its size as a listing already gave it (Cloud Storage): an object over the cap is skipped unread.

    Returns
    -------
    bytes
        At most :data:`RECORD_MAX_BYTES` bytes.

    Raises
    ------
    ObjectNotFoundError
        There is no such record.
    StorageError
        It is not a regular file, is larger than :data:`RECORD_MAX_BYTES`, or cannot be read (one line).
    """
    where = f"{storage.uri}/{name}"
    local = storage.local_path(name)
    if local is not None:
        return _read_local_file(local, where)
    if listed_size is None:
        listed_size = next((info.size for info in storage.list(name) if info.name == name), None)
        if listed_size is None:
            raise ObjectNotFoundError(f"{where} does not exist")
    if listed_size > RECORD_MAX_BYTES:
        raise StorageError(f"{where} is {listed_size} bytes, over the {RECORD_MAX_BYTES} a record may be")
    return storage.read_bounded(name, RECORD_MAX_BYTES)  # one version, cut off past the cap (ObjectTooLargeError)


def owned_here(storage: Storage) -> bool | None:
    """Whether this user owns the job's directory: True or False on ``file://``, None where storage has no
    owners (``gs://``: anyone who may write to the bucket could have written it).

    Parameters
    ----------
    storage : Storage
        A job's or session's storage.

    Returns
    -------
    bool or None
        True only for a directory (not a link) whose owner is this process's effective user.
    """
    local = storage.local_path()
    if local is None:
        return None
    try:
        info = os.lstat(local)
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid()


@dataclasses.dataclass(frozen=True)
class ListedFields:
    """What a listing shows of a job's ``handle.json``, each field checked and printable."""

    backend: str
    hosts: int
    accelerator: str
    submitted_at: float
    status: str
    #: The cell as its notebook named it (``In[5]``); "" for a job from the API or from before it was recorded.
    cell: str = ""


def _text(record: dict, name: str, default: str) -> str:
    value = record.get(name, default)
    if not isinstance(value, str):
        raise StorageError(f"{name} is a {type(value).__name__}, not text")
    return printable(value)


def listed_fields(record: Any) -> ListedFields:
    """The fields of a decoded ``handle.json`` a listing shows, each checked.

    Parameters
    ----------
    record : Any
        What ``json.loads`` made of the handle.

    Returns
    -------
    ListedFields
        Text fields with control characters replaced; ``hosts`` a whole number from 0;
        ``submitted_at`` a finite time a date can show.

    Raises
    ------
    StorageError
        A field has the wrong type or is out of range (one line naming the field).
    """
    if not isinstance(record, dict):
        raise StorageError(f"the record is a JSON {type(record).__name__}, not an object")
    hosts = record.get("hosts", 0)
    if isinstance(hosts, bool) or not isinstance(hosts, int) or hosts < 0:
        raise StorageError(f"hosts is {printable(repr(hosts))[:40]}, not a whole number from 0")
    submitted_at = record.get("submitted_at", 0.0)
    if isinstance(submitted_at, bool) or not isinstance(submitted_at, (int, float)) or not (
            math.isfinite(submitted_at) and 0 <= submitted_at <= _LATEST_TIME_S):
        raise StorageError(f"submitted_at is {printable(repr(submitted_at))[:40]}, not a time a date can show")
    return ListedFields(_text(record, "backend", "local"), hosts, _text(record, "accelerator", ""),
                        float(submitted_at), _text(record, "status", ""), _text(record, "cell", "")[:CELL_CHARS])


def listed_ids(root: Storage, pattern: re.Pattern[str], record: str) -> list[tuple[str, int | None]]:
    """The entries below ``root`` whose whole name matches ``pattern``, newest first (ids sort by time),
    each with the size of its ``record`` where the listing gave it (Cloud Storage), else None.

    Parameters
    ----------
    root : Storage
        A storage root (jobs) or its ``sessions/`` directory.
    pattern : re.Pattern
        What an id looks like; matched whole (``fullmatch``), so ``"kn-...\\n"`` is not an id.
    record : str
        The object every entry holds (``handle.json``): on Cloud Storage, an entry is a prefix holding it.

    Returns
    -------
    list of (str, int or None)
        Ids, newest first, with the record's listed size.

    Raises
    ------
    StorageError
        The root itself cannot be listed (one line).
    """
    local = root.local_path()
    sizes: dict[str, int | None] = {}
    if local:
        try:
            sizes = dict.fromkeys(os.listdir(local))
        except FileNotFoundError:
            sizes = {}
        except OSError as error:
            raise StorageError(f"cannot list {root.uri}: {error.strerror or error}") from None
    else:
        for info in root.list():
            entry, _, rest = info.name.partition("/")
            if rest == record:
                sizes[entry] = info.size
    return sorted(((name, size) for name, size in sizes.items() if pattern.fullmatch(name)), reverse=True)
