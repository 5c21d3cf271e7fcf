"""The quick-start demo: run examples/01_quickstart.ipynb headless and show what it did.

Executes the notebook in a real Jupyter kernel (nbclient), prints every code
cell with its outputs (the leader's value, the per-host table, the failing
host's traceback), and saves the executed notebook under build/.
"""

from __future__ import annotations

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


def main() -> int:
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    started = time.monotonic()
    NotebookClient(notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(HERE)}}).execute()
    for cell in notebook.cells:
        if cell.cell_type != "code":
            continue
        print(f"\n\033[1mIn [{cell.execution_count}]:\033[0m")
        print("    " + cell.source.replace("\n", "\n    "))
        for output in cell.outputs:
            sys.stdout.write(show_output(output))
    EXECUTED.parent.mkdir(exist_ok=True)
    nbformat.write(notebook, EXECUTED)
    print(f"\nRan {NOTEBOOK.name} in {time.monotonic() - started:.1f} s; the executed notebook is {EXECUTED}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
