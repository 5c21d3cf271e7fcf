"""A host's ``status.json``: written on every change, or deferred so that a quick phase costs no write.

A host does not beat its own ``heartbeat``: its agent does, for every host
process it has not reaped (``kinetic_nb.agent.liveness``), so a framework that
holds the interpreter's GIL, or a stopped process, is never taken for a host
that is gone. The paces are here, where readers (``state``) find them.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from kinetic_nb.errors import StorageError
from kinetic_nb.runner import protocol
from kinetic_nb.runner.environment_install import installed_environment
from kinetic_nb.runner.memory import measure
from kinetic_nb.runner.protocol import HostState, HostStatus, Phase
from kinetic_nb.runner.records import write_record
from kinetic_nb.storage import Storage

logger = logging.getLogger(__name__)

#: How often a live host's heartbeat is rewritten (by its agent); a reader that sees no new heartbeat for
#: several intervals can suspect the host, or its agent, is gone.
HEARTBEAT_INTERVAL_S = 2.0
#: The states that end a cell on a host: its status then carries the host's memory.
CELL_END_STATES = (HostState.IDLE, HostState.SUCCEEDED, HostState.FAILED, HostState.STOPPED)
#: How often an idle session host's is: nobody waits on it, and each beat is a request on a bucket (a reader
#: gives an idle host several of these before it calls it lost: ``state.IDLE_LOST_AFTER_S``).
IDLE_HEARTBEAT_INTERVAL_S = 60.0


class StatusReporter:
    """Keeps ``hosts/{i}/status.json`` current (sealed under ``key``); a deferred change is written from a thread
    started for the first one, which sleeps until a change is due (the host's heartbeat is its agent's)."""

    def __init__(self, storage: Storage, host_index: int, key: bytes | None):
        self._storage = storage
        self._key = key
        self._status_name = protocol.host_status(host_index)
        self._lock = threading.Lock()
        #: Held through a status write, so two writes (the main thread's, a deferred one from the writer
        #: thread) land in the order they were taken: a slow older write never overwrites a newer one.
        self._write_lock = threading.Lock()
        self._stop = threading.Event()
        #: Set when the writer thread has something new to wait for: a deferred write, or the stop.
        self._changed = threading.Event()
        #: When a deferred change is due to be written (monotonic), or None when none waits.
        self._due_at: float | None = None
        #: The thread that writes deferred changes, once one was deferred.
        self._writer: threading.Thread | None = None
        #: The state of the status last written.
        self._stored_state: str | None = None
        now = time.time()
        history = [[Phase.STARTUP.value, now]]
        install = installed_environment()
        if install is not None:  # this pod installed its environment first: the host's life began there
            history = [[Phase.ENVIRONMENT_INSTALL.value, install.started_at], [Phase.STARTUP.value, install.ended_at]]
        self._status = HostStatus(
            host_index=host_index,
            state=HostState.PENDING.value,
            phase=Phase.STARTUP.value,
            started_at=history[0][1],
            updated_at=now,
            pid=os.getpid(),
            hostname=os.uname().nodename,
            history=history,
        )

    def start(self) -> None:
        self._write_status()

    def update(
        self, *, state: HostState | None = None, phase: Phase | None = None, message: str = "", traceback: str = "",
        record: bool = True, defer_s: float | None = None, first: Callable[[bytes], None] | None = None,
        **session: Any,
    ) -> None:
        """Record a change of state or phase; ``session`` sets a session host's ``cell``, ``cell_failed``, ``names``.

        ``record=False`` keeps the change for the next write; with ``defer_s`` as
        well, it is written after that many seconds unless a write came first
        (a session's quick cell writes its status once, when it is done; a long
        one still shows that it runs). ``first`` stores the same record under
        another name before ``status.json`` is written (a cell's end: a reader
        that sees the host idle sees that record too); deferred, ``first`` is
        stored at once and ``status.json`` follows when due (a cell's end that
        its readers read by its own name, while a rewrite of ``status.json`` by
        rename costs a disk most of a small write).
        """
        with self._lock:
            now = time.time()
            history = self._status.history
            if session.get("cell", self._status.cell) != self._status.cell:
                history = []  # a session's timeline is its current cell's
            if phase is not None and phase.value != self._status.phase:
                history = [*history, [phase.value, now]]
            session.setdefault("frame_locals", [])  # as the message and traceback: a failure's, until the next change
            if state in CELL_END_STATES:  # the cell's memory, in the write that records its end
                session["memory"] = measure()
            self._status = dataclasses.replace(
                self._status,
                state=state.value if state else self._status.state,
                phase=phase.value if phase else self._status.phase,
                message=message,
                traceback=traceback,
                updated_at=now,
                history=history,
                **session,
            )
        if record:  # False: remembered, and written with the next change
            self._write_status(first=first)
        elif defer_s is not None:
            if first is not None:
                with self._write_lock:
                    self._store_first(first, self._next_revision()[0])
            with self._lock:
                armed, self._due_at = self._due_at is None, self._due_at or time.monotonic() + defer_s
                if armed and self._writer is None:
                    self._writer = threading.Thread(target=self._write_deferred, name="kinetic-status", daemon=True)
                    self._writer.start()
            if armed:  # the writer thread learns of a new due time; a later change rides on this one
                self._changed.set()

    def stored_state(self) -> str | None:
        """The state the stored status says (None before the first write): a deferred change is not in it yet."""
        return self._stored_state

    def stop(self) -> None:
        self._stop.set()
        self._changed.set()

    def current(self) -> bytes:
        """The status as last changed, as its record holds it."""
        with self._lock:
            return self._status.to_json()

    def _write_deferred(self) -> None:
        """Write a deferred change when it is due; with none due, sleep until one is deferred (or the stop)."""
        while not self._stop.is_set():
            with self._lock:
                due_at = self._due_at
            wait = None if due_at is None else max(0.0, due_at - time.monotonic())
            if self._changed.wait(wait):
                self._changed.clear()
                continue  # something new to wait for (or the stop): look again
            self._write_status(only_if_due=True)

    def _next_revision(self) -> tuple[bytes, str]:
        """The status as it is now, as its next record (a revision up: a reader never goes back to an older one),
        and its state."""
        with self._lock:
            self._status = dataclasses.replace(self._status, revision=self._status.revision + 1)
            return self._status.to_json(), self._status.state

    def _store_first(self, first: Callable[[bytes], None], data: bytes) -> None:
        try:
            first(data)
        except Exception as error:  # a record must never take the host down
            logger.warning("could not write %s's record before it: %s", self._status_name, error,
                           exc_info=not isinstance(error, StorageError))

    def _write_status(self, only_if_due: bool = False, first: Callable[[bytes], None] | None = None) -> None:
        with self._write_lock:
            with self._lock:
                if only_if_due and self._due_at is None:
                    return  # written meanwhile
                self._due_at = None
            data, state = self._next_revision()
            if first is not None:
                self._store_first(first, data)
            try:
                write_record(self._storage, self._key, self._status_name, data)
                self._stored_state = state
            except Exception as error:  # a record must never take the host down
                logger.warning("could not write %s: %s", self._status_name, error,
                               exc_info=not isinstance(error, StorageError))
