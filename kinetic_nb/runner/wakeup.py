"""Wake a local session's host at once instead of at its next look at storage.

Each host of a session on a local disk sleeps on a unix datagram socket in
a 0700 directory of this user's (``~/.cache/kinetic_nb/agents/{session}/host-{i}.sock``,
a notebook waiting on a cell ``client-{pid}.sock`` beside them; a notebook
waiting on a one-shot job's cell has one too, in the job's directory, which
the job's agent wakes whenever a host ends): only this user can reach it. A datagram carries nothing but "look now": what
to do still comes from storage, verified as ever, so the socket needs no
signature and storage stays the record. Where no socket can be made (a long
path, a remote host), the host simply keeps looking at storage. Host-safe.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import select
import shutil
import socket
from pathlib import Path

from kinetic_nb.storage.defaults import user_directory, user_directory_path

#: Set (to "1") by an agent that runs every host of a job on the notebook's machine (the local backend): only there
#: do the notebook and the hosts reach each other's sockets. A host elsewhere (ssh, Ray, Kubernetes, a TPU VM,
#: sharing a disk with the notebook) would sleep on a socket nobody wakes: it looks at storage at a busy pace.
WOKEN_HOSTS_ENV = "KINETIC_WOKEN_HOSTS"


def session_socket_directory(session_id: str) -> Path:
    """Where a session's sockets live: one directory per session, so waking its notebooks lists a handful."""
    return Path(_socket_directory(session_id, os.environ.get("XDG_CACHE_HOME"), os.environ.get("HOME")))


@functools.lru_cache(maxsize=64)
def _socket_directory(session_id: str, cache_home: str | None, home: str | None) -> str:
    # Asked for several times a cell: worked out once per session (and per setting it follows from).
    return str(user_directory_path("agents") / session_id)


def wakeup_path(session_id: str, host_index: int) -> str:
    # Only named here (asked for on every cell); the socket's owner creates the directory when it binds.
    return f"{_socket_directory(session_id, os.environ.get('XDG_CACHE_HOME'), os.environ.get('HOME'))}" \
           f"/host-{host_index}.sock"


#: The folder, inside a session's, of the notebooks' sockets: a host that wakes them lists it, not the hosts'
#: sockets beside them (a look at 1,024 names by each of 1,024 hosts, every cell).
CLIENTS_FOLDER = "clients"


def client_wakeup_path(session_id: str) -> str:
    """A notebook's own socket for a session: its hosts wake it when they are back to idle."""
    return str(session_socket_directory(session_id) / CLIENTS_FOLDER / f"client-{os.getpid()}.sock")


def agent_wakeup_path(session_id: str) -> str:
    """A local session's agent's socket: a notebook that stored a control record (an interrupt) wakes it, so it
    looks now rather than at its next look."""
    return str(session_socket_directory(session_id) / "agent.sock")


def wake_clients(session_id: str) -> None:
    """Wake every notebook waiting on a cell of ``session_id`` (one look at the session's socket directory)."""
    directory = session_socket_directory(session_id) / CLIENTS_FOLDER
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            if name.startswith("client-"):
                wake(str(directory / name))


def last_to_end(count_path: str, hosts: int) -> bool:
    """Append this host's byte to a cell's count of ends at ``count_path`` (``protocol.CELL_ENDS``); whether it
    completed it: that host wakes the notebooks, where each host did (a look per host, at a thousand hosts a
    thousand looks). True where the count cannot be kept: a wake too many costs a look, one too few a pause."""
    try:
        fd = os.open(count_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError:
        return True
    try:
        os.write(fd, b".")  # appended whole: two hosts' bytes never land on one another
        return os.fstat(fd).st_size >= hosts
    except OSError:
        return True
    finally:
        os.close(fd)


def remove_session_sockets(session_id: str) -> None:
    """The session's socket directory, once its hosts have ended (a notebook's socket left behind goes too)."""
    shutil.rmtree(session_socket_directory(session_id), ignore_errors=True)


#: This process's one socket for sending wakeups (unbound: it only sends), made at the first, closed at exit.
_sender: socket.socket | None = None


def _close_sender() -> None:
    if _sender is not None:
        _sender.close()


atexit.register(_close_sender)


def wake(path: str) -> None:
    """Wake whoever sleeps on ``path``; nobody there is fine."""
    global _sender
    with contextlib.suppress(OSError):
        if _sender is None:
            sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            sender.setblocking(False)
            _sender = sender
        _sender.sendto(b"", path)


class Wakeup:
    """The socket one host sleeps on: :meth:`sleep` returns early when woken."""

    def __init__(self, path: str):
        self.path = path
        agents = user_directory("agents")  # 0700: only this user reaches the socket
        folders = []  # the socket's folder and those above it, up to the agents' own
        folder = os.path.dirname(path)
        while folder.startswith(f"{agents}{os.sep}") and not os.path.isdir(folder):
            folders.append(folder)
            folder = os.path.dirname(folder)
        for folder in reversed(folders or [os.path.dirname(path)]):
            with contextlib.suppress(FileExistsError):
                os.mkdir(folder, 0o700)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # left by a host that was killed
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self._socket.bind(path)
            os.chmod(path, 0o600)
        except OSError:
            self._socket.close()
            raise
        self._socket.setblocking(False)

    def sleep(self, seconds: float) -> None:
        """Wait up to ``seconds``, less if woken; every wakeup that arrived meanwhile is taken."""
        readable, _, _ = select.select([self._socket], [], [], seconds)
        if readable:
            self.take()

    def fileno(self) -> int:
        """For a selector that waits on this socket among others (the agent's)."""
        return self._socket.fileno()

    def take(self) -> None:
        """Take every wakeup that arrived."""
        while True:
            try:
                self._socket.recv(16)
            except (BlockingIOError, OSError):
                return

    def close(self) -> None:
        self._socket.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def open_wakeup(session_id: str, host_index: int) -> Wakeup | None:
    """This host's wakeup socket, or None where one cannot be made (storage is then looked at as ever)."""
    try:
        return Wakeup(wakeup_path(session_id, host_index))
    except OSError:
        return None
