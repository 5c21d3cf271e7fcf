"""A host's own log upload, for platforms with no supervisor to pump its output (GKE pods).

``capture_output`` points file descriptors 1 and 2 at a pipe; a thread copies
what arrives to the original stdout (so ``kubectl logs`` still shows it) and
into ``hosts/{i}/log/`` chunks, at least once a second. Output written by C
code (XLA, gloo) is captured too, since the descriptors themselves move.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import sys
import threading
from collections.abc import Iterator

from kinetic_nb.runner.logs import FLUSH_INTERVAL_S, LogChunkWriter
from kinetic_nb.storage import Storage

#: Set on a host whose platform has no supervisor: the runner uploads its own log.
LOG_UPLOAD_ENV = "KINETIC_LOG_UPLOAD"


def wants_log_upload() -> bool:
    return os.environ.get(LOG_UPLOAD_ENV) == "1"


@contextlib.contextmanager
def capture_output(storage: Storage, host_index: int) -> Iterator[None]:
    """Tee fds 1 and 2 into log chunks while the block runs; the last chunk is written on exit."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    read_end, write_end = os.pipe()
    original = os.dup(1)
    saved = (os.dup(1), os.dup(2))
    os.dup2(write_end, 1)
    os.dup2(write_end, 2)
    os.close(write_end)
    writer = LogChunkWriter(storage, host_index)
    pump = threading.Thread(target=_pump, args=(read_end, original, writer), name="kinetic-log", daemon=True)
    pump.start()
    try:
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os.dup2(saved[0], 1)  # the pipe's last writers go: the pump sees the end
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
        pump.join(timeout=10)
        os.close(original)


def _pump(read_end: int, original: int, writer: LogChunkWriter) -> None:
    selector = selectors.DefaultSelector()
    selector.register(read_end, selectors.EVENT_READ)
    try:
        while True:
            if selector.select(timeout=FLUSH_INTERVAL_S):
                data = os.read(read_end, 1 << 16)
                if not data:
                    break
                with contextlib.suppress(OSError):
                    os.write(original, data)
                writer.feed(data)
            if writer.due():
                writer.flush()
    finally:
        writer.flush(final=True)
        selector.close()
        os.close(read_end)
