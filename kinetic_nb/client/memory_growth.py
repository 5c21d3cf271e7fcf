"""A session host whose memory keeps growing from cell to cell: said once, in the cell's output.

After each of a session's cells, each host's status carries its resident
memory (``runner.memory``). A host whose memory grew by :data:`GROWTH_BYTES`
or more over the last :data:`GROWTH_CELLS` cells is holding on to something
the cells make (a list a cell appends to, arrays kept in a cache, a figure per
step): the notebook says so once per host and session, naming the figures.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable

from kinetic_nb.runner.memory import format_bytes
from kinetic_nb.state import HostSnapshot

__all__ = ["GROWTH_BYTES", "GROWTH_CELLS", "MemoryGrowth"]

#: Growth over GROWTH_CELLS cells that is reported.
GROWTH_BYTES = 512 * 1024**2
GROWTH_CELLS = 5


class MemoryGrowth:
    """Each host's resident memory after each cell, and the hosts already reported."""

    def __init__(self) -> None:
        self._after: dict[int, collections.deque[int]] = {}
        self._reported: set[int] = set()

    def note(self, hosts: Iterable[HostSnapshot], name_of=lambda index: f"host {index}") -> list[str]:
        """Record the figures the cell's hosts ended with; the lines to show, one per host newly found growing."""
        lines = []
        for host in hosts:
            if "rss" not in host.memory:
                continue
            after = self._after.setdefault(host.index, collections.deque(maxlen=GROWTH_CELLS + 1))
            after.append(host.memory["rss"])
            if host.index in self._reported or len(after) <= GROWTH_CELLS:
                continue
            grown = after[-1] - after[0]
            if grown >= GROWTH_BYTES:
                self._reported.add(host.index)
                lines.append(f"kinetic_nb: {name_of(host.index)}'s memory grew by {format_bytes(grown)} over the "
                             f"last {GROWTH_CELLS} cells ({format_bytes(after[0])} -> {format_bytes(after[-1])}): "
                             "does a cell keep what it makes (a list it appends to, arrays it caches)?")
        return lines
