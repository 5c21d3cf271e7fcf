"""Wait until a job has ended: every host has an exit record, or the job was cancelled.

A cluster runs this as the job's root object (a small Job that owns the
workload): when it returns, the root completes and the cluster removes it and,
through owner references, everything the job holds, with no client.
"""

from __future__ import annotations

import time

from kinetic_nb.errors import ObjectNotFoundError
from kinetic_nb.runner import protocol
from kinetic_nb.runner.protocol import JobPlan
from kinetic_nb.storage import Storage

#: First and longest pause between two looks: each look is one listing.
FIRST_LOOK_S = 1.0
MAX_LOOK_S = 15.0


def job_has_ended(storage: Storage, plan: JobPlan) -> bool:
    """Whether every host has an exit record, a cancel was requested, or the job was cleaned up (one listing)."""
    names = {info.name for info in storage.list()}
    if protocol.CANCEL in names or protocol.PLAN not in names:
        return True
    return all(protocol.host_exit(index) in names for index in range(plan.hosts))


def wait_for_job_end(storage: Storage, *, sleep=time.sleep) -> int:
    """Return 0 once the job in ``storage`` has ended (a job whose plan is gone has ended too)."""
    try:
        plan = JobPlan.from_json(storage.read_bytes(protocol.PLAN))
    except ObjectNotFoundError:
        return 0  # collected, or cleaned up after its outcome
    pause = FIRST_LOOK_S
    while not job_has_ended(storage, plan):
        sleep(pause)
        pause = min(pause * 1.5, MAX_LOOK_S)
    return 0
