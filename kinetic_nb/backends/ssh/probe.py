"""What each ssh host is, asked of all of them at once before anything of a job runs there.

One small Python program per host, over its connection: the interpreter's
version and where it is (an environment kept on the host is that interpreter's
own), whether the job's ``file://`` storage is a directory its user can use
(or one it sees but cannot enter, read or write), and (on
host 0) free ports for the framework's coordinator and a session's hub, chosen
below the kernel's ephemeral range (``runner.ports``): a port is probed, then
bound later by the framework, and no connection made in between can be given
one there; host 0 checks the coordinator's again just before it is bound. Each answer that rules a
host out is one line naming the host and the way out.

Whether a TPU VM's chips are free is asked two ways. The processes whose open
files name a chip (``/proc/PID/fd``, readable for this user's processes, and
all of them for root), and libtpu's own lock: a program that uses the chips
holds ``/tmp/libtpu_lockfile`` (or, where that file is another user's and closed
to this one, a file of this user's own) with ``lockf(F_TLOCK)``, a POSIX write
lock on the whole file, for its whole life. The probe asks ``F_GETLK`` whether
that lock could be taken, which takes nothing and names the holder's pid; a
file it cannot open is looked up in ``/proc/locks`` by its device and inode. So
another user's program, whose open files are not this user's to read, is still
named, with its user (``/proc/PID/status`` says it); a file a killed program
left, which no process holds, is free. The chips themselves are never opened:
a TPU driver may act on its device being opened for writing (gasket's gives
the chip to the opening process, and runs the chip's close handler at its last
close), and ``O_EXCL`` without ``O_CREAT`` asks nothing of a character device.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import re
import sys
from collections.abc import Sequence

from kinetic_nb.backends.ssh.connections import Connections
from kinetic_nb.errors import SshHostError
from kinetic_nb.runner.ports import free_ports

__all__ = ["DEFAULT_PYTHON", "LIBTPU_LOCK_FILES", "ChipHolder", "HostFacts", "probe_hosts"]

#: The interpreter a host runs kinetic_nb with unless told (``--ssh-python``); where it is another minor version
#: than the notebook's, the pool installs the notebook's there (``python_install``) and runs that one instead.
DEFAULT_PYTHON = "python3"

#: The files libtpu takes its lock on (``{uid}``: the user's id, ``~``: its home): the shared one, then libtpu's
#: own fallbacks where the shared one is another user's file closed to this one. A program that uses a host's TPU
#: holds one of them for its whole life; a file no process holds is a stale one, which frees nothing and stops
#: nothing.
LIBTPU_LOCK_FILES = ("/tmp/libtpu_lockfile", "/tmp/libtpu_lock_{uid}/libtpu_lockfile", "~/.libtpu_lockfile")

#: Runs on each host with its own Python (any 3.x): argv[1] is a path to look for ("" for none), argv[2] how many
#: free ports to find (``runner.ports.free_ports``, its source included: below the ephemeral range, where no
#: connection made meanwhile takes one), argv[3] device paths (comma-separated prefixes) whose holders to name,
#: argv[4] lock files (comma-separated) whose holder holds those devices.
_PROBE = "from __future__ import annotations\n" + inspect.getsource(free_ports) + r"""
import fcntl, json, os, pwd, re, socket, struct, sys
def name_of(uid):
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)
def owner_of(pid):
    # The user a process runs as (its real uid): /proc/PID/status is readable whoever's it is.
    with open(f"/proc/{pid}/status") as file:
        for line in file:
            if line.startswith("Uid:"):
                return name_of(int(line.split()[1]))
    return ""
def command_of(pid):
    with open(f"/proc/{pid}/cmdline", "rb") as file:
        command = " ".join(file.read().replace(b"\0", b" ").decode(errors="replace").split())  # one line
    ours = re.search(r"\bk[ns]-\d{8}-\d{6}-[0-9a-f]+", command) if "kinetic_nb" in command else None
    if ours and ours.group(0) not in command[:200]:  # a kinetic_nb job's id stays, however long the rest
        command = command[:200 - len(ours.group(0)) - 5] + " ... " + ours.group(0)
    return command[:200]
# struct flock as Linux lays it out: l_type, l_whence, l_start, l_len (off_t: 64 bits), l_pid.
FLOCK = "hhqqi"
def lock_holder(path):
    # The pid of the process holding libtpu's lock on ``path`` (0: one this host's /proc does not show, another
    # PID namespace's), or None where no process holds it: no such file, or a stale one.
    try:
        status = os.stat(path)
    except OSError:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError:  # another user's file, closed to this one
        return listed_holder(status)
    try:  # F_GETLK: could this process take the write lock libtpu takes? It takes nothing.
        kind, _, _, _, pid = struct.unpack(FLOCK, fcntl.fcntl(fd, fcntl.F_GETLK,
                                                               struct.pack(FLOCK, fcntl.F_WRLCK, 0, 0, 0, 0)))
    except (OSError, struct.error):
        return listed_holder(status)
    finally:
        os.close(fd)
    return None if kind == fcntl.F_UNLCK else max(pid, 0)
def listed_holder(status):
    # The same question asked of /proc/locks, which lists every lock with its file's device and inode.
    try:
        with open("/proc/locks") as file:
            lines = file.read().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) < 8 or fields[1] == "->":  # "->": a process waiting for the lock, not its holder
            continue
        try:
            major, minor, inode = fields[5].split(":")
            if (int(major, 16), int(minor, 16), int(inode)) == (os.major(status.st_dev), os.minor(status.st_dev),
                                                                 status.st_ino):
                return max(int(fields[4]), 0)  # an open file description's lock (OFD) names no pid: -1
        except ValueError:  # a line of another shape
            continue
    return None
def storage_access(path):
    # Whether the user can use the directory ``path``, and where it is closed to the user: [folder, what the user
    # cannot do there, its owner, its mode], else None. Walked down from the root: a folder the user cannot enter
    # hides what is below it, so "not there" is said only where the user can look.
    path = os.path.abspath(path)
    parts = [part for part in path.split("/") if part]
    for depth in range(len(parts) + 1):
        folder = "/" + "/".join(parts[:depth])
        try:
            status = os.stat(folder)
        except FileNotFoundError:
            return False, None
        except OSError:
            return False, [folder, "enter", None, None]
        wanted = [("enter", os.X_OK)] + ([("read", os.R_OK), ("write to", os.W_OK)] if folder == path else [])
        for verb, mode in wanted:
            if not os.access(folder, mode):
                return False, [folder, verb, name_of(status.st_uid), oct(status.st_mode & 0o7777)]
    return os.path.isdir(path), None
answer = {"python": list(sys.version_info[:3]), "executable": sys.executable, "hostname": socket.gethostname(),
          "sees": None, "ports": [], "holders": [], "user": name_of(os.getuid()),
          "interpreter": [os.path.realpath(sys.executable), sys.prefix]}
if sys.argv[1]:
    answer["sees"], answer["closed"] = storage_access(sys.argv[1])
answer["ports"] = free_ports(int(sys.argv[2]))
devices = tuple(prefix for prefix in sys.argv[3].split(",") if prefix)
for pid in (name for name in os.listdir("/proc") if name.isdigit() and devices and int(name) != os.getpid()):
    try:
        opened = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        if any(path.startswith(devices) for path in opened):
            answer["holders"].append([int(pid), command_of(pid), owner_of(pid), ""])
    except OSError:  # gone, or another user's (not ours to read: its lock, below, may still name it)
        continue
named = {holder[0] for holder in answer["holders"]}
for lock in (path for path in sys.argv[4].split(",") if path and devices):
    pid = lock_holder(os.path.expanduser(lock.replace("{uid}", str(os.getuid()))))
    if pid is None or (pid and pid in named):
        continue
    try:
        answer["holders"].append([pid, command_of(pid), owner_of(pid), lock] if pid else [0, "", "", lock])
    except OSError:  # it ended meanwhile, and its lock with it
        continue
    named.add(pid)
print(json.dumps(answer))
"""
#: Ports host 0 finds: the framework's coordinator's, and a session's hub's.
HOST_0_PORTS = 2
#: A kinetic_nb job's or session's id in a process's command line (its agent's ``--job`` URI ends with it).
_KINETIC_ID = re.compile(r"\bk[ns]-\d{8}-\d{6}-[0-9a-f]+")


@dataclasses.dataclass(frozen=True)
class ChipHolder:
    """A process holding a host's chips, as the probe found it."""

    #: Its pid on the host; 0 where the host's ``/proc`` does not show it (another PID namespace's: a container's).
    pid: int
    #: Its command line, one line (a kinetic_nb job's or session's id kept in it); "" where unknown.
    command: str
    #: The user it runs as; "" where unknown.
    user: str
    #: libtpu's lock file it holds, where that is how it was found (its open files are not this user's to read),
    #: else "".
    lock: str = ""


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
    #: The processes holding one of the devices asked about (a TPU VM's chips), or libtpu's lock.
    holders: tuple[ChipHolder, ...] = ()
    #: The user the host's commands run as.
    user: str = ""
    #: The interpreter's resolved path and its prefix (a virtual environment's own folder).
    interpreter: tuple[str, str] = ("", "")
    #: When the storage is there but closed to ``user``: the folder, what the user cannot do there ("enter",
    #: "read", "write to"), its owner and mode (None when unknown).
    storage_closed: tuple[str, str, str | None, str | None] | None = None

    def environments_key(self) -> str:
        """The name of the folder this host keeps this interpreter's environments in: its version, and a hash of
        its resolved path and prefix. An environment made from one interpreter (its ``venv`` links to it, and
        sees its packages) is never another's, whatever else is the same."""
        identity = json.dumps([*self.interpreter, list(self.python)]).encode()
        return f"python{'.'.join(map(str, self.python))}-{hashlib.sha256(identity).hexdigest()[:12]}"


def probe_hosts(connections: Connections, *, python: str | Sequence[str] = DEFAULT_PYTHON,
                storage_path: str | None = None, notebook_python: tuple[int, int] = sys.version_info[:2],
                ports: int = HOST_0_PORTS, devices: tuple[str, ...] = (), device_name: str = "device",
                lock_files: tuple[str, ...] | None = None, other_versions: bool = False) -> list[HostFacts]:
    """Every host's facts, asked at once of ``python`` (or of each host's own: ``python[index]``); ``SshHostError``
    with one line for the lowest host that cannot run the job: no such Python, another minor version than the
    notebook's (unless ``other_versions``: the caller installs the notebook's there), no sight of ``storage_path``
    (a ``file://`` root, which every host must share), a ``storage_path`` it sees but its user cannot enter, read
    or write (named with the user and the closed folder), or a process holding one of ``devices`` (paths by their
    prefix: a TPU VM's chips, its ``device_name``) or the lock of one of ``lock_files`` (None: libtpu's,
    :data:`LIBTPU_LOCK_FILES`, whenever ``devices`` are asked about), named with its pid, command and, where it is
    not the user the host's commands run as, its user."""
    pythons = [python] * len(connections.hosts) if isinstance(python, str) else list(python)
    locks = ",".join(LIBTPU_LOCK_FILES if lock_files is None else lock_files)
    answers = connections.run_each(lambda index: [pythons[index], "-c", _PROBE, storage_path or "",
                                                  str(ports if index == 0 else 0), ",".join(devices), locks],
                                   timeout=60)
    facts = []
    for host, python, answer in zip(connections.hosts, pythons, answers, strict=True):
        if answer.returncode != 0:
            said = answer.stderr.decode(errors="replace").strip().splitlines()
            if answer.returncode == 127 or (said and "not found" in said[-1]):
                raise SshHostError(f"{host} has no {python}: install Python "
                                   f"{notebook_python[0]}.{notebook_python[1]} there, or name one with --ssh-python")
            raise SshHostError(f"{host}: {python} could not run the probe: {said[-1] if said else 'no message'}")
        record = json.loads(answer.stdout.decode().strip().splitlines()[-1])
        closed = record.get("closed")
        found = HostFacts(tuple(record["python"]), record["executable"], record["hostname"], record["sees"],
                          tuple(record["ports"]), tuple(ChipHolder(*holder) for holder in record["holders"]),
                          record["user"], tuple(record["interpreter"]),
                          tuple(closed) if closed else None)
        if found.python[:2] != tuple(notebook_python) and not other_versions:
            raise SshHostError(
                f"{host} runs Python {'.'.join(map(str, found.python))} ({found.executable}) and this notebook "
                f"{notebook_python[0]}.{notebook_python[1]}: the hosts need the notebook's minor version (cells and "
                f"their values travel pickled); install it there and name it with --ssh-python, or run the notebook "
                f"on that Python")
        if found.storage_closed is not None:
            raise SshHostError(_closed_storage(host, found, storage_path))
        if found.sees_storage is False:
            raise SshHostError(f"{host} does not see the job storage {storage_path}: a file:// root must be a "
                               "directory every host shares; use --storage gs://BUCKET/PREFIX")
        if found.holders:
            raise SshHostError(_held(host, device_name, found.holders, found.user))
        facts.append(found)
    return facts


def _held(host: object, device_name: str, holders: tuple[ChipHolder, ...], user: str) -> str:
    """One line for a host whose chips a process holds: a kinetic_nb job's or session's is ended the way it was
    started (from a notebook), anything else by its pid; another user's (``user`` runs the host's commands) is
    named with its user, who ends it (or root)."""
    holder = holders[0]
    more = f" (and {len(holders) - 1} more)" if len(holders) > 1 else ""
    if not holder.pid:
        return (f"{host}: its {device_name} is held: libtpu's lock {holder.lock} is taken by a process this host's "
                f"/proc does not show (another PID namespace's, a container's){more}: stop it there and run the cell "
                "again")
    theirs = holder.user if holder.user and holder.user != user else ""
    lock = f", which holds libtpu's lock {holder.lock}" if holder.lock else ""
    ours = _KINETIC_ID.search(holder.command)  # the probe keeps a kinetic_nb process's id in its line
    if ours is not None:
        kind = "session" if ours.group(0).startswith("ks-") else "job"
        whose = f"user {theirs}'s " if theirs else ""
        held = f"{host}: its {device_name} is held by {whose}kinetic_nb {kind} {ours.group(0)} (process {holder.pid})" \
               f"{lock}{more}: "
        if kind == "session" and theirs:
            return held + f"ask {theirs} to end it with %kinetic stop in its notebook, and run the cell again"
        if kind == "session":
            return held + (f"end it with %kinetic stop in its notebook (from another: %kinetic attach "
                           f"{ours.group(0)}, then %kinetic stop), and run the cell again")
        if theirs:
            return held + f"ask {theirs} to let it end, or to end it with %kinetic cancel {ours.group(0)}, and run " \
                          "the cell again"
        return held + f"let it end, or end it with %kinetic cancel {ours.group(0)}, and run the cell again"
    if theirs:
        kill = "kill" if user == "root" else "sudo kill"
        return (f"{host}: its {device_name} is held by process {holder.pid} of user {theirs} ({holder.command})"
                f"{lock}{more}: a job, session or notebook of theirs still runs there; ask {theirs} to stop it, or "
                f"stop it as root ({kill} {holder.pid}), and run the cell again")
    return (f"{host}: its {device_name} is held by process {holder.pid} ({holder.command}){lock}{more}: a job, "
            f"session or notebook there still runs; stop it (kill {holder.pid}) and run the cell again")


def _closed_storage(host: object, found: HostFacts, storage_path: str) -> str:
    """One line for a host whose user cannot use the ``file://`` storage it sees: who, where, and the way out."""
    folder, verb, owner, mode = found.storage_closed
    whose = f" ({owner}'s, mode {mode[2:].zfill(4)})" if owner is not None and mode is not None else ""
    return (f"{host} sees the job storage {storage_path}, but its user {found.user} cannot {verb} {folder}{whose}: "
            f"a file:// root must be open to every host's user; give {found.user} access to it (a group they "
            "share), log in as its owner, or use --storage gs://BUCKET/PREFIX")
