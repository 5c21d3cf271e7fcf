"""Signed records: what crosses storage carries an HMAC-SHA256 under the job's key.

Storage is not trusted. Every pickle that crosses it (the cell's payload, the
hosts' result payloads) and every record that steers a host or the client
(``plan.json``, ``handle.json``) is stored as its exact bytes followed by one
fixed-size trailer line::

    <body>\\n#kinetic-mac-v2:<64 hex digits>\\n

The MAC (HMAC-SHA256 over fixed blocks, bound in order by a final HMAC; see
``_BlockMac``) covers a domain tag, the object's name, its length and every
byte, under a key bound to the job's kind and id (``runner.job_keys``), so a record
that is genuine for one object, one job or one session cannot be moved onto
another.

Objects signed by an older kinetic_nb (``#kinetic-hmac-sha256:`` trailers,
whose MAC did not bind the job) are refused in one line: nothing of them is read.

A reader verifies before it unpickles or acts: streaming, in one pass over the
object (a copy to a temporary file only when the object cannot be re-read),
never holding the value twice. A writer computes the MAC in the same pass
that writes the bytes.

Host-safe: the standard library, cloudpickle and storage only.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import hmac
import io
import os
import tempfile
import threading
from typing import IO, Any

import cloudpickle

from kinetic_nb.errors import IntegrityError, ObjectTooLargeError
from kinetic_nb.runner.protocol.limits import record_limit
from kinetic_nb.storage import Storage

#: Bound into every MAC: a MAC made for anything else never verifies here.
_DOMAIN = b"kinetic-nb/envelope/v2\0"
TRAILER_PREFIX = b"\n#kinetic-mac-v2:"
TRAILER_BYTES = len(TRAILER_PREFIX) + 64 + 1
#: The trailer of kinetic_nb's first signed format, whose key was not bound to the job: recognised, to be refused.
OLD_TRAILER_PREFIX = b"\n#kinetic-hmac-sha256:"
OLD_TRAILER_BYTES = len(OLD_TRAILER_PREFIX) + 64 + 1
#: Read in pieces this large: big enough for few system calls, small enough to hold.
_CHUNK_BYTES = 8 * 1024 * 1024
#: The MAC's block: each is hashed on its own, in parallel; the object's tag binds them in order.
BLOCK_BYTES = 8 * 1024 * 1024
#: A block smaller than this is hashed in place: a hand-off to a thread would cost more than it hides.
_PARALLEL_BYTES = 1 << 20
#: Blocks being hashed at once while a stream is read or written.
_IN_FLIGHT = 4
#: A pickle up to this size is spooled in memory before it is stored; a larger one goes through a temporary file.
SPOOL_IN_MEMORY_BYTES = 1024 * 1024


class _BlockMac:
    """HMAC-SHA256 over an object in fixed blocks, hashed on worker threads while the caller does its I/O.

    Each block's tag is an HMAC of the domain, the object's name, the block's
    index and its bytes; the object's tag is an HMAC of the domain, the name,
    the total length and every block tag in order. So every byte, the order
    and the length are bound, and blocks hash in parallel (``hashlib``
    releases the GIL): with two cores, verifying costs about half a pass.
    A view handed to :meth:`update` must stay unchanged until :meth:`wait`.
    """

    def __init__(self, key: bytes, name: str, *, bounded: bool = True):
        self._key = key
        self._prefix = _DOMAIN + name.encode() + b"\0"
        self._partial = bytearray()
        self._tags: list[concurrent.futures.Future[bytes] | bytes] = []
        self.length = 0
        #: At most _IN_FLIGHT blocks wait to be hashed, when each holds memory of its own (a stream's pieces);
        #: a pickler's blocks are views of the object being pickled, held anyway, so any number may wait.
        self._bounded = bounded

    def _block_tag(self, index: int, data: Any) -> bytes:
        mac = hmac.new(self._key, self._prefix + index.to_bytes(8, "big"), hashlib.sha256)
        mac.update(data)
        return mac.digest()

    def _submit(self, data: Any) -> None:
        index = len(self._tags)
        if len(data) < _PARALLEL_BYTES:
            self._tags.append(self._block_tag(index, data))
        else:
            self._tags.append(_pool().submit(self._block_tag, index, data))
            if self._bounded:  # looked at only when bounded: a long unbounded stream would rescan every block
                pending = [tag for tag in self._tags[-(_IN_FLIGHT + 1):]
                           if isinstance(tag, concurrent.futures.Future) and not tag.done()]
                if len(pending) > _IN_FLIGHT:
                    pending[0].result()

    def update(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        self.length += len(view)
        if self._partial:
            take = min(len(view), BLOCK_BYTES - len(self._partial))
            self._partial += view[:take]
            view = view[take:]
            if len(self._partial) == BLOCK_BYTES:
                self._submit(bytes(self._partial))
                self._partial = bytearray()
        while len(view) >= BLOCK_BYTES:
            self._submit(view[:BLOCK_BYTES])
            view = view[BLOCK_BYTES:]
        self._partial += view

    def update_from_file(self, fd: int, start: int, length: int) -> None:
        """Hash ``length`` bytes of the file ``fd`` from ``start`` (the first bytes this MAC sees).

        Each block is read and hashed by one worker thread, a piece at a time
        into that thread's own small buffer: the reads and the hashing of
        different blocks run side by side, nothing block-sized is held, and the
        buffer stays in the processor's cache between its read and its hash.
        """
        if self.length or self._partial:
            raise ValueError("update_from_file must come first")

        def block_tag(index: int) -> bytes:
            mac = hmac.new(self._key, self._prefix + index.to_bytes(8, "big"), hashlib.sha256)
            buffer = _read_buffer()
            offset, end = index * BLOCK_BYTES, min(length, (index + 1) * BLOCK_BYTES)
            while offset < end:
                count = os.preadv(fd, [buffer[: end - offset]], start + offset)
                if not count:
                    raise IntegrityError("the object ended while it was being verified")
                mac.update(buffer[:count])
                offset += count
            return mac.digest()

        if 0 < length < _PARALLEL_BYTES:  # a record, a trivial cell's payload or value: no thread earns its handoff
            self._tags.append(block_tag(0))
        else:
            self._tags.extend(_pool().map(block_tag, range(-(-length // BLOCK_BYTES))))
        self.length = length

    def wait(self) -> None:
        """Every block handed over so far has been hashed: the caller may reuse its buffers."""
        self._tags = [tag.result() if isinstance(tag, concurrent.futures.Future) else tag for tag in self._tags]

    def trailer(self) -> bytes:
        if self._partial:
            self._submit(bytes(self._partial))
            self._partial = bytearray()
        self.wait()
        mac = hmac.new(self._key, self._prefix + b"final\0" + self.length.to_bytes(8, "big"), hashlib.sha256)
        for tag in self._tags:
            mac.update(tag)
        return TRAILER_PREFIX + mac.hexdigest().encode() + b"\n"


_pool_instance: concurrent.futures.ThreadPoolExecutor | None = None
_thread_state = threading.local()
#: Each hashing thread reads a file's blocks in pieces this large: small enough to stay in cache.
_READ_BYTES = 1024 * 1024


def _read_buffer() -> memoryview:
    """This thread's own read buffer, made once."""
    buffer = getattr(_thread_state, "buffer", None)
    if buffer is None:
        buffer = _thread_state.buffer = memoryview(bytearray(_READ_BYTES))
    return buffer


def _forget_the_pool() -> None:
    """In a forked child: the parent's hashing threads are not there, so a pool that thinks it has them would
    never run a block (every verify of a file would hang); the child makes its own on first use."""
    global _pool_instance
    _pool_instance = None


os.register_at_fork(after_in_child=_forget_the_pool)


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    global _pool_instance
    if _pool_instance is None:
        _pool_instance = concurrent.futures.ThreadPoolExecutor(max_workers=max(2, min(8, os.cpu_count() or 2)),
                                                               thread_name_prefix="kinetic-mac")
    return _pool_instance


def _trailer_of(key: bytes, name: str, body: Any) -> bytes:
    mac = _BlockMac(key, name)
    mac.update(body)
    return mac.trailer()


def seal(key: bytes, name: str, body: bytes) -> bytes:
    """``body`` with its trailer, for the object called ``name``."""
    return body + _trailer_of(key, name, body)


def is_sealed(data: bytes) -> bool:
    """Whether ``data`` ends in a trailer (it may still fail verification)."""
    return len(data) >= TRAILER_BYTES and data[-TRAILER_BYTES:].startswith(TRAILER_PREFIX)


def _unsigned_error(tail: bytes, where: str) -> IntegrityError:
    """Why an object whose last bytes are ``tail`` carries no signature of this format, in one line."""
    if len(tail) >= OLD_TRAILER_BYTES and tail[-OLD_TRAILER_BYTES:].startswith(OLD_TRAILER_PREFIX):
        return IntegrityError(f"{where} is signed in kinetic_nb's old format, which did not bind the signature "
                              "to its job: it is refused, not read")
    return IntegrityError(f"{where} carries no signature: it was not written by this job's hosts")


def unseal(key: bytes, name: str, data: bytes, *, where: str) -> bytes:
    """The body of ``data`` once its trailer verifies; ``IntegrityError`` naming ``where`` otherwise."""
    if not is_sealed(data):
        raise _unsigned_error(data[-OLD_TRAILER_BYTES:], where)
    body, trailer = data[:-TRAILER_BYTES], data[-TRAILER_BYTES:]
    if not hmac.compare_digest(trailer, _trailer_of(key, name, body)):
        raise IntegrityError(f"{where} failed verification: it was not written by this job's hosts")
    return body


class SealingWriter(io.RawIOBase):
    """A binary file for a pickler: writes go on to ``file`` and are MACed in the same pass.

    A large buffer a pickler hands over is the pickled object's own memory,
    unchanged while it is pickled, so its blocks go on hashing after ``write``
    returns (a pickler's own, reused buffer is small and is copied). The
    object to store is then :meth:`stored`: the body copies out while its
    last blocks hash, and the trailer follows once they are done. Or
    :meth:`finish` appends the trailer to ``file`` in place.
    """

    def __init__(self, file: IO[bytes], key: bytes, name: str):
        self._file = file
        self._mac = _BlockMac(key, name, bounded=False)
        self._trailer: bytes | None = None

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        start = 0
        while start < len(view):
            # Cut at the MAC's block boundaries, so a block is handed over whole (never copied) and is
            # hashed on a worker thread while this thread writes the same bytes.
            piece = view[start:start + BLOCK_BYTES - self._mac.length % BLOCK_BYTES]
            self._mac.update(piece)
            self._file.write(piece)
            start += len(piece)
        return len(view)

    def trailer(self) -> bytes:
        """The trailer line, once every block written so far is hashed."""
        if self._trailer is None:
            self._trailer = self._mac.trailer()
        return self._trailer

    def finish(self) -> None:
        self._file.write(self.trailer())

    def stored(self) -> IO[bytes]:
        """``file`` from its start, then the trailer: a readable, seekable stream to hand to storage."""
        # Buffered: a reader asking for n bytes gets n (the body's end is no short read), and can seek.
        return io.BufferedReader(_BodyThenTrailer(self._file, self))


class _BodyThenTrailer(io.RawIOBase):
    """A sealed object as one stream: a spooled body, then its trailer (asked for when the body is read)."""

    def __init__(self, body: IO[bytes], writer: SealingWriter):
        self._body = body
        self._writer = writer
        self._body_size = body.seek(0, io.SEEK_END)
        self._position = 0
        body.seek(0)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._body_size + TRAILER_BYTES}[whence]
        self._position = max(0, base + offset)
        self._body.seek(min(self._position, self._body_size))
        return self._position

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        if self._position < self._body_size:
            count = self._body.readinto(view[: self._body_size - self._position])
        else:
            tail = self._writer.trailer()[self._position - self._body_size:][: len(view)]
            view[: len(tail)] = tail
            count = len(tail)
        self._position += count
        return count


def verify_file(key: bytes, name: str, file: IO[bytes], *, where: str, copy_to: IO[bytes] | None = None) -> int:
    """Read ``file`` to its end, check its trailer, and return the body's length.

    With ``copy_to``, the bytes are also written there in the same pass (a
    stream that cannot be read twice is verified into a temporary file).
    """
    mac = _BlockMac(key, name)
    size = _size(file) if copy_to is None else None
    fd = _descriptor(file) if size is not None else None
    if fd is not None:  # an OS file: its blocks are read and hashed on worker threads, side by side
        start = file.tell()
        mac.update_from_file(fd, start, max(0, size - start - TRAILER_BYTES))
        file.seek(start + mac.length)
        held = file.read(TRAILER_BYTES)
    elif size is not None:  # a file: read the body in whole blocks, so none is copied to realign it
        remaining = max(0, size - file.tell() - TRAILER_BYTES)
        while remaining:
            chunk = file.read(min(BLOCK_BYTES, remaining))  # read while earlier blocks are being hashed
            if not chunk:
                break
            mac.update(chunk)
            remaining -= len(chunk)
        held = file.read(TRAILER_BYTES)
    else:
        held = _verify_stream(mac, file, copy_to)
    expected = mac.trailer()
    if not held.startswith(TRAILER_PREFIX) or len(held) != TRAILER_BYTES:
        raise _unsigned_error(_last_bytes(file, OLD_TRAILER_BYTES, held), where)
    if not hmac.compare_digest(held, expected):
        raise IntegrityError(f"{where} failed verification: it was not written by this job's hosts")
    return mac.length


def _last_bytes(file: IO[bytes], count: int, held: bytes) -> bytes:
    """The last ``count`` bytes of ``file`` where it can seek back to them, else the ``held`` tail."""
    try:
        end = file.seek(0, io.SEEK_END)
        file.seek(max(0, end - count))
        return file.read(count)
    except (AttributeError, OSError, ValueError):
        return held


def _descriptor(file: IO[bytes]) -> int | None:
    try:
        return file.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError
        return None


def _verify_stream(mac: _BlockMac, file: IO[bytes], copy_to: IO[bytes] | None) -> bytes:
    """Feed a one-pass stream to ``mac``, all but its last TRAILER_BYTES bytes, which are returned."""
    held = b""  # the last TRAILER_BYTES bytes seen: the trailer, once the end is reached
    while True:
        chunk = file.read(_CHUNK_BYTES)
        if not chunk:
            return held
        if copy_to is not None:
            copy_to.write(chunk)
        if len(chunk) >= TRAILER_BYTES:  # the usual case: no copy of the chunk
            mac.update(held)
            mac.update(memoryview(chunk)[:-TRAILER_BYTES])
            held = chunk[-TRAILER_BYTES:]
            continue
        data = held + chunk
        cut = max(0, len(data) - TRAILER_BYTES)
        mac.update(data[:cut])
        held = data[cut:]


def _size(file: IO[bytes]) -> int | None:
    """The size of a seekable file (its position kept), else None."""
    if not _seekable(file):
        return None
    here = file.tell()
    size = file.seek(0, io.SEEK_END)
    file.seek(here)
    return size


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


def read_limited(storage: Storage, name: str, *, max_bytes: int | None = None, listed_size: int | None = None
                 ) -> bytes:
    """The stored bytes of ``name``, reading at most its limit: the one way a record is read before it verifies.

    Parameters
    ----------
    storage : Storage
        Where ``name`` is.
    name : str
        The object's name; its kind's limit is ``protocol.limits.record_limit(name)``.
    max_bytes : int, optional
        The most bytes to read, in place of the kind's limit (a reader with a bound of its own).
    listed_size : int, optional
        The object's size in a listing just made: over the limit, it is refused without a request.

    Raises
    ------
    IntegrityError
        The object is over its limit: refused as a record that does not verify is, nothing of it read.
    ObjectNotFoundError
        There is no such object.
    """
    where = f"{storage.uri}/{name}"
    kind, limit = ("object", max_bytes) if max_bytes is not None else record_limit(name) or ("object", None)
    if limit is None:
        return storage.read_bytes(name)
    if listed_size is not None and listed_size > limit:
        raise IntegrityError(f"{where} is {listed_size} bytes, over its limit of {limit} ({kind}): refused, not read")
    try:
        return storage.read_bounded(name, limit)
    except ObjectTooLargeError as error:
        raise IntegrityError(f"{where} is over its limit of {limit} bytes ({kind}): refused, not read") from error


def read_sealed(storage: Storage, name: str, key: bytes, *, max_bytes: int | None = None) -> bytes:
    """The verified body of ``name``, read up to its kind's limit (or ``max_bytes``); ``IntegrityError`` when it is
    over that or does not verify, ``ObjectNotFoundError`` if absent."""
    return unseal(key, name, read_limited(storage, name, max_bytes=max_bytes), where=f"{storage.uri}/{name}")


def spool() -> IO[bytes]:
    """Where a pickle waits to be stored: memory while it is small (most cells' values), a temporary file
    once it is not, so a large value is never held twice (the object and its bytes)."""
    return tempfile.SpooledTemporaryFile(max_size=SPOOL_IN_MEMORY_BYTES)  # type: ignore[return-value]


def dump_sealed(storage: Storage, name: str, key: bytes, value: Any, *, exclusive: bool = False) -> None:
    """Pickle ``value`` into ``name``, MACed in the same pass, streamed through :func:`spool`."""
    with spool() as spool_file:
        writer = SealingWriter(spool_file, key, name)
        cloudpickle.dump(value, writer)
        storage.write_file(name, writer.stored(), exclusive=exclusive)


def load_sealed(storage: Storage, name: str, key: bytes) -> Any:
    """Verify ``name``, then unpickle it; nothing is unpickled from an object that does not verify.

    A seekable object (a local file) is read twice, once to verify and once
    to unpickle; a stream (a download) is verified into a temporary file in
    its one pass. Either way the value is never held twice.
    """
    with storage.open_read(name) as file:
        return load_sealed_file(file, name, key, where=f"{storage.uri}/{name}")


def load_sealed_file(file: IO[bytes], name: str, key: bytes, *, where: str) -> Any:
    """:func:`load_sealed` of an object already open (a host that looked for it by opening it)."""
    if _seekable(file):
        length = verify_file(key, name, file, where=where)
        file.seek(0)
        return cloudpickle.load(_Body(file, length))
    with tempfile.TemporaryFile() as spool:
        length = verify_file(key, name, file, where=where, copy_to=spool)
        spool.seek(0)
        return cloudpickle.load(_Body(spool, length))


def load_payload(storage: Storage, name: str, key: bytes | None) -> Any:
    """:func:`load_sealed` under ``key``; with ``key=None`` (a job from before signing, which its own user
    chose to trust) the object is unpickled as it is, unless it carries a signature of either format."""
    if key is not None:
        return load_sealed(storage, name, key)
    return cloudpickle.loads(read_unsigned(storage, name))


def _seekable(file: IO[bytes]) -> bool:
    try:
        return bool(file.seekable())
    except (AttributeError, OSError, ValueError):
        return False


def read_unsigned_bytes(data: bytes, *, where: str) -> bytes:
    """``data`` of an object from before signing existed (its user opted in to trusting it); one that carries a
    signature is refused: a signed object is read only under its key, and the old format not at all."""
    if is_sealed(data):
        raise IntegrityError(f"{where} is signed: it is read only under its job's key")
    tail = data[-OLD_TRAILER_BYTES:]
    if tail.startswith(OLD_TRAILER_PREFIX) and len(tail) == OLD_TRAILER_BYTES:
        raise _unsigned_error(tail, where)
    return data


def read_unsigned(storage: Storage, name: str) -> bytes:
    """The bytes of an object from before signing existed (its user opted in to trusting it)."""
    return read_unsigned_bytes(storage.read_bytes(name), where=f"{storage.uri}/{name}")


__all__ = ["SealingWriter", "dump_sealed", "is_sealed", "load_sealed", "read_limited", "read_sealed", "read_unsigned", "seal",
           "unseal", "verify_file", "write_sealed"]
