"""The live host-status panel (stock ipywidgets), and its plain-text twin.

``HostPanel.update(snapshot)`` draws a ``JobSnapshot``: a header (job, backend,
accelerator, elapsed time, state) over a progress bar whose style says how the
job went (danger on failure, success at the end), a row per host (index,
leader mark, state, phase, elapsed time, last log line) and a drill-down per
host (its log tail and, when it failed, its remote traceback). Above
``GRID_ABOVE`` hosts the rows become a compact grid of coloured squares
(``grid.py``), a short list of the hosts that differ (failed, lost, quiet,
the slowest), the hosts' last lines grouped (``grouping.py``: identical lines
once, with the hosts that printed them), and drill-downs for the hosts that
differ; such a panel draws at most once per ``redraw_interval`` and resends
only the rows of squares that changed. Hosts with identical tracebacks are
grouped into one line.

Outside a widget frontend the same snapshots are drawn as text
(``TextStatus``); ``text_summary`` and ``html_summary`` are the static forms.
``watch_in_background`` keeps a view current from any ``SnapshotSource``.
"""

from __future__ import annotations

import contextlib
import contextvars
import html
import logging
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import IO, Any

from kinetic_nb.notebook.display.grid import (
    GRID_ROW,
    MAX_DIFFERING,
    differing_counts,
    differing_hosts,
    differing_html,
    grid_row,
    grid_style,
    grouped_host_lines,
    left_out_line,
    lines_html,
    many_word,
    square,
    square_key,
    static_grid_html,
)
from kinetic_nb.notebook.display.memory import memory_detail, memory_flags, memory_line
from kinetic_nb.notebook.display.rows import (
    LAST_LINE_CHARS,
    STATE_COLORS,
    badge_html,
    host_title,
    phase_text,
    rank_label,
    row_html,
    seconds_text,
)
from kinetic_nb.runner.frame_locals import NOTE_NAMES, FrameLocals
from kinetic_nb.runner.logs import shown_text
from kinetic_nb.runner.protocol import MAX_RANGES, host_ranges
from kinetic_nb.runner.stacks import readable_stacks, where_the_cell_is
from kinetic_nb.state import (
    SNAPSHOT_INTERVAL_S,
    HostSnapshot,
    HostState,
    JobSnapshot,
    JobStatus,
    SnapshotSource,
    is_chatter,
)

#: Above this many hosts, one row each no longer fits a cell's output.
GRID_ABOVE = 32
#: Hosts shown in the drill-down of a grid (the ones that are not fine).
MAX_DETAILS = 32
#: Log lines shown in a host's drill-down.
DETAIL_LINES = 40
#: A brief view's text twin (a session's cell) says nothing until its cell has run this long.
BRIEF_QUIET_S = 1.0
#: A grid panel draws at most once per this many seconds per host (and never more often than the poller looks,
#: ``SNAPSHOT_INTERVAL_S``): every 0.5 s at 256 hosts, every 2 s at 1,024. A draw may resend every square (about
#: 60 bytes each, when hosts end in a scattered order), and its CPU grows with the hosts: this keeps a big panel's
#: kernel CPU and bytes sent per second at or under a 16-host panel's at four draws a second
#: (``benchmarks/panel.py`` measures both). A cell's last draw is never skipped.
REDRAW_S_PER_HOST = 1 / 512
#: The progress bar's style for each job state (tqdm's meanings).
BAR_STYLES = {JobStatus.PENDING: "", JobStatus.RUNNING: "info", JobStatus.SUCCEEDED: "success",
              JobStatus.FAILED: "danger", JobStatus.CANCELLED: "warning"}

logger = logging.getLogger(__name__)

#: How a host's stacks begin where it gave none (stopped by a signal, or it did not answer in time).
NO_ANSWER = "no answer: "

#: A frame of the cell in a host's traceback: ``<kinetic In[3]>`` (the notebook's name), or ``<kinetic cell>``.
_CELL_LINE = re.compile(r'File "<kinetic (?P<cell>[^"]*)>", line (?P<line>\d+)')


def redraw_interval(hosts: int) -> float:
    """Seconds between two draws of a grid panel of ``hosts`` (``REDRAW_S_PER_HOST``): the poller's interval up
    to 128 hosts, 2 s at 1,024."""
    return max(SNAPSHOT_INTERVAL_S, REDRAW_S_PER_HOST * hosts)


def _failure_label(traceback: str, message: str) -> str:
    last = next((line for line in reversed(traceback.splitlines()) if line.strip()), message)
    exception_type = last.split(":", 1)[0].strip().rsplit(".", 1)[-1] or "error"
    frames = list(_CELL_LINE.finditer(traceback))
    if not frames:
        return exception_type
    cell, line = frames[-1]["cell"], frames[-1]["line"]
    return f"{exception_type} at cell line {line}" if cell == "cell" else f"{exception_type} at {cell}, line {line}"


def failure_groups(hosts: Iterable[HostSnapshot]) -> list[tuple[list[int], str, str]]:
    """Failed or lost hosts grouped by identical traceback (or ending): ``(indices, label, traceback)``."""
    groups: dict[str, list[HostSnapshot]] = {}
    for host in hosts:
        if host.state in (HostState.FAILED, HostState.LOST):
            groups.setdefault(host.traceback or host.message or host.exit_summary or host.state, []).append(host)
    result = []
    for key, members in groups.items():
        first = members[0]
        label = _failure_label(first.traceback, first.message) if first.traceback or first.message else key
        result.append(([h.index for h in members], label, first.traceback))
    return sorted(result, key=lambda group: group[0][0])


def failure_lines(snapshot: JobSnapshot) -> list[str]:
    """``"hosts 1-63: the same ValueError at In[3], line 12"`` (``ranks`` where hosts run several processes), one
    line per group; above ``GRID_ABOVE`` hosts, the first ``MAX_DIFFERING`` groups and a line counting the rest."""
    lines = []
    many = "ranks" if snapshot.procs_per_host > 1 else "hosts"
    groups = failure_groups(snapshot.hosts)
    limit = MAX_DIFFERING if len(snapshot.hosts) > GRID_ABOVE else None
    for indices, label, traceback in groups[:limit]:
        if len(indices) == 1:
            lines.append(f"{snapshot.name_of(indices[0])}: {label}")
        else:
            lines.append(f"{many} {host_ranges(indices, limit=MAX_RANGES)}: {'the same ' if traceback else ''}{label}")
    rest = [index for indices, _, _ in groups[len(lines):] for index in indices]
    if rest:
        lines.append(f"… and {len(rest)} more failed or lost with failures of their own: "
                     f"{host_ranges(rest, limit=MAX_RANGES)}")
    return lines


def quiet_lines(snapshot: JobSnapshot, limit: int | None = None) -> list[str]:
    """One line per quiet host, the first ``limit`` of them (the rest counted on one more line): where its cell
    is (the user's frame and its source line) and what it waits in."""
    lines = []
    quiet = [host for host in snapshot.hosts if host.state == HostState.QUIET]
    for host in quiet[:limit]:
        where = where_the_cell_is(host.stacks)
        text = f"{snapshot.name_of(host.index)} is quiet: no output and no phase change since another host ended"
        if not where and host.stacks.startswith(NO_ANSWER):  # why it cannot say where: stopped by a signal, ...
            where = host.stacks.splitlines()[0].removeprefix(NO_ANSWER)
            lines.append(f"{text}; {where}")
            continue
        lines.append(text + (f"; at {where}" if where else ""))
    if limit is not None and len(quiet) > limit:
        lines.append(f"… and {len(quiet) - limit} more quiet: "
                     f"{host_ranges([host.index for host in quiet[limit:]], limit=MAX_RANGES)}")
    return lines


def _header_text(snapshot: JobSnapshot) -> str:
    per = snapshot.procs_per_host
    count = len(snapshot.hosts) // per
    shape = f"{count} host{'' if count == 1 else 's'}" + (f" x {per} processes" if per > 1 else "")
    return (f"{snapshot.label or snapshot.job_id} · {snapshot.backend} · {snapshot.accelerator} · {shape} · "
            f"{seconds_text(snapshot.elapsed)} · {snapshot.status_word}")


#: A host's state in its row, where it runs several processes: the first of these its processes are in.
HOST_STATE_ORDER = (HostState.FAILED, HostState.LOST, HostState.QUIET, HostState.STOPPED, HostState.STOPPING,
                    HostState.RUNNING,
                    HostState.READY, HostState.PENDING, HostState.IDLE, HostState.SUCCEEDED)


def host_summary(host: int, processes: tuple[HostSnapshot, ...]) -> HostSnapshot:
    """Host ``host``'s row, from its processes: the state that matters most among theirs (a failure first, one
    of a process's own before a peer's loss), that process's phase and time, and a line tagged by rank: that
    process's own (its failure's) where it is not fine, else the last line of the first process that printed one."""
    rank = {state.value: order for order, state in enumerate(HOST_STATE_ORDER)}
    worst = min(processes, key=lambda process: (rank.get(process.state, len(rank)), not process.failed_on_its_own,
                                                process.index))
    speaker = worst if not worst.fine and worst.row_line else \
        next((process for process in processes if process.row_line), None)
    last = f"[rank {speaker.index}] {speaker.row_line}" if speaker is not None else ""
    memory = {figure: sum(process.memory[figure] for process in processes if figure in process.memory)
              for figure in ("rss", "peak_rss", "device", "device_peak")
              if any(figure in process.memory for process in processes)}  # the host's: its processes' together
    return HostSnapshot(index=host, state=worst.state, phase=worst.phase, started_at=worst.started_at,
                        updated_at=worst.updated_at, last_line=last, exit=worst.exit, memory=memory)


def _counts_text(snapshot: JobSnapshot) -> str:
    counts = snapshot.counts()
    return ", ".join(f"{counts[state]} {state}" for state in STATE_COLORS if counts[state])


def _detail_html(host: HostSnapshot) -> str:
    parts = []
    if host.memory and (host.ended or host.state == HostState.IDLE):  # figures of its cell's end, never mid-cell
        parts.append(f'<div style="font-family:monospace;color:#555">{html.escape(memory_detail(host))}</div>')
    if host.traceback:
        parts.append(f'<pre style="color:#b71c1c;white-space:pre-wrap">{html.escape(host.traceback)}</pre>')
        parts.extend(_locals_html(frame) for frame in host.frame_locals if frame.names)
    elif host.message:
        parts.append(f"<pre>{html.escape(host.message)}</pre>")
    if host.exit is not None:
        parts.append(f"<div>process {html.escape(host.exit.describe())}</div>")
    if host.stacks:  # the cell's thread first, from the user's frame: whole, not in a small scroll box
        parts.append(f"<div>quiet: no output and no phase change since another host ended; where it is:</div>"
                     f'<pre style="white-space:pre-wrap">{html.escape(readable_stacks(host.stacks))}</pre>')
    # Framework chatter stays out, as it stays out of the cell's output.
    tail = shown_text("\n".join([line for line in host.log_tail if not is_chatter(line)][-DETAIL_LINES:]))
    empty = "(no output)" if host.ended else "(no output yet)"
    parts.append(f'<pre style="max-height:20em;overflow:auto">{html.escape(tail) or empty}</pre>')
    return "".join(parts)


def _locals_html(frame: FrameLocals) -> str:
    """A failing frame's variables under its traceback: one line each, as its host described them."""
    rows = "\n".join(f"{name} = {text}" for name, text in frame.names)
    rows += f"\n... and {frame.omitted} more" if frame.omitted else ""
    return (f'<div style="font-family:monospace;color:#555">variables {html.escape(frame.where)} '
            f'({html.escape(frame.location)}):</div><pre style="white-space:pre-wrap;margin-top:0">'
            f'{html.escape(rows)}</pre>')


def locals_lines(snapshot: JobSnapshot) -> list[str]:
    """The text twin's: the first few variables of each failed host's failing frames (of the first
    ``MAX_DIFFERING`` such frames above ``GRID_ABOVE`` hosts)."""
    lines = [f"{snapshot.name_of(host.index)} variables {frame.text(NOTE_NAMES)}"
             for host in snapshot.hosts if host.state == HostState.FAILED for frame in host.frame_locals if frame.names]
    return lines[:MAX_DIFFERING] if len(snapshot.hosts) > GRID_ABOVE else lines


def _processes_html(snapshot: JobSnapshot, processes: tuple[HostSnapshot, ...]) -> str:
    """A host's drill-down where it runs several processes: a row per process, then each one's own drill-down
    (its traceback, its log tail) under its name."""
    rows = "".join(row_html(process, snapshot.taken_at, rank_label(process, snapshot.procs_per_host))
                   for process in processes)
    details = "".join(f"<div><b>{html.escape(host_title(process, snapshot.name_of(process.index)))}</b></div>"
                      f"{_detail_html(process)}" for process in processes)
    return rows + details


def _memory_lines(snapshot: JobSnapshot) -> tuple[list[str], list[str]]:
    """Once the cell ended: each host's memory at its end, and the hosts whose memory stands out. Nothing while
    it runs: a host's figures are those of the end of its last cell, never of this one so far."""
    if not snapshot.status.done:
        return [], []
    hosts = _per_host(snapshot)
    measured = memory_line(hosts)
    return [measured] if measured else [], memory_flags(hosts)


def _failures_html(snapshot: JobSnapshot) -> str:
    """Each host's memory at its cell's end (grey), the failures, then the hosts whose memory stands out (amber:
    worth a look, not an error)."""
    measured, flagged = _memory_lines(snapshot)
    memory = "".join(f'<div style="color:#555;font-family:monospace">{html.escape(line)}</div>' for line in measured)
    failures = "".join(f'<div style="color:#b71c1c;font-family:monospace">{html.escape(line)}</div>'
                       for line in failure_lines(snapshot))
    flags = "".join(f'<div style="color:#b26a00;font-family:monospace">{html.escape(line)}</div>'
                    for line in flagged)
    return memory + failures + flags


def _per_host(snapshot: JobSnapshot) -> list[HostSnapshot]:
    """A row per host: its processes together, where hosts run several."""
    if snapshot.procs_per_host > 1:
        return [host_summary(index, processes) for index, processes in snapshot.by_host()]
    return list(snapshot.hosts)


class HostPanel:
    """The live panel: stock ipywidgets, changed only by assigning traits.

    Parameters
    ----------
    hosts : int
        Processes in all.
    brief : bool
        A session's cell: once it succeeded, only the header stays.
    procs_per_host : int
        Processes on each host.
    clock : callable
        Seconds, for the grid's ``redraw_interval`` (``time.monotonic``).
    """

    def __init__(self, hosts: int, *, brief: bool = False, procs_per_host: int = 1,
                 clock: Callable[[], float] = time.monotonic):
        import ipywidgets as widgets

        #: A session's cell: once it succeeded, only the header stays (its output and value follow it).
        self.brief = brief
        #: Where hosts run several processes, a row is a host and its drill-down lists its processes.
        self.procs_per_host = procs_per_host
        self.compact = hosts // procs_per_host > GRID_ABOVE
        self.header = widgets.HTML()
        # The bar counts hosts done with the cell; its label (the state) is never cut.
        self.progress = widgets.IntProgress(min=0, max=hosts, value=0, layout=widgets.Layout(width="100%"),
                                            style={"description_width": "initial"})
        self.failures = widgets.HTML()
        self.interval = redraw_interval(hosts) if self.compact else 0.0
        self._clock = clock
        self._drawn_at: float | None = None
        if self.compact:
            self.grid_style = widgets.HTML(grid_style(STATE_COLORS))  # sent once, with the panel
            square_row = widgets.Layout(margin="0", height="12px")
            self.grid = widgets.VBox([widgets.HTML(layout=square_row) for _ in range(-(-hosts // GRID_ROW))],
                                     layout=widgets.Layout(margin="2px 0"))
            #: Each host's square and what it showed: a square is made again only when its host's state changed.
            self._squares = [""] * hosts
            self._square_keys: list[tuple[str, str] | None] = [None] * hosts
            self.differing = widgets.HTML()
            self.lines = widgets.HTML()
            self.details = widgets.Accordion()
            body = [self.grid_style, self.grid, self.differing, self.lines]
            #: The drill-downs' widgets, made once: the hosts that differ come and go, their widgets stay.
            self._detail_pool = [widgets.HTML() for _ in range(min(MAX_DETAILS, hosts))]
        else:
            tight = widgets.Layout(margin="0", height="22px")  # rows read as one table
            self.rows = [widgets.HTML(layout=tight) for _ in range(hosts // procs_per_host)]
            self.details = widgets.Accordion(children=[widgets.HTML() for _ in range(hosts // procs_per_host)])
            body = [widgets.VBox(self.rows)]
        self.body = widgets.VBox([self.progress, *body, self.failures, self.details], layout=widgets.Layout(
            margin="0"))
        self.widget = widgets.VBox([self.header, self.body])

    def update(self, snapshot: JobSnapshot, *, final: bool = False) -> None:
        """Draw ``snapshot``; each widget sends at most one message, and only for a value that changed. A grid
        panel draws at most once per ``interval``: a snapshot that comes sooner is skipped, unless the cell
        ended or it is the ``final`` one."""
        now = self._clock()
        if not (final or snapshot.status.done or self._drawn_at is None or now - self._drawn_at >= self.interval):
            return
        self._drawn_at = now
        done = sum(1 for host in snapshot.hosts if host.ended)
        with contextlib.ExitStack() as stack:
            stack.enter_context(self.progress.hold_sync())
            stack.enter_context(self.details.hold_sync())
            self.header.value = f"<b>{html.escape(_header_text(snapshot))}</b> &nbsp; {_counts_text(snapshot)}"
            self.progress.value = done
            self.progress.bar_style = BAR_STYLES[snapshot.status]
            self.progress.description = snapshot.status_word
            self.failures.value = _failures_html(snapshot)
            self.body.layout.display = "none" if self.brief and snapshot.status is JobStatus.SUCCEEDED else None
            if self.compact:
                self._update_grid(snapshot)
            else:
                self._update_rows(snapshot)

    def _update_rows(self, snapshot: JobSnapshot) -> None:
        if snapshot.procs_per_host > 1:
            self._update_host_rows(snapshot)
            return
        for host, row, detail in zip(snapshot.hosts, self.rows, self.details.children, strict=True):
            row.value = row_html(host, snapshot.taken_at)
            detail.value = _detail_html(host)
        titles = tuple(host_title(host) for host in snapshot.hosts)
        if tuple(self.details.titles) != titles:
            self.details.titles = titles

    def _update_host_rows(self, snapshot: JobSnapshot) -> None:
        """A row per host (its processes summed up), and a drill-down per host with a row per process."""
        summaries = [host_summary(index, processes) for index, processes in snapshot.by_host()]
        for (_, processes), summary, row, detail in zip(snapshot.by_host(), summaries, self.rows,
                                                        self.details.children, strict=True):
            row.value = row_html(summary, snapshot.taken_at)
            detail.value = _processes_html(snapshot, processes)
        titles = tuple(f"{host_title(summary)} · {snapshot.procs_per_host} processes" for summary in summaries)
        if tuple(self.details.titles) != titles:
            self.details.titles = titles

    def _update_grid(self, snapshot: JobSnapshot) -> None:
        """The rows of squares whose hosts changed, the hosts that differ, the grouped lines, the drill-downs."""
        def title(host: HostSnapshot) -> str:
            return host_title(host, snapshot.name_of(host.index))

        changed_rows = set()
        for position, host in enumerate(snapshot.hosts):
            key = square_key(host)
            if key != self._square_keys[position]:
                self._square_keys[position] = key
                self._squares[position] = square(host, title(host))
                changed_rows.add(position // GRID_ROW)
        for row in sorted(changed_rows):  # a row's value is not even made when none of its squares changed
            self.grid.children[row].value = grid_row(self._squares[row * GRID_ROW:(row + 1) * GRID_ROW])
        differing = differing_hosts(snapshot.hosts)
        self.differing.value = differing_html(snapshot, differing)
        self.lines.value = lines_html(snapshot)
        shown = differing[:MAX_DETAILS]
        if len(self.details.children) != len(shown):
            self.details.children = self._detail_pool[:len(shown)]
        for host, detail in zip(shown, self.details.children, strict=True):
            detail.value = _detail_html(host)
        titles = tuple(title(host) for host in shown)
        if tuple(self.details.titles) != titles:
            self.details.titles = titles


def text_summary(snapshot: JobSnapshot, *, brief: bool = False) -> str:
    """The job and every host, as plain text; above GRID_ABOVE hosts, as the grid view: the counts, the hosts
    that differ, and the hosts' last lines grouped. ``brief``: a session's cell that succeeded is its header
    alone."""
    lines = [_header_text(snapshot)]
    if brief and snapshot.status is JobStatus.SUCCEEDED:
        return f"{lines[0]} · {_counts_text(snapshot)}"
    hosts: tuple[HostSnapshot, ...] | list[HostSnapshot] = snapshot.hosts
    big = len(hosts) > GRID_ABOVE
    left_out: list[HostSnapshot] = []
    if big:
        lines.append(_counts_text(snapshot))
        differing = differing_hosts(snapshot.hosts)
        hosts, left_out = differing[:MAX_DIFFERING], differing[MAX_DIFFERING:]
        if differing:
            lines.append(f"{many_word(snapshot)} that differ: {differing_counts(snapshot.hosts)}")
    per = snapshot.procs_per_host
    if hosts:
        lines.append(f"{'host' if per == 1 else 'h.proc':>6}  {'state':<9}  {'phase':<20}  {'time':>7}  "
                     "last line / exit")
    for host in hosts:
        leader = "*" if host.is_leader else " "
        # A host that ended badly: how; one kinetic_nb stopped (its state says so): its last line, as any other.
        tail = host.exit_summary if host.exit and not host.fine and host.state != HostState.STOPPED.value else \
            host.row_line[:LAST_LINE_CHARS]
        lines.append(f"{rank_label(host, per):>5}{leader}  {host.state:<9}  {phase_text(host):<20}  "
                     f"{seconds_text(host.elapsed(snapshot.taken_at)):>7}  {tail}")
    if left_out:
        lines.append(left_out_line(snapshot, left_out))
    memory, flags = _memory_lines(snapshot)
    lines.extend(memory)
    lines.extend(failure_lines(snapshot))
    lines.extend(locals_lines(snapshot))
    lines.extend(flags)
    lines.extend(quiet_lines(snapshot, MAX_DIFFERING if big else None))
    grouped = grouped_host_lines(snapshot) if big else []
    if grouped:
        lines.append("last lines:")
        lines.extend(f"  {line}" for line in grouped)
    return "\n".join(lines)


def html_summary(snapshot: JobSnapshot, *, brief: bool = False) -> str:
    """A static HTML snapshot: what a saved notebook shows without the widget (``brief``: as ``text_summary``)."""
    if brief and snapshot.status is JobStatus.SUCCEEDED:
        return f"<div><b>{html.escape(_header_text(snapshot))}</b> {_counts_text(snapshot)}</div>"
    big = len(snapshot.hosts) > GRID_ABOVE
    hosts = differing_hosts(snapshot.hosts)[:MAX_DIFFERING] if big else snapshot.hosts
    rows = "".join(
        f"<tr><td>{rank_label(host, snapshot.procs_per_host)}{' ★' if host.is_leader else ''}</td><td>{badge_html(host.state)}</td>"
        f"<td>{html.escape(phase_text(host))}</td><td>{seconds_text(host.elapsed(snapshot.taken_at))}</td>"
        f"<td><code>{html.escape(host.row_line[:LAST_LINE_CHARS])}</code></td></tr>"
        for host in hosts
    )
    grid, lines = (static_grid_html(snapshot), lines_html(snapshot)) if big else ("", "")
    return (f"<div><b>{html.escape(_header_text(snapshot))}</b> {_counts_text(snapshot)}{grid}"
            f"<table><tr><th>host</th><th>state</th><th>phase</th><th>time</th><th>last line</th></tr>{rows}"
            f"</table>{_failures_html(snapshot)}{lines}</div>")


class TextStatus:
    """The text twin: one status line updated in place, then a per-host summary."""

    def __init__(self, stream: IO[str] | None = None, *, brief: bool = False):
        self.stream = stream or sys.stderr
        self.brief = brief
        self._last = ""

    def _line(self, snapshot: JobSnapshot) -> str:
        return f"{snapshot.label or snapshot.job_id}: {_counts_text(snapshot)} · {seconds_text(snapshot.elapsed)}"

    def update(self, snapshot: JobSnapshot) -> None:
        if self.brief and snapshot.elapsed < BRIEF_QUIET_S:
            return  # a quick session cell: its summary line alone
        line = self._line(snapshot)
        interactive = getattr(self.stream, "isatty", lambda: False)()
        if interactive:
            self.stream.write("\r" + line.ljust(len(self._last)))
        elif line.split(" · ")[0] != self._last.split(" · ")[0]:  # a log gets a line per change of states
            self.stream.write(line + "\n")
        self.stream.flush()
        self._last = line

    def close(self, snapshot: JobSnapshot) -> None:
        if getattr(self.stream, "isatty", lambda: False)():
            self.stream.write("\n")
        self.stream.write(text_summary(snapshot, brief=self.brief) + "\n")
        self.stream.flush()

    def settle(self, final: JobSnapshot, settled: Callable[[], JobSnapshot | None]) -> threading.Thread | None:
        """Nothing: the summary is printed already, and a printed line is not drawn again."""
        return None


def in_widget_frontend() -> bool:
    """Whether we run in a Jupyter kernel (whose frontend can show widgets)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


class WidgetView:
    """A ``HostPanel`` displayed in the cell, with a static HTML and text fallback."""

    def __init__(self, hosts: int, *, brief: bool = False, procs_per_host: int = 1):
        from IPython.display import display

        self.brief = brief
        self.panel = HostPanel(hosts, brief=brief, procs_per_host=procs_per_host)
        self._display = display(self._bundle(None), raw=True, display_id=True)

    def _bundle(self, snapshot: JobSnapshot | None) -> dict[str, Any]:
        bundle: dict[str, Any] = {
            "application/vnd.jupyter.widget-view+json": {
                "version_major": 2, "version_minor": 0, "model_id": self.panel.widget.model_id,
            },
            "text/plain": text_summary(snapshot, brief=self.brief) if snapshot else "kinetic job starting",
        }
        if snapshot is not None:
            bundle["text/html"] = html_summary(snapshot, brief=self.brief)
        return bundle

    def update(self, snapshot: JobSnapshot) -> None:
        self.panel.update(snapshot)

    def close(self, snapshot: JobSnapshot) -> None:
        """The final update, made before the cell returns so the saved notebook keeps it."""
        self.panel.update(snapshot, final=True)
        self._display.update(self._bundle(snapshot), raw=True)

    def settle(self, final: JobSnapshot, settled: Callable[[], JobSnapshot | None]) -> threading.Thread | None:
        """Once the cell returned ``final`` with hosts still being stopped, redraw it from a thread when
        ``settled()`` says they have ended, so the panel's last state stays the truth; in the cell's context
        (the kernel's parent header), as :func:`watch_in_background` is."""
        if not any(host.state == HostState.STOPPING.value for host in final.hosts):
            return None

        def follow() -> None:
            try:
                snapshot = settled()
            except Exception:  # noqa: BLE001 - a background redraw; the cell has returned its outcome
                return
            if snapshot is not None:
                self.close(snapshot)

        context = contextvars.copy_context()
        thread = threading.Thread(target=context.run, args=(follow,), name=f"kinetic-settle-{final.job_id}",
                                  daemon=True)
        thread.start()
        return thread


def live_view(hosts: int, *, widgets: bool | None = None, stream: IO[str] | None = None, brief: bool = False,
              procs_per_host: int = 1) -> WidgetView | TextStatus:
    """The panel when a widget frontend can show it, else its text twin: ``hosts`` processes in all,
    ``procs_per_host`` on each host. ``brief`` (a session's cell): once the cell succeeded, its header alone
    stays (the rows matter while it runs, or when it failed)."""
    if widgets is None:
        widgets = in_widget_frontend()
    return WidgetView(hosts, brief=brief, procs_per_host=procs_per_host) if widgets else TextStatus(stream, brief=brief)


def watch_in_background(source: SnapshotSource, view: WidgetView | TextStatus | None = None, *,
                        interval: float = SNAPSHOT_INTERVAL_S) -> threading.Thread:
    """Keep ``view`` current from a thread until ``source``'s job ends.

    The thread runs in a copy of the caller's context, which carries the
    kernel's parent header (ipykernel 7 keeps it in a context variable), so its
    messages belong to the cell that started it, not whichever cell runs now.

    Parameters
    ----------
    source : SnapshotSource
        Polled with ``source.snapshot()`` every ``interval`` seconds; nothing
        else of it is called.
    view : WidgetView or TextStatus, optional
        What to draw on (default: ``live_view`` for ``source.plan``'s processes).
    interval : float
        Seconds between two polls.

    Returns
    -------
    threading.Thread
        The started daemon thread; it ends after the view's final update.
    """
    view = view if view is not None else live_view(source.plan.world_size, procs_per_host=source.plan.procs_per_host)
    context = contextvars.copy_context()

    def follow() -> None:
        snapshot = source.snapshot()
        while not snapshot.status.done:
            view.update(snapshot)
            time.sleep(interval)
            snapshot = source.snapshot()
        view.close(snapshot)

    name = f"kinetic-watch-{source.plan.job_id}"
    thread = threading.Thread(target=context.run, args=(follow,), name=name, daemon=True)
    thread.start()
    return thread
