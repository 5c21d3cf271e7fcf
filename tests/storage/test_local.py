import os
import stat

import pytest

from kinetic_nb.errors import ObjectExistsError, ObjectNotFoundError, StorageError
from kinetic_nb.storage import LocalStorage, default_root, open_storage


@pytest.fixture
def storage(tmp_path):
    return open_storage(f"file://{tmp_path}/root")


def test_write_read_list_delete(storage):
    storage.write_bytes("a/b.txt", b"one")
    storage.write_bytes("a/c.txt", b"two")
    storage.write_bytes("z.txt", b"three")
    assert storage.read_bytes("a/b.txt") == b"one"
    assert [info.name for info in storage.list("a/")] == ["a/b.txt", "a/c.txt"]
    assert [info.name for info in storage.list()] == ["a/b.txt", "a/c.txt", "z.txt"]
    assert [info.name for info in storage.list("a/b")] == ["a/b.txt"]
    storage.delete("a/b.txt")
    assert not storage.exists("a/b.txt")
    with pytest.raises(ObjectNotFoundError, match="a/b.txt does not exist"):
        storage.read_bytes("a/b.txt")
    with pytest.raises(ObjectNotFoundError):
        storage.delete("a/b.txt")
    assert storage.list("missing/") == []


def test_rewrites_change_the_version_and_leave_no_temporary_files(storage):
    storage.write_bytes("status.json", b"1")
    first = storage.list("status.json")[0].version
    storage.write_bytes("status.json", b"22")
    assert storage.list("status.json")[0].version != first
    assert os.listdir(storage.local_path()) == ["status.json"]


def test_exclusive_writes_refuse_a_second_writer(storage):
    storage.write_bytes("result.pkl", b"first", exclusive=True)
    with pytest.raises(ObjectExistsError, match="result.pkl already exists"):
        storage.write_bytes("result.pkl", b"second", exclusive=True)
    assert storage.read_bytes("result.pkl") == b"first"
    assert [info.name for info in storage.list()] == ["result.pkl"]


def test_half_written_objects_are_never_listed(storage):
    os.makedirs(storage.local_path("hosts"), exist_ok=True)
    open(storage.local_path("hosts/.tmp-status.json-abc"), "wb").close()
    assert storage.list() == []


def test_names_cannot_escape_the_root(storage):
    with pytest.raises(StorageError, match="invalid object name"):
        storage.read_bytes("../secret")


def test_child_and_plain_paths(tmp_path):
    storage = LocalStorage(str(tmp_path)).child("job-1")
    assert storage.uri == f"file://{tmp_path}/job-1"
    storage.write_bytes("x", b"1")
    assert (tmp_path / "job-1" / "x").read_bytes() == b"1"


def test_default_root_is_private(tmp_path, monkeypatch):
    monkeypatch.delenv("KINETIC_STORAGE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    root = default_root()
    assert root == f"file://{tmp_path}/kinetic_nb/jobs"
    assert stat.S_IMODE(os.stat(tmp_path / "kinetic_nb" / "jobs").st_mode) == 0o700


def test_unsupported_scheme_is_one_clear_line():
    with pytest.raises(ValueError, match=r"unsupported storage URI 's3://b/x': scheme s3:// is not supported"):
        open_storage("s3://b/x")
