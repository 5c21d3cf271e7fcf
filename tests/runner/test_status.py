"""A host's status record: written on a change, or deferred so that a quick phase costs no write."""

from __future__ import annotations

import time

import pytest

from kinetic_nb.runner import protocol
from kinetic_nb.runner.envelope import unseal
from kinetic_nb.runner.job_keys import new_key
from kinetic_nb.runner.protocol import HostState, HostStatus, Phase
from kinetic_nb.runner.records import read_host_status
from kinetic_nb.runner.status import StatusReporter
from kinetic_nb.storage import LocalStorage

#: The job's key every status is sealed under.
KEY = new_key()


class CountingStorage(LocalStorage):
    def __init__(self, root: str):
        super().__init__(root)
        self.status_writes: list[HostStatus] = []

    def write_bytes(self, name: str, data: bytes, *, exclusive: bool = False) -> None:
        if name == protocol.host_status(0):
            self.status_writes.append(HostStatus.from_json(unseal(KEY, name, data, where=name)))
        super().write_bytes(name, data, exclusive=exclusive)


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.01)


@pytest.fixture
def reporting(tmp_path):
    storage = CountingStorage(str(tmp_path / "job"))
    reporter = StatusReporter(storage, 0, KEY)
    reporter.start()
    yield storage, reporter
    reporter.stop()


def test_a_deferred_phase_is_written_once_it_lasts(reporting):
    storage, reporter = reporting
    reporter.update(state=HostState.RUNNING, phase=Phase.EXECUTE, record=False, defer_s=0.05)
    wait_for(lambda: len(storage.status_writes) == 2)  # the start's, then the phase that lasted
    assert storage.status_writes[-1].phase == Phase.EXECUTE.value


def test_a_quick_phase_reaches_storage_with_the_next_write_only(reporting):
    storage, reporter = reporting
    reporter.update(state=HostState.RUNNING, phase=Phase.EXECUTE, record=False, defer_s=0.5)
    reporter.update(state=HostState.IDLE, phase=Phase.TEARDOWN)  # done before the deferred write was due
    time.sleep(1.0)
    assert [status.state for status in storage.status_writes] == [HostState.PENDING.value, HostState.IDLE.value]
    assert [phase for phase, _ in storage.status_writes[-1].history][-2:] == [Phase.EXECUTE.value,
                                                                               Phase.TEARDOWN.value]


class SlowRunningWrites(CountingStorage):
    """A storage on which writing a RUNNING status takes a while (a slow request to a bucket)."""

    def write_bytes(self, name: str, data: bytes, *, exclusive: bool = False) -> None:
        if name == protocol.host_status(0) and HostStatus.from_json(unseal(KEY, name, data, where=name)).state == HostState.RUNNING.value:
            time.sleep(0.3)
        super().write_bytes(name, data, exclusive=exclusive)


def test_a_slow_deferred_write_never_lands_over_a_newer_status(tmp_path):
    storage = SlowRunningWrites(str(tmp_path / "job"))
    reporter = StatusReporter(storage, 0, KEY)
    reporter.start()
    try:
        reporter.update(state=HostState.RUNNING, phase=Phase.EXECUTE, record=False, defer_s=0.01)
        time.sleep(0.1)  # the heartbeat thread is now inside its slow write of RUNNING
        reporter.update(state=HostState.IDLE, phase=Phase.TEARDOWN)  # the cell is done meanwhile
        wait_for(lambda: len(storage.status_writes) == 3)
        assert read_host_status(storage, KEY, 0).state == HostState.IDLE.value
    finally:
        reporter.stop()


def test_a_deferred_end_stores_its_own_record_at_once_and_the_status_when_due(reporting):
    storage, reporter = reporting
    ends: list[HostStatus] = []
    reporter.update(state=HostState.RUNNING, phase=Phase.EXECUTE, cell=1, record=False, defer_s=0.5)
    reporter.update(state=HostState.IDLE, cell=1, record=False, defer_s=0.3,
                    first=lambda data: ends.append(HostStatus.from_json(data)))
    assert [status.state for status in ends] == [HostState.IDLE.value]  # at once, before update returned
    assert [status.state for status in storage.status_writes] == [HostState.PENDING.value]  # status.json: not yet
    wait_for(lambda: len(storage.status_writes) == 2)
    written = storage.status_writes[-1]
    assert (written.state, written.cell) == (HostState.IDLE.value, 1)
    assert written.revision > ends[0].revision  # a reader that has the end never goes back from it
    time.sleep(0.6)  # the RUNNING change's due time has passed: it rode on the one write
    assert len(storage.status_writes) == 2
