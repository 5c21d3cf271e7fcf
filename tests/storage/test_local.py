"""What only ``file://`` storage does; the shared rules are in test_contract.py."""

import io
import os
import stat

import pytest

from kinetic_nb.errors import ObjectExistsError, StorageError
from kinetic_nb.storage import LocalStorage, default_root, open_storage


@pytest.fixture
def storage(tmp_path):
    return open_storage(f"file://{tmp_path}/root")


def test_writes_leave_no_temporary_files(storage, tmp_path):
    storage.write_bytes("status.json", b"1")
    storage.write_bytes("status.json", b"22")
    source = tmp_path / "value.bin"
    source.write_bytes(b"x" * 1000)
    storage.write_file("value.bin", source)
    storage.write_file("stream.bin", io.BytesIO(b"y" * 1000))
    with pytest.raises(ObjectExistsError):
        storage.write_file("value.bin", source, exclusive=True)
    assert sorted(os.listdir(storage.local_path())) == ["status.json", "stream.bin", "value.bin"]


def test_half_written_objects_are_never_listed(storage):
    os.makedirs(storage.local_path("hosts"), exist_ok=True)
    open(storage.local_path("hosts/.tmp-status.json-abc"), "wb").close()
    assert storage.list() == []


def test_objects_are_files_at_their_local_path(storage):
    storage.write_bytes("a/b.txt", b"one")
    with open(storage.local_path("a/b.txt"), "rb") as file:
        assert file.read() == b"one"


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


def test_a_file_in_the_way_is_one_line_that_says_what_to_do(tmp_path):
    (tmp_path / "a_file").write_text("not a directory")
    storage = LocalStorage(str(tmp_path / "a_file" / "jobs"))
    with pytest.raises(StorageError) as raised:
        storage.write_bytes("plan.json", b"{}")
    message = str(raised.value)
    assert message.startswith(f"cannot write {storage.uri}/plan.json: Not a directory")
    assert "--storage" in message and "\n" not in message
    assert isinstance(raised.value.__cause__, NotADirectoryError)  # kept for %tb


def test_no_permission_is_one_line_too(storage, monkeypatch):
    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied", "/somewhere")

    monkeypatch.setattr(os, "replace", refuse)  # root may write anywhere: the refusal is played
    with pytest.raises(StorageError, match=r"cannot write .*/x: Permission denied \(/somewhere\); use a --storage"):
        storage.write_bytes("x", b"1")
    monkeypatch.setattr(os, "scandir", refuse)
    with pytest.raises(StorageError, match=r"cannot list file://.*: Permission denied"):
        storage.list()
