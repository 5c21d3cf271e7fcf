"""A quiet host's stack dump as its user reads it: the cell's thread first, from the user's own frame and its
source line, kinetic_nb's own threads and frames left out (``runner.stacks``)."""

from __future__ import annotations

import faulthandler
import os
import tempfile
import threading

from kinetic_nb.notebook.display.panel import HostPanel, quiet_lines
from kinetic_nb.runner.cell import remember_source, run_cell
from kinetic_nb.runner.stacks import parse_stacks, readable_stacks, where_the_cell_is
from kinetic_nb.state import HostSnapshot, JobSnapshot, JobStatus

OWN = f"{os.sep}site-packages{os.sep}kinetic_nb{os.sep}runner{os.sep}"
#: A host's dump as faulthandler writes it: kinetic_nb's heartbeat and output threads above the cell's own thread,
#: which waits in a library the cell called, under kinetic_nb's frames that ran the cell.
DUMP = f"""Thread 0x00007f0000000001 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 331 in wait
  File "{OWN}status.py", line 88 in _beat
  File "/usr/lib/python3.11/threading.py", line 1045 in _bootstrap_inner

Thread 0x00007f0000000002 (most recent call first):
  File "{OWN}logs.py", line 120 in _pump
  File "/usr/lib/python3.11/threading.py", line 1045 in _bootstrap_inner

Thread 0x00007f0000000003 (most recent call first):
  File "/data/loader.py", line 12 in prefetch
  File "/usr/lib/python3.11/threading.py", line 1045 in _bootstrap_inner

Current thread 0x00007f0000000004 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 331 in wait
  File "/site-packages/jax/_src/distributed.py", line 99 in barrier
  File "<kinetic In[7]>", line 3 in step
  File "<kinetic In[7]>", line 5 in <module>
  File "{OWN}cell.py", line 75 in run_cell
  File "{OWN}group.py", line 300 in run
"""
SOURCE = "# %%kinetic -n 4\ndef step():\n    barrier('step')\n\nstep()\n"


def test_the_cells_thread_comes_first_from_the_users_frame_with_its_source_line():
    remember_source(SOURCE, "<kinetic In[7]>")
    text = readable_stacks(DUMP)
    assert text.splitlines() == [
        "the cell's thread (most recent call last):",
        "  In[7], line 5",
        "    step()",
        "  In[7], line 3",
        "    barrier('step')",
        '  File "/site-packages/jax/_src/distributed.py", line 99, in barrier',
        '  File "/usr/lib/python3.11/threading.py", line 331, in wait',
        "Thread 0x00007f0000000003 (most recent call last):",
        '  File "/usr/lib/python3.11/threading.py", line 1045, in _bootstrap_inner',
        '  File "/data/loader.py", line 12, in prefetch',
        "(2 threads of kinetic_nb's own not shown)",
    ]
    assert "kinetic_nb" not in text.replace("kinetic_nb's own", "")


def test_a_quiet_hosts_line_names_the_users_frame_its_source_and_what_it_waits_in():
    remember_source(SOURCE, "<kinetic In[7]>")
    assert where_the_cell_is(DUMP) == "In[7], line 3: barrier('step'), waiting in wait (threading.py:331)"
    snapshot = JobSnapshot("kn-q", "local", "cpu", JobStatus.RUNNING, 0.0, 1.0,
                           (HostSnapshot(0, "succeeded", "teardown"), HostSnapshot(1, "quiet", "execute", stacks=DUMP)))
    assert quiet_lines(snapshot) == ["host 1 is quiet: no output and no phase change since another host ended; at "
                                     "In[7], line 3: barrier('step'), waiting in wait (threading.py:331)"]
    panel = HostPanel(2)
    panel.update(snapshot)
    detail = panel.details.children[1].value
    assert detail.index("In[7], line 5") < detail.index("Thread 0x00007f0000000003")  # the user's frame first
    assert "max-height" not in detail.split("where it is:")[1].split("</pre>")[0]  # never a small scroll box


def test_a_real_dump_of_a_cell_waiting_in_a_thread_is_read_from_the_cell():
    started, release = threading.Event(), threading.Event()
    source = "started.set()\nrelease.wait()\n"
    worker = threading.Thread(target=run_cell, args=(source, "<kinetic In[9]>",
                                                     {"started": started, "release": release}), daemon=True)
    worker.start()
    started.wait(10)
    with tempfile.TemporaryFile("w+") as dump:
        faulthandler.dump_traceback(dump, all_threads=True)
        dump.seek(0)
        text = dump.read()
    release.set()
    worker.join(10)
    assert any(thread.runs_the_cell for thread in parse_stacks(text))
    assert where_the_cell_is(text).startswith("In[9], line 2: release.wait(), waiting in wait (threading.py:")
    assert readable_stacks(text).splitlines()[1:3] == ["  In[9], line 2", "    release.wait()"]


def test_text_that_is_not_a_dump_is_shown_as_it_is():
    answer = "no answer: host 1 did not dump its stacks within 5 s\n"
    assert readable_stacks(answer) == answer and where_the_cell_is(answer) == ""
