"""Real notebooks executed by a real kernel (nbclient)."""

from __future__ import annotations

import re

from nbformat.v4 import new_code_cell, new_notebook

from .nbrun import cell_text, execute


def test_a_four_host_cell_in_a_real_kernel(tmp_path):
    notebook = new_notebook(cells=[
        new_code_cell("%load_ext kinetic_nb"),
        new_code_cell("offset = 100"),
        new_code_cell("%%kinetic -n 4 -o rank\nimport os\nrank = int(os.environ['RANK'])\nprint('leader says hi')\n"
                      "offset + rank + 1"),
        new_code_cell("rank"),
        new_code_cell("%%kinetic -n 2\nimport os\nif os.environ['RANK'] == '1':\n    raise OSError('disk gone')",
                      metadata={"tags": ["raises-exception"]}),
    ])
    notebook = execute(notebook, tmp_path)
    value_cell, rank_cell, failing = notebook.cells[2], notebook.cells[3], notebook.cells[4]
    results = [o for o in value_cell.outputs if o.output_type == "execute_result"]
    assert results[0].data["text/plain"] == "101"
    assert "leader says hi" in cell_text(value_cell)
    assert rank_cell.outputs[0].data["text/plain"] == "0"
    error = failing.outputs[-1]
    assert error.output_type == "error" and error.ename == "OSError" and error.evalue == "disk gone"
    rendered = cell_text(failing)  # drawn as IPython draws a local traceback
    assert f"Cell In[{failing.execution_count}], line 4\n----> 4 raise OSError('disk gone')" in rendered
    assert "Reported by host 1" in rendered


def widget_values(notebook) -> dict[str, dict]:
    state = notebook.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    return {model_id: model["state"] for model_id, model in state.items()}


def test_the_saved_notebook_keeps_the_final_panel(tmp_path):
    notebook = new_notebook(cells=[
        new_code_cell("%load_ext kinetic_nb"),
        new_code_cell("%%kinetic -n 4\nimport os\nif os.environ['RANK'] == '2':\n    raise ValueError('shard 2 is corrupt')\n"
                      "'ok'", metadata={"tags": ["raises-exception"]}),
    ])
    notebook = execute(notebook, tmp_path)
    states = widget_values(notebook)
    texts = [s.get("value", "") for s in states.values() if s.get("_model_name") == "HTMLModel"]
    rows = [t for t in texts if "font-family:monospace;font-size:12px" in t]
    assert len(rows) == 4
    assert "failed" in rows[2] and "in the cell" in rows[2]
    assert all(("succeeded" in row or "stopped" in row) for i, row in enumerate(rows) if i != 2)
    assert any("ValueError: shard 2 is corrupt" in t and "raise ValueError" in t for t in texts)  # drill-down
    progress = [s for s in states.values() if s.get("_model_name") == "IntProgressModel"]
    assert progress[0]["bar_style"] == "danger" and progress[0]["value"] == 4
    accordion = next(s for s in states.values() if s.get("_model_name") == "AccordionModel")
    assert accordion["titles"][2] == "host 2 · failed · in the cell"
    # The display keeps a static fallback for frontends without the widget state.
    displays = [o for o in notebook.cells[1].outputs if o.output_type == "display_data"]
    assert re.search(r"host 2: ValueError at In\[\d+\], line 4", displays[0].data["text/plain"])
    assert "application/vnd.jupyter.widget-view+json" in displays[0].data
