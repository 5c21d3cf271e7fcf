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


def job_variables(plan: JobPlan, job_uri: str, output_dir: str) -> dict[str, str]:
    """The variables every host of the job gets alike: kinetic's, torch's and JAX's, less the host's index.

    The one place they are named, for every launcher: the local agent adds
    :func:`index_variables` itself, a pod gets the index from its platform.
    """
    env = {
        "KINETIC_JOB_ID": plan.job_id,
        "KINETIC_JOB_URI": job_uri,
        "KINETIC_NUM_HOSTS": str(plan.hosts),
        "KINETIC_OUTPUT_DIR": output_dir,
        "WORLD_SIZE": str(plan.hosts),
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_PORT": str(plan.coordinator_port),
        "JAX_NUM_PROCESSES": str(plan.hosts),
        "PYTHONUNBUFFERED": "1",
    }
    if plan.simulated:  # CPU devices in place of the accelerator's chips
        env["JAX_PLATFORMS"] = "cpu"
    return env


def index_variables(host_index: int) -> dict[str, str]:
    """The variables that say which host this is."""
    return {"KINETIC_HOST_INDEX": str(host_index), "RANK": str(host_index), "JAX_PROCESS_ID": str(host_index)}


def host_environment(plan: JobPlan, host_index: int, job_uri: str, output_dir: str,
                     base: Mapping[str, str]) -> dict[str, str]:
    """The whole environment of host ``host_index`` when its launcher knows its index and the coordinator:
    ``base`` (which carries the job's key and the ``-e`` values, out of band), then :func:`job_variables`,
    :func:`index_variables` and the coordinator; the ``-e`` values win, as the user set them."""
    env = {**base, **job_variables(plan, job_uri, output_dir), **index_variables(host_index),
           "MASTER_ADDR": plan.coordinator_host, "JAX_COORDINATOR_ADDRESS": plan.coordinator_address}
    if plan.simulated:
        xla_flags = base.get("XLA_FLAGS", "")
        env["XLA_FLAGS"] = f"{xla_flags} --xla_force_host_platform_device_count={plan.devices_per_host}".strip()
    env.update({name: base[name] for name in plan.env_names if name in base})
    return env
