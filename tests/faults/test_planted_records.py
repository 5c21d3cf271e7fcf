"""A planted record far over its kind's limit (256 MiB for a log chunk) in a job the victim polls is refused
without being read (issue #38).

Whoever may write where a job's records are (a bucket's other writers, as
``tests/faults/test_listing_attacks.py`` explains) can put a gigabyte where a
host's status, a log chunk or its exit record belongs. The victim's poller
reads at most each kind's limit (``runner.protocol.limits``) and refuses one
listed over it as it refuses a record that does not verify: the host's log
says "unverified record from host 1" in its place, and the victim's peak
memory stays where it was. On ``file://`` the test plants into the victim's
job directory as the attacker's (owned by her uid), as such a writer would
leave it; on ``gs://`` the attacker uploads it to the bucket herself.
"""

# ruff: noqa: F811 - the two_users fixture is imported, then named by each test that uses it
from __future__ import annotations

import os
import resource
import threading
import time
from pathlib import Path

import pytest

import kinetic_nb
from kinetic_nb.runner import protocol
from kinetic_nb.runner.protocol.limits import record_limit
from kinetic_nb.runner.records import unverified_line
from kinetic_nb.storage import open_storage
from tests.two_users import ATTACKER_UID, two_users  # noqa: F401

#: What polling a job with the planted objects may add to the victim's peak memory.
POLL_MEMORY_BYTES = 16 * 1024 * 1024
#: How long one side waits for the other.
STEP_TIMEOUT_S = 120.0
#: Host 1's records the attacker replaces or adds: its status, its next log chunk (a look on a local disk looks for
#: a host's chunks by number, in order: one further on is never read at all), its exit record.
PLANTED = (protocol.host_status(1), protocol.host_log_chunk(1, 0), protocol.host_exit(1))
#: How long the victim polls for every planted record to be refused: a look on a local disk looks at a worker's
#: records only every ``EVERY_HOST_LOOK_S`` or so.
REFUSED_WITHIN_S = 10.0


def _planted_bytes(name: str) -> int:
    """What the planted ``name`` holds: twice its kind's limit, and at least 64 MiB (four times what polling may
    add to the victim's peak): 256 MiB for a log chunk, 64 MiB for a status or an exit record."""
    return max(2 * record_limit(name)[1], 4 * POLL_MEMORY_BYTES)


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + STEP_TIMEOUT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} never appeared")
        time.sleep(0.05)


def _victim_polls(root: str, home: str) -> tuple[int, list[str], list[str]]:
    """As the victim: a running job, polled once the attacker's objects are in; (memory added, host 1's log, the
    names it refused)."""
    os.environ.pop("KINETIC_STORAGE", None)
    handle = kinetic_nb.submit("import time\ntime.sleep(120)", hosts=2, framework="none", storage=root, echo=False)
    try:
        deadline = time.monotonic() + STEP_TIMEOUT_S
        while not all(host.phase == "execute" for host in handle.poller.poll().hosts):
            assert time.monotonic() < deadline, "the job never ran"
            time.sleep(0.1)
        Path(home, "job").write_text(handle.storage.uri)
        _wait_for(Path(home, "planted"))
        before = _peak()
        deadline = time.monotonic() + REFUSED_WITHIN_S
        while len(handle.poller.records[1].unverified) < len(PLANTED) and time.monotonic() < deadline:
            handle.poller.poll()
            time.sleep(0.2)
        added = _peak() - before
        return added, list(handle.poller.snapshot().hosts[1].log_tail), list(handle.poller.records[1].unverified)
    finally:
        handle.cancel()


def _plant_in_bucket(job_uri: str, home: str) -> None:
    """As the attacker, on a bucket: upload the planted objects (streamed from a sparse file of hers)."""
    job = open_storage(job_uri)
    for name in PLANTED:
        sparse = Path(home, "planted.bin")
        with open(sparse, "wb") as file:
            file.truncate(_planted_bytes(name))
        job.write_file(name, str(sparse))


def _plant_in_directory(job_uri: str) -> None:
    """As a bucket's other writer would leave them, in the victim's job directory: sparse files of hers."""
    job = Path(job_uri[len("file://"):])
    for name in PLANTED:
        path = job / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)
        with open(path, "wb") as file:
            file.truncate(_planted_bytes(name))
        path.chmod(0o644)
        os.chown(path, ATTACKER_UID, ATTACKER_UID)


@pytest.mark.parametrize("where", ["file", "gs"])
def test_a_planted_status_log_chunk_and_exit_far_over_their_limits_are_refused_unread(two_users, where, request):
    root = request.getfixturevalue("gcs_root") if where == "gs" else f"file://{two_users.shared}"
    home = two_users.victim.home
    outcome: dict = {}

    def attacker_side() -> None:
        try:
            _wait_for(home / "job")
            job_uri = (home / "job").read_text()
            if where == "gs":
                two_users.attacker.run(_plant_in_bucket, job_uri, str(two_users.attacker.home))
            else:
                _plant_in_directory(job_uri)
        except BaseException as error:  # re-raised by the test
            outcome["error"] = error
        finally:
            (home / "planted").write_text("planted")

    side = threading.Thread(target=attacker_side, daemon=True)
    side.start()
    added, log, refused = two_users.victim.run(_victim_polls, root, str(home), timeout=2 * STEP_TIMEOUT_S)
    side.join(STEP_TIMEOUT_S)
    if "error" in outcome:
        raise outcome["error"]
    assert added < POLL_MEMORY_BYTES, f"polling the planted objects added {added} bytes to the victim's peak"
    assert sorted(refused) == sorted(PLANTED)
    for name in PLANTED:
        assert unverified_line(1, name) in log
