"""The agent answers for its hosts' liveness: a host holding its GIL, or stopped, is never lost; the pace follows
a session host's cells; the host's own interpreter never beats."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import kinetic_nb
from kinetic_nb.agent.liveness import Liveness, not_running
from kinetic_nb.runner import protocol
from kinetic_nb.runner.job_keys import new_key
from kinetic_nb.runner.protocol import HostState
from kinetic_nb.runner.records import read_host_status
from kinetic_nb.runner.status import HEARTBEAT_INTERVAL_S, StatusReporter
from kinetic_nb.state import LOST_AFTER_S, LOST_CONFIRM_S
from kinetic_nb.storage import LocalStorage

from ..faults.helpers import wait_for

HOST = "import os\nhost = int(os.environ['KINETIC_HOST_INDEX'])\n"
#: Only catches a hang, never a slow machine.
HANG_GUARD_S = 60.0
#: Longer than a notebook waits before it calls a silent host lost, with room to spare.
PAST_THE_LOST_LIMIT_S = LOST_AFTER_S + LOST_CONFIRM_S + 2


class Beats:
    """A write that records which heartbeats were written."""

    def __init__(self):
        self.names: list[str] = []
        self.lock = threading.Lock()

    def __call__(self, name: str) -> None:
        with self.lock:
            self.names.append(name)

    def of(self, index: int) -> int:
        with self.lock:
            return self.names.count(protocol.host_heartbeat(index))


# -- the beater alone --------------------------------------------------------------------------------------


def test_a_round_beats_a_busy_host_at_the_busy_pace_and_an_idle_one_at_the_idle_pace():
    beats = Beats()
    liveness = Liveness(beats, read_state=lambda index: None, busy_s=0.3, idle_s=600)
    liveness.add(0, session=True)
    liveness.add(1, session=True)
    assert liveness.beat_round() == [0, 1]  # every host at once, as it starts
    liveness.cell_ended(1)
    time.sleep(0.35)
    assert liveness.beat_round() == [0]  # host 1 is idle: not due for the idle pace
    liveness.cell_started(1)
    time.sleep(0.35)
    assert liveness.beat_round() == [0, 1]
    liveness.forget(0)  # reaped: its exit record speaks for it
    time.sleep(0.35)
    assert liveness.beat_round() == [1]


def test_a_session_host_is_idle_before_its_first_cell_once_its_status_says_so():
    beats = Beats()
    states = {0: HostState.RUNNING.value}
    liveness = Liveness(beats, read_state=states.get, busy_s=0.3, idle_s=600)
    liveness.add(0, session=True)
    liveness.add(1, session=False)  # a one-shot job's host: never read, never idle
    liveness.beat_round()
    time.sleep(0.35)
    assert liveness.beat_round() == [0, 1]  # still starting: the busy pace
    states[0] = states[1] = HostState.IDLE.value
    time.sleep(0.35)
    assert liveness.beat_round() == [0, 1]  # beaten first, then read: idle from the next round on
    time.sleep(0.35)
    assert liveness.beat_round() == [1]


def test_on_a_bucket_a_round_beats_before_it_reads_and_reads_the_starting_hosts_at_once():
    # At a thousand hosts' start on a bucket, the agent read every starting host's status one by one before it beat
    # any: a round took longer than the pace, and the notebook called host 0 lost while it waited for the others.
    hosts = 16
    beats, meeting = Beats(), threading.Barrier(hosts, timeout=1.0)

    def read_state(index):
        assert beats.of(index) == 1  # this round's beat is written before any read
        meeting.wait()  # every starting host's status is read at once (one by one, the first read never returns)
        return HostState.IDLE.value

    liveness = Liveness(beats, read_state=read_state, busy_s=0.3, idle_s=600, remote=True)
    for index in range(hosts):
        liveness.add(index, session=True)
    liveness.start()  # its first round at once
    try:
        time.sleep(2.5)  # rounds at the busy pace, past a read's wait for the others (one by one: it gives up)
        # Each beaten once: idle from the first round on (a read that failed would have left it busy).
        assert [beats.of(index) for index in range(hosts)] == [1] * hosts
    finally:
        liveness.stop()


def test_a_cell_that_starts_after_a_long_idle_is_beaten_at_once_and_a_channel_that_comes_up_beats_everyone():
    beats = Beats()
    liveness = Liveness(beats, read_state=lambda index: None, busy_s=1.0, idle_s=600)
    liveness.add(0, session=True)
    liveness.add(1, session=True)
    liveness.start()
    try:
        wait_for(lambda: beats.of(0) == 1 and beats.of(1) == 1, "the first round")
        liveness.cell_ended(0)
        liveness.cell_ended(1)  # every host idle: the next round is the idle pace away
        liveness.cell_started(0)  # at once: beaten at the busy pace from its last beat, not the idle one
        wait_for(lambda: beats.of(0) == 2, "host 0 beaten at the busy pace", guard=10)
        liveness.cell_ended(0)
        time.sleep(1.5)  # idle for longer than the busy pace
        liveness.cell_started(0)
        wait_for(lambda: beats.of(0) == 3, "host 0 beaten as its cell starts", guard=10)
        assert beats.of(1) == 1  # still idle
        liveness.beat_now()
        wait_for(lambda: beats.of(0) == 4 and beats.of(1) == 2, "every host beaten at once", guard=10)
    finally:
        liveness.stop()


def test_a_stopped_process_is_told_from_a_running_one():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert not_running(child.pid) == ""
        os.kill(child.pid, signal.SIGSTOP)
        wait_for(lambda: not_running(child.pid), "the child stopping")
        assert not_running(child.pid) == "is stopped by a signal (SIGSTOP or SIGTSTP)"
        os.kill(child.pid, signal.SIGCONT)
        wait_for(lambda: not_running(child.pid) == "", "the child running again")
    finally:
        child.kill()
        child.wait()
    assert not_running(child.pid) == ""  # gone


def test_the_host_never_beats_nor_wakes_a_thread_to_beat(tmp_path):
    storage = LocalStorage(str(tmp_path / "job"))
    reporter = StatusReporter(storage, 0, new_key())
    before = set(threading.enumerate())
    reporter.start()
    reporter.update(state=HostState.RUNNING)
    time.sleep(HEARTBEAT_INTERVAL_S + 0.5)
    assert not storage.exists(protocol.host_heartbeat(0))
    assert set(threading.enumerate()) == before  # no deferred write yet: no thread at all
    reporter.stop()


# -- real hosts --------------------------------------------------------------------------------------------


def test_a_host_whose_interpreter_holds_the_gil_past_the_lost_limit_is_not_lost():
    """A C call that holds the GIL (``sleep`` through ``ctypes.PyDLL``, as a framework's long call would) starves
    every Python thread of its host: the cell measures that it did, and no host is ever shown lost."""
    source = HOST + (
        "import ctypes, threading, time\n"
        "ticks = []\n"
        "def tick():\n"
        "    while True:\n"
        "        ticks.append(time.monotonic())\n"
        "        time.sleep(0.05)\n"
        "threading.Thread(target=tick, daemon=True).start()\n"
        "time.sleep(0.3)\n"
        f"ctypes.PyDLL(None).sleep({PAST_THE_LOST_LIMIT_S:.0f})  # holds the GIL throughout\n"
        "time.sleep(0.3)\n"
        "max(later - earlier for earlier, later in zip(ticks, ticks[1:]))"
    )
    handle = kinetic_nb.submit(source, hosts=2, grace=1)
    seen = set()
    try:
        while not handle.status().done:
            seen |= {host.state for host in handle.hosts()}
            time.sleep(0.1)
        starved_s = handle.result()
    finally:
        handle.cancel()
    assert starved_s > LOST_AFTER_S + LOST_CONFIRM_S  # the host's own threads ran nothing for that long
    assert "lost" not in seen


def test_a_stopped_host_is_quiet_with_why_and_its_cell_ends_once_it_is_continued():
    source = HOST + "import time\nprint('working', flush=True)\nif host == 1:\n    time.sleep(4)\n'the leader is done'"
    handle = kinetic_nb.submit(source, hosts=2, grace=1)
    wait_for(lambda: handle.hosts()[1].last_line == "working", "host 1 working")
    pid = read_host_status(handle.storage, handle.key, 1).pid
    os.kill(pid, signal.SIGSTOP)
    try:
        quiet = wait_for(lambda: [h for h in handle.hosts() if h.state == "quiet" and h.stacks], "host 1 quiet")
        assert [h.index for h in quiet] == [1]
        assert "host 1 is stopped by a signal" in quiet[0].stacks and "SIGCONT" in quiet[0].stacks
        seen = set()
        watch_until = time.monotonic() + PAST_THE_LOST_LIMIT_S
        while time.monotonic() < watch_until:
            seen |= {host.state for host in handle.hosts()[1:]}
            time.sleep(0.1)
        assert seen == {"quiet"}
    finally:
        os.kill(pid, signal.SIGCONT)
    assert handle.result(timeout=HANG_GUARD_S) == "the leader is done"
    assert [h.state for h in handle.hosts()] == ["succeeded", "succeeded"]


def test_an_idle_session_host_is_beaten_at_the_idle_pace_and_at_once_when_a_cell_starts():
    session = kinetic_nb.start(hosts=2, framework="none", echo=False, quiet=True)
    try:
        paths = [session.storage.local_path(protocol.host_heartbeat(index)) for index in range(2)]
        time.sleep(HEARTBEAT_INTERVAL_S + 0.5)  # one busy round more: the agent reads that the hosts are idle
        idle_since = [os.stat(path).st_mtime_ns for path in paths]
        time.sleep(2 * HEARTBEAT_INTERVAL_S + 0.5)
        assert [os.stat(path).st_mtime_ns for path in paths] == idle_since  # not rewritten while idle
        assert session.run("import time\ntime.sleep(0.5)\n'ran'").result() == "ran"
        assert all(os.stat(path).st_mtime_ns > before for path, before in zip(paths, idle_since, strict=True))
    finally:
        session.stop()


def _beaten_again(snapshot, what: str) -> None:
    """Every host's heartbeat, as the notebook lists it, rewritten after it was first seen."""
    first = wait_for(lambda: (beats := [h.heartbeat_at for h in snapshot().hosts]) and all(beats) and beats,
                     f"{what}: every host's first heartbeat")
    wait_for(lambda: all(h.heartbeat_at > at for h, at in zip(snapshot().hosts, first, strict=True)),
             f"{what}: every host beaten again")


def test_hosts_on_a_bucket_are_beaten_by_their_agent_through_storage_and_through_a_sessions_channel(gcs_root):
    """On a bucket each beat is a request (the agent sends a round's together); a session's agent beats through
    its hub as well, and storage is still the record."""
    handle = kinetic_nb.submit("import time\nprint('working', flush=True)\ntime.sleep(600)", hosts=2,
                               storage=gcs_root)
    try:
        _beaten_again(handle.snapshot, "a one-shot job")
    finally:
        handle.cancel()
        handle.wait(timeout=30)
    session = kinetic_nb.start(hosts=2, framework="none", storage=gcs_root, echo=False, quiet=True)
    try:
        cell = session.run("import time\ntime.sleep(600)")
        assert session.channel is not None and session.channel.broken is None
        _beaten_again(session.group.snapshot, "a session's cell")
        cell.cancel()
    finally:
        session.stop()
