"""A notebook outside the cluster reaches a port of a pod the way ``kubectl port-forward`` does: through the API
server, over the official client's websocket port-forward (``pods/portforward``).

:func:`pod_port_forward` opens the stream at once, so that a refusal (no such pod, no right to forward to it)
is one line where the route is asked for, and gives the loopback address that carries the one connection it is
for: a session's channel to its hub (``backends.forward``).
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

from kinetic_nb.backends.forward import CarriedConnection
from kinetic_nb.backends.kubernetes.api import api_message
from kinetic_nb.errors import KineticError

__all__ = ["pod_port_forward"]


class _ForwardedPort:
    """One port of an open port-forward, as a stream: its end of the client's socket pair (the client's thread
    copies it to and from the websocket), and the forward closed with it."""

    def __init__(self, forward: Any, port: int):
        self._forward = forward
        self._socket = forward.socket(port)

    def recv(self, size: int) -> bytes:
        return self._socket.recv(size)

    def sendall(self, data: bytes) -> None:
        self._socket.sendall(data)

    def shutdown(self, how: int) -> None:
        self._socket.shutdown(how)

    def close(self) -> None:
        self._forward.close()


def pod_port_forward(api: Any, namespace: str, pod: str, port: int) -> tuple[str, int]:
    """``port`` of pod ``pod`` in ``namespace``, carried to the loopback address returned, for one connection.

    Raises
    ------
    KineticError
        One line: the API server refused the forward (the pod is gone, or these credentials may not create
        ``pods/portforward`` in the namespace).
    """
    from kubernetes.stream import portforward

    try:
        forward = portforward(api.core.connect_get_namespaced_pod_portforward, pod, namespace, ports=str(port))
    except Exception as error:  # an ApiException, or the websocket's own handshake error
        raise KineticError(f"no port-forward to pod {namespace}/{pod}:{port} through the Kubernetes API "
                           f"({_refusal(error)})") from error
    return CarriedConnection(_ForwardedPort(forward, port), f"port-forward-{pod}").address


def _refusal(error: BaseException) -> str:
    """The API server's message. The client raises an ``ApiException`` with no body while handling websocket-
    client's ``WebSocketBadStatusException``, which holds the server's answer: its status and ``Status`` body."""
    for candidate in (error, error.__cause__, error.__context__):
        with contextlib.suppress(AttributeError, ValueError, KeyError, TypeError):
            return f"{candidate.status_code} {json.loads(candidate.resp_body)['message']}"
    return api_message(error)
