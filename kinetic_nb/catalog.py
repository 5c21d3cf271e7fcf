"""Jobs from any kernel: list them, attach to one, clean old ones up.

Everything here reads storage only, so it works the same after a kernel
restart, from a second kernel, or from a script.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import time

from kinetic_nb.backends import get_backend
from kinetic_nb.client import JobHandle, print_to_stdout, remove_job_objects
from kinetic_nb.errors import IntegrityError, ObjectNotFoundError, StorageError, UnsignedJobError
from kinetic_nb.keys import delete_key, key_path, load_key, read_key_file
from kinetic_nb.runner import protocol
from kinetic_nb.runner.envelope import JOB, TRAILER_BYTES, is_sealed, read_unsigned_bytes, unseal
from kinetic_nb.runner.protocol import JobPlan
from kinetic_nb.storage import Storage, default_root, open_storage

logger = logging.getLogger(__name__)

__all__ = ["JobRecord", "attach", "gc", "jobs", "parse_duration"]

_JOB_ID = re.compile(r"^kn-\d{8}-\d{6}-[0-9a-f]+$")
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_UNIT_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


@dataclasses.dataclass(frozen=True)
class JobRecord:
    """One row of ``jobs()``."""

    job_id: str
    uri: str
    backend: str
    hosts: int
    accelerator: str
    submitted_at: float
    status: str


def _root(storage: str | None) -> Storage:
    return open_storage(storage or default_root())


def _job_ids(root: Storage) -> list[str]:
    """The job directories below ``root``, newest first (ids sort by submission time)."""
    local = root.local_path()
    if local:
        try:
            names = os.listdir(local)
        except FileNotFoundError:
            names = []
        except OSError as error:
            raise StorageError(f"cannot list the jobs in {root.uri}: {error.strerror or error}") from error
    else:
        names = {info.name.split("/", 1)[0] for info in root.list() if info.name.endswith("/" + protocol.HANDLE)}
    return sorted((name for name in names if _JOB_ID.match(name)), reverse=True)


#: How ``jobs()`` lists a job this user cannot verify: no key here (another user's, or planted).
NOT_YOURS = "NOT YOURS (unverified)"
#: How ``jobs()`` lists a job stored before records were signed.
UNSIGNED = "UNSIGNED"


@dataclasses.dataclass(frozen=True)
class _Access:
    """How this user may read a job: its key, or the explicit trust of a job from before signing."""

    key: bytes | None
    trust_unsigned: bool = False


def _access(job_id: str, *, key_file: str | None = None, trust_unsigned: bool = False) -> _Access | None:
    if key_file is not None:
        return _Access(read_key_file(key_file, job_id, JOB))
    key = load_key(job_id, JOB)
    if key is not None:
        return _Access(key)
    return _Access(None, trust_unsigned=True) if trust_unsigned else None


def _read_record(job: Storage, name: str, access: _Access) -> bytes:
    """A signed record's verified body (or, trusted explicitly, an unsigned one's bytes)."""
    data = job.read_bytes(name)
    if access.key is not None:
        return unseal(access.key, name, data, where=f"{job.uri}/{name}")
    if is_sealed(data):
        raise IntegrityError(f"{job.uri}/{name} is signed, and this user has no key for it")
    return read_unsigned_bytes(data, where=f"{job.uri}/{name}")


def _handle_record(job: Storage, access: _Access) -> dict:
    try:
        return json.loads(_read_record(job, protocol.HANDLE, access))
    except (ObjectNotFoundError, ValueError):
        return {}


def _handle_for(job: Storage, record: dict, access: _Access, *, echo: bool = False) -> JobHandle:
    plan = JobPlan.from_json(_read_record(job, protocol.PLAN, access))
    backend = get_backend(record.get("backend", "local"), **record.get("backend_options", {}))
    return JobHandle(job, plan, backend, key=access.key, echo=print_to_stdout if echo else None,
                     submitted_at=record.get("submitted_at"), detached=True)


def attach(job_id: str, *, storage: str | None = None, echo: bool = False, key_file: str | None = None,
           trust_unsigned: bool = False) -> JobHandle:
    """A ``JobHandle`` for a job submitted earlier, from this kernel or another.

    The handle is detached: interrupting a wait on it never cancels the job.
    Everything read from the job is verified under its key: this user's own
    (kept when it was submitted), or ``key_file`` (the key exported from
    another machine). A job with no key here is refused: nothing of it is
    unpickled.

    Parameters
    ----------
    job_id : str
        The job's id (``%kinetic jobs`` lists them).
    storage : str, optional
        The storage root it lives under.
    echo : bool
        Print the leader's output while waiting.
    key_file : str, optional
        A file holding the job's key, copied from the machine that submitted it.
    trust_unsigned : bool
        Read a job stored before records were signed (nothing in it can be verified).

    Raises
    ------
    ValueError
        What is given is not a job id.
    ObjectNotFoundError
        There is no such job.
    IntegrityError
        This user has no key for the job, or a record failed verification.
    """
    if not _JOB_ID.match(job_id):
        raise ValueError(f"{job_id!r} is not a job id (they look like kn-20250101-120000-a1b2c3; "
                         "%kinetic jobs lists them)")
    root = _root(storage)
    job = root.child(job_id)
    access = _access(job_id, key_file=key_file, trust_unsigned=trust_unsigned)
    if access is None:
        if not job.exists(protocol.PLAN) and not job.exists(protocol.HANDLE):
            raise ObjectNotFoundError(f"no job {job_id} in {root.uri}")
        try:
            unsigned = not is_sealed(job.read_bytes(protocol.HANDLE))
        except ObjectNotFoundError:
            unsigned = False
        if unsigned:
            raise UnsignedJobError(f"job {job_id} was stored before records were signed: nothing in it can be "
                                   "verified; attach with trust_unsigned=True (--trust-unsigned) if you wrote it")
        raise IntegrityError(f"job {job_id} is not yours: this user has no key for it (another user's job, or "
                             "one planted in a shared root), so nothing of it is read; to attach from another "
                             f"machine, pass its key file (key_file=..., --key-file), {key_path(job_id).name} "
                             "where it was submitted")
    try:
        return _handle_for(job, _handle_record(job, access), access, echo=echo)
    except ObjectNotFoundError:
        raise ObjectNotFoundError(f"no job {job_id} in {root.uri} (its plan.json is missing)") from None


def _current_status(job: Storage, record: dict, access: _Access) -> str:
    """The recorded outcome, or the state the job's records show now."""
    if record.get("status"):
        return record["status"]
    try:
        return str(_handle_for(job, record, access).status())
    except ObjectNotFoundError:
        return "UNKNOWN"


def _unverified_record(job: Storage) -> tuple[dict, str]:
    """What a job this user cannot verify says of itself, to list it (never to act on), and how to label it."""
    try:
        data = job.read_bytes(protocol.HANDLE)
    except ObjectNotFoundError:
        return {}, NOT_YOURS
    label = NOT_YOURS if is_sealed(data) else UNSIGNED
    try:
        record = json.loads(data[:-TRAILER_BYTES] if is_sealed(data) else data)
    except ValueError:
        return {}, label
    return (record if isinstance(record, dict) else {}), label


def jobs(*, storage: str | None = None, limit: int = 20) -> list[JobRecord]:
    """The most recent jobs, newest first, with their state.

    A job this user has no key for is listed as ``NOT YOURS (unverified)``
    (or ``UNSIGNED``, from before signing), with what it says of itself.
    """
    root = _root(storage)
    records = []
    for job_id in _job_ids(root)[:limit]:
        job = root.child(job_id)
        access = _access(job_id)
        if access is None:
            record, status = _unverified_record(job)
        else:
            try:
                record = _handle_record(job, access)
                status = _current_status(job, record, access) if record else ""
            except IntegrityError:
                record, status = _unverified_record(job)[0], "FAILED VERIFICATION"
        if not record:
            continue
        records.append(JobRecord(job_id, job.uri, str(record.get("backend", "local")), int(record.get("hosts", 0)),
                                 str(record.get("accelerator", "")), float(record.get("submitted_at", 0.0)),
                                 status))
    return records


def parse_duration(text: str) -> float:
    """``"90s"``, ``"30m"``, ``"12h"``, ``"7d"``, ``"2w"`` (or plain seconds) in seconds."""
    match = _DURATION.match(text)
    if not match:
        raise ValueError(f"invalid duration {text!r}: use a number with s, m, h, d or w, e.g. 7d")
    return float(match.group(1)) * _UNIT_SECONDS[match.group(2)]


def _clean_up_platform(job: Storage, record: dict, access: _Access) -> None:
    """Remove what the job's platform still holds for it (a cluster's objects; locally nothing)."""
    try:
        handle = _handle_for(job, record, access)
        handle.backend.cleanup(handle.plan)
    except ObjectNotFoundError:
        return  # no plan: cleaned up at its outcome, its platform's objects with it
    except Exception:  # the objects in storage go regardless
        logger.warning("could not clean up the %s objects of %s", record.get("backend"), job.uri, exc_info=True)


def _forget_on_this_machine(job_id: str, record: dict) -> None:
    """What the job's backend keeps outside storage (a local job's agent log and record)."""
    try:
        get_backend(record.get("backend", "local"), **record.get("backend_options", {})).forget(job_id)
    except Exception:  # the job itself is gone regardless
        logger.warning("could not remove what this machine keeps of %s", job_id, exc_info=True)


def gc(older_than: float | str, *, storage: str | None = None) -> list[str]:
    """Remove this user's jobs submitted longer than ``older_than`` ago whose every host has ended.

    A job's recorded outcome is not enough: a failed job's other hosts may
    still be inside their grace period, so each job's hosts are looked at. A
    job this user has no key for (another user's in a shared root, or
    planted) is left alone; a removed job's key file and agent records go with it.
    """
    age = parse_duration(older_than) if isinstance(older_than, str) else float(older_than)
    root = _root(storage)
    removed = []
    for job_id in _job_ids(root):
        access = _access(job_id)
        if access is None:
            continue  # not ours to judge, nor to remove
        job = root.child(job_id)
        try:
            record = _handle_record(job, access)
        except IntegrityError:
            continue  # tampered with: kept for whoever investigates
        if time.time() - record.get("submitted_at", time.time()) < age:
            continue
        try:
            live = _handle_for(job, record, access).status()
        except ObjectNotFoundError:
            live = None  # no plan: nothing of the job can still run
        except IntegrityError:
            continue
        if live is not None and not live.done:
            continue  # never pull a job's objects from under a live host
        _clean_up_platform(job, record, access)
        remove_job_objects(job)
        delete_key(job_id)
        _forget_on_this_machine(job_id, record)
        removed.append(job_id)
    return removed
