"""One contract, every storage: ``file://`` and ``gs://`` (a real fake-gcs-server) obey the same rules.

Assertions are on stored state, read back through the interface.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import io
import os
import threading
import time

import pytest

from kinetic_nb.errors import ObjectExistsError, ObjectNotFoundError, StorageError
from kinetic_nb.runner import protocol
from kinetic_nb.storage import GcsStorage, Storage, open_storage

#: More than one listing page of Cloud Storage (1,000 objects).
MANY_OBJECTS = 1_050
#: Parallel writers when filling a storage (below the client's connection pool of 10).
WRITERS = 8
#: Over the 8 MiB multipart limit and over one 32 MiB transfer chunk: a
#: resumable upload and ranged reads of more than one piece.
LARGE_BYTES = 40 * 1024 * 1024 + 123


@pytest.fixture(params=["file", "gs"])
def storage(request: pytest.FixtureRequest, tmp_path) -> Storage:
    if request.param == "file":
        return open_storage(f"file://{tmp_path}/root")
    return open_storage(request.getfixturevalue("gcs_root"))


def names(infos) -> list[str]:
    return [info.name for info in infos]


def test_write_read_list_delete(storage):
    storage.write_bytes("a/b.txt", b"one")
    storage.write_bytes("a/c.txt", b"two")
    storage.write_bytes("z.txt", b"three")
    assert storage.read_bytes("a/b.txt") == b"one"
    assert names(storage.list("a/")) == ["a/b.txt", "a/c.txt"]
    assert names(storage.list()) == ["a/b.txt", "a/c.txt", "z.txt"]
    assert names(storage.list("a/b")) == ["a/b.txt"]
    assert [info.size for info in storage.list()] == [3, 3, 5]
    assert storage.exists("a/b.txt") and not storage.exists("a/b") and not storage.exists("a")
    storage.delete("a/b.txt")
    assert not storage.exists("a/b.txt")
    assert names(storage.list()) == ["a/c.txt", "z.txt"]


def test_delete_many_removes_what_exists_in_every_folder_and_skips_what_does_not(storage):
    for name in ("a/1", "a/2", "a/b/3", "z", "keep"):
        storage.write_bytes(name, name.encode())
    storage.delete_many(["a/1", "a/b/3", "z", "a/missing", "nowhere/at/all"])
    assert names(storage.list()) == ["a/2", "keep"]
    storage.delete_many([])


def test_json_records_round_trip(storage):
    storage.write_json("handle.json", {"hosts": 4, "job_id": "j"})
    assert storage.read_json("handle.json") == {"hosts": 4, "job_id": "j"}


def test_not_found_cases(storage):
    with pytest.raises(ObjectNotFoundError, match=r"missing\.txt does not exist") as info:
        storage.read_bytes("missing.txt")
    assert isinstance(info.value, FileNotFoundError) and storage.uri in str(info.value)
    with pytest.raises(ObjectNotFoundError, match=r"missing\.txt does not exist"):
        storage.delete("missing.txt")
    with pytest.raises(ObjectNotFoundError, match=r"missing\.txt does not exist"):
        storage.open_read("missing.txt")
    assert not storage.exists("missing.txt")
    assert storage.list() == []
    assert storage.list("nothing/here/") == []


def test_a_child_is_a_storage_below_its_parent(storage):
    child = storage.child("job-1")
    assert child.uri == f"{storage.uri}/job-1"
    child.write_bytes("hosts/0/status.json", b"{}")
    assert names(child.list()) == ["hosts/0/status.json"]
    assert names(storage.list()) == ["job-1/hosts/0/status.json"]
    assert open_storage(child.uri).read_bytes("hosts/0/status.json") == b"{}"


def test_names_cannot_escape_the_root(storage):
    for name in ("../secret", "/etc/passwd", "a/../../b"):
        with pytest.raises(StorageError, match="invalid object name"):
            storage.read_bytes(name)


def test_listing_pages_through_more_than_a_thousand_objects(storage):
    expected = [f"hosts/{i % 7}/log/{i:06d}.txt" for i in range(MANY_OBJECTS)]
    with concurrent.futures.ThreadPoolExecutor(WRITERS) as pool:
        list(pool.map(lambda name: storage.write_bytes(name, name.encode()), expected))
    if isinstance(storage, GcsStorage):
        before = storage.requests["list"]
    listing = storage.list()
    assert names(listing) == sorted(expected)
    if isinstance(storage, GcsStorage):
        assert storage.requests["list"] - before == 2  # two pages, one request each
    assert names(storage.list("hosts/3/")) == sorted(n for n in expected if n.startswith("hosts/3/"))


def test_a_second_exclusive_writer_fails_and_the_first_content_stays(storage):
    storage.write_bytes("result.pkl", b"first", exclusive=True)
    with pytest.raises(ObjectExistsError, match=r"result\.pkl already exists") as info:
        storage.write_bytes("result.pkl", b"second", exclusive=True)
    assert isinstance(info.value, FileExistsError)
    with pytest.raises(ObjectExistsError):
        storage.write_file("result.pkl", io.BytesIO(b"third"), exclusive=True)
    assert storage.read_bytes("result.pkl") == b"first"
    assert names(storage.list()) == ["result.pkl"]


def test_empty_objects_are_objects_too(storage):
    # Markers (a host ready at a barrier) and heartbeats are empty; the local disk makes them without a rename.
    storage.write_bytes("cells/000001/ready-0", b"", exclusive=True)
    with pytest.raises(ObjectExistsError, match="ready-0 already exists"):
        storage.write_bytes("cells/000001/ready-0", b"", exclusive=True)
    assert storage.read_bytes("cells/000001/ready-0") == b""
    storage.write_bytes("hosts/0/heartbeat", b"")
    first = storage.list("hosts/0/heartbeat")[0]
    time.sleep(0.05)  # a file's time moves in steps of a few milliseconds
    storage.write_bytes("hosts/0/heartbeat", b"")  # a beat: the same empty object, written again
    assert storage.list("hosts/0/heartbeat")[0].version != first.version
    storage.write_bytes("hosts/0/heartbeat", b"not empty")
    storage.write_bytes("hosts/0/heartbeat", b"")
    assert storage.read_bytes("hosts/0/heartbeat") == b""
    assert names(storage.list()) == ["cells/000001/ready-0", "hosts/0/heartbeat"]


def test_racing_exclusive_writers_leave_exactly_one_winner(storage):
    start = threading.Barrier(WRITERS)

    def write(index: int) -> int | None:
        start.wait()
        try:
            storage.write_bytes("result.pkl", f"writer {index}".encode(), exclusive=True)
            return index
        except ObjectExistsError:
            return None

    with concurrent.futures.ThreadPoolExecutor(WRITERS) as pool:
        winners = [index for index in pool.map(write, range(WRITERS)) if index is not None]
    assert len(winners) == 1
    assert storage.read_bytes("result.pkl") == f"writer {winners[0]}".encode()


def test_a_rewrite_changes_the_version_and_keeps_one_object(storage):
    storage.write_bytes("hosts/0/status.json", b"1")
    first = storage.list("hosts/0/status.json")[0]
    assert abs(first.updated - time.time()) < 300  # seconds since the epoch, not another unit
    storage.write_bytes("hosts/0/status.json", b"22")
    second = storage.list()
    assert names(second) == ["hosts/0/status.json"]
    assert second[0].version != first.version and second[0].size == 2
    assert storage.read_bytes("hosts/0/status.json") == b"22"


def test_every_per_host_object_is_listed_and_parsed_back(storage):
    hosts = 12  # hosts/1/ must not match hosts/10/ or hosts/11/
    written = {protocol.RESULT: b"leader", protocol.PLAN: b"{}"}
    for index in range(hosts):
        written[protocol.host_status(index)] = b"{}"
        written[protocol.host_heartbeat(index)] = b""
        written[protocol.host_exit(index)] = b"{}"
        for seq in range(3):
            written[protocol.host_log_chunk(index, seq)] = f"line {seq} of {index}\n".encode()
        if index % 2:
            written[protocol.worker_result(index)] = b"failure"
    for name, data in written.items():
        storage.write_bytes(name, data)

    listing = storage.list()
    assert names(listing) == sorted(written)
    kinds: dict[int, set] = {index: set() for index in range(hosts)}
    for info in listing:
        parsed = protocol.parse_host_object(info.name)
        if parsed is not None:
            kinds[parsed[0]].add(parsed[1])
    assert all(found == {"status", "heartbeat", "exit", "log"} for found in kinds.values())
    failing = sorted(i for info in listing if (i := protocol.parse_worker_result(info.name)) is not None)
    assert failing == [1, 3, 5, 7, 9, 11]
    assert [info.size for info in listing if info.name == protocol.host_heartbeat(4)] == [0]

    logs = storage.list(protocol.host_log_prefix(1))
    assert names(logs) == [protocol.host_log_chunk(1, seq) for seq in range(3)]
    assert b"".join(storage.read_bytes(info.name) for info in logs) == b"line 0 of 1\nline 1 of 1\nline 2 of 1\n"
    assert {protocol.parse_host_object(n)[0] for n in names(storage.list(f"{protocol.HOSTS_DIR}/1/"))} == {1}


def _sha256_of(file) -> str:
    digest = hashlib.sha256()
    while chunk := file.read(1 << 20):
        digest.update(chunk)
    return digest.hexdigest()


def test_a_large_value_streams_in_and_out(storage, tmp_path):
    source = tmp_path / "large.bin"
    with open(source, "wb") as file:
        file.writelines(os.urandom(4 << 20) for _ in range(LARGE_BYTES // (4 << 20) + 1))
        file.truncate(LARGE_BYTES)
    with open(source, "rb") as file:
        expected = _sha256_of(file)

    storage.write_file("result.pkl", source, exclusive=True)
    assert [(info.name, info.size) for info in storage.list()] == [("result.pkl", LARGE_BYTES)]
    with storage.open_read("result.pkl") as file:
        assert _sha256_of(file) == expected
    with storage.open_read("result.pkl") as file:  # one read of everything, as pickle.load may do
        assert hashlib.sha256(file.read()).hexdigest() == expected

    with open(source, "rb") as file:  # from a file object's position to its end
        file.seek(LARGE_BYTES - 10)
        storage.write_file("tail.bin", file)
        file.seek(LARGE_BYTES - 10)
        assert storage.read_bytes("tail.bin") == file.read()

    # A reader sees the version it opened, or fails loudly: never a mix of two.
    with storage.open_read("result.pkl") as file:
        head = file.read(1)
        storage.write_bytes("result.pkl", b"replaced")
        failure: StorageError | None = None
        try:
            whole = head + file.read()
        except StorageError as error:
            failure = error
        if failure is not None:  # it failed loudly, or it read the one version it opened
            assert "replaced or deleted while it was being read" in str(failure)
        else:
            assert hashlib.sha256(whole).hexdigest() == expected
    assert storage.read_bytes("result.pkl") == b"replaced"


def test_small_values_stream_too(storage):
    storage.write_file("a.txt", io.BytesIO(b"small"))
    with storage.open_read("a.txt") as file:
        assert file.read() == b"small"
    storage.write_file("empty", io.BytesIO(b""))
    with storage.open_read("empty") as file:
        assert file.read() == b""
    assert [(info.name, info.size) for info in storage.list()] == [("a.txt", 5), ("empty", 0)]
