"""Jobs from any kernel: list them, attach to one, clean old ones up.

Everything here reads storage only, so it works the same after a kernel
restart, from a second kernel, or from a script.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import time

from kinetic_nb.backends import Backend, get_backend
from kinetic_nb.client.catalog_records import listed_fields, listed_ids, owned_here, printable, read_record_bytes
from kinetic_nb.client.cell_handle import CellHandle
from kinetic_nb.client.host_group import HostGroup, remove_job_objects
from kinetic_nb.client.keys import delete_key, key_path, load_key, read_key_file
from kinetic_nb.client.launch import print_to_stdout
from kinetic_nb.client.plan import check_protocol
from kinetic_nb.client.sessions import SESSION_ID, attach_session
from kinetic_nb.errors import IntegrityError, KineticError, ObjectNotFoundError, StorageError, UnsignedJobError
from kinetic_nb.runner import protocol
from kinetic_nb.runner.envelope import is_sealed, read_unsigned_bytes, unseal
from kinetic_nb.runner.job_keys import JOB, SESSION
from kinetic_nb.runner.protocol import JobPlan
from kinetic_nb.storage import Storage, default_root, open_storage

logger = logging.getLogger(__name__)

__all__ = ["GcReport", "JobRecord", "attach", "gc", "gc_report", "jobs", "parse_duration"]

#: A job id, matched whole (``fullmatch``): ASCII digits only, and nothing after it (not even a newline).
_JOB_ID = re.compile(r"kn-[0-9]{8}-[0-9]{6}-[0-9a-f]+")
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_UNIT_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
#: What one job's row may fail with without taking the rest of the listing down: storage, a record's
#: verification or shape, a backend its handle names that this kernel cannot make.
_ROW_ERRORS = (KineticError, OSError, ValueError, TypeError, LookupError)


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
    #: The cell as its notebook named it (``In[5]``); "" for a job from the API or from before it was recorded.
    cell: str = ""


def _root(storage: str | None) -> Storage:
    return open_storage(storage or default_root())


def _job_ids(root: Storage) -> list[tuple[str, int | None]]:
    """The job directories below ``root``, newest first (ids sort by submission time), each with its
    handle's size where the listing gave it."""
    return listed_ids(root, _JOB_ID, protocol.HANDLE)


#: How ``jobs()`` lists a job that is not this user's: its directory is another user's, or there is no key here.
NOT_YOURS = "NOT YOURS (unverified)"
#: How ``jobs()`` lists a job of this user's stored before records were signed (no key, no signature).
UNSIGNED = "UNSIGNED"
#: How ``jobs()`` lists a job whose handle could not be read or makes no sense, with the reason after it.
UNREADABLE = "UNREADABLE"


@dataclasses.dataclass(frozen=True)
class _Access:
    """How this user may read a job: its key, or the explicit trust of a job from before signing."""

    key: bytes | None
    trust_unsigned: bool = False


def _access(job_id: str, job: Storage, *, key_file: str | None = None,
            trust_unsigned: bool = False) -> _Access | None:
    """This user's way into the job, or None when it is not this user's: a job directory another user owns
    is never read as this user's, whatever key is here; only this user's own may be trusted unsigned."""
    if key_file is not None:
        return _Access(read_key_file(key_file, job_id, JOB))  # the key itself says whose job it is
    owned = owned_here(job)
    if owned is False:
        return None
    key = load_key(job_id, JOB)
    if key is not None:
        return _Access(key)
    return _Access(None, trust_unsigned=True) if trust_unsigned and owned else None


def _read_record(job: Storage, name: str, access: _Access, *, listed_size: int | None = None) -> bytes:
    """A signed record's verified body (or, trusted explicitly, an unsigned one's bytes)."""
    data = read_record_bytes(job, name, listed_size=listed_size)
    if access.key is not None:
        return unseal(access.key, name, data, where=f"{job.uri}/{name}")
    if is_sealed(data):
        raise IntegrityError(f"{job.uri}/{name} is signed, and this user has no key for it")
    return read_unsigned_bytes(data, where=f"{job.uri}/{name}")


def _unverified_body(data: bytes) -> object:
    """The JSON value a record starts with, whatever trails it (a signature this user cannot check)."""
    return json.JSONDecoder().raw_decode(data.decode(errors="replace"))[0]


def _handle_record(job: Storage, access: _Access) -> dict:
    try:
        record = json.loads(_read_record(job, protocol.HANDLE, access))
    except (ObjectNotFoundError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _group_for(job: Storage, record: dict, access: _Access, *, echo: bool = False) -> HostGroup:
    plan = JobPlan.from_json(_read_record(job, protocol.PLAN, access))
    backend = get_backend(record.get("backend", "local"), **record.get("backend_options", {}))
    return HostGroup(job, plan, backend, key=access.key, echo=print_to_stdout if echo else None,
                     submitted_at=record.get("submitted_at"), detached=True)


def _unsigned_and_own(job: Storage) -> bool:
    """Whether the job is this user's own from before signing: its directory is this user's (never so on
    ``gs://``, where anyone who may write to the bucket could have put it) and its handle has no signature."""
    if owned_here(job) is not True:
        return False
    try:
        return not is_sealed(read_record_bytes(job, protocol.HANDLE))
    except StorageError:  # missing, or not a record at all
        return False


def _not_yours(job_id: str, job: Storage, *, trust_unsigned: bool) -> IntegrityError:
    whose = ("its directory belongs to another user" if owned_here(job) is False
             else "this user has no key for it (another user's job, or one planted in a shared root)")
    if trust_unsigned:
        return IntegrityError(f"job {job_id} is not yours: {whose}, so nothing of it is read, trusted or not")
    return IntegrityError(f"job {job_id} is not yours: {whose}, so nothing of it is read; to attach from another "
                          f"machine, pass its key file (key_file=..., --key-file), {key_path(job_id).name} "
                          "where it was submitted")


def attach(job_id: str, *, storage: str | None = None, echo: bool = False, key_file: str | None = None,
           trust_unsigned: bool = False) -> CellHandle:
    """A ``CellHandle`` on a job submitted earlier, from this kernel or another.

    The handle is detached: interrupting a wait on it never cancels the job.
    Everything read from the job is verified under its key: this user's own
    (kept when it was submitted), or ``key_file`` (the key exported from
    another machine). A job that is not this user's (no key here, or on
    ``file://`` a directory another user owns) is refused: nothing of it is
    unpickled, with ``trust_unsigned`` or without.

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
        Read a job this user stored before records were signed: its result is unpickled unverified,
        so only for a job you ran yourself. Refused for a job whose directory is not this user's
        (and on ``gs://``, where storage has no owners).

    Raises
    ------
    ValueError
        What is given is not a job id.
    ObjectNotFoundError
        There is no such job.
    UnsignedJobError
        The job is this user's own from before signing, and ``trust_unsigned`` was not given.
    IntegrityError
        The job is not this user's, or a record failed verification.
    """
    if not _JOB_ID.fullmatch(job_id):
        raise ValueError(f"{printable(repr(job_id))} is not a job id (they look like kn-20250101-120000-a1b2c3; "
                         "%kinetic jobs lists them)")
    root = _root(storage)
    job = root.child(job_id)
    access = _access(job_id, job, key_file=key_file, trust_unsigned=trust_unsigned)
    if access is None:
        if not job.exists(protocol.PLAN) and not job.exists(protocol.HANDLE):
            raise ObjectNotFoundError(f"no job {job_id} in {root.uri}")
        if not trust_unsigned and _unsigned_and_own(job):
            raise UnsignedJobError(f"job {job_id} was stored before records were signed, so nothing in it can be "
                                   "verified: --trust-unsigned (trust_unsigned=True) unpickles this job's stored "
                                   "result, only for a job you ran yourself before signing existed")
        raise _not_yours(job_id, job, trust_unsigned=trust_unsigned)
    try:
        handle = CellHandle(_group_for(job, _handle_record(job, access), access, echo=echo))
    except ObjectNotFoundError:
        raise ObjectNotFoundError(f"no job {job_id} in {root.uri} (its plan.json is missing)") from None
    check_protocol(handle.plan, f"job {job_id}")
    return handle


def _current_status(job: Storage, record: dict, access: _Access) -> str:
    """The recorded outcome, or the state the job's records show now."""
    if record.get("status"):
        return record["status"]
    try:
        return str(_group_for(job, record, access).status())
    except ObjectNotFoundError:
        return "UNKNOWN"


def _job_row(job_id: str, job: Storage, listed_size: int | None) -> JobRecord:
    """One job's row: what its handle says, each field checked, and its state as far as this user can know it.

    A job that is not this user's is listed with what it says of itself, never acted on: ``NOT YOURS``,
    or ``UNSIGNED`` for this user's own from before signing.
    """
    access = _access(job_id, job)
    data = read_record_bytes(job, protocol.HANDLE, listed_size=listed_size)
    if access is None:
        status = UNSIGNED if owned_here(job) is True and not is_sealed(data) else NOT_YOURS
        record = _unverified_body(data)
    else:
        try:
            record = json.loads(unseal(access.key, protocol.HANDLE, data, where=f"{job.uri}/{protocol.HANDLE}"))
            status = ""
        except IntegrityError:
            record, status = _unverified_body(data), "FAILED VERIFICATION"
    fields = listed_fields(record)
    if not status:
        status = printable(_current_status(job, record, access)) if access is not None else ""
    return JobRecord(job_id, job.uri, fields.backend, fields.hosts, fields.accelerator, fields.submitted_at, status,
                     fields.cell)


def jobs(*, storage: str | None = None, limit: int = 20) -> list[JobRecord]:
    """The most recent jobs, newest first, with their state.

    A job that is not this user's (no key here, or its directory another
    user's) is listed as ``NOT YOURS (unverified)``; this user's own from
    before signing as ``UNSIGNED``; each with what it says of itself. A job
    whose handle cannot be read (not a regular file, too large, a field of
    the wrong type) is listed as ``UNREADABLE: <reason>`` on its own row;
    no entry can stop the others from being listed. No field holds a
    control character.
    """
    root = _root(storage)
    records = []
    for job_id, listed_size in _job_ids(root)[:limit]:
        job = root.child(job_id)
        try:
            records.append(_job_row(job_id, job, listed_size))
        except ObjectNotFoundError:
            continue  # no handle (yet): nothing to list
        except _ROW_ERRORS as error:
            logger.debug("job %s cannot be listed", job_id, exc_info=True)
            reason = printable(str(error).splitlines()[0] if str(error) else type(error).__name__)
            records.append(JobRecord(job_id, job.uri, "", 0, "", 0.0, f"{UNREADABLE}: {reason}"))
    return records


#: How long gc waits for the agent of a job whose hosts have ended to end too, before keeping the job for the
#: next gc (an agent joins its sweep of killed agents' scratch folders for up to 5 s at its end).
AGENT_END_WAIT_S = 10.0


def parse_duration(text: str) -> float:
    """``"90s"``, ``"30m"``, ``"12h"``, ``"7d"``, ``"2w"`` (or plain seconds) in seconds."""
    match = _DURATION.match(text)
    if not match:
        raise ValueError(f"invalid duration {text!r}: use a number with s, m, h, d or w, e.g. 7d")
    return float(match.group(1)) * _UNIT_SECONDS[match.group(2)]


def _backend_of(job_id: str, record: dict) -> Backend | None:
    """The backend a job's record names, or None where this kernel cannot make it (said in the log)."""
    try:
        return get_backend(record.get("backend", "local"), **record.get("backend_options", {}))
    except Exception:  # a backend this kernel cannot make: the objects in storage go regardless
        logger.warning("could not clean up the %s objects of %s", record.get("backend"), job_id, exc_info=True)
        return None


def _agent_runs(backend: Backend | None, job_id: str) -> bool:
    """Whether the job's agent on this machine still runs after waiting for it to end for a moment: it outlives
    its hosts' outcome by one (it stores their last words, removes its scratch folder and ends), and its record,
    written again after gc removed it, would stay for good."""
    deadline = time.monotonic() + AGENT_END_WAIT_S
    while backend is not None and backend.agent_gone(job_id) is False:
        if time.monotonic() > deadline:
            return True
        time.sleep(0.05)
    return False


def _remove(job_id: str, storage: Storage, plan: JobPlan | None, backend: Backend | None) -> int:
    """Remove a job or session this user owns whose hosts and agent have all ended: what its platform still
    holds for it (a cluster's objects; none without a plan), its objects, its key, and what this machine keeps
    of it (a local agent's log and record). Returns the bytes its storage held."""
    freed = sum(info.size for info in storage.list())
    if backend is not None and plan is not None:
        try:
            backend.cleanup(plan)
        except Exception:
            logger.warning("could not clean up the platform's objects of %s", job_id, exc_info=True)
    remove_job_objects(storage)
    delete_key(job_id)
    if backend is not None:
        try:
            backend.forget(job_id)
        except Exception:
            logger.warning("could not remove what this machine keeps of %s", job_id, exc_info=True)
    return freed


def gc(older_than: float | str, *, storage: str | None = None) -> list[str]:
    """Remove this user's jobs and sessions older than ``older_than`` whose every host has ended; their ids.

    A job's recorded outcome is not enough: a failed job's other hosts may
    still be inside their grace period, so each job's hosts are looked at; a
    session whose hosts still run is live, and kept. The agent of a job whose
    hosts have ended is given a moment to end as well (else the next gc takes
    the job). A job that is not this user's (no key here, or a directory
    another user owns: another user's in a shared root, or planted) is left
    alone; a removed job's key file and agent records go with it. The ssh and
    TPU VM hosts of the removed jobs that can be reached have their kinetic_nb
    cache pruned (:func:`gc_report`, which also says how many bytes each job
    held and what each host removed).
    """
    return [job_id for job_id, _ in gc_report(older_than, storage=storage).removed]


@dataclasses.dataclass(frozen=True)
class GcReport:
    """What :func:`gc_report` removed: each job or session with the bytes its storage held, and a line for each
    ssh or TPU VM host whose cache it pruned or could not reach."""

    removed: tuple[tuple[str, int], ...]
    hosts: tuple[str, ...] = ()


def gc_report(older_than: float | str, *, storage: str | None = None) -> GcReport:
    """What :func:`gc` does, and what it removed: the jobs and sessions, and on the ssh and TPU VM hosts they ran
    on (each reached as its jobs reached it, over ssh with the user's own config), the environments beyond the
    newest few that no process uses and the agent logs of those jobs or of long ago
    (:mod:`kinetic_nb.backends.ssh.host_cache`). A host that cannot be reached is a line of the report, skipped."""
    from kinetic_nb.backends.ssh.host_cache import prune_hosts_of_jobs  # ssh only where a job ran there

    age = parse_duration(older_than) if isinstance(older_than, str) else float(older_than)
    removed = _collect_jobs(age, storage) + _collect_sessions(age, storage)
    hosts = prune_hosts_of_jobs((job_id, record.get("backend", "local"), record.get("backend_options") or {})
                                for job_id, _, record in removed)
    return GcReport(tuple((job_id, size) for job_id, size, _ in removed), tuple(hosts))


def collect(older_than: float | str, *, storage: str | None = None) -> list[tuple[str, int]]:
    """What :func:`gc` does, with the bytes each removed job or session held in storage."""
    return list(gc_report(older_than, storage=storage).removed)


def _collect_jobs(age: float, storage: str | None) -> list[tuple[str, int, dict]]:
    """This user's jobs submitted longer than ``age`` seconds ago whose every host has ended, removed: each with
    its bytes and its handle's record."""
    root = _root(storage)
    removed = []
    for job_id, _ in _job_ids(root):
        job = root.child(job_id)
        access = _access(job_id, job)
        if access is None:
            continue  # not ours to judge, nor to remove
        try:
            record = _handle_record(job, access)
        except (IntegrityError, StorageError):
            continue  # tampered with, or not a record at all: kept for whoever investigates
        if time.time() - record.get("submitted_at", time.time()) < age:
            continue
        try:
            group = _group_for(job, record, access)
        except ObjectNotFoundError:
            group = None  # no plan: nothing of the job can still run
        except IntegrityError:
            continue
        except (KineticError, ValueError) as error:  # its backend cannot be made here: whether it runs is unknown
            logger.warning("kept %s: its -b %s backend cannot be made here: %s", job_id, record.get("backend"), error)
            continue
        if group is not None and not group.status().done:
            continue  # never pull a job's objects from under a live host
        backend = group.backend if group is not None else _backend_of(job_id, record)
        if _agent_runs(backend, job_id):
            continue
        removed.append((job_id, _remove(job_id, job, group.plan if group else None, backend), record))
    return removed


def _collect_sessions(age: float, storage: str | None) -> list[tuple[str, int, dict]]:
    """This user's sessions started longer than ``age`` seconds ago whose every host has ended, removed: each with
    its bytes and its record."""
    root = open_storage(storage or default_root()).child(protocol.SESSIONS_DIR)
    removed = []
    for session_id, _ in listed_ids(root, SESSION_ID, protocol.HANDLE):
        if owned_here(root.child(session_id)) is False or load_key(session_id, SESSION) is None:
            continue  # another user's, or planted
        try:
            session = attach_session(session_id, storage=storage, echo=False)
            if time.time() - session.plan.created_at < age or not session.group.status().done:
                continue  # too recent, or a host still runs: never pulled from under it
        except _ROW_ERRORS:
            logger.debug("session %s cannot be collected", session_id, exc_info=True)
            continue  # unreadable: kept for whoever investigates
        record = session.group.to_dict()
        if _agent_runs(session.group.backend, session_id):
            continue
        removed.append((session_id, _remove(session_id, session.storage, session.plan, session.group.backend), record))
    return removed
