"""Warm sessions on real host processes: state and frameworks kept across cells, the seed's rules per cell,
failures that keep or end the session, interrupts, the idle timeout, and a kernel restart.

Time bounds here are hang guards; the figures are in benchmarks/session_roundtrip.py.
"""

from __future__ import annotations

import os
import re
import threading
import time

import pytest
from IPython.core.interactiveshell import InteractiveShell

import kinetic_nb
from kinetic_nb.client.sessions import SessionEndedError
from kinetic_nb.errors import HostExitError, JobFailedError, KineticTimeoutError, PostMortemError
from kinetic_nb.runner.records import read_host_status

from .faults.helpers import kernel
from .faults.test_reattach import run

HOST = "import os\nhost = int(os.environ['KINETIC_HOST_INDEX'])\n"
HANG_GUARD_S = 60.0


@pytest.fixture
def session():
    started = kinetic_nb.start(hosts=2, framework="none", idle_timeout=600, grace=2, echo=False)
    yield started
    started.stop()


def test_state_lives_from_cell_to_cell_and_held_names_are_not_shipped(session):
    assert session.run("x = 41\nx").result() == 41
    assert session.run("x += 1\nx").result() == 42
    assert "x" in session.held_names()
    # The notebook's own x is never shipped: the hosts hold x, and theirs wins.
    assert session.run("x", namespace={"__name__": "__main__", "x": 1000}).result() == 42
    # A notebook whose idea of what the hosts hold is behind (another kernel's cell bound x a moment ago) ships
    # its own: the hosts still keep theirs.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(session, "held_names", list)  # it knows of no name the hosts hold
        assert session.run("x", namespace={"__name__": "__main__", "x": 1000}).result() == 42
    # A notebook value the hosts do not hold is shipped, as for a one-shot job.
    assert session.run("x + y", namespace={"__name__": "__main__", "y": 8}).result() == 50
    assert session.run("os.getpid() if 'os' in dir() else None").result() is None
    pids = session.run(HOST + "os.getpid()").result(), session.run("os.getpid()").result()
    assert pids[0] == pids[1]  # the same process serves every cell


def test_a_hosts_status_right_after_a_cell_is_its_end_of_that_cell(session):
    # Long enough that each host's status.json says RUNNING while the cell runs; on a local disk status.json
    # follows the cell's end a moment later, and what a host is asked about (``%kinetic pm``) must not lag.
    first = session.run("import time\ntime.sleep(0.3)")
    first.result()
    # Its status.json said RUNNING: it says idle again at once (only a quick cell's status.json, still idle, waits).
    stored = read_host_status(session.records, session.group.key, 0)
    assert (stored.state, stored.cell) == ("idle", first.seq)
    cell = session.run(HOST + "time.sleep(0.3)\nif host == 1:\n    raise ValueError('bad shard')")
    with pytest.raises(ValueError, match="bad shard"):
        cell.result()
    leader, failed = session.host_status(0), session.host_status(1)
    assert (leader.state, leader.cell, leader.cell_failed) == ("idle", cell.seq, False)
    assert (failed.state, failed.cell, failed.cell_failed) == ("idle", cell.seq, True)
    with pytest.raises(PostMortemError, match=rf"host 0 of session .* did not fail in its last cell \({cell.seq}\)"):
        session.post_mortem(0, "1")


def test_out_copies_from_the_leaders_namespace(session):
    cell = session.run(HOST + "weights = [host, 2 * host]\n'trained'", out=["weights"])
    assert cell.result() == "trained" and cell.outputs == {"weights": [0, 0]}


def test_jax_is_initialized_once_and_collectives_work_across_cells():
    started = kinetic_nb.start(hosts=2, framework="auto", idle_timeout=600, echo=False)
    try:
        first = started.run("import os, jax\nfrom jax._src import distributed\n"
                            "client = id(distributed.global_state.client)\n(jax.process_count(), os.getpid())")
        assert first.result()[0] == 2
        second = started.run(
            "import jax.numpy as jnp\nfrom jax.experimental import multihost_utils\n"
            "total = float(multihost_utils.process_allgather(jnp.ones(1) * (jax.process_index() + 1)).sum())\n"
            "(id(distributed.global_state.client) == client, os.getpid(), total)")
        same_client, pid, total = second.result()
        assert same_client and pid == first.result()[1] and total == 3.0  # initialized once, still working
    finally:
        started.stop()


def test_an_auto_session_cell_is_captured_and_pickled_once(monkeypatch):
    from kinetic_nb.client import plan

    pickled = []
    real = plan.capture.pickle_namespace
    monkeypatch.setattr(plan.capture, "pickle_namespace", lambda *args, **kw: pickled.append(args[0]) or real(*args, **kw))
    started = kinetic_nb.start(hosts=2, framework="auto", idle_timeout=600, echo=False)
    try:
        cell = started.run("import json\nvalue + 1", namespace={"__name__": "__main__", "value": 41})
        assert cell.result() == 42
        assert pickled == [["value"]]  # once, though the framework is chosen from what the cell imports
    finally:
        started.stop()


def test_torch_is_initialized_once_and_collectives_work_across_cells():
    started = kinetic_nb.start(hosts=2, framework="torch", idle_timeout=600, echo=False)
    try:
        source = ("import torch, torch.distributed as dist\nt = torch.tensor([float(dist.get_rank() + 1)])\n"
                  "dist.all_reduce(t)\n(dist.is_initialized(), t.item())")
        assert started.run(source).result() == (True, 3.0)
        assert started.run(source).result() == (True, 3.0)
    finally:
        started.stop()


def test_a_worker_failure_leaves_the_session_up_and_the_namespace_as_the_cell_left_it(session):
    session.run("count = 0").result()
    cell = session.run(HOST + "count += 1\nif host == 1:\n    raise ValueError('worker 1 broke')\n'ok'")
    with pytest.raises(ValueError, match="worker 1 broke") as info:
        cell.result()
    assert info.value.__notes__[0].startswith("Reported by host 1")
    assert session.ended() is None
    assert session.run("count").result() == 1  # the failed cell's own change stays, as Jupyter keeps it


def test_a_system_exit_fails_the_cell_not_the_host(session):
    with pytest.raises(HostExitError, match=r"^the cell on host 0 exited with SystemExit\(3\)"):  # as a one-shot cell's
        session.run(HOST + "import sys\nif host == 0:\n    sys.exit(3)\n1").result()
    assert session.run("'still up'").result() == "still up"


def test_a_killed_host_ends_the_session_and_the_cell_says_so(session):
    cell = session.run(HOST + "import signal, time\nif host == 1:\n    os.kill(os.getpid(), signal.SIGKILL)\n"
                              "time.sleep(600)")
    with pytest.raises(JobFailedError, match="host 1 was killed by SIGKILL") as info:
        cell.result(timeout=HANG_GUARD_S)
    assert any(note.startswith(f"kinetic_nb: session {session.session_id} ended: ") and "%kinetic restart" in note
               for note in info.value.__notes__), info.value.__notes__
    assert session.ended() is not None
    with pytest.raises(SessionEndedError, match="has ended"):
        session.run("1")


def _interrupt_soon(cell, delay: float = 0.5) -> None:
    threading.Timer(delay, cell.interrupt).start()


def test_an_interrupt_brings_every_host_back_to_idle(session):
    session.run("kept = 'yes'").result()
    cell = session.run("import time\nprint('waiting', flush=True)\ntime.sleep(600)")
    _interrupt_soon(cell)
    with pytest.raises(KeyboardInterrupt):
        cell.result(timeout=HANG_GUARD_S)
    assert session.ended() is None
    assert session.run("kept").result() == "yes"


def test_an_interrupt_that_cannot_return_ends_the_session(session):
    source = HOST + "import signal, time\nif host == 1:\n    signal.signal(signal.SIGINT, signal.SIG_IGN)\ntime.sleep(600)"
    cell = session.run(source)
    _interrupt_soon(cell, 1.0)
    with pytest.raises((KeyboardInterrupt, JobFailedError)):
        cell.result(timeout=HANG_GUARD_S)
    deadline = time.monotonic() + HANG_GUARD_S
    while session.ended() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "host 1 did not come back from cell 1" in session.ended()


def test_a_cell_timeout_interrupts_it(session):
    with pytest.raises(KineticTimeoutError, match="ran past its timeout of 1 s") as info:
        session.run("import time\ntime.sleep(600)", timeout=1).result(timeout=HANG_GUARD_S)
    assert "back to idle" in info.value.__notes__[-1]  # after where each host was
    assert session.run("'up'").result() == "up"


def test_an_idle_session_stops_itself():
    started = kinetic_nb.start(hosts=2, framework="none", idle_timeout=1, echo=False)
    deadline = time.monotonic() + HANG_GUARD_S
    while started.ended() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "idle for 1 s" in started.ended()
    with pytest.raises(SessionEndedError, match="idle for 1 s"):
        started.run("1")
    started.group.wait(timeout=HANG_GUARD_S)  # every host gone


def test_the_magic_runs_cells_on_the_session_and_refuses_a_shape_that_does_not_fit():
    InteractiveShell.clear_instance()  # a shell of its own: it ends on a stopped session
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "kinetic_nb")
    shell.run_line_magic("kinetic", "start -n 2 --framework none --idle-timeout 600")
    try:
        shell.run_cell("%%kinetic --quiet\nz = 5")
        result = shell.run_cell("%%kinetic --quiet\nz * 2", store_history=True)
        assert result.result == 10
        refused = shell.run_cell("%%kinetic -n 3\nz")
        assert type(refused.error_in_exec).__name__ == "UsageError"
        assert "session ks-" in str(refused.error_in_exec) and "--once" in str(refused.error_in_exec)
        once = shell.run_cell("%%kinetic --once -n 3 --quiet\n'beside it'", store_history=True)
        assert once.result == "beside it"
    finally:
        shell.run_line_magic("kinetic", "stop")
        InteractiveShell.clear_instance()


def test_a_kernel_restart_leaves_the_session_up_and_attach_finds_its_state(storage_root):
    with kernel() as (manager, client):
        reply, printed = run(client, "%kinetic start -n 2 --framework none --idle-timeout 600")
        assert reply["status"] == "ok", printed
        session_id = next(word for text in printed for word in text.split() if word.startswith("ks-"))
        reply, printed = run(client, "%%kinetic --quiet\nremembered = 'across a restart'")
        assert reply["status"] == "ok", printed
        old_pid = run(client, "import os\nos.getpid()")[1][-1]
        manager.restart_kernel(now=False)
        client.wait_for_ready(timeout=60)
        deadline = time.monotonic() + HANG_GUARD_S  # the old kernel may still answer as it shuts down
        while run(client, "import os\nos.getpid()")[1][-1] == old_pid and time.monotonic() < deadline:
            time.sleep(0.2)
        reply, printed = run(client, "%load_ext kinetic_nb")
        assert reply["status"] == "ok", printed
        reply, printed = run(client, f"%kinetic attach {session_id}")
        assert reply["status"] == "ok", printed
        reply, printed = run(client, "%%kinetic --quiet\nremembered")
        assert printed[-1] == "'across a restart'", printed
        run(client, "%kinetic stop")
    session = kinetic_nb.attach_session(session_id)
    session.group.wait(timeout=HANG_GUARD_S)
    assert session.ended() is not None


def test_cells_from_two_kernels_run_one_at_a_time_in_the_order_accepted(session):
    other = kinetic_nb.attach_session(session.session_id, echo=False)  # a second kernel, bound to the same session
    session.run("order = []").result()
    first = session.run("import time\ntime.sleep(0.3)\norder.append('first')")
    second = other.run("order.append('second')\nlist(order)")
    assert second.seq == first.seq + 1  # the session numbered them as it accepted them
    assert second.result() == ["first", "second"]
    first.result()


def test_a_local_session_wakes_its_hosts_through_sockets_only_this_user_reaches():
    import stat

    from kinetic_nb.runner.wakeup import wakeup_path

    started = kinetic_nb.start(hosts=2, framework="none", idle_timeout=600, echo=False)
    paths = [wakeup_path(started.session_id, index) for index in range(2)]
    try:
        assert started.run("'woken'").result() == "woken"
        assert started.group.woken  # and they wake this notebook
        modes = [os.stat(path) for path in paths]
        assert all(stat.S_ISSOCK(mode.st_mode) and stat.S_IMODE(mode.st_mode) == 0o600 for mode in modes)
        assert stat.S_IMODE(os.stat(os.path.dirname(paths[0])).st_mode) == 0o700
    finally:
        started.stop()
    started.group.wait(timeout=HANG_GUARD_S)
    assert not any(os.path.exists(path) for path in paths)  # gone with their hosts
    assert not os.path.exists(os.path.dirname(paths[0]))  # and the session's socket directory with them


def test_a_failed_session_cell_is_drawn_as_a_one_shot_jobs_failure(session):
    """What the panel gets: the phase the cell failed in (nothing is torn down), the host's own traceback and
    last line, the cell named as the notebook names it, and hosts done with the cell counted as done."""
    cell = session.run("import os\nif os.environ['RANK'] == '1':\n    raise ValueError('bad shard')\n'fine'",
                       cell_name="kinetic In[7]")
    with pytest.raises(ValueError, match="bad shard"):
        cell.result()
    snapshot = cell.snapshot()
    assert snapshot.label == f"In[7] · session {session.session_id}"
    leader, failed = snapshot.hosts
    assert (leader.state, failed.state) == ("succeeded", "failed")
    assert failed.phase == "execute" and "teardown" not in (leader.phase, failed.phase)
    assert "raise ValueError('bad shard')" in failed.traceback
    assert failed.log_tail[-1] == "host 1 failed while in the cell: ValueError: bad shard"
    assert leader.ended and failed.ended and failed.ended_at == failed.updated_at
    assert session.run("'up'").result() == "up"  # the session goes on


def test_what_goes_wrong_after_an_interrupt_is_said_in_its_note_never_raised_instead(session, monkeypatch):
    from kinetic_nb.errors import StorageError

    cell = session.run("'quick'")
    assert cell.result() == "quick"

    def broken(**_):
        raise StorageError("cannot write control/cell-000001-interrupt.json: Bad file descriptor")

    monkeypatch.setattr(cell, "interrupt", broken)
    note, withdrawn = cell._interrupt_and_report()
    assert not withdrawn
    assert note.startswith(f"kinetic_nb: could not learn whether session {session.session_id} is still up after "
                           "the interrupt (StorageError: cannot write")


def test_whether_a_session_ended_costs_one_listing_on_a_bucket_and_a_cell_tells_it_without_one(gcs_root):
    session = kinetic_nb.start(hosts=2, framework="none", storage=gcs_root, idle_timeout=600, echo=False)
    try:
        storage = session.storage
        calls = []
        real_list, real_read, real_bounded = storage.list, storage.read_bytes, storage.read_bounded
        storage.list = lambda prefix="": calls.append(("list", prefix)) or real_list(prefix)
        storage.read_bytes = lambda name: calls.append(("read", name)) or real_read(name)
        storage.read_bounded = lambda name, max_bytes: calls.append(("read", name)) or real_bounded(name, max_bytes)
        assert session.ended() is None
        assert calls == [("read", "control/cancel.json"), ("list", "hosts/")]  # not one read per host
        calls.clear()
        assert session.ended(hosts_ended=False) is None and calls == [("read", "control/cancel.json")]
        assert session.ended(hosts_ended=True) == "its hosts have ended"
    finally:
        del storage.list, storage.read_bytes
        session.stop()
    assert session.ended() == "stopped by the user"


def test_a_stop_reads_each_hosts_end_once(gcs_root, monkeypatch):
    """A stop on a bucket waits for the hosts' ends: it lists them, and reads each end once it is listed (a
    thousand hosts' ends, read again at every look, took it past its wait on gs://). Host 1 ignores its SIGTERM
    in a running cell, so the stop looks many times before its end (its agent's SIGKILL, a moment later)."""
    from kinetic_nb.client import sessions

    session = kinetic_nb.start(hosts=3, framework="none", storage=gcs_root, idle_timeout=600, echo=False)
    session.run(HOST + "import signal\nif host == 1:\n    signal.signal(signal.SIGTERM, signal.SIG_IGN)").result()
    cell = session.run("import time\nprint('sleeping', flush=True)\ntime.sleep(600)")
    deadline = time.monotonic() + 60
    while not all(host.last_line == "sleeping" for host in cell.hosts()):
        if time.monotonic() > deadline:
            session.stop()
            pytest.fail("the cell never ran")
        time.sleep(0.1)
    reads = []
    real_read_exit = sessions.read_exit
    monkeypatch.setattr(sessions, "read_exit", lambda storage, key, index: reads.append(index)
                        or real_read_exit(storage, key, index))
    said = session.stop()
    assert said == f"session {session.session_id} stopped: its 3 hosts and its agent have ended", said
    assert sorted(reads) == [0, 1, 2], reads


def test_a_one_shot_job_and_a_session_cell_are_one_handle_type_with_one_set_of_methods(session):
    # A one-shot job is a group that runs one cell: submit() and session.run() hand back the same type.
    job = kinetic_nb.submit(HOST + "print('from', host)\nhost + 10", hosts=2, framework="none", echo=False)
    cell = session.run(HOST + "print('from', host)\nhost + 20")
    assert type(job) is type(cell) is kinetic_nb.CellHandle is kinetic_nb.JobHandle
    assert job.one_shot and not cell.one_shot
    assert (job.result(), cell.result()) == (10, 20)
    for handle in (job, cell):
        assert handle.leader_result() == handle.result()
        assert handle.status() is kinetic_nb.JobStatus.SUCCEEDED
        assert [host.index for host in handle.hosts()] == [0, 1]
        assert "from 1" in handle.logs(1) and "from 0" in handle.logs(0)
        assert "SUCCEEDED" in handle.summary()
        with pytest.raises(ValueError, match=r"^host 2 is out of range for a 2-host job$"):
            handle.logs(2)
    # The one-shot job's hosts ended with its cell: no stacks to ask for. The session's are idle, up, and answer.
    assert job.stacks() == {} and job.group.status() is kinetic_nb.JobStatus.SUCCEEDED
    stacks = cell.stacks()
    assert set(stacks) == {0, 1} and all("no answer" not in text for text in stacks.values())
    assert not session.group.status().done


def test_interrupt_stops_a_one_shot_job_and_only_the_cell_of_a_session(session):
    job = kinetic_nb.submit("import time\ntime.sleep(600)", hosts=2, framework="none", echo=False)
    cell = session.run("import time\ntime.sleep(600)")
    deadline = time.monotonic() + HANG_GUARD_S
    while not all(host.state == "running" for host in job.hosts() + cell.hosts()):
        assert time.monotonic() < deadline, "the cells never ran"
        time.sleep(0.05)
    job.interrupt()  # a one-shot job's cell is its job: cancelled, its hosts gone
    assert job.status() is kinetic_nb.JobStatus.CANCELLED
    cell.interrupt()
    with pytest.raises(KeyboardInterrupt):
        cell.result(timeout=HANG_GUARD_S)
    assert session.run("'still up'").result() == "still up"


def test_a_local_session_cell_never_waits_for_a_channel_it_does_not_use(session, monkeypatch):
    """A cell's outcome is removed at once on a local disk: the pause for what the channel has yet to store is
    for a session whose cells went through it (it cost every local cell 1.5 s once)."""
    import time as real_time
    import types

    from kinetic_nb.client import cell_handle

    pauses: list[float] = []
    clock = types.SimpleNamespace(monotonic=real_time.monotonic, time=real_time.time,
                                  sleep=lambda seconds: (pauses.append(seconds), real_time.sleep(seconds)))
    monkeypatch.setattr(cell_handle, "time", clock)
    assert session.run("21 * 2").result(timeout=60) == 42
    assert not [pause for pause in pauses if pause >= cell_handle.STORE_INTERVAL_S]


def test_a_start_that_does_not_finish_leaves_no_session_up():
    """Whatever ends the wait for the hosts (an interrupt, a display that fails), the session it started is
    stopped: no host of it survives the test (the suite's fixture checks)."""
    class DisplayBroke(Exception):
        pass

    def show(snapshot):
        if any(host.state == "idle" for host in snapshot.hosts):
            raise DisplayBroke("the panel could not draw")

    with pytest.raises(DisplayBroke):
        kinetic_nb.start(hosts=2, framework="none", echo=False, on_snapshot=show)


def test_a_one_host_session_and_its_cell_say_one_host():
    session = kinetic_nb.start(hosts=1, framework="none", idle_timeout=600, echo=False)
    try:
        assert re.fullmatch(r"<Session ks-\S+ 1 host up>", repr(session)), repr(session)
        cell = session.run("1")
        assert cell.result(timeout=60) == 1 and " 1 host " in repr(cell)
        assert " · 1 host · " in session.summary().splitlines()[0]
    finally:
        session.stop()
