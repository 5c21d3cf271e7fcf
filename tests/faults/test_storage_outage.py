"""A job whose bucket stops answering still ends by its own rules, and its last records cost no more than the outage.

The emulator is this test's own (stopped for good mid-session), and every process of the job inherits a short
outage deadline (``KINETIC_GCS_RETRY_S``): before it gave up on a request, an agent spent that deadline on every
request of its loop, so a session whose bucket was gone never reached its idle timeout, and on SIGTERM went on
storing to a bucket that was not there.
"""

from __future__ import annotations

import os
import pathlib
import re
import time

import pytest

import kinetic_nb
from kinetic_nb.backends.local import agent_files

from ..conftest import job_processes
from ..fixtures_gcs import TEST_BUCKET
from ..gcs_emulator import GcsEmulator

#: How long a request rides out the outage, in every process of the job.
RETRY_S = 3
IDLE_TIMEOUT_S = 5
#: The agent gives up on each request after ``RETRY_S`` once, then tries each once: its idle timeout, its hosts'
#: stop (SIGTERM, SIGKILL after a grace) and its last records fit well within this; requests ridden out for
#: ``RETRY_S`` each would not (dozens of them: flushes, looks, heartbeats, exit records).
ENDS_WITHIN_S = 40


@pytest.fixture
def dying_bucket(tmp_path, tmp_path_factory, monkeypatch):
    """A root on an emulator of this test's own; the test stops it."""
    monkeypatch.setenv("KINETIC_GCS_RETRY_S", str(RETRY_S))
    with GcsEmulator(tmp_path / "emulator") as emulator:
        emulator.create_bucket(TEST_BUCKET)
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", emulator.url)
        session = str(tmp_path_factory.getbasetemp()).strip("/")  # the survivor check knows this run's jobs by it
        yield emulator, f"gs://{TEST_BUCKET}/{session}/{os.urandom(6).hex()}"


def _gone_within(seconds: float) -> list:
    deadline = time.monotonic() + seconds
    while (left := job_processes()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def test_a_session_whose_bucket_stops_answering_ends_at_its_idle_timeout(dying_bucket):
    emulator, root = dying_bucket
    session = kinetic_nb.start(hosts=2, framework="none", storage=root, idle_timeout=IDLE_TIMEOUT_S, echo=False)
    assert session.run("1 + 1").result(timeout=60) == 2
    assert job_processes(), "the session's agent and hosts run"
    emulator.stop()
    left = _gone_within(ENDS_WITHIN_S)
    assert not left, f"the session outlived its bucket: {[process.cmdline() for process in left]}"
    log = pathlib.Path(agent_files(session.session_id)[0]).read_text()
    assert f"the session ended: idle for {IDLE_TIMEOUT_S} s (--idle-timeout)" in log, log
    assert "storage error: " in log and "its storage has not answered for" in log, log
    assert "Traceback" not in log and log.count("kinetic agent: storage error: ") == 1, log  # once a minute at most
    said = session.stop()  # the notebook lets it go, and says so in one line
    assert said.startswith(f"session {session.session_id} stopped: its agent has ended, though its storage does "
                           "not answer (cannot ") and "\n" not in said, said


def test_a_session_stopped_while_its_bucket_does_not_answer_is_stopped_and_let_go(dying_bucket):
    """``%kinetic stop`` with the bucket gone: the stop request cannot be stored, but the agent on this machine is
    signalled (and the channel carries it where it is up); the notebook waits for it, and says what happened."""
    emulator, root = dying_bucket
    session = kinetic_nb.start(hosts=2, framework="none", storage=root, idle_timeout=600, echo=False)
    assert session.run("1 + 1").result(timeout=60) == 2
    emulator.stop()
    said = session.stop()
    assert said.startswith(f"session {session.session_id} stopped: its agent has ended, though its storage does "
                           f"not answer (cannot store the stop request in {root}/sessions/{session.session_id}: its "
                           "storage has not answered for ") and "\n" not in said, said
    assert not re.search(r"\.(json|pkl)\b|HTTPConnectionPool", said), said  # no object's name, no library's text
    left = _gone_within(RETRY_S + 10)
    assert not left, f"the session outlived its stop: {[process.cmdline() for process in left]}"


def test_a_job_stopped_while_its_bucket_does_not_answer_ends_at_once(dying_bucket):
    """SIGTERM to the agent (a pod's deletion, a machine's shutdown) while the bucket is gone: the hosts stop, and
    their exit records are tried once each, not ridden out one after another."""
    emulator, root = dying_bucket
    handle = kinetic_nb.submit("import time\nprint('working', flush=True)\ntime.sleep(600)", hosts=2, storage=root)
    deadline = time.monotonic() + 60
    while not all(host.last_line == "working" for host in handle.hosts()) and time.monotonic() < deadline:
        time.sleep(0.1)
    job = job_processes()
    agents = [process for process in job if process.ppid() not in {other.pid for other in job}]  # the hosts' parent
    assert len(agents) == 1, job
    emulator.stop()
    time.sleep(RETRY_S + 1)  # the agent's requests have given up once
    for agent in agents:
        agent.terminate()
    left = _gone_within(RETRY_S + 10)
    assert not left, f"the job outlived its agent's SIGTERM: {[process.cmdline() for process in left]}"
