"""``Storage.read_bounded`` on every storage: at most ``max_bytes`` are read, however large the object (issue #38).

A reader that verifies a record reads it whole first: storage others may write
could hold 256 MiB where a status belongs. Proven on ``file://`` and on a real
fake-gcs-server: the bytes come back within the bound, a larger object fails
with ``ObjectTooLargeError``, and reading a 256 MiB object that way adds next
to nothing to the reader's peak memory (measured in a forked child).
"""

from __future__ import annotations

import os
import resource
import traceback

import pytest

from kinetic_nb.errors import ObjectNotFoundError, ObjectTooLargeError
from kinetic_nb.storage import Storage, open_storage

#: What a planted object holds: far more than any record's limit.
PLANTED_BYTES = 256 * 1024 * 1024
#: The bound asked for in the memory test, like a host's status's.
BOUND_BYTES = 1024 * 1024
#: What one bounded read of the planted object may add to the reader's peak memory.
MEMORY_BYTES = 16 * 1024 * 1024


@pytest.fixture(params=["file", "gs"])
def storage(request: pytest.FixtureRequest, tmp_path) -> Storage:
    if request.param == "file":
        return open_storage(f"file://{tmp_path}/root")
    return open_storage(request.getfixturevalue("gcs_root"))


def test_a_bounded_read_returns_what_fits_and_refuses_what_does_not(storage):
    storage.write_bytes("hosts/0/status.json", b"x" * 100)
    storage.write_bytes("hosts/0/heartbeat", b"")
    assert storage.read_bounded("hosts/0/status.json", 100) == b"x" * 100
    assert storage.read_bounded("hosts/0/heartbeat", 10) == b""
    with pytest.raises(ObjectTooLargeError, match=r"hosts/0/status\.json is .*than the 99 bytes its reader allows"):
        storage.read_bounded("hosts/0/status.json", 99)
    with pytest.raises(ObjectNotFoundError):
        storage.read_bounded("hosts/0/exit.json", 100)


def _peak_memory_of_a_bounded_read(uri: str, name: str) -> tuple[int, str]:
    """In this (forked) process: the peak memory one bounded read of ``name`` adds, and what it raised."""
    storage = open_storage(uri)
    storage.read_bounded("warm-up", 10)  # the client's connections and imports, before the measure
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    try:
        storage.read_bounded(name, BOUND_BYTES)
        raised = ""
    except ObjectTooLargeError as error:
        raised = str(error)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before, raised


def _in_a_child(func, *args):
    """``func(*args)`` in a forked child, so its peak memory is its own; its value, or its error as text."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        try:
            outcome = repr(func(*args))
        except BaseException:
            outcome = repr(("error", traceback.format_exc()))
        with open(write_end, "w") as pipe:
            pipe.write(outcome)
        os._exit(0)
    os.close(write_end)
    with open(read_end) as pipe:
        text = pipe.read()
    os.waitpid(pid, 0)
    return eval(text)  # noqa: S307 - our own child's repr of an (int, str) tuple


def test_a_planted_256_mib_object_is_refused_without_being_read(storage, tmp_path):
    sparse = tmp_path / "planted"
    with open(sparse, "wb") as file:
        file.truncate(PLANTED_BYTES)
    storage.write_file("hosts/1/status.json", str(sparse))
    storage.write_bytes("warm-up", b"w")
    added, raised = _in_a_child(_peak_memory_of_a_bounded_read, storage.uri, "hosts/1/status.json")
    assert "than the 1048576 bytes its reader allows" in raised
    assert added < MEMORY_BYTES, f"a bounded read of a {PLANTED_BYTES}-byte object added {added} bytes"
