"""Signed records: what crosses storage carries an HMAC-SHA256 under the job's key.

Storage is not trusted. Every pickle that crosses it (the cell's payload, the
hosts' result payloads) and every record that steers a host or the client
(``plan.json``, ``handle.json``) is stored as its exact bytes followed by one
fixed-size trailer line::

    <body>\\n#kinetic-hmac-sha256:<64 hex digits>\\n

The MAC covers a domain tag, the object's name and the body, so a record that
is genuine for one object cannot be moved onto another. The key is 32 random
bytes per job that never enter storage: the client keeps it in a 0600 file,
the hosts get it in their environment (:data:`KEY_ENV`), which the runner
empties before user code runs.

A reader verifies before it unpickles or acts: streaming, in one pass over the
object (a copy to a temporary file only when the object cannot be re-read),
never holding the value twice. A writer computes the MAC in the same pass
that writes the bytes.

Host-safe: the standard library, cloudpickle and storage only.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import os
import secrets
import tempfile
import threading
from typing import IO, Any

import cloudpickle

from kinetic_nb.errors import IntegrityError
from kinetic_nb.storage import Storage

#: The environment variable that carries a job's key (hex) to its agent and hosts.
KEY_ENV = "KINETIC_JOB_KEY"
#: 256 bits: HMAC-SHA256's own strength.
KEY_BYTES = 32
#: Bound into every MAC: a MAC made for anything else never verifies here.
_DOMAIN = b"kinetic-nb/envelope/v1\0"
TRAILER_PREFIX = b"\n#kinetic-hmac-sha256:"
TRAILER_BYTES = len(TRAILER_PREFIX) + 64 + 1
#: Read and hash in pieces this large: big enough for few system calls, small enough to hold.
_CHUNK_BYTES = 4 * 1024 * 1024


def new_key() -> bytes:
    """A fresh random key for one job (or session)."""
    return secrets.token_bytes(KEY_BYTES)


def derived_key(key: bytes, purpose: str) -> bytes:
    """A key for one part of a job (a session's cell: ``"cells/000003"``), so its records cannot be
    replayed onto another part under the same names."""
    return hmac.new(key, b"kinetic-nb/derive\0" + purpose.encode(), hashlib.sha256).digest()


def key_from_environment(environ: dict[str, str] | os._Environ = os.environ, *, remove: bool = True) -> bytes | None:
    """The job's key from :data:`KEY_ENV` (removed from ``environ`` by default), or None when there is none."""
    raw = environ.pop(KEY_ENV, None) if remove else environ.get(KEY_ENV)
    if not raw:
        return None
    try:
        key = bytes.fromhex(raw)
    except ValueError:
        raise IntegrityError(f"{KEY_ENV} is not a hex key") from None
    if len(key) != KEY_BYTES:
        raise IntegrityError(f"{KEY_ENV} holds {len(key)} bytes, not {KEY_BYTES}")
    return key


def _mac(key: bytes, name: str) -> hmac.HMAC:
    mac = hmac.new(key, _DOMAIN, hashlib.sha256)
    mac.update(name.encode() + b"\0")
    return mac


class _OverlappedMac:
    """An HMAC fed from a helper thread while the caller does its I/O, so hashing and I/O overlap.

    ``hashlib`` releases the GIL while it hashes a large buffer; a buffer
    handed to :meth:`update_async` must stay unchanged until :meth:`wait`.
    """

    #: Smaller buffers are hashed in place: a thread hand-off would cost more than it hides.
    ASYNC_BYTES = 1 << 20

    def __init__(self, mac: hmac.HMAC):
        self.mac = mac
        self._pending: threading.Thread | None = None

    def update_async(self, data: Any) -> None:
        self.wait()
        if len(data) < self.ASYNC_BYTES:
            self.mac.update(data)
            return
        self._pending = threading.Thread(target=self.mac.update, args=(data,), daemon=True)
        self._pending.start()

    def wait(self) -> None:
        if self._pending is not None:
            self._pending.join()
            self._pending = None

    def trailer(self) -> bytes:
        self.wait()
        return _trailer(self.mac)


def _trailer(mac: hmac.HMAC) -> bytes:
    return TRAILER_PREFIX + mac.hexdigest().encode() + b"\n"


def seal(key: bytes, name: str, body: bytes) -> bytes:
    """``body`` with its trailer, for the object called ``name``."""
    mac = _mac(key, name)
    mac.update(body)
    return body + _trailer(mac)


def is_sealed(data: bytes) -> bool:
    """Whether ``data`` ends in a trailer (it may still fail verification)."""
    return len(data) >= TRAILER_BYTES and data[-TRAILER_BYTES:].startswith(TRAILER_PREFIX)


def unseal(key: bytes, name: str, data: bytes, *, where: str) -> bytes:
    """The body of ``data`` once its trailer verifies; ``IntegrityError`` naming ``where`` otherwise."""
    if not is_sealed(data):
        raise IntegrityError(f"{where} carries no signature: it was not written by this job's hosts")
    body, trailer = data[:-TRAILER_BYTES], data[-TRAILER_BYTES:]
    mac = _mac(key, name)
    mac.update(body)
    if not hmac.compare_digest(trailer, _trailer(mac)):
        raise IntegrityError(f"{where} failed verification: it was not written by this job's hosts")
    return body


class SealingWriter(io.RawIOBase):
    """A binary file that passes writes on to ``file`` and MACs them in the same pass; ``finish`` adds the trailer."""

    def __init__(self, file: IO[bytes], key: bytes, name: str):
        self._file = file
        self._mac = _OverlappedMac(_mac(key, name))

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._mac.update_async(view)  # hashed while the same bytes are written
        self._file.write(view)
        self._mac.wait()  # the caller may reuse its buffer once write returns
        return len(view)

    def finish(self) -> None:
        self._file.write(self._mac.trailer())


def verify_file(key: bytes, name: str, file: IO[bytes], *, where: str, copy_to: IO[bytes] | None = None) -> int:
    """Read ``file`` to its end, check its trailer, and return the body's length.

    With ``copy_to``, the bytes are also written there in the same pass (a
    stream that cannot be read twice is verified into a temporary file).
    """
    mac = _OverlappedMac(_mac(key, name))
    held = b""  # the last TRAILER_BYTES bytes seen: the trailer, once the end is reached
    length = 0
    while True:
        chunk = file.read(_CHUNK_BYTES)  # read while the previous chunk is still being hashed
        if not chunk:
            break
        if copy_to is not None:
            copy_to.write(chunk)
        if len(chunk) >= TRAILER_BYTES:  # the usual case: no copy of the chunk
            mac.update_async(held)
            mac.update_async(memoryview(chunk)[:-TRAILER_BYTES])
            length += len(held) + len(chunk) - TRAILER_BYTES
            held = chunk[-TRAILER_BYTES:]
            continue
        mac.wait()
        data = held + chunk
        cut = max(0, len(data) - TRAILER_BYTES)
        mac.update_async(data[:cut])
        length += cut
        held = data[cut:]
    expected = mac.trailer()
    if not held.startswith(TRAILER_PREFIX) or len(held) != TRAILER_BYTES:
        raise IntegrityError(f"{where} carries no signature: it was not written by this job's hosts")
    if not hmac.compare_digest(held, expected):
        raise IntegrityError(f"{where} failed verification: it was not written by this job's hosts")
    return length


class _Body(io.RawIOBase):
    """The first ``length`` bytes of ``file`` from its current position: a verified body, without its trailer."""

    def __init__(self, file: IO[bytes], length: int):
        self._file = file
        self._left = length

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")[: self._left]
        if not view:
            return 0
        count = self._file.readinto(view) if hasattr(self._file, "readinto") else _read_into(self._file, view)
        self._left -= count
        return count


def _read_into(file: IO[bytes], view: memoryview) -> int:
    data = file.read(len(view))
    view[: len(data)] = data
    return len(data)


# -- storage ---------------------------------------------------------------------------------


def write_sealed(storage: Storage, name: str, key: bytes, body: bytes, *, exclusive: bool = False) -> None:
    storage.write_bytes(name, seal(key, name, body), exclusive=exclusive)


def read_sealed(storage: Storage, name: str, key: bytes) -> bytes:
    """The verified body of ``name``; ``IntegrityError`` when it does not verify, ``ObjectNotFoundError`` if absent."""
    return unseal(key, name, storage.read_bytes(name), where=f"{storage.uri}/{name}")


def dump_sealed(storage: Storage, name: str, key: bytes, value: Any, *, exclusive: bool = False) -> None:
    """Pickle ``value`` into ``name``, MACed in the same pass, streamed through a temporary file."""
    with tempfile.TemporaryFile() as spool:
        writer = SealingWriter(spool, key, name)
        cloudpickle.dump(value, writer)
        writer.finish()
        spool.seek(0)
        storage.write_file(name, spool, exclusive=exclusive)


def load_sealed(storage: Storage, name: str, key: bytes) -> Any:
    """Verify ``name``, then unpickle it; nothing is unpickled from an object that does not verify.

    A seekable object (a local file) is read twice, once to verify and once
    to unpickle; a stream (a download) is verified into a temporary file in
    its one pass. Either way the value is never held twice.
    """
    where = f"{storage.uri}/{name}"
    with storage.open_read(name) as file:
        if _seekable(file):
            length = verify_file(key, name, file, where=where)
            file.seek(0)
            return cloudpickle.load(_Body(file, length))
        with tempfile.TemporaryFile() as spool:
            length = verify_file(key, name, file, where=where, copy_to=spool)
            spool.seek(0)
            return cloudpickle.load(_Body(spool, length))


def load_payload(storage: Storage, name: str, key: bytes | None) -> Any:
    """:func:`load_sealed` under ``key``; with ``key=None`` (a job from before signing, which the caller
    chose to trust) the object is unpickled as it is."""
    if key is not None:
        return load_sealed(storage, name, key)
    with storage.open_read(name) as file:
        return cloudpickle.load(file)


def _seekable(file: IO[bytes]) -> bool:
    try:
        return bool(file.seekable())
    except (AttributeError, OSError, ValueError):
        return False


def read_unsigned(storage: Storage, name: str) -> bytes:
    """The body of an object from before signing existed (the caller opted in to trusting it)."""
    data = storage.read_bytes(name)
    return data[:-TRAILER_BYTES] if is_sealed(data) else data


__all__ = ["KEY_BYTES", "KEY_ENV", "SealingWriter", "dump_sealed",
           "is_sealed", "key_from_environment", "load_sealed", "new_key", "read_sealed", "read_unsigned", "seal",
           "unseal", "verify_file", "write_sealed"]
