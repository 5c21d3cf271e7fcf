"""A host's stdout and stderr as append-only chunks in storage.

``hosts/{i}/log/{seq:06d}.json`` objects are never rewritten, so a reader
that lists them knows which ones it has already read. Each chunk holds the
host's output as ``[stream, text]`` segments in the order it was written, so
stdout and stderr stay apart and in order. A progress bar that redraws with
``\\r`` keeps only its last state in a chunk.
"""

from __future__ import annotations

import codecs
import logging
import time
from collections.abc import Callable

from kinetic_nb.runner import protocol
from kinetic_nb.runner.redact import Redactor
from kinetic_nb.storage import Storage

logger = logging.getLogger(__name__)

#: A chunk is written at least this often while output keeps coming, so
#: readers see a host's output within about a second.
FLUSH_INTERVAL_S = 0.5


def collapse_carriage_returns(text: str) -> str:
    """Keep only what the last ``\\r`` of each line left on screen."""
    return "\n".join(line.rstrip("\r").rsplit("\r", 1)[-1] for line in text.split("\n"))


class LogChunkWriter:
    """Buffers one host's output, stream by stream, and writes it as numbered chunks.

    ``on_error`` is called with the exception when a chunk cannot be stored
    (the host goes on; its agent records the storage error).
    """

    def __init__(self, storage: Storage, host_index: int, *,
                 on_error: Callable[[str, BaseException], None] | None = None, redactor: Redactor | None = None):
        self._storage = storage
        self._host_index = host_index
        self._on_error = on_error
        #: Secrets never reach storage; a tail that may begin one waits for the next flush.
        self._redactor = redactor or Redactor(())
        self._held = {protocol.STDOUT: "", protocol.STDERR: ""}
        #: Bytes become text as they arrive; a UTF-8 sequence cut between two reads waits in its decoder.
        self._decoders = {stream: codecs.getincrementaldecoder("utf-8")(errors="replace")
                          for stream in (protocol.STDOUT, protocol.STDERR)}
        self._segments: list[list[str]] = []
        self._seq = 0
        #: A session's host: the cell its output belongs to, from the mark it prints when one starts.
        self.cell = 0
        self._last_flush = time.monotonic()

    def feed(self, data: bytes, stream: str = protocol.STDOUT) -> None:
        text = self._decoders[stream].decode(data)
        if stream == protocol.STDOUT and "\x1e" in text:
            text = self._take_cell_marks(text)
        if text:
            self._append(stream, text)
        if time.monotonic() - self._last_flush >= FLUSH_INTERVAL_S:
            self.flush()

    def _append(self, stream: str, text: str) -> None:
        if self._segments and self._segments[-1][0] == stream:
            self._segments[-1][1] += text
        else:
            self._segments.append([stream, text])

    def _take_cell_marks(self, text: str) -> str:
        """Split ``text`` at each cell mark: what came before a mark is flushed as the previous cell's;
        what follows the last mark is returned."""
        parts = protocol.CELL_MARK_RE.split(text)  # [text, end, seq, text, end, seq, ..., text]
        for index in range(0, len(parts) - 1, 3):
            if parts[index]:
                self._append(protocol.STDOUT, parts[index])
            if parts[index + 1]:  # the cell's end: its output, stored now and marked as its last
                self.flush(cell_end=True)
            else:
                self.flush()
                self.cell = int(parts[index + 2])
        return parts[-1]

    def due(self) -> bool:
        return bool(self._segments) and time.monotonic() - self._last_flush >= FLUSH_INTERVAL_S

    def flush(self, final: bool = False, *, cell_end: bool = False) -> None:
        """Write what is buffered as the next chunk (``final``: the host has ended; ``cell_end``: a
        session's cell has, and its last chunk is written even when empty)."""
        self._last_flush = time.monotonic()
        if final:
            for stream, decoder in self._decoders.items():
                rest = decoder.decode(b"", final=True)
                if rest:
                    self._append(stream, rest)
        segments = []
        for stream, text in self._segments:
            text = self._held[stream] + text
            self._held[stream] = ""
            if self._redactor:
                text, held = (self._redactor.text(text), "") if final else self._redactor.split_safe(text)
                self._held[stream] = held
            if text:
                segments.append((stream, collapse_carriage_returns(text)))
        if final:
            segments += [(stream, self._redactor.text(held)) for stream, held in self._held.items() if held]
            self._held = {stream: "" for stream in self._held}
        self._segments = []
        if not segments and not cell_end:
            return
        name = protocol.host_log_chunk(self._host_index, self._seq)
        try:
            self._storage.write_bytes(name, protocol.encode_log_chunk(segments, self.cell, end=cell_end))
            self._seq += 1
        except Exception as error:
            logger.warning("could not write %s", name, exc_info=True)
            if self._on_error is not None:
                self._on_error(name, error)


def read_log_segments(storage: Storage, host_index: int) -> list[tuple[str, str]]:
    """A host's whole log as ``(stream, text)`` segments, its chunks in order."""
    segments: list[tuple[str, str]] = []
    for info in storage.list(protocol.host_log_prefix(host_index)):
        segments += protocol.decode_log_chunk(storage.read_bytes(info.name))
    return segments


def read_log(storage: Storage, host_index: int) -> str:
    """A host's whole log, stdout and stderr interleaved as written."""
    return "".join(text for _, text in read_log_segments(storage, host_index))


def last_lines(text: str, count: int = 10) -> list[str]:
    return [line for line in text.splitlines() if line.strip()][-count:]
