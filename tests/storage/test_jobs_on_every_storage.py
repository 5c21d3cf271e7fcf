"""4-host jobs on the local backend, with their objects in ``file://`` and in ``gs://`` (a real
fake-gcs-server): the same outcome on both. And a job that outlives an emulator restart.

The hosts are forked by a supervisor that inherits this process's environment,
so ``STORAGE_EMULATOR_HOST`` (set by the ``gcs_root`` fixture) reaches them.
"""

from __future__ import annotations

import collections
import os
import time

import pytest

import kinetic_nb
from kinetic_nb.errors import JobFailedError
from kinetic_nb.runner import protocol
from kinetic_nb.runner.protocol import HostState
from kinetic_nb.state import JobStatus

from ..fixtures_gcs import TEST_BUCKET
from ..gcs_emulator import GcsEmulator

HOST = "import os\nhost = int(os.environ['KINETIC_HOST_INDEX'])\n"
#: How long a test waits for a job's hosts to reach the cell.
REACH_CELL_S = 60.0


@pytest.fixture(params=["file", "gs"])
def root(request: pytest.FixtureRequest, storage_root: str) -> str:
    return storage_root if request.param == "file" else request.getfixturevalue("gcs_root")


def test_success(root):
    handle = kinetic_nb.submit(HOST + "print('output of', host)\nf'value of host {host}'", hosts=4, storage=root)
    assert handle.uri.startswith(root + "/")
    assert handle.result() == "value of host 0"
    assert handle.status() is JobStatus.SUCCEEDED
    assert [h.state for h in handle.hosts()] == [HostState.SUCCEEDED] * 4
    assert handle.logs(3) == "output of 3\n"
    names = {info.name for info in handle.poller.listing}  # the last listing, before any cleanup
    assert {protocol.PLAN, protocol.PAYLOAD, protocol.HANDLE, protocol.LEADER_READY, protocol.RESULT} <= names
    assert {protocol.host_status(3), protocol.host_exit(3), protocol.host_log_chunk(3, 0)} <= names
    assert not any(protocol.parse_worker_result(name) is not None for name in names)


def test_a_worker_failure_after_leader_success_raises_the_workers_exception(root):
    source = HOST + (
        "import time\n"
        "from kinetic_nb.storage import open_storage\n"
        "job = open_storage(os.environ['KINETIC_JOB_URI'])\n"
        "if host == 2:\n"
        "    while not job.exists('result.pkl'):  # fail only after the leader has recorded its success\n"
        "        time.sleep(0.01)\n"
        "    raise KeyError('only on host 2')\n"
        "'leader value'"
    )
    handle = kinetic_nb.submit(source, hosts=4, storage=root)
    with pytest.raises(KeyError, match="only on host 2") as info:
        handle.result()
    assert info.value.__notes__[0] == (  # where to look, never a storage object
        f"Reported by host 2 of job {handle.job_id}. %kinetic logs {handle.job_id} --host 2 shows its output."
    )
    assert "raise KeyError" in str(info.value.__cause__)
    assert handle.status() is JobStatus.FAILED
    assert [h.state for h in handle.hosts()] == [HostState.SUCCEEDED, HostState.SUCCEEDED, HostState.FAILED,
                                                 HostState.SUCCEEDED]


def test_no_host_payload_at_all_says_no_host_reported_and_how_the_leader_ended(root):
    handle = kinetic_nb.submit(HOST + "if host == 0:\n    os._exit(7)\nhost", hosts=4, storage=root)
    with pytest.raises(JobFailedError) as info:
        handle.result()
    first_line = str(info.value).splitlines()[0]
    assert first_line.startswith(
        f"job {handle.job_id} failed and no host reported an outcome; host 0 exited with code 7"
    )
    assert handle.status() is JobStatus.FAILED


def test_a_job_rides_out_an_emulator_restart(tmp_path, tmp_path_factory, monkeypatch):
    with GcsEmulator(tmp_path / "emulator") as emulator:
        emulator.create_bucket(TEST_BUCKET)
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", emulator.url)
        session = str(tmp_path_factory.getbasetemp()).strip("/")  # lets the leftover-process check see this job
        source = HOST + (
            "import time\n"
            "for tick in range(15):  # output, so log chunks are written while the emulator is down\n"
            "    print('tick', tick, flush=True)\n"
            "    time.sleep(0.2)\n"
            "f'survived on host {host}'"
        )
        handle = kinetic_nb.submit(source, hosts=2, storage=f"gs://{TEST_BUCKET}/{session}/restart")
        deadline = time.monotonic() + REACH_CELL_S
        while not all(h.phase == "execute" for h in handle.hosts()):
            assert time.monotonic() < deadline, handle.summary()
            time.sleep(0.05)
        emulator.stop()
        time.sleep(2.0)
        emulator.start()
        assert handle.result() == "survived on host 0"
        assert handle.status() is JobStatus.SUCCEEDED
        for index in range(2):
            assert list(handle.logs(index).splitlines()) == [f"tick {tick}" for tick in range(15)]
    assert os.environ["STORAGE_EMULATOR_HOST"] == emulator.url


def test_files_the_cell_writes_land_in_outputs(root):
    source = HOST + "import pathlib\npathlib.Path(os.environ['KINETIC_OUTPUT_DIR'], f'shard-{host}.txt').write_text(str(host))"
    handle = kinetic_nb.submit(source, hosts=2, storage=root)
    handle.result()
    names = sorted(info.name for info in handle.storage.list("outputs/"))
    assert names == ["outputs/shard-0.txt", "outputs/shard-1.txt"]  # kept after the success's cleanup
    assert handle.storage.read_bytes("outputs/shard-1.txt") == b"1"


def test_a_session_cell_on_gs_reads_no_earlier_cells_log_chunks(gcs_root, monkeypatch, storage_only):
    """A cell's feed reads what is new for it: over 20 cells no log chunk is read twice (each cell's handle
    re-read every earlier chunk: 575 chunk reads a cell at cell 600), so a cell's reads do not grow."""
    session = kinetic_nb.start(hosts=2, framework="none", storage=gcs_root, idle_timeout=600, echo=False)
    try:
        storage = session.group.storage
        reads: list[str] = []
        real_read, real_bounded = storage.read_bytes, storage.read_bounded
        monkeypatch.setattr(storage, "read_bytes", lambda name: reads.append(name) or real_read(name))
        monkeypatch.setattr(storage, "read_bounded",  # how a record is read: up to its limit
                            lambda name, max_bytes: reads.append(name) or real_bounded(name, max_bytes))
        for seq in range(1, 21):
            assert session.run(f"print('cell {seq}')\n{seq}").result(timeout=60) == seq
        chunks = collections.Counter(name for name in reads if "/log/" in name)
        assert len(chunks) >= 20, chunks  # every cell printed: its chunks were read
        assert [name for name, times in chunks.items() if times > 1] == []
    finally:
        session.stop()
