"""A host in one line, as the panel, the grid view and the summaries draw it: its state's colour and badge,
its row, its title, its times."""

from __future__ import annotations

import html

from kinetic_nb.runner.protocol import process_label
from kinetic_nb.state import HostSnapshot, HostState, phase_words

#: A row's last log line is cut to this many characters.
LAST_LINE_CHARS = 120
#: Each state's colour: its badge, its square in the grid.
STATE_COLORS = {
    HostState.PENDING: "#9e9e9e",
    HostState.IDLE: "#26a69a",
    HostState.READY: "#64b5f6",
    HostState.RUNNING: "#1e88e5",
    HostState.SUCCEEDED: "#43a047",
    HostState.FAILED: "#e53935",
    HostState.STOPPED: "#78909c",  # grey, never red: kinetic_nb stopped it (asked to, or after another failed)
    HostState.STOPPING: "#b0bec5",
    HostState.LOST: "#6d4c41",
    HostState.QUIET: "#8e24aa",
}


def seconds_text(value: float) -> str:
    """``12.3 s``, or ``14 min`` past ten minutes."""
    return f"{value:.1f} s" if value < 600 else f"{value / 60:.0f} min"


def rank_label(host: HostSnapshot, procs_per_host: int) -> str:
    """A process's short name in a row: its host's index, or ``host.process`` where hosts run several."""
    return process_label(host.index, procs_per_host)


def phase_text(host: HostSnapshot) -> str:
    """What a host's row says it is doing: the words for its phase, none once it has succeeded (its last phase,
    "shutting down", is true of its process but not news to the user)."""
    return "" if host.state == HostState.SUCCEEDED.value else phase_words(host.phase)


def badge_html(state: str) -> str:
    """A state as a small coloured label."""
    return (f'<span style="color:white;background:{STATE_COLORS.get(state, "#999")};border-radius:3px;'
            f'padding:0 4px">{html.escape(state)}</span>')


def row_html(host: HostSnapshot, now: float, label: str | None = None) -> str:
    """A host's row: its name (a star for the leader), state, phase, time in the cell and last line."""
    leader = " ★" if host.is_leader else ""
    last = html.escape(host.row_line[:LAST_LINE_CHARS])
    label = str(host.index) if label is None else label
    return (
        '<div style="display:flex;gap:10px;font-family:monospace;font-size:12px;white-space:nowrap">'
        f'<span style="width:4.5em" title="{"leader" if host.is_leader else "worker"}">{label}{leader}</span>'
        f'<span style="width:6.5em">{badge_html(host.state)}</span>'
        f'<span style="width:13em">{html.escape(phase_text(host))}</span>'
        f'<span style="width:5em;text-align:right">{seconds_text(host.elapsed(now))}</span>'
        f'<span style="overflow:hidden;text-overflow:ellipsis;color:#555">{last}</span></div>'
    )


def host_title(host: HostSnapshot, name: str | None = None) -> str:
    """``host 5 (leader) · failed · in the cell``: a drill-down's title, a square's tooltip."""
    name = f"host {host.index}" if name is None else name
    phase = f" · {phase_text(host)}" if phase_text(host) else ""  # none: succeeded, or withdrawn before it began
    return f"{name}{' (leader)' if host.is_leader else ''} · {host.state}{phase}"
