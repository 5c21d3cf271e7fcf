"""The agent's host processes: forked from the lean agent, tied to its life, counted before they start.

Linux process controls (parent-death signal, child subreaper) make sure no
host outlives its agent; elsewhere they are no-ops.
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal

#: File descriptors the agent holds for each host: its stdout, stderr and marks pipes and its pidfd.
FDS_PER_HOST = 4
#: Descriptors the agent needs besides its hosts' (storage clients, the selector, its log, slack).
FDS_RESERVED = 64
#: Processes one host may count against the user's process limit (RLIMIT_NPROC counts
#: threads): a JAX or torch host starts dozens of threads.
THREADS_PER_HOST = 64
#: Memory one host needs at the least (a forked interpreter that imports numpy); a
#: framework takes far more, but this is the floor below which nothing can run.
MIN_HOST_MEMORY_BYTES = 64 * 1024 * 1024
#: The most hosts the local backend starts: past this, one machine is not a slice.
MAX_LOCAL_HOSTS = 512
#: For tests and benchmarks only: with this set to 1, hosts with no framework count as light (the forked host
#: alone, about 7 MiB of its own) and up to MAX_LIGHT_HOSTS of them start, so that the real protocol, barrier,
#: hub, storage and panel run at a large slice's size on one machine. Nobody trains on such a slice.
LIGHT_HOSTS_ENV = "KINETIC_LIGHT_HOSTS"
#: The most light hosts: the largest slice a test or benchmark plays.
MAX_LIGHT_HOSTS = 1024
#: Memory a light host needs at the least: a forked host that runs no framework (measured: 6.6 MiB of its own
#: at 64 and 256 hosts), with room for what a test's cell holds.
MIN_LIGHT_HOST_MEMORY_BYTES = 16 * 1024 * 1024

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, value: int) -> None:
    """Linux process controls; elsewhere a no-op."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(option, value)
    except (AttributeError, OSError):
        pass


def process_start(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks after boot, ``/proc/PID/stat``), or None when it is gone or a
    zombie: with the pid, what tells a process from a later one that reused its pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()  # after the command name, which may hold anything
    except OSError:
        return None
    if fields[0] in (b"Z", b"X"):  # dead, not yet reaped
        return None
    return int(fields[19])


def die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL this process when its parent dies, and die now if it already has.

    The signal is armed after ``fork``: a parent killed in between would go
    unnoticed, so the parent is checked once more after arming it.
    """
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:
        os._exit(1)


def adopt_orphans() -> None:
    """Become the parent of whatever the hosts start and then abandon, so nothing outlives the job."""
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def end_adopted_orphans() -> None:
    """SIGKILL and reap every remaining child: descendants the hosts left behind."""
    me = str(os.getpid())
    try:
        pids = [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]
    except FileNotFoundError:
        pids = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                parent = stat.read().rsplit(")", 1)[1].split()[1]
        except (OSError, IndexError):
            continue
        if parent == me:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def raise_open_file_limit() -> int:
    """Raise this process's soft open-file limit to its hard limit; return the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def light_hosts(framework: str) -> bool:
    """Whether hosts of ``framework`` run as light hosts (:data:`LIGHT_HOSTS_ENV`: tests and benchmarks only)."""
    return framework == "none" and os.environ.get(LIGHT_HOSTS_ENV) == "1"


def host_count_problem(hosts: int, framework: str = "") -> str | None:
    """Why this machine cannot run ``hosts`` local hosts of ``framework``, in one line; None when it can.

    Checked before anything starts: the open files the agent would need (its
    hard limit, which it raises its soft limit to), the user's process limit,
    the memory available, and :data:`MAX_LOCAL_HOSTS` (:data:`MAX_LIGHT_HOSTS`
    for light hosts, :func:`light_hosts`).
    """
    light = light_hosts(framework)
    most_hosts = MAX_LIGHT_HOSTS if light else MAX_LOCAL_HOSTS
    floor = MIN_LIGHT_HOST_MEMORY_BYTES if light else MIN_HOST_MEMORY_BYTES
    if hosts > most_hosts:
        return (f"{hosts} host processes are more than the local backend runs (at most {most_hosts}): "
                "one machine is not a slice; use a cluster backend")
    _, hard_files = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard_files != resource.RLIM_INFINITY and hosts * FDS_PER_HOST + FDS_RESERVED > hard_files:
        most = max(0, (hard_files - FDS_RESERVED) // FDS_PER_HOST)
        return (f"{hosts} local hosts need about {hosts * FDS_PER_HOST + FDS_RESERVED} open files, and this "
                f"process may open {hard_files} (ulimit -n): at most {most} hosts here")
    soft_procs, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    if soft_procs != resource.RLIM_INFINITY and hosts * THREADS_PER_HOST > soft_procs:
        return (f"{hosts} local hosts may need {hosts * THREADS_PER_HOST} processes and threads, and this user "
                f"may run {soft_procs} (ulimit -u): at most {soft_procs // THREADS_PER_HOST} hosts here")
    memory = _available_memory()
    if memory is not None and hosts * floor > memory:
        return (f"{hosts} local hosts need at least {hosts * floor >> 20} MiB of memory and "
                f"{memory >> 20} MiB is available: at most {memory // floor} hosts here")
    return None
