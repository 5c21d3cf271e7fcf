"""Jobs from any kernel: jobs(), attach(), gc(), cleanup after success, and the %kinetic line magic."""

from __future__ import annotations

import json
import os
import pathlib
import threading
import time

import pytest
from IPython.core.interactiveshell import InteractiveShell

import kinetic_nb
from kinetic_nb.agent.local_state import AgentState
from kinetic_nb.agent.processes import process_start
from kinetic_nb.backends.local import agent_files
from kinetic_nb.client import catalog as jobs
from kinetic_nb.client.catalog_records import RECORD_MAX_BYTES, listed_fields, printable, read_record_bytes
from kinetic_nb.errors import ObjectNotFoundError, ProtocolVersionError, StorageError
from kinetic_nb.runner import protocol
from kinetic_nb.runner.envelope import read_sealed, write_sealed
from kinetic_nb.state import JobStatus
from kinetic_nb.storage import open_storage


def record_of(handle) -> dict:
    """handle.json's verified body."""
    return json.loads(read_sealed(handle.storage, "handle.json", handle.key))


def test_a_success_leaves_only_the_record_and_the_outputs():
    source = "import os, pathlib\npathlib.Path(os.environ['KINETIC_OUTPUT_DIR'], 'model.txt').write_text('weights')\n1"
    handle = kinetic_nb.submit(source, hosts=2)
    assert handle.result() == 1
    names = sorted(info.name for info in handle.storage.list())
    assert names == ["handle.json", "outputs/model.txt"]
    record = record_of(handle)
    assert record["status"] == "SUCCEEDED" and record["hosts"] == 2
    assert handle.status() is JobStatus.SUCCEEDED


def test_a_failure_keeps_everything_for_inspection():
    handle = kinetic_nb.submit("raise RuntimeError('inspect me')", hosts=2)
    with pytest.raises(RuntimeError):
        handle.result()
    names = {info.name for info in handle.storage.list()}
    assert {"plan.json", "payload.pkl", "result.pkl", "hosts/1/exit.json"} <= names
    assert record_of(handle)["status"] == "FAILED"


def test_jobs_attach_and_gc(storage_root, monkeypatch):
    kept = kinetic_nb.submit("'kept'", hosts=2, keep=True)
    kept.result()
    running = kinetic_nb.submit("import time\ntime.sleep(30)", hosts=1)
    try:
        listed = {record.job_id: record for record in jobs.jobs()}
        assert listed[kept.job_id].status == "SUCCEEDED" and listed[running.job_id].status in ("PENDING", "RUNNING")
        again = jobs.attach(kept.job_id)
        assert again.result() == "kept" and again.group.detached
        with pytest.raises(FileNotFoundError, match="no job kn-19990101-000000-abc"):
            jobs.attach("kn-19990101-000000-abc")
        kept_record = agent_files(kept.job_id)[1]  # the agent's own record (its log went, being empty)
        wait_for_agent_end(kept)  # it outlives the outcome by a moment (gc waits that moment for it)
        assert os.path.exists(kept_record)  # kept past the outcome: it tells a dead agent from a busy one
        ended = pathlib.Path(kept_record).read_bytes()
        # An agent still ending (here: a record naming this live process) keeps its job when it does not end in
        # gc's moment: removed under it, its record would be written again after gc, and left for good.
        monkeypatch.setattr(jobs, "AGENT_END_WAIT_S", 0.2)
        AgentState(pid=os.getpid(), started_at=time.time(), process_start=process_start(os.getpid())).write(kept_record)
        assert kept.job_id not in jobs.gc(0) and os.path.exists(kept.storage.local_path())
        pathlib.Path(kept_record).write_bytes(ended)
        removed = jobs.gc(0)
        assert kept.job_id in removed and running.job_id not in removed  # never a running job
        assert not os.path.exists(kept.storage.local_path())
        assert not any(os.path.exists(path) for path in agent_files(kept.job_id))  # gc ends them with the job
    finally:
        running.cancel()


def wait_for_agent_end(handle, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while handle.group.backend.agent_gone(handle.job_id) is False:
        assert time.monotonic() < deadline, f"the agent of {handle.job_id} did not end in {timeout_s:g} s"
        time.sleep(0.05)


@pytest.mark.parametrize(("text", "seconds"), [("90s", 90), ("30m", 1800), ("12h", 43200), ("7d", 604800), ("5", 5)])
def test_durations(text, seconds):
    assert jobs.parse_duration(text) == seconds


@pytest.fixture(scope="module")
def shell():
    shell = InteractiveShell.instance()
    shell.run_cell("%load_ext kinetic_nb")
    yield shell
    InteractiveShell.clear_instance()


def test_line_magic(shell, capsys):
    failing = kinetic_nb.submit("import os\nprint('hello from', os.environ['RANK'])\nraise ValueError('x')", hosts=2)
    with pytest.raises(ValueError, match=r"^x"):
        failing.result()
    capsys.readouterr()
    shell.run_cell("%kinetic jobs")
    table = capsys.readouterr().out
    assert table.splitlines()[0].split() == ["job", "cell", "submitted", "hosts", "accelerator", "state"]
    assert failing.job_id in table and "FAILED" in table
    shell.run_cell(f"%kinetic logs {failing.job_id} --host 1")
    assert "hello from 1" in capsys.readouterr().out
    sleeper = kinetic_nb.submit("import time\ntime.sleep(60)", hosts=2)
    shell.run_cell(f"%kinetic cancel {sleeper.job_id}")
    assert capsys.readouterr().out.strip() == f"job {sleeper.job_id}: CANCELLED"
    result = shell.run_cell("%kinetic gc --older-than 1w")
    assert result.error_in_exec is None and "removed 0 jobs" in capsys.readouterr().out


def test_logs_and_stacks_without_a_job_id_show_this_notebooks_last_cell(shell, capsys):
    shell.magics_manager.registry["KineticMagics"].last_cell = None
    result = shell.run_cell("%kinetic logs")
    assert type(result.error_in_exec).__name__ == "UsageError"
    assert str(result.error_in_exec) == ("no %%kinetic cell has run in this notebook yet: %kinetic logs JOB_ID "
                                         "(%kinetic jobs lists them)")
    shell.run_cell("%%kinetic -n 2\nimport os\nprint('one-shot cell on', os.environ['RANK'])")
    capsys.readouterr()
    shell.run_cell("%kinetic logs --host 1")
    assert capsys.readouterr().out == "one-shot cell on 1\n"
    shell.run_cell("%kinetic start -n 2 --idle-timeout 120")
    try:
        shell.run_cell("%%kinetic\nimport os\nprint('session cell on', os.environ['RANK'])")
        capsys.readouterr()
        shell.run_cell("%kinetic logs --host 1")  # a session's cell: that cell's output, which no job id names
        assert capsys.readouterr().out == "session cell on 1\n"
        shell.run_cell("%kinetic stacks --host 1")  # the session's host 1, waiting for the next cell
        stacks = capsys.readouterr().out
        assert stacks.startswith("--- rank 1 ---\n") and "--- rank 0 ---" not in stacks
        failed = shell.run_cell("%%kinetic\nimport os\nprint('failing on', os.environ['RANK'])\n"
                                "assert os.environ['RANK'] != '1', 'host 1 fails'")
        assert "%kinetic logs --host 1 shows its output until the next %%kinetic cell." in failed.error_in_exec.__notes__[0]
        capsys.readouterr()
        shell.run_cell("%kinetic logs --host 1")  # as the error said
        assert capsys.readouterr().out.startswith("failing on 1\n")
    finally:
        shell.run_cell("%kinetic stop")


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("", "%kinetic expects a subcommand: start, stop, restart, profile, pm, sessions, jobs, attach, cancel, logs, "
                "stacks, gc"),
        ("frobnicate", "%kinetic expects a subcommand, not 'frobnicate'"),
        ("attach", "the following arguments are required: job_id"),
        ("attach kn-19990101-000000-abc", "no job kn-19990101-000000-abc"),
        ("attach ../../etc", "'../../etc' is not a job id (they look like kn-20250101-120000-a1b2c3"),
        ("cancel not-a-job", "'not-a-job' is not a job id"),
        ("gc --older-than soon", "invalid duration 'soon'"),
        ("logs kn-1 --host x", "argument --host: invalid int value: 'x'"),
    ],
)
def test_line_magic_usage_errors(shell, line, expected):
    result = shell.run_cell(f"%kinetic {line}")
    assert type(result.error_in_exec).__name__ == "UsageError"
    assert expected in str(result.error_in_exec) and "\n" not in str(result.error_in_exec)


def test_detached_cell_returns_a_handle_at_once(shell, tmp_path):
    go = tmp_path / "go"
    # The hosts wait for the test's word (a hang guard of two minutes): the cell can only have returned at once.
    result = shell.run_cell(f"%%kinetic -n 2 --detach\nimport os, time\ndeadline = time.time() + 120\n"
                            f"while not os.path.exists({str(go)!r}) and time.time() < deadline:\n"
                            f"    time.sleep(0.05)\n'later'")
    handle = result.result
    assert isinstance(handle, kinetic_nb.CellHandle) and handle.one_shot and handle.group.detached
    assert not handle.status().done  # returned while its hosts still wait
    go.touch()
    assert handle.result() == "later"


def test_cancel_without_a_job_id_stops_this_notebooks_detached_cell(shell, capsys):
    handle = shell.run_cell("%%kinetic -n 2 --detach\nimport time\ntime.sleep(120)").result
    assert not handle.status().done
    capsys.readouterr()
    shell.run_cell("%kinetic cancel")
    said = capsys.readouterr().out.strip()
    assert said.endswith(f"(job {handle.job_id}): CANCELLED") and said.startswith("In["), said
    assert handle.status().done
    for watcher in threading.enumerate():  # its panel's last word, while capsys still holds the stream
        if watcher.name == f"kinetic-watch-{handle.job_id}":
            watcher.join(timeout=30)


def test_gc_leaves_a_failed_job_whose_hosts_are_still_in_grace(storage_root):
    source = "import os, time\nif os.environ['RANK'] == '1':\n    raise ValueError('worker broke')\ntime.sleep(600)"
    handle = kinetic_nb.submit(source, hosts=2, grace=600)
    # Decided and recorded FAILED while the leader still runs, as by a notebook that does not stop the rest
    # (result() now does at once; the agent alone would after the grace).
    deadline = time.monotonic() + 60
    while handle.hosts()[1].state != "failed" and time.monotonic() < deadline:
        time.sleep(0.05)
    handle.group.record_outcome(JobStatus.FAILED)
    assert record_of(handle)["status"] == "FAILED"
    assert handle.job_id not in jobs.gc(0, storage=storage_root)
    assert handle.storage.exists("plan.json")
    handle.cancel()
    assert handle.job_id in jobs.gc(0, storage=storage_root)


def test_a_cancelled_job_is_listed_as_cancelled(storage_root):
    handle = kinetic_nb.submit("import time\ntime.sleep(600)", hosts=2)
    handle.cancel()
    with pytest.raises(kinetic_nb.errors.JobCancelledError):
        handle.result()
    assert record_of(handle)["status"] == "CANCELLED"
    [record] = [r for r in jobs.jobs(storage=storage_root) if r.job_id == handle.job_id]
    assert record.status == "CANCELLED"


GOOD_HANDLE = {"backend": "local", "hosts": 2, "accelerator": "cpu", "submitted_at": 1.7e9, "status": "SUCCEEDED"}


def test_listed_fields_of_a_good_handle():
    fields = listed_fields({**GOOD_HANDLE, "accelerator": "tpu\nv5e\x1b[2K\u202e"})
    assert (fields.backend, fields.hosts, fields.submitted_at, fields.status) == ("local", 2, 1.7e9, "SUCCEEDED")
    assert fields.accelerator == "tpu?v5e?[2K?"  # every control character (category C*) replaced
    assert listed_fields({}).hosts == 0 and listed_fields({}).submitted_at == 0.0


@pytest.mark.parametrize(("field", "value"), [
    ("hosts", "many"), ("hosts", -1), ("hosts", 2.5), ("hosts", True), ("submitted_at", 1e300),
    ("submitted_at", float("inf")), ("submitted_at", float("nan")), ("submitted_at", -5.0),
    ("submitted_at", "2099-01-01"), ("backend", 3), ("accelerator", None), ("status", ["SUCCEEDED"]),
])
def test_listed_fields_refuse_a_wrong_type_or_range_in_one_line_naming_the_field(field, value):
    with pytest.raises(StorageError, match=field) as info:
        listed_fields({**GOOD_HANDLE, field: value})
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("record", [[1, 2], "text", 7, None])
def test_listed_fields_refuse_what_is_not_an_object(record):
    with pytest.raises(StorageError, match="not an object"):
        listed_fields(record)


def test_printable_replaces_every_control_character():
    assert printable("a\nb\rc\td\x00e\x7ff\u200bg\u2028h") == "a?b?c?d?e?f?g?h"
    assert printable("plain text, café, 日本") == "plain text, café, 日本"


@pytest.mark.parametrize("plant", [
    pytest.param(lambda path: os.mkfifo(path), id="fifo"),
    pytest.param(lambda path: os.symlink("/dev/zero", path), id="link"),
    pytest.param(lambda path: os.mkdir(path), id="directory"),
    pytest.param(lambda path: path.write_bytes(b" " * (RECORD_MAX_BYTES + 1)), id="too-large"),
])
def test_a_record_that_is_not_a_small_regular_file_is_refused_unread(tmp_path, plant):
    plant(tmp_path / "handle.json")
    with pytest.raises(StorageError) as info:
        read_record_bytes(open_storage(f"file://{tmp_path}"), "handle.json")
    assert "\n" not in str(info.value) and not isinstance(info.value, ObjectNotFoundError)


def test_a_record_is_read_whole_up_to_the_cap(tmp_path):
    storage = open_storage(f"file://{tmp_path}")
    (tmp_path / "handle.json").write_bytes(b"x" * RECORD_MAX_BYTES)
    assert read_record_bytes(storage, "handle.json") == b"x" * RECORD_MAX_BYTES
    with pytest.raises(ObjectNotFoundError):
        read_record_bytes(storage, "plan.json")


def test_ids_are_matched_whole(tmp_path):
    for name in ("kn-20250101-120000-a1b2c3", "kn-20250101-120000-a1b2c3\n", "kn-20250101-120000-a1b2c3 x",
                 "kn-\uff12\uff10\uff12\uff150101-120000-a1b2c3", "kn-20250101-120000-A1B2C3"):
        (tmp_path / name).mkdir()
    assert [job_id for job_id, _ in jobs._job_ids(open_storage(f"file://{tmp_path}"))] == [
        "kn-20250101-120000-a1b2c3"]
    with pytest.raises(ValueError, match="is not a job id"):
        jobs.attach("kn-20250101-120000-a1b2c3\n", storage=f"file://{tmp_path}")


def test_on_gs_a_handle_over_the_cap_is_skipped_by_its_listed_size_unread(gcs_root):
    big, small = "kn-20990101-000000-b16b16", "kn-20980101-000000-5a11"
    root = open_storage(gcs_root)
    root.child(big).write_bytes("handle.json", b" " * (RECORD_MAX_BYTES + 1))
    root.child(small).write_bytes("handle.json", json.dumps(GOOD_HANDLE).encode())
    listed = {record.job_id: record for record in jobs.jobs(storage=gcs_root)}
    assert listed[big].status.startswith("UNREADABLE: ") and "over the" in listed[big].status
    assert listed[small].status == jobs.NOT_YOURS and listed[small].hosts == 2
    big_job = root.child(big)
    before = sum(big_job.requests.values())
    with pytest.raises(StorageError, match="over the"):
        read_record_bytes(big_job, "handle.json", listed_size=RECORD_MAX_BYTES + 1)
    assert sum(big_job.requests.values()) == before  # refused by its listed size: not even asked for


@pytest.mark.parametrize("kind", ["job", "session"])
def test_a_job_or_session_of_another_protocol_is_refused_in_one_line_naming_both_versions(kind):
    """Met by a newer kinetic_nb (a kernel upgraded under a live session, say): one line, never a hang."""
    if kind == "job":
        made = kinetic_nb.submit("1", hosts=1, keep=True)
        assert made.result() == 1
        storage, key, ident = made.storage, made.key, made.job_id
    else:
        made = kinetic_nb.start(hosts=1, framework="none", idle_timeout=600, echo=False)
        made.stop()
        storage, key, ident = made.storage, made.group.key, made.session_id
    plan = json.loads(read_sealed(storage, protocol.PLAN, key))
    plan["protocol_version"] = protocol.PROTOCOL_VERSION + 1
    plan["client_versions"]["kinetic_nb"] = "9.9.9"
    write_sealed(storage, protocol.PLAN, key, json.dumps(plan).encode())
    with pytest.raises(ProtocolVersionError, match=(
            rf"^{kind} {ident} was stored by kinetic_nb 9\.9\.9, which speaks job protocol "
            rf"{protocol.PROTOCOL_VERSION + 1}; this notebook's kinetic_nb \S+ speaks {protocol.PROTOCOL_VERSION}: "
            r"open it from a notebook with that kinetic_nb$")):
        kinetic_nb.attach(ident) if kind == "job" else kinetic_nb.attach_session(ident, echo=False)


def test_a_job_is_listed_with_the_cell_its_notebook_named(storage_root):
    handle = kinetic_nb.submit("1", hosts=1)
    assert handle.result() == 1
    handle.group.write_record(status="SUCCEEDED", cell="In[5]")  # what the magic's job records
    [record] = [r for r in jobs.jobs(storage=storage_root) if r.job_id == handle.job_id]
    assert record.cell == "In[5]" and record.status == "SUCCEEDED"
    assert listed_fields({**GOOD_HANDLE, "cell": "In[5]\x1b[2K" + "9" * 100}).cell == "In[5]?[2K" + "9" * 23
    assert listed_fields(GOOD_HANDLE).cell == ""  # a job from the API, or from before it was recorded
    with pytest.raises(StorageError, match="cell"):
        listed_fields({**GOOD_HANDLE, "cell": 5})
