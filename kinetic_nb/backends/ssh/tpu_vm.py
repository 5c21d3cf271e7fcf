"""``-b tpu-vm``: the workers of a Cloud TPU VM slice, in worker order, reached over ssh as ``-b ssh`` reaches hosts.

The slice is read from the Cloud TPU API (``GET
https://tpu.googleapis.com/v2/projects/P/locations/Z/nodes/NAME`` through
google-auth's ``AuthorizedSession``, with the notebook's Application Default
Credentials): its state, its accelerator (so ``-a`` is not needed) and its
network endpoints, worker 0 first. The accelerator is Cloud TPU's own naming,
always (``v4-32`` is 32 TensorCores, 4 workers, whatever keras-kinetic calls
it): its ``acceleratorType``, or its ``acceleratorConfig`` (type and
topology) for a node made with ``--type``/``--topology``, any generation and
size, its shape computed by ``accelerators.cloud_tpu_accelerator``. Each worker is reached at its internal
address when the notebook runs inside the slice's network (on one of its
workers, or where no worker has an external address), at its external one
otherwise; ``--tpu-addresses internal|external`` chooses. Whichever it is, the
workers meet at worker 0's internal address (the framework's coordinator, a
session's hub): from outside their network only ssh gets through Google
Cloud's default firewall, and a notebook outside reaches the hub through a
port forwarded over its ssh connection to worker 0.

The connection is the user's own ssh with gcloud's key
(``~/.ssh/google_compute_engine``, which ``gcloud compute tpus tpu-vm ssh``
makes and pushes to the workers) and gcloud's known-hosts file, each worker's
host key kept under an alias of the node's id and the worker's index (a
recreated TPU of the same name is another machine; the same worker at another
address is not). A refused key gets gcloud's fix in its one line, and a worker
whose chips another process holds (a notebook or job still running there) is
refused before anything runs, naming the process. Everything else is
``-b ssh``'s: the kept environment, warm agents, the key on standard input.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import socket
from collections.abc import Mapping
from typing import Any

from kinetic_nb.accelerators import Accelerator, cloud_tpu_accelerator, first_workers
from kinetic_nb.backends.base import BackendFlag, register
from kinetic_nb.backends.google_api import authorized_session
from kinetic_nb.backends.requirements import framework_requirement, host_requirements, with_framework
from kinetic_nb.backends.ssh.backend import (
    REQUIREMENTS_FLAG,
    SSH_CONFIG_FLAG,
    SSH_PYTHON_FLAG,
    SshBackend,
    ssh_settings,
)
from kinetic_nb.backends.ssh.probe import DEFAULT_PYTHON, probe_hosts
from kinetic_nb.errors import KineticError
from kinetic_nb.runner.protocol import JobPlan
from kinetic_nb.storage import Storage

__all__ = ["TpuNode", "TpuVmBackend", "read_node"]

logger = logging.getLogger(__name__)

#: The Cloud TPU API; ``$KINETIC_TPU_API_ENDPOINT`` replaces it and the others below (a test's double).
TPU_API = "https://tpu.googleapis.com"
API_ENDPOINT_ENV = "KINETIC_TPU_API_ENDPOINT"
#: Where a project's metadata says whether its VMs use OS Login, the OS Login API (a user's POSIX account),
#: and which account the credentials are (OpenID's userinfo: its email).
COMPUTE_API = "https://compute.googleapis.com"
OS_LOGIN_API = "https://oslogin.googleapis.com"
USER_INFO_API = "https://openidconnect.googleapis.com"
#: The key and known-hosts file ``gcloud compute tpus tpu-vm ssh`` makes and uses.
GCLOUD_KEY = "~/.ssh/google_compute_engine"
GCLOUD_KNOWN_HOSTS = "~/.ssh/google_compute_known_hosts"
#: Test-only: the slice's first N workers stand in for it (a test's four loopback machines for a 64-worker slice,
#: planned in full first, then run as the same generation's slice of N hosts). Never set it for real work.
TEST_WORKERS_ENV = "KINETIC_TPU_TEST_WORKERS"
#: A TPU VM's chips as its processes hold them: ``/dev/accel*`` (v2-v4, v5p) or ``/dev/vfio/N`` (v5e, v6e).
TPU_DEVICES = ("/dev/accel", "/dev/vfio/")
ADDRESS_CHOICES = ("auto", "internal", "external")


@dataclasses.dataclass(frozen=True)
class TpuNode:
    """What the Cloud TPU API says of a TPU VM slice."""

    name: str
    node_id: str
    #: Cloud TPU's name for it: ``v5litepod-16``, ``v4-32``; empty for a node made with ``--type/--topology``.
    accelerator_type: str
    state: str
    #: Each worker's internal address, worker 0 first, and its external one (None: it has none).
    internal: tuple[str, ...]
    external: tuple[str | None, ...]
    #: Its ``acceleratorConfig``: the type (``V5P``) and the topology (``4x4x8``), where the API gives them.
    config_type: str | None = None
    topology: str | None = None
    #: Its own ``enable-oslogin`` metadata (None: it has none, and its project's says).
    os_login: bool | None = None

    @property
    def accelerator(self) -> Accelerator:
        """The slice it is, in Cloud TPU's naming (``UnknownAcceleratorError`` in one line for one that is
        none)."""
        return cloud_tpu_accelerator(self.accelerator_type or None, config_type=self.config_type,
                                     topology=self.topology)


def read_node(session: Any, project: str, zone: str, tpu: str, *, endpoint: str | None = None) -> TpuNode:
    """The TPU VM ``tpu`` in ``project``/``zone``, as the Cloud TPU API answers; a one-line ``KineticError`` for
    one that does not exist, cannot be read or is not ready."""
    base = (endpoint or os.environ.get(API_ENDPOINT_ENV) or TPU_API).rstrip("/")
    answer = session.get(f"{base}/v2/projects/{project}/locations/{zone}/nodes/{tpu}")
    if answer.status_code == 404:
        raise KineticError(f"there is no TPU VM {tpu} in project {project}, zone {zone}: see `gcloud compute tpus "
                           f"tpu-vm list --zone {zone} --project {project}`; one asked for as a queued resource is "
                           f"there once granted (`gcloud compute tpus queued-resources list --zone {zone} "
                           f"--project {project}`)")
    if answer.status_code in (401, 403):
        raise KineticError(f"the Cloud TPU API refused to describe TPU VM {tpu} ({answer.status_code}: "
                           f"{_message(answer)}): your account needs tpu.nodes.get in project {project}")
    if answer.status_code != 200:
        raise KineticError(f"the Cloud TPU API could not describe TPU VM {tpu}: HTTP {answer.status_code}: "
                           f"{_message(answer)}")
    body = answer.json()
    # A node on several networks lists each worker's endpoint on each, worker by worker: every num_nets-th is
    # one worker's first network's (as gcloud's tpu-vm ssh takes them).
    endpoints = (body.get("networkEndpoints") or [])[::max(1, len(body.get("networkConfigs") or []))]
    state = body.get("state", "STATE_UNSPECIFIED")
    unusable = _unusable(tpu, zone, state, body.get("health", ""), body.get("schedulingConfig") or {})
    if unusable or not endpoints:
        raise KineticError(unusable or f"TPU VM {tpu} is {state} but names no worker: wait for it (`gcloud compute "
                                       f"tpus tpu-vm describe {tpu} --zone {zone}`)")
    config = body.get("acceleratorConfig") or {}
    node = TpuNode(name=tpu, node_id=str(body.get("id") or tpu), accelerator_type=body.get("acceleratorType") or "",
                   state=state, internal=tuple(endpoint["ipAddress"] for endpoint in endpoints),
                   external=tuple((endpoint.get("accessConfig") or {}).get("externalIp") for endpoint in endpoints),
                   config_type=config.get("type"), topology=config.get("topology"),
                   os_login=_flag((body.get("metadata") or {}).get("enable-oslogin")))
    node.accelerator  # noqa: B018 - a type that is no slice is refused here, before any worker is reached
    return node


def _flag(value: object) -> bool | None:
    """A metadata value as Compute Engine reads it (``TRUE``, ``true``, ``1``...); None for none."""
    return None if value is None else str(value).strip().lower() in ("true", "1", "yes", "y", "on")


def _api(default: str) -> str:
    return (os.environ.get(API_ENDPOINT_ENV) or default).rstrip("/")


def project_uses_os_login(session: Any, project: str) -> bool:
    """Whether ``project``'s common metadata turns OS Login on (a node's own metadata wins over it). An account
    that may not read it (no compute.projects.get) logs in as before, as this machine's user: the key's refusal
    then says what to run."""
    answer = session.get(f"{_api(COMPUTE_API)}/compute/v1/projects/{project}")
    if answer.status_code != 200:
        logger.debug("project %s's metadata unread (HTTP %s): OS Login taken as off", project, answer.status_code)
        return False
    items = (answer.json().get("commonInstanceMetadata") or {}).get("items") or []
    return bool(_flag(next((item.get("value") for item in items if item.get("key") == "enable-oslogin"), None)))


def os_login_user(session: Any, project: str) -> str:
    """The POSIX user OS Login gives the notebook's account (its primary one), as gcloud logs in with it."""
    credentials = getattr(session, "credentials", None)
    email = getattr(credentials, "service_account_email", None) or getattr(credentials, "account", None)
    if not email:  # user credentials: their account, as OpenID's userinfo says (the token in its header only)
        answer = session.get(f"{_api(USER_INFO_API)}/v1/userinfo")
        email = answer.json().get("email") if answer.status_code == 200 else None
    if not email:
        raise KineticError("TPU VMs of this project use OS Login, and the notebook's credentials do not say which "
                           "account they are: run `gcloud auth application-default login` again")
    answer = session.get(f"{_api(OS_LOGIN_API)}/v1/users/{email}/loginProfile",
                         params={"projectId": project, "systemId": "linux"})
    accounts = answer.json().get("posixAccounts") or [] if answer.status_code == 200 else []
    chosen = next((account for account in accounts if account.get("primary")), accounts[0] if accounts else None)
    if chosen is None or not chosen.get("username"):
        raise KineticError(f"OS Login has no POSIX account for {email} (HTTP {answer.status_code}): run `gcloud "
                           "compute os-login ssh-keys add --key-file ~/.ssh/google_compute_engine.pub` once")
    return str(chosen["username"])


#: States a TPU VM passes through on its own: waiting is the way.
_TRANSIENT_STATES = frozenset({"CREATING", "STARTING", "RESTARTING", "REPAIRING", "REIMAGING", "STOPPING"})


def _unusable(tpu: str, zone: str, state: str, health: str, scheduling: dict) -> str:
    """Why TPU VM ``tpu`` cannot run a cell now, with what to do, in one line; "" when it can."""
    describe = f"`gcloud compute tpus tpu-vm describe {tpu} --zone {zone}`"
    if state == "READY":
        if health == "UNHEALTHY_MAINTENANCE":
            return f"TPU VM {tpu} is READY but under maintenance (health {health}): wait for it to end ({describe})"
        return ""
    if state == "PREEMPTED":
        kind = "spot" if scheduling.get("spot") else "preemptible" if scheduling.get("preemptible") else ""
        return (f"TPU VM {tpu} was preempted, and a {kind + ' ' if kind else ''}TPU VM cannot be started again: "
                f"delete it (`gcloud compute tpus tpu-vm delete {tpu} --zone {zone}`) and create it anew")
    if state == "STOPPED":
        return f"TPU VM {tpu} is STOPPED: start it (`gcloud compute tpus tpu-vm start {tpu} --zone {zone}`)"
    if state in _TRANSIENT_STATES:
        return f"TPU VM {tpu} is {state}, not READY: wait for it ({describe})"
    return f"TPU VM {tpu} is {state}, not READY: see {describe}"


def _message(answer: Any) -> str:
    try:
        return answer.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return (getattr(answer, "text", "") or "no message").strip().splitlines()[0][:200]


def choose_addresses(node: TpuNode, choice: str, here: set[str] | None = None) -> tuple[tuple[str, ...], str]:
    """The workers' addresses by ``choice`` (``auto``: internal when this machine is one of the workers or no
    worker has an external address, else external), and which they are."""
    if choice not in ADDRESS_CHOICES:
        raise ValueError(f"--tpu-addresses must be one of {', '.join(ADDRESS_CHOICES)}, got {choice!r}")
    if choice == "auto":
        inside = bool(set(node.internal) & (here if here is not None else local_addresses()))
        choice = "internal" if inside or not all(node.external) else "external"
    if choice == "external":
        missing = [str(index) for index, address in enumerate(node.external) if not address]
        if missing:
            raise ValueError(f"TPU VM {node.name}'s worker {', '.join(missing)} has no external address: run the "
                             "notebook inside its network (on worker 0, say) with --tpu-addresses internal")
        return tuple(address for address in node.external if address), "external"
    return node.internal, "internal"


def local_addresses() -> set[str]:
    """This machine's IPv4 addresses, as its name resolves and as its default route leaves (no packet is sent)."""
    found = set()
    try:
        found |= {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)}
    except OSError:
        pass
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 1))  # a UDP "connection" only picks the route
            found.add(probe.getsockname()[0])
        except OSError:
            pass
    return found


@register
class TpuVmBackend(SshBackend):
    """The workers of a Cloud TPU VM slice, over ssh (see the module's docstring)."""

    name = "tpu-vm"
    summary = "the workers of a Cloud TPU VM slice, over ssh (docs/ssh.md)"
    named_by = ("KINETIC_TPU",)
    flags = (
        BackendFlag("--tpu", "tpu", "The TPU VM (default $KINETIC_TPU).", metavar="NAME", setting=True),
        BackendFlag("--zone", "zone", "Its zone (default $KINETIC_ZONE).", metavar="ZONE", setting=True),
        BackendFlag("--project", "project", "Its project (default $KINETIC_PROJECT, then your credentials').",
                    metavar="PROJECT", setting=True),
        BackendFlag("--tpu-addresses", "addresses", "How to reach the workers: internal (inside their network), "
                    "external, or auto (internal when the notebook runs on a worker or no worker has an external "
                    "address).", metavar="WHICH", setting=True),
        SSH_CONFIG_FLAG, SSH_PYTHON_FLAG, REQUIREMENTS_FLAG,
    )
    hosts_named_by = "the TPU VM has (its workers)"

    def __init__(self, tpu: str, *, zone: str, project: str | None = None, addresses: str = "auto",
                 config: str | None = None, python: str = DEFAULT_PYTHON, requirements: str | None = None,
                 session: Any = None):
        if addresses not in ADDRESS_CHOICES:
            raise ValueError(f"--tpu-addresses must be one of {', '.join(ADDRESS_CHOICES)}, got {addresses!r}")
        self.tpu, self.zone, self.project, self.requested_addresses = tpu, zone, project, addresses
        self._settings(config, python, requirements)
        self._session = session
        self._node: TpuNode | None = None
        self._addresses: tuple[tuple[str, ...], str] | None = None
        #: The OS Login POSIX user the workers are logged in as, where the node or its project uses OS Login.
        self._user: str | None = None

    @property
    def node(self) -> TpuNode:
        """The slice, read from the Cloud TPU API when first needed (a stored job's backend made again for
        ``%kinetic jobs`` or ``gc`` never calls it)."""
        if self._node is None:
            session, default_project = (self._session, None) if self._session is not None else \
                authorized_session("-b tpu-vm")
            self.project = self.project or default_project
            if not self.project:
                raise ValueError("-b tpu-vm needs the TPU VM's project: --project PROJECT (or $KINETIC_PROJECT)")
            node = read_node(session, self.project, self.zone, self.tpu)
            os_login = node.os_login
            if os_login is None:
                os_login = project_uses_os_login(session, self.project)
            # gcloud logs in as the account's OS Login user where OS Login is on, never as this machine's user; the
            # node is kept only with its user, so a lookup that failed is tried again, never skipped.
            self._user = os_login_user(session, self.project) if os_login else None
            self._node = node
        return self._node

    @property
    def targets(self) -> list[str]:
        addresses = self._chosen()[0][:self._test_workers() or None]  # reads the node (and its OS Login) first
        return [f"{self._user}@{address}" for address in addresses] if self._user else list(addresses)

    @staticmethod
    def _test_workers() -> int | None:
        """``$KINETIC_TPU_TEST_WORKERS`` (test-only: see :data:`TEST_WORKERS_ENV`), or None."""
        text = os.environ.get(TEST_WORKERS_ENV, "").strip()
        if not text:
            return None
        if not text.isdigit() or int(text) < 1:
            raise ValueError(f"${TEST_WORKERS_ENV} must be a number of workers, got {text!r}")
        return int(text)

    def host0_address(self) -> str:
        """Worker 0's internal address: the workers meet there (the coordinator, a session's hub), whichever
        address the notebook reaches them at. A slice's workers share a network; from outside it, Google Cloud's
        default firewall lets in only ssh (JAX's own Cloud TPU cluster also takes the internal endpoints)."""
        return self.node.internal[0]

    def channel_route(self, plan: JobPlan, announced: tuple[str, int]) -> tuple[str, int] | None:
        """A session's hub listens beside worker 0's agent at its internal address: reached there from inside the
        slice's network, else through a port forwarded over the ssh connection the notebook holds to worker 0
        (no firewall rule to open)."""
        if self._chosen()[1] == "internal":
            return announced
        return self._pool().connections.forward(0, announced)

    def _chosen(self) -> tuple[tuple[str, ...], str]:
        if self._addresses is None:
            self._addresses = choose_addresses(self.node, self.requested_addresses)
        return self._addresses

    def ssh_options(self) -> tuple[str, ...]:
        # gcloud's: a worker's host key is first seen when gcloud pushes the key (accepted then, checked after).
        options = ["CheckHostIP=no", f"UserKnownHostsFile={GCLOUD_KNOWN_HOSTS}", "StrictHostKeyChecking=accept-new"]
        if os.path.exists(os.path.expanduser(GCLOUD_KEY)):
            # gcloud's key alone, as gcloud offers it: an agent holding many keys would be refused first ("Too many
            # authentication failures") before the server saw this one.
            options += [f"IdentityFile={GCLOUD_KEY}", "IdentitiesOnly=yes"]
        return tuple(options)

    def host_options(self) -> tuple[tuple[str, ...], ...]:
        return tuple((f"HostKeyAlias={self.key_alias(index)}",) for index in range(len(self.targets)))

    @classmethod
    def from_options(cls, *, tpu: str | None = None, zone: str | None = None, project: str | None = None,
                     addresses: str | None = None, ssh_config: str | None = None, ssh_python: str | None = None,
                     requirements: str | None = None, config: Mapping[str, Any] | None = None,
                     **options: Any) -> TpuVmBackend:
        if options:
            raise ValueError(f"the tpu-vm backend takes tpu, zone, project, addresses, ssh_config, ssh_python and "
                             f"requirements, got {', '.join(sorted(options))}")
        config = dict(config or {})
        tpu = tpu or os.environ.get("KINETIC_TPU") or config.get("tpu")
        zone = zone or os.environ.get("KINETIC_ZONE") or config.get("zone")
        if not tpu or not zone:
            raise ValueError("-b tpu-vm needs the TPU VM and its zone: --tpu NAME --zone ZONE (or $KINETIC_TPU, "
                             "$KINETIC_ZONE)")
        return cls(tpu, zone=zone, project=project or os.environ.get("KINETIC_PROJECT") or config.get("project"),
                   addresses=addresses or config.get("addresses") or "auto",
                   **ssh_settings(ssh_config, ssh_python, requirements, config))

    def options(self) -> dict[str, object]:
        stored: dict[str, object] = {"tpu": self.tpu, "zone": self.zone, "addresses": self.requested_addresses}
        if self.project:
            stored["project"] = self.project
        return {**stored, **self._ssh_options()}

    def default_accelerator(self) -> str | None:
        accelerator = self.node.accelerator
        workers = self._test_workers()
        return (first_workers(accelerator, workers) if workers else accelerator).name

    def host_requirements(self, plan: JobPlan) -> bytes | None:
        """``--requirements``, and the cell's framework for TPUs at the notebook's version (``jax[tpu]``) unless
        the file names it: a TPU VM's image has no JAX (one that has it satisfies the line as it is)."""
        requirements = host_requirements(self.requirements) if self.requirements else None
        return with_framework(requirements, framework_requirement("tpu", plan.framework, requirements))

    def key_alias(self, worker: int) -> str:
        """The name a worker's host key is kept under in gcloud's known-hosts file."""
        return f"tpu.{self.node.node_id}-{worker}"

    def connection_hint(self, problem: str) -> str:
        worker = re.match(r"host (\d+) ", problem)
        if "host key changed" in problem and worker:
            alias = self.key_alias(int(worker.group(1)))
            return (f"{problem.split(': check it', 1)[0]}: check it, then remove the old one with "
                    f"`ssh-keygen -R {alias} -f {GCLOUD_KNOWN_HOSTS}`")
        if "key was refused" in problem:
            return (f"{problem}; on a TPU VM, gcloud makes your key and pushes it to every worker: run "
                    f"`gcloud compute tpus tpu-vm ssh {self.tpu} --zone {self.zone} --project {self.project} "
                    "--worker=all --command=true` once")
        if "cannot be reached" in problem and self._chosen()[1] == "internal":
            return f"{problem}; these are the workers' internal addresses: from outside their network, use " \
                   "--tpu-addresses external"
        return problem

    def _launch(self, pool, storage: Storage, plan: JobPlan, secrets) -> None:
        # A worker whose chips another process holds (a notebook, job or session still running there) would fail
        # deep in the framework's start: refused here, naming the process.
        probe_hosts(pool.connections, python=pool.pythons, ports=0, devices=TPU_DEVICES, device_name="TPU")
        super()._launch(pool, storage, plan, secrets)
