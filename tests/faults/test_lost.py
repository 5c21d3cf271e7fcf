"""A host whose heartbeat stops without an exit record is lost within a bound, and fails the job."""

from __future__ import annotations

import os
import signal
import time

import pytest

import kinetic_nb
from kinetic_nb.errors import JobFailedError
from kinetic_nb.runner.records import read_host_status
from kinetic_nb.runner.status import HEARTBEAT_INTERVAL_S
from kinetic_nb.state import LOST_AFTER_S, LOST_CONFIRM_S, JobStatus


def test_a_frozen_host_is_lost():
    handle = kinetic_nb.submit("import time\nprint('working', flush=True)\ntime.sleep(600)", hosts=2, grace=1)
    deadline = time.monotonic() + 30
    while not all(h.last_line == "working" for h in handle.hosts()) and time.monotonic() < deadline:
        time.sleep(0.1)
    pid = read_host_status(handle.storage, handle.key, 1).pid
    os.kill(pid, signal.SIGSTOP)  # alive but silent, as a host behind a dead network link is
    frozen_at = time.monotonic()
    try:
        with pytest.raises(JobFailedError) as info:
            handle.result()
        assert time.monotonic() - frozen_at < LOST_AFTER_S + 30  # a hang guard
        assert "host 1 was lost (no heartbeat and no exit record)" in str(info.value)
        # The outcome decided, the notebook stops the rest at once: host 0 is stopped, not left running.
        assert handle.hosts()[0].state in ("stopping", "stopped")
        assert handle.wait(timeout=30) is JobStatus.FAILED
        assert handle.hosts()[0].state == "stopped"
    finally:
        handle.cancel()  # SIGKILL reaches a stopped process


def test_a_pause_of_the_whole_machine_loses_no_host():
    """Every host silent at once past the limit, as when the machine (or VM) pauses as a whole: a host that beats
    again within LOST_CONFIRM_S of the notebook's next look was never lost."""
    handle = kinetic_nb.submit("import time\nprint('working', flush=True)\ntime.sleep(600)", hosts=2, grace=1)
    try:
        deadline = time.monotonic() + 30
        while not all(h.last_line == "working" for h in handle.hosts()) and time.monotonic() < deadline:
            time.sleep(0.1)
        pids = [read_host_status(handle.storage, handle.key, index).pid for index in range(2)]
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
