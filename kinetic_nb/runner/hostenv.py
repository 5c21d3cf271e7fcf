"""Which host this is, from the environment each platform sets; and the environment a host runs in."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from kinetic_nb.runner.protocol import JobPlan

logger = logging.getLogger(__name__)

#: Checked in order; the first valid value wins. TPU VMs set TPU_WORKER_ID,
#: LeaderWorkerSet pods LWS_WORKER_INDEX, Indexed Jobs JOB_COMPLETION_INDEX,
#: and the local backend KINETIC_HOST_INDEX.
HOST_INDEX_VARIABLES = ("TPU_WORKER_ID", "LWS_WORKER_INDEX", "JOB_COMPLETION_INDEX", "KINETIC_HOST_INDEX")


def resolve_host_index(environ: Mapping[str, str]) -> int | None:
    """This host's index, or None when no variable gives one.

    None means a single-host job whose only host is the leader; the plan check
    refuses it for a multi-host job. A value that is not a non-negative
    integer is logged and skipped, never silently taken as the leader's index.
    """
    for variable in HOST_INDEX_VARIABLES:
        raw = environ.get(variable)
        if raw is None or raw.strip() == "":
            continue
        value = raw.strip()
        if value.isdigit():
            return int(value)
        logger.warning("ignoring %s=%r: not a non-negative integer", variable, raw)
    return None


def host_environment(plan: JobPlan, host_index: int, job_uri: str, output_dir: str,
                     base: Mapping[str, str]) -> dict[str, str]:
    """The environment of host ``host_index``: ``base``, then kinetic's, torch's and JAX's variables, then ``plan.env``.

    Built here once for every launcher that knows the host's index up front
    (the local agent); a platform that learns it only on the host (a pod's
    downward API) sets the same names from its own sources.
    """
    env = dict(base)
    env.update(
        KINETIC_JOB_ID=plan.job_id,
        KINETIC_JOB_URI=job_uri,
        KINETIC_HOST_INDEX=str(host_index),
        KINETIC_NUM_HOSTS=str(plan.hosts),
        KINETIC_OUTPUT_DIR=output_dir,
        RANK=str(host_index),
        WORLD_SIZE=str(plan.hosts),
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR=plan.coordinator_host,
        MASTER_PORT=str(plan.coordinator_port),
        JAX_COORDINATOR_ADDRESS=plan.coordinator_address,
        JAX_NUM_PROCESSES=str(plan.hosts),
        JAX_PROCESS_ID=str(host_index),
        PYTHONUNBUFFERED="1",
    )
    if plan.simulated:  # CPU devices in place of the accelerator's chips
        xla_flags = env.get("XLA_FLAGS", "")
        env["JAX_PLATFORMS"] = "cpu"
        env["XLA_FLAGS"] = f"{xla_flags} --xla_force_host_platform_device_count={plan.devices_per_host}".strip()
    env.update(plan.env)
    return env
