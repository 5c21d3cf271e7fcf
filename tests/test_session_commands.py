"""What ``%kinetic restart`` and ``%kinetic sessions`` show in a real kernel: the same panel as ``start``, and
a listing with a header."""

from __future__ import annotations

import re

from nbformat.v4 import new_code_cell, new_notebook

from .nbrun import execute, outputs_of


def test_restart_shows_the_start_panel_and_sessions_lists_under_a_header(tmp_path):
    notebook = new_notebook(cells=[new_code_cell(source) for source in (
        "%load_ext kinetic_nb",
        "%kinetic start -n 2 --framework none",
        "%%kinetic\nx = 1",
        "%kinetic sessions",
        "%kinetic restart",
        "%kinetic stop",
    )])
    execute(notebook, tmp_path)
    start, _, listing, restart, _ = notebook.cells[1:]

    def panel(cell) -> str:
        [shown] = [output for output in outputs_of(cell, "display_data")
                   if "application/vnd.jupyter.widget-view+json" in output.data]
        return shown.data["text/plain"]

    up = r"session ks-\S+ \(framework none\) is up · local · cpu · 2 hosts · .* · SUCCEEDED · 2 idle"
    assert re.fullmatch(up, panel(start)), panel(start)
    assert re.fullmatch(up, panel(restart)), panel(restart)  # the same panel as start's, not a text table
    assert not outputs_of(restart, "stream")
    lines = "".join(output.text for output in outputs_of(listing, "stream")).splitlines()
    assert lines[0].split() == ["session", "hosts", "accelerator", "cells", "state"]
    assert re.fullmatch(r"ks-\S+ +2 +cpu +1 +up", lines[1]), lines[1]  # "1", not "1 cells"
