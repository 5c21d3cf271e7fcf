"""Wait until a job has ended: every host has ended or gone silent, or the job was cancelled.

A cluster runs this as the job's root object (a small Job that owns the
workload): when it returns, the root completes and the cluster removes it and,
through owner references, everything the job holds, with no client. So an
exit or cancel record counts only once it verifies under the job's key: one
that anyone who may write to the bucket forged would otherwise free the slice
under a running job.

A host that never reports is bounded too, from storage alone: past the start
window (the plan's start barrier bound, which includes the backend's pending
limit) a host with no heartbeat never started (its pod was never scheduled,
or crashed in a loop before its agent ran). The watcher then records its end,
sealed, where ``%kinetic jobs`` and ``attach`` read it, and the slice is let
go; a host whose start barrier waits for it reads that record and stops.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kinetic_nb.errors import IntegrityError, ObjectNotFoundError
from kinetic_nb.runner import protocol
from kinetic_nb.runner.envelope import read_sealed
from kinetic_nb.runner.protocol import ExitSummary, JobPlan
from kinetic_nb.runner.records import read_record, store_exit
from kinetic_nb.storage import Storage

logger = logging.getLogger(__name__)

#: First and longest pause between two looks: each look is one listing.
FIRST_LOOK_S = 1.0
MAX_LOOK_S = 15.0
#: A host that started but has not beaten its heartbeat for this long has ended
#: without a record (a pod OOMKilled as a whole, a node gone): waiting longer
#: would hold the slice until the deadline. Far above the 2 s beat each host's
#: agent keeps for it, so a busy or briefly partitioned host is never taken for gone.
SILENT_HOST_S = 300.0


def job_has_ended(storage: Storage, plan: JobPlan, key: bytes, now: float | None = None, *,
                  seen: dict[str, bool] | None = None) -> bool:
    """Whether every host has a verified exit record or a long-silent heartbeat, a verified cancel was
    requested, or the job was cleaned up (one listing, and one read of each record not yet verified).

    ``seen`` carries what earlier looks found from one look to the next: a
    record that verified (written once, it is not read again) or that did not.
    """
    now = time.time() if now is None else now
    seen = {} if seen is None else seen
    listing = {info.name: info for info in storage.list()}
    if protocol.PLAN not in listing:
        return True
    if protocol.CANCEL in listing and _verifies(storage, key, protocol.CANCEL, seen):
        return True
    if plan.created_at and now > plan.created_at + plan.barrier_timeout_s:
        _record_never_started(storage, plan, key, listing, now, seen)
    for index in range(plan.world_size):
        name = protocol.host_exit(index)
        if name in listing and _verifies(storage, key, name, seen):
            continue
        heartbeat = listing.get(protocol.host_heartbeat(index))
        if heartbeat is None or now - heartbeat.updated < SILENT_HOST_S:
            return False  # not started yet (still scheduling), or alive
    return True


def _record_never_started(storage: Storage, plan: JobPlan, key: bytes, listing: dict, now: float,
                          seen: dict[str, bool]) -> None:
    """Past the start window: the end of each host that never beat and has no end, recorded (so the hosts
    waiting for it at the start barrier stop too)."""
    for index in range(plan.world_size):
        name = protocol.host_exit(index)
        if protocol.host_heartbeat(index) in listing or name in listing:
            continue
        store_exit(storage, key, ExitSummary(
            host_index=index, exit_code=None, ended_at=now,
            reason=f"never started: no report within {plan.barrier_timeout_s:g} s of the job's start (its pod "
                   "was not scheduled, or crashed before its agent ran); the job's root ended the job"))
        listing[name] = None
        seen[name] = True


def _verifies(storage: Storage, key: bytes, name: str, seen: dict[str, bool]) -> bool:
    """Whether record ``name`` verifies under ``key``; a refusal is logged once."""
    if seen.get(name):
        return True
    try:
        read_record(storage, key, name)
    except ObjectNotFoundError:
        return False
    except IntegrityError as error:
        if name not in seen:
            logger.warning("ignoring %s: %s", name, error)
        seen[name] = False
        return False
    seen[name] = True
    return True


def wait_for_job_end(storage: Storage, key: bytes, *, sleep: Callable[[float], None] = time.sleep) -> int:
    """Return 0 once the job in ``storage`` has ended (a job whose plan is gone has ended too).

    A storage error is retried with the same backoff: failing here would end
    the root, and with it a healthy job.
    """
    plan = None
    seen: dict[str, bool] = {}
    pause = FIRST_LOOK_S
    while True:
        try:
            if plan is None:
                plan = JobPlan.from_json(read_sealed(storage, protocol.PLAN, key))
            if job_has_ended(storage, plan, key, seen=seen):
                return 0
        except ObjectNotFoundError:
            return 0  # collected, or cleaned up after its outcome
        except IntegrityError:
            raise  # a plan this job's client did not write: nothing to watch over
        except Exception as error:  # noqa: BLE001 - a flaky store must not end the job
            logger.warning("could not look at %s (%s); looking again in %.0f s", storage.uri, error, pause)
        sleep(pause)
        pause = min(pause * 1.5, MAX_LOOK_S)
