"""``%kinetic doctor -b ssh`` and ``-b tpu-vm``: are the hosts ready to run cells, and if not, the fix.

One row per check, each ok, warn or fail, with the command that fixes a
failure, in the Kubernetes doctor's table
(:class:`~kinetic_nb.backends.kubernetes.doctor_report.DoctorReport`):

- ``TPU VM`` (``-b tpu-vm``): the Cloud TPU API's answer: its state, its
  accelerator, its workers and which of their addresses are used;
- ``OS Login`` (``-b tpu-vm``): on or off (the node's metadata, else its
  project's), and the user the workers are logged in as;
- ``hosts reachable``: every host's ssh connection, opened at once; each
  failing host is named (a job stops at the first), with ssh's reason;
- ``Python``: each host's interpreter against the notebook's minor version
  (the default ``python3`` of another one is fine: the first job installs the
  notebook's there; a ``--ssh-python`` of another one is not);
- ``storage``: a ``file://`` root every host sees and its user may use (the
  probe's own verdict), or a ``gs://`` root written, read back and deleted
  from the notebook, and its endpoint reached from every host (each host's own
  credentials are the first cell's to find out);
- ``coordinator port``: every other host connects to a port that host 0
  listens on for the check (the probe's free port), at the address the jobs
  give them (:meth:`~kinetic_nb.backends.ssh.backend.SshBackend.host0_address`);
- ``free TPU chips`` (``-b tpu-vm``, and ``-b ssh`` with ``-a tpu-...``): no
  process holds a host's TPU (the probe's busy-chip facts).

Each host is asked on its own (:class:`OneHost`), so one host's problem hides
no other host's; a host that was not reached, or has no usable Python, is
named as not checked in the later rows. Nothing is installed or started on a
host beyond the probe and, for the port, a listener that ends with the check.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import re
import secrets
import selectors
import shlex
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from kinetic_nb.accelerators import resolve_accelerator
from kinetic_nb.backends.kubernetes.doctor_report import FAIL, OK, WARN, Check, DoctorReport
from kinetic_nb.backends.ssh import tpu_vm
from kinetic_nb.backends.ssh.backend import PYTHON_ENV, SshBackend
from kinetic_nb.backends.ssh.connections import PARALLEL_OPENS, Connections, SshHost
from kinetic_nb.backends.ssh.probe import DEFAULT_PYTHON, HostFacts, probe_hosts
from kinetic_nb.errors import KineticError, SshHostError

__all__ = ["OneHost", "doctor", "doctor_for"]

#: How long a host may take to answer one of the doctor's commands (a probe, a connection attempt).
COMMAND_TIMEOUT_S = 60
#: How long a host waits for a connection to host 0's port (or the storage's endpoint) before it says it cannot.
CONNECT_TIMEOUT_S = 5
#: How long host 0's listener lives at most, should the notebook vanish during the check.
LISTENER_LIFETIME_S = 120
#: How long host 0's listener may take to say it listens.
LISTENER_START_S = 30
#: Where the gs:// check writes its object under the storage root; deleted at once.
PROBE_PREFIX = ".kinetic-doctor"
#: Where a gs:// root's objects are served when no emulator is named (``$STORAGE_EMULATOR_HOST``).
GCS_ENDPOINT = ("storage.googleapis.com", 443)
#: Hosts named in one row's detail; the rest are counted.
NAMED_HOSTS = 4

#: Run by a host's own Python: its version (any 3.x), so that the probe is asked with it.
_VERSION = "import sys; print(sys.version_info[0], sys.version_info[1])"
#: Run by host 0's Python: listen on port argv[1] on every address, as the coordinator will, until standard input
#: ends (the check is over) or argv[2] seconds pass; says "listening" once it does, "taken ..." when it cannot.
_LISTENER = r"""
import signal, socket, sys, threading
signal.alarm(int(sys.argv[2]))
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try:
    server.bind(("", int(sys.argv[1])))
    server.listen(128)
except OSError as error:
    print("taken", error, flush=True)
    sys.exit(0)
print("listening", flush=True)
def accept():
    while True:
        peer, _ = server.accept()
        peer.close()
threading.Thread(target=accept, daemon=True).start()
sys.stdin.read()
"""
#: Run by another host's Python: connect to argv[1]:argv[2] within argv[3] seconds (exit 0), or say why not.
_CONNECT = "import socket, sys\nsocket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3]))"


class OneHost:
    """Host ``index`` of ``connections`` as :func:`~kinetic_nb.backends.ssh.probe.probe_hosts` sees a set of
    hosts: the only one of its set, asked alone, so that its answer (or the one line that rules it out) is its
    own, whatever the others say. Its lines name it as it is (``host 2 (h2)``); the ports it is asked for are the
    caller's choice (a set's first host is asked for them)."""

    def __init__(self, connections: Connections, index: int):
        self.connections = connections
        self.index = index
        self.hosts = [connections.hosts[index]]

    def run_each(self, command_for: Callable[[int], Sequence[str] | str], *, input: bytes | None = None,
                 timeout: float | None = None, **_: Any) -> list[subprocess.CompletedProcess]:
        return [self.connections.run(self.index, command_for(0), input=input, timeout=timeout)]


class _EachHost(Connections):
    """The hosts' connections, each host's failure kept: a doctor reports every host, a job stops at the first."""

    def open_each(self) -> dict[int, str]:
        """Connect to every host at once; each host that failed, with ssh's reason in one line."""
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(len(self.hosts), PARALLEL_OPENS)) as pool:
            problems = list(pool.map(self._open_one, self.hosts))
        return {host.index: problem for host, problem in zip(self.hosts, problems, strict=True) if problem}


@dataclasses.dataclass
class _Finding:
    """One host's answer to one check: a problem (one line) and its fix, or nothing wrong; or why it was not
    checked."""

    host: SshHost
    problem: str = ""
    fix: str = ""
    unchecked: str = ""


@dataclasses.dataclass
class _Host:
    """What the doctor learned of one host."""

    host: SshHost
    unreached: str = ""
    #: Its Python's (major, minor), when it has the one named.
    version: tuple[int, int] | None = None
    facts: HostFacts | None = None
    python_problem: str = ""

    @property
    def usable(self) -> bool:
        """Whether the later checks can ask it (it was reached and its Python runs)."""
        return self.version is not None and self.facts is not None

    def why_unchecked(self) -> str:
        return "not reached" if self.unreached else "no Python to ask"


def doctor_for(backend_class: type[SshBackend], accelerator: str | None, storage: str | None,
               options: Mapping[str, Any]) -> DoctorReport:
    """What ``%kinetic doctor -b ssh`` (or ``-b tpu-vm``) runs: the backend made from its flags' ``options``,
    then :func:`doctor` (``ValueError`` in one line for options that name no hosts)."""
    return doctor(backend_class.from_options(**dict(options)), accelerator, storage)


def doctor(backend: SshBackend, accelerator: str | None = None, storage: str | None = None, *,
           notebook_python: tuple[int, int] = sys.version_info[:2]) -> DoctorReport:
    """Check that cells can run on ``backend``'s hosts with ``storage``; a table of checks with fixes.

    Parameters
    ----------
    backend : SshBackend
        The hosts (``-b ssh``), or a TPU VM's workers (``-b tpu-vm``).
    accelerator : str, optional
        ``-b ssh`` with a TPU accelerator (``tpu-v5e-16``) also checks that no
        process holds a host's chips (``-b tpu-vm`` always does).
    storage : str, optional
        The job storage root; default ``$KINETIC_STORAGE``, else the per-user
        directory (which other machines do not see).
    notebook_python : tuple of int, optional
        The minor version the hosts need: the notebook's.

    Returns
    -------
    DoctorReport
        ``report.ok`` is False when a check failed; ``print(report)`` shows the table.
    """
    checks: list[Check] = []
    tpu = isinstance(backend, tpu_vm.TpuVmBackend)
    chips = tpu or _is_tpu(accelerator)  # an -a that names nothing is one line before any host is reached
    if tpu:
        checks += _tpu_vm_checks(backend)
        if any(check.status == FAIL for check in checks):
            return DoctorReport(tuple(checks))
    connections = _EachHost(backend.targets, config=backend.config, options=backend.ssh_options(),
                            host_options=backend.host_options())
    try:
        hosts = _ask_hosts(connections, backend, notebook_python)
        if tpu:
            checks.append(_os_login_check(backend, hosts))
        checks.append(_reach_check(backend, hosts))
        checks.append(_python_check(backend, hosts, notebook_python))
        checks.append(_storage_check(connections, backend, hosts, storage))
        checks.append(_coordinator_check(connections, backend, hosts))
        if chips:
            checks.append(_chips_check(connections, backend, hosts, tpu_vm.TPU_DEVICES))
    finally:
        connections.close()
    return DoctorReport(tuple(checks))


def _is_tpu(accelerator: str | None) -> bool:
    return bool(accelerator) and resolve_accelerator(accelerator).kind == "tpu"


# -- the TPU VM and its OS Login ----------------------------------------------------------------------------------


def _tpu_vm_checks(backend: tpu_vm.TpuVmBackend) -> list[Check]:
    """The node as the Cloud TPU API describes it, or the one line that stops a cell there, with its fix (and
    the OS Login row, failed, when the node was read but its OS Login user was not)."""
    try:
        node = backend.node
    except Exception as error:  # noqa: BLE001 - any failure to read the node (the API unreachable too) is a row
        problem = str(error) if isinstance(error, (KineticError, ValueError)) else _one_line(error)
        if "OS Login" in problem:  # the node was read; the account's OS Login user was not
            return [Check("TPU VM", OK, f"{backend.tpu} in {backend.project}, {backend.zone}"),
                    Check("OS Login", FAIL, problem, _command_in(problem))]
        return [Check("TPU VM", FAIL, problem, _command_in(problem) or _tpu_fix(problem))]
    try:
        addresses = [target.rsplit("@", 1)[-1] for target in backend.targets]
    except ValueError as error:  # --tpu-addresses external, and a worker has none
        return [Check("TPU VM", FAIL, str(error), "--tpu-addresses internal")]
    which = "internal" if addresses == list(node.internal[:len(addresses)]) else "external"
    return [Check("TPU VM", OK, f"{node.name} is {node.state}: {node.accelerator.name}, {len(node.internal)} "
                                f"workers, reached at their {which} addresses")]


def _tpu_fix(problem: str) -> str:
    if "--project" in problem:
        return "--project PROJECT (or %env KINETIC_PROJECT=PROJECT)"
    if "credentials" in problem.lower():
        return "gcloud auth application-default login"
    return ""


def _os_login_check(backend: tpu_vm.TpuVmBackend, hosts: list[_Host]) -> Check:
    """On or off, where that was read, and the POSIX user the workers are logged in as."""
    node = backend.node
    where = "the TPU VM's metadata" if node.os_login is not None else "its project's metadata"
    users = {target.rsplit("@", 1)[0] for target in backend.targets if "@" in target}
    if users:
        return Check("OS Login", OK, f"on ({where}): the workers are logged in as {users.pop()}, your account's "
                                     "OS Login user")
    seen = next((host.facts.user for host in hosts if host.facts is not None), None)
    return Check("OS Login", OK, f"off ({where}): the workers are logged in as "
                                 f"{seen or 'the user your ssh config names'}, as ssh would")


# -- asking each host -------------------------------------------------------------------------------------------


def _ask_hosts(connections: _EachHost, backend: SshBackend, notebook_python: tuple[int, int]) -> list[_Host]:
    """Each host's connection, its Python's version, and the probe's facts (host 0's with a free port)."""
    unreached = connections.open_each()
    hosts = [_Host(host, unreached=backend.connection_hint(unreached[host.index]) if host.index in unreached else "")
             for host in connections.hosts]
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(len(hosts), PARALLEL_OPENS)) as pool:
        list(pool.map(lambda host: _ask_one(connections, backend, host, notebook_python),
                      [host for host in hosts if not host.unreached]))
    return hosts


def _ask_one(connections: Connections, backend: SshBackend, host: _Host, notebook_python: tuple[int, int]) -> None:
    index = host.host.index
    try:
        answer = connections.run(index, [backend.python, "-c", _VERSION], timeout=COMMAND_TIMEOUT_S)
    except (SshHostError, subprocess.TimeoutExpired) as error:
        host.python_problem = f"{host.host}: no answer to the probe: {error}"
        return
    said = answer.stderr.decode(errors="replace").strip().splitlines()
    if answer.returncode != 0:
        if answer.returncode == 127 or (said and "not found" in said[-1]):
            host.python_problem = (f"{host.host} has no {backend.python}: install Python "
                                   f"{'.'.join(map(str, notebook_python))} there, or name one with --ssh-python")
        else:
            host.python_problem = f"{host.host}: {backend.python} did not run: {said[-1] if said else 'no message'}"
        return
    major, minor = answer.stdout.decode().split()[-2:]
    host.version = (int(major), int(minor))
    try:  # asked with its own version: the facts, whatever the verdict on the version
        host.facts = probe_hosts(OneHost(connections, index), python=backend.python, notebook_python=host.version,
                                 ports=1 if index == 0 else 0)[0]
    except (SshHostError, subprocess.TimeoutExpired, ValueError) as error:
        host.python_problem = f"{host.host}: the probe failed: {error}"


def _finding(host: _Host, ask: Callable[[], tuple[str, str]]) -> _Finding:
    """``ask()``'s (problem, fix) for a host the later checks can ask; else why it was not checked."""
    if not host.usable:
        return _Finding(host.host, unchecked=host.why_unchecked())
    problem, fix = ask()
    return _Finding(host.host, problem, fix)


def _each(hosts: list[_Host], ask: Callable[[_Host], tuple[str, str]]) -> list[_Finding]:
    """``ask`` of every host at once (those it can ask), in host order."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(len(hosts), PARALLEL_OPENS)) as pool:
        return list(pool.map(lambda host: _finding(host, lambda: ask(host)), hosts))


# -- the rows ---------------------------------------------------------------------------------------------------


def _row(name: str, findings: list[_Finding], ok_detail: str) -> Check:
    """One check over the hosts: failed when a host has a problem (the lowest named, the others counted), else ok
    (with the hosts it could not check named), or a warning when it could check none."""
    problems = [finding for finding in findings if finding.problem]
    unchecked = [finding for finding in findings if finding.unchecked]
    if problems:
        more = f" (and {len(problems) - 1} more: {_named(problems[1:])})" if len(problems) > 1 else ""
        return Check(name, FAIL, problems[0].problem + more, problems[0].fix)
    if unchecked and len(unchecked) == len(findings):
        return Check(name, WARN, f"not checked: no host to ask ({unchecked[0].unchecked})")
    if unchecked:
        return Check(name, OK, f"{ok_detail}; not checked on {_named(unchecked)} ({unchecked[0].unchecked})")
    return Check(name, OK, ok_detail)


def _named(findings: list[_Finding]) -> str:
    named = ", ".join(str(finding.host) for finding in findings[:NAMED_HOSTS])
    return named + (f" and {len(findings) - NAMED_HOSTS} others" if len(findings) > NAMED_HOSTS else "")


def _reach_check(backend: SshBackend, hosts: list[_Host]) -> Check:
    findings = [_Finding(host.host, host.unreached, _reach_fix(backend, host) if host.unreached else "")
                for host in hosts]
    return _row("hosts reachable", findings, f"all {len(hosts)} host{'s' if len(hosts) != 1 else ''} over ssh")


def _reach_fix(backend: SshBackend, host: _Host) -> str:
    """The command in ssh's (and the platform's) advice, else the one that shows where the connection stops."""
    command = _command_in(host.unreached)
    if command:
        return command
    if "--tpu-addresses external" in host.unreached:
        return "--tpu-addresses external"
    if isinstance(backend, tpu_vm.TpuVmBackend):
        return _gcloud_ssh(backend, "true", worker="all")
    return _ssh(backend, host.host.target, "true", verbose=True)


def _python_check(backend: SshBackend, hosts: list[_Host], notebook_python: tuple[int, int]) -> Check:
    """Each host's Python against the notebook's minor version: the default ``python3`` of another one is fine (the
    first job installs the notebook's there, :mod:`~kinetic_nb.backends.ssh.python_install`); a ``--ssh-python``
    of another one, or none, is not (it is used as it is)."""
    wanted = ".".join(map(str, notebook_python))
    named = backend.python != DEFAULT_PYTHON
    findings, installs = [], []
    for host in hosts:
        if host.unreached:
            findings.append(_Finding(host.host, unchecked=host.why_unchecked()))
        elif host.python_problem:
            findings.append(_Finding(host.host, host.python_problem, _python_fix(backend, host, wanted)))
        elif host.version != tuple(notebook_python) and named:
            facts = host.facts
            findings.append(_Finding(
                host.host, f"{host.host} runs Python {'.'.join(map(str, facts.python))} ({facts.executable}) and "
                           f"this notebook {wanted}: the hosts need the notebook's minor version (cells and their "
                           "values travel pickled), and --ssh-python is used as it is", _python_fix(backend, host,
                                                                                                  wanted)))
        else:
            findings.append(_Finding(host.host))
            if host.version != tuple(notebook_python):
                installs.append(findings[-1])
    usable = [host for host in hosts if host.facts is not None]
    found = sorted({f"{'.'.join(map(str, host.facts.python))} ({host.facts.executable})" for host in usable})
    seen = f"{', '.join(found[:2])}{' and others' if len(found) > 2 else ''}"
    if installs:
        return _row("Python", findings, f"{seen}: the first job installs the notebook's {wanted} into the kinetic_nb "
                                        f"cache of {_named(installs)} (uv's managed CPython, once; later jobs find "
                                        "it there)")
    return _row("Python", findings, f"{seen}: the notebook's {wanted}")


def _python_fix(backend: SshBackend, host: _Host, wanted: str) -> str:
    """A named Python of another version (or none): leave the choice to the jobs, which install the notebook's
    where ``python3`` is another; no ``python3`` at all: the distribution's, from which the jobs go on."""
    if backend.python != DEFAULT_PYTHON:
        return (f"leave out --ssh-python (and %config KineticMagics.ssh_python, ${PYTHON_ENV}): jobs then install "
                f"Python {wanted} where a host's python3 is another minor version; or name a Python {wanted} there")
    install = "sudo apt-get install -y python3 python3-pip"
    return (_gcloud_ssh(backend, install, worker="all") if isinstance(backend, tpu_vm.TpuVmBackend)
            else _ssh(backend, host.host.target, install))


def _storage_check(connections: Connections, backend: SshBackend, hosts: list[_Host], storage: str | None) -> Check:
    from kinetic_nb.storage import open_storage
    from kinetic_nb.storage.defaults import default_root

    uri = storage or backend.default_storage() or default_root()
    elsewhere = "--storage gs://BUCKET/PREFIX (or a file:// directory every host mounts)"
    try:
        root = open_storage(uri)
        path = root.local_path()
    except Exception as error:  # noqa: BLE001 - any failure here is the notebook's own, reported as a row
        return Check("storage", FAIL, f"{uri} cannot be used from this notebook: {_one_line(error)}", elsewhere)
    if path is not None:
        def sees(host: _Host) -> tuple[str, str]:
            try:
                probe_hosts(OneHost(connections, host.host.index), python=backend.python,
                            notebook_python=host.version, storage_path=path, ports=0)
            except SshHostError as error:
                return str(error), elsewhere
            return "", ""

        return _row("storage", _each(hosts, sees), f"{uri}: every host sees it, and its user may use it")
    written = _written_and_read(root, uri)
    if written is not None:
        return written
    address, port = _storage_endpoint()

    def reaches(host: _Host) -> tuple[str, str]:
        problem = _connects(connections, backend, host.host, address, port)
        return ((f"{host.host} cannot reach {address}:{port}, where {uri} is served: {problem}",
                 _endpoint_fix(backend)) if problem else ("", ""))

    return _row("storage", _each(hosts, reaches), f"{uri} written, read back and deleted from here; every host "
                                                  f"reaches {address}:{port} (each with its own credentials)")


def _written_and_read(root: Any, uri: str) -> Check | None:
    """A failed row when this notebook cannot write, read back and delete an object under ``root``; else None."""
    name = f"{PROBE_PREFIX}/{secrets.token_hex(6)}"
    data = b"kinetic_nb doctor probe"
    try:
        root.write_bytes(name, data)
        try:
            read = root.read_bytes(name)
        finally:
            root.delete(name)
    except Exception as error:  # noqa: BLE001 - reported as a row
        return Check("storage", FAIL, f"{uri} is not writable and readable from here: {_one_line(error)}",
                     "gcloud auth application-default login")
    if read != data:
        return Check("storage", FAIL, f"{uri} returned other bytes than were written")
    return None


def _storage_endpoint() -> tuple[str, int]:
    """Where the hosts reach Cloud Storage: the emulator the notebook names (hosts are given it too), else
    Google's."""
    emulator = os.environ.get("STORAGE_EMULATOR_HOST")
    if not emulator:
        return GCS_ENDPOINT
    parts = urlsplit(emulator if "://" in emulator else f"http://{emulator}")
    return parts.hostname or "localhost", parts.port or (443 if parts.scheme == "https" else 80)


def _endpoint_fix(backend: SshBackend) -> str:
    if isinstance(backend, tpu_vm.TpuVmBackend):  # workers with internal addresses only: Private Google Access
        return (f"gcloud compute networks subnets update SUBNET --region {backend.zone.rsplit('-', 1)[0]} "
                f"--project {backend.project} --enable-private-ip-google-access")
    return "let the hosts reach it (a proxy or NAT), or use a file:// root every host mounts (--storage file://...)"


def _coordinator_check(connections: Connections, backend: SshBackend, hosts: list[_Host]) -> Check:
    """Every other host connects to a port host 0 listens on, at the address a job gives them."""
    name = "coordinator port"
    if len(hosts) == 1:
        return Check(name, OK, "one host: its processes meet on it")
    leader = hosts[0]
    if not leader.usable or not leader.facts.ports:
        return Check(name, WARN, f"not checked: {leader.host} cannot be asked ({leader.why_unchecked()})")
    port = leader.facts.ports[0]
    address = backend.host0_address()
    listener = subprocess.Popen(
        connections.command(0, shlex.join([backend.python, "-c", _LISTENER, str(port), str(LISTENER_LIFETIME_S)])),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        said = _first_line(listener, LISTENER_START_S)
        if said != "listening":
            return Check(name, WARN, f"not checked: {leader.host} could not listen on port {port} "
                                     f"({said or 'no answer'}): run the doctor again")

        def reaches(host: _Host) -> tuple[str, str]:
            problem = _connects(connections, backend, host.host, address, port)
            return ((f"{host.host} cannot connect to host 0 at {address}:{port}: {problem}",
                     _port_fix(backend, hosts, address)) if problem else ("", ""))

        findings = _each(hosts[1:], reaches)
    finally:
        _stop(listener)
    return _row(name, findings, f"every host reaches host 0 at {address}:{port}, where a job's coordinator "
                                "listens")


def _port_fix(backend: SshBackend, hosts: list[_Host], address: str) -> str:
    if isinstance(backend, tpu_vm.TpuVmBackend):
        sources = ",".join(f"{worker}/32" for worker in backend.node.internal)
        return (f"gcloud compute firewall-rules create kinetic-nb-workers --project {backend.project} "
                f"--network NETWORK --allow tcp --source-ranges {sources}")
    return (f"on host 0, let the other hosts in over TCP ({_ssh(backend, hosts[0].host.target, 'sudo ufw allow from ADDRESS')} "
            f"for each), or name host 0 in your ssh config by an address they reach (not {address})")


def _chips_check(connections: Connections, backend: SshBackend, hosts: list[_Host], devices: tuple[str, ...]) -> Check:
    """No process holds a host's TPU: the probe's busy-chip facts, with the way to end the holder."""
    def free(host: _Host) -> tuple[str, str]:
        try:
            probe_hosts(OneHost(connections, host.host.index), python=backend.python, notebook_python=host.version,
                        ports=0, devices=devices, device_name="TPU")
        except SshHostError as error:
            return str(error), _holder_fix(backend, host.host, str(error))
        return "", ""

    return _row("free TPU chips", _each(hosts, free), f"no process holds the TPU on any of the {len(hosts)} hosts")


def _holder_fix(backend: SshBackend, host: SshHost, problem: str) -> str:
    """How to end what holds a host's chips, as the probe's line names it: a kinetic_nb session or job from a
    notebook, any other process by its pid on that host."""
    session = re.search(r"%kinetic attach (ks-\S+?),", problem)
    if session:
        return f"%kinetic stop in its notebook (from another: %kinetic attach {session.group(1)}, then %kinetic stop)"
    job = re.search(r"%kinetic cancel (kn-[^\s,;)]+)", problem)
    if job:
        return f"%kinetic cancel {job.group(1)}"
    pid = re.search(r"\((sudo )?kill (\d+)\)", problem)  # another user's process: as root
    if pid is None:
        return ""
    kill = f"{pid.group(1) or ''}kill {pid.group(2)}"
    if isinstance(backend, tpu_vm.TpuVmBackend):
        return _gcloud_ssh(backend, kill, worker=str(host.index))
    return _ssh(backend, host.target, kill)


# -- commands the fixes name, and small helpers -------------------------------------------------------------------


def _ssh(backend: SshBackend, target: str, command: str, *, verbose: bool = False) -> str:
    return shlex.join(["ssh", *(["-F", backend.config] if backend.config else []), *(["-v"] if verbose else []),
                       target, command])


def _gcloud_ssh(backend: tpu_vm.TpuVmBackend, command: str, *, worker: str) -> str:
    return (f"gcloud compute tpus tpu-vm ssh {backend.tpu} --zone {backend.zone} --project {backend.project} "
            f"--worker={worker} --command={shlex.quote(command)}")


def _command_in(problem: str) -> str:
    """The command a one-line problem names (in backticks, as kinetic_nb's lines write them), else ""."""
    found = re.findall(r"`([^`]+)`", problem)
    return found[-1] if found else ""


def _connects(connections: Connections, backend: SshBackend, host: SshHost, address: str, port: int) -> str:
    """"" when ``host`` connects to ``address:port`` (with its Python); else why not, in a few words."""
    try:
        done = connections.run(host.index, [backend.python, "-c", _CONNECT, address, str(port), str(CONNECT_TIMEOUT_S)],
                               timeout=COMMAND_TIMEOUT_S)
    except (SshHostError, subprocess.TimeoutExpired) as error:
        return f"no answer ({_one_line(error)})"
    if done.returncode == 0:
        return ""
    said = done.stderr.decode(errors="replace").strip().splitlines()
    return said[-1] if said else f"exit status {done.returncode}"


def _first_line(process: subprocess.Popen, timeout: float) -> str:
    """The first line ``process`` printed, within ``timeout`` ("" when none came)."""
    pending = b""
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        while b"\n" not in pending and selector.select(timeout):
            chunk = os.read(process.stdout.fileno(), 4096)
            if not chunk:
                break
            pending += chunk
    return pending.split(b"\n", 1)[0].decode(errors="replace").strip()


def _stop(process: subprocess.Popen) -> None:
    """End host 0's listener: its standard input ends (it exits), and the ssh client with it."""
    with contextlib.suppress(OSError):
        process.stdin.close()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    with contextlib.suppress(OSError):
        process.stdout.close()


def _one_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__
