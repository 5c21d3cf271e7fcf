"""A host's printed text is only ever text (issue #38): real hosts, and a real notebook.

Until b3f2552 a host's rich outputs and its session cells' boundaries travelled
inside its stdout, behind escape markers; any bytes with those markers that a
cell printed (a planted file's name in a listing, a file's contents, a
subprocess's output) became ``text/html`` or ``application/javascript`` in the
notebook, which JupyterLab trusts, or cut the cell's output short. They now
travel on the host's marks pipe; the old markers, printed, are text.
"""

from __future__ import annotations

import json
import re

import pytest
from nbformat.v4 import new_code_cell, new_notebook

import kinetic_nb
from kinetic_nb.notebook.display.panel import _detail_html, text_summary
from kinetic_nb.runner import protocol

from .nbrun import execute, rendered_streams

#: The in-band markers of b3f2552: a display record between the first two, a session cell's start and end.
OLD_DISPLAY_START, OLD_DISPLAY_END = "\x1b]kinetic-display;", "\x1b\\"
OLD_CELL_START, OLD_CELL_END = "\x1ekinetic-cell:{seq}\x1e", "\x1ekinetic-cell-end:{seq}\x1e"
#: What an attacker plants: rich data a trusting frontend runs. JSON's ``\\u002f`` is a ``/``, so the whole
#: payload can be a file's name.
RECORD = ('{"data": {"text\\u002fhtml": "<script>steal()<\\u002fscript>", '
          '"application\\u002fjavascript": "steal()", "text\\u002fplain": "planted"}, "metadata": {}}')
PAYLOAD = OLD_DISPLAY_START + RECORD + OLD_DISPLAY_END
#: The live panel's output: kinetic_nb's own widget (with an HTML twin), not the host's.
PANEL = "application/vnd.jupyter.widget-view+json"
#: The MIME types that run code in a trusting frontend.
ACTIVE = ("text/html", "application/javascript")

#: A cell that prints the payload, cats a file holding it and lists a folder with a file named after it.
PRINTS_THE_PAYLOAD = f"""\
import os, shutil, subprocess, tempfile
payload = {PAYLOAD!r}
print("printed:", payload)
folder = tempfile.mkdtemp()
with open(os.path.join(folder, "planted.txt"), "w") as planted:
    planted.write(payload + "\\n")
subprocess.run(["cat", os.path.join(folder, "planted.txt")], check=True)
os.mkdir(os.path.join(folder, "listing"))
open(os.path.join(folder, "listing", payload), "w").close()
subprocess.run(["ls", os.path.join(folder, "listing")], check=True)
shutil.rmtree(folder)
print("the end")
"""


def test_the_payload_is_valid_and_names_a_file():
    assert "/" not in PAYLOAD and len(PAYLOAD.encode()) < 255
    assert set(json.loads(RECORD)["data"]) >= set(ACTIVE)  # what b3f2552 published as rich output


def active_displays(shown: list[tuple[str, str]]) -> list[str]:
    """The display records among what the echo showed that carry code a frontend would run."""
    return [text for stream, text in shown if stream == protocol.DISPLAY
            and set(json.loads(text).get("data", {})) & set(ACTIVE)]


def stdout_of(shown: list[tuple[str, str]], stream: str = protocol.STDOUT) -> str:
    """What the echo showed on ``stream``, its pieces joined (a line may come in two)."""
    return "".join(text for name, text in shown if name == stream)


def test_a_one_shot_jobs_printed_payload_arrives_as_text():
    shown: list[tuple[str, str]] = []
    job = kinetic_nb.submit(PRINTS_THE_PAYLOAD, hosts=2, framework="none",
                            echo=lambda text, stream: shown.append((stream, text)))
    job.result(timeout=120)
    assert active_displays(shown) == [] and [s for s, _ in shown if s == protocol.DISPLAY] == []
    assert stdout_of(shown) == f"printed: {PAYLOAD}\n{PAYLOAD}\n{PAYLOAD}\nthe end\n"  # print, cat, ls
    assert job.logs(0).count(PAYLOAD) == 3


@pytest.fixture
def session():
    started = kinetic_nb.start(hosts=2, framework="none", idle_timeout=600, grace=2, echo=False)
    yield started
    started.stop()


def run_cell(session, source: str) -> list[tuple[str, str]]:
    shown: list[tuple[str, str]] = []
    session.run(source, echo=lambda text, stream: shown.append((stream, text))).result(timeout=120)
    return shown


def test_a_session_cells_printed_payload_arrives_as_text(session):
    shown = run_cell(session, PRINTS_THE_PAYLOAD)
    assert active_displays(shown) == [] and [s for s, _ in shown if s == protocol.DISPLAY] == []
    assert stdout_of(shown) == f"printed: {PAYLOAD}\n{PAYLOAD}\n{PAYLOAD}\nthe end\n"


def test_a_printed_cell_mark_cuts_nothing(session):
    # b3f2552's marks of this cell's end and of another cell's start: the cell's output goes on after them.
    marks = OLD_CELL_END.format(seq=1) + OLD_CELL_START.format(seq=7)
    first = run_cell(session, f"print('before the marks')\nprint({marks!r})\nprint('after the marks')\n"
                              "import sys\nprint('on stderr', file=sys.stderr)\nprint('the last line')")
    assert stdout_of(first) == f"before the marks\n{marks}\nafter the marks\nthe last line\n"
    assert stdout_of(first, protocol.STDERR) == "on stderr\n"
    second = run_cell(session, "print('the next cell')")
    assert stdout_of(second) == "the next cell\n" and {stream for stream, _ in second} == {protocol.STDOUT}


def test_a_real_display_keeps_its_place_between_the_lines_around_it(session):
    shown = run_cell(session, "import subprocess\nfrom IPython.display import HTML, display\n"
                              "for i in range(20):\n"
                              "    print(f'before {i}')\n"
                              "    if i % 5 == 0:  # a finished subprocess's output comes before the display too\n"
                              "        subprocess.run(['echo', f'from a subprocess {i}'], check=True)\n"
                              "    display(HTML(f'<b>{i}</b>'))\n"
                              "    print(f'after {i}')\n")
    seen, line = [], ""
    for stream, text in shown:  # a line may come in pieces
        if stream == protocol.DISPLAY:
            assert line == "", "a display came in the middle of a line"
            seen.append(json.loads(text)["data"]["text/html"])
        else:
            *done, line = (line + text).split("\n")
            seen += done
    assert seen == [line for i in range(20) for line in (
        f"before {i}", *([f"from a subprocess {i}"] if i % 5 == 0 else []), f"<b>{i}</b>", f"after {i}")]


#: A coloured line with a hyperlink in it, a clipboard write, the screen erased and a bell.
ACTING = "\x1b[1;31mloss\x1b[0m 0.5 \x1b]8;;https://example.com\x1b\\docs\x1b]8;;\x1b\\\x1b]52;c;c3RlYWw=\x07\x1b[2J\x07"


def test_the_panel_shows_a_hosts_escapes_as_text_and_the_echo_keeps_them_as_jupyter_renders_them():
    shown: list[tuple[str, str]] = []
    job = kinetic_nb.submit(f"print({ACTING!r})\nimport sys\nprint({ACTING!r}, file=sys.stderr)", hosts=2,
                            framework="none", echo=lambda text, stream: shown.append((stream, text)))
    job.result(timeout=120)
    job.wait(timeout=120)
    snapshot = job.snapshot()
    assert [host.row_line for host in snapshot.hosts] == ["loss 0.5 docs\ufffd"] * 2
    assert all(line == ACTING for host in snapshot.hosts for line in host.log_tail)  # as printed: logs() gives it
    assert job.logs(1) == f"{ACTING}\n{ACTING}\n"
    details = _detail_html(snapshot.hosts[1])  # the panel's drill-down: the tail as text
    assert details.count("loss 0.5 docs\ufffd") == 2 and not re.search("[\x00-\x08\x0b-\x1f\x7f-\x9f]", details)
    summary = text_summary(snapshot)  # the text twin: nothing in it a terminal would act on
    assert "loss 0.5 docs\ufffd" in summary and not re.search("[\x00-\x08\x0b-\x1f\x7f-\x9f]", summary)
    assert stdout_of(shown) == ACTING + "\n" and stdout_of(shown, protocol.STDERR) == ACTING + "\n"  # the user's own

    failing = kinetic_nb.submit(f"raise ValueError({ACTING!r})", hosts=2, framework="none", echo=False)
    with pytest.raises(ValueError, match="loss") as raised:
        failing.result(timeout=120)
    assert str(raised.value) == ACTING  # the user's own exception, as raised
    failing.wait(timeout=120)
    hosts = failing.snapshot().hosts
    assert [host.row_line for host in hosts] == ["ValueError: loss 0.5 docs\ufffd"] * 2, text_summary(failing.snapshot())
    assert all(host.traceback.endswith("ValueError: loss 0.5 docs\ufffd\n") for host in hosts)


def test_a_program_the_cell_starts_never_holds_the_marks_pipe():
    """Only the runner itself writes frames: a program started with every inheritable descriptor has 0, 1, 2."""
    source = ("import subprocess, sys\n"
              "subprocess.run([sys.executable, '-c', 'import os; print(sorted(os.listdir(\"/proc/self/fd\")))'], "
              "close_fds=False, check=True)")
    job = kinetic_nb.submit(source, hosts=1, framework="none", echo=False)
    job.result(timeout=120)
    assert job.logs(0).strip() == "['0', '1', '2', '3']"  # 3: the listing's own


def test_what_is_not_a_frame_on_the_marks_pipe_is_dropped_with_a_line_in_the_log():
    """Only the host's own code could write there; what it writes that is no frame is said, never shown."""
    source = ("import os, time\nfrom kinetic_nb.runner import marks\n"
              "os.write(marks._fd, b'hello, not a frame')\ntime.sleep(0.5)\n"
              "from IPython.display import HTML, display\ndisplay(HTML('<b>still shown</b>'))")
    shown: list[tuple[str, str]] = []
    job = kinetic_nb.submit(source, hosts=1, framework="none", echo=lambda text, stream: shown.append((stream, text)))
    job.result(timeout=120)
    assert "kinetic agent: dropped 18 bytes that are not a frame from host 0's marks pipe" in job.logs(0)
    assert [json.loads(text)["data"]["text/html"] for stream, text in shown if stream == protocol.DISPLAY] == [
        "<b>still shown</b>"]


def test_in_a_notebook_printed_markers_are_text_and_display_is_rich(tmp_path):
    notebook = new_notebook(cells=[new_code_cell("%load_ext kinetic_nb"),
                                   new_code_cell(f"%%kinetic -n 2\n{PRINTS_THE_PAYLOAD}"),
                                   new_code_cell("%%kinetic -n 2\nfrom IPython.display import HTML\n"
                                                 "print('before')\ndisplay(HTML('<b>x</b>'))\nprint('after')")])
    printed, rich = execute(notebook, tmp_path).cells[1:]
    for output in printed.outputs:
        data = output.get("data", {})
        assert "application/javascript" not in data and "<script>" not in data.get("text/html", ""), output
        assert "text/html" not in data or PANEL in data, output  # the panel's own, of kinetic_nb's making
    assert rendered_streams(printed)["stdout"].count(PAYLOAD) == 3
    from_the_host = [(output.output_type, output.get("text") or output.data.get("text/html"))
                     for output in rich.outputs if PANEL not in output.get("data", {})]
    assert from_the_host == [("stream", "before\n"), ("display_data", "<b>x</b>"), ("stream", "after\n")]
