"""The small interface every storage implements, and the URI dispatch.

Host-safe: the standard library only. A storage is rooted at a URI (a job's
directory, or the root that holds many jobs); object names are relative,
``/``-separated paths below it.
"""

from __future__ import annotations

import abc
import contextlib
import contextvars
import dataclasses
import io
import json
import os
from collections.abc import Iterable, Iterator
from typing import IO, Any

from kinetic_nb.errors import ObjectNotFoundError, ObjectTooLargeError

#: Set while a record that decides a job's outcome is stored: see :func:`patiently`.
_patient: contextvars.ContextVar[bool] = contextvars.ContextVar("kinetic_patient_storage", default=False)


@contextlib.contextmanager
def patiently() -> Iterator[None]:
    """Requests made inside (in this thread) ride out an outage for their storage's whole retry deadline from
    their own start, even after routine requests gave up on it: a record that decides a job's outcome (a host's
    exit, its result) outlives an outage a little longer than the deadline, where a heartbeat or a log chunk is
    tried once. The first such request that gives up ends that for the rest of the outage: a bucket that is gone
    costs one deadline, not one per record."""
    token = _patient.set(True)
    try:
        yield
    finally:
        _patient.reset(token)


def is_patient() -> bool:
    """Whether this thread's requests are made :func:`patiently` now."""
    return _patient.get()


@dataclasses.dataclass(frozen=True)
class ObjectInfo:
    """One object from a listing: its name below the root, size, version and time.

    ``version`` changes whenever the object is rewritten (mtime and size on
    ``file://``, the generation on ``gs://``), so a poller can skip reading an
    object it has already seen. ``updated`` is when it was last written, in
    seconds since the epoch: a heartbeat object's liveness, without a read.
    """

    name: str
    size: int
    version: str
    updated: float = 0.0


class Storage(abc.ABC):
    """Objects below one URI."""

    uri: str

    @abc.abstractmethod
    def child(self, name: str) -> Storage:
        """The storage rooted at ``{uri}/{name}``."""

    @abc.abstractmethod
    def write_bytes(self, name: str, data: bytes, *, exclusive: bool = False) -> None:
        """Write ``name`` atomically: readers see the old object or the whole new one.

        With ``exclusive``, fail with ``ObjectExistsError`` if ``name`` exists.
        """

    @abc.abstractmethod
    def read_bytes(self, name: str) -> bytes:
        """The object's bytes; ``ObjectNotFoundError`` if it does not exist."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Every object whose name starts with ``prefix``, sorted by name."""

    @abc.abstractmethod
    def delete(self, name: str) -> None:
        """Remove ``name``; ``ObjectNotFoundError`` if it does not exist."""

    def delete_many(self, names: Iterable[str]) -> None:
        """Remove each of ``names`` that exists (one at a time here; a disk opens each folder once)."""
        for name in names:
            with contextlib.suppress(ObjectNotFoundError):
                self.delete(name)

    def write_file(self, name: str, source: str | os.PathLike | IO[bytes], *, exclusive: bool = False) -> None:
        """Write ``name`` from a local file or a binary file object, atomically, as ``write_bytes`` does.

        Parameters
        ----------
        name : str
            The object's name below this storage's root.
        source : str, os.PathLike or binary file object
            A path, or a file object read from its current position to its end.
        exclusive : bool
            Fail with ``ObjectExistsError`` if ``name`` exists.

        Implementations stream the bytes (a resumable upload, a file copy), so
        a large value is never held in memory whole; this default reads it whole.
        """
        if isinstance(source, (str, os.PathLike)):
            with open(source, "rb") as file:
                data = file.read()
        else:
            data = source.read()
        self.write_bytes(name, data, exclusive=exclusive)

    def open_read(self, name: str) -> IO[bytes]:
        """A binary file object over ``name``'s bytes; ``ObjectNotFoundError`` at once if it does not exist.

        The caller closes it (``with storage.open_read(name) as file: ...``).
        Implementations stream: a read holds one chunk, not the whole object,
        and a reader sees one version of the object even if it is rewritten
        meanwhile (or fails loudly). This default reads the object whole.
        """
        return io.BytesIO(self.read_bytes(name))

    def read_bounded(self, name: str, max_bytes: int) -> bytes:
        """The object's bytes, reading at most ``max_bytes`` of them: what a reader that verifies afterwards uses.

        Parameters
        ----------
        name : str
            The object's name below this storage's root.
        max_bytes : int
            The most bytes the object may hold.

        Raises
        ------
        ObjectNotFoundError
            There is no such object.
        ObjectTooLargeError
            It holds more than ``max_bytes``: refused from its size where the storage knows it before reading
            (a local file, a listing), else after at most ``max_bytes + 1`` bytes were read.

        This default opens the object (:meth:`open_read`) and reads at most
        ``max_bytes + 1`` bytes; a local file's size is looked at first, so a
        larger one is not read at all.
        """
        with self.open_read(name) as file:
            size = _file_size(file)
            if size is not None and size > max_bytes:
                raise object_too_large(self, name, max_bytes, size)
            data = file.read(max_bytes + 1)
        if len(data) > max_bytes:
            raise object_too_large(self, name, max_bytes)
        return data

    def unreachable_for(self) -> float:
        """Seconds this storage has failed without answering; 0 while it answers (a local disk always does)."""
        return 0.0

    def local_path(self, name: str = "") -> str | None:
        """A local filesystem path for ``name``, when the storage has one."""
        return None

    def exists(self, name: str) -> bool:
        """Whether ``name`` exists (implementations ask for that one object, not a listing)."""
        return any(info.name == name for info in self.list(name))

    def write_json(self, name: str, record: Any, *, exclusive: bool = False) -> None:
        self.write_bytes(name, json.dumps(record, sort_keys=True).encode(), exclusive=exclusive)

    def read_json(self, name: str) -> Any:
        return json.loads(self.read_bytes(name))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"


def _file_size(file: IO[bytes]) -> int | None:
    """The size of an open OS file (from its descriptor, nothing read), else None."""
    try:
        return os.fstat(file.fileno()).st_size
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError
        return None


def object_too_large(storage: Storage, name: str, max_bytes: int, size: int | None = None) -> ObjectTooLargeError:
    """The one line that says ``name`` is over ``max_bytes`` (its ``size`` when known) and was not read."""
    held = f"{size} bytes, more than" if size is not None else "larger than"
    return ObjectTooLargeError(f"{storage.uri}/{name} is {held} the {max_bytes} bytes its reader allows: "
                               "it was not read")
