"""The one barrier protocol, in process, as a session's cell meets it and as a job's start does.

(Real hosts meeting at the start, failing and dying before it, are the fault tests' own.)
"""

from __future__ import annotations

import threading
import types

import pytest

from kinetic_nb.errors import HostStoppedError, KineticTimeoutError
from kinetic_nb.runner import barrier, protocol
from kinetic_nb.runner.barrier import CellMarkers, HostStatuses, meet
from kinetic_nb.runner.job_keys import new_key
from kinetic_nb.runner.protocol import HostStatus, LeaderReady
from kinetic_nb.runner.records import read_record, write_record
from kinetic_nb.storage import LocalStorage

KEY = new_key()


@pytest.fixture
def cell(tmp_path):
    return LocalStorage(str(tmp_path / "cells" / "000001"))


def verdict(storage) -> LeaderReady:
    return LeaderReady.from_json(read_record(storage, KEY, protocol.LEADER_READY))


def meet_cell(storage, *, leader, timeout=5.0, woken=None):
    woken = [] if woken is None else woken
    meet(storage, KEY, leader=leader, hosts=3, timeout=timeout, sighting=CellMarkers(storage, 3),
         what="cell barrier", on_verdict=lambda: woken.append(True))
    return woken


def test_the_leader_says_go_once_every_host_is_ready(cell):
    for index in range(3):
        cell.write_bytes(protocol.cell_ready(index), b"")
    assert meet_cell(cell, leader=True) == [True]  # and it woke the workers
    assert verdict(cell).go
    assert meet_cell(cell, leader=False) == []  # a worker hears it


def test_a_host_that_could_not_load_the_cell_stops_every_host(cell):
    cell.write_bytes(protocol.cell_ready(0), b"")
    cell.write_bytes(protocol.worker_result(2), b"its failure")
    woken = []
    with pytest.raises(HostStoppedError, match="host 2 failed while loading the cell"):
        meet_cell(cell, leader=True, woken=woken)
    assert woken == [True]  # the workers are woken for an abort too: they may be sleeping long
    assert (verdict(cell).go, verdict(cell).failed_host) == (False, 2)
    with pytest.raises(HostStoppedError, match="host 2 failed while loading the cell"):
        meet_cell(cell, leader=False)  # the abort reaches the workers


def test_a_leader_that_failed_before_its_verdict_stops_the_workers_but_a_quick_cell_after_go_does_not(cell):
    cell.write_bytes(protocol.RESULT, b"the leader's failure")
    with pytest.raises(HostStoppedError, match="host 0 failed while loading the cell"):
        meet_cell(cell, leader=False)
    write_record(cell, KEY, protocol.LEADER_READY, LeaderReady(True).to_json())
    meet_cell(cell, leader=False)  # the leader said go, then ran the cell: its outcome is no failure


def test_hosts_that_never_get_ready_time_out_and_the_leader_says_which(cell, monkeypatch):
    cell.write_bytes(protocol.cell_ready(0), b"")
    with pytest.raises(KineticTimeoutError, match=r"^cell barrier: hosts 1-2 were not ready after 0.05 s$"):
        meet_cell(cell, leader=True, timeout=0.05)
    assert (verdict(cell).go, verdict(cell).failed_host) == (False, 1)
    # At a thousand hosts the line stays a line (a start on gs:// here left 302 of 1,024 hosts unready: it named
    # each of them, a page of numbers).
    for index in range(1, 722):
        cell.write_bytes(protocol.cell_ready(index), b"")
    with pytest.raises(KineticTimeoutError, match=r"^cell barrier: hosts 722-1023 were not ready after 0.05 s$"):
        meet(cell, KEY, leader=True, hosts=1024, timeout=0.05, sighting=CellMarkers(cell, 1024), what="cell barrier")
    monkeypatch.setattr(barrier, "WORKER_SLACK_S", 0.0)
    with pytest.raises(HostStoppedError):  # its workers hear the abort rather than waiting on
        meet_cell(cell, leader=False, timeout=0.05)


def test_the_start_sees_the_hosts_through_their_signed_statuses(tmp_path):
    job = LocalStorage(str(tmp_path / "job"))

    def status(index, state, phase="start barrier", revision=1):
        record = HostStatus(host_index=index, state=state, phase=phase, started_at=0.0, updated_at=0.0, pid=1,
                            hostname="h", revision=revision)
        write_record(job, KEY, protocol.host_status(index), record.to_json())

    status(0, "ready")
    status(1, "failed", "payload load")
    with pytest.raises(HostStoppedError, match="host 1 failed while loading the cell"):
        meet(job, KEY, leader=True, hosts=2, timeout=5.0, sighting=HostStatuses(job, KEY), what="start barrier")
    status(1, "ready", revision=2)
    job.write_bytes(protocol.host_status(1), b"forged: not signed")  # unverified: never counted as ready
    sighting = HostStatuses(job, KEY)
    sighting.look()
    assert sighting.ready() == {0}


def test_at_a_large_start_a_worker_looks_at_the_leader_less_often_than_the_leader_looks_at_the_hosts(monkeypatch):
    # Each worker's look is two requests on a bucket: at 1,024 hosts, one every 0.5 s from every worker was 4,000
    # requests a second while the rest of the slice started.
    paces = {}
    monkeypatch.setattr(barrier, "meet", lambda *args, leader, max_pause, **kwargs: paces.__setitem__(leader, max_pause))
    for hosts in (4, 1024):
        plan = types.SimpleNamespace(world_size=hosts, barrier_timeout_s=300.0)
        for index in (0, 1):
            barrier.start_barrier(None, plan, KEY, index)
        assert paces == ({True: 0.1, False: 0.1} if hosts == 4 else {True: 0.512, False: 2.048}), hosts


class FarStorage(LocalStorage):
    """A disk that acts as a bucket far away: no local path, and each read waits until ``together`` reads are
    under way at once (a look that reads one record at a time never gets there)."""

    def __init__(self, root, together):
        super().__init__(root)
        self.meeting = threading.Barrier(together, timeout=5)

    def local_path(self, name=""):
        return None

    def read_bounded(self, name, *args, **kwargs):
        if protocol.parse_host_object(name) is not None:
            self.meeting.wait()
        return super().read_bounded(name, *args, **kwargs)


def test_on_a_bucket_the_leader_reads_the_hosts_statuses_at_once_not_one_by_one(tmp_path):
    # At a start every host's status changes between two of the leader's looks: at 1,024 hosts on a bucket, read
    # one by one, a look was a thousand round trips (half a minute at 30 ms each) before the leader could say go.
    hosts = barrier.READERS
    job = FarStorage(str(tmp_path / "job"), together=hosts)
    for index in range(hosts):
        record = HostStatus(host_index=index, state="ready", phase="start barrier", started_at=0.0, updated_at=0.0,
                            pid=1, hostname="h")
        write_record(job, KEY, protocol.host_status(index), record.to_json())
    sighting = HostStatuses(job, KEY)
    sighting.look()
    assert sighting.ready() == set(range(hosts))
