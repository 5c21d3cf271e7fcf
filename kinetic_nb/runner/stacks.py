"""Every thread's Python stack, on request, even while the host is blocked in C code.

The agent gives each host a file (``KINETIC_STACKS_FILE``) and, to ask for a
dump, sends the host :data:`STACKS_SIGNAL`. ``faulthandler`` answers it from
its C signal handler, without the interpreter's help, so a host stuck in a
collective, in XLA or in ``time.sleep`` still answers; a Python-level signal
handler would wait for the blocking call to return.

The notebook reads a dump with :func:`readable_stacks` and :func:`where_the_cell_is`: the thread that runs
the cell first, from the user's own frame and its source line, without kinetic_nb's own threads and frames.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import linecache
import os
import re
import signal
from typing import IO

#: The file a host's stack dumps are appended to; set by its agent.
STACKS_FILE_ENV = "KINETIC_STACKS_FILE"
#: The signal that asks a host for a dump. SIGUSR1 is free in Python, JAX and
#: torch (none installs a handler for it), and its default action would kill
#: the host, so it is registered before any user code runs.
STACKS_SIGNAL = signal.SIGUSR1

_dump_file: IO[str] | None = None  # kept open for the process's life: faulthandler writes to its descriptor


def enable_stack_dumps(environ: dict[str, str] | None = None) -> bool:
    """Answer :data:`STACKS_SIGNAL` with a dump of every thread into the agent's file; whether one was set up."""
    global _dump_file
    environ = os.environ if environ is None else environ
    path = environ.pop(STACKS_FILE_ENV, None)
    if not path:
        return False
    _dump_file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - lives as long as the process
    faulthandler.register(STACKS_SIGNAL, file=_dump_file, all_threads=True, chain=False)
    return True


# -- reading a dump ---------------------------------------------------------------------------------------------------

#: A thread's header in a dump: ``Thread 0x...`` or ``Current thread 0x...`` (the one the signal interrupted).
_THREAD = re.compile(r"^(?P<current>Current thread|Thread) (?P<id>0x[0-9a-f]+) \(most recent call first\):$")
#: A frame in a dump (faulthandler writes no source lines, and ``in`` without a comma).
_FRAME = re.compile(r'^\s+File "(?P<file>[^"]*)", line (?P<line>\d+) in (?P<name>.*)$')
#: The cell's own code: compiled as ``<kinetic In[5]>`` (the notebook's name), or ``<kinetic cell>``.
_CELL_FILE = re.compile(r"^<kinetic (?P<cell>[^>]*)>$")
#: Where kinetic_nb's own code lies on a host: its frames are never shown as the user's.
_OWN_CODE = f"{os.sep}kinetic_nb{os.sep}"


@dataclasses.dataclass(frozen=True)
class DumpedFrame:
    """One frame of a thread in a dump."""

    file: str
    line: int
    name: str

    @property
    def cell(self) -> str:
        """The cell's name (``In[5]``) for a frame of the cell's own code, else ""."""
        match = _CELL_FILE.match(self.file)
        return match["cell"] if match else ""

    @property
    def own(self) -> bool:
        """A frame of kinetic_nb's own code."""
        return _OWN_CODE in self.file

    def location(self) -> str:
        """``In[5], line 3`` for the cell (as IPython names a cell's frame), ``File "path", line 9, in name``."""
        if self.cell:
            return f"{'the cell' if self.cell == 'cell' else self.cell}, line {self.line}"
        return f'File "{self.file}", line {self.line}, in {self.name}'

    def source(self) -> str:
        """The line of the cell's code it is on, where this process knows the cell's source; else ""."""
        return linecache.getline(self.file, self.line).strip() if self.cell else ""


@dataclasses.dataclass(frozen=True)
class DumpedThread:
    """One thread of a dump, its frames in call order (outermost first)."""

    header: str
    current: bool
    frames: tuple[DumpedFrame, ...]

    @property
    def runs_the_cell(self) -> bool:
        return any(frame.cell for frame in self.frames)

    @property
    def own(self) -> bool:
        """A thread of kinetic_nb's own (a heartbeat, an output relay): its code, and none of the cell's."""
        return not self.runs_the_cell and any(frame.own for frame in self.frames)


def parse_stacks(text: str) -> list[DumpedThread]:
    """The threads of a ``faulthandler`` dump, in its order; [] for text that is not one (a "no answer")."""
    threads: list[DumpedThread] = []
    header, current, frames = "", False, []
    for line in [*text.splitlines(), ""]:
        thread = _THREAD.match(line.strip())
        frame = _FRAME.match(line)
        if frame and header:
            frames.append(DumpedFrame(frame["file"], int(frame["line"]), frame["name"]))
        elif thread or not line.strip():
            if header:
                threads.append(DumpedThread(header, current, tuple(reversed(frames))))
            header, current, frames = (line.strip(), thread["current"] == "Current thread", []) if thread else \
                ("", False, [])
    return threads


def _cell_thread(threads: list[DumpedThread]) -> DumpedThread | None:
    return next((thread for thread in threads if thread.runs_the_cell), None) or \
        next((thread for thread in threads if thread.current), None)


def _from_the_cell(thread: DumpedThread) -> tuple[DumpedFrame, ...]:
    """Its frames from the cell's outermost one on: kinetic_nb's own frames that called the cell are left out."""
    first = next((position for position, frame in enumerate(thread.frames) if frame.cell), None)
    if first is None:
        return tuple(frame for frame in thread.frames if not frame.own) or thread.frames
    return thread.frames[first:]


def where_the_cell_is(text: str) -> str:
    """One line for a quiet host: the cell's innermost frame and its source, and the call it waits in.

    Parameters
    ----------
    text : str
        A host's stack dump (``faulthandler``'s text).

    Returns
    -------
    str
        ``In[5], line 3: jax.block_until_ready(x), waiting in wait (threading.py:327)``; "" when the dump
        shows no frame of the thread that runs the cell.
    """
    threads = parse_stacks(text)
    thread = _cell_thread(threads)
    if thread is None or not thread.frames:
        return ""
    frames = _from_the_cell(thread)
    cell_frames = [frame for frame in frames if frame.cell]
    innermost = frames[-1]
    if not cell_frames:
        return f"in {innermost.name} ({os.path.basename(innermost.file)}:{innermost.line})"
    at = cell_frames[-1]
    said = at.location() + (f": {at.source()}" if at.source() else "")
    if innermost is not at:
        said += f", waiting in {innermost.name} ({os.path.basename(innermost.file)}:{innermost.line})"
    return said


def readable_stacks(text: str) -> str:
    """A host's stack dump as its user reads it: the thread that runs the cell first, from the cell's own frame
    (with its source line) into the calls it waits in, as a traceback reads; then the user's other threads;
    kinetic_nb's own threads and frames left out, and said so. Text that is not a dump comes back as it is.

    Parameters
    ----------
    text : str
        A host's stack dump (``faulthandler``'s text).

    Returns
    -------
    str
    """
    threads = parse_stacks(text)
    thread = _cell_thread(threads)
    if thread is None:
        return text
    lines = ["the cell's thread (most recent call last):"]
    for frame in _from_the_cell(thread):
        lines.append(f"  {frame.location()}")
        if frame.source():
            lines.append(f"    {frame.source()}")
    others = [other for other in threads if other is not thread and not other.own]
    for other in others:
        lines.append(f"{other.header.replace('(most recent call first)', '(most recent call last)')}")
        lines.extend(f"  {frame.location()}" for frame in other.frames)
    own = sum(1 for other in threads if other is not thread and other.own)
    if own:
        lines.append(f"({own} thread{'s' if own != 1 else ''} of kinetic_nb's own not shown)")
    return "\n".join(lines)
