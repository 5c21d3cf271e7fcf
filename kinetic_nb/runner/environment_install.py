"""What a pod's environment install (``kinetic_nb.agent.bootstrap``) leaves for its host: when, and what pip said.

The bootstrap runs before kinetic_nb exists in the pod, so it cannot write the
host's records itself. It leaves a small JSON record (its path in
:data:`RECORD_ENV`) and the install's output; the agent copies that output
into the host's log, each line marked with :data:`LOG_PREFIX` (the cell's echo
leaves such lines out, as it leaves framework chatter), and the runner puts
the install first in the host's phase history, so ``timeline()`` and the
panel show it as the ``environment install`` phase.

Host-safe: the standard library only.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Mapping

from kinetic_nb.agent.bootstrap import PREFIX as LOG_PREFIX
from kinetic_nb.agent.bootstrap import RECORD_ENV

logger = logging.getLogger(__name__)

__all__ = ["LOG_PREFIX", "RECORD_ENV", "EnvironmentInstall", "installed_environment"]
#: At most this much of the install's output is copied into the host's log (its end is kept).
MAX_LOG_BYTES = 256 * 1024


@dataclasses.dataclass(frozen=True)
class EnvironmentInstall:
    """When this pod's environment install ran (seconds since the epoch), and where its output is."""

    started_at: float
    ended_at: float
    log_path: str = ""

    def log_text(self) -> str:
        """The install's output, each line marked with :data:`LOG_PREFIX` (its last :data:`MAX_LOG_BYTES`)."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(max(0, os.fstat(log.fileno()).st_size - MAX_LOG_BYTES))
                text = log.read().decode(errors="replace")
        except OSError:
            return ""
        return "".join(f"{LOG_PREFIX}{line}\n" for line in text.splitlines())


def installed_environment(environ: Mapping[str, str] = os.environ) -> EnvironmentInstall | None:
    """The record of this pod's environment install, or None when there was none (or it cannot be read)."""
    path = environ.get(RECORD_ENV)
    if not path:
        return None
    try:
        with open(path) as file:
            record = json.load(file)
        return EnvironmentInstall(float(record["started_at"]), float(record["ended_at"]), str(record.get("log", "")))
    except (OSError, ValueError, KeyError, TypeError) as error:
        logger.warning("ignoring the environment install record %s: %s", path, error)
        return None
