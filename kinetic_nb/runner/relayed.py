"""Storage with a session's channel in front: what is written goes to the channel at once and to storage later;
what the channel carries is read from it.

While the channel is up, a write is sent to the hub (``runner.channel``) and
stored by a background writer that stores each name at most once a second
(a status rewritten ten times in a second is stored once, as it last was;
Cloud Storage refuses more than about one write a second to one object);
a read of a name the channel serves (a host: a cell's records; a notebook: a
cell's records and the hosts') comes from what the channel has carried, and
one it has not carried is absent, with no request; any other name comes from
the channel when it carried it, else from storage. The channel is used only
once the hosts' start verdict says every host joined it (:func:`hosts_agreed`). When the channel breaks, what waits to be stored is stored at
once and from then on the storage is the plain one: every record is in storage
within a second of being written, so a reader that falls back misses nothing.
Host-safe.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import IO

from kinetic_nb.errors import ChannelClosed, IntegrityError, ObjectExistsError, ObjectNotFoundError, StorageError
from kinetic_nb.runner import protocol
from kinetic_nb.runner.channel import STORED, Mirror, Stored
from kinetic_nb.runner.envelope import unseal
from kinetic_nb.runner.protocol import LeaderReady
from kinetic_nb.storage import ObjectInfo, Storage

logger = logging.getLogger(__name__)

__all__ = ["CARRY_MAX_BYTES", "Relay", "RelayedStorage", "WriteBehind", "hosts_agreed"]

#: An object larger than this is stored at once and the channel says only that it is there.
CARRY_MAX_BYTES = 8 << 20
#: The least time between two stores of one name: Cloud Storage allows about one write a second per object.
STORE_INTERVAL_S = 1.0
#: Stores in flight at once, per process: back-to-back cells bring several records a cell from each host.
WRITERS = 4


class WriteBehind:
    r"""Stores what it is given in the background (``WRITERS`` at a time), each name at most once per
    ``interval`` seconds, counted from the end of its last store to the start of the next (the latest bytes
    win); what it :meth:`hold`\ s it stores only when :meth:`flush`\ ed (a cell's barrier markers: storage needs
    them only if the channel breaks during the cell). :meth:`flush` stores everything waiting, now."""

    def __init__(self, storage: Storage, *, interval: float = STORE_INTERVAL_S,
                 on_error: Callable[[str, BaseException], None] | None = None):
        self._storage = storage
        self._interval = interval
        self._on_error = on_error
        self._waiting: dict[str, tuple[bytes, bool]] = {}  # name -> (data, exclusive)
        self._held: dict[str, tuple[bytes, bool]] = {}
        self._stored_at: dict[str, float] = {}  # name -> when its last store ended (monotonic)
        self._in_flight: set[str] = set()
        self._changed = threading.Condition()
        self._closed = False
        for number in range(WRITERS):
            threading.Thread(target=self._loop, name=f"kinetic-write-behind-{number}", daemon=True).start()

    def put(self, name: str, data: bytes, *, exclusive: bool = False) -> None:
        with self._changed:
            previous = self._waiting.get(name)
            self._waiting[name] = (data, exclusive or bool(previous and previous[1]))
            self._changed.notify_all()

    def hold(self, name: str, data: bytes, *, exclusive: bool = False) -> None:
        with self._changed:
            self._held[name] = (data, exclusive)

    def let_go(self, keep: Callable[[str], bool]) -> None:
        """Forget what is held but ``keep`` (the markers of cells every host has left behind)."""
        with self._changed:
            self._held = {name: entry for name, entry in self._held.items() if keep(name)}

    def _due_at(self, name: str) -> float:
        return self._stored_at.get(name, -self._interval) + self._interval

    def _loop(self) -> None:
        while True:
            with self._changed:
                while True:
                    if self._closed and not self._waiting:
                        return
                    now = time.monotonic()
                    ready = [name for name in self._waiting if name not in self._in_flight]
                    name = min(ready, key=self._due_at, default=None)
                    if name is not None and self._due_at(name) <= now:
                        break
                    wait = self._due_at(name) - now if name is not None else 60.0
                    self._changed.wait(max(wait, 0.001))
                data, exclusive = self._waiting.pop(name)
                self._in_flight.add(name)
            self._store([(name, data, exclusive)])

    def _store(self, batch: list[tuple[str, bytes, bool]]) -> None:
        for name, data, exclusive in batch:
            try:
                self._storage.write_bytes(name, data, exclusive=exclusive)
            except ObjectExistsError:
                pass  # stored already (an exclusive record is written once)
            except Exception as error:  # the channel carried it; the next write of the name stores it again
                if self._on_error is not None:
                    self._on_error(name, error)
                else:
                    logger.warning("could not store %s: %s", name, error,
                                   exc_info=not isinstance(error, StorageError))
            finally:
                with self._changed:
                    self._stored_at[name] = time.monotonic()
                    self._in_flight.discard(name)
                    self._changed.notify_all()

    def flush(self) -> None:
        """Store everything waiting or held now, and return once what was being stored is stored too."""
        with self._changed:
            batch = [(name, data, exclusive) for name, (data, exclusive) in {**self._held, **self._waiting}.items()]
            self._waiting.clear()
            self._held.clear()
            self._in_flight.update(name for name, _, _ in batch)
        self._store(batch)
        with self._changed:
            self._changed.wait_for(lambda: not self._in_flight, timeout=30)

    def close(self) -> None:
        self.flush()
        with self._changed:
            self._closed = True
            self._changed.notify_all()


class Relay:
    """What every :class:`RelayedStorage` of one process shares: the plain storage at the session's root, the
    channel's send and mirror, the writer behind, and which names the channel serves.

    ``send(name, data)`` passes a record on (a peer's ``Channel.send``, the hub's ``publish``); ``serves(name)``
    says whether a read of ``name`` is the channel's to answer; ``holds(name)`` whether a record of ``name`` is
    stored only if the channel breaks (a cell's barrier markers). Until :meth:`attach`, and after :meth:`fall_back`,
    it is plain storage.
    """

    def __init__(self, storage: Storage, serves: Callable[[str], bool], *,
                 holds: Callable[[str], bool] = lambda name: False,
                 on_error: Callable[[str, BaseException], None] | None = None):
        self.storage = storage
        self._serves = serves
        self._holds = holds
        self._on_error = on_error
        self.mirror: Mirror | None = None
        self._send: Callable[[str, bytes | Stored], None] | None = None
        self.behind: WriteBehind | None = None
        self.fell_back: str | None = None
        self._lock = threading.Lock()

    @property
    def up(self) -> bool:
        return self._send is not None

    def attach(self, send: Callable[[str, bytes | Stored], None], mirror: Mirror) -> None:
        with self._lock:
            if self.fell_back is not None:
                return  # gone back to storage already: for good
            self.mirror = mirror
            self._send = send

    def fall_back(self, reason: str) -> None:
        """The channel is gone: store what waits, now, and be plain storage from here on."""
        with self._lock:
            if self._send is None:
                return
            self._send = None
            self.fell_back = reason
        if self.behind is not None:
            self.behind.flush()
        if self.mirror is not None:
            self.mirror.wake()

    def close(self) -> None:
        if self.behind is not None:
            self.behind.close()

    def serves(self, name: str) -> bool:
        return self._send is not None and self._serves(name) and self.mirror.covers(name)

    def write(self, name: str, data: bytes, exclusive: bool) -> bool:
        """Send ``name`` and store it later; False when the channel is not up (the caller stores it)."""
        send, mirror = self._send, self.mirror
        if send is None or mirror is None:
            return False
        if exclusive and isinstance(mirror.get(name), bytes):
            raise ObjectExistsError(f"{self.storage.uri}/{name} exists")
        try:
            send(name, data)
        except ChannelClosed as error:
            self.fall_back(str(error))
            return False
        with self._lock:
            self.behind = self.behind or WriteBehind(self.storage, on_error=self._on_error)
        if self._holds(name):
            self.behind.hold(name, data, exclusive=exclusive)
        else:
            self.behind.put(name, data, exclusive=exclusive)
        return True

    def let_go(self, keep: Callable[[str], bool]) -> None:
        """Forget the held records but ``keep``: see :meth:`WriteBehind.let_go`."""
        if self.behind is not None:
            self.behind.let_go(keep)

    def stored(self, name: str) -> None:
        """``name`` was stored at once (too large to carry): the channel says so."""
        send = self._send
        if send is not None:
            with contextlib.suppress(ChannelClosed):
                send(name, STORED)


class RelayedStorage(Storage):
    """A :class:`Storage` below ``prefix`` of a :class:`Relay`'s root: the channel first, storage behind it."""

    def __init__(self, relay: Relay, prefix: str = ""):
        self.relay = relay
        self._prefix = prefix
        self._plain = relay.storage.child(prefix) if prefix else relay.storage
        self.uri = self._plain.uri

    def _full(self, name: str) -> str:
        return f"{self._prefix}/{name}" if self._prefix else name

    def child(self, name: str) -> RelayedStorage:
        return RelayedStorage(self.relay, self._full(name.strip("/")))

    @property
    def plain(self) -> Storage:
        """The same place without the channel."""
        return self._plain

    def unreachable_for(self) -> float:
        return self._plain.unreachable_for()

    def write_bytes(self, name: str, data: bytes, *, exclusive: bool = False) -> None:
        if len(data) > CARRY_MAX_BYTES or not self.relay.write(self._full(name), bytes(data), exclusive):
            self._plain.write_bytes(name, data, exclusive=exclusive)
            if len(data) > CARRY_MAX_BYTES:
                self.relay.stored(self._full(name))

    def write_file(self, name: str, source: str | os.PathLike | IO[bytes], *, exclusive: bool = False) -> None:
        size = _size_of(source)
        if self.relay.up and size is not None and size <= CARRY_MAX_BYTES:
            super().write_file(name, source, exclusive=exclusive)  # read whole, then as ``write_bytes``
            return
        self._plain.write_file(name, source, exclusive=exclusive)
        self.relay.stored(self._full(name))

    def _carried(self, name: str) -> bytes | Stored | None:
        """What the channel carried for ``name`` while it is up; ``ObjectNotFoundError`` when it serves ``name``
        and has carried nothing; None when the read is storage's."""
        full = self._full(name)
        mirror = self.relay.mirror
        if not self.relay.up or mirror is None:
            return None
        data = mirror.get(full)
        if data is None and self.relay.serves(full):
            raise ObjectNotFoundError(f"{self.uri}/{name} does not exist")
        return None if data is None or isinstance(data, Stored) else data

    def read_bytes(self, name: str) -> bytes:
        data = self._carried(name)
        return data if data is not None else self._plain.read_bytes(name)

    def read_bounded(self, name: str, max_bytes: int) -> bytes:
        data = self._carried(name)  # carried: already held, at most CARRY_MAX_BYTES
        if data is None:
            return self._plain.read_bounded(name, max_bytes)
        return super().read_bounded(name, max_bytes)  # the same check, on the bytes held

    def open_read(self, name: str) -> IO[bytes]:
        data = self._carried(name)
        return io.BytesIO(data) if data is not None else self._plain.open_read(name)

    def exists(self, name: str) -> bool:
        try:
            return self._carried(name) is not None or self._plain.exists(name)
        except ObjectNotFoundError:
            return False

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        full = self._full(prefix) if prefix else (f"{self._prefix}/" if self._prefix else "")
        if not self.relay.serves(full):
            return self._plain.list(prefix)
        cut = len(self._prefix) + 1 if self._prefix else 0
        return [ObjectInfo(name[cut:], size, version, at) for name, size, version, at in self.relay.mirror.entries(full)]

    def delete(self, name: str) -> None:
        self._plain.delete(name)

    def local_path(self, name: str = "") -> str | None:
        return self._plain.local_path(name)


def hosts_agreed(mirror: Mirror, key: bytes) -> bool:
    """Whether the hosts' start verdict, as the channel carried it, says their cells travel through it (the
    leader sends it once every host joined; it verifies under the session's key)."""
    data = mirror.get(protocol.LEADER_READY)
    if not isinstance(data, bytes):
        return False
    try:
        verdict = LeaderReady.from_json(unseal(key, protocol.LEADER_READY, data, where="the channel's start verdict"))
    except (IntegrityError, ValueError, TypeError):
        return False
    return verdict.go and verdict.channel


def _size_of(source: str | os.PathLike | IO[bytes]) -> int | None:
    if isinstance(source, (str, os.PathLike)):
        return os.path.getsize(source)
    try:
        here = source.tell()
        end = source.seek(0, io.SEEK_END)
        source.seek(here)
    except (OSError, ValueError, AttributeError):
        return None
    return end - here
