"""Work on no cell's way (a decided cell's outcome objects removed), done in order by one daemon thread.

A thread started per cell costs a warm session cell more than the work itself
on a busy machine (its start waits for the new thread to run); one long-lived
thread per session takes each piece as it comes. Daemon: a kernel that exits
does not wait for a cleanup its session's ``gc`` would do anyway.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable


class BackgroundWork:
    """One daemon thread, started at the first :meth:`submit`, running what it is given in order."""

    def __init__(self, name: str):
        self.name = name
        self._queue: queue.SimpleQueue[tuple[concurrent.futures.Future, Callable[[], object]]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, work: Callable[[], object]) -> concurrent.futures.Future:
        """Run ``work`` after what was submitted before it; its future holds its result or its error."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((future, work))
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
        return future

    def _run(self) -> None:
        while True:
            future, work = self._queue.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(work())
            except BaseException as error:  # noqa: BLE001 - handed to whoever waits on the future
                future.set_exception(error)
