"""The ``ssh`` backend: each host a machine reached with the user's own OpenSSH setup, host 0 first.

Before anything of a job is stored, every host is connected at once
(:mod:`connections`: one control master each, reused by every command) and
asked what it is (:mod:`probe`: its Python against the notebook's, a free port
on host 0 for the framework's coordinator and one for a session's hub). The
launch checks that every host sees a ``file://`` root, then starts each host's
agent, detached from the ssh session (a dropped connection does not end a
cell), one of two ways:

- the first job on a set of hosts, or one whose environment changed, stores the
  notebook's own kinetic_nb wheel and ``--requirements`` signed with the job and
  runs the standard-library bootstrap (GKE prebuilt mode's: it verifies what it
  installs) on every host at once; it keeps the environment under
  ``~/.cache/kinetic_nb/environments/``, in a folder of the host's interpreter
  (its version, resolved path and prefix) by its content, reused while the
  interpreter, the wheel and the requirements are the same;
- every later job asks each host's warm agent in that environment (:mod:`pool`:
  what a notebook keeps open to its hosts between jobs) to fork the job's agent,
  past its imports: a line over a connection already open.

The job's key and every variable (the ``-e`` values among them) reach the agent
on the ssh channel's standard input, never on a command line or in a file.
From there on everything goes through storage, as on any backend: the agents
end their hosts by the plan's rules with or without the notebook, and a host
whose machine is gone is lost by its heartbeat.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shlex
import subprocess
from collections.abc import Mapping
from typing import Any

from kinetic_nb.agent.bootstrap import PREFIX as INSTALL_OUTPUT_PREFIX
from kinetic_nb.backends.base import Backend, BackendFlag, JobSecrets, PlatformView, register
from kinetic_nb.backends.host_environment import bootstrap_source, install_record, package_wheel, store_environment
from kinetic_nb.backends.requirements import host_requirements
from kinetic_nb.backends.ssh.pool import HostPool, close_pool, pool_for, release_pool
from kinetic_nb.backends.ssh.probe import DEFAULT_PYTHON
from kinetic_nb.errors import SshHostError
from kinetic_nb.runner.channel import CHANNEL_ENV
from kinetic_nb.runner.host_variables import job_variables
from kinetic_nb.runner.protocol import ExitSummary, JobPlan
from kinetic_nb.storage import ObjectInfo, Storage

logger = logging.getLogger(__name__)

#: Where a host's agent writes its own output (``--output``), there too: what it said before the job's records.
AGENT_LOGS_DIR = "kinetic_nb/agents"
#: The hosts, the ssh config and the hosts' Python when no flag names them.
HOSTS_ENV = "KINETIC_SSH_HOSTS"
CONFIG_ENV = "KINETIC_SSH_CONFIG"
PYTHON_ENV = "KINETIC_SSH_PYTHON"
#: The requirements file when no flag names it (as on GKE).
REQUIREMENTS_ENV = "KINETIC_REQUIREMENTS"
#: Variables of the notebook's environment a host's agent gets too: how the hosts reach the job's storage.
PASSED_ON = ("STORAGE_EMULATOR_HOST",)
#: How long one host's environment install and agent start may take (pip may download).
START_TIMEOUT_S = 900
#: How the bootstrap ends a failed install command's line: its output went to a pod's log (GKE); over ssh it
#: came back on the session's standard output, its lines marked with ``INSTALL_OUTPUT_PREFIX``.
OUTPUT_POINTER = " (its output is above)"
#: How many of a failed install's own lines its error carries: pip's last ``ERROR:`` lines say why.
INSTALL_ERROR_LINES = 3
#: Each of them at most this long (a requirement's URL, a resolver's conflict), so the error stays readable.
MAX_ERROR_LINE_CHARS = 300


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


#: The flags -b ssh and -b tpu-vm share.
SSH_CONFIG_FLAG = BackendFlag("--ssh-config", "ssh_config", "An ssh config file to use instead of ~/.ssh/config "
                              f"(default ${CONFIG_ENV}).", metavar="FILE", setting=True)
SSH_PYTHON_FLAG = BackendFlag("--ssh-python", "ssh_python", "The hosts' Python, of the notebook's minor version "
                              f"(default ${PYTHON_ENV}, then {DEFAULT_PYTHON}).", metavar="PATH", setting=True)
REQUIREMENTS_FLAG = BackendFlag("--requirements", "requirements", "A pip requirements file the hosts install, e.g. "
                                f"jax[tpu] (default ${REQUIREMENTS_ENV}).", metavar="FILE", setting=True)


@register
class SshBackend(Backend):
    """Hosts reached with ssh: plain machines (and, as :class:`~kinetic_nb.backends.ssh.tpu_vm.TpuVmBackend`,
    the workers of a Cloud TPU VM slice)."""

    name = "ssh"
    summary = "machines you reach with ssh, host 0 first (docs/ssh.md)"
    named_by = ("KINETIC_SSH_HOSTS",)
    ships_workdir = True
    flags = (
        BackendFlag("--ssh-hosts", "ssh_hosts", "The hosts, host 0 first: H0,H1,... as your ssh config or "
                    f"user@address names them, or a file with one per line (default ${HOSTS_ENV}).",
                    metavar="HOSTS", setting=True),
        SSH_CONFIG_FLAG, SSH_PYTHON_FLAG, REQUIREMENTS_FLAG,
    )

    def __init__(self, targets: list[str], *, config: str | None = None, python: str = DEFAULT_PYTHON,
                 requirements: str | None = None):
        if not targets:
            raise ValueError(f"-b ssh needs its hosts: --ssh-hosts H0,H1,... (host 0 first), a file naming one per "
                             f"line, or ${HOSTS_ENV}")
        self._targets = list(targets)
        self._settings(config, python, requirements)

    def _settings(self, config: str | None, python: str, requirements: str | None) -> None:
        """What every ssh-reached backend keeps: the ssh config, the hosts' Python, the requirements file."""
        self.config = config
        self.python = python or DEFAULT_PYTHON
        self.requirements = requirements
        #: Each job's pool and requirements, from its coordinator's choice to its launch's end.
        self._jobs: dict[str, HostPool] = {}
        self._requirements: dict[str, bytes | None] = {}
        self._host0: str | None = None
        #: What named the pool this backend last used (``pool_for``'s arguments), once it used one: what
        #: ``release`` closes, without reading the hosts again (a TPU VM's from the Cloud TPU API).
        self._pool_settings: dict[str, Any] | None = None

    @property
    def targets(self) -> list[str]:
        """The hosts as ssh is given them, host 0 first."""
        return self._targets

    def ssh_options(self) -> tuple[str, ...]:
        """More ``-o`` options for every connection (a TPU VM's key and known hosts)."""
        return ()

    def host_options(self) -> tuple[tuple[str, ...], ...]:
        """Each host's own ``-o`` options (a TPU VM worker's host key alias)."""
        return ()

    @classmethod
    def from_options(cls, *, ssh_hosts: str | None = None, ssh_config: str | None = None,
                     ssh_python: str | None = None, requirements: str | None = None,
                     config: Mapping[str, Any] | None = None, **options: Any) -> SshBackend:
        if options:
            raise ValueError(f"the ssh backend takes ssh_hosts, ssh_config, ssh_python and requirements, got "
                             f"{', '.join(sorted(options))}")
        config = dict(config or {})
        hosts = ssh_hosts or os.environ.get(HOSTS_ENV) or config.get("ssh_hosts") or ""
        return cls(parse_hosts(hosts), **ssh_settings(ssh_config, ssh_python, requirements, config))

    def options(self) -> dict[str, object]:
        stored: dict[str, object] = {"ssh_hosts": ",".join(self.targets)}
        return {**stored, **self._ssh_options()}

    def _ssh_options(self) -> dict[str, object]:
        stored: dict[str, object] = {}
        if self.config:
            stored["ssh_config"] = self.config
        if self.python != DEFAULT_PYTHON:
            stored["ssh_python"] = self.python
        if self.requirements:
            stored["requirements"] = self.requirements
        return stored

    def default_hosts(self) -> int | None:
        return len(self.targets)

    # -- before anything is stored ----------------------------------------------------------------

    def coordinator_address(self, job_id: str) -> str:
        """Host 0's address and a port free there; connecting to every host (or finding them connected) and
        asking each what it is (``SshHostError`` in one line for one that cannot run the job)."""
        pool = self._jobs.get(job_id) or self._pool()
        self._jobs[job_id] = pool
        with pool.lock:
            return f"{self._host0_of(pool)}:{pool.host0_ports()[0]}"

    def _pool(self) -> HostPool:
        self._pool_settings = {"targets": self.targets, "config": self.config, "python": self.python,
                               "options": self.ssh_options(), "host_options": self.host_options()}
        return pool_for(**self._pool_settings, hint=self.connection_hint)

    def connection_hint(self, problem: str) -> str:
        """What to do about a host that cannot be reached (``problem``, one line): ssh's own advice here."""
        return problem

    def host0_address(self) -> str:
        """The address the other hosts reach host 0 at: the one ``ssh`` connects to, as the user's config
        resolves it."""
        if self._host0 is None:
            self._host0 = ssh_address(self.targets[0], self.config)
        return self._host0

    def _host0_of(self, pool: HostPool) -> str:
        """:meth:`host0_address`, resolved once for as long as ``pool`` keeps its connections (which the same
        config made)."""
        if pool.host0_address is None:
            pool.host0_address = self.host0_address()
        return pool.host0_address

    def preflight(self, plan: JobPlan) -> None:
        try:
            if plan.hosts != len(self.targets):
                raise ValueError(f"{plan.hosts} hosts do not match the {len(self.targets)} that "
                                 f"{self.hosts_named_by}")
            # Read and checked now: a line the hosts cannot satisfy is one line before anything is stored.
            self._requirements[plan.job_id] = self.host_requirements(plan)
        except BaseException:
            self._jobs.pop(plan.job_id, None)
            raise

    #: What names the hosts, for a count that does not match.
    hosts_named_by = "--ssh-hosts names"

    def host_requirements(self, plan: JobPlan) -> bytes | None:
        """What the hosts pip-install besides kinetic_nb: ``--requirements``, checked (None: nothing)."""
        return host_requirements(self.requirements) if self.requirements else None

    # -- starting the hosts -----------------------------------------------------------------------

    def launch(self, storage: Storage, plan: JobPlan, secrets: JobSecrets) -> None:
        pool = self._jobs.get(plan.job_id) or self._pool()
        try:
            with pool.lock:
                self._launch(pool, storage, plan, secrets)
        except BaseException as error:
            # The agents that did start stop at once (not at their start barrier's timeout), and the hosts'
            # connections are opened afresh for the next job.
            with contextlib.suppress(Exception):
                self.cancel(storage, plan, f"not every host's agent started: {error}", secrets.key)
            close_pool(pool)
            raise
        finally:
            self._jobs.pop(plan.job_id, None)
            self._requirements.pop(plan.job_id, None)
            pool.touch()

    def _launch(self, pool: HostPool, storage: Storage, plan: JobPlan, secrets: JobSecrets) -> None:
        path = storage.local_path()
        if path is not None:  # a file:// root: every host must see it, as it is (one line for one that does not)
            pool.check_shared(path)
        requirements = self._requirements.get(plan.job_id)
        wheel = package_wheel()
        digest = hashlib.sha256(install_record(storage.uri, requirements=requirements, wheel=wheel)[1]).hexdigest()
        host0 = self._host0_of(pool)
        common = {**job_variables(plan, storage.uri, ""), **secrets.env,
                  **{name: os.environ[name] for name in PASSED_ON if name in os.environ},
                  "MASTER_ADDR": host0, "KINETIC_COORDINATOR_ADDRESS": plan.coordinator_address,
                  "JAX_COORDINATOR_ADDRESS": plan.coordinator_address}
        if plan.session and path is None:  # a session on a bucket: its hub beside host 0's agent
            common[CHANNEL_ENV] = f"{host0}:{pool.host0_ports()[1]}"

        def variables(index: int) -> dict[str, str]:
            return {**common, "KINETIC_HOST_INDEX": str(index)}

        def log(index: int) -> str:
            return f"{AGENT_LOGS_DIR}/{plan.job_id}-{index}.log"

        left = pool.launch_warm(digest, lambda index: {
            "argv": ["--job", storage.uri, "--key-stdin"], "env": variables(index), "key": secrets.key.hex(),
            "log": log(index)})
        if not left:
            return
        store_environment(storage, secrets.key, requirements=requirements, wheel=wheel)
        bootstrap = bootstrap_source()

        def command(index: int) -> str:
            passed = {name: common[name] for name in ("KINETIC_JOB_URI", *PASSED_ON) if name in common}
            agent = ["python", "-m", "kinetic_nb.agent", "--job", storage.uri, "--key-stdin", "--env-stdin", "--detach"]
            argv = [self.python, "-c", bootstrap, "--key-stdin", "--once", "--environments", pool.environments(index),
                    "--output", log(index), *([] if requirements is not None else ["--no-requirements"]),
                    "--", *agent]
            return shlex.join(["env", *(f"{name}={value}" for name, value in passed.items()),
                               f"KINETIC_HOST_INDEX={index}", *argv])

        inputs = {index: (secrets.key.hex() + "\n" + json.dumps(variables(index)) + "\n").encode()
                  for index in left}
        started = pool.connections.run_each(command, input_for=inputs.get, timeout=START_TIMEOUT_S, only=left)
        for index, done in zip(left, started, strict=True):
            if done.returncode != 0:
                raise SshHostError(f"{pool.connections.hosts[index]}: its agent did not start: {why_not_started(done)}")
        pool.warm_up(digest)  # every host has this environment now: the next job's agents are forked there

    def observe(self, storage: Storage, plan: JobPlan, listing: list[ObjectInfo],
                recorded: Mapping[int, ExitSummary], key: bytes | None) -> PlatformView:
        """Nothing beyond the records: each host's agent records its processes' ends, and a host whose machine
        or agent is gone is lost by its heartbeat."""
        return PlatformView()

    def cleanup(self, plan: JobPlan) -> None:
        """Forget the job (its hosts' connections stay open for the next job, until they are idle)."""
        self._jobs.pop(plan.job_id, None)
        self._requirements.pop(plan.job_id, None)

    def release(self, plan: JobPlan) -> None:
        """Close the hosts' connections and warm agents now (a session stopped: they would stay until idle), where
        this backend opened them and no launch holds them; the jobs they started run on by storage."""
        if self._pool_settings is not None:
            try:
                release_pool(**self._pool_settings)
            except Exception:  # a hook that never raises: what is left closes when idle
                logger.warning("could not close the ssh connections to %s", ", ".join(self._pool_settings["targets"]),
                               exc_info=True)

    def channel_route(self, plan: JobPlan, announced: tuple[str, int]) -> tuple[str, int] | None:
        """Host 0's hub, at the address it announced (the notebook on the hosts' network, or a tunnel the user
        keeps)."""
        return announced


def why_not_started(done: subprocess.CompletedProcess) -> str:
    """What a host's bootstrap said when its agent did not start, in one line: its last line, and when a command
    of the install failed (pip), that command's own last error lines, which came back on standard output."""
    said = [line for line in done.stderr.decode(errors="replace").splitlines() if line.strip()]
    last = said[-1].strip() if said else "no message"
    if not last.endswith(OUTPUT_POINTER):
        return last
    return f"{last.removesuffix(OUTPUT_POINTER)}: {'; '.join(install_errors(done.stdout))}"


def install_errors(stdout: bytes) -> list[str]:
    """The last of pip's ``ERROR:`` lines (its reasons) among the install's output, else its last lines."""
    lines = [line.removeprefix(INSTALL_OUTPUT_PREFIX).strip() for line in stdout.decode(errors="replace").splitlines()
             if line.startswith(INSTALL_OUTPUT_PREFIX)]
    lines = [line for line in lines if line]
    reasons = [line for line in lines if line.startswith("ERROR:")] or lines
    return [line[:MAX_ERROR_LINE_CHARS] for line in reasons[-INSTALL_ERROR_LINES:]] or ["it printed nothing"]


def ssh_settings(ssh_config: str | None, ssh_python: str | None, requirements: str | None,
                 config: Mapping[str, Any]) -> dict[str, Any]:
    """The settings -b ssh and -b tpu-vm share, each from its flag, then its variable, then ``%config``."""
    return {"config": ssh_config or os.environ.get(CONFIG_ENV) or config.get("ssh_config"),
            "python": ssh_python or os.environ.get(PYTHON_ENV) or config.get("ssh_python") or DEFAULT_PYTHON,
            "requirements": requirements or os.environ.get(REQUIREMENTS_ENV) or config.get("requirements")}
