"""A host's output as stored: log chunks of ``[stream, text]`` segments.

What a host prints is only ever text here: its rich outputs (``DISPLAY``
segments) and its cells' boundaries reach its agent out of band, on the
host's marks pipe (``kinetic_nb.runner.marks``), never parsed out of stdout.
"""

from __future__ import annotations

import json
import typing

#: The two streams of a host's output, as log chunks name them.
STDOUT = "out"
STDERR = "err"
#: A third kind of log segment: one rich output (``display(...)``, a figure) as the
#: JSON of ``{"data": {mime: ...}, "metadata": {...}}``, in its place among the lines.
DISPLAY = "display"
#: A fourth: what a host printed once its framework's teardown began (``runner.marks.FRAMEWORK``: gloo's
#: "Connection closed by peer" after a peer failed, NCCL's abort), stdout and stderr alike. Kept in the host's
#: log, never echoed into the cell nor taken as its row's last line.
FRAMEWORK_OUTPUT = "framework"


def encode_log_chunk(segments: list[tuple[str, str]], cell: int = 0, *, end: bool = False) -> bytes:
    """A log chunk: ``[[stream, text], ...]`` in the order the host wrote them; a session's chunk also
    names its cell, and the cell's last chunk says so: ``{"cell": seq, "end": true, "segments": [...]}``."""
    pairs = [[stream, text] for stream, text in segments]
    if not cell:
        return json.dumps(pairs, ensure_ascii=False).encode()
    return json.dumps({"cell": cell, "end": end, "segments": pairs}, ensure_ascii=False).encode()


class LogChunk(typing.NamedTuple):
    cell: int
    segments: list[tuple[str, str]]
    #: The last chunk of its cell: whatever the host printed during the cell is stored.
    end: bool = False


def decode_log_chunk_of_cell(data: bytes) -> LogChunk:
    """A log chunk with its cell (0 outside a session); text that is not a chunk counts as stdout."""
    try:
        record = json.loads(data)
        if isinstance(record, dict):
            return LogChunk(int(record.get("cell", 0)), [(str(s), str(t)) for s, t in record["segments"]],
                            bool(record.get("end")))
        return LogChunk(0, [(str(stream), str(text)) for stream, text in record])
    except (ValueError, TypeError, KeyError):
        return LogChunk(0, [(STDOUT, data.decode(errors="replace"))])


def decode_log_chunk(data: bytes) -> list[tuple[str, str]]:
    """The ``(stream, text)`` segments of a log chunk."""
    return decode_log_chunk_of_cell(data).segments
