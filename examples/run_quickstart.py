"""The quick-start demo: run examples/01_quickstart.ipynb headless and show what it did.

Executes the notebook in a real Jupyter kernel (nbclient), prints every code
cell with its outputs (the leader's value, the per-host table, the failing
host's traceback) and the seconds it took, and saves the executed notebook
under build/.
"""

from __future__ import annotations

import datetime
import pathlib
import sys
import time

import nbformat
from nbclient import NotebookClient

HERE = pathlib.Path(__file__).resolve().parent
NOTEBOOK = HERE / "01_quickstart.ipynb"
EXECUTED = HERE.parent / "build" / "01_quickstart.ipynb"


def show_output(output: dict) -> str:
    kind = output["output_type"]
    if kind == "stream":
        return output["text"]
    if kind in ("execute_result", "display_data"):
        return output["data"].get("text/plain", "") + "\n"
    if kind == "error":
        return "\n".join(output["traceback"]) + "\n"
    return ""


def cell_seconds(cell: dict) -> float:
    """How long the kernel took to run ``cell``, from the times nbclient records in its metadata."""
    recorded = cell.metadata.get("execution", {})
    started, ended = recorded.get("iopub.execute_input"), recorded.get("shell.execute_reply")
    if not (started and ended):
        return 0.0
    return (datetime.datetime.fromisoformat(ended) - datetime.datetime.fromisoformat(started)).total_seconds()


def main() -> int:
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    started = time.monotonic()
    NotebookClient(notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(HERE)}}).execute()
    ran = time.monotonic() - started
    code_cells = [cell for cell in notebook.cells if cell.cell_type == "code"]
    for cell in code_cells:
        print(f"\n\033[1mIn [{cell.execution_count}]:\033[0m  ({cell_seconds(cell):.1f} s)")
        print("    " + cell.source.replace("\n", "\n    "))
        for output in cell.outputs:
            sys.stdout.write(show_output(output))
    EXECUTED.parent.mkdir(exist_ok=True)
    nbformat.write(notebook, EXECUTED)
    in_cells = sum(map(cell_seconds, code_cells))
    print(f"\nRan {NOTEBOOK.name} in {ran:.1f} s ({in_cells:.1f} s in its cells, the rest starting and stopping its kernel); "
          f"the executed notebook is {EXECUTED}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
