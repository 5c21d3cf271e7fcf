"""Which host this is, from the environment each platform sets."""

from __future__ import annotations

import logging
from collections.abc import Mapping

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
