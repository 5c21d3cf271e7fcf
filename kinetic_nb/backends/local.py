"""The ``local`` backend: a job's hosts are processes on this machine.

``launch`` starts one detached host agent per job (``python -m
kinetic_nb.agent --all-hosts``) that forks and supervises every host; from
the second job on, the notebook's warm agent forks it, past its imports
(``backends.warm_agent``);
everything else goes through storage, so a kernel restart, an interrupt or a
second kernel sees the same job. The agent's own log and record live in a
per-user directory outside the job's storage, so a client can still tell why
the agent died or could not write the job.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

from kinetic_nb.agent.local_state import AgentState
from kinetic_nb.agent.processes import host_count_problem, process_start
from kinetic_nb.backends.base import Backend, BackendFlag, JobSecrets, PlatformView, register
from kinetic_nb.backends.warm_agent import launch_warm, warm_agent_wanted
from kinetic_nb.runner import protocol
from kinetic_nb.runner.channel_link import Address
from kinetic_nb.runner.frameworks import on_real_gpus
from kinetic_nb.runner.gpus import machine_gpus, visible_gpus
from kinetic_nb.runner.logs import last_lines
from kinetic_nb.runner.protocol import ExitSummary, JobPlan
from kinetic_nb.runner.records import recorded_success
from kinetic_nb.storage import ObjectInfo, Storage
from kinetic_nb.storage.defaults import user_directory

logger = logging.getLogger(__name__)

#: An agent that has not written its record this long after the job was
#: stored never started (an import error, a missing interpreter): its log says why.
AGENT_START_TIMEOUT_S = 15.0
#: Lines of a dead agent's log quoted in the error.
AGENT_LOG_LINES = 8


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def platform_problem(platform: str) -> str:
    """Why the local backend cannot run hosts on ``platform`` (``sys.platform``), or "".

    The host agent needs Linux: it reads ``/proc`` to find its hosts and their
    descendants, and uses ``prctl`` so that nothing outlives it. Elsewhere it
    could neither stop what a cell starts nor tell a dead agent from a live one.
    """
    if platform.startswith("linux"):
        return ""
    return (f"the local backend runs hosts on Linux only (its agent uses /proc and prctl), not {platform}: "
            "run the notebook in a Linux container or VM, or use -b ray or -b kubernetes")


def agent_files(job_id: str) -> tuple[str, str]:
    """The paths of a local job's agent log and agent record (per user, outside the job's storage)."""
    directory = user_directory("agents")
    return str(directory / f"{job_id}.log"), str(directory / f"{job_id}.json")


def _alive(state: AgentState, job_id: str) -> bool:
    """Whether the agent ``state`` names still runs: its pid, started when it says (a reused pid runs something
    else); for a record without its start, its command line naming the job."""
    if state.process_start is not None:
        return process_start(state.pid) == state.process_start
    try:
        with open(f"/proc/{state.pid}/cmdline", "rb") as cmdline:
            return job_id.encode() in cmdline.read()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel whether the pid exists at all
        try:
            os.kill(state.pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True


def gpu_shortfall(plan: JobPlan, gpus: list[str]) -> str:
    """Why this machine cannot run ``plan``'s GPU slice on its own ``gpus`` (model names), or ""."""
    wanted = plan.hosts * plan.devices_per_host
    if len(gpus) >= wanted:
        return ""
    models = ", ".join(sorted(set(gpus)))
    return (f"{plan.accelerator} x {plan.hosts} host{'s' if plan.hosts != 1 else ''} needs {wanted} GPU"
            f"{'s' if wanted != 1 else ''}; this machine shows {len(gpus)} ({models}): choose a smaller -a or -n, "
            "or --simulate to run the slice on CPU")


@register
class LocalBackend(Backend):
    """Every host a process on this machine: a GPU slice on this machine's GPUs where it has them, every other
    accelerator (and a GPU slice with ``simulate``, or on a machine without GPUs) simulated with CPU devices."""

    name = "local"
    summary = "processes on this machine (simulated on CPU; -a gpu-... on its GPUs where it has them)"
    simulates_accelerators = True
    hosts_beside_the_notebook = True
    flags = (
        BackendFlag("--simulate", "simulate", "Run a gpu-... slice on CPU devices (gloo) even where this machine "
                    "has GPUs.", switch=True),
    )

    def __init__(self, *, simulate: bool = False) -> None:
        #: Run GPU slices on CPU even where this machine has GPUs.
        self.simulate = bool(simulate)
        #: Each job's launcher until it exits (``--detach``: as soon as the agent has written its record).
        self._agents: dict[str, subprocess.Popen] = {}
        self._launcher_codes: dict[str, int] = {}

    @classmethod
    def from_options(cls, *, simulate: bool | None = None, config: Mapping[str, Any] | None = None,
                     **options: Any) -> LocalBackend:
        if options:
            raise ValueError(f"the local backend takes simulate, got {', '.join(sorted(options))}")
        return cls(simulate=bool(simulate))

    def options(self) -> dict[str, object]:
        return {"simulate": True} if self.simulate else {}

    def simulates(self, acc: Any) -> bool:
        """A GPU slice runs on this machine's GPUs when it has any (counted without CUDA: ``runner.gpus``) and
        ``simulate`` is off; every other slice on CPU devices."""
        return self.simulate or acc.kind != "gpu" or not visible_gpus(os.environ)

    def preflight(self, plan: JobPlan) -> None:
        problem = platform_problem(sys.platform) or host_count_problem(plan.world_size, plan.framework)
        if not problem and on_real_gpus(plan):
            problem = gpu_shortfall(plan, _named(visible_gpus(os.environ), machine_gpus()))
        if problem:
            raise ValueError(problem)
        warm_agent_wanted()  # a KINETIC_WARM_AGENT it cannot read is said before anything is stored

    def launch_notices(self, plan: JobPlan) -> list[str]:
        if not on_real_gpus(plan):
            return []
        gpus = _named(visible_gpus(os.environ), machine_gpus())
        return [f"{plan.accelerator} runs on this machine's GPUs: {plan.hosts} host{'s' if plan.hosts != 1 else ''}"
                f" x {plan.devices_per_host} of {len(gpus)} ({', '.join(sorted(set(gpus)))}), {plan.world_size} "
                f"process{'es' if plan.world_size != 1 else ''} (--simulate runs it on CPU)"]

    def coordinator_address(self, job_id: str) -> str:
        return f"127.0.0.1:{_free_port()}"

    def forget(self, job_id: str) -> None:
        for path in agent_files(job_id):  # kept past the job's outcome, for its last words; gc ends them
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def launch(self, storage: Storage, plan: JobPlan, secrets: JobSecrets) -> None:
        log_path, state_path = agent_files(plan.job_id)
        arguments = ["--job", storage.uri, "--all-hosts", "--key-stdin", "--log", log_path, "--state", state_path]
        # -e values: never on a command line; the key: never in an environment, where /proc/PID/environ shows it.
        if launch_warm(arguments, {**os.environ, **secrets.env}, secrets.key.hex(), log_path):
            return  # this notebook's warm agent forked the job's agent, past its imports
        log = open(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab")  # noqa: SIM115
        try:
            launcher = self._agents[plan.job_id] = subprocess.Popen(
                [sys.executable, "-m", "kinetic_nb.agent", *arguments, "--detach"],
                env={**os.environ, **secrets.env},  # -e values: never on a command line
                stdin=subprocess.PIPE,  # the key: never in an environment, where /proc/PID/environ shows it
                stdout=log,
                stderr=log,
                start_new_session=True,  # not in the kernel's process group: an interrupt must not reach it
                close_fds=True,
                cwd=os.getcwd(),
            )
            try:
                launcher.stdin.write(secrets.key.hex().encode() + b"\n")
                launcher.stdin.close()
            except BrokenPipeError:  # it died before reading the key: the poller reports its death and log
                logger.info("the agent of %s ended before it read its key", plan.job_id)
        finally:
            log.close()
        # The launcher exits once the agent has written its record: reap it then, whether or not anyone polls.
        threading.Thread(target=launcher.wait, name=f"kinetic-launcher-{plan.job_id}", daemon=True).start()

    def observe(self, storage: Storage, plan: JobPlan, listing: list[ObjectInfo],
                recorded: Mapping[int, ExitSummary], key: bytes | None) -> PlatformView:
        """A dead agent's hosts as ended (with the tail of its log), and its storage error."""
        if len(recorded) >= plan.world_size:
            self._launcher_code(plan.job_id)  # reap the launcher
            return PlatformView()
        log_path, state_path = agent_files(plan.job_id)
        state = AgentState.read(state_path)
        died = self._agent_death(plan, state)
        if died is None:
            problem = f"the job's agent met a storage error: {state.storage_error}" if state and state.storage_error else ""
            return PlatformView(problem=problem)
        tail = tuple(_log_tail(log_path))
        reason = f"{died}; its log: {log_path}"
        # Looked up one by one: an exit record may have landed after the poll's listing.
        missing = [index for index in range(plan.world_size)
                   if index not in recorded and not storage.exists(protocol.host_exit(index))]
        exits = {index: ExitSummary(index, None, recorded_success=recorded_success(storage, key, index),
                                    ended_at=time.time(), reason=reason, stderr_tail=tail,
                                    storage_error=state.storage_error if state else "")
                 for index in missing}
        return PlatformView(exits=exits, problem=reason if exits else "")

    def _launcher_code(self, job_id: str) -> int | None:
        """The launcher's exit code once it has exited (then it is reaped and forgotten), else None."""
        launcher = self._agents.get(job_id)
        if launcher is None or launcher.poll() is None:
            return None
        del self._agents[job_id]
        self._launcher_codes[job_id] = launcher.returncode
        return launcher.returncode

    def channel_route(self, plan: JobPlan, announced: Address) -> Address | None:
        """The hub is a Unix socket on this machine, in the session's 0700 directory: reached at its path."""
        return announced

    def cancel(self, storage: Storage, plan: JobPlan, reason: str, key: bytes | None) -> None:
        """The cancel record, and to a session's agent on this machine a SIGTERM, which stops its hosts at once
        as on a pod's deletion (an idle session's agent lists its control records only every few seconds)."""
        try:
            super().cancel(storage, plan, reason, key)
        finally:  # a bucket that does not answer: the agent on this machine is stopped all the same
            state = AgentState.read(agent_files(plan.job_id)[1]) if plan.session else None
            if state is not None and _alive(state, plan.job_id):
                with contextlib.suppress(OSError):
                    os.kill(state.pid, signal.SIGTERM)

    def agent_gone(self, job_id: str) -> bool | None:
        """Whether the job's agent process has ended (by its record's pid and start time)."""
        state = AgentState.read(agent_files(job_id)[1])
        return state is None or not _alive(state, job_id)

    def _agent_death(self, plan: JobPlan, state: AgentState | None) -> str | None:
        """Why the job's agent is gone while hosts have no exit record, or None while it lives."""
        code = self._launcher_code(plan.job_id)
        if code is None:
            code = self._launcher_codes.get(plan.job_id)
        if state is None:
            if code:  # it died before it wrote its record
                return f"the job's agent exited with code {code} before it started any host"
            state = AgentState.read(agent_files(plan.job_id)[1])  # it may have written it meanwhile
        if state is not None:
            if state.finished:
                return "the job's agent ended without recording how this host ended"
            if _alive(state, plan.job_id):
                return None
            return f"the job's agent (pid {state.pid}) died"
        if time.time() - (plan.created_at or time.time()) > AGENT_START_TIMEOUT_S:
            return f"the job's agent never started ({AGENT_START_TIMEOUT_S:g} s after the job was stored)"
        return None

def _named(visible: list[str], machine: list[str]) -> list[str]:
    """The model names of the ``visible`` GPUs (``CUDA_VISIBLE_DEVICES`` entries: indices, or UUIDs that
    name a GPU of ``machine`` by no index)."""
    return [machine[int(entry)] if entry.isdigit() and int(entry) < len(machine) else "NVIDIA GPU"
            for entry in visible]


def _log_tail(path: str) -> list[str]:
    try:
        with open(path, "rb") as log:
            log.seek(max(0, os.path.getsize(path) - 16384))
            return last_lines(log.read().decode(errors="replace"), AGENT_LOG_LINES)
    except OSError:
        return []

