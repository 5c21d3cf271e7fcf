"""What only ``gs://`` storage does: retries, clear permanent errors, a missing bucket, lazy imports.

Faults are real: a loopback proxy in front of a real fake-gcs-server answers
503 or 429, drops connections or loses responses; the emulator itself is
stopped and restarted.
"""

from __future__ import annotations

import collections
import json
import re
import subprocess
import sys
import threading
import time

import pytest

from kinetic_nb.errors import ObjectExistsError, ObjectNotFoundError, StorageError
from kinetic_nb.runner.protocol import storage_error_words
from kinetic_nb.storage import GcsStorage, open_storage, patiently

from ..fixtures_gcs import TEST_BUCKET
from ..gcs_emulator import Fault, FaultProxy, GcsEmulator, free_port


@pytest.fixture
def storage(gcs_root) -> GcsStorage:
    return open_storage(gcs_root)


def through(proxy: FaultProxy, monkeypatch, gcs_root: str) -> GcsStorage:
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
    return open_storage(gcs_root)


def test_uri_forms():
    assert GcsStorage("gs://bucket").uri == "gs://bucket"
    assert GcsStorage("gs://bucket/").uri == "gs://bucket"
    assert GcsStorage("gs://bucket/a/b/").uri == "gs://bucket/a/b"
    assert GcsStorage("gs://bucket/a").child("job").uri == "gs://bucket/a/job"
    with pytest.raises(ValueError, match="no bucket in 'gs://'"):
        open_storage("gs://")


def test_transient_errors_are_retried(gcs_emulator, gcs_root, monkeypatch):
    faults = [
        Fault("POST", "/upload/", 503, times=2),
        Fault("GET", "/download/", 429),
        Fault("GET", "/o?", "drop"),
        Fault("DELETE", "/o/", 500),
        Fault("GET", "/o/", 502),  # exists() is a metadata GET
    ]
    with FaultProxy(gcs_emulator, faults) as proxy:
        storage = through(proxy, monkeypatch, gcs_root)
        storage.write_bytes("hosts/0/status.json", b"{}")
        assert storage.read_bytes("hosts/0/status.json") == b"{}"
        assert [info.name for info in storage.list()] == ["hosts/0/status.json"]
        assert storage.exists("hosts/0/status.json")
        storage.delete("hosts/0/status.json")
    assert [fault.seen for fault in faults] == [2, 1, 1, 1, 1]
    assert storage.list() == []


def test_a_lost_response_does_not_fail_an_exclusive_write(gcs_emulator, gcs_root, monkeypatch):
    faults = [Fault("POST", "ifGenerationMatch=0", "lose-response")]
    with FaultProxy(gcs_emulator, faults) as proxy:
        storage = through(proxy, monkeypatch, gcs_root)
        storage.write_bytes("result.pkl", b"mine", exclusive=True)  # the retry finds its own object
        assert faults[0].seen == 1
        with pytest.raises(ObjectExistsError, match=r"result\.pkl already exists"):
            storage.write_bytes("result.pkl", b"another writer", exclusive=True)
    assert storage.read_bytes("result.pkl") == b"mine"


def test_a_lost_delete_response_still_deletes(gcs_emulator, gcs_root, monkeypatch):
    faults = [Fault("DELETE", "/o/", "lose-response")]
    with FaultProxy(gcs_emulator, faults) as proxy:
        storage = through(proxy, monkeypatch, gcs_root)
        storage.write_bytes("cancel.json", b"{}")
        storage.delete("cancel.json")
        assert faults[0].seen == 1
        assert not storage.exists("cancel.json")


def test_permission_denied_is_one_line_naming_the_bucket_and_object(gcs_emulator, gcs_root, monkeypatch):
    faults = [Fault("GET", "/download/", 403, times=100)]
    with FaultProxy(gcs_emulator, faults) as proxy:
        storage = through(proxy, monkeypatch, gcs_root)
        with pytest.raises(StorageError) as info:
            storage.read_bytes("result.pkl")
    message = str(info.value)
    assert message.startswith(f"permission denied: cannot read {gcs_root}/result.pkl in bucket '{TEST_BUCKET}'")
    assert "\n" not in message and not isinstance(info.value, ObjectNotFoundError)
    # The notebook says it without the object's name.
    assert storage_error_words(info.value).startswith(f"cannot read the cell's value in {gcs_root}: permission "
                                                      "denied (HTTP 403: ")
    assert faults[0].seen == 1  # a permanent error is not retried


def test_a_missing_object_is_missing_to_a_client_that_may_not_look_at_the_bucket(gcs_emulator, gcs_root, monkeypatch):
    """roles/storage.objectUser, what docs/gke.md grants the hosts, has no storage.buckets.get: whether the
    bucket exists is told by listing one object, so a routine miss (the next cell's payload) stays a miss."""
    faults = [Fault("GET", f"/b/{TEST_BUCKET}?", 403, times=100)]  # the bucket's own metadata, not its objects
    with FaultProxy(gcs_emulator, faults) as proxy:
        storage = through(proxy, monkeypatch, gcs_root)  # a fresh client: it has listed nothing yet
        with pytest.raises(ObjectNotFoundError):
            storage.read_bytes("cells/000001/payload.pkl")
        with pytest.raises(ObjectNotFoundError):
            storage.child("cells/000002").open_read("payload.pkl")
    assert faults[0].seen == 0


def test_a_missing_bucket_is_a_clear_error_naming_it(gcs_emulator, monkeypatch):
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_emulator.url)
    storage = open_storage("gs://no-such-bucket/jobs")
    for action in (lambda: storage.read_bytes("plan.json"), storage.list,
                   lambda: storage.write_bytes("plan.json", b"{}"), lambda: storage.delete("plan.json"),
                   lambda: storage.open_read("plan.json")):
        with pytest.raises(StorageError, match=r"^bucket 'no-such-bucket' does not exist \(cannot ") as info:
            action()
        assert not isinstance(info.value, ObjectNotFoundError)
    assert not storage.exists("plan.json")


def test_a_dead_endpoint_fails_at_the_retry_deadline(monkeypatch):
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    storage = GcsStorage(f"gs://{TEST_BUCKET}/dead", retry_deadline_s=1.0)
    with pytest.raises(StorageError, match=r"^cannot read gs://kinetic-tests/dead/plan.json: still failing after \d+ "
                                           r"attempts; its storage has not answered for ([\d.]+) s \(an outage is "
                                           r"ridden out for 1 s\): ") as info:
        storage.read_bytes("plan.json")
    assert storage.requests["read"] > 1
    # Its last attempt is made at the deadline, not when the next pause would have passed it.
    assert float(re.search(r"has not answered for ([\d.]+) s", str(info.value)).group(1)) >= 1.0
    # The notebook says what could not be read, where and why, in words: no object's name, no HTTP library's text.
    assert re.fullmatch(r"cannot read the job's plan in gs://kinetic-tests/dead: its storage has not answered for "
                        r"[\d.]+ s \(an outage is ridden out for 1 s\): Connection refused",
                        storage_error_words(info.value)), storage_error_words(info.value)


def test_an_outage_past_the_retry_deadline_is_tried_once_per_request_until_the_storage_answers(tmp_path,
                                                                                               monkeypatch):
    """The deadline counts from the outage's first failure, not from each request's start: an agent whose
    bucket is gone makes one attempt per request from then on (its loop, its idle timeout and its last records
    go on), and the first answer ends the outage, so the next one is ridden out in full again."""
    with GcsEmulator(tmp_path / "emulator") as emulator:
        emulator.create_bucket(TEST_BUCKET)
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", emulator.url)
        storage = GcsStorage(f"gs://{TEST_BUCKET}/outage", retry_deadline_s=1.0)
        child = storage.child("cells")  # one storage family: one outage
        storage.write_bytes("before", b"kept")
        assert storage.unreachable_for() == 0.0
        emulator.stop()
        with pytest.raises(StorageError, match=r"still failing after \d+ attempts"):
            storage.read_bytes("before")
        ridden_out = storage.requests["read"] - 1
        assert ridden_out > 1
        for action in (lambda: child.read_bytes("payload"), lambda: child.write_bytes("status", b"{}"),
                       child.list, lambda: storage.exists("before")):
            made = sum(storage.requests.values())
            with pytest.raises(StorageError, match=r"still failing after 1 attempt; its storage has not "
                                                   r"answered for [\d.]+ s"):
                action()
            assert sum(storage.requests.values()) == made + 1
        assert storage.unreachable_for() > 0.0
        emulator.start()
        assert storage.read_bytes("before") == b"kept"
        assert storage.unreachable_for() == 0.0
        emulator.stop()
        reads = storage.requests["read"]
        with pytest.raises(StorageError, match=r"still failing after \d+ attempts"):
            storage.read_bytes("before")
        assert storage.requests["read"] - reads > 1  # a new outage: ridden out again


def test_a_record_stored_patiently_rides_out_the_deadline_from_its_own_start_until_one_gives_up(tmp_path,
                                                                                               monkeypatch):
    """A host's exit record or result, written after the routine requests gave up on an outage, is still tried
    for the whole deadline (an outage a little longer than it loses no outcome); once one of them has given up,
    the next is tried once (a bucket that is gone costs one deadline, not one per host)."""
    with GcsEmulator(tmp_path / "emulator") as emulator:
        emulator.create_bucket(TEST_BUCKET)
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", emulator.url)
        storage = GcsStorage(f"gs://{TEST_BUCKET}/patient", retry_deadline_s=2.0)
        storage.write_bytes("before", b"kept")
        emulator.stop()
        with pytest.raises(StorageError):
            storage.read_bytes("before")  # a routine request gives up: the others are tried once
        writes = storage.requests["write"]
        restarter = threading.Timer(0.2, emulator.start)  # back well before a patient write's own deadline
        restarter.start()
        try:
            with patiently():
                storage.write_bytes("hosts/0/exit.json", b"{}")
        finally:
            restarter.join()
        assert storage.requests["write"] - writes > 1 and storage.read_bytes("hosts/0/exit.json") == b"{}"
        emulator.stop()
        with pytest.raises(StorageError):
            storage.read_bytes("before")  # a new outage, given up by a routine request
        with patiently(), pytest.raises(StorageError):
            storage.write_bytes("hosts/1/exit.json", b"{}")  # ridden out for the deadline, and given up
        writes = storage.requests["write"]
        with patiently(), pytest.raises(StorageError, match="still failing after 1 attempt;"):
            storage.write_bytes("hosts/2/exit.json", b"{}")
        assert storage.requests["write"] == writes + 1


def test_a_missing_object_is_an_answer_and_a_missing_bucket_a_failure(gcs_emulator, gcs_root, monkeypatch):
    storage = open_storage(gcs_root)
    with pytest.raises(ObjectNotFoundError):
        storage.read_bytes("not-yet")
    assert storage.unreachable_for() == 0.0
    gone = open_storage("gs://no-such-bucket/jobs")
    with pytest.raises(StorageError, match="does not exist"):
        gone.write_bytes("plan.json", b"{}")
    assert gone.unreachable_for() > 0.0


@pytest.mark.parametrize("value", ["soon", "-1", "nan"])
def test_a_retry_deadline_that_is_no_number_of_seconds_is_one_line_naming_the_variable(value, monkeypatch):
    monkeypatch.setenv("KINETIC_GCS_RETRY_S", value)
    with pytest.raises(StorageError, match=rf"^KINETIC_GCS_RETRY_S must be a number of seconds \(0 or more\), "
                                           rf"got '{value}'$"):
        open_storage(f"gs://{TEST_BUCKET}/jobs")
    monkeypatch.setenv("KINETIC_GCS_RETRY_S", "2.5")
    assert open_storage(f"gs://{TEST_BUCKET}/jobs").retry_deadline_s == 2.5


def test_a_restarted_emulator_is_ridden_out(tmp_path, monkeypatch):
    with GcsEmulator(tmp_path / "emulator") as emulator:
        emulator.create_bucket(TEST_BUCKET)
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", emulator.url)
        storage = open_storage(f"gs://{TEST_BUCKET}/restart")
        storage.write_bytes("before", b"kept")
        emulator.stop()
        restarter = threading.Timer(1.0, emulator.start)
        restarter.start()
        try:
            storage.write_bytes("during", b"retried")  # refused until the server is back
        finally:
            restarter.join()
        assert storage.read_bytes("before") == b"kept"
        assert [info.name for info in storage.list()] == ["before", "during"]
        assert storage.requests["write"] > 2


def test_the_storage_package_imports_no_cloud_client_until_gs_is_used(gcs_emulator, tmp_path):
    code = (
        "import json, sys, kinetic_nb.storage as s\n"
        "before = sorted(m for m in sys.modules if m.split('.')[0] == 'google')\n"
        f"s.open_storage('file://{tmp_path}').list()\n"
        "middle = sorted(m for m in sys.modules if m.split('.')[0] == 'google')\n"
        f"s.open_storage('gs://{TEST_BUCKET}/imports').list()\n"
        "print(json.dumps([before, middle, 'google.cloud.storage' in sys.modules]))\n"
    )
    env = {**__import__("os").environ, **gcs_emulator.environ()}
    output = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, env=env).stdout
    assert json.loads(output) == [[], [], True]


def test_listing_times_are_epoch_seconds(storage):
    storage.write_bytes("hosts/0/heartbeat", b"")
    (info,) = storage.list()
    assert abs(info.updated - time.time()) < 300 and info.version.isdigit()


def test_no_credentials_is_one_line_that_says_how_to_log_in(tmp_path, monkeypatch):
    """No emulator and no credentials: what a new user meets first (no metadata server is asked)."""
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "no-such-key.json"))
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path))
    monkeypatch.setenv("NO_GCE_CHECK", "True")
    storage = GcsStorage("gs://some-bucket/jobs")
    with pytest.raises(StorageError) as raised:
        storage.write_bytes("plan.json", b"{}")
    message = str(raised.value)
    assert "gcloud auth application-default login" in message and "STORAGE_EMULATOR_HOST" in message
    assert "\n" not in message and type(raised.value.__cause__).__name__ == "DefaultCredentialsError"


def test_the_benchmarks_count_every_request_from_the_emulators_own_log(tmp_path, monkeypatch):
    """``benchmarks/scale.py`` counts a session's requests from the emulator's log (no proxy between a thousand
    hosts and it): the log's count and kinds are the storage's own."""
    from benchmarks.delay_proxy import RequestLog

    with GcsEmulator(tmp_path / "emulator", backend="memory", log_requests=True) as emulator:
        emulator.create_bucket(TEST_BUCKET)
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", emulator.url)
        storage = GcsStorage(f"gs://{TEST_BUCKET}/counted")
        log = RequestLog(emulator)
        storage.write_bytes("warm", b"x")  # the client's first request may look the bucket up
        mark, before = log.mark(), dict(storage.requests)
        storage.write_bytes("a/status.json", b"{}")
        storage.write_bytes("a/status.json", b"{ }")
        assert storage.read_bytes("a/status.json") == b"{ }"
        assert [info.name for info in storage.list("a/")] == ["a/status.json"]
        storage.delete("a/status.json")
        with pytest.raises(ObjectNotFoundError):
            storage.read_bytes("a/status.json")
        made = {kind: count - before.get(kind, 0) for kind, count in storage.requests.items()}
        deadline = time.monotonic() + 5  # a request is logged once it is answered: the last may come a moment late
        while len(log.since(mark)) < sum(made.values()) and time.monotonic() < deadline:
            time.sleep(0.01)
        logged = collections.Counter(request.kind for request in log.since(mark))
        assert logged == {"write": made["write"], "read": made["read"], "list": made["list"],
                          "delete": made["delete"]}, (logged, made)
        assert [request.name for request in log.since(mark) if request.kind == "read"] == [
            "counted/a/status.json"] * made["read"]
    with pytest.raises(ValueError, match="log_requests=True"):
        RequestLog(GcsEmulator(tmp_path / "quiet"))
