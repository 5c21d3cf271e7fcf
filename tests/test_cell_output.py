"""What a %%kinetic cell shows, in a real kernel: streams by name, Out, rich output and one-line errors."""

from __future__ import annotations

from nbformat.v4 import new_code_cell, new_notebook

from .nbrun import cell_text, execute, outputs_of, rendered_streams

#: A cell whose error is the point of the test.
RAISES = {"tags": ["raises-exception"]}


def run(tmp_path, *sources: str | tuple[str, dict]) -> list:
    """Execute the cells after ``%load_ext kinetic_nb``; a ``(source, RAISES)`` cell may raise."""
    cells = [new_code_cell("%load_ext kinetic_nb")]
    for source in sources:
        text, metadata = source if isinstance(source, tuple) else (source, {})
        cells.append(new_code_cell(text, metadata=metadata))
    return execute(new_notebook(cells=cells), tmp_path).cells[1:]


def panel_text(cell) -> str:
    """The final panel's plain-text twin (what a frontend without widgets shows)."""
    return "\n".join(output.data["text/plain"] for output in outputs_of(cell, "display_data")
                     if "application/vnd.jupyter.widget-view+json" in output.data)


def out_value(cell) -> str | None:
    results = outputs_of(cell, "execute_result")
    return results[0].data["text/plain"] if results else None


def usage_error(cell) -> str:
    """What IPython shows for a ``UsageError``: one line on stderr, no traceback."""
    return rendered_streams(cell)["stderr"]


def error_of(cell):
    [error] = outputs_of(cell, "error")
    return error


def test_host_output_shows_as_jupyter_would_show_the_same_program(tmp_path):
    streams, progress, chatter, logs, quiet, shown = run(
        tmp_path,
        "%%kinetic -n 2\nimport sys\nprint('to stdout')\nprint('to stderr', file=sys.stderr)\n'done'",
        # Each update is 0.3 s apart: the log's 0.5 s chunks cut the bar's line in different places.
        "%%kinetic -n 1\nimport sys, time\nfor percent in range(0, 101, 25):\n"
        "    sys.stderr.write(f'\\r{percent:3d}%|' + '#' * (percent // 10))\n"
        "    sys.stderr.flush()\n    time.sleep(0.3)\nsys.stderr.write('\\n')\nprint('trained')",
        # gloo writes its line in pieces: one chunk ends in the middle of it.
        "%%kinetic -n 1\nimport sys, time\nsys.stdout.write('[Gloo] Rank 0 is connected to ')\nsys.stdout.flush()\n"
        "time.sleep(0.8)\nprint('1 peer ranks. Expected number of connected peer ranks is : 1')\nprint('real output')",
        "import kinetic_nb\nprint(kinetic_nb.last_job().logs(0))",
        "%%kinetic -n 2\n41 + 1;",
        "%%kinetic -n 2\n'shown'  # no semicolon",
    )
    assert [(o.name, o.text) for o in outputs_of(streams, "stream")] == [("stdout", "to stdout\n"),
                                                                        ("stderr", "to stderr\n")]
    assert out_value(streams) == "'done'"

    assert rendered_streams(progress) == {"stderr": "100%|##########\n", "stdout": "trained\n"}

    assert rendered_streams(chatter) == {"stdout": "real output\n"}
    assert "connected" not in panel_text(chatter) and "real output" in panel_text(chatter)
    assert "[Gloo] Rank 0 is connected to 1 peer ranks" in cell_text(logs)  # the log keeps it whole

    assert out_value(quiet) is None and outputs_of(quiet, "error") == []
    assert out_value(shown) == "'shown'"


def test_a_progress_bar_is_one_line_in_the_panel(tmp_path):
    [progress] = run(
        tmp_path,
        "%%kinetic -n 1\nimport sys, time\nfor percent in range(0, 101, 25):\n"
        "    sys.stderr.write(f'\\r{percent:3d}%|' + '#' * (percent // 10))\n"
        "    sys.stderr.flush()\n    time.sleep(0.3)",
    )
    row = next(line for line in panel_text(progress).splitlines() if line.strip().startswith("0*"))
    assert row.rstrip().endswith("100%|##########") and "75%" not in row


def test_the_leaders_rich_output_reaches_the_cell_as_rich_output(tmp_path):
    [rich] = run(
        tmp_path,
        "%%kinetic -n 2\nimport os\nfrom IPython.display import HTML\n"
        "display(HTML(f\"<b>bold from host {os.environ['RANK']}</b>\"))\n"
        "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\n"
        "class Card:\n    def _repr_html_(self):\n        return '<i>card</i>'\nCard()",
    )
    displays = [o for o in outputs_of(rich, "display_data") if "application/vnd.jupyter.widget-view+json" not in o.data]
    assert [o.data.get("text/html") for o in displays[:1]] == ["<b>bold from host 0</b>"]  # the leader's only
    assert len([o for o in displays if "image/png" in o.data]) == 1  # the figure, as the inline backend shows it
    assert outputs_of(rich, "execute_result")[0].data["text/html"] == "<i>card</i>"
    assert "<IPython.core.display.HTML object>" not in rendered_streams(rich).get("stdout", "")


def test_mistakes_are_one_usage_error_line_before_any_host_starts(tmp_path):
    typo, ipython, nan, not_an_id, unknown = run(
        tmp_path,
        ("%%kinetic -n 2 -o never_defined\nx = 1", RAISES),
        ("%%kinetic -n 2\nimport os\n!ls", RAISES),
        ("%%kinetic -n 1 --timeout nan\n1", RAISES),
        ("%kinetic attach ../../etc", RAISES),
        ("%kinetic attach kn-20250101-120000-abcdef", RAISES),
    )
    for cell in (typo, ipython, nan, not_an_id, unknown):
        assert outputs_of(cell, "error") == [] and panel_text(cell) == ""  # IPython's usage error; no host started
        assert usage_error(cell).count("\n") == 1  # one line
    assert usage_error(typo).startswith("UsageError: -o/--out never_defined: the cell never assigns it")
    assert usage_error(ipython).startswith("UsageError: line 3 uses `!ls`: %%kinetic cells run as plain Python")
    assert "use subprocess" in usage_error(ipython)
    assert "--timeout must be a positive number of seconds, got nan" in usage_error(nan)
    assert "'../../etc' is not a job id" in usage_error(not_an_id)
    assert "no job kn-20250101-120000-abcdef" in usage_error(unknown)


def test_a_timeout_and_a_cancel_are_one_line(tmp_path):
    timeout, cancelled = run(
        tmp_path,
        ("%%kinetic -n 1 --timeout 1\nimport time\ntime.sleep(60)", RAISES),
        ("import kinetic_nb\njob = kinetic_nb.submit('import time\\ntime.sleep(60)', hosts=1)\njob.cancel()\n"
         "job.result()", RAISES),
    )
    for cell, ename, words in ((timeout, "KineticTimeoutError", "ran past its timeout of 1 s"),
                               (cancelled, "JobCancelledError", "was cancelled")):
        error = error_of(cell)
        assert error.ename == ename and words in error.evalue
        # One line, and for a timeout where each host was: never a traceback of kinetic_nb's frames.
        assert error.traceback[0] == f"{ename}: {error.evalue}" and "Traceback" not in "\n".join(error.traceback)
        assert len(error.traceback) == (2 if ename == "KineticTimeoutError" else 1), error.traceback


def test_storage_mistakes_are_one_line_and_tb_shows_where(tmp_path):
    _, file_in_the_way, tb, _, no_credentials = run(
        tmp_path,
        "open('a_file', 'w').close()",
        ("%%kinetic -n 1 --storage a_file\n1", RAISES),
        "%tb",
        "import os\nos.environ.pop('STORAGE_EMULATOR_HOST', None)\n"
        "os.environ['GOOGLE_APPLICATION_CREDENTIALS'] = os.path.abspath('no-such-key.json')\n"
        "os.environ['NO_GCE_CHECK'] = 'True'",  # no metadata server is asked either
        ("%%kinetic -n 1 --storage gs://some-bucket/jobs\n1", RAISES),
    )
    error = error_of(file_in_the_way)
    assert error.ename == "StorageError" and "Not a directory" in error.evalue and "--storage" in error.evalue
    assert len(error.traceback) == 1
    assert "local.py" in cell_text(tb) and "NotADirectoryError" in cell_text(tb)  # the internal traceback, on request
    error = error_of(no_credentials)
    assert error.ename == "StorageError" and "gcloud auth application-default login" in error.evalue
    assert "STORAGE_EMULATOR_HOST" in error.evalue and len(error.traceback) == 1


def test_system_exit_on_a_host(tmp_path):
    failing, fine, missing, brought = run(
        tmp_path,
        ("%%kinetic -n 2\nimport os, sys\nif os.environ['RANK'] == '1':\n    sys.exit(3)\n'leader'", RAISES),
        "%%kinetic -n 2\nimport os, sys\nif os.environ['RANK'] == '1':\n    sys.exit(0)\n'fine'",
        "%%kinetic -n 2 -o maybe,x\nx = 1\nif False:\n    maybe = 2\nx + 1",
        "x",
    )
    error = error_of(failing)
    assert error.ename == "HostExitError" and "SystemExit(3)" in error.evalue
    rendered = "\n".join(error.traceback)
    assert "sys.exit(3)" in rendered and "line 4" in rendered and "An exception has occurred" not in rendered
    assert out_value(fine) == "'fine'"
    assert out_value(missing) == "2"  # the value comes back; the missing name is a warning
    assert "KineticWarning: -o/--out maybe: not bound on the leader" in rendered_streams(missing)["stderr"]
    assert out_value(brought) == "1"
