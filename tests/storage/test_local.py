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


def test_a_link_in_place_of_an_object_or_a_directory_is_never_followed(storage, tmp_path):
    precious = tmp_path / "precious.txt"
    precious.write_bytes(b"keep me")
    storage.write_bytes("hosts/0/status.json", b"{}")
    os.symlink(precious, storage.local_path("hosts/0/heartbeat"))
    os.symlink(tmp_path, storage.local_path("cells"))
    with pytest.raises(StorageError, match=r"cannot write .*hosts/0/heartbeat: Too many levels of symbolic links"):
        storage.write_bytes("hosts/0/heartbeat", b"")
    with pytest.raises(StorageError, match=r"cannot read .*hosts/0/heartbeat"):
        storage.read_bytes("hosts/0/heartbeat")
    with pytest.raises(StorageError, match=r"cannot write .*cells/000002/ready-1"):
        storage.write_bytes("cells/000002/ready-1", b"")
    storage.write_bytes("hosts/0/heartbeat2", b"x")  # beside the link: a plain object
    assert precious.read_bytes() == b"keep me" and not (tmp_path / "000002").exists()
    assert [info.name for info in storage.list()] == ["hosts/0/heartbeat2", "hosts/0/status.json"]
    assert not storage.exists("hosts/0/heartbeat")


def test_a_directory_renamed_away_keeps_every_write_in_it(storage, tmp_path):
    storage.write_bytes("a/b.txt", b"one")
    os.rename(storage.local_path(), tmp_path / "moved")
    os.makedirs(tmp_path / "root" / "a", mode=0o777)
    storage.write_bytes("a/c.txt", b"two")
    assert (tmp_path / "moved" / "a" / "c.txt").read_bytes() == b"two"
    assert os.listdir(tmp_path / "root" / "a") == []
    assert storage.read_bytes("a/b.txt") == b"one"


def test_a_fifo_in_place_of_an_object_is_refused_at_once(storage):
    storage.write_bytes("x", b"1")
    os.mkfifo(storage.local_path("handle.json"))
    with pytest.raises(StorageError, match=r"handle\.json is not a regular file"):
        storage.read_bytes("handle.json")
    assert [info.name for info in storage.list()] == ["x"]


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o077])
def test_directories_are_0700_and_files_0600_whatever_the_umask(storage, tmp_path, umask):
    source = tmp_path / "source.bin"
    source.write_bytes(b"s")
    source.chmod(0o644)
    before = os.umask(umask)
    try:
        storage.write_bytes("a/b/value.bin", b"v")
        storage.write_bytes("a/marker", b"")
        storage.write_file("c/from-path.bin", source)
        storage.write_file("c/from-file.bin", io.BytesIO(b"f"))
        storage.make_directory("outputs/sub")
    finally:
        os.umask(before)
    root = storage.local_path()
    modes = {os.path.relpath(os.path.join(directory, name), root): stat.S_IMODE(os.lstat(os.path.join(directory, name)).st_mode)
             for directory, names, files in os.walk(root) for name in [*names, *files]}
    assert modes == {"a": 0o700, "a/b": 0o700, "a/b/value.bin": 0o600, "a/marker": 0o600, "c": 0o700,
                     "c/from-path.bin": 0o600, "c/from-file.bin": 0o600, "outputs": 0o700, "outputs/sub": 0o700}
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700


def test_a_shared_root_keeps_this_users_objects_in_a_directory_of_their_own(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    storage = LocalStorage(str(shared))
    job = storage.child("kn-1")
    job.write_bytes("plan.json", b"{}")
    mine = shared / f"uid-{os.geteuid()}"
    assert job.uri == f"file://{mine}/kn-1" and (mine / "kn-1" / "plan.json").read_bytes() == b"{}"
    assert stat.S_IMODE(mine.stat().st_mode) == 0o700
    assert LocalStorage(job.uri).read_bytes("plan.json") == b"{}"  # a host opens its job's own directory
    # Other users may rename directories above the job: a path through the held descriptor, never the plain one.
    assert job.local_path("outputs") == f"/proc/{os.getpid()}/fd/{job._anchor.fd}/kn-1/outputs"


def test_a_user_directory_others_may_write_is_refused_in_one_line(tmp_path):
    shared = tmp_path / "shared"
    mine = shared / f"uid-{os.geteuid()}"
    mine.mkdir(parents=True)
    shared.chmod(0o777)
    mine.chmod(0o777)
    with pytest.raises(StorageError, match=rf"^{mine} may be written by other users \(mode 777\): run chmod 700"):
        LocalStorage(str(shared)).write_bytes("x", b"1")
