"""The ``local`` backend: a job's hosts are processes on this machine.

``launch`` starts one detached supervisor per job (see
``local_supervisor``); everything else goes through storage, so a kernel
restart, an interrupt or a second kernel sees the same job.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time

from kinetic_nb.backends.base import Backend
from kinetic_nb.errors import ObjectNotFoundError
from kinetic_nb.runner import protocol
from kinetic_nb.runner.protocol import ExitSummary, JobPlan
from kinetic_nb.storage import ObjectInfo, Storage

#: The supervisor's own messages go here, in the job's directory when it has one.
SUPERVISOR_LOG = "supervisor.log"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class LocalBackend(Backend):
    name = "local"

    def coordinator_address(self, job_id: str) -> str:
        return f"127.0.0.1:{_free_port()}"

    def launch(self, storage: Storage, plan: JobPlan) -> None:
        # Beside the job when it is local; else in the temporary directory, so a
        # supervisor that cannot even read the plan still says why somewhere.
        log_path = storage.local_path(SUPERVISOR_LOG) or os.path.join(
            tempfile.gettempdir(), f"kinetic-{plan.job_id}-{SUPERVISOR_LOG}")
        log = open(log_path, "ab")  # noqa: SIM115 - handed to the child, closed below
        try:
            subprocess.Popen(
                [sys.executable, "-m", "kinetic_nb.backends.local_supervisor", "--job", storage.uri,
                 "--log", log_path],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,  # not in the kernel's process group: an interrupt must not reach it
                close_fds=True,
                cwd=os.getcwd(),
            )
        finally:
            log.close()

    def cancel(self, storage: Storage, plan: JobPlan, reason: str) -> None:
        storage.write_bytes(protocol.CANCEL, json.dumps({"reason": reason, "at": time.time()}).encode())

    def exit_summaries(self, storage: Storage, plan: JobPlan, listing: list[ObjectInfo]) -> dict[int, ExitSummary]:
        summaries = {}
        for info in listing:
            parsed = protocol.parse_host_object(info.name)
            if parsed is None or parsed[1] != "exit":
                continue
            try:
                summaries[parsed[0]] = ExitSummary.from_json(storage.read_bytes(info.name))
            except ObjectNotFoundError:
                continue
        return summaries
