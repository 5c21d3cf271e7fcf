"""The compact view of a big slice: a grid of squares, the few hosts that differ, and the hosts' lines grouped.

Pure functions of a ``JobSnapshot``; the panel (``panel.py``) puts them in
widgets, the text twin in lines. Cheap at 1,024 hosts: a square is a
class (one stylesheet gives each state its colour) and its tooltip, and the
grid is cut into rows of ``GRID_ROW`` squares, each its own widget value, so a
host's change resends its row alone.
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Mapping, Sequence

from kinetic_nb.notebook.display.grouping import grouped_lines
from kinetic_nb.notebook.display.rows import LAST_LINE_CHARS, STATE_COLORS, host_title, rank_label, row_html
from kinetic_nb.runner.protocol import MAX_RANGES, host_ranges
from kinetic_nb.state import HostSnapshot, HostState, JobSnapshot

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


def static_grid_html(snapshot: JobSnapshot) -> str:
    """The grid in a static summary (a saved notebook's): a style on each square, as a sanitized page keeps it."""
    cells = "".join(
        f'<span title="{html.escape(host_title(host, snapshot.name_of(host.index)))}" style="display:inline-block;'
        f'width:10px;height:10px;margin:1px;background:{STATE_COLORS.get(host.state, "#999")}"></span>'
        for host in snapshot.hosts
    )
    return f'<div style="line-height:0;max-width:{GRID_ROW * 12}px">{cells}</div>'


def many_word(snapshot: JobSnapshot) -> str:
    """What several of its hosts are called: ``hosts``, or ``ranks`` where hosts run several processes."""
    return "ranks" if snapshot.procs_per_host > 1 else "hosts"


def left_out_line(snapshot: JobSnapshot, left_out: list[HostSnapshot]) -> str:
    """``"… and 40 more: failed hosts 80-99, stopped hosts 3, 5"``: the hosts that differ past the list's end."""
    by_state: dict[str, list[int]] = {}
    for host in left_out:
        by_state.setdefault(host.state, []).append(host.index)
    return f"… and {len(left_out)} more: " + ", ".join(
        f"{state} {many_word(snapshot)} {host_ranges(indices, limit=MAX_RANGES)}" for state, indices in by_state.items())


def differing_html(snapshot: JobSnapshot, differing: list[HostSnapshot]) -> str:
    """Under the grid: what differs in a line, then a row for each of the first ``MAX_DIFFERING`` such hosts."""
    if not differing:
        return ""
    rows = "".join(row_html(host, snapshot.taken_at, rank_label(host, snapshot.procs_per_host))
                   for host in differing[:MAX_DIFFERING])
    more = differing[MAX_DIFFERING:]
    tail = f'<div style="font-family:monospace;font-size:12px">{html.escape(left_out_line(snapshot, more))}</div>' \
        if more else ""
    return (f'<div style="line-height:1.6"><div style="font-family:monospace;font-size:12px;margin-top:4px">'
            f"{many_word(snapshot)} that differ: {html.escape(differing_counts(snapshot.hosts))}</div>{rows}{tail}</div>")


def grouped_host_lines(snapshot: JobSnapshot) -> list[str]:
    """Each host's last line, identical ones once with the hosts that printed them."""
    lines = {index: line[:LAST_LINE_CHARS] for index, line in last_lines(snapshot.hosts).items()}
    return grouped_lines(lines, snapshot.name_of, many=many_word(snapshot))


def lines_html(snapshot: JobSnapshot) -> str:
    """Under the hosts that differ: the hosts' last lines, grouped."""
    grouped = grouped_host_lines(snapshot)
    if not grouped:
        return ""
    lines = "".join(f"<div style='white-space:pre;overflow:hidden;text-overflow:ellipsis'>{html.escape(line)}</div>"
                    for line in grouped)
    return (f'<div style="font-family:monospace;font-size:12px;line-height:1.6;margin-top:4px">'
            f'<div style="color:#555">last lines:</div>{lines}</div>')
