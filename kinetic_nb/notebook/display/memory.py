"""Each host's memory at its cell's end, as the panel and its text twin show it, and the host that stands out.

A host's status carries, at a cell's end, its process's resident memory and
its peak, and its accelerator's where the framework reports it
(``runner.memory``). A host is flagged when it holds at least
:data:`SKEW_RATIO` times the median of the others *and* at least
:data:`SKEW_BYTES` more: on one of SPMD's identical hosts that is a leak, or a
shard larger than its peers'. Both conditions, so that small processes that
differ by a few megabytes (a ratio) and large ones that differ by a sliver (an
amount) are left alone.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from kinetic_nb.runner.memory import format_bytes
from kinetic_nb.state import HostSnapshot

__all__ = ["SKEW_BYTES", "SKEW_RATIO", "memory_detail", "memory_flags", "memory_line", "stands_out"]

#: A host holding this many times the others' median, and SKEW_BYTES more, stands out.
SKEW_RATIO = 1.5
SKEW_BYTES = 256 * 1024**2
#: What is compared, and how a flag names it.
FIGURES = (("rss", "resident"), ("device", "accelerator"))
#: Above this many hosts the memory line gives the range, not every host.
LISTED_HOSTS = 16


def stands_out(size: int, others: Sequence[int]) -> bool:
    """Whether ``size`` is above the median of ``others`` by both :data:`SKEW_RATIO` and :data:`SKEW_BYTES`."""
    if not others:
        return False
    median = statistics.median(others)
    return size >= SKEW_RATIO * median and size - median >= SKEW_BYTES


def memory_flags(hosts: Sequence[HostSnapshot], noun: str = "host") -> list[str]:
    """One line for each host whose memory stands out against the others' (a leak, or a skewed shard)."""
    lines = []
    for figure, name in FIGURES:
        measured = [(host.index, host.memory[figure]) for host in hosts if figure in host.memory]
        for index, size in measured:
            others = [other for at, other in measured if at != index]
            if stands_out(size, others):
                median = statistics.median(others)
                lines.append(f"{noun} {index} holds {format_bytes(size)} of {name} memory, {size / median:.1f}x "
                             f"the others' median ({format_bytes(median)}): a leak, or a shard larger than theirs?")
    return lines


def memory_line(hosts: Sequence[HostSnapshot], noun: str = "host") -> str:
    """Every measured host's memory at its cell's end, in one line a user reads as a sentence.

    ``memory: host 0 21 MiB, host 1 21 MiB`` (resident), then ``accelerator memory: ...`` where a framework
    reports it; above :data:`LISTED_HOSTS` hosts, the range; "" when no host has reported any. The caller
    shows it once the cell ended: a host's figures are from the end of its last cell.
    """
    parts = []
    for figure, name in FIGURES:
        measured = [(host.index, host.memory[figure]) for host in hosts if figure in host.memory]
        if not measured:
            continue
        label = "memory" if figure == "rss" else f"{name} memory"
        if len(measured) > LISTED_HOSTS:
            sizes = [size for _, size in measured]
            parts.append(f"{label}: {format_bytes(min(sizes))} to {format_bytes(max(sizes))} "
                         f"across {len(sizes)} {noun}s")
        else:
            parts.append(f"{label}: " + ", ".join(f"{noun} {index} {format_bytes(size)}" for index, size in measured))
    return "; ".join(parts)


def memory_detail(host: HostSnapshot) -> str:
    """One host's figures, for its drill-down: now and at most."""
    memory = host.memory
    if "rss" not in memory:
        return ""
    text = f"memory: {format_bytes(memory['rss'])} resident (peak {format_bytes(memory.get('peak_rss', 0))})"
    if "device" in memory:
        text += (f", {format_bytes(memory['device'])} on its accelerators "
                 f"(peak {format_bytes(memory.get('device_peak', 0))})")
    return text
