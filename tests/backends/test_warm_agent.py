"""A notebook's warm agent forks each local job's agent past its imports; the agent it forks behaves as one
started afresh, holds no secret in its environment, and outlives the notebook as any job's agent does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

import kinetic_nb
from kinetic_nb.agent.local_state import AgentState
from kinetic_nb.backends import warm_agent
from kinetic_nb.backends.local import agent_files

HANG_GUARD_S = 60.0
WAIT_FOR_GO = ("import os, sys, time\ndeadline = time.time() + 60\n"
               "while not os.path.exists({go!r}) and time.time() < deadline:\n    time.sleep(0.01)\n")


def agent_of(job) -> psutil.Process:
    """The job's agent, by the record it keeps of itself."""
    deadline = time.monotonic() + HANG_GUARD_S
    while (state := AgentState.read(agent_files(job.job_id)[1])) is None:
        assert time.monotonic() < deadline, "the job's agent never recorded itself"
        time.sleep(0.01)
    return psutil.Process(state.pid)


def warm_job(source: str, **options):
    """A job whose agent the warm agent forked: the first starts its own (and the warm agent), the next not."""
    deadline = time.monotonic() + HANG_GUARD_S
    while True:
        job = kinetic_nb.submit(source, **options)
        warm = warm_agent._warm
        if warm is not None and agent_of(job).ppid() == warm.process.pid:
            return job, warm
        job.cancel()
        assert time.monotonic() < deadline, "the warm agent never forked a job's agent"
        time.sleep(0.1)


def test_a_job_forked_by_the_warm_agent_runs_as_a_fresh_agents_would_and_keeps_its_secrets_off_its_environment(
        tmp_path, monkeypatch):
    go = tmp_path / "go"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "helper_module.py").write_text("WHERE = 'the notebook directory'\n")
    source = WAIT_FOR_GO.format(go=str(go)) + (
        "import helper_module\n(os.getcwd(), sys.path[0], os.environ['TOKEN'], helper_module.WHERE)")
    job, warm = warm_job(source, hosts=2, framework="none", env={"TOKEN": "s3cr3t-value"})
    agent = agent_of(job)
    # Neither the key nor an -e value is in any process's environment as the kernel shows it (/proc/PID/environ).
    for process in [agent, *agent.children(recursive=True)]:
        shown = Path(f"/proc/{process.pid}/environ").read_bytes()
        assert b"s3cr3t-value" not in shown and job.key.hex().encode() not in shown
    go.touch()
    assert job.result(timeout=HANG_GUARD_S) == (str(tmp_path), str(tmp_path), "s3cr3t-value",
                                                "the notebook directory")
    assert warm.process.poll() is None  # it stays for the next job


def test_a_changed_interpreter_setting_or_the_switch_starts_the_jobs_agent_afresh(monkeypatch, tmp_path):
    go = tmp_path / "go"
    go.touch()  # every job here runs straight through
    job, warm = warm_job("1", hosts=1, framework="none")
    assert job.result(timeout=HANG_GUARD_S) == 1
    # PYTHON* variables act when an interpreter starts: a warm agent started without this one cannot honour it.
    monkeypatch.setenv("PYTHONWARNINGS", "ignore::FutureWarning")
    go.unlink()
    fresh = kinetic_nb.submit(WAIT_FOR_GO.format(go=str(go)) + "sys.warnoptions", hosts=1, framework="none")
    assert fresh.job_id in " ".join(agent_of(fresh).cmdline())  # started afresh: its own command line
    go.touch()
    assert fresh.result(timeout=HANG_GUARD_S) == ["ignore::FutureWarning"]
    assert warm.process.wait(HANG_GUARD_S) is not None  # the stale one is gone; another serves the next job
    monkeypatch.setenv(warm_agent.WARM_AGENT_ENV, "0")
    go.unlink()
    off = kinetic_nb.submit(WAIT_FOR_GO.format(go=str(go)) + "2", hosts=1, framework="none")
    assert off.job_id in " ".join(agent_of(off).cmdline())
    go.touch()
    assert off.result(timeout=HANG_GUARD_S) == 2


def test_the_warm_agent_ends_with_its_notebook_and_the_job_it_forked_goes_on(tmp_path):
    go = tmp_path / "go"
    notebook = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.path.dirname(os.path.dirname(os.path.dirname(__file__)))!r})
        from tests.backends.test_warm_agent import warm_job, WAIT_FOR_GO
        job, warm = warm_job(WAIT_FOR_GO.format(go={str(go)!r}) + "'went on'", hosts=2, framework="none")
        print(job.job_id, warm.process.pid, flush=True)
        import time
        time.sleep(600)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        job_id, warm_pid = notebook.stdout.readline().split()
    finally:
        notebook.send_signal(signal.SIGKILL)
        notebook.wait()
        notebook.stdout.close()
    gone, _ = psutil.wait_procs([psutil.Process(int(warm_pid))], timeout=HANG_GUARD_S)
    assert gone, "the warm agent outlived its notebook"
    go.touch()
    assert kinetic_nb.attach(job_id).result(timeout=HANG_GUARD_S) == "went on"


@pytest.fixture(autouse=True)
def _stop_the_warm_agent():
    """Each test here starts from no warm agent, and leaves none."""
    warm_agent.stop_warm_agent()
    yield
    warm_agent.stop_warm_agent()


def test_an_agent_the_warm_agent_could_not_start_says_so_in_its_record_and_log_at_once(tmp_path):
    import json
    import socket

    name = f"kinetic-warm-test-{os.getpid()}"
    server = subprocess.Popen([sys.executable, "-m", "kinetic_nb.agent.warm", "--parent", str(os.getpid()),
                               "--name", name])
    state, log = tmp_path / "agent.json", tmp_path / "agent.log"
    # The notebook's working directory is gone by the time the agent would enter it.
    request = {"argv": ["--job", f"file://{tmp_path}/job", "--all-hosts", "--key-stdin", "--state", str(state)],
               "env": dict(os.environ), "cwd": str(tmp_path / "gone"), "key": "00" * 32, "log": str(log)}
    try:
        deadline = time.monotonic() + HANG_GUARD_S
        while True:
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
                    connection.connect("\0" + name)
                    connection.sendall(json.dumps(request).encode())
                    connection.shutdown(socket.SHUT_WR)
                    forked = int(connection.recv(64))
                break
            except ConnectionRefusedError:  # still importing
                assert time.monotonic() < deadline, "the warm agent never listened"
                time.sleep(0.05)
        while (recorded := AgentState.read(str(state))) is None:
            assert time.monotonic() < deadline, "the agent that could not start left no record"
            time.sleep(0.05)
        assert recorded is not None and recorded.finished and recorded.pid == forked
        assert "could not start from the warm agent: FileNotFoundError" in log.read_text()
    finally:
        server.kill()
        server.wait()


def test_the_variables_that_act_when_a_process_starts_are_what_a_warm_agent_must_share():
    env = {"PYTHONPATH": "src", "LD_LIBRARY_PATH": "/opt/cuda/lib64", "LD_PRELOAD": "libx.so",
           "GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "MALLOC_ARENA_MAX": "2",
           "HOME": "/root", "CUDA_VISIBLE_DEVICES": "0", "MY_PYTHON": "read by the cell, after the start"}
    assert warm_agent.startup_variables(env) == {
        "PYTHONPATH": "src", "LD_LIBRARY_PATH": "/opt/cuda/lib64", "LD_PRELOAD": "libx.so",
        "GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "MALLOC_ARENA_MAX": "2"}


def test_a_setting_it_cannot_read_is_one_line_before_anything_is_stored_or_started(monkeypatch, storage_root):
    root = Path(storage_root.removeprefix("file://"))
    before = sorted(path.name for path in root.iterdir()) if root.exists() else []
    monkeypatch.setenv(warm_agent.WARM_AGENT_ENV, "off")
    with pytest.raises(ValueError, match=r"^KINETIC_WARM_AGENT must be 0 \(start every local job's agent afresh\) "
                                         r"or 1, got 'off'$"):
        kinetic_nb.submit("1", hosts=2, framework="none")
    assert (sorted(path.name for path in root.iterdir()) if root.exists() else []) == before
    assert warm_agent._warm is None  # and no warm agent was started for it
