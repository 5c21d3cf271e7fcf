"""Many printed lines at speed (issue 39), in a real notebook: a burst arrives whole, in order, in a few messages.

Until the echo batched them, every line a host printed became a stream
message of its own: 10,000 lines were 10,000 outputs and took seconds while
the hosts were done in a fraction of one. A burst is now one write per log
segment, as ipykernel's own stream batching makes of a local burst, in a
one-shot cell and in a session cell alike, and a ``\\r`` progress bar still
updates one line.
"""

from __future__ import annotations

from nbformat.v4 import new_code_cell, new_notebook

from .nbrun import execute, outputs_of, rendered_streams

LINES = 10_000
#: Far fewer outputs than lines: each is one log chunk's segment (a chunk at most every half second).
MOST_OUTPUTS = 100
BURST = f"import sys\nfor i in range({LINES}):\n    print(f'line {{i}}')\nprint('on stderr', file=sys.stderr)"
#: A progress bar whose updates are 0.3 s apart, so the log's chunks cut it in different places.
PROGRESS = ("import sys, time\nfor percent in range(0, 101, 25):\n"
            "    sys.stdout.write(f'\\r{percent:3d}%|' + '#' * (percent // 10))\n"
            "    sys.stdout.flush()\n    time.sleep(0.3)\nprint()\nprint('done')")
EXPECTED = "".join(f"line {i}\n" for i in range(LINES))


def test_a_burst_of_lines_arrives_whole_in_few_outputs_in_both_kinds_of_cell(tmp_path):
    notebook = new_notebook(cells=[new_code_cell("%load_ext kinetic_nb"),
                                   new_code_cell(f"%%kinetic -n 4 --framework none\n{BURST}"),
                                   new_code_cell("%kinetic start -n 4 --framework none --idle-timeout 600"),
                                   new_code_cell(f"%%kinetic\n{BURST}"),
                                   new_code_cell(f"%%kinetic\n{PROGRESS}"),
                                   new_code_cell("%kinetic stop")])
    cells = execute(notebook, tmp_path).cells
    one_shot, session_cell, progress = cells[1], cells[3], cells[4]
    for cell in (one_shot, session_cell):
        streams = rendered_streams(cell)
        assert streams["stdout"] == EXPECTED  # every line, once, in order (the leader's only)
        assert "on stderr\n" in streams["stderr"]
        assert len(outputs_of(cell, "stream")) < MOST_OUTPUTS
    assert rendered_streams(progress)["stdout"] == "100%|##########\ndone\n"
