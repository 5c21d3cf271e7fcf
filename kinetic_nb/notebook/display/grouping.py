"""Many hosts' identical lines shown once, with the hosts that printed them (as ``dshbak -c`` does).

Pure functions of values: ``group_lines`` gathers the hosts that printed the
same line, and ``grouped_lines`` words the groups, at most a bounded number of
them, each group's hosts short (``0-63, 65``: ``protocol.host_ranges``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from kinetic_nb.runner.protocol import MAX_RANGES, host_ranges

__all__ = ["MAX_LINE_GROUPS", "group_lines", "grouped_lines"]

#: Groups of lines a big slice's panel or text twin shows at most; the rest are counted on one more line.
MAX_LINE_GROUPS = 10


def group_lines(lines: Mapping[int, str]) -> list[tuple[list[int], str]]:
    """Hosts that printed the same line, together: ``{0: "a", 1: "a", 2: "b"}`` -> ``[([0, 1], "a"), ([2], "b")]``.

    Parameters
    ----------
    lines : mapping of int to str
        Each host's line, by host index; an empty line is no line.

    Returns
    -------
    list of (list of int, str)
        One entry per distinct line, its hosts in order, ordered by its first host.
    """
    groups: dict[str, list[int]] = {}
    for index in sorted(lines):
        if lines[index]:
            groups.setdefault(lines[index], []).append(index)
    return sorted(((indices, line) for line, indices in groups.items()), key=lambda group: group[0][0])


def grouped_lines(lines: Mapping[int, str], name_of: Callable[[int], str], *, many: str = "hosts",
                  limit: int = MAX_LINE_GROUPS) -> list[str]:
    """``"hosts 0-63: step 10 loss 0.53"``, one line per group, a line of its own per host that differs.

    Parameters
    ----------
    lines : mapping of int to str
        Each host's line, by host index.
    name_of : callable
        A lone host's name (``host 5``, or ``host 1, process 0 (rank 2)``).
    many : str
        What several of them are called (``hosts``, or ``ranks``).
    limit : int
        Lines at most: past it, the biggest groups are kept (in host order) and one more line counts the
        hosts left out.

    Returns
    -------
    list of str
    """
    groups = group_lines(lines)
    left_out: list[int] = []
    if len(groups) > limit:
        kept = sorted(groups, key=lambda group: (-len(group[0]), group[0][0]))[:limit - 1]
        kept_firsts = {indices[0] for indices, _ in kept}
        left_out = [index for indices, _ in groups if indices[0] not in kept_firsts for index in indices]
        groups = sorted(kept, key=lambda group: group[0][0])
    words = [f"{name_of(indices[0]) if len(indices) == 1 else f'{many} {host_ranges(indices, limit=MAX_RANGES)}'}: "
             f"{line}" for indices, line in groups]
    if left_out:
        words.append(f"… {len(left_out)} more {many if len(left_out) > 1 else many[:-1]} with lines of their own: "
                     f"{host_ranges(left_out, limit=MAX_RANGES)}")
    return words
