"""How the leader's output reaches this process: as Jupyter would show the same program's output.

The poller hands :class:`LeaderEcho` each segment of the leader's log as it
reads it. stdout and stderr go to this process's stream of the same name, at
once and a segment at a time (a burst of lines in one chunk is one write, so
one stream message in Jupyter, as ipykernel's own batching makes of a local
burst), with the ``\\r`` the host's log writer puts before a rewritten line, so
Jupyter (and a terminal) show one updating line. A line that may still turn
out to be framework chatter (``state.CHATTER``) waits for its end, wherever
chunk boundaries cut it, and is dropped if it is chatter. A display record
(``display(...)``, a figure) is published as rich output in IPython, and
printed as its text elsewhere.

Client side: IPython is imported only when a display record arrives in a
process that already runs IPython.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable

from kinetic_nb.runner import protocol
from kinetic_nb.runner.logs import display_text
from kinetic_nb.state import is_chatter, may_become_chatter

__all__ = ["LeaderEcho", "show_output"]


def show_output(text: str, stream: str = protocol.STDOUT) -> None:
    """Show one piece of a host's output here: a stream on the stream of the same name, a display record as such.

    Parameters
    ----------
    text : str
        The text, or for ``protocol.DISPLAY`` the record's JSON.
    stream : str
        ``"out"``, ``"err"`` or ``"display"``.
    """
    if stream == protocol.DISPLAY:
        _show_display(text)
        return
    out = sys.stderr if stream == protocol.STDERR else sys.stdout
    out.write(text)
    out.flush()


def _show_display(record: str) -> None:
    shell = _running_ipython()
    if shell is None:
        show_output(display_text(record))
        return
    try:
        bundle = json.loads(record)
        data, metadata = dict(bundle["data"]), dict(bundle.get("metadata") or {})
    except (ValueError, KeyError, TypeError):
        show_output(display_text(record))
        return
    for stream in (sys.stdout, sys.stderr):
        stream.flush()  # what was printed before the display comes before it
    from IPython.display import publish_display_data

    publish_display_data(data, metadata)


def _running_ipython():
    """The IPython shell this process runs in, if any (without importing IPython where it is not)."""
    if "IPython" not in sys.modules:
        return None
    from IPython import get_ipython

    return get_ipython()


class LeaderEcho:
    """Feeds the leader's log segments to ``show(text, stream)``, leaving framework chatter out.

    Parameters
    ----------
    show : callable
        ``show(text, stream)``, e.g. :func:`show_output`.
    """

    def __init__(self, show: Callable[[str, str], None]):
        self._show = show
        #: Per stream: the start of a line held back because it may become chatter.
        self._held: dict[str, str] = {}
        #: Per stream: whether part of the current line has been shown already.
        self._line_started: dict[str, bool] = {}

    def feed(self, stream: str, text: str) -> None:
        """Show one segment, less complete chatter lines; hold a line that may still become chatter. What the
        framework printed in its teardown (``protocol.FRAMEWORK_OUTPUT``) stays in the host's log."""
        if stream == protocol.FRAMEWORK_OUTPUT:
            return
        if stream == protocol.DISPLAY:
            self._show(text, stream)
            return
        *complete, rest = text.split("\n")
        shown = [self._piece(stream, line + "\n") for line in complete]
        if rest:
            shown.append(self._piece(stream, rest))
        batch = "".join(shown)
        if batch:  # a burst of lines is one write, so one stream message in Jupyter, not one per line
            self._show(batch, stream)

    def _piece(self, stream: str, piece: str) -> str:
        """What of ``piece`` (a line, or the start of one) is shown: all of it, or none while it is held back or
        when it is chatter."""
        shown = piece
        if not self._line_started.get(stream):
            line = self._held.pop(stream, "") + piece
            if not line.endswith("\n") and may_become_chatter(line):
                self._held[stream] = line
                return ""
            shown = "" if is_chatter(line.rstrip("\n")) else line
        self._line_started[stream] = not piece.endswith("\n")
        return shown

    def close(self) -> None:
        """Show what is held back: the host has ended, so no line will grow any more."""
        for stream, line in sorted(self._held.items()):
            self._show(line, stream)
        self._held.clear()

    def end(self) -> None:
        """The cell's outcome is decided: what is held back is shown, and nothing after it (what the leader
        prints while it is being stopped stays in its log, never below the cell's error)."""
        self.close()
        self._show = lambda text, stream: None
