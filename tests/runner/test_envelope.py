"""Signed records: a MAC over the exact bytes, bound to the object's name, checked before anything is unpickled."""

from __future__ import annotations

import io
import os
import signal

import cloudpickle
import pytest

from kinetic_nb.errors import IntegrityError
from kinetic_nb.runner import envelope, job_keys
from kinetic_nb.storage import LocalStorage

KEY = bytes(range(32))


def test_seal_and_unseal_round_trip():
    sealed = envelope.seal(KEY, "plan.json", b'{"hosts": 4}')
    assert sealed.startswith(b'{"hosts": 4}\n#kinetic-mac-v2:')  # still readable as text
    assert envelope.unseal(KEY, "plan.json", sealed, where="x") == b'{"hosts": 4}'


@pytest.mark.parametrize("tamper", [
    lambda data: data.replace(b"4", b"8"),  # a changed body
    lambda data: data[:-5] + b"0000\n",  # a changed MAC
    lambda data: data[:-envelope.TRAILER_BYTES],  # no trailer
])
def test_any_change_fails_verification(tamper):
    sealed = envelope.seal(KEY, "plan.json", b'{"hosts": 4}')
    with pytest.raises(IntegrityError, match="not written by this job's hosts"):
        envelope.unseal(KEY, "plan.json", tamper(sealed), where="plan.json of kn-x")


def test_a_record_cannot_move_to_another_name_or_job():
    sealed = envelope.seal(KEY, "result-worker-1.pkl", b"payload")
    with pytest.raises(IntegrityError):
        envelope.unseal(KEY, "result.pkl", sealed, where="result.pkl")
    with pytest.raises(IntegrityError):
        envelope.unseal(os.urandom(32), "result-worker-1.pkl", sealed, where="another job")


def test_the_key_travels_as_hex_and_leaves_the_environment():
    environ = {job_keys.KEY_ENV: KEY.hex(), "OTHER": "1"}
    assert job_keys.key_from_environment(environ) == KEY
    assert job_keys.KEY_ENV not in environ
    for bad in ("zz", KEY.hex()[:-2]):  # not hex; hex but a byte short
        with pytest.raises(IntegrityError, match="holds no kinetic_nb key"):
            job_keys.key_from_environment({job_keys.KEY_ENV: bad})


def test_a_pods_key_comes_from_the_file_its_variable_names(tmp_path):
    path = tmp_path / "key"
    path.write_text(KEY.hex() + "\n")
    environ = {job_keys.KEY_FILE_ENV: str(path), "OTHER": "1"}
    assert job_keys.key_from_file(environ) == KEY
    assert environ == {"OTHER": "1"}  # the name is not passed on to the hosts
    assert job_keys.key_from_file({}) is None
    with pytest.raises(IntegrityError, match=f"cannot read the job's key file {tmp_path}/none: No such file"):
        job_keys.key_from_file({job_keys.KEY_FILE_ENV: str(tmp_path / "none")})
    path.write_text("not a key")
    with pytest.raises(IntegrityError, match=f"the job's key file {path} holds no kinetic_nb key"):
        job_keys.key_from_file({job_keys.KEY_FILE_ENV: str(path)})


@pytest.mark.parametrize("chunk", [1, 7, envelope.TRAILER_BYTES, envelope.TRAILER_BYTES + 1, 1 << 20])
def test_streamed_verification_whatever_the_read_sizes(chunk, monkeypatch):
    monkeypatch.setattr(envelope, "_CHUNK_BYTES", chunk)
    body = os.urandom(3000)
    sealed = envelope.seal(KEY, "result.pkl", body)
    assert envelope.verify_file(KEY, "result.pkl", io.BytesIO(sealed), where="x") == len(body)
    with pytest.raises(IntegrityError):
        envelope.verify_file(KEY, "result.pkl", io.BytesIO(sealed[:100] + bytes([sealed[100] ^ 1]) + sealed[101:]),
                             where="x")  # one bit flipped: a random body may already hold any byte there


class Marker:
    """Unpickling this writes a file: proof that something was (or was not) unpickled."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_nothing_is_unpickled_from_a_tampered_object(tmp_path):
    storage = LocalStorage(str(tmp_path / "job"))
    envelope.dump_sealed(storage, "result.pkl", KEY, {"value": 42})
    assert envelope.load_sealed(storage, "result.pkl", KEY) == {"value": 42}
    marker = tmp_path / "ran"
    storage.write_bytes("result.pkl", envelope.seal(os.urandom(32), "result.pkl", cloudpickle.dumps(Marker(str(marker)))))
    with pytest.raises(IntegrityError, match=r"result\.pkl failed verification"):
        envelope.load_sealed(storage, "result.pkl", KEY)
    assert not marker.exists()


class StreamOnly(LocalStorage):
    """A storage whose reads are one-pass streams, as a download is."""

    def open_read(self, name):
        return io.BufferedReader(NonSeekable(super().open_read(name)))


class NonSeekable(io.RawIOBase):
    def __init__(self, file):
        self.file = file

    def readable(self):
        return True

    def readinto(self, buffer):
        return self.file.readinto(buffer)

    def close(self):
        self.file.close()
        super().close()


def test_a_stream_is_verified_into_a_spool_before_unpickling(tmp_path):
    storage = StreamOnly(str(tmp_path / "job"))
    value = os.urandom(5 << 20)
    envelope.dump_sealed(storage, "result.pkl", KEY, value)
    assert envelope.load_sealed(storage, "result.pkl", KEY) == value


def test_blocks_are_bound_in_order_and_by_length():
    body = os.urandom(envelope.BLOCK_BYTES * 2 + 12345)  # three blocks, hashed in parallel
    sealed = envelope.seal(KEY, "result.pkl", body)
    assert envelope.verify_file(KEY, "result.pkl", io.BytesIO(sealed), where="x") == len(body)
    block = envelope.BLOCK_BYTES
    swapped = body[block:2 * block] + body[:block] + body[2 * block:]  # the same blocks, in another order
    truncated = body[:2 * block]  # whole blocks dropped from the end
    flipped = body[:block + 5] + bytes([body[block + 5] ^ 1]) + body[block + 6:]  # one bit, in the second block
    for forged in (swapped, truncated, flipped):
        with pytest.raises(IntegrityError):
            envelope.unseal(KEY, "result.pkl", forged + sealed[-envelope.TRAILER_BYTES:], where="x")


@pytest.mark.parametrize("pieces", [[3, 2 * envelope.BLOCK_BYTES + 5, 7], [envelope.BLOCK_BYTES - 1, 2, 1],
                                    [envelope.BLOCK_BYTES, envelope.BLOCK_BYTES + 1]])
def test_a_writer_signs_what_it_wrote_whatever_the_write_sizes(pieces):
    body = os.urandom(sum(pieces))
    written = io.BytesIO()
    writer = envelope.SealingWriter(written, KEY, "result.pkl")
    offset = 0
    for size in pieces:  # writes that straddle the MAC's blocks, as a pickle's header and its value do
        assert writer.write(body[offset:offset + size]) == size
        offset += size
    writer.finish()
    assert written.getvalue() == envelope.seal(KEY, "result.pkl", body)


@pytest.mark.parametrize("size", [100, envelope.SPOOL_IN_MEMORY_BYTES + 1])
def test_a_small_value_is_spooled_in_memory_and_a_large_one_on_disk(tmp_path, size):
    storage = LocalStorage(str(tmp_path / "job"))
    value = os.urandom(size)
    envelope.dump_sealed(storage, "result.pkl", KEY, value)
    assert envelope.load_sealed(storage, "result.pkl", KEY) == value
    with envelope.spool() as spool:
        spool.write(value)
        assert spool._rolled == (size > envelope.SPOOL_IN_MEMORY_BYTES)


def test_a_local_file_is_verified_block_by_block_in_place(tmp_path):
    storage = LocalStorage(str(tmp_path / "job"))
    body = os.urandom(envelope.BLOCK_BYTES * 2 + 12345)  # read and hashed by the worker threads, from the file
    storage.write_bytes("result.pkl", envelope.seal(KEY, "result.pkl", body))
    with storage.open_read("result.pkl") as file:
        assert envelope.verify_file(KEY, "result.pkl", file, where="x") == len(body)
    flipped = bytearray(body)
    flipped[envelope.BLOCK_BYTES * 2 + 7] ^= 1  # one bit, in the last block
    storage.write_bytes("result.pkl", bytes(flipped) + envelope.seal(KEY, "result.pkl", body)[len(body):])
    with storage.open_read("result.pkl") as file, pytest.raises(IntegrityError, match="failed verification"):
        envelope.verify_file(KEY, "result.pkl", file, where="x")


@pytest.mark.parametrize("size", [0, 1, 4096, (1 << 20) - 1, 1 << 20])
def test_a_small_local_file_is_hashed_in_place_as_a_thread_would(tmp_path, size):
    """Below a megabyte a file is hashed without a worker thread (a trivial cell's payload and value): its
    trailer is the one ``seal`` made, and a flipped bit fails it."""
    storage = LocalStorage(str(tmp_path / "job"))
    body = os.urandom(size)
    storage.write_bytes("result.pkl", envelope.seal(KEY, "result.pkl", body))
    with storage.open_read("result.pkl") as file:
        assert envelope.verify_file(KEY, "result.pkl", file, where="x") == size
    if size:
        flipped = bytearray(body)
        flipped[-1] ^= 1
        storage.write_bytes("result.pkl", bytes(flipped) + envelope.seal(KEY, "result.pkl", body)[size:])
        with storage.open_read("result.pkl") as file, pytest.raises(IntegrityError, match="failed verification"):
            envelope.verify_file(KEY, "result.pkl", file, where="x")


def test_the_stored_stream_is_the_body_then_its_trailer_and_rewinds(tmp_path):
    body = os.urandom(envelope.BLOCK_BYTES + 12345)
    with open(tmp_path / "spool", "w+b") as spool:
        writer = envelope.SealingWriter(spool, KEY, "result.pkl")
        writer.write(body[:10])  # a pickler's header, then its large object's own memory
        writer.write(body[10:])
        stored = writer.stored()
        sealed = envelope.seal(KEY, "result.pkl", body)
        assert stored.seek(0, io.SEEK_END) == len(sealed)  # a bucket's upload asks for the size first
        stored.seek(0)
        pieces = []
        while piece := stored.read(len(body) - 5):  # every read but the last is whole, across the trailer
            pieces.append(piece)
        assert [len(piece) for piece in pieces] == [len(body) - 5, len(sealed) - len(body) + 5]
        assert b"".join(pieces) == sealed
        stored.seek(3)  # a retried upload rewinds
        assert stored.read() == sealed[3:]


def test_a_forked_child_verifies_files_though_its_parent_hashed_some(tmp_path):
    """The hashing pool's threads do not survive a fork: a child that used the parent's pool hung for ever."""
    storage = LocalStorage(str(tmp_path))
    envelope.dump_sealed(storage, "result.pkl", KEY, b"x" * 4096)
    assert envelope.load_sealed(storage, "result.pkl", KEY) == b"x" * 4096  # the parent's pool is up now
    pid = os.fork()
    if pid == 0:  # the child: verify again, or be killed by the alarm
        signal.alarm(20)
        os._exit(0 if envelope.load_sealed(storage, "result.pkl", KEY) == b"x" * 4096 else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
