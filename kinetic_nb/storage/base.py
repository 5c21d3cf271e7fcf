"""The small interface every storage implements, and the URI dispatch.

Host-safe: the standard library only. A storage is rooted at a URI (a job's
directory, or the root that holds many jobs); object names are relative,
``/``-separated paths below it.
"""

from __future__ import annotations

import abc
import dataclasses
import json
from typing import Any


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

    def local_path(self, name: str = "") -> str | None:
        """A local filesystem path for ``name``, when the storage has one."""
        return None

    def exists(self, name: str) -> bool:
        return any(info.name == name for info in self.list(name))

    def write_json(self, name: str, record: Any, *, exclusive: bool = False) -> None:
        self.write_bytes(name, json.dumps(record, sort_keys=True).encode(), exclusive=exclusive)

    def read_json(self, name: str) -> Any:
        return json.loads(self.read_bytes(name))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"


def open_storage(uri: str) -> Storage:
    """The storage for ``uri``: ``file://`` or a plain path; ``gs://`` once supported."""
    from kinetic_nb.storage.local import LocalStorage

    if uri.startswith("file://") or "://" not in uri:
        return LocalStorage(uri)
    scheme = uri.split("://", 1)[0]
    raise ValueError(f"unsupported storage URI {uri!r}: scheme {scheme}:// is not supported (use file://)")
