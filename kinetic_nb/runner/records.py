"""A job's JSON records, each sealed under the job's key: what hosts, agents, backends and clients tell each other.

Statuses, exit records, log chunks, stacks, the leader's verdict, the first
failure and cancel requests are all written with :func:`write_record` and read
with :func:`read_record`, which reads at most the record's limit
(``protocol.limits``) and verifies before anything is parsed, acted on or
shown (``IntegrityError`` otherwise, a record over its limit included). Only the empty objects are unsigned: a
host's heartbeat and a cell's ready markers, which are read by their time or
their presence alone (docs/security.md, "Signed: every record", says what forging one can do).

Host-safe: the standard library and the runner only.
"""

from __future__ import annotations

from typing import TypeVar

from kinetic_nb.errors import IntegrityError, ObjectExistsError, ObjectNotFoundError
from kinetic_nb.runner import protocol
from kinetic_nb.runner.envelope import read_limited, unseal, write_sealed
from kinetic_nb.runner.protocol import ExitSummary, HostState, HostStatus, LogChunk
from kinetic_nb.storage import Storage

_Record = TypeVar("_Record", HostStatus, ExitSummary)

__all__ = ["open_log_chunk", "open_record", "read_exit", "read_host_status", "read_log_chunk", "read_record", "recorded_success", "store_exit",
           "unverified_line", "write_record"]


def write_record(storage: Storage, key: bytes | None, name: str, body: bytes, *, exclusive: bool = False) -> None:
    """Store ``body`` as ``name``, sealed under ``key`` (``ObjectExistsError`` if ``exclusive`` and it exists).

    A host without a key (started by hand, with nothing to verify its plan)
    still says why it fails, unsealed; every reader refuses that record as unverified.
    """
    if key is None:
        storage.write_bytes(name, body, exclusive=exclusive)
    else:
        write_sealed(storage, name, key, body, exclusive=exclusive)


def read_record(storage: Storage, key: bytes | None, name: str, *, listed_size: int | None = None) -> bytes:
    """The verified body of ``name``: ``IntegrityError`` when it does not verify, ``ObjectNotFoundError`` if absent.

    At most its kind's limit is read (``protocol.limits``; a ``listed_size`` over it: nothing), and a record
    over it is refused as one that does not verify. ``key=None`` reads a job from before signing, which its
    own user chose to trust: as it is.
    """
    return open_record(key, name, read_limited(storage, name, listed_size=listed_size), where=f"{storage.uri}/{name}")


def open_record(key: bytes | None, name: str, data: bytes, *, where: str) -> bytes:
    """The body of ``data``, read as ``name``, once it verifies under ``key`` (``IntegrityError`` naming ``where``
    otherwise); as it is for a job from before signing that its own user chose to trust (``key=None``)."""
    return unseal(key, name, data, where=where) if key is not None else data


def open_log_chunk(key: bytes | None, name: str, data: bytes, *, where: str) -> LogChunk:
    """A log chunk's segments once ``data`` verifies as ``name``: the one way a chunk is decoded for showing."""
    return protocol.decode_log_chunk_of_cell(open_record(key, name, data, where=where))


def read_log_chunk(storage: Storage, key: bytes | None, name: str) -> LogChunk:
    """The verified log chunk ``name``."""
    return open_log_chunk(key, name, read_limited(storage, name), where=f"{storage.uri}/{name}")


def unverified_line(host_index: int, name: str) -> str:
    """What a reader shows in place of a record that does not verify: that it was there, nothing of it."""
    return f"[kinetic_nb] unverified record from host {host_index} ({name}): not shown"


def _read_verified(storage: Storage, key: bytes | None, name: str, record: type[_Record]) -> _Record | None:
    """The verified record ``name``, or None when there is none (or none that verifies, or none that parses)."""
    try:
        return record.from_json(read_record(storage, key, name))
    except (ObjectNotFoundError, IntegrityError, ValueError, TypeError):
        return None


def read_host_status(storage: Storage, key: bytes | None, index: int) -> HostStatus | None:
    """Host ``index``'s verified status, or None when it has none (or none that verifies)."""
    return _read_verified(storage, key, protocol.host_status(index), HostStatus)


def recorded_success(storage: Storage, key: bytes | None, index: int) -> bool:
    """Whether host ``index`` recorded its success before it ended (a crash then is a teardown warning)."""
    status = read_host_status(storage, key, index)
    return status is not None and status.state == HostState.SUCCEEDED.value


def read_exit(storage: Storage, key: bytes | None, index: int) -> ExitSummary | None:
    """Host ``index``'s verified exit record, or None when it has none (or none that verifies)."""
    return _read_verified(storage, key, protocol.host_exit(index), ExitSummary)


def store_exit(storage: Storage, key: bytes | None, summary: ExitSummary) -> ExitSummary:
    """Store ``summary`` as its host's exit record, unless one landed meanwhile: then the stored one, if it verifies.

    What the platform alone sees (a pod evicted, an actor's node lost) is
    recorded this way by the backend, as an agent records its own hosts.
    """
    name = protocol.host_exit(summary.host_index)
    try:
        write_record(storage, key, name, summary.to_json(), exclusive=True)
    except ObjectExistsError:
        return read_exit(storage, key, summary.host_index) or summary
    return summary
