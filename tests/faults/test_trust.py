"""The trust boundary, tested as the attacks were found: storage is not trusted, and no secret is stored.

Each attack plants or replaces an object in a job's storage. A planted pickle
would write a marker file if anything unpickled it: its absence proves that
nothing ran.
"""

from __future__ import annotations

import json
import os
import pathlib
import stat
import time
import warnings

import cloudpickle
import pytest
from IPython.core.interactiveshell import InteractiveShell

import kinetic_nb
from kinetic_nb.backends.local import LocalBackend, agent_files
from kinetic_nb.client import catalog
from kinetic_nb.client.keys import key_path, load_key
from kinetic_nb.errors import IntegrityError, KineticWarning, UnsignedJobError
from kinetic_nb.runner import envelope, job_keys, protocol
from kinetic_nb.storage import open_storage

HOST = "import os\nhost = int(os.environ['KINETIC_HOST_INDEX'])\n"
SECRET = "hunter2-correct-horse-battery"


class Planted:
    """Unpickling it writes ``path``: code run in whoever unpickled it."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (pathlib.Path(self.path).write_text, ("code ran here",))


def planted_job(root: str, job_id: str, marker: pathlib.Path, *, sign_with: bytes | None) -> None:
    """A job directory someone else wrote into a shared root: a SUCCEEDED record and a poisoned result."""
    job = open_storage(root).child(job_id)
    plan = {"job_id": job_id, "hosts": 1, "accelerator": "cpu", "devices_per_host": 1, "framework": "none",
            "coordinator_address": "127.0.0.1:1", "barrier_timeout_s": 1, "heartbeat_timeout_s": 1,
            "shutdown_timeout_s": 1, "protocol_version": protocol.PROTOCOL_VERSION}
    handle = {"job_id": job_id, "uri": job.uri, "backend": "local", "hosts": 1, "accelerator": "cpu",
              "submitted_at": 4102444800.0, "status": "SUCCEEDED"}
    result = cloudpickle.dumps({"success": True, "result": Planted(marker), "outputs": {}, "phase": "execute",
                                "host_index": 0})
    for name, body in ((protocol.PLAN, json.dumps(plan).encode()), (protocol.HANDLE, json.dumps(handle).encode()),
                       (protocol.RESULT, result)):
        job.write_bytes(name, envelope.seal(sign_with, name, body) if sign_with else body)


@pytest.mark.parametrize("signed", [True, False], ids=["signed-by-someone-else", "unsigned"])
def test_a_job_planted_in_a_shared_root_is_never_unpickled(storage_root, tmp_path, signed):
    marker = tmp_path / "planted-code-ran"
    job_id = "kn-21000101-000000-badbad"  # sorts first: the newest
    planted_job(storage_root, job_id, marker, sign_with=os.urandom(32) if signed else None)

    [listed] = [record for record in catalog.jobs(storage=storage_root) if record.job_id == job_id]
    assert listed.status == (catalog.NOT_YOURS if signed else catalog.UNSIGNED)
    with pytest.raises(IntegrityError) as info:
        catalog.attach(job_id, storage=storage_root).result()
    assert "not yours" in str(info.value) if signed else isinstance(info.value, UnsignedJobError)
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "kinetic_nb")
    result = shell.run_cell(f"%kinetic attach {job_id} --storage {storage_root}")
    assert type(result.error_in_exec).__name__ == "UsageError" and "\n" not in str(result.error_in_exec)
    assert job_id not in catalog.gc(0, storage=storage_root)  # not ours to remove either
    assert not marker.exists()


def test_a_tampered_result_is_refused_and_never_unpickled(tmp_path):
    handle = kinetic_nb.submit("'the real value'", hosts=2, keep=True)
    assert handle.result() == "the real value"
    marker = tmp_path / "ran"
    handle.storage.write_bytes(protocol.RESULT, cloudpickle.dumps({"success": True, "result": Planted(marker)}))
    again = kinetic_nb.attach(handle.job_id)  # another kernel of the same user, with the key
    with pytest.raises(IntegrityError, match=rf"{handle.job_id}/result\.pkl carries no signature"):
        again.result()
    assert not marker.exists()


def test_a_tampered_worker_payload_is_named_with_the_next_verified_error(tmp_path):
    source = HOST + "if host in (1, 2):\n    raise ValueError(f'host {host} broke')\n'leader'"
    handle = kinetic_nb.submit(source, hosts=3, keep=True)
    with pytest.raises(ValueError, match="host 1 broke"):
        handle.result()
    marker = tmp_path / "ran"
    handle.storage.write_bytes(protocol.worker_result(1), envelope.seal(
        os.urandom(32), protocol.worker_result(1), cloudpickle.dumps(Planted(marker))))
    with pytest.raises(IntegrityError, match=r"result-worker-1\.pkl failed verification") as info:
        kinetic_nb.attach(handle.job_id).result()
    assert "The next verified failure: host 2: ValueError: host 2 broke" in info.value.__notes__
    assert not marker.exists()


class Tampering(LocalBackend):
    """Replaces one of the job's objects after the client stored it and before any host reads it."""

    def __init__(self, object_name: str, data: bytes):
        super().__init__()
        self.object_name, self.data = object_name, data

    def launch(self, storage, plan, secrets):
        storage.write_bytes(self.object_name, self.data)
        super().launch(storage, plan, secrets)


@pytest.mark.parametrize("root_kind", ["file", "gs"])
def test_hosts_refuse_a_replaced_payload(tmp_path, root_kind, request, storage_root):
    root = storage_root if root_kind == "file" else request.getfixturevalue("gcs_root")
    marker = tmp_path / "ran-on-a-host"
    poisoned = cloudpickle.dumps({protocol.CELL_SOURCE: "1", protocol.CELL_FILENAME: "<x>",
                                  protocol.CELL_NAMESPACE: {"x": cloudpickle.dumps(Planted(marker))},
                                  protocol.CELL_OUT_NAMES: []})
    handle = kinetic_nb.submit("1", hosts=2, storage=root, backend=Tampering(protocol.PAYLOAD, poisoned))
    with pytest.raises(IntegrityError, match=r"payload\.pkl carries no signature") as info:
        handle.result()
    assert "It failed while loading the cell, before the cell's code ran." in info.value.__notes__
    assert not marker.exists()


def test_hosts_refuse_a_rewritten_coordinator():
    handle = kinetic_nb.submit("1", hosts=2, keep=True)
    handle.result()
    plan = json.loads(envelope.read_sealed(handle.storage, protocol.PLAN, handle.key))
    plan["coordinator_address"] = "203.0.113.7:8476"  # would receive every collective's traffic
    rewritten = kinetic_nb.submit("1", hosts=2, backend=Tampering(protocol.PLAN, json.dumps(plan).encode()))
    with pytest.raises(IntegrityError, match=r"plan\.json carries no signature") as info:
        rewritten.result()
    assert "It failed while checking versions, before the cell's code ran." in info.value.__notes__


def test_no_secret_in_any_stored_byte_or_log(monkeypatch, storage_root):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "kernel-only-credential-1234")  # the kernel's own environment
    source = HOST + (
        "print('the password is', os.environ['DB_PASSWORD'], flush=True)\n"
        "print('and the key is', os.environ.get('KINETIC_JOB_KEY'), flush=True)\n"
        "if host == 1:\n"
        "    raise RuntimeError('login failed with ' + os.environ['DB_PASSWORD'])\n"
        "len(os.environ['DB_PASSWORD'])  # a value the cell returns is its own business: not the secret here"
    )
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "kinetic_nb")
    shell.run_cell(f"%%kinetic -n 2 -e DB_PASSWORD={SECRET} --keep --quiet\n{source}")
    handle = kinetic_nb.last_job()
    with pytest.raises(RuntimeError) as info:
        handle.result()
    assert SECRET not in str(info.value)  # redacted where it was written, on the host
    key_hex = load_key(handle.job_id, job_keys.JOB).hex()  # the bound key the hosts hold
    secret_hex = key_path(handle.job_id).read_text().strip()  # the secret it is bound from
    stored = b"".join(pathlib.Path(path).read_bytes()
                      for path in pathlib.Path(handle.storage.local_path()).rglob("*") if path.is_file())
    # What the agent keeps on this machine: its record, always; its log, unless it had nothing to say. The cell
    # is decided before its agent ends (cleanup goes on in the background), so read them once it has ended.
    deadline = time.monotonic() + 30
    while not LocalBackend().agent_gone(handle.job_id) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert LocalBackend().agent_gone(handle.job_id), "the job's agent outlived its cell by 30 s"
    log_path, record_path = map(pathlib.Path, agent_files(handle.job_id))
    kept = sorted(log_path.parent.glob(f"{handle.job_id}.*"))
    assert record_path in kept and set(kept) <= {log_path, record_path}, kept
    stored += b"".join(path.read_bytes() for path in kept)
    for secret in (SECRET, key_hex, secret_hex, "kernel-only-credential-1234"):
        assert secret.encode() not in stored
    assert "the password is ***" in handle.logs(0) and "and the key is None" in handle.logs(0)
    assert json.loads(envelope.read_sealed(handle.storage, protocol.PLAN, handle.key))["env_names"] == ["DB_PASSWORD"]


def test_keys_are_this_users_only_and_go_with_their_jobs(storage_root):
    handle = kinetic_nb.submit("1", hosts=1)
    handle.result()
    path = key_path(handle.job_id)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert handle.job_id in catalog.gc(0, storage=storage_root)  # its agent may still be ending: gc waits for it
    assert not path.exists()
    time.sleep(0.5)  # an agent that outlived gc would write its record again now
    assert not any(os.path.exists(path) for path in agent_files(handle.job_id))


def test_attach_from_another_machine_with_the_key_file(tmp_path):
    handle = kinetic_nb.submit("'from afar'", hosts=2, keep=True)
    handle.result()
    exported = tmp_path / "exported.key"
    exported.write_text(key_path(handle.job_id).read_text())
    key_path(handle.job_id).unlink()  # this machine no longer has it
    with pytest.raises(IntegrityError, match="not yours"):
        kinetic_nb.attach(handle.job_id)
    assert kinetic_nb.attach(handle.job_id, key_file=str(exported)).result() == "from afar"


def test_a_root_others_can_write_is_accepted_with_one_warning(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.warns(KineticWarning, match="writable by other users") as warned:
        handle = kinetic_nb.submit("1", hosts=1, storage=f"file://{shared}")
    assert len([w for w in warned if issubclass(w.category, KineticWarning)]) == 1
    assert handle.result() == 1
    assert stat.S_IMODE(os.stat(handle.storage.local_path()).st_mode) == 0o700
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        private = tmp_path / "private"
        kinetic_nb.submit("1", hosts=1, storage=f"file://{private}").result()  # no warning for a private root



def test_a_job_from_before_signing_is_read_only_on_explicit_opt_in(storage_root):
    job_id = "kn-20200101-000000-01d0b5"
    job = open_storage(storage_root).child(job_id)
    plan = {"job_id": job_id, "hosts": 1, "accelerator": "cpu", "devices_per_host": 1, "framework": "none",
            "coordinator_address": "127.0.0.1:1", "barrier_timeout_s": 1, "heartbeat_timeout_s": 1,
            "shutdown_timeout_s": 1, "protocol_version": protocol.PROTOCOL_VERSION}
    job.write_bytes(protocol.PLAN, json.dumps(plan).encode())
    job.write_bytes(protocol.HANDLE, json.dumps({"job_id": job_id, "backend": "local", "hosts": 1}).encode())
    job.write_bytes(protocol.RESULT, cloudpickle.dumps({"success": True, "result": "written before signing",
                                                        "outputs": {}, "phase": "execute", "host_index": 0}))
    job.write_bytes(protocol.host_exit(0), protocol.ExitSummary(0, 0, recorded_success=True).to_json())
    with pytest.raises(UnsignedJobError, match="trust_unsigned=True"):
        catalog.attach(job_id, storage=storage_root)
    trusted = catalog.attach(job_id, storage=storage_root, trust_unsigned=True)
    assert trusted.result() == "written before signing"
