"""The host agent bounds a job with no client waiting, answers for stacks, and its own death is named.

No test here asserts a time tighter than a hang guard: the figures are in
``benchmarks/failure_detection.py``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import kinetic_nb
from kinetic_nb.agent import processes
from kinetic_nb.agent.local_state import AgentState
from kinetic_nb.backends.local import agent_files
from kinetic_nb.client.keys import load_key
from kinetic_nb.client.outcome import JobStatus
from kinetic_nb.errors import JobFailedError, KineticTimeoutError
from kinetic_nb.runner import protocol
from kinetic_nb.runner.job_keys import JOB
from kinetic_nb.runner.protocol import CancelRequest, ExitSummary, FirstFailure
from kinetic_nb.runner.records import read_exit, read_host_status, read_record
from kinetic_nb.storage import Storage, open_storage

from .helpers import wait_for

HOST = "import os\nhost = int(os.environ['KINETIC_HOST_INDEX'])\n"
#: Generous: a bound that only catches a hang, never a slow machine.
HANG_GUARD_S = 60.0


def stored_exits(storage: Storage, hosts: int, key: bytes) -> dict[int, ExitSummary] | None:
    """Every host's exit record, read straight from storage as a second kernel would, or None."""
    names = {info.name for info in storage.list()}
    if not all(protocol.host_exit(i) in names for i in range(hosts)):
        return None
    return {i: read_exit(storage, key, i) for i in range(hosts)}


def test_the_agent_stops_a_job_at_its_timeout_with_its_kernel_gone(storage_root):
    kernel = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent("""
            import time, kinetic_nb
            job = kinetic_nb.submit("import time\\nprint('up', flush=True)\\ntime.sleep(600)", hosts=2, timeout=4, grace=1)
            print(job.uri, flush=True)
            time.sleep(600)
        """)], stdout=subprocess.PIPE, text=True, env={**os.environ, "KINETIC_STORAGE": storage_root})
    uri = kernel.stdout.readline().strip()
    time.sleep(2)
    kernel.kill()  # the kernel that submitted the job dies 2 s in; nobody waits for the job
    kernel.wait()
    storage = open_storage(uri)
    key = load_key(uri.rsplit("/", 1)[1], JOB)  # this user's key, as a second kernel finds it
    exits = wait_for(lambda: stored_exits(storage, 2, key), "every host ending")
    assert CancelRequest.from_json(read_record(storage, key, protocol.CANCEL)).reason == CancelRequest.TIMEOUT
    assert all(summary.stopped for summary in exits.values())
    job = kinetic_nb.attach(uri.rsplit("/", 1)[1], storage=storage_root)
    with pytest.raises(KineticTimeoutError, match="ran past its timeout of 4 s"):
        job.result()
    assert job.status() is JobStatus.CANCELLED


def test_grace_is_enforced_with_no_client_waiting():
    source = HOST + "import time\nif host == 1:\n    raise ValueError('host 1 broke')\ntime.sleep(600)"
    job = kinetic_nb.submit(source, hosts=3, grace=1)
    exits = wait_for(lambda: stored_exits(job.storage, 3, job.key), "every host ending")  # job.result() is never called
    first = FirstFailure.from_json(read_record(job.storage, job.key, protocol.FAILED))
    assert first.host_index == 1 and "exited with code 1" in first.description
    assert exits[1].failed and "ValueError: host 1 broke" in "\n".join(exits[1].stderr_tail)
    assert exits[0].stopped and exits[2].stopped
    with pytest.raises(ValueError, match="host 1 broke"):
        job.result()


def test_stacks_of_hosts_blocked_in_c_code():
    source = HOST + (
        "import select, time\n"
        "print('ready', flush=True)\n"
        "if host == 0:\n"
        "    time.sleep(600)\n"
        "else:\n"
        "    select.select([], [], [], 600)\n"
    )
    job = kinetic_nb.submit(source, hosts=2)
    wait_for(lambda: all(h.last_line == "ready" for h in job.hosts()), "both hosts printing")
    stacks = job.stacks()
    assert sorted(stacks) == [0, 1]
    assert 'File "<kinetic cell>", line 6 in <module>' in stacks[0]  # blocked in time.sleep
    assert 'File "<kinetic cell>", line 8 in <module>' in stacks[1]  # blocked in select
    assert job.stacks(host=1).keys() == {1}
    job.cancel()
    assert job.status() is JobStatus.CANCELLED


def test_stacks_of_a_host_that_cannot_answer_say_so():
    source = HOST + "import signal, time\nprint('ready', flush=True)\ntime.sleep(600)"
    job = kinetic_nb.submit(source, hosts=2)
    wait_for(lambda: all(h.last_line == "ready" for h in job.hosts()), "both hosts printing")
    pid = read_host_status(job.storage, job.key, 1).pid
    os.kill(pid, signal.SIGSTOP)  # a stopped process runs no signal handler at all
    try:
        stacks = job.stacks()
    finally:
        os.kill(pid, signal.SIGCONT)
    assert "line 5 in <module>" in stacks[0]
    assert stacks[1].startswith("no answer")
    job.cancel()


def test_an_agent_that_dies_before_any_host_starts_fails_the_cell_with_its_log(tmp_path, monkeypatch):
    broken = tmp_path / "python"  # an interpreter whose kinetic_nb cannot be imported
    broken.write_text("#!/bin/sh\necho 'ImportError: simulated broken installation' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(broken))
    job = kinetic_nb.submit("1", hosts=2)
    with pytest.raises(JobFailedError) as info:
        job.result(timeout=HANG_GUARD_S)
    message = str(info.value)
    assert "the job's agent exited with code 1 before it started any host" in message
    assert "simulated broken installation" in message  # the tail of its log
    assert job.status() is JobStatus.FAILED


def test_an_agent_killed_mid_job_fails_the_cell_naming_it():
    job = kinetic_nb.submit("import time\nprint('working', flush=True)\ntime.sleep(600)", hosts=2)
    wait_for(lambda: all(h.last_line == "working" for h in job.hosts()), "both hosts working")
    state = AgentState.read(agent_files(job.job_id)[1])
    os.kill(state.pid, signal.SIGKILL)  # its hosts die with it (parent-death signal)
    with pytest.raises(JobFailedError) as info:
        job.result(timeout=HANG_GUARD_S)
    assert f"the job's agent (pid {state.pid}) died" in str(info.value)
    assert job.status() is JobStatus.FAILED


def test_no_host_outlives_an_agent_killed_while_forking():
    job = kinetic_nb.submit("import time\ntime.sleep(600)", hosts=24)
    state = wait_for(lambda: AgentState.read(agent_files(job.job_id)[1]), "the agent's record")
    os.kill(state.pid, signal.SIGKILL)  # as early as possible: most hosts are not forked yet
    with pytest.raises(JobFailedError):
        job.result(timeout=HANG_GUARD_S)
    # The autouse fixture fails this test if any host process survives.


def test_the_local_backend_refuses_more_hosts_than_it_can_run():
    before = set(os.listdir(open_storage(os.environ["KINETIC_STORAGE"]).local_path()))
    with pytest.raises(ValueError, match="10000 host processes are more than the local backend runs") as info:
        kinetic_nb.submit("1", hosts=10000)
    assert "\n" not in str(info.value)
    assert set(os.listdir(open_storage(os.environ["KINETIC_STORAGE"]).local_path())) == before  # nothing stored


def test_a_low_open_file_limit_is_refused_before_anything_starts():
    code = textwrap.dedent("""
        import resource, kinetic_nb
        resource.setrlimit(resource.RLIMIT_NOFILE, (100, 100))
        try:
            kinetic_nb.submit("1", hosts=40)
        except ValueError as error:
            print(error)
    """)
    printed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "40 local hosts need about 224 open files" in printed and "ulimit -n" in printed


def test_a_storage_error_mid_job_is_named(tmp_path):
    job = kinetic_nb.submit("import time\nprint('working', flush=True)\ntime.sleep(3)\nprint('done')", hosts=2)
    wait_for(lambda: all(h.last_line == "working" for h in job.hosts()), "both hosts working")
    hosts_dir = job.storage.local_path(protocol.HOSTS_DIR)
    os.rename(hosts_dir, hosts_dir + ".moved")
    with open(hosts_dir, "w"):  # every write below hosts/ now fails with ENOTDIR
        pass
    with pytest.raises(JobFailedError) as info:
        job.result(timeout=HANG_GUARD_S)
    assert "storage error: ENOTDIR" in str(info.value)


def test_a_worker_stuck_after_the_leader_succeeded_is_shown_quiet_with_its_stack():
    source = HOST + "import time\nif host == 1:\n    time.sleep(600)\n'the leader is done'"
    job = kinetic_nb.submit(source, hosts=2, grace=1)
    quiet = wait_for(lambda: [h for h in job.hosts() if h.state == "quiet"], "host 1 turning quiet")
    assert [h.index for h in quiet] == [1]
    assert 'File "<kinetic cell>", line 5 in <module>' in quiet[0].stacks
    assert "host 1 is quiet" in job.summary() and "at the cell, line 5: time.sleep(600)" in job.summary()
    with pytest.raises(KineticTimeoutError, match="it goes on"):
        job.result(timeout=2)  # a slow checkpoint is legitimate: the cell keeps waiting
    assert job.leader_result() == "the leader is done"  # never lost, whatever the workers do
    job.cancel()
    assert job.leader_result() == "the leader is done"


def test_light_hosts_lift_the_local_limit_for_tests_and_benchmarks_only(monkeypatch):
    """``KINETIC_LIGHT_HOSTS=1`` lets hosts with no framework go past ``MAX_LOCAL_HOSTS``, up to
    ``MAX_LIGHT_HOSTS``; a framework's hosts, or a user without the setting, keep the limit."""
    hosts = processes.MAX_LOCAL_HOSTS + 1
    too_many = f"{hosts} host processes are more than the local backend runs"
    monkeypatch.delenv(processes.LIGHT_HOSTS_ENV, raising=False)
    assert too_many in (processes.host_count_problem(hosts, "none") or "")
    monkeypatch.setenv(processes.LIGHT_HOSTS_ENV, "1")
    assert too_many in (processes.host_count_problem(hosts, "jax") or "")
    assert too_many not in (processes.host_count_problem(hosts, "none") or "")
    assert "more than the local backend runs (at most 1024)" in processes.host_count_problem(1025, "none")
