"""A session cell's life belongs to the host agent: interrupts name a cell, the agent enforces a cell's timeout
with no kernel, ``stop`` ends every host whatever state it is in, and a host's own exit code is never taken for
kinetic_nb's "stopped".

Real host processes; every test ends with none left (the suite's ``no_process_survives``).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time

import psutil
import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

import kinetic_nb
from kinetic_nb.agent.local_state import AgentState
from kinetic_nb.agent.processes import process_start
from kinetic_nb.backends.local import agent_files
from kinetic_nb.client import catalog
from kinetic_nb.client.keys import load_key
from kinetic_nb.errors import JobFailedError, KineticTimeoutError
from kinetic_nb.runner.job_keys import SESSION

from .helpers import kernel

HOST = "import os, time\nhost = int(os.environ['KINETIC_HOST_INDEX'])\n"
#: Hang guards only: a test that waits longer has failed.
HANG_GUARD_S = 60.0
GRACE_S = 2.0


@pytest.fixture
def session():
    started = kinetic_nb.start(hosts=3, framework="none", idle_timeout=600, grace=GRACE_S, echo=False)
    yield started
    started.stop()


def agent_and_hosts(session) -> list[psutil.Process]:
    """The session's agent (by its record: its pid and when it started) and every process under it."""
    state = AgentState.read(agent_files(session.session_id)[1])
    assert state is not None and state.process_start is not None, "the session's agent never recorded itself"
    if process_start(state.pid) != state.process_start:
        return []
    agent = psutil.Process(state.pid)
    try:
        return [agent, *agent.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def value_of(cell):
    """The cell's value; its KeyboardInterrupt as a test failure (pytest would take it for a Ctrl-C and stop)."""
    try:
        return cell.result(timeout=HANG_GUARD_S)
    except KeyboardInterrupt as error:
        pytest.fail(f"cell {cell.seq} was interrupted: {error}")


def test_interrupting_a_queued_cell_withdraws_it_and_leaves_the_running_one_alone(session):
    running = session.run("import time\ntime.sleep(3)\n'c1'")
    queued = session.run("'c2'")
    queued.interrupt()
    assert value_of(running) == "c1"  # never interrupted
    with pytest.raises(KeyboardInterrupt, match=r"cell 2 of session \S+ was withdrawn before it started"):
        queued.result(timeout=HANG_GUARD_S)
    assert session.ended() is None
    assert session.run("'still up'").result(timeout=HANG_GUARD_S) == "still up"


def test_a_queued_cell_interrupted_behind_a_long_one_does_not_end_the_session(session):
    """The grace for coming back counts from when the interrupted cell runs, not from the interrupt."""
    running = session.run(f"import time\ntime.sleep({2 * GRACE_S + 2:g})\n'long'")
    queued = session.run("'queued'")
    queued.interrupt()
    assert value_of(running) == "long"
    with pytest.raises(KeyboardInterrupt):
        queued.result(timeout=HANG_GUARD_S)
    assert session.ended() is None


def test_interrupting_a_queued_cell_from_a_second_kernel_leaves_the_running_one_alone(session):
    running = session.run("import time\ntime.sleep(3)\n'c1'")
    code = (f"import kinetic_nb\nsession = kinetic_nb.attach_session({session.session_id!r}, echo=False)\n"
            "cell = session.run(\"'from the second kernel'\")\ncell.interrupt()\n"
            "try:\n    cell.result(timeout=60)\nexcept KeyboardInterrupt as error:\n    print('withdrawn:', error)\n")
    second = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert f"withdrawn: cell 2 of session {session.session_id} was withdrawn before it started" in second.stdout, \
        second.stderr[-2000:]
    assert value_of(running) == "c1"
    assert session.ended() is None


def test_the_agent_enforces_a_cells_timeout_with_no_kernel(storage_root):
    """The kernel that ran the cell is SIGKILLed: the agent still interrupts the cell at its timeout."""
    code = ("import kinetic_nb, sys\n"
            "session = kinetic_nb.start(hosts=2, framework='none', idle_timeout=600, grace=2, echo=False)\n"
            "print(session.session_id, flush=True)\n"
            "session.run('import time\\ntime.sleep(600)', timeout=3)\n"
            "import time\ntime.sleep(600)\n")
    kernel = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        session_id = kernel.stdout.readline().strip()
        time.sleep(0.5)
        kernel.kill()  # SIGKILL: nothing of the notebook is left to enforce anything
        kernel.wait()
        session = kinetic_nb.attach_session(session_id, echo=False)
        cell = session.cell(1)
        with pytest.raises(KineticTimeoutError, match=r"cell 1 of session \S+ ran past its timeout of 3 s"):
            cell.result(timeout=3 + GRACE_S + 5 + 10)
        assert session.ended() is None  # the hosts came back to idle
        assert session.run("'after the timeout'").result(timeout=HANG_GUARD_S) == "after the timeout"
    finally:
        kernel.kill()
        kinetic_nb.attach_session(session_id, echo=False).stop()


def test_a_host_that_exits_with_code_3_ends_the_session_and_is_named(session):
    """3 is also the code kinetic_nb's own stop used to mean: the host's own exit must not pass for it."""
    cell = session.run(HOST + "if host == 1:\n    os._exit(3)\ntime.sleep(600)")
    with pytest.raises(JobFailedError, match=r"host 1 exited with code 3"):
        cell.result(timeout=HANG_GUARD_S)
    assert session.ended() is not None


def test_stop_ends_every_host_and_the_agent_whatever_state_they_are_in(session):
    cell = session.run(HOST + "if host == 1:\n    os._exit(3)\ntime.sleep(600)")
    deadline = time.monotonic() + HANG_GUARD_S
    while not any(host.exit for host in cell.hosts()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(agent_and_hosts(session)) == 3  # the agent and hosts 0 and 2 (host 1 has exited)
    said = session.stop()
    assert said == f"session {session.session_id} stopped: its 3 hosts and its agent have ended"
    assert agent_and_hosts(session) == []


def test_a_cells_outcome_goes_once_read_and_gc_removes_ended_sessions_never_a_live_one(storage_root):
    live = kinetic_nb.start(hosts=2, framework="none", idle_timeout=600, echo=False)
    ended = kinetic_nb.start(hosts=2, framework="none", idle_timeout=600, echo=False)
    try:
        assert len(value_of(ended.run("b'x' * 5_000_000"))) == 5_000_000
        ended._last_cell.cleanup.result()  # the outcome's objects go in the background, off the value's way
        # The 5 MB value, read, is gone; the payload stays (it numbers the session's cells), and so do the
        # leader's output of the cell (its last chunk, empty here) and each host's end of it (the names a later
        # cell finds the leader holding).
        assert [info.name for info in ended.storage.list("cells/000001/")] == [
            "cells/000001/done-0", "cells/000001/done-1", "cells/000001/log/0/000000.json", "cells/000001/payload.pkl"]
        ended.stop()
        removed = dict(catalog.collect(0, storage=storage_root))
        assert ended.session_id in removed and live.session_id not in removed
        assert ended.storage.list() == [] and load_key(ended.session_id, SESSION) is None
        assert value_of(live.run("'still up'")) == "still up"
    finally:
        live.stop()
        ended.stop()


def test_what_the_notebook_says_after_stop_and_for_a_session_that_does_not_exist():
    InteractiveShell.clear_instance()
    shell = InteractiveShell.instance()
    try:
        shell.run_line_magic("load_ext", "kinetic_nb")
        session = shell.run_line_magic("kinetic", "start -n 2 --framework none")
        shell.run_line_magic("kinetic", "stop")
        # After an explicit stop the notebook is where it was before %kinetic start: a one-shot cell runs.
        assert session.ended() is not None
        assert shell.run_cell("%%kinetic -n 1\n41 + 1").result == 42
        with pytest.raises(UsageError, match=r"^no session ks-20990101-000000-abcdef in file://.*\(%kinetic "
                                             r"sessions lists them\)$"):
            shell.run_line_magic("kinetic", "attach ks-20990101-000000-abcdef")
    finally:
        InteractiveShell.clear_instance()


def execute_value(client, code: str) -> str:
    """Run ``code`` in the kernel; its value as text (or its error's name, to fail the caller's assertion)."""
    value = []

    def output(message: dict) -> None:
        if message["msg_type"] == "execute_result":
            value.append(message["content"]["data"]["text/plain"])

    reply = client.execute_interactive(code, timeout=HANG_GUARD_S, output_hook=output)["content"]
    return value[0] if value else reply.get("ename", "no value")


def interrupt_reply(client, manager, code: str, *, twice: bool) -> dict:
    """Run ``code`` in the kernel, interrupt it once its hosts run it (twice: again half a second later),
    and return the kernel's error reply."""
    msg_id = client.execute(code)
    deadline = time.monotonic() + HANG_GUARD_S
    while time.monotonic() < deadline:  # the cell's hosts print when they are in it
        message = client.get_iopub_msg(timeout=HANG_GUARD_S)
        if message["msg_type"] == "stream" and "in the cell" in message["content"]["text"]:
            break
    manager.interrupt_kernel()
    if twice:
        time.sleep(0.5)
        manager.interrupt_kernel()
    reply = client.get_shell_msg(timeout=HANG_GUARD_S)
    assert reply["parent_header"]["msg_id"] == msg_id
    return reply["content"]


def test_an_interrupted_session_cell_says_one_line_and_the_sessions_fate():
    with kernel() as (manager, client):
        client.execute_interactive("%kinetic start -n 2 --framework none --grace 2", timeout=HANG_GUARD_S)
        reply = interrupt_reply(client, manager, "%%kinetic\nimport time\nprint('in the cell', flush=True)\n"
                                                 "time.sleep(600)", twice=False)
        assert reply["ename"] == "CellInterrupted"
        assert re.fullmatch(r"CellInterrupted: In\[\d+\] was interrupted on every host", reply["traceback"][0])
        assert len(reply["traceback"]) == 2 and "stays up once they are back to idle" in reply["traceback"][1]
        assert "'in the cell'" in execute_value(client, "%%kinetic\nprint('back', flush=True)\n'in the cell'")
        # Hosts that ignore SIGINT cannot come back: the kernel is free at once all the same, and the session's
        # agent ends the session after the grace; the next cell says so.
        reply = interrupt_reply(client, manager, "%%kinetic\nimport signal, time\n"
                                                 "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
                                                 "print('in the cell', flush=True)\ntime.sleep(600)", twice=False)
        assert reply["ename"] == "CellInterrupted", reply["traceback"]
        assert "(its agent ends it if they are not within 2 s)" in reply["traceback"][1]
        time.sleep(2 + 5)
        reply = client.execute_interactive("%%kinetic\n1", timeout=HANG_GUARD_S)["content"]
        assert reply["status"] == "error" and "has ended" in reply["evalue"], reply
        client.execute_interactive("%kinetic stop", timeout=HANG_GUARD_S)


def test_a_stuck_worker_in_a_session_cell_is_quiet_with_its_stacks_and_the_leaders_value_is_kept(session):
    cell = session.run(HOST + "def stuck_in_a_collective():\n    time.sleep(600)\n"
                              "if host == 2:\n    stuck_in_a_collective()\n'the leader is done'")
    deadline = time.monotonic() + HANG_GUARD_S
    while time.monotonic() < deadline:
        hosts = cell.hosts()
        if hosts[2].state == "quiet" and hosts[2].stacks:
            break
        time.sleep(0.1)
    assert hosts[2].state == "quiet" and "stuck_in_a_collective" in hosts[2].stacks
    assert cell.leader_result() == "the leader is done"  # whatever the stuck worker does
    cell.interrupt()
    with pytest.raises(KeyboardInterrupt):
        cell.result(timeout=HANG_GUARD_S)
    assert cell.leader_result() == "the leader is done"  # still, after the interrupt
    assert session.ended() is None
