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
#: A process's global rank, set by the agent that starts it (a host that runs several processes: the host's
#: own index, from the platform, no longer names it); it outranks the host's index.
RANK_VARIABLE = "KINETIC_RANK"


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


def resolve_rank(environ: Mapping[str, str]) -> int | None:
    """This process's global rank: :data:`RANK_VARIABLE` where its agent set it, else its host's index (one
    process per host), else None (see :func:`resolve_host_index`)."""
    raw = environ.get(RANK_VARIABLE, "").strip()
    if raw.isdigit():
        return int(raw)
    if raw:
        logger.warning("ignoring %s=%r: not a non-negative integer", RANK_VARIABLE, raw)
    return resolve_host_index(environ)


def job_variables(plan: JobPlan, job_uri: str, output_dir: str) -> dict[str, str]:
    """The variables every process of the job gets alike: kinetic's, torch's and JAX's, less its rank.

    The one place they are named, for every launcher: the agent adds
    :func:`index_variables` for each process it starts.
    """
    env = {
        "KINETIC_JOB_ID": plan.job_id,
        "KINETIC_JOB_URI": job_uri,
        "KINETIC_NUM_HOSTS": str(plan.hosts),
        "KINETIC_OUTPUT_DIR": output_dir,
        "WORLD_SIZE": str(plan.world_size),
        "LOCAL_WORLD_SIZE": str(plan.procs_per_host),
        "NUM_NODES": str(plan.hosts),
        "MASTER_PORT": str(plan.coordinator_port),
        "JAX_NUM_PROCESSES": str(plan.world_size),
        "PYTHONUNBUFFERED": "1",
    }
    if plan.simulated:  # CPU devices in place of the accelerator's chips
        env["JAX_PLATFORMS"] = "cpu"
    return env


def index_variables(plan: JobPlan, rank: int) -> dict[str, str]:
    """The variables that say which process this is, as torchrun names them (``GROUP_RANK``/``NODE_RANK``: its
    host), and JAX."""
    host, local = str(plan.host_of(rank)), str(rank % plan.procs_per_host)
    return {"KINETIC_HOST_INDEX": host, RANK_VARIABLE: str(rank), "RANK": str(rank), "LOCAL_RANK": local,
            "GROUP_RANK": host, "NODE_RANK": host, "JAX_PROCESS_ID": str(rank)}


def host_environment(plan: JobPlan, rank: int, job_uri: str, output_dir: str,
                     base: Mapping[str, str]) -> dict[str, str]:
    """The whole environment of process ``rank`` when its launcher knows the coordinator (the local backend):
    ``base`` (which carries the ``-e`` values, out of band), then :func:`job_variables`, :func:`index_variables`
    and the coordinator; the ``-e`` values win, as the user set them."""
    env = {**base, **job_variables(plan, job_uri, output_dir), **index_variables(plan, rank),
           "MASTER_ADDR": plan.coordinator_host, "JAX_COORDINATOR_ADDRESS": plan.coordinator_address}
    if plan.simulated:  # the host's devices, shared among its processes
        xla_flags = base.get("XLA_FLAGS", "")
        devices = max(1, plan.devices_per_host // plan.procs_per_host)
        env["XLA_FLAGS"] = f"{xla_flags} --xla_force_host_platform_device_count={devices}".strip()
    env.update({name: base[name] for name in plan.env_names if name in base})
    return env


def process_environment(plan: JobPlan, rank: int, output_dir: str, base: Mapping[str, str]) -> dict[str, str]:
    """Process ``rank``'s environment where its host's came from the platform (a pod's, a Ray actor's): ``base``
    with its own rank's variables, the ``-e`` values still winning."""
    env = {**base, **index_variables(plan, rank), "KINETIC_OUTPUT_DIR": output_dir}
    env.update({name: base[name] for name in plan.env_names if name in base})
    return env
