"""A host's marks pipe: its rich outputs and its cells' boundaries, out of band from the text it prints.

Whatever a host prints (a file name in a listing, a file's contents, a
subprocess's output) is text, and stays text: nothing the agent reads on the
host's stdout or stderr can become a display record or a cell's boundary.
Those travel on a third pipe of their own, which the agent opens when it forks
the host and the runner keeps as a descriptor no subprocess inherits
(``os.pipe()`` makes them close-on-exec). Each frame on it is
``kind (1 byte) | length (4 bytes, big-endian) | body``: a display record (its
JSON), a cell's start or end (its number), the start of its framework's teardown.

Order against the text is kept by both ends. The runner flushes its streams
before it writes a frame, then waits until the agent has taken the frame off
the pipe before it goes on; the agent, before it reads the marks pipe, reads
whatever the host's stdout and stderr pipes hold. So text printed before a
frame lands before it, text printed after lands after it. A cell's start is
sent as the cell begins and its taking confirmed just before its code runs
(by then the agent has long taken it), and a cell's end is not waited for
(nothing of the cell comes after it): neither wait is on a cell's way.

``python -m kinetic_nb.runner`` run by hand has no marks pipe: a display
record is then printed as its text, and cells are not marked.

Host-safe: the standard library only.
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import json
import os
import struct
import sys
import termios
import threading
import time
import typing

__all__ = ["CELL_END", "CELL_START", "DISPLAY", "FRAMEWORK", "MAX_FRAME_BYTES", "Mark", "MarkReader", "attach",
           "cell_ended", "cell_started", "framework_teardown_starts", "send_display", "taken"]

#: Frame kinds: one rich output (the JSON of ``{"data": ..., "metadata": ...}``), a cell's start, a cell's end,
#: and the start of the framework's teardown (an empty body): what the host prints from there until its next cell
#: starts is its framework's (gloo's "Connection closed by peer" after a peer failed, NCCL's abort), kept in its
#: log but never echoed into the cell nor shown as its row's line.
DISPLAY = b"D"
CELL_START = b"S"
CELL_END = b"E"
FRAMEWORK = b"F"
#: Every kind a frame may be: a first byte of none of them means what the pipe holds there is no frame.
_KINDS = frozenset({DISPLAY, CELL_START, CELL_END, FRAMEWORK})
#: A frame's header: its kind and its body's length.
_HEADER = struct.Struct(">cI")
#: The largest body a frame may carry: a bigger display record is shown as its text, a bigger frame read is dropped
#: (the agent holds at most this much of one host's frame in memory).
MAX_FRAME_BYTES = 64 * 1024 * 1024
#: A frame up to this size is written by one ``write`` call, which a pipe performs whole or not at all (POSIX's
#: PIPE_BUF): an interrupt cannot leave half of it on the pipe.
_ATOMIC_WRITE_BYTES = 4096
#: How long the runner waits for the agent to take a frame before it goes on anyway (the agent is then busy, say
#: storing a chunk on a slow bucket; only the order of what is printed meanwhile is at stake).
TAKEN_WAIT_S = 2.0
#: The runner's first and longest pause between two looks at whether the agent has taken a frame.
_FIRST_PAUSE_S = 0.0001
_LONGEST_PAUSE_S = 0.005

#: This host's end of its marks pipe (set in the host the agent forks), or None (no agent reads one).
_fd: int | None = None
#: One frame at a time on the pipe, whichever thread writes.
_lock = threading.Lock()


class Mark(typing.NamedTuple):
    """One frame read off a host's marks pipe: its kind and its body (the record's JSON, or the cell's number)."""

    kind: bytes
    body: str | int


def attach(fd: int | None) -> None:
    """Send this process's marks on ``fd`` (the write end of its marks pipe); None: it has none."""
    global _fd
    _fd = fd


def attached() -> bool:
    """Whether an agent reads this process's marks."""
    return _fd is not None


def send_display(record: str) -> bool:
    """Send one display record (its JSON) in its place among the lines printed around it.

    Returns
    -------
    bool
        False when it could not travel as one (no marks pipe, or too large): the caller prints its text instead.
    """
    return _send(DISPLAY, record.encode("utf-8", errors="replace"))


def cell_started(seq: int) -> None:
    """Tell the agent that a session's cell ``seq`` starts: the output from here on is the cell's.

    It does not wait for the agent to take the frame, so that the wait is no cost on a cell's way: call it as
    the cell begins (before its payload loads and its barrier), and :func:`taken` before its code runs.
    """
    _send(CELL_START, str(seq).encode(), wait=False)


def cell_ended(seq: int) -> None:
    """Tell the agent that cell ``seq`` has ended: it stores the cell's output at once, marked as its last.

    It does not wait for the agent to take the frame: nothing of the cell is printed after it, and the next
    cell's start comes after it on the same pipe.
    """
    _send(CELL_END, str(seq).encode(), wait=False)


def taken() -> None:
    """Wait until the agent has taken every frame sent so far (at most TAKEN_WAIT_S): what is printed from
    here on reaches it after them."""
    if _fd is not None:
        _wait_taken(_fd)


def framework_teardown_starts() -> None:
    """Tell the agent that what this host prints from now until its next cell starts is its framework's teardown:
    the agent keeps it in the host's log as ``protocol.FRAMEWORK_OUTPUT``."""
    _send(FRAMEWORK, b"")


def _send(kind: bytes, body: bytes, *, wait: bool = True) -> bool:
    """Write one frame after what was printed before it; ``wait``: then wait until the agent has taken it."""
    fd = _fd
    if fd is None or len(body) > MAX_FRAME_BYTES:
        return False
    _flush_streams()  # what was printed before the frame is on the stdout and stderr pipes before it
    frame = _HEADER.pack(kind, len(body)) + body
    try:
        if len(frame) <= _ATOMIC_WRITE_BYTES:
            with _lock:
                _write_all(fd, frame)
        else:
            _write_whole(fd, frame)
    except OSError:  # the agent has gone: the host is about to end with it
        return False
    if wait:
        _wait_taken(fd)
    return True


def _flush_streams() -> None:
    for stream in {id(s): s for s in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__) if s}.values():
        with contextlib.suppress(Exception):  # a closed or odd stream of the cell's own
            stream.flush()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _write_whole(fd: int, frame: bytes) -> None:
    """Write a large frame from a thread of its own: an interrupt raised in the main thread (the cell's
    ``KeyboardInterrupt``) cannot stop it halfway, which would leave the pipe out of step for every later frame."""
    failure: list[BaseException] = []

    def write() -> None:
        try:
            with _lock:
                _write_all(fd, frame)
        except OSError as error:
            failure.append(error)

    writer = threading.Thread(target=write, name="kinetic-marks", daemon=True)
    writer.start()
    writer.join()
    if failure:
        raise failure[0]


def _wait_taken(fd: int) -> None:
    """Wait until the agent has read what this pipe holds (at most TAKEN_WAIT_S): what the cell prints next
    then reaches the agent after the frame."""
    pending = array.array("i", [0])
    deadline = time.monotonic() + TAKEN_WAIT_S
    pause = _FIRST_PAUSE_S
    while True:
        try:
            fcntl.ioctl(fd, termios.FIONREAD, pending, True)
        except OSError:
            return
        if pending[0] == 0 or time.monotonic() >= deadline:
            return
        time.sleep(pause)
        pause = min(pause * 2, _LONGEST_PAUSE_S)


class MarkReader:
    """The agent's side: frames out of the bytes read off one host's marks pipe, whatever the reads' boundaries.

    A partial frame waits for its rest. A frame over MAX_FRAME_BYTES is skipped
    (never held), a frame of no known kind or with a body that is not one is
    dropped; each is named in ``problems`` (the agent writes them into the
    host's log). Only the host's own code could write such frames: its
    subprocesses never hold the pipe.
    """

    def __init__(self) -> None:
        self._buffer = bytearray()
        #: Bytes of an oversized frame still to be thrown away as they arrive.
        self._skip = 0
        self.problems: list[str] = []

    @property
    def pending(self) -> int:
        """How many bytes of an unfinished frame are held."""
        return len(self._buffer)

    def feed(self, data: bytes) -> list[Mark]:
        """The whole frames ``data`` completes, in order."""
        if self._skip:
            skipped = min(self._skip, len(data))
            self._skip -= skipped
            data = data[skipped:]
        self._buffer += data
        marks: list[Mark] = []
        while len(self._buffer) >= _HEADER.size:
            kind, length = _HEADER.unpack_from(self._buffer)
            if kind not in _KINDS:
                self.problems.append(f"{len(self._buffer)} bytes that are not a frame")
                self._buffer.clear()
                break
            if length > MAX_FRAME_BYTES:
                self.problems.append(f"a frame of {length} bytes (at most {MAX_FRAME_BYTES} travel)")
                held = len(self._buffer) - _HEADER.size
                self._skip = max(0, length - held)
                del self._buffer[:_HEADER.size + min(length, held)]
                continue
            if len(self._buffer) < _HEADER.size + length:
                break
            body = bytes(self._buffer[_HEADER.size:_HEADER.size + length])
            del self._buffer[:_HEADER.size + length]
            mark = _parse(kind, body)
            if mark is None:
                self.problems.append(f"a frame of kind {kind!r} whose body is not one ({length} bytes)")
            else:
                marks.append(mark)
        return marks


def _parse(kind: bytes, body: bytes) -> Mark | None:
    """The frame as a Mark, or None when its body is not what its kind carries."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if kind == DISPLAY:
        try:
            record = json.loads(text)
        except ValueError:
            return None
        return Mark(kind, text) if isinstance(record, dict) and isinstance(record.get("data"), dict) else None
    if kind == FRAMEWORK:
        return Mark(kind, 0) if not text else None
    return Mark(kind, int(text)) if text.isascii() and text.isdigit() and len(text) < 19 else None
