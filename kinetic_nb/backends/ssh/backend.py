"""The ``ssh`` backend: each host a machine reached with the user's own OpenSSH setup, host 0 first.

Before anything of a job is stored, every host is connected at once
(:mod:`connections`: one control master each, reused by every command) and
asked what it is (:mod:`probe`: its Python against the notebook's, a free port
on host 0 for the framework's coordinator and one for a session's hub). The
launch stores the notebook's own kinetic_nb wheel (and ``--requirements``)
signed with the job, checks that every host sees a ``file://`` root, then on
each host, at once, runs the standard-library bootstrap (the GKE prebuilt
mode's: it verifies what it installs), which keeps the environment under
``~/.cache/kinetic_nb/environments/`` by its content and reuses it for the next
job with the same wheel and requirements, and starts the same host agent as
every backend, detached from the ssh session (a dropped connection does not
end a cell). The job's key and every variable (the ``-e`` values among them)
reach the agent on the ssh channel's standard input, never on a command line
or in a file. From there on everything goes through storage, as on any
backend: the agents end their hosts by the plan's rules with or without the
notebook, and a host whose machine is gone is lost by its heartbeat.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import subprocess
from collections.abc import Mapping
from typing import Any

from kinetic_nb.backends.base import Backend, BackendFlag, JobSecrets, PlatformView, register
from kinetic_nb.backends.kubernetes.image_modes import bootstrap_source, store_environment
from kinetic_nb.backends.ssh.connections import Connections
from kinetic_nb.backends.ssh.probe import DEFAULT_PYTHON, HostFacts, probe_hosts
from kinetic_nb.errors import SshHostError
from kinetic_nb.runner.channel import CHANNEL_ENV
from kinetic_nb.runner.host_variables import job_variables
from kinetic_nb.runner.protocol import ExitSummary, JobPlan
from kinetic_nb.storage import ObjectInfo, Storage

logger = logging.getLogger(__name__)

#: Where a host keeps the environments it installed, one per content (the bootstrap's ``--environments``), under
#: its user's cache directory (``$XDG_CACHE_HOME``, else ``~/.cache``).
ENVIRONMENTS_DIR = "kinetic_nb/environments"
#: Where a host's agent writes its own output (``--output``), there too: what it said before the job's records.
AGENT_LOGS_DIR = "kinetic_nb/agents"
#: The hosts, the ssh config and the hosts' Python when no flag names them.
HOSTS_ENV = "KINETIC_SSH_HOSTS"
CONFIG_ENV = "KINETIC_SSH_CONFIG"
PYTHON_ENV = "KINETIC_SSH_PYTHON"
#: Variables of the notebook's environment a host's agent gets too: how the hosts reach the job's storage.
PASSED_ON = ("STORAGE_EMULATOR_HOST",)
#: How long one host's environment install and agent start may take (pip may download).
START_TIMEOUT_S = 900


def parse_hosts(text: str) -> list[str]:
    """``h0,h1`` (or a file naming one host per line, ``#`` comments allowed): the hosts, host 0 first."""
    if os.path.isfile(os.path.expanduser(text)):
        with open(os.path.expanduser(text)) as file:
            lines = [line.split("#", 1)[0].strip() for line in file]
        return [line for line in lines if line]
    return [part.strip() for part in text.split(",") if part.strip()]


def ssh_address(target: str, config: str | None) -> str:
    """The address ``ssh target`` connects to, as the user's config resolves it (``ssh -G``): what the other
    hosts use to reach host 0."""
    command = ["ssh", *(["-F", config] if config else []), "-G", target]
    resolved = subprocess.run(command, capture_output=True, text=True, timeout=30)
    for line in resolved.stdout.splitlines():
        name, _, value = line.partition(" ")
        if name == "hostname":
            return value.strip()
    return target.rsplit("@", 1)[-1]


@register
class SshBackend(Backend):
    """Hosts reached with ssh: plain machines, or the workers of a TPU VM slice."""

    name = "ssh"
    summary = "machines you reach with ssh, host 0 first (docs/ssh.md)"
    ships_workdir = True
    flags = (
        BackendFlag("--ssh-hosts", "ssh_hosts", "The hosts, host 0 first: H0,H1,... as your ssh config or "
                    f"user@address names them, or a file with one per line (default ${HOSTS_ENV}).",
                    metavar="HOSTS", setting=True),
        BackendFlag("--ssh-config", "ssh_config", "An ssh config file to use instead of ~/.ssh/config (default "
                    f"${CONFIG_ENV}).", metavar="FILE", setting=True),
        BackendFlag("--ssh-python", "ssh_python", "The hosts' Python, of the notebook's minor version (default "
                    f"${PYTHON_ENV}, then {DEFAULT_PYTHON}).", metavar="PATH", setting=True),
    )

    def __init__(self, targets: list[str], *, config: str | None = None, python: str = DEFAULT_PYTHON):
        if not targets:
            raise ValueError(f"-b ssh needs its hosts: --ssh-hosts H0,H1,... (host 0 first), a file naming one per "
                             f"line, or ${HOSTS_ENV}")
        self.targets = targets
        self.config = config
        self.python = python or DEFAULT_PYTHON
        #: Each job's connections and what its hosts said, from its coordinator's choice to its cleanup.
        self._jobs: dict[str, tuple[Connections, list[HostFacts]]] = {}

    @classmethod
    def from_options(cls, *, ssh_hosts: str | None = None, ssh_config: str | None = None,
                     ssh_python: str | None = None, config: Mapping[str, Any] | None = None,
                     **options: Any) -> SshBackend:
        if options:
            raise ValueError(f"the ssh backend takes ssh_hosts, ssh_config and ssh_python, got "
                             f"{', '.join(sorted(options))}")
        config = dict(config or {})
        hosts = ssh_hosts or os.environ.get(HOSTS_ENV) or config.get("ssh_hosts") or ""
        return cls(parse_hosts(hosts), config=ssh_config or os.environ.get(CONFIG_ENV) or config.get("ssh_config"),
                   python=ssh_python or os.environ.get(PYTHON_ENV) or config.get("ssh_python") or DEFAULT_PYTHON)

    def options(self) -> dict[str, object]:
        stored: dict[str, object] = {"ssh_hosts": ",".join(self.targets)}
        if self.config:
            stored["ssh_config"] = self.config
        if self.python != DEFAULT_PYTHON:
            stored["ssh_python"] = self.python
        return stored

    def default_hosts(self) -> int | None:
        return len(self.targets)

    # -- before anything is stored ----------------------------------------------------------------

    def coordinator_address(self, job_id: str) -> str:
        """Host 0's address and a port free there; connecting to every host and asking each what it is
        (``SshHostError`` in one line for one that cannot run the job)."""
        facts = self._connect(job_id)[1]
        return f"{ssh_address(self.targets[0], self.config)}:{facts[0].ports[0]}"

    def _connect(self, job_id: str) -> tuple[Connections, list[HostFacts]]:
        if job_id not in self._jobs:
            connections = Connections(self.targets, config=self.config)
            connections.open()
            try:
                facts = probe_hosts(connections, python=self.python)
            except BaseException:
                connections.close()
                raise
            self._jobs[job_id] = (connections, facts)
        return self._jobs[job_id]

    def preflight(self, plan: JobPlan) -> None:
        if plan.hosts != len(self.targets):
            self._close(plan.job_id)
            raise ValueError(f"{plan.hosts} hosts do not match the {len(self.targets)} that --ssh-hosts names")

    # -- starting the hosts -----------------------------------------------------------------------

    def launch(self, storage: Storage, plan: JobPlan, secrets: JobSecrets) -> None:
        try:
            self._launch(storage, plan, secrets)
        except BaseException as error:
            # The agents that did start stop at once (not at their start barrier's timeout), and nothing of the
            # job's is kept open here.
            with contextlib.suppress(Exception):
                self.cancel(storage, plan, f"not every host's agent started: {error}", secrets.key)
            self._close(plan.job_id)
            raise

    def _launch(self, storage: Storage, plan: JobPlan, secrets: JobSecrets) -> None:
        connections, facts = self._connect(plan.job_id)
        path = storage.local_path()
        if path is not None:  # a file:// root: every host must see it, as it is (one line for one that does not)
            probe_hosts(connections, python=self.python, storage_path=path, ports=0)
        store_environment(storage, secrets.key, requirements=None)
        host0 = ssh_address(self.targets[0], self.config)
        common = {**job_variables(plan, storage.uri, ""), **secrets.env,
                  **{name: os.environ[name] for name in PASSED_ON if name in os.environ},
                  "MASTER_ADDR": host0, "KINETIC_COORDINATOR_ADDRESS": plan.coordinator_address,
                  "JAX_COORDINATOR_ADDRESS": plan.coordinator_address}
        if plan.session and path is None:  # a session on a bucket: its hub beside host 0's agent
            common[CHANNEL_ENV] = f"{host0}:{facts[0].ports[1]}"
        bootstrap = bootstrap_source()

        def command(index: int) -> str:
            passed = {name: common[name] for name in ("KINETIC_JOB_URI", *PASSED_ON) if name in common}
            agent = ["python", "-m", "kinetic_nb.agent", "--job", storage.uri, "--key-stdin", "--env-stdin", "--detach"]
            argv = [self.python, "-c", bootstrap, "--key-stdin", "--once", "--environments", ENVIRONMENTS_DIR,
                    "--output", f"{AGENT_LOGS_DIR}/{plan.job_id}-{index}.log", "--", *agent]
            return shlex.join(["env", *(f"{name}={value}" for name, value in passed.items()),
                               f"KINETIC_HOST_INDEX={index}", *argv])

        inputs = {index: (secrets.key.hex() + "\n" + json.dumps({**common, "KINETIC_HOST_INDEX": str(index)})
                          + "\n").encode() for index in range(plan.hosts)}
        started = connections.run_each(command, input_for=inputs.get, timeout=START_TIMEOUT_S)
        for host, done in zip(connections.hosts, started, strict=True):
            if done.returncode != 0:
                said = [line for line in done.stderr.decode(errors="replace").splitlines() if line.strip()]
                raise SshHostError(f"{host}: its agent did not start: {said[-1] if said else 'no message'}")

    def observe(self, storage: Storage, plan: JobPlan, listing: list[ObjectInfo],
                recorded: Mapping[int, ExitSummary], key: bytes | None) -> PlatformView:
        """Nothing beyond the records: each host's agent records its processes' ends, and a host whose machine
        or agent is gone is lost by its heartbeat."""
        return PlatformView()

    def cleanup(self, plan: JobPlan) -> None:
        """Close the job's connections (the agents run on without them)."""
        self._close(plan.job_id)

    def close(self) -> None:
        """Close every connection this backend holds (jobs whose cleanup never came: a launch that failed)."""
        for job_id in list(self._jobs):
            self._close(job_id)

    def _close(self, job_id: str) -> None:
        job = self._jobs.pop(job_id, None)
        if job is not None:
            job[0].close()

    def channel_route(self, plan: JobPlan, announced: tuple[str, int]) -> tuple[str, int] | None:
        """Host 0's hub, at the address it announced (the notebook on the hosts' network, or a tunnel the user
        keeps)."""
        return announced

