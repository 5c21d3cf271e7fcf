"""The compact view of a big slice: a grid of squares, the few hosts that differ, and the hosts' lines grouped.

Pure functions of a ``JobSnapshot``'s hosts; the panel (``panel.py``) puts
them in widgets, the text twin in lines. Cheap at 1,024 hosts: a square is a
class (one stylesheet gives each state its colour) and its tooltip, and the
grid is cut into rows of ``GRID_ROW`` squares, each its own widget value, so a
host's change resends its row alone.
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Mapping, Sequence

from kinetic_nb.state import HostSnapshot, HostState

#: Squares in one row of the grid, and in one widget value: a host's change resends 64 squares, not 1,024.
GRID_ROW = 64
#: Hosts listed under the grid at most (the worst first); the rest are counted by state on one more line.
MAX_DIFFERING = 12
#: The slowest hosts: those still in the cell once more than this share of the hosts is done with it (the
#: stragglers everyone waits on). Before that, the hosts still running are the many, not the few that differ.
SLOWEST_AFTER_ENDED_SHARE = 0.5
#: The order the hosts that differ are listed in: a host's own failure first, a follow-on's after the quiet ones.
_DIFFER_ORDER = {HostState.LOST.value: 1, HostState.QUIET.value: 2, HostState.FAILED.value: 3,
                 HostState.STOPPING.value: 4, HostState.STOPPED.value: 5}
#: A square's class, by state: ``kn-failed``.
_SQUARE_CLASS = "kn-{}"


def grid_style(colors: Mapping[str, str]) -> str:
    """The grid's one stylesheet: a square's size, and each state's colour by class (sent once per panel)."""
    rules = "".join(f".kn-grid i.{_SQUARE_CLASS.format(state)}{{background:{color}}}" for state, color in colors.items())
    return ("<style>.kn-grid{line-height:0;white-space:nowrap}"
            ".kn-grid i{display:inline-block;width:10px;height:10px;margin:1px;background:#999}" + rules + "</style>")


def square(host: HostSnapshot, title: str) -> str:
    """A host's square: ``<i class=kn-running title='host 5 · running · in the cell'></i>`` (no double quotes:
    each would cost two bytes in the widget's JSON message)."""
    return f"<i class={_SQUARE_CLASS.format(host.state)} title='{html.escape(title)}'></i>"


def square_key(host: HostSnapshot) -> tuple[str, str]:
    """What a host's square shows (its state and phase): the square is made again only when it changed."""
    return host.state, host.phase


def grid_row(squares: Iterable[str]) -> str:
    """One row of the grid, from its squares."""
    return f"<div class=kn-grid>{''.join(squares)}</div>"


def slowest_hosts(hosts: Sequence[HostSnapshot]) -> list[HostSnapshot]:
    """The hosts still in the cell once more than ``SLOWEST_AFTER_ENDED_SHARE`` of them are done with it."""
    ended = sum(1 for host in hosts if host.ended)
    if ended <= SLOWEST_AFTER_ENDED_SHARE * len(hosts) or ended == len(hosts):
        return []
    return [host for host in hosts if host.fine and not host.ended and host.state != HostState.IDLE.value]


def differing_hosts(hosts: Sequence[HostSnapshot]) -> list[HostSnapshot]:
    """The hosts that differ from the many, worst first: failed on their own, lost, quiet, failed as a
    consequence, being stopped or stopped, then the slowest; in host order within each."""
    slowest = slowest_hosts(hosts)
    others = [host for host in hosts if not host.fine]
    others.sort(key=lambda host: (0 if host.state == HostState.FAILED.value and host.failed_on_its_own
                                  else _DIFFER_ORDER.get(host.state, len(_DIFFER_ORDER) + 1), host.index))
    return others + slowest


def differing_counts(hosts: Sequence[HostSnapshot]) -> str:
    """``"1 failed, 3 quiet, 2 still running after 250 of 256 ended"``: what the list under the grid holds."""
    counts: dict[str, int] = {}
    for host in differing_hosts(hosts):
        counts[host.state] = counts.get(host.state, 0) + 1
    slowest = len(slowest_hosts(hosts))
    words = [f"{count} {state}" for state, count in counts.items() if state not in (HostState.RUNNING.value,
                                                                                     HostState.READY.value,
                                                                                     HostState.PENDING.value)]
    if slowest:
        ended = sum(1 for host in hosts if host.ended)
        words.append(f"{slowest} still running after {ended} of {len(hosts)} ended")
    return ", ".join(words)


def last_lines(hosts: Iterable[HostSnapshot]) -> dict[int, str]:
    """Each host's last printed line, by index (the lines the grid view groups)."""
    return {host.index: host.last_line for host in hosts if host.last_line}
