"""Every record the notebook reads is verified: the attacks on unsigned records, as they were found.

Anyone who may write to a job's storage (a bucket's other writers, another
user of a shared root) can plant or replay objects. A planted log chunk must
never be shown, nor its display data published; a job's records copied under
``sessions/`` must not verify as a session's; a replayed older status must not
take the host back; a record in kinetic_nb's old signature format is refused.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import pathlib

import cloudpickle
import pytest

import kinetic_nb
from kinetic_nb.backends.testing import FakeBackend
from kinetic_nb.client import catalog
from kinetic_nb.client.keys import load_key
from kinetic_nb.client.poller import JobPoller
from kinetic_nb.errors import IntegrityError, KineticError
from kinetic_nb.runner import envelope, job_keys, protocol
from kinetic_nb.runner.protocol import HostState, HostStatus
from kinetic_nb.runner.records import unverified_line, write_record
from kinetic_nb.storage import open_storage

from .test_trust import Planted

FORGED_DISPLAY = json.dumps({"data": {"application/javascript": "document.title = 'forged'",
                                      "text/html": "<b>forged html</b>"}, "metadata": {}})
FORGED_CHUNK = "hosts/0/log/000777.json"


def forged_chunk(key: bytes | None = None) -> bytes:
    body = protocol.encode_log_chunk([(protocol.DISPLAY, FORGED_DISPLAY), (protocol.STDOUT, "forged stdout line\n")])
    return envelope.seal(key, FORGED_CHUNK, body) if key is not None else body


@pytest.mark.parametrize("signed_by", ["nobody", "another-job"])
def test_a_log_chunk_planted_in_a_bucket_is_never_rendered(gcs_root, signed_by):
    shown: list[tuple[str, str]] = []
    job = kinetic_nb.submit("import time\nprint('genuine line', flush=True)\ntime.sleep(3)\n'done'", hosts=2,
                            storage=gcs_root, echo=lambda text, stream=protocol.STDOUT: shown.append((stream, text)))
    other_key = job_keys.job_key(job_keys.new_key(), job_keys.JOB, "kn-20990101-000000-0ther0")
    job.storage.write_bytes(FORGED_CHUNK, forged_chunk(other_key if signed_by == "another-job" else None))
    assert job.result(timeout=120) == "done"
    echoed = "".join(text for _, text in shown)
    assert "genuine line" in echoed  # the leader's real output still comes through
    assert "forged" not in echoed
    assert all(stream != protocol.DISPLAY for stream, _ in shown)  # no display data was published at all
    leader = job.hosts()[0]
    assert unverified_line(0, FORGED_CHUNK) in leader.log_tail
    assert not any("forged" in line for line in leader.log_tail)


def test_a_replayed_older_status_never_takes_a_host_back(storage_root):
    job_id = "kn-20261201-000000-5a7a5e"
    key = job_keys.job_key(job_keys.new_key(), job_keys.JOB, job_id)
    storage = open_storage(storage_root).child(job_id)
    plan = protocol.JobPlan(job_id=job_id, hosts=1, accelerator="cpu", devices_per_host=1, framework="none",
                            coordinator_address="127.0.0.1:1", barrier_timeout_s=1, heartbeat_timeout_s=1,
                            shutdown_timeout_s=1)
    older = HostStatus(0, HostState.PENDING.value, "startup", 1.0, 1.0, 1, "h", revision=1)
    newer = HostStatus(0, HostState.RUNNING.value, "execute", 1.0, 2.0, 1, "h", revision=2)
    poller = JobPoller(storage, plan, FakeBackend(), key=key)
    write_record(storage, key, protocol.host_status(0), older.to_json())
    replay = storage.read_bytes(protocol.host_status(0))  # what an attacker kept: genuine, signed, older
    write_record(storage, key, protocol.host_status(0), newer.to_json())
    assert poller.poll().hosts[0].state == HostState.RUNNING.value
    storage.write_bytes(protocol.host_status(0), replay)
    assert poller.poll().hosts[0].state == HostState.RUNNING.value


def test_a_jobs_records_copied_under_sessions_do_not_verify_as_a_session(storage_root):
    job = kinetic_nb.submit("1 + 1", hosts=1, keep=True)
    assert job.result(timeout=60) == 2
    root = open_storage(storage_root)
    copy = root.child(protocol.SESSIONS_DIR).child(job.job_id)
    for name in (protocol.PLAN, protocol.HANDLE):
        copy.write_bytes(name, job.storage.read_bytes(name))
    with pytest.raises((KineticError, ValueError)):  # refused, by its id or its records
        kinetic_nb.attach_session(job.job_id, storage=storage_root)
    # The MAC binds the kind: even under this user's own key for that id, the copy is no session's record.
    with pytest.raises(IntegrityError, match="failed verification"):
        envelope.read_sealed(copy, protocol.PLAN, load_key(job.job_id, job_keys.SESSION))
    assert envelope.read_sealed(job.storage, protocol.PLAN, load_key(job.job_id, job_keys.JOB))


def _old_format_seal(key: bytes, name: str, body: bytes) -> bytes:
    """``body`` sealed as kinetic_nb's first format did (whose key was not bound to the job)."""
    prefix = b"kinetic-nb/envelope/v1\0" + name.encode() + b"\0"
    block = hmac.new(key, prefix + (0).to_bytes(8, "big") + body, hashlib.sha256).digest()
    final = hmac.new(key, prefix + b"final\0" + len(body).to_bytes(8, "big") + block, hashlib.sha256)
    return body + envelope.OLD_TRAILER_PREFIX + final.hexdigest().encode() + b"\n"


def test_a_record_in_the_old_signature_format_is_refused_in_one_line_with_no_opt_in(storage_root, tmp_path):
    marker = tmp_path / "planted-code-ran"
    job_id = "kn-20200101-000000-01df0a"
    job = open_storage(storage_root).child(job_id)
    secret = job_keys.new_key()
    plan = {"job_id": job_id, "hosts": 1, "accelerator": "cpu", "devices_per_host": 1, "framework": "none",
            "coordinator_address": "127.0.0.1:1", "barrier_timeout_s": 1, "heartbeat_timeout_s": 1,
            "shutdown_timeout_s": 1, "protocol_version": protocol.PROTOCOL_VERSION}
    result = cloudpickle.dumps({"success": True, "result": Planted(marker), "outputs": {}, "phase": "execute",
                                "host_index": 0})
    for name, body in ((protocol.PLAN, json.dumps(plan).encode()),
                       (protocol.HANDLE, json.dumps({"job_id": job_id, "backend": "local", "hosts": 1}).encode()),
                       (protocol.RESULT, result)):
        job.write_bytes(name, _old_format_seal(secret, name, body))
    with pytest.raises(IntegrityError) as refused:
        envelope.read_sealed(job, protocol.PLAN, job_keys.job_key(secret, job_keys.JOB, job_id))
    assert "old format" in str(refused.value) and "\n" not in str(refused.value)
    with pytest.raises(IntegrityError, match="old format"):
        envelope.load_payload(job, protocol.RESULT, None)  # the opt-in for unsigned jobs does not take it
    with pytest.raises(KineticError):  # refused, by its old signature
        catalog.attach(job_id, storage=storage_root, trust_unsigned=True).result(timeout=10)
    assert not pathlib.Path(marker).exists()
