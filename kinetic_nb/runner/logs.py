"""A host's stdout and stderr as append-only chunks in storage, and how a terminal shows them.

``hosts/{i}/log/{seq:06d}.json`` objects are never rewritten, so a reader
that lists them knows which ones it has already read. Each chunk holds the
host's output as ``[stream, text]`` segments in the order it was written, so
stdout and stderr stay apart and in order; a rich output the host displayed
is a ``display`` segment in its place among them.

A carriage return rewrites the current line, as on a terminal (a progress bar
is one line that updates). The writer keeps, in each chunk, only what the
screen shows of a line, wherever the chunk boundaries fall: a line rewritten
since the last chunk is written again whole after a ``\\r``, so a reader (the
panel, ``logs()``, Jupyter's own stream rendering) that applies carriage
returns the terminal's way shows the same line.
"""

from __future__ import annotations

import codecs
import json
import logging
import re
import time
from collections.abc import Callable

from kinetic_nb.errors import IntegrityError, ObjectNotFoundError, StorageError
from kinetic_nb.runner import protocol
from kinetic_nb.runner.records import read_log_chunk, unverified_line, write_record
from kinetic_nb.runner.redact import Redactor
from kinetic_nb.storage import Storage

logger = logging.getLogger(__name__)

#: A chunk is written at least this often while output keeps coming, so
#: readers see a host's output within about a second.
FLUSH_INTERVAL_S = 0.5
#: A chunk is also written as soon as this much text waits, however little time passed: a host that prints
#: fast never makes a chunk over the size readers take (``runner.protocol.limits``), which they would refuse.
MAX_CHUNK_CHARS = 4 * 1024 * 1024
_CONTROL = re.compile("(\r|\n|\x08)")  # a line ends, or its cursor moves back
#: An escape sequence, which a terminal acts on rather than prints: CSI (colours, cursor moves, erasing:
#: ``ESC [ ... final``), OSC (a title, a hyperlink, the clipboard: ``ESC ] ... BEL`` or ``ESC \\``), DCS and its
#: kin (``ESC P ... ESC \\``), and the two-character ones.
_ESCAPE = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)|[PX^_][^\x1b]*\x1b\\|[ -/]*[0-~])")
#: The start of an escape sequence that the text's end cut (a line still being written).
_ESCAPE_CUT = re.compile(r"\x1b(?:\[[0-?]*[ -/]*|\][^\x07\x1b]*\x1b?|[PX^_][^\x1b]*\x1b?|[ -/]*)\Z")
#: What is no text on a screen: the C0 controls but tab and newline (a carriage return or a backspace left in a
#: message would move a terminal's cursor over what came before), DEL, the C1 controls, and the bidirectional
#: overrides and isolates, which reorder what follows.
_UNPRINTED = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
#: What such a character is shown as (the same as a byte that is no UTF-8).
_REPLACEMENT = "\ufffd"


class TerminalLine:
    """One stream's current line as a terminal shows it: ``\\r`` moves back to its start, a backspace one
    character back, and text overwrites."""

    def __init__(self) -> None:
        self.text = ""
        self.cursor = 0

    @property
    def at_end(self) -> bool:
        return self.cursor == len(self.text)

    def feed(self, text: str) -> list[str]:
        """Apply ``text``; return the lines it completed, as they were shown."""
        if "\r" not in text and "\b" not in text and self.at_end:  # plain lines (the common case): nothing overwritten
            *done, self.text = (self.text + text).split("\n")
            self.cursor = len(self.text)
            return done
        done = []
        for piece in _CONTROL.split(text):
            if piece == "\n":
                done.append(self.text)
                self.text, self.cursor = "", 0
            elif piece == "\r":
                self.cursor = 0
            elif piece == "\b":  # a backspace moves back a character (Keras's progress bar writes a row of them)
                self.cursor = max(0, self.cursor - 1)
            elif piece:
                self.text = self.text[:self.cursor] + piece + self.text[self.cursor + len(piece):]
                self.cursor += len(piece)
        return done

    def rewrite(self, text: str) -> str:
        """Apply ``text`` and return what a reader that saw everything before needs to show the same.

        Completed lines come as they were shown; a line the reader holds in
        part comes back whole after a ``\\r`` when ``text`` rewrote it (or
        left the cursor inside it), and otherwise only its new end.
        """
        if "\r" not in text and "\b" not in text and self.at_end:  # plain lines: a reader needs the text itself
            self.feed(text)
            return text
        before = self.text
        first_line = text.split("\n", 1)[0]
        rewritten = bool(before) and ("\r" in first_line or not self.at_end)
        done = self.feed(text)
        if not done:
            return "\r" + self.text if rewritten else self.text[len(before):]
        first = "\r" + done[0] if rewritten else done[0][len(before):]
        return "\n".join([first, *done[1:], self.text])


def collapse_carriage_returns(text: str) -> str:
    """What a terminal shows of ``text``: each line as its last ``\\r`` left it."""
    return TerminalLine().rewrite(text)


def display_text(record: str) -> str:
    """The plain-text form of a ``display`` segment (what a terminal would print for it)."""
    try:
        data = json.loads(record).get("data", {})
        text = data.get("text/plain") or "<" + ", ".join(sorted(data)) + ">"
    except (ValueError, AttributeError):
        text = "<display>"
    return text if text.endswith("\n") else text + "\n"


def shown_text(text: str) -> str:
    """``text`` as plain text a screen shows, never acts on: escape sequences (colours, cursor moves, a title, a
    hyperlink, the clipboard) left out, with one that ``text``'s end cuts short, and every other character that is
    no text shown as U+FFFD, tabs and newlines kept (a log's lines come through :class:`TerminalLine`, which has
    applied their carriage returns and backspaces)."""
    if "\x1b" in text:
        text = _ESCAPE.sub("", _ESCAPE_CUT.sub("", text, count=1))
    return _UNPRINTED.sub(_REPLACEMENT, text)


class LogScreen:
    """A host's whole output as a terminal shows it: completed lines in order, each stream's line in progress.
    The lines are as the host printed them, escapes and all (what ``logs()`` gives); :func:`shown_text` is what
    the panel shows of one."""

    def __init__(self) -> None:
        self._lines = {protocol.STDOUT: TerminalLine(), protocol.STDERR: TerminalLine()}

    def feed(self, stream: str, text: str) -> list[str]:
        """Apply one segment; return the lines it completed (a display segment is its plain text)."""
        if stream == protocol.DISPLAY:
            return display_text(text).splitlines()
        return self._lines.setdefault(stream, TerminalLine()).feed(text)

    def partial(self, *, leaving_out: str = "") -> list[str]:
        """The lines still being written, stdout's first (less the stream ``leaving_out`` names)."""
        return [line.text for stream, line in self._lines.items() if line.text and stream != leaving_out]


class LogChunkWriter:
    """Buffers one host's output, stream by stream, and writes it as numbered chunks.

    What the host prints is fed as bytes and stored as text, whatever it
    contains; its rich outputs and its cells' boundaries come apart, from the
    host's marks pipe (``runner.marks``): :meth:`add_display`,
    :meth:`start_cell` and :meth:`end_cell`.
    ``on_error`` is called with the exception when a chunk cannot be stored
    (the host goes on; its agent records the storage error).
    """

    def __init__(self, storage: Storage, host_index: int, key: bytes | None, *,
                 on_error: Callable[[str, BaseException], None] | None = None, redactor: Redactor | None = None,
                 on_cell_end: Callable[[], None] | None = None):
        self._storage = storage
        self._key = key
        self._host_index = host_index
        self._on_error = on_error
        #: Called once a session cell's last chunk is stored (the notebook waiting on the cell looks now).
        self._on_cell_end = on_cell_end
        #: Secrets never reach storage; a tail that may begin one waits for the next flush.
        self._redactor = redactor or Redactor(())
        self._held = {protocol.STDOUT: "", protocol.STDERR: "", protocol.FRAMEWORK_OUTPUT: ""}
        #: A session's host: the cell its output belongs to, from the mark its runner sends when one starts.
        self.cell = 0
        #: Whether the host's framework is being torn down (its runner's mark): what it prints is stored as
        #: ``FRAMEWORK_OUTPUT`` until its next cell starts.
        self.in_framework_teardown = False
        #: Bytes become text as they arrive; a UTF-8 sequence cut between two reads waits in its decoder.
        self._decoders = {stream: codecs.getincrementaldecoder("utf-8")(errors="replace")
                          for stream in (protocol.STDOUT, protocol.STDERR)}
        #: What each stream's current line shows so far, across chunks.
        self._screens = {stream: TerminalLine() for stream in self._held}
        #: What waits to be stored: per run of one stream, its pieces as they came (joined once, when stored: a
        #: host that prints line by line would otherwise cost a copy of the whole run per line).
        self._segments: list[tuple[str, list[str]]] = []
        #: Characters waiting in ``_segments``.
        self._buffered = 0
        #: The next chunk's number: among the host's own chunks, or (in a session's cell) among the cell's.
        self._seq = 0
        self._cell_seq = 0
        self._last_flush = time.monotonic()

    def feed(self, data: bytes, stream: str = protocol.STDOUT) -> None:
        """Take what the host wrote on ``stream`` (stdout or stderr): text, stored as text."""
        text = self._decoders[stream].decode(data)
        if text:
            self._append(self._stored_as(stream), text)
        if self._buffered >= MAX_CHUNK_CHARS or time.monotonic() - self._last_flush >= FLUSH_INTERVAL_S:
            self.flush()

    def add_display(self, record: str) -> None:
        """One rich output (its record's JSON, from the marks pipe), in its place after what was fed before."""
        if len(record) >= MAX_CHUNK_CHARS:
            self.flush()  # a large record goes in a chunk of its own, after what was printed before it
        self._segments.append((protocol.DISPLAY, [record]))
        self._buffered += len(record)

    def start_cell(self, seq: int) -> None:
        """A session's cell ``seq`` starts: what came before is stored as before, what follows is the cell's."""
        self.flush()
        self.cell, self._cell_seq = seq, 0
        self.in_framework_teardown = False

    def start_framework_teardown(self) -> None:
        """The host's framework is being torn down (``runner.marks.FRAMEWORK``): what it prints from now until its
        next cell starts is kept as ``FRAMEWORK_OUTPUT``, after what was fed before."""
        self.in_framework_teardown = True

    def end_cell(self, seq: int) -> None:
        """Cell ``seq`` has ended: its output is stored now, marked as its last (an end that names another cell
        than the current one ends nothing)."""
        if seq == self.cell:
            self.flush(cell_end=True)

    def _stored_as(self, pipe: str) -> str:
        """The stream that what the host wrote on ``pipe`` is stored as: its framework's once teardown began."""
        return protocol.FRAMEWORK_OUTPUT if self.in_framework_teardown else pipe

    def _append(self, stream: str, text: str) -> None:
        self._buffered += len(text)
        if self._segments and self._segments[-1][0] == stream:
            self._segments[-1][1].append(text)
        else:
            self._segments.append((stream, [text]))

    def due(self) -> bool:
        return bool(self._segments) and time.monotonic() - self._last_flush >= FLUSH_INTERVAL_S

    def _mark_output_stored(self) -> None:
        """On a local disk, say that this host's output of the cell is all stored (an empty marker in the cell's
        folder, which the notebook lists anyway): the cell's panel ends with every host's last line. The leader's
        last chunk says so itself. On a bucket it would be a request per host per cell: not made."""
        if self._host_index == protocol.LEADER_INDEX or self._storage.local_path() is None:
            return
        name = protocol.cell_output_stored(self.cell, self._host_index)
        try:
            self._storage.write_bytes(name, b"")
        except Exception as error:
            if self._on_error is not None:  # the agent says it, once a minute at most
                self._on_error(name, error)
            else:
                logger.warning("could not write %s: %s", name, error, exc_info=not isinstance(error, StorageError))

    def flush(self, final: bool = False, *, cell_end: bool = False) -> None:
        """Write what is buffered as the next chunk (``final``: the host has ended; ``cell_end``: a
        session's cell has, and its last chunk is written even when empty)."""
        self._last_flush = time.monotonic()
        if final:
            for stream, decoder in self._decoders.items():
                rest = decoder.decode(b"", final=True)
                if rest:
                    self._append(self._stored_as(stream), rest)
        raw = [(stream, "".join(pieces)) for stream, pieces in self._segments]
        self._segments, self._buffered = [], 0
        if final:
            raw += [(stream, "") for stream, held in self._held.items() if held]
        segments = []
        for stream, text in raw:
            if stream == protocol.DISPLAY:
                segments.append((stream, self._redactor.text(text)))
                continue
            if self._redactor:
                text = self._held[stream] + text
                text, self._held[stream] = (self._redactor.text(text), "") if final else self._redactor.split_safe(text)
            segments.append((stream, self._screens[stream].rewrite(text)))
        segments = [(stream, text) for stream, text in segments if text]
        in_cell = self.cell > 0  # a session's cell: its output lives with the cell
        # A cell's end is written even when empty for the leader, whose output a cell waits for.
        if not segments and not (cell_end and self._host_index == protocol.LEADER_INDEX):
            if cell_end and in_cell:
                self._mark_output_stored()
            return
        name = (protocol.cell_log_chunk(self.cell, self._host_index, self._cell_seq) if in_cell
                else protocol.host_log_chunk(self._host_index, self._seq))
        try:
            write_record(self._storage, self._key, name, protocol.encode_log_chunk(segments, self.cell, end=cell_end))
            if in_cell:
                self._cell_seq += 1
            else:
                self._seq += 1
            if cell_end and in_cell:
                self._mark_output_stored()
            if cell_end and self._on_cell_end is not None:
                self._on_cell_end()
        except Exception as error:
            if self._on_error is not None:  # the agent says it, once a minute at most
                self._on_error(name, error)
            else:
                logger.warning("could not write %s: %s", name, error, exc_info=not isinstance(error, StorageError))


def read_log_segments(storage: Storage, host_index: int, key: bytes, *, session: bool = False
                      ) -> list[tuple[str, str]]:
    """A host's whole log as ``(stream, text)`` segments, its chunks in order (``session``: then each cell's,
    in order); a chunk that does not verify under ``key`` is replaced by one stderr line that says so, and
    nothing of it is shown."""
    segments: list[tuple[str, str]] = []
    names = [info.name for info in storage.list(protocol.host_log_prefix(host_index))]
    if session:
        cells = [(parsed, info.name) for info in storage.list(protocol.CELLS_DIR + "/")
                 if (parsed := protocol.parse_cell_log_chunk(info.name)) and parsed[1] == host_index]
        names += [name for _, name in sorted(cells)]
    for name in names:
        try:
            segments += read_log_chunk(storage, key, name).segments
        except IntegrityError:
            segments.append((protocol.STDERR, unverified_line(host_index, name) + "\n"))
        except ObjectNotFoundError:
            continue
    return segments


def render_log(segments: list[tuple[str, str]]) -> str:
    """Segments as a terminal shows them: lines in the order they were completed, rewrites applied."""
    screen = LogScreen()
    lines: list[str] = []
    for stream, text in segments:
        lines += screen.feed(stream, text)
    text = "".join(f"{line}\n" for line in lines)
    return text + "\n".join(screen.partial())


def read_log(storage: Storage, host_index: int, key: bytes, *, session: bool = False) -> str:
    """A host's whole log as a terminal shows it, stdout and stderr interleaved by line (``session``: with
    every cell's output)."""
    return render_log(read_log_segments(storage, host_index, key, session=session))


def last_lines(text: str, count: int = 10) -> list[str]:
    return [line for line in text.splitlines() if line.strip()][-count:]
