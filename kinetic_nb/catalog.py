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
from kinetic_nb.errors import ObjectNotFoundError, StorageError
from kinetic_nb.runner import protocol
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


def _handle_record(job: Storage) -> dict:
    try:
        return json.loads(job.read_bytes(protocol.HANDLE))
    except (ObjectNotFoundError, ValueError):
        return {}


def _handle_for(job: Storage, record: dict, *, echo: bool = False) -> JobHandle:
    plan = JobPlan.from_json(job.read_bytes(protocol.PLAN))
    backend = get_backend(record.get("backend", "local"), **record.get("backend_options", {}))
    return JobHandle(job, plan, backend, echo=print_to_stdout if echo else None,
                     submitted_at=record.get("submitted_at"), detached=True)


def attach(job_id: str, *, storage: str | None = None, echo: bool = False) -> JobHandle:
    """A ``JobHandle`` for a job submitted earlier, from this kernel or another.

    The handle is detached: interrupting a wait on it never cancels the job.
    Raises ``ValueError`` for what is not a job id, and
    ``ObjectNotFoundError`` if there is no such job.
    """
    if not _JOB_ID.match(job_id):
        raise ValueError(f"{job_id!r} is not a job id (they look like kn-20250101-120000-a1b2c3; "
                         "%kinetic jobs lists them)")
    root = _root(storage)
    job = root.child(job_id)
    try:
        return _handle_for(job, _handle_record(job), echo=echo)
    except ObjectNotFoundError:
        raise ObjectNotFoundError(f"no job {job_id} in {root.uri} (its plan.json is missing)") from None


def _current_status(job: Storage, record: dict) -> str:
    """The recorded outcome, or the state the job's records show now."""
    if record.get("status"):
        return record["status"]
    try:
        return str(_handle_for(job, record).status())
    except ObjectNotFoundError:
        return "UNKNOWN"


def jobs(*, storage: str | None = None, limit: int = 20) -> list[JobRecord]:
    """The most recent jobs, newest first, with their state."""
    root = _root(storage)
    records = []
    for job_id in _job_ids(root)[:limit]:
        job = root.child(job_id)
        record = _handle_record(job)
        if not record:
            continue
        records.append(JobRecord(job_id, job.uri, record.get("backend", "local"), record.get("hosts", 0),
                                 record.get("accelerator", ""), record.get("submitted_at", 0.0),
                                 _current_status(job, record)))
    return records


def parse_duration(text: str) -> float:
    """``"90s"``, ``"30m"``, ``"12h"``, ``"7d"``, ``"2w"`` (or plain seconds) in seconds."""
    match = _DURATION.match(text)
    if not match:
        raise ValueError(f"invalid duration {text!r}: use a number with s, m, h, d or w, e.g. 7d")
    return float(match.group(1)) * _UNIT_SECONDS[match.group(2)]


def _clean_up_platform(job: Storage, record: dict) -> None:
    """Remove what the job's platform still holds for it (a cluster's objects; locally nothing)."""
    try:
        handle = _handle_for(job, record)
        handle.backend.cleanup(handle.plan)
    except ObjectNotFoundError:
        return  # no plan: cleaned up at its outcome, its platform's objects with it
    except Exception:  # the objects in storage go regardless
        logger.warning("could not clean up the %s objects of %s", record.get("backend"), job.uri, exc_info=True)


def gc(older_than: float | str, *, storage: str | None = None) -> list[str]:
    """Remove jobs submitted longer than ``older_than`` ago whose every host has ended; return their ids.

    A job's recorded outcome is not enough: a failed job's other hosts may
    still be inside their grace period, so each job's hosts are looked at.
    """
    age = parse_duration(older_than) if isinstance(older_than, str) else float(older_than)
    root = _root(storage)
    removed = []
    for job_id in _job_ids(root):
        job = root.child(job_id)
        record = _handle_record(job)
        if time.time() - record.get("submitted_at", time.time()) < age:
            continue
        try:
            live = _handle_for(job, record).status()
        except ObjectNotFoundError:
            live = None  # no plan: nothing of the job can still run
        if live is not None and not live.done:
            continue  # never pull a job's objects from under a live host
        _clean_up_platform(job, record)
        remove_job_objects(job)
        removed.append(job_id)
    return removed
