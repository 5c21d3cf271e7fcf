"""A per-host phase timeline: where each host spent its time, and who held the others up."""

from __future__ import annotations

import statistics
from typing import Any

from kinetic_nb.runner.protocol import Phase
from kinetic_nb.state import HostState, JobSnapshot, phase_words

PHASE_COLORS = {
    Phase.ENVIRONMENT_INSTALL.value: "#a1887f",
    Phase.STARTUP.value: "#cfd8dc",
    Phase.PLAN_CHECK.value: "#b0bec5",
    Phase.PAYLOAD_LOAD.value: "#90a4ae",
    Phase.START_BARRIER.value: "#ffe082",
    Phase.DISTRIBUTED_INIT.value: "#ce93d8",
    Phase.EXECUTE.value: "#64b5f6",
    Phase.RESULT_SERIALIZATION.value: "#81c784",
    Phase.RESULT_UPLOAD.value: "#4db6ac",
    Phase.TEARDOWN.value: "#e0e0e0",
}
#: The outline of a profiled cell's span (``--profile``).
PROFILED_COLOR = "#6a1b9a"
#: A host whose cell ran this many times longer than the median is a straggler.
STRAGGLER_FACTOR = 1.5


def phase_spans(history: tuple[tuple[str, float], ...], end: float) -> list[tuple[str, float, float]]:
    """``(phase, start, duration)`` for each phase a host went through."""
    spans = []
    for position, (phase, start) in enumerate(history):
        stop = history[position + 1][1] if position + 1 < len(history) else end
        spans.append((phase, start, max(0.0, stop - start)))
    return spans


def _show_figures_inline() -> None:
    """Let IPython draw a bare ``Figure`` as a PNG (pyplot would otherwise have to be imported first)."""
    try:
        from IPython import get_ipython
        from IPython.core.pylabtools import select_figure_formats
        from matplotlib.figure import Figure
    except ImportError:
        return
    shell = get_ipython()
    if shell is None:
        return
    png = shell.display_formatter.formatters["image/png"]
    try:
        png.lookup_by_type(Figure)
    except KeyError:
        select_figure_formats(shell, {"png"})


def plot_timeline(snapshot: JobSnapshot) -> Any:
    """A matplotlib ``Figure``: one row per process (per host where each runs one), one coloured bar per phase.

    A profiled cell's span is outlined and hatched on each host (``--profile``).
    Failed hosts end in a red cross, stopped hosts in an orange bar; the
    leader's row is labelled; hosts whose cell ran ``STRAGGLER_FACTOR`` times
    longer than the median are outlined and labelled as stragglers.
    """
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    _show_figures_inline()
    origin = snapshot.submitted_at
    hosts = snapshot.hosts
    figure = Figure(figsize=(9, 1.2 + 0.3 * min(len(hosts), 64)), layout="constrained")
    axes = figure.add_subplot()
    executes: dict[int, float] = {}
    for host in hosts:
        end = host.ended_at or snapshot.taken_at
        spans = phase_spans(host.history, end)
        for phase, _start, duration in spans:
            if phase == Phase.EXECUTE.value:
                executes[host.index] = duration
        bars = [(start - origin, duration) for _, start, duration in spans]
        colors = [PHASE_COLORS.get(phase, "#999999") for phase, _, _ in spans]
        axes.broken_barh(bars, (host.index - 0.4, 0.8), facecolors=colors, label=f"host {host.index}")
        if host.profiled:  # the span its framework's profiler recorded, outlined over the execute phase
            start, stop = host.profiled
            axes.broken_barh([(start - origin, max(0.0, stop - start))], (host.index - 0.45, 0.9), facecolors="none",
                             edgecolors=PROFILED_COLOR, hatch="///", linewidth=1)
        if host.state == HostState.FAILED:
            axes.plot([end - origin], [host.index], marker="x", color="#d32f2f", markersize=9, mew=2)
        elif host.state == HostState.STOPPED:
            axes.plot([end - origin], [host.index], marker="|", color="#ef6c00", markersize=14, mew=3)
    if len(executes) >= 2:
        typical = statistics.median(executes.values())
        for index, duration in executes.items():
            if typical > 0 and duration > STRAGGLER_FACTOR * typical:
                axes.annotate("straggler", (0, index), xytext=(4, 0), textcoords="offset points", va="center",
                              color="#d32f2f", fontsize=8, annotation_clip=False)
                axes.axhspan(index - 0.45, index + 0.45, fill=False, edgecolor="#d32f2f", linewidth=1)
    axes.set_yticks([host.index for host in hosts])
    axes.set_yticklabels([_row_label(host.index, snapshot.procs_per_host) for host in hosts],
                         fontsize=8 if len(hosts) <= 64 else 4)
    axes.invert_yaxis()
    axes.set_xlabel("seconds since submission")
    axes.set_title(f"{snapshot.label or snapshot.job_id} · {snapshot.status}", fontsize=10)
    seen = {phase for host in hosts for phase, _ in host.history}
    handles = [Patch(color=color, label=phase_words(phase)) for phase, color in PHASE_COLORS.items() if phase in seen]
    if any(host.profiled for host in hosts):
        handles.append(Patch(facecolor="none", edgecolor=PROFILED_COLOR, hatch="///", label="profiled"))
    axes.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return figure


def _row_label(rank: int, procs_per_host: int) -> str:
    """``0 (leader)``, ``3``; where hosts run several processes ``host 1 · proc 0 · rank 2``."""
    name = str(rank) if procs_per_host == 1 else \
        f"host {rank // procs_per_host} · proc {rank % procs_per_host} · rank {rank}"
    return f"{name} (leader)" if rank == 0 else name
