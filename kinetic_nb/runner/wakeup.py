"""Wake a local session's host at once instead of at its next look at storage.

Each host of a session on a local disk sleeps on a unix datagram socket in
this user's 0700 directory (``~/.cache/kinetic_nb/agents/{session}-{i}.sock``):
only this user can reach it. A datagram carries nothing but "look now": what
to do still comes from storage, verified as ever, so the socket needs no
signature and storage stays the record. Where no socket can be made (a long
path, a remote host), the host simply keeps looking at storage. Host-safe.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket

from kinetic_nb.storage.defaults import user_directory, user_directory_path


def wakeup_path(session_id: str, host_index: int) -> str:
    # Only named here (asked for on every cell); the socket's owner creates the directory when it binds.
    return str(user_directory_path("agents") / f"{session_id}-{host_index}.sock")


def client_wakeup_path(session_id: str) -> str:
    """A notebook's own socket for a session: its hosts wake it when they are back to idle."""
    return str(user_directory_path("agents") / f"{session_id}-client-{os.getpid()}.sock")


def wake_clients(session_id: str) -> None:
    """Wake every notebook waiting on a cell of ``session_id`` (one look at this user's agents directory)."""
    directory = user_directory_path("agents")
    prefix = f"{session_id}-client-"
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            if name.startswith(prefix) and name.endswith(".sock"):
                wake(str(directory / name))


def wake(path: str) -> None:
    """Wake whoever sleeps on ``path``; nobody there is fine."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sender:
        sender.setblocking(False)
        sender.sendto(b"", path)


class Wakeup:
    """The socket one host sleeps on: :meth:`sleep` returns early when woken."""

    def __init__(self, path: str):
        self.path = path
        user_directory("agents")  # 0700: only this user reaches the socket
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
        while readable:
            try:
                self._socket.recv(16)
            except BlockingIOError:
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
