"""Running notebooks in a real kernel for the tests, and reading their outputs back."""

from __future__ import annotations

import re

import nbformat
from nbclient import NotebookClient


def execute(notebook: nbformat.NotebookNode, directory) -> nbformat.NotebookNode:
    """Execute ``notebook`` in a fresh python3 kernel whose working directory is ``directory``."""
    NotebookClient(notebook, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(directory)}}).execute()
    return notebook


def cell_text(cell) -> str:
    """Everything a cell showed as text: streams, plain-text results and tracebacks (without their colours)."""
    parts = []
    for output in cell.outputs:
        if output.output_type == "stream":
            parts.append(output.text)
        elif output.output_type in ("execute_result", "display_data"):
            parts.append(output.data.get("text/plain", ""))
        elif output.output_type == "error":
            parts.append(re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(output.traceback)))
    return "\n".join(parts)


def outputs_of(cell, output_type: str) -> list:
    """The cell's outputs of one type (``stream``, ``display_data``, ``execute_result``, ``error``)."""
    return [output for output in cell.outputs if output.output_type == output_type]


def rendered_streams(cell) -> dict[str, str]:
    """Each stream's text as Jupyter's output area shows it.

    The outputs of one stream are joined, and a carriage return rewrites its
    line from the start, character by character, as JupyterLab renders it.
    """
    texts: dict[str, str] = {}
    for output in outputs_of(cell, "stream"):
        texts[output.name] = texts.get(output.name, "") + output.text
    return {name: _overwritten(text) for name, text in texts.items()}


def _overwritten(text: str) -> str:
    lines = []
    for line in re.sub(r"\r+\n", "\n", text).split("\n"):
        shown = ""
        for part in line.split("\r"):
            shown = part + shown[len(part):]
        lines.append(shown)
    return "\n".join(lines)
