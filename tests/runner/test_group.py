"""A group's host, in process: the parts that need no peers."""

from __future__ import annotations

import os
import types

import pytest

from kinetic_nb.errors import KineticTimeoutError
from kinetic_nb.runner import barrier
from kinetic_nb.runner import group as session
from kinetic_nb.runner.job_keys import new_key
from kinetic_nb.storage import LocalStorage

KEY = new_key()


def test_a_cell_barrier_waits_for_a_cell_not_for_the_start_window(tmp_path, monkeypatch):
    # On Kubernetes the plan's barrier includes the pending limit (45 minutes) for hosts still being scheduled;
    # a session's hosts are up, so a cell's barrier keeps to its own, shorter limit.
    monkeypatch.setattr(session, "CELL_BARRIER_TIMEOUT_S", 0.2)
    monkeypatch.setattr(barrier, "WORKER_SLACK_S", 0.0)  # a worker waits a little longer than the leader
    monkeypatch.setattr(session, "MAX_LOOK_LOCAL_S", 0.02)
    storage = LocalStorage(str(tmp_path / "session"))
    plan = types.SimpleNamespace(job_id=f"ks-test-{os.getpid()}", hosts=2, world_size=2, barrier_timeout_s=3000.0, session=True)
    # The parts of a HostRun the loop reads, for host 1 of 2: no peers, so the leader never answers.
    run = types.SimpleNamespace(storage=storage, plan=plan, host_index=1, is_leader=False, key=KEY, outcome_key=KEY)
    loop = session.CellGroup(run)
    try:
        with pytest.raises(KineticTimeoutError, match=r"^cell barrier: no word from the leader after 0.2 s$"):
            loop.cell_barrier(storage.child("cells/000001"))
    finally:
        if loop.wakeup is not None:
            loop.wakeup.close()
    assert storage.exists("cells/000001/ready-1")  # it said it was ready; the leader never answered
