"""One connection on this machine's loopback, carried to a session's hub by whatever a backend reaches it with:
the Kubernetes API's port-forward to host 0's pod, or calls to host 0's Ray actor.

A session's channel (``runner.channel``) dials an address; where the hub is not reachable at one, a backend
opens its own stream to it and hands the channel :attr:`CarriedConnection.address`, which accepts the one
connection the channel makes and copies it both ways. When either side ends, both do, and nothing stays
behind; a route nobody dials is closed after :data:`ACCEPT_WAIT_S`.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from typing import Protocol

__all__ = ["ACCEPT_WAIT_S", "CarriedConnection", "Stream", "answers"]

#: How long the local end waits for its one connection before it gives up and closes the stream.
ACCEPT_WAIT_S = 30.0
_CHUNK = 1 << 16
#: How long a backend tries the hub's own address before it carries the channel its own way instead
#: (from off the cluster's network an address there does not answer).
DIRECT_PROBE_S = 1.0


def answers(address: tuple[str, int], timeout: float = DIRECT_PROBE_S) -> bool:
    """Whether something listens at ``address`` and is reachable from here, within ``timeout``."""
    try:
        socket.create_connection(address, timeout=timeout).close()
    except OSError:
        return False
    return True


class Stream(Protocol):
    """What carries the bytes: ``recv`` (``b""`` at its end), ``sendall``, ``close``; a socket is one."""

    def recv(self, size: int) -> bytes: ...

    def sendall(self, data: bytes) -> None: ...

    def close(self) -> None: ...


class CarriedConnection:
    """A loopback listener at :attr:`address` whose one connection is copied to and from ``stream``."""

    def __init__(self, stream: Stream, name: str):
        self._stream = stream
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(ACCEPT_WAIT_S)
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        threading.Thread(target=self._carry, name=f"kinetic-{name}", daemon=True).start()

    def _carry(self) -> None:
        try:
            local, _ = self._listener.accept()
        except OSError:  # nobody came: the route was not used
            self._end(self._stream)
            return
        finally:
            self._listener.close()
        local.settimeout(None)
        threading.Thread(target=self._copy, args=(self._stream, local), name="kinetic-carried-in",
                         daemon=True).start()
        self._copy(local, self._stream)

    def _copy(self, source: Stream, target: Stream) -> None:
        """Copy ``source`` to ``target`` until either ends; then end both, so the other direction ends too."""
        try:
            while data := source.recv(_CHUNK):
                target.sendall(data)
        except OSError:
            pass
        finally:
            self._end(source)
            self._end(target)

    @staticmethod
    def _end(stream: Stream) -> None:
        with contextlib.suppress(OSError, AttributeError):
            stream.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            stream.close()
