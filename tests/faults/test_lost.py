"""A host whose process vanished without an exit record is lost within a bound, and fails the job."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

import kinetic_nb
from kinetic_nb.errors import JobFailedError
from kinetic_nb.results import JobStatus
from kinetic_nb.state import LOST_AFTER_S


def test_hosts_are_lost_when_their_supervisor_dies():
    handle = kinetic_nb.submit("import time\nprint('working', flush=True)\ntime.sleep(600)", hosts=2)
    deadline = time.monotonic() + 30
    while not all(h.last_line == "working" for h in handle.hosts()) and time.monotonic() < deadline:
        time.sleep(0.1)
    host_pid = handle.hosts()[0].exit or psutil.Process(
        __import__("json").loads(handle.storage.read_bytes("hosts/0/status.json"))["pid"])
    supervisor = host_pid.parent()
    os.kill(supervisor.pid, signal.SIGKILL)  # its hosts die with it; nobody writes their exit records
    killed_at = time.monotonic()
    with pytest.raises(JobFailedError) as info:
        handle.result()
    assert time.monotonic() - killed_at < LOST_AFTER_S + 10
    assert "was lost (no heartbeat and no exit record)" in str(info.value)
    assert handle.status() is JobStatus.FAILED
    assert [host.state for host in handle.hosts()] == ["lost", "lost"]
