"""The outcome rules on stored records, without processes: which payloads are read, what is raised."""

from __future__ import annotations

import dataclasses
import warnings

import cloudpickle
import pytest

from kinetic_nb.client.outcome import cell_words, phase_note, resolve_outcome
from kinetic_nb.errors import HostExitError, HostStoppedError, JobCancelledError, JobFailedError, KineticWarning
from kinetic_nb.runner import envelope, protocol
from kinetic_nb.runner.protocol import ExitSummary, JobPlan, ResultPayload
from kinetic_nb.state import JobStatus, job_status
from kinetic_nb.storage import LocalStorage


class CountingStorage(LocalStorage):
    """A real file storage that counts what the client reads and lists."""

    def __init__(self, uri):
        super().__init__(uri)
        self.reads: list[str] = []
        self.lists = 0

    def read_bytes(self, name):
        self.reads.append(name)
        return super().read_bytes(name)

    def open_read(self, name):
        self.reads.append(name)
        return super().open_read(name)

    def list(self, prefix=""):
        self.lists += 1
        return super().list(prefix)


#: The job's key: every payload here is signed with it, as the hosts sign theirs.
KEY = bytes(range(32))


def put(storage, name: str, body: bytes) -> None:
    """Store ``body`` as a host would: signed under the job's key."""
    storage.write_bytes(name, envelope.seal(KEY, name, body))


def make_plan(hosts: int) -> JobPlan:
    return JobPlan(job_id="kn-test", hosts=hosts, accelerator="cpu", devices_per_host=1, framework="none",
                   coordinator_address="127.0.0.1:1", barrier_timeout_s=1,
                   heartbeat_timeout_s=1, shutdown_timeout_s=1)


def failure(host: int, error: BaseException, *, stopped: bool = False, phase: str = "execute") -> bytes:
    text = f"Traceback (most recent call last):\n  File \"<cell>\", line 1\n{error!r}\n"
    return cloudpickle.dumps(ResultPayload(
        success=False, exception=cloudpickle.dumps(error), exception_type=type(error).__name__,
        exception_message=str(error), traceback=text, phase=phase, host_index=host, stopped=stopped,
    ).to_dict())


def success(value) -> bytes:
    return cloudpickle.dumps(ResultPayload(success=True, result=value, phase="execute", host_index=0).to_dict())


@pytest.fixture
def storage(tmp_path):
    return CountingStorage(str(tmp_path / "kn-test"))


def exits(hosts: int, failed=(), stopped=()) -> dict[int, ExitSummary]:
    return {i: ExitSummary(i, 1 if i in failed else (3 if i in stopped else 0), recorded_success=i not in failed + stopped,
                           stopped=i in stopped) for i in range(hosts)}


def resolve(storage, hosts, status, host_exits, *, listing_error: Exception | None = None, cell: str = "",
            plan: JobPlan | None = None):
    listed = []

    def list_job():
        listed.append(True)
        if listing_error is not None:
            raise listing_error
        return storage.list()

    outcome = resolve_outcome(storage, plan or make_plan(hosts), status, host_exits, list_job,
                              lambda i: f"ended (host {i})", key=KEY, cell=cell)
    return outcome, listed


def test_rule_2_success_reads_only_the_leader_and_never_lists(storage):
    put(storage, "result.pkl", success(42))
    put(storage, "result-worker-3.pkl", failure(3, ValueError("stale")))
    outcome, listed = resolve(storage, 4, JobStatus.SUCCEEDED, exits(4))
    assert outcome.result == 42
    assert storage.reads == ["result.pkl"] and listed == []


def test_rule_1_leader_failure_wins_over_workers(storage):
    put(storage, "result.pkl", failure(0, KeyError("leader")))
    put(storage, "result-worker-1.pkl", failure(1, ValueError("worker")))
    with pytest.raises(KeyError, match="leader"):
        resolve(storage, 2, JobStatus.FAILED, exits(2, failed=(0, 1)))
    assert storage.reads == ["result.pkl"]


def test_rule_3_and_5_one_download_names_the_others(storage):
    put(storage, "result.pkl", success("never returned"))
    for host in (5, 2, 7):
        put(storage, protocol.worker_result(host), failure(host, ValueError(f"host {host}")))
    with pytest.raises(ValueError, match="host 2") as info:
        resolve(storage, 8, JobStatus.FAILED, exits(8, failed=(2, 5, 7)))
    assert info.value.__notes__ == [  # a failure in the cell's code: its traceback says where, no phase note
        "Reported by host 2 of job kn-test. %kinetic logs kn-test --host 2 shows its output. "
        "Other hosts that also reported a failure: 5, 7.",
    ]
    assert storage.reads == ["result.pkl", "result-worker-2.pkl"]
    assert "host 2" in str(info.value.__cause__)  # the remote traceback travels as the cause


def test_rule_4_no_leader_payload_uses_the_worker_rule(storage):
    put(storage, "result-worker-1.pkl", failure(1, OSError("disk")))
    with pytest.raises(OSError, match="disk"):
        resolve(storage, 2, JobStatus.FAILED, exits(2, failed=(0, 1)))


def test_rule_4_no_payload_at_all_says_no_host_reported_and_names_every_host(storage):
    with pytest.raises(JobFailedError) as info:
        resolve(storage, 3, JobStatus.FAILED, exits(3, failed=(0,)))
    message = str(info.value)
    assert message.startswith("job kn-test failed and no host reported an outcome; host 0 ended (host 0).")
    assert all(f"host {i} ended (host {i})" in message for i in range(3))


def test_rule_5_unreadable_and_success_claiming_worker_payloads_are_skipped(storage):
    put(storage, "result.pkl", success(1))
    put(storage, "result-worker-1.pkl", b"garbage")
    put(storage, "result-worker-2.pkl", success("a worker must not claim success"))
    put(storage, "result-worker-3.pkl", failure(3, RuntimeError("the real one")))
    with pytest.warns(KineticWarning) as warned:
        with pytest.raises(RuntimeError, match="the real one"):
            resolve(storage, 4, JobStatus.FAILED, exits(4, failed=(1, 2, 3)))
    messages = [str(w.message) for w in warned]
    assert any("unreadable outcome of host 1" in m for m in messages)
    assert any("host 2" in m and "claims success" in m for m in messages)


def test_single_host_jobs_never_list(storage):
    put(storage, "result.pkl", failure(0, ArithmeticError("alone")))
    with pytest.raises(ArithmeticError):
        resolve(storage, 1, JobStatus.FAILED, exits(1, failed=(0,)))
    assert storage.lists == 0


def test_rule_6_a_peer_loss_ranks_after_a_hosts_own_failure(storage):
    put(storage, "result.pkl", failure(0, RuntimeError("Connection closed by peer [127.0.0.1]:1234")))
    put(storage, "result-worker-1.pkl", failure(1, RuntimeError("gloo: connection reset by peer")))
    put(storage, "result-worker-3.pkl", failure(3, MemoryError("host 3 ran out")))
    with pytest.raises(MemoryError) as info:
        resolve(storage, 4, JobStatus.FAILED, exits(4, failed=(0, 1, 3)))
    assert "Other hosts that also reported a failure: 1." in info.value.__notes__[0]
    assert "The leader (host 0) failed as a consequence" in info.value.__notes__[1]


def test_a_stopped_leader_defers_to_the_failing_host(storage):
    put(storage, "result.pkl", failure(0, HostStoppedError("stopped: host 2 failed while loading the cell"),
                                              stopped=True))
    put(storage, "result-worker-2.pkl", failure(2, ImportError("no module")))
    with pytest.raises(ImportError):
        resolve(storage, 3, JobStatus.FAILED, exits(3, failed=(2,), stopped=(0, 1)))


def test_cancelled_jobs_say_so(storage):
    with pytest.raises(JobCancelledError):
        resolve(storage, 2, JobStatus.CANCELLED, exits(2, stopped=(0, 1)))


def test_the_same_records_give_the_same_exception(storage):
    put(storage, "result-worker-4.pkl", failure(4, ValueError("four")))
    put(storage, "result-worker-2.pkl", failure(2, ValueError("two")))
    raised = set()
    for _ in range(3):
        with pytest.raises(ValueError, match="two") as info:
            resolve(storage, 5, JobStatus.FAILED, exits(5, failed=(2, 4)))
        raised.add(str(info.value))
    assert raised == {"two"}


def test_job_status():
    plan = make_plan(2)
    assert job_status(plan, {}, started=False, cancelled=False) is JobStatus.PENDING
    assert job_status(plan, {0: exits(2)[0]}, started=True, cancelled=False) is JobStatus.RUNNING
    assert job_status(plan, exits(2), started=True, cancelled=False) is JobStatus.SUCCEEDED
    assert job_status(plan, exits(2, failed=(1,)), started=True, cancelled=False) is JobStatus.FAILED
    assert job_status(plan, exits(2, stopped=(0, 1)), started=True, cancelled=True) is JobStatus.CANCELLED
    crashed_after_success = {0: ExitSummary(0, None, "SIGABRT", recorded_success=True), 1: exits(2)[1]}
    assert job_status(plan, crashed_after_success, started=True, cancelled=False) is JobStatus.SUCCEEDED


def test_ordinary_words_do_not_make_a_failure_a_consequence(storage):
    put(storage, "result-worker-1.pkl", failure(1, RuntimeError("resource unavailable, deadline exceeded")))
    put(storage, "result-worker-2.pkl", failure(2, RuntimeError("UNAVAILABLE: coordination service lost")))
    with pytest.raises(RuntimeError, match="resource unavailable"):
        resolve(storage, 3, JobStatus.FAILED, exits(3, failed=(0, 1, 2)))


# A failed listing never becomes the error (the seed: "could not list per-host result payloads").

def test_a_failed_listing_after_leader_success_raises_the_jobs_failure_with_a_warning(storage):
    put(storage, "result.pkl", success("never returned"))
    put(storage, "result-worker-2.pkl", failure(2, ValueError("unseen")))
    with pytest.warns(KineticWarning, match="could not list the hosts' outcomes of job kn-test"):
        with pytest.raises(JobFailedError) as info:
            resolve(storage, 3, JobStatus.FAILED, exits(3, failed=(2,)), listing_error=RuntimeError("bucket unreachable"))
    message = str(info.value)
    assert message.startswith("job kn-test failed after the leader succeeded; the other hosts' outcomes could not")
    assert "host 2 ended (host 2)" in message.splitlines()[0]  # the culprit, from its exit summary
    assert all(f"host {i} ended (host {i})" in message for i in range(3))  # every host's summary and last lines
    assert any("RuntimeError: bucket unreachable" in note for note in info.value.__notes__)
    assert storage.reads == ["result.pkl"]


def test_a_failed_listing_with_no_leader_payload_still_names_the_dead_host(storage):
    with pytest.warns(KineticWarning, match="could not list"):
        with pytest.raises(JobFailedError) as info:
            resolve(storage, 2, JobStatus.FAILED, exits(2, failed=(1,)), listing_error=PermissionError("403"))
    assert "the leader reported no outcome, and the other hosts' outcomes could not be listed" in str(info.value)
    assert "host 1 ended (host 1)" in str(info.value).splitlines()[0]
    assert any("PermissionError: 403" in note for note in info.value.__notes__)


def test_a_failed_listing_keeps_the_leaders_consequence_failure_with_a_note(storage):
    put(storage, "result.pkl", failure(0, RuntimeError("gloo: connection reset by peer")))
    with pytest.warns(KineticWarning, match="could not list"):
        with pytest.raises(RuntimeError, match="connection reset by peer") as info:
            resolve(storage, 2, JobStatus.FAILED, exits(2, failed=(0,)), listing_error=OSError("unreachable"))
    assert any("OSError: unreachable" in note for note in info.value.__notes__)


# The failing phase travels with the exception.

def test_the_leaders_failure_names_its_phase(storage):
    put(storage, "result.pkl", failure(0, ImportError("no module named foo"), phase="payload load"))
    with pytest.raises(ImportError) as info:
        resolve(storage, 2, JobStatus.FAILED, exits(2, failed=(0,)))
    assert info.value.__notes__ == ["It failed while loading the cell, before the cell's code ran."]


def test_a_workers_failure_names_its_phase(storage):
    put(storage, "result.pkl", success(1))
    put(storage, "result-worker-1.pkl", failure(1, TimeoutError("barrier"), phase="start barrier"))
    with pytest.raises(TimeoutError) as info:
        resolve(storage, 2, JobStatus.FAILED, exits(2, failed=(1,)))
    assert "It failed while waiting for the others, before the cell's code ran." in info.value.__notes__
    assert info.value.__notes__[0].startswith("Reported by host 1")


# A leader payload that exists but cannot be unpickled here is named, never "missing".

def test_an_unreadable_leader_success_is_reported_as_unreadable(storage):
    from kinetic_nb.errors import UnreadableResultError

    put(storage, "result.pkl", b"\x80\x05not a pickle")
    with pytest.raises(UnreadableResultError, match=r"^host 0 recorded its outcome, but it cannot be unpickled here"):
        resolve(storage, 2, JobStatus.SUCCEEDED, exits(2))


def test_a_workers_own_failure_still_ranks_before_an_unreadable_leader(storage):
    put(storage, "result.pkl", b"\x80\x05not a pickle")
    put(storage, "result-worker-1.pkl", failure(1, ValueError("the worker's own")))
    with pytest.raises(ValueError, match="the worker's own"):
        resolve(storage, 2, JobStatus.FAILED, exits(2, failed=(1,)))


def test_an_unreadable_leader_is_named_when_nothing_else_failed(storage):
    from kinetic_nb.errors import UnreadableResultError

    put(storage, "result.pkl", b"\x80\x05not a pickle")
    with pytest.raises(UnreadableResultError):
        resolve(storage, 2, JobStatus.FAILED, exits(2, stopped=(1,)))


# Storage is not trusted: a payload that fails verification is never unpickled.

class Planted:
    """Unpickling it would write a marker file: proof of code run in the notebook."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_tampered_leader_success_never_returns_a_value(storage, tmp_path):
    from kinetic_nb.errors import IntegrityError

    marker = tmp_path / "ran"
    storage.write_bytes("result.pkl", envelope.seal(b"x" * 32, "result.pkl", cloudpickle.dumps(Planted(str(marker)))))
    with pytest.raises(IntegrityError, match=r"kn-test/result\.pkl failed verification: it was not written by this"):
        resolve(storage, 2, JobStatus.SUCCEEDED, exits(2))
    assert not marker.exists()


def test_a_tampered_worker_payload_is_named_with_the_next_verified_error(storage, tmp_path):
    from kinetic_nb.errors import IntegrityError

    marker = tmp_path / "ran"
    put(storage, "result.pkl", success("never returned"))
    storage.write_bytes("result-worker-1.pkl", cloudpickle.dumps(Planted(str(marker))))  # unsigned, planted
    put(storage, "result-worker-3.pkl", failure(3, ValueError("host 3's own")))
    with pytest.raises(IntegrityError, match=r"result-worker-1\.pkl carries no signature") as info:
        resolve(storage, 4, JobStatus.FAILED, exits(4, failed=(1, 3)))
    assert "The next verified failure: host 3: ValueError: host 3's own" in info.value.__notes__
    assert not marker.exists()


def test_a_signature_is_bound_to_its_object(storage):
    from kinetic_nb.errors import IntegrityError

    # host 2's genuine failure payload, copied over the leader's: valid bytes under the job's key, wrong name
    storage.write_bytes("result.pkl", envelope.seal(KEY, "result-worker-2.pkl", failure(2, ValueError("moved"))))
    with pytest.raises(IntegrityError, match=r"result\.pkl failed verification"):
        resolve(storage, 3, JobStatus.SUCCEEDED, exits(3))


def test_a_stored_system_exit_is_never_raised_as_one(storage):
    """A payload from a host that predates HostExitError: the caller's process must not end."""
    put(storage, protocol.worker_result(1), failure(1, SystemExit(3)))
    with pytest.raises(HostExitError, match="the cell on host 1 exited with SystemExit") as raised:
        resolve(storage, 2, JobStatus.FAILED, exits(2, failed=(1,)))
    assert raised.value.code == 3


def test_a_missing_out_name_is_a_warning_and_the_value_still_comes(storage):
    payload = ResultPayload(success=True, result=42, outputs={"kept": 1}, phase="execute", host_index=0,
                            missing_outputs=("typo",))
    put(storage, protocol.RESULT, cloudpickle.dumps(payload.to_dict()))
    with pytest.warns(KineticWarning, match="-o/--out typo: not bound on the leader"):
        record, _ = resolve(storage, 2, JobStatus.SUCCEEDED, exits(2))
    assert record.result == 42 and record.outputs == {"kept": 1} and record.missing_outputs == ("typo",)


def test_a_remote_traceback_is_drawn_as_ipython_draws_a_local_one():
    import re

    from kinetic_nb.client.remote_traceback import render_remote_traceback

    text = ('Traceback (most recent call last):\n  File "<kinetic In[4]>", line 4, in <module>\n    json.loads(s)\n'
            '  File "/usr/lib/python3.11/json/__init__.py", line 346, in loads\n'
            '    return _default_decoder.decode(s)\n           ^^^^^^^^^^^^^^^^^^^^^^^^^^\nKeyError: \'x\'\n\n'
            'During handling of the above exception, another exception occurred:\n\n'
            'Traceback (most recent call last):\n  File "<kinetic In[4]>", line 12, in <module>\n'
            '    raise ValueError("bad")\nValueError: bad\nsecond line\n')
    coloured = render_remote_traceback(text, "ValueError", "host 2 of ks-1/cells/000002", ["Reported by host 2."])
    plain = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in coloured]
    assert plain[0] == "-" * 75
    assert re.fullmatch(r"ValueError +Traceback from host 2 of ks-1/cells/000002 \(most recent call last\)", plain[1])
    assert plain[2:] == [
        "Cell In[4], line 4", "----> 4 json.loads(s)", "",
        "File /usr/lib/python3.11/json/__init__.py:346, in loads", "--> 346 return _default_decoder.decode(s)", "",
        "KeyError: 'x'", "", "During handling of the above exception, another exception occurred:", "",
        "Cell In[4], line 12", "---> 12 raise ValueError(\"bad\")", "",
        "ValueError: bad", "second line", "Reported by host 2.",
    ]
    assert "\x1b[31m\x1b[1mKeyError\x1b[0m: 'x'" in coloured  # each exception in red, as IPython's
    assert "second line" in coloured  # a message's second line is not taken for an exception


# Messages name the cell as the notebook does and where to look, never a storage object or a pickle.

def _said(error: BaseException) -> str:
    return "\n".join([str(error), *getattr(error, "__notes__", ())])


@pytest.mark.parametrize("scenario", ["worker", "nothing", "listing", "cancelled", "unreadable"])
def test_no_message_names_a_storage_object_or_a_pickle(storage, scenario):
    put(storage, "result.pkl", b"\x80\x05not a pickle" if scenario == "unreadable" else success(1))
    if scenario == "worker":
        put(storage, "result-worker-1.pkl", failure(1, ValueError("bad shard")))
    if scenario == "nothing":
        storage.delete("result.pkl")
    status = {"cancelled": JobStatus.CANCELLED, "unreadable": JobStatus.SUCCEEDED}.get(scenario, JobStatus.FAILED)
    listing_error = OSError("unreachable") if scenario == "listing" else None
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        with pytest.raises(Exception) as info:  # noqa: PT011 - each scenario raises its own kind
            resolve(storage, 2, status, exits(2, failed=(1,)), cell="In[5]", listing_error=listing_error)
    said = "\n".join([_said(info.value), *(str(w.message) for w in warned)])
    assert ".pkl" not in said and storage.uri not in said and "payload" not in said
    if scenario != "unreadable":
        assert "In[5] (job kn-test)" in said


def test_a_session_cell_is_named_by_the_notebook_and_its_session_never_its_folder(storage):
    put(storage, "result.pkl", success(1))
    put(storage, "result-worker-1.pkl", failure(1, ValueError("bad shard")))
    plan = dataclasses.replace(make_plan(2), job_id="ks-abc/cells/000002")
    with pytest.raises(ValueError, match="bad shard") as info:
        resolve(storage, 2, JobStatus.FAILED, exits(2, failed=(1,)), cell="In[5]", plan=plan)
    assert info.value.__notes__[0] == ("Reported by host 1 of In[5] (session ks-abc). %kinetic logs --host 1 shows its "
                                       "output until the next %%kinetic cell.")
    assert cell_words("ks-abc/cells/000002") == "cell 2 of session ks-abc"
    assert cell_words("kn-1", "In[3]") == "In[3] (job kn-1)" and cell_words("kn-1") == "job kn-1"


@pytest.mark.parametrize(("phase", "note"), [
    ("execute", []),
    ("plan check", ["It failed while checking versions, before the cell's code ran."]),
    ("result upload", ["It failed while sending the result, after the cell's code ran."]),
    ("teardown", ["It failed while shutting down, after the cell's code ran."]),
])
def test_a_failure_outside_the_cells_code_says_when_in_a_users_words(phase, note):
    assert phase_note(phase) == note
