"""One face for every cell: each way a cell can end, run as a one-shot cell and as a session cell in a real
kernel, ends the same way in both: the panel's last state, the error's first line, the lines in the cell (none
from another cell) and how long after the deciding moment (an interrupt, a host's failure, the timeout) the
cell returned."""

from __future__ import annotations

import json
import re

import nbformat
from nbformat.v4 import new_code_cell, new_notebook

from .nbrun import execute, outputs_of

HOSTS = 4
#: How far apart the two kinds of cell may return after the same deciding moment (no fixed wait in either).
RETURN_SPREAD_S = 0.2

SETUP = """\
%load_ext kinetic_nb
import json, os, signal, threading, time
_marks = {}
get_ipython().events.register('pre_run_cell', lambda info: _marks.__setitem__('start', time.time()))
get_ipython().events.register('post_run_cell', lambda result: _marks.__setitem__('end', time.time()))

def _interrupt_in(seconds):
    def fire():
        _marks['event'] = time.time()
        os.kill(os.getpid(), signal.SIGINT)
    _marks.pop('event', None)
    threading.Timer(seconds, fire).start()
"""
#: After each scenario's cell: when it started and returned, and its deciding moment, for the test to read.
MARKS = "print(json.dumps(_marks)); _marks.pop('event', None)"


def failed_at(directory, kind: str, name: str):
    """Where a failing host records when it fails: the cell's deciding moment."""
    return directory / f"{kind}-{name}.failed_at"


def scenarios(directory, kind: str = "") -> dict[str, tuple[str, str, float | None]]:
    """Each scenario: its magic's flags, its cell, and when the kernel is interrupted (None: it is not)."""
    host = "int(os.environ['KINETIC_HOST_INDEX'])"

    def _fail_at(directory) -> str:
        return f"open({str(failed_at(directory, kind, name))!r}, 'w').write(str(time.time()))"

    name = "raises"
    raises = (f"import os, time\nprint('this cell', flush=True)\ntime.sleep(0.3)\nif {host} == 2:\n"
              f"    {_fail_at(directory)}\n    raise ValueError('host 2 broke')\ntime.sleep(1)\n'done'")
    name = "killed"
    killed = (f"import os, time\nprint('this cell', flush=True)\ntime.sleep(0.6)\nif {host} == 1:\n"
              f"    {_fail_at(directory)}\n    os._exit(3)\ntime.sleep(4)\n'done'")
    return {
        "interrupt": ("", "import time\nprint('working', flush=True)\ntime.sleep(60)", 2.0),
        "raises": ("", raises, None),
        "timeout": ("--timeout 3", "import time\nprint('this cell', flush=True)\ntime.sleep(60)", None),
        "killed": ("", killed, None),
    }


def build(directory) -> tuple[nbformat.NotebookNode, dict[tuple[str, str], int]]:
    cells = [new_code_cell(SETUP)]
    where: dict[tuple[str, str], int] = {}

    def scenario(kind: str, name: str, flags: str, source: str, interrupt_at: float | None) -> None:
        if interrupt_at is not None:
            cells.append(new_code_cell(f"_interrupt_in({interrupt_at})"))
        shape = f"-n {HOSTS} " if kind == "one-shot" else ""
        cells.append(new_code_cell(f"%%kinetic {shape}{flags}\n{source}", metadata={"tags": ["raises-exception"]}))
        where[kind, name] = len(cells) - 1
        cells.append(new_code_cell(MARKS))

    # Untimed: the kernel's first interrupt and error display import what they need, once, whatever the cell.
    cells.append(new_code_cell("_interrupt_in(1.0)"))
    cells.append(new_code_cell("%%kinetic -n 2\nimport time\ntime.sleep(30)", metadata={"tags": ["raises-exception"]}))
    for name, (flags, source, interrupt_at) in scenarios(directory, "one-shot").items():
        scenario("one-shot", name, flags, source, interrupt_at)
    cells.append(new_code_cell(f"%kinetic start -n {HOSTS}"))
    cells.append(new_code_cell("%%kinetic\nprint('an earlier cell line', flush=True)"))
    for name, (flags, source, interrupt_at) in scenarios(directory, "session").items():
        scenario("session", name, flags, source, interrupt_at)
        if name == "killed":  # a host died: the session ended with it
            cells.append(new_code_cell("%kinetic restart"))
    # A cell queued behind a running one, interrupted: withdrawn at once, its lines nowhere.
    cells.append(new_code_cell(
        "_session = get_ipython().magics_manager.registry['KineticMagics'].session\n"
        "_running = _session.run(\"import time\\nprint('the running cell', flush=True)\\ntime.sleep(6)\\n'ran'\")\n"
        "time.sleep(0.5)\n_interrupt_in(1.0)"))
    cells.append(new_code_cell("%%kinetic\nprint('the queued cell', flush=True)\n'queued'",
                               metadata={"tags": ["raises-exception"]}))
    where["session", "queued"] = len(cells) - 1
    cells.append(new_code_cell(MARKS))
    cells.append(new_code_cell("_running.result()"))
    cells.append(new_code_cell("%%kinetic\nprint('the next cell', flush=True)\n'next'"))
    where["session", "next"] = len(cells) - 1
    # After an explicit stop the notebook is where it was before %kinetic start: a one-shot cell runs.
    cells.append(new_code_cell("%kinetic stop"))
    cells.append(new_code_cell("%%kinetic -n 2\nimport os\nint(os.environ['KINETIC_HOST_INDEX']) + 40"))
    where["one-shot", "after stop"] = len(cells) - 1
    return new_notebook(cells=cells), where


def panel(cell) -> tuple[str, list[str]]:
    """The panel's last state as the saved notebook keeps it: its header's state and each host's state."""
    shown = [output for output in outputs_of(cell, "display_data") if "text/plain" in output.data]
    assert shown, f"no panel in {cell.source[:40]!r}"
    lines = shown[-1].data["text/plain"].splitlines()
    rows = [match[1] for line in lines[1:] if (match := re.match(r"^\s+\d+\*?\s+(\w+)\s", line))]
    return lines[0].rsplit(" · ", 1)[-1], rows


def shown_text(cell) -> str:
    """The panel's last text, as the saved notebook keeps it."""
    return [output for output in outputs_of(cell, "display_data") if "text/plain" in output.data][-1].data["text/plain"]


def error_line(cell) -> str:
    """The error's first line, the cell's and job's names made alike (In[n], job or session ids)."""
    errors = outputs_of(cell, "error")
    text = f"{errors[0].ename}: {errors[0].evalue}".splitlines()[0] if errors else ""
    text = re.sub(r" \((job|session) k[ns]-[^)]*\)", "", text)  # In[5] (job kn-…), In[5] (session ks-…)
    return re.sub(r"In\[\d+\]|k[ns]-\d{8}-\d{6}-[0-9a-f]{6}(/cells/\d+)?", "<cell>", text)


def lines(cell) -> set[str]:
    return {line for output in outputs_of(cell, "stream") for line in output.text.splitlines() if line.strip()}


def marks(notebook, index: int) -> dict[str, float]:
    return json.loads("".join(output.text for output in outputs_of(notebook.cells[index + 1], "stream")))


def test_every_way_a_cell_ends_looks_the_same_in_a_one_shot_and_a_session_cell(tmp_path):
    notebook, where = build(tmp_path)
    execute(notebook, tmp_path)
    cell = {key: notebook.cells[index] for key, index in where.items()}
    returned = {}
    for name in scenarios(tmp_path):
        one_shot, session = cell["one-shot", name], cell["session", name]
        state, rows = panel(one_shot)
        # One outcome drawn one way: never RUNNING once the cell returned, a stop never red. A host the
        # notebook is still stopping (a one-shot job is cancelled after the kernel's restart window) is
        # "stopping" on the way to "stopped".
        assert (state, [row.replace("stopping", "stopped") for row in rows]) == \
            (panel(session)[0], [row.replace("stopping", "stopped") for row in panel(session)[1]]), name
        assert state in {"interrupt": "INTERRUPTED", "timeout": "TIMED OUT"}.get(name, "FAILED")
        assert rows.count("failed") == (0 if name in ("interrupt", "timeout") else 1), (name, rows)
        assert error_line(one_shot) == error_line(session), name
        assert lines(one_shot) == lines(session), name
        assert "an earlier cell line" not in lines(session)
        for kind in ("one-shot", "session"):
            at = marks(notebook, where[kind, name])
            if name in ("raises", "killed"):  # the failing host's own moment
                event = float(failed_at(tmp_path, kind, name).read_text())
            else:
                event = at["event"] if name == "interrupt" else at["start"] + 3
            returned[kind, name] = at["end"] - event
        assert abs(returned["one-shot", name] - returned["session", name]) <= RETURN_SPREAD_S, (name, returned)
    # The kernel is free within a second of an interrupt; a failure returns as the hosts decide it, not
    # after the others finish (they would have slept 1 s more, or 4).
    assert max(returned["one-shot", "interrupt"], returned["session", "interrupt"]) < 1.0, returned
    assert max(returned["one-shot", "raises"], returned["session", "raises"]) < 1.0, returned
    assert max(returned["one-shot", "killed"], returned["session", "killed"]) < 3.0, returned
    # The queued cell: withdrawn at once, said so, and none of its lines (or the running cell's) anywhere else.
    queued = cell["session", "queued"]
    assert error_line(queued) == "CellInterrupted: <cell> was withdrawn before it started"
    assert panel(queued) == ("WITHDRAWN", ["stopped"] * 4)  # never started: no host pending for ever
    # A host that died in the cell has no memory figures of it (the last cell's are not shown as this one's).
    assert "host 1 " not in "".join(line for line in shown_text(cell["session", "killed"]).splitlines()
                                   if line.startswith("memory:"))
    assert "withdrawn before it started" in shown_text(queued)
    at = marks(notebook, where["session", "queued"])
    assert at["end"] - at["event"] < 1.0, at
    assert "the queued cell" not in lines(queued) | lines(cell["session", "next"])
    assert lines(cell["session", "next"]) == {"the next cell"}  # nothing of the withdrawn or the running cell
    assert "the running cell" not in lines(queued)
    after_stop = cell["one-shot", "after stop"]
    assert not outputs_of(after_stop, "error")
    assert outputs_of(after_stop, "execute_result")[0].data["text/plain"] == "40"
