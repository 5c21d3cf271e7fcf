"""A host's stdout and stderr as append-only chunks in storage.

``hosts/{i}/log/{seq:06d}.txt`` objects are never rewritten, so a reader
that lists them knows which ones it has already read. A progress bar that
redraws with ``\\r`` keeps only its last state in a chunk.
"""

from __future__ import annotations

import logging
import time

from kinetic_nb.runner import protocol
from kinetic_nb.storage import Storage

logger = logging.getLogger(__name__)

#: A chunk is written at least this often while output keeps coming, so
#: readers see a host's output within about a second.
FLUSH_INTERVAL_S = 0.5


def collapse_carriage_returns(text: str) -> str:
    """Keep only what the last ``\\r`` of each line left on screen."""
    return "\n".join(line.rstrip("\r").rsplit("\r", 1)[-1] for line in text.split("\n"))


class LogChunkWriter:
    """Buffers one host's output and writes it as numbered chunks."""

    def __init__(self, storage: Storage, host_index: int):
        self._storage = storage
        self._host_index = host_index
        self._buffer = bytearray()
        self._seq = 0
        self._last_flush = time.monotonic()

    def feed(self, data: bytes) -> None:
        self._buffer += data
        if time.monotonic() - self._last_flush >= FLUSH_INTERVAL_S:
            self.flush()

    def due(self) -> bool:
        return bool(self._buffer) and time.monotonic() - self._last_flush >= FLUSH_INTERVAL_S

    def flush(self, final: bool = False) -> None:
        """Write what is buffered as the next chunk (``final``: the host has ended)."""
        self._last_flush = time.monotonic()
        if not self._buffer:
            return
        # Hold back an incomplete trailing UTF-8 sequence for the next chunk.
        cut = len(self._buffer)
        text = ""
        for back in range(0 if final else 4):
            try:
                text = bytes(self._buffer[: cut - back]).decode()
                cut -= back
                break
            except UnicodeDecodeError:
                continue
        else:
            text = bytes(self._buffer).decode(errors="replace")
        del self._buffer[:cut]
        if not text:
            return
        name = protocol.host_log_chunk(self._host_index, self._seq)
        try:
            self._storage.write_bytes(name, collapse_carriage_returns(text).encode())
            self._seq += 1
        except Exception:
            logger.warning("could not write %s", name, exc_info=True)


def read_log(storage: Storage, host_index: int) -> str:
    """A host's whole log, its chunks joined in order."""
    chunks = storage.list(protocol.host_log_prefix(host_index))
    return "".join(storage.read_bytes(info.name).decode(errors="replace") for info in chunks)


def last_lines(text: str, count: int = 10) -> list[str]:
    return [line for line in text.splitlines() if line.strip()][-count:]
