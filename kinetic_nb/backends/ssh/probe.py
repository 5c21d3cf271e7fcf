"""What each ssh host is, asked of all of them at once before anything of a job runs there.

One small Python program per host, over its connection: the interpreter's
version, whether the job's ``file://`` storage is a directory it sees, and (on
host 0) free ports for the framework's coordinator and a session's hub, chosen
below the kernel's ephemeral range (``runner.ports``): a port is probed, then
bound later by the framework, and no connection made in between can be given
one there; host 0 checks the coordinator's again just before it is bound. Each answer that rules a
host out is one line naming the host and the way out.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import sys

from kinetic_nb.backends.ssh.connections import Connections
from kinetic_nb.errors import SshHostError
from kinetic_nb.runner.ports import free_ports

__all__ = ["DEFAULT_PYTHON", "HostFacts", "probe_hosts"]

#: The interpreter a host runs kinetic_nb with unless told (``--ssh-python``).
DEFAULT_PYTHON = "python3"

#: Runs on each host with its own Python (any 3.x): argv[1] is a path to look for ("" for none), argv[2] how many
#: free ports to find (``runner.ports.free_ports``, its source included: below the ephemeral range, where no
#: connection made meanwhile takes one), argv[3] device paths (comma-separated prefixes) whose holders to name.
_PROBE = "from __future__ import annotations\n" + inspect.getsource(free_ports) + r"""
import json, os, socket, sys
answer = {"python": list(sys.version_info[:3]), "executable": sys.executable, "hostname": socket.gethostname(),
          "sees": None, "ports": [], "holders": []}
if sys.argv[1]:
    answer["sees"] = os.path.isdir(sys.argv[1])
answer["ports"] = free_ports(int(sys.argv[2]))
devices = tuple(prefix for prefix in sys.argv[3].split(",") if prefix)
for pid in (name for name in os.listdir("/proc") if name.isdigit() and devices and int(name) != os.getpid()):
    try:
        opened = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        if any(path.startswith(devices) for path in opened):
            with open(f"/proc/{pid}/cmdline", "rb") as file:
                command = " ".join(file.read().replace(b"\0", b" ").decode(errors="replace").split())  # one line
            answer["holders"].append([int(pid), command[:200]])
    except OSError:  # gone, or another user's (not ours to read)
        continue
print(json.dumps(answer))
"""
#: Ports host 0 finds: the framework's coordinator's, and a session's hub's.
HOST_0_PORTS = 2


@dataclasses.dataclass(frozen=True)
class HostFacts:
    """What one host said of itself."""

    python: tuple[int, int, int]
    executable: str
    hostname: str
    #: Whether it sees the job's ``file://`` storage (None: storage it reaches over the network).
    sees_storage: bool | None
    #: Ports free on it when asked (host 0: the coordinator's, then a session hub's).
    ports: tuple[int, ...]
    #: The processes (pid, command line) holding one of the devices asked about (a TPU VM's chips).
    holders: tuple[tuple[int, str], ...] = ()


def probe_hosts(connections: Connections, *, python: str = DEFAULT_PYTHON, storage_path: str | None = None,
                notebook_python: tuple[int, int] = sys.version_info[:2], ports: int = HOST_0_PORTS,
                devices: tuple[str, ...] = (), device_name: str = "device") -> list[HostFacts]:
    """Every host's facts, asked at once; ``SshHostError`` with one line for the lowest host that cannot run the
    job: no such Python, another minor version than the notebook's, no sight of ``storage_path`` (a
    ``file://`` root, which every host must share), or a process holding one of ``devices`` (paths by their
    prefix: a TPU VM's chips, its ``device_name``), named with its pid and command."""
    answers = connections.run_each(lambda index: [python, "-c", _PROBE, storage_path or "",
                                                  str(ports if index == 0 else 0), ",".join(devices)], timeout=60)
    facts = []
    for host, answer in zip(connections.hosts, answers, strict=True):
        if answer.returncode != 0:
            said = answer.stderr.decode(errors="replace").strip().splitlines()
            if answer.returncode == 127 or (said and "not found" in said[-1]):
                raise SshHostError(f"{host} has no {python}: install Python "
                                   f"{notebook_python[0]}.{notebook_python[1]} there, or name one with --ssh-python")
            raise SshHostError(f"{host}: {python} could not run the probe: {said[-1] if said else 'no message'}")
        record = json.loads(answer.stdout.decode().strip().splitlines()[-1])
        found = HostFacts(tuple(record["python"]), record["executable"], record["hostname"], record["sees"],
                          tuple(record["ports"]), tuple((pid, command) for pid, command in record["holders"]))
        if found.python[:2] != tuple(notebook_python):
            raise SshHostError(
                f"{host} runs Python {'.'.join(map(str, found.python))} ({found.executable}) and this notebook "
                f"{notebook_python[0]}.{notebook_python[1]}: the hosts need the notebook's minor version (cells and "
                f"their values travel pickled); install it there and name it with --ssh-python, or run the notebook "
                f"on that Python")
        if found.sees_storage is False:
            raise SshHostError(f"{host} does not see the job storage {storage_path}: a file:// root must be a "
                               "directory every host shares; use --storage gs://BUCKET/PREFIX")
        if found.holders:
            pid, command = found.holders[0]
            more = f" (and {len(found.holders) - 1} more)" if len(found.holders) > 1 else ""
            raise SshHostError(f"{host}: its {device_name} is held by process {pid} ({command}){more}: a job, "
                               f"session or notebook there still runs; stop it (kill {pid}) and run the cell again")
        facts.append(found)
    return facts
