"""Running notebooks in a real kernel for the tests, and reading their outputs back."""

from __future__ import annotations

import nbformat
from nbclient import NotebookClient


def execute(notebook: nbformat.NotebookNode, directory) -> nbformat.NotebookNode:
    """Execute ``notebook`` in a fresh python3 kernel whose working directory is ``directory``."""
    NotebookClient(notebook, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(directory)}}).execute()
    return notebook


def cell_text(cell) -> str:
    """Everything a cell showed as text: streams, plain-text results and tracebacks."""
    parts = []
    for output in cell.outputs:
        if output.output_type == "stream":
            parts.append(output.text)
        elif output.output_type in ("execute_result", "display_data"):
            parts.append(output.data.get("text/plain", ""))
        elif output.output_type == "error":
            parts.append("\n".join(output.traceback))
    return "\n".join(parts)
