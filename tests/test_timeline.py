"""CellHandle.timeline(): one row per host, bars per phase, markers for failures."""

from __future__ import annotations

import kinetic_nb


def test_timeline_has_one_row_per_host():
    from matplotlib.figure import Figure

    source = "import os, time\nif os.environ['RANK'] == '2':\n    time.sleep(0.3)\n    raise ValueError('late')"
    handle = kinetic_nb.submit(source, hosts=3)
    handle.wait()
    figure = handle.timeline()
    assert isinstance(figure, Figure)
    axes = figure.axes[0]
    rows = [c for c in axes.collections if c.get_label().startswith("host ")]
    assert [c.get_label() for c in rows] == ["host 0", "host 1", "host 2"]
    assert all(len(c.get_paths()) >= 5 for c in rows)  # startup ... execute, at least
    assert [label.get_text() for label in axes.get_yticklabels()] == ["0 (leader)", "1", "2"]
    failure_markers = [line for line in axes.lines if line.get_marker() == "x"]
    assert len(failure_markers) == 1 and list(failure_markers[0].get_ydata()) == [2]
    legend = [text.get_text() for text in axes.get_legend().get_texts()]
    assert "in the cell" in legend and "waiting for the others" in legend  # phases in a user's words
    assert "execute" not in legend and "start barrier" not in legend
    figure.savefig(__import__("io").BytesIO(), format="png")  # it renders


def test_timeline_has_one_row_per_process_named_by_host_and_process():
    handle = kinetic_nb.submit("import os\nif os.environ['RANK'] == '3':\n    raise ValueError('rank 3')", hosts=2,
                               procs_per_host=2, framework="none")
    handle.wait()
    axes = handle.timeline().axes[0]
    assert [label.get_text() for label in axes.get_yticklabels()] == [
        "host 0 · proc 0 · rank 0 (leader)", "host 0 · proc 1 · rank 1", "host 1 · proc 0 · rank 2",
        "host 1 · proc 1 · rank 3"]
    failure_markers = [line for line in axes.lines if line.get_marker() == "x"]
    assert len(failure_markers) == 1 and list(failure_markers[0].get_ydata()) == [3]
