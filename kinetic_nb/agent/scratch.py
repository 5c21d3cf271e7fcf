"""An agent's scratch folder (its hosts' stacks files, the shipped folder's copy, a hub's socket), held while it
lives, and the sweep that removes the folders of agents that were killed before they could remove their own.

An agent removes its scratch as it ends; one that is SIGKILLed cannot (a Ray actor that died takes its agent with
it by the parent-death signal, an out-of-memory kill, a machine's shutdown), and each such folder holds a copy of
the user's folder. So an agent's scratch holds a lock (``flock`` on :data:`ALIVE`, taken before the file has that
name) for as long as the agent or a host it forked lives, and every agent that starts removes, in the background,
this user's scratch folders in the same temporary folder whose lock nobody holds.

Host-safe: the standard library only.
"""

from __future__ import annotations

import contextlib
import fcntl
import fnmatch
import os
import shutil
import tempfile
import threading

#: The file whose lock says an agent, or a host it forked, still uses its scratch folder.
ALIVE = ".alive"
#: An agent's scratch folder's name: ``kinetic-{job_id}-agent-{random}``.
PATTERN = "kinetic-*-agent-*"


class Scratch:
    """This agent's scratch folder in ``folder`` (the temporary folder), locked from its first moment."""

    def __init__(self, job_id: str, folder: str | None = None):
        self.path = tempfile.mkdtemp(prefix=f"kinetic-{job_id}-agent-", dir=folder)
        claiming = os.path.join(self.path, f"{ALIVE}-claiming")
        self._lock = os.open(claiming, os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o600)
        fcntl.flock(self._lock, fcntl.LOCK_EX)
        os.rename(claiming, os.path.join(self.path, ALIVE))  # a sweep finds it only once it is held

    def remove(self) -> None:
        remove_lock_last(self.path)
        os.close(self._lock)


def remove_lock_last(path: str) -> None:
    """Remove scratch folder ``path``, its lock file last: a removal cut short (its agent killed meanwhile) leaves
    the lock file, so the next sweep finishes it."""
    try:
        entries = list(os.scandir(path))
    except OSError:
        return
    for entry in entries:
        if entry.name == ALIVE:
            continue
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(entry.path)
    with contextlib.suppress(OSError):
        os.unlink(os.path.join(path, ALIVE))
        os.rmdir(path)


def sweep_abandoned(folder: str | None = None) -> list[str]:
    """Remove this user's agent scratch folders in ``folder`` (the temporary folder) whose lock nobody holds;
    return their paths. A folder with no lock file (an agent starting, or another program's) is left alone."""
    folder = folder or tempfile.gettempdir()
    removed = []
    try:
        entries = [entry for entry in os.scandir(folder) if fnmatch.fnmatchcase(entry.name, PATTERN)]
    except OSError:
        return removed
    for entry in entries:
        try:
            if not entry.is_dir(follow_symlinks=False) or entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
            lock = os.open(os.path.join(entry.path, ALIVE), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its agent, or a host of it, lives
            os.close(lock)
            continue
        remove_lock_last(entry.path)
        os.close(lock)
        removed.append(entry.path)
    return removed


def sweep_in_background(folder: str | None = None) -> threading.Thread:
    """:func:`sweep_abandoned`, off the agent's way to starting its hosts."""
    thread = threading.Thread(target=sweep_abandoned, args=(folder,), name="kinetic-scratch-sweep", daemon=True)
    thread.start()
    return thread
