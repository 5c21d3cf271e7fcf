"""The root's watcher: when a job counts as ended, and that a flaky store never ends it early."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time

import pytest

from kinetic_nb.agent.watch import SILENT_HOST_S, job_has_ended, wait_for_job_end
from kinetic_nb.runner import protocol
from kinetic_nb.runner.envelope import write_sealed
from kinetic_nb.runner.job_keys import KEY_FILE_ENV
from kinetic_nb.runner.protocol import CancelRequest, ExitSummary, JobPlan
from kinetic_nb.runner.records import read_exit, write_record
from kinetic_nb.storage import LocalStorage

KEY = bytes(range(32))


def make_job(tmp_path, hosts=2) -> tuple[LocalStorage, JobPlan]:
    storage = LocalStorage(str(tmp_path / "job"))
    plan = JobPlan(job_id="kn-w", hosts=hosts, accelerator="cpu", devices_per_host=1, framework="none",
                   coordinator_address="127.0.0.1:1", barrier_timeout_s=1,
                   heartbeat_timeout_s=1, shutdown_timeout_s=1)
    write_sealed(storage, protocol.PLAN, KEY, plan.to_json())
    return storage, plan


def test_a_job_ends_when_every_host_has_an_exit_record(tmp_path):
    storage, plan = make_job(tmp_path)
    assert not job_has_ended(storage, plan, KEY)  # nothing started yet: pods may still be scheduling
    write_record(storage, KEY, protocol.host_exit(0), ExitSummary(0, 0).to_json())
    storage.write_bytes(protocol.host_heartbeat(1), b"")
    assert not job_has_ended(storage, plan, KEY)
    write_record(storage, KEY, protocol.host_exit(1), ExitSummary(1, 1).to_json())
    assert job_has_ended(storage, plan, KEY)


def test_a_cancel_or_a_cleanup_ends_it(tmp_path):
    storage, plan = make_job(tmp_path)
    write_record(storage, KEY, protocol.CANCEL, CancelRequest("by the test", 0.0).to_json())
    assert job_has_ended(storage, plan, KEY)
    storage, plan = make_job(tmp_path / "other")
    storage.delete(protocol.PLAN)
    assert job_has_ended(storage, plan, KEY)


def test_a_host_silent_for_long_counts_as_ended(tmp_path):
    storage, plan = make_job(tmp_path)
    write_record(storage, KEY, protocol.host_exit(0), ExitSummary(0, 0).to_json())
    storage.write_bytes(protocol.host_heartbeat(1), b"")  # its pod was OOMKilled whole: no exit record, ever
    assert not job_has_ended(storage, plan, KEY)
    assert job_has_ended(storage, plan, KEY, now=time.time() + SILENT_HOST_S + 1)


@pytest.mark.parametrize("forgery", ["unsigned", "another key's", "another record's"])
def test_forged_exit_and_cancel_records_do_not_end_the_job(tmp_path, forgery, caplog):
    """Anyone who may write to the bucket cannot free the slice under a running job: the watcher, whose end
    deletes the workload, counts only records that verify under the job's key."""
    storage, plan = make_job(tmp_path)
    for index in range(plan.hosts):
        storage.write_bytes(protocol.host_heartbeat(index), b"")  # both hosts alive
    forged = {
        "unsigned": lambda name, body: storage.write_bytes(name, body),
        "another key's": lambda name, body: write_record(storage, bytes(32), name, body),
        # a verified record of this job, put where the watcher looks (a host's status as an exit record)
        "another record's": lambda name, body: storage.write_bytes(
            name, _sealed_as(storage, protocol.host_status(0), body)),
    }[forgery]
    for index in range(plan.hosts):
        forged(protocol.host_exit(index), ExitSummary(index, 0).to_json())
    forged(protocol.CANCEL, CancelRequest("forged", 0.0).to_json())
    seen: dict[str, bool] = {}
    with caplog.at_level("WARNING"):
        assert not job_has_ended(storage, plan, KEY, seen=seen)
        assert not job_has_ended(storage, plan, KEY, seen=seen)
    assert seen == {protocol.CANCEL: False, protocol.host_exit(0): False}  # host 1 is alive: not read
    assert len([r for r in caplog.records if "ignoring" in r.message]) == 2  # once each, not every look
    # The hosts' own records still end it, once the forged ones are gone (a real host's write is exclusive).
    for index in range(plan.hosts):
        storage.delete(protocol.host_exit(index))
        write_record(storage, KEY, protocol.host_exit(index), ExitSummary(index, 0).to_json())
    assert job_has_ended(storage, plan, KEY, seen=seen)


def _sealed_as(storage, name, body):
    write_record(storage, KEY, name, body)
    return storage.read_bytes(name)


class FlakyStorage(LocalStorage):
    def __init__(self, uri, failures):
        super().__init__(uri)
        self.failures = failures

    def list(self, prefix=""):
        if self.failures:
            self.failures -= 1
            raise OSError("503 backend error")
        return super().list(prefix)


def test_storage_errors_are_retried_not_fatal(tmp_path):
    storage, _ = make_job(tmp_path)
    write_record(storage, KEY, protocol.CANCEL, CancelRequest("by the test", 0.0).to_json())
    flaky = FlakyStorage(storage.uri, failures=3)
    pauses = []
    assert wait_for_job_end(flaky, KEY, sleep=pauses.append) == 0
    assert len(pauses) == 3 and pauses == sorted(pauses)  # backed off, then looked again


def test_a_job_whose_plan_is_gone_has_ended(tmp_path):
    storage = LocalStorage(str(tmp_path / "never"))
    os.makedirs(storage.local_path(), exist_ok=True)
    assert wait_for_job_end(storage, KEY, sleep=lambda _: None) == 0


def test_a_plan_that_does_not_verify_is_not_watched(tmp_path):
    from kinetic_nb.errors import IntegrityError

    storage, _ = make_job(tmp_path)
    with pytest.raises(IntegrityError):
        wait_for_job_end(storage, bytes(32), sleep=lambda _: None)


def test_with_no_client_a_host_that_never_reports_is_bounded_by_the_start_window(tmp_path):
    """No notebook watches: a host whose pod is never scheduled, or crash-loops in its bootstrap (from storage
    the two look the same: neither ever beats), would hold the slice until the root's deadline (a week). Past
    the start window (the start barrier's bound, the pending limit in it) the watcher records the host's end,
    sealed, so the hosts still waiting at the barrier stop, and the job ends; before it, nothing is recorded."""
    storage, plan = make_job(tmp_path, hosts=3)
    plan = dataclasses.replace(plan, created_at=1_000_000.0, barrier_timeout_s=2700.0 + 300.0)
    storage.write_bytes(protocol.host_heartbeat(0), b"")  # host 0 started, and waits at the barrier
    within = plan.created_at + plan.barrier_timeout_s - 1
    assert not job_has_ended(storage, plan, KEY, now=within)
    assert read_exit(storage, KEY, 1) is None and read_exit(storage, KEY, 2) is None
    after = plan.created_at + plan.barrier_timeout_s + 1
    assert not job_has_ended(storage, plan, KEY, now=after)  # host 0 is alive: it stops once it reads the ends
    for index in (1, 2):
        summary = read_exit(storage, KEY, index)
        assert summary.failed and summary.describe() == (
            "ended unrecorded (never started: no report within 3000 s of the job's start (its pod was not "
            "scheduled, or crashed before its agent ran); the job's root ended the job)")
    write_record(storage, KEY, protocol.host_exit(0), ExitSummary(0, None, stopped=True).to_json())
    assert job_has_ended(storage, plan, KEY, now=after)


def test_the_root_pods_watcher_ends_a_job_none_of_whose_hosts_ever_started(tmp_path):
    """The root pod's own command (``python -m kinetic_nb.agent --job URI --watch``, the key from the mounted
    Secret's file) on a job whose start window is over and no host ever beat: it records every host's end and
    exits 0 at its first look, so the root completes and the cluster lets the slice go."""
    storage, plan = make_job(tmp_path, hosts=2)
    plan = dataclasses.replace(plan, created_at=time.time() - 4000, barrier_timeout_s=3000.0)
    write_sealed(storage, protocol.PLAN, KEY, plan.to_json())
    key_file = tmp_path / "key"
    key_file.write_text(KEY.hex())
    done = subprocess.run([sys.executable, "-m", "kinetic_nb.agent", "--job", storage.uri, "--watch"],
                          env={**os.environ, KEY_FILE_ENV: str(key_file)}, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert all(read_exit(storage, KEY, index).describe().startswith("ended unrecorded (never started: ")
               for index in range(plan.hosts))
