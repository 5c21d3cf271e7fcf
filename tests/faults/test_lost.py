"""A host whose heartbeat stops without an exit record is lost within a bound, and fails the job; the heartbeat is
its agent's, so a host that exists but runs nothing (stopped) is quiet, never lost."""

from __future__ import annotations

import os
import signal
import time

import pytest

import kinetic_nb
from kinetic_nb.agent.local_state import AgentState
from kinetic_nb.backends.local import agent_files
from kinetic_nb.errors import JobFailedError, KineticTimeoutError
from kinetic_nb.runner.records import read_host_status
from kinetic_nb.runner.status import HEARTBEAT_INTERVAL_S
from kinetic_nb.state import LOST_AFTER_S, LOST_CONFIRM_S, JobStatus

WORKING = "import time\nprint('working', flush=True)\ntime.sleep(600)"
#: Longer than a notebook waits before it calls a silent host lost, with room to spare.
PAST_THE_LOST_LIMIT_S = LOST_AFTER_S + LOST_CONFIRM_S + 2


def wait_until_working(handle) -> None:
    deadline = time.monotonic() + 30
    while not all(h.last_line == "working" for h in handle.hosts()) and time.monotonic() < deadline:
        time.sleep(0.1)


def agent_pid(handle) -> int:
    return AgentState.read(agent_files(handle.job_id)[1]).pid


def test_a_host_whose_agent_is_frozen_is_lost():
    """Its agent answers for a host: one cut off (stopped here, as one behind a dead network link is silent)
    leaves its hosts' heartbeats to age, and the notebook calls them lost, then stops what it can."""
    handle = kinetic_nb.submit(WORKING, hosts=2, grace=1)
    wait_until_working(handle)
    agent = agent_pid(handle)
    os.kill(agent, signal.SIGSTOP)
    try:
        with pytest.raises(JobFailedError) as info:
            handle.result(timeout=LOST_AFTER_S + 30)  # a hang guard
        assert "host 0 was lost (no heartbeat and no exit record)" in str(info.value)
        assert "host 1 was lost (no heartbeat and no exit record)" in str(info.value)
    finally:
        os.kill(agent, signal.SIGCONT)  # thawed, it acts on the notebook's cancel
        handle.cancel()
    assert handle.wait(timeout=30) is JobStatus.FAILED


def test_a_stopped_host_is_quiet_not_lost_and_its_cell_ends_at_its_timeout():
    """A stopped host exists: its agent beats for it, so it is shown quiet (silent past the grace after another
    host ended, its stacks saying why), never lost; the agent's timeout still ends it (SIGKILL reaches it)."""
    source = "import os, time\nprint('working', flush=True)\nif os.environ['KINETIC_HOST_INDEX'] == '1':\n" \
             "    time.sleep(600)\n'the leader is done'"
    timeout = 2 + PAST_THE_LOST_LIMIT_S + 5
    handle = kinetic_nb.submit(source, hosts=2, grace=1, timeout=timeout)
    deadline = time.monotonic() + 30
    while handle.hosts()[1].last_line != "working" and time.monotonic() < deadline:
        time.sleep(0.1)
    os.kill(read_host_status(handle.storage, handle.key, 1).pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    seen: set[str] = set()
    try:
        while time.monotonic() - stopped_at < PAST_THE_LOST_LIMIT_S:
            seen |= {host.state for host in handle.hosts()[1:]}
            time.sleep(0.1)
        assert "lost" not in seen and "quiet" in seen
        host = handle.hosts()[1]
        assert host.state == "quiet" and "is stopped by a signal" in host.stacks
        with pytest.raises(KineticTimeoutError, match=f"ran past its timeout of {timeout:g} s"):
            handle.result(timeout=timeout + 30)
        assert handle.status() is JobStatus.CANCELLED
        assert handle.leader_result() == "the leader is done"
    finally:
        handle.cancel()  # SIGKILL reaches a stopped process


def test_a_pause_of_the_whole_machine_loses_no_host():
    """Every host and its agent silent at once past the limit, as when the machine (or VM) pauses as a whole: a
    host beaten again within LOST_CONFIRM_S of the notebook's next look was never lost."""
    handle = kinetic_nb.submit(WORKING, hosts=2, grace=1)
    try:
        wait_until_working(handle)
        pids = [agent_pid(handle)] + [read_host_status(handle.storage, handle.key, index).pid for index in range(2)]
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        time.sleep(LOST_AFTER_S + 1)  # the notebook does not look meanwhile, as on a paused machine
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
        seen = set()
        watch_until = time.monotonic() + LOST_CONFIRM_S + 2 * HEARTBEAT_INTERVAL_S
        while time.monotonic() < watch_until:
            seen |= {host.state for host in handle.hosts()}
            time.sleep(0.05)
        assert seen == {"running"}
        assert handle.status() is JobStatus.RUNNING
    finally:
        handle.cancel()
        handle.wait(timeout=30)
