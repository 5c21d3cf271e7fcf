"""A host's output as stored: log chunks of ``[stream, text]`` segments, and the in-band marks they are cut by."""

from __future__ import annotations

import json
import re
import typing

#: The two streams of a host's output, as log chunks name them.
STDOUT = "out"
STDERR = "err"
#: A third kind of log segment: one rich output (``display(...)``, a figure) as the
#: JSON of ``{"data": {mime: ...}, "metadata": {...}}``, in its place among the lines.
DISPLAY = "display"
#: A host's rich output travels in-band on its stdout between these two
#: markers (an OSC escape sequence that no terminal acts on), so it keeps its
#: place among the lines printed around it; the agent's log writer lifts it out
#: into a ``DISPLAY`` segment. JSON escapes ESC, so the end marker cannot occur inside.
DISPLAY_START = "\x1b]kinetic-display;"
DISPLAY_END = "\x1b\\"
#: Carried to the host's agent in-band on stdout when a session's host starts a cell: its log chunks
#: from there on belong to that cell. Unprintable framing that no program prints by accident.
CELL_MARK = "\x1ekinetic-cell:{seq}\x1e"
#: Printed when the cell ends: the agent stores the cell's output at once, marked as its last.
CELL_END_MARK = "\x1ekinetic-cell-end:{seq}\x1e"
CELL_MARK_RE = re.compile("\x1ekinetic-cell(-end)?:(\\d+)\x1e")


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
