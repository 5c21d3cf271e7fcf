"""A host that hangs forever meets --timeout; a kernel interrupt cancels a waiting 4-host cell."""

from __future__ import annotations

import time

import pytest

import kinetic_nb
from kinetic_nb.client.outcome import JobStatus
from kinetic_nb.errors import KineticTimeoutError

from ..conftest import job_processes
from .helpers import kernel, newest_job


def test_a_hanging_host_meets_the_timeout():
    source = "import os, time\nprint('waiting forever', flush=True)\nif os.environ['RANK'] == '1':\n    time.sleep(10**6)"
    started = time.monotonic()
    handle = kinetic_nb.submit(source, hosts=2, timeout=3)
    with pytest.raises(KineticTimeoutError) as info:
        handle.result()
    assert time.monotonic() - started < 3 + 15
    assert "ran past its timeout of 3 s and was stopped on every host" in str(info.value)
    where = "\n".join(info.value.__notes__)
    assert "host 1: in the cell, last line: waiting forever" in where  # where it was stopped
    assert handle.status() is JobStatus.CANCELLED
    assert handle.hosts()[1].state == "stopped"


def test_a_kernel_interrupt_cancels_the_job(storage_root):
    with kernel() as (manager, client):
        submitted = time.time()
        msg_id = client.execute("%%kinetic -n 4\nimport time\nprint('sleeping', flush=True)\ntime.sleep(600)")
        handle = newest_job(storage_root, submitted, running_hosts=4)
        manager.interrupt_kernel()
        interrupted_at = time.monotonic()
        reply = client.get_shell_msg(timeout=30)
        assert reply["parent_header"]["msg_id"] == msg_id
        assert reply["content"]["status"] == "error"
        assert reply["content"]["ename"] == "CellInterrupted"  # a KeyboardInterrupt, shown as one line
        while job_processes() and time.monotonic() - interrupted_at < 30:
            time.sleep(0.05)
        assert job_processes() == []  # every host gone (a hang guard: the figure is in the benchmark)
        errors = []
        while True:
            message = client.get_iopub_msg(timeout=5)
            if message["msg_type"] == "error":
                errors.append(message["content"])
            if message["msg_type"] == "status" and message["content"]["execution_state"] == "idle":
                break
        assert any(f"cancelling job {handle.job_id}" in "\n".join(e["traceback"]) for e in errors)
    assert handle.status() is JobStatus.CANCELLED
    assert [host.state for host in handle.hosts()] == ["stopped"] * 4
