"""A host's ``status.json``: written on every phase change and as a heartbeat."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

from kinetic_nb.runner import protocol
from kinetic_nb.runner.protocol import HostState, HostStatus, Phase
from kinetic_nb.storage import Storage

logger = logging.getLogger(__name__)

#: How often a live host rewrites its status; a reader that sees no change
#: for several intervals can suspect the host is gone.
HEARTBEAT_INTERVAL_S = 2.0


class StatusReporter:
    """Keeps ``hosts/{i}/status.json`` current from the main thread and a heartbeat thread."""

    def __init__(self, storage: Storage, host_index: int):
        self._storage = storage
        self._name = protocol.host_status(host_index)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._status = HostStatus(
            host_index=host_index,
            state=HostState.PENDING.value,
            phase=Phase.STARTUP.value,
            started_at=time.time(),
            updated_at=time.time(),
            pid=os.getpid(),
            hostname=socket.gethostname(),
        )
        self._thread: threading.Thread | None = None

    @property
    def phase(self) -> Phase:
        return Phase(self._status.phase)

    def start(self) -> None:
        self._write()
        self._thread = threading.Thread(target=self._beat, name="kinetic-heartbeat", daemon=True)
        self._thread.start()

    def update(self, *, state: HostState | None = None, phase: Phase | None = None, message: str = "") -> None:
        with self._lock:
            self._status = HostStatus(
                **{
                    **self._status.__dict__,
                    "state": (state or self._status.state).__str__(),
                    "phase": (phase or self._status.phase).__str__(),
                    "message": message,
                }
            )
        self._write()

    def stop(self) -> None:
        self._stop.set()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_INTERVAL_S):
            self._write()

    def _write(self) -> None:
        with self._lock:
            self._status = HostStatus(**{**self._status.__dict__, "updated_at": time.time()})
            data = self._status.to_json()
            try:
                self._storage.write_bytes(self._name, data)
            except Exception:  # a heartbeat must never take the host down
                logger.warning("could not write %s", self._name, exc_info=True)
