"""Printed lines at speed: a cell that prints many lines, in a real notebook, against a plain local cell.

One notebook, executed by a real kernel (nbclient), runs the same printing
cell (``--lines`` lines, 10,000 by default) three ways, ``--repeat`` times
each, in turn so that all three meet the same load on the machine:

1. a plain local cell (the baseline: ipykernel's own batching of a burst);
2. a one-shot ``%%kinetic -n 4`` cell;
3. a session cell, after ``%kinetic start -n 4``.

Each also runs once more with the same loop printing nothing, so that what
the lines cost is told from what the cell costs anyway (a one-shot cell
starts its hosts). For each kind it prints the median time the kernel took
(from the cell's ``execute_input`` to its ``execute_reply``, as nbclient
records them) with and without the lines, the most stream outputs one cell
made, and the lines' cost (the difference) against the plain cell's; issue
39's goal is at most 1.5x in both kinds of kinetic cell. The kernel and the
hosts import kinetic_nb from this checkout; the hosts run on this machine's
local backend, and the session is stopped at the end.

    python benchmarks/printed_lines.py [--lines 10000] [--repeat 3] [--hosts 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from datetime import datetime
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbformat.v4 import new_code_cell, new_notebook

#: The three kinds of cell, in the order each round runs them.
KINDS = ("plain local cell", "one-shot %%kinetic", "session cell")
#: Issue 39's goal for both kinds of kinetic cell, against the plain local cell.
GOAL = 1.5


def printing(lines: int) -> str:
    return f"for i in range({lines}):\n    print(f'line {{i}} of a burst')"


def build(lines: int, repeat: int, hosts: int) -> tuple[nbformat.NotebookNode, dict[tuple[str, int], list[int]]]:
    """The notebook, and per kind and number of lines the indexes of its cells of that kind."""
    cells = [new_code_cell("%load_ext kinetic_nb"),
             new_code_cell(f"%kinetic start -n {hosts} --framework none --idle-timeout 600")]
    where: dict[tuple[str, int], list[int]] = {}
    for _ in range(repeat):
        for count in (0, lines):
            body = printing(count)
            for kind, source in zip(KINDS, (body, f"%%kinetic -n {hosts} --once --framework none\n{body}",
                                            f"%%kinetic\n{body}"), strict=True):
                where.setdefault((kind, count), []).append(len(cells))
                cells.append(new_code_cell(source))
    cells.append(new_code_cell("%kinetic stop"))
    return new_notebook(cells=cells), where


def seconds(cell) -> float:
    """The kernel's time for the cell: from its execute_input to its execute_reply."""
    timing = cell.metadata["execution"]
    started, replied = (datetime.fromisoformat(timing[name].replace("Z", "+00:00"))
                        for name in ("iopub.execute_input", "shell.execute_reply"))
    return (replied - started).total_seconds()


def streams(cell) -> int:
    return sum(output.output_type == "stream" for output in cell.outputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=10_000, help="lines each cell prints")
    parser.add_argument("--repeat", type=int, default=3, help="cells of each kind (medians)")
    parser.add_argument("--hosts", type=int, default=4, help="hosts of the kinetic cells")
    args = parser.parse_args()
    notebook, where = build(args.lines, args.repeat, args.hosts)
    checkout = str(Path(__file__).resolve().parent.parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (checkout, os.environ.get("PYTHONPATH"))))
    with tempfile.TemporaryDirectory(prefix="kinetic-lines-") as directory:
        os.environ.setdefault("KINETIC_STORAGE", os.path.join(directory, "jobs"))  # the kernel inherits it
        NotebookClient(notebook, timeout=600, kernel_name="python3", record_timing=True,
                       resources={"metadata": {"path": directory}}).execute()
    print(f"{args.lines} printed lines, {args.hosts} hosts, medians of {args.repeat}; {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f} at the end")

    def median(kind: str, count: int) -> float:
        return statistics.median(seconds(notebook.cells[i]) for i in where[kind, count])

    costs = {kind: median(kind, args.lines) - median(kind, 0) for kind in KINDS}
    for kind in KINDS:
        outputs = max(streams(notebook.cells[i]) for i in where[kind, args.lines])
        ratio = f"= {costs[kind] / costs[KINDS[0]]:5.2f}x  goal <= {GOAL}x" if kind != KINDS[0] else "(the baseline)"
        print(f"{kind:<20} {median(kind, args.lines):7.3f} s with the lines, {median(kind, 0):7.3f} s without; "
              f"{outputs:5d} stream outputs; the lines cost {costs[kind]:7.3f} s {ratio}")


if __name__ == "__main__":
    sys.exit(main())
