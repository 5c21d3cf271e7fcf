"""A stand-in for the API server's ``pods/{name}/portforward`` subresource, spoken to by the official client.

No real API server can run here. This one plays, over a real websocket on
loopback, the part that ``kubernetes.stream.portforward`` relies on, as the
API server and kubelet do it (``pkg/kubelet/cri/streaming/portforward/
websocket.go`` of kubernetes/kubernetes, protocol ``v4.channel.k8s.io``):

- ``GET /api/v1/namespaces/{ns}/pods/{name}/portforward?ports=P`` upgraded
  to a websocket; a pod it does not know is answered 404, and a forbidden
  forward 403, each with the API's ``Status`` as the body, before any upgrade;
- two channels per port, data (0) and error (1), each opened with a frame of
  the port number (two bytes, little-endian); then every binary frame is its
  channel's byte and the data;
- the pod's port is dialled as the kubelet does it, in the pod's network:
  here ``pods[name]`` is the address it lies at on this machine. A port
  nobody listens on is reported on the error channel, as the kubelet reports
  it, and the stream closed.

``core()`` is a real ``CoreV1Api`` pointed at it, whose
``connect_get_namespaced_pod_portforward`` the backend calls.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import socket
import socketserver
import struct
import threading
from typing import Any
from urllib.parse import parse_qs, urlparse

from ..serving import serve_in_background

_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
PROTOCOL = "v4.channel.k8s.io"
_BINARY, _CLOSE, _PING, _PONG = 0x2, 0x8, 0x9, 0xA


def _status(code: int, reason: str, message: str) -> bytes:
    return json.dumps({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                       "message": message, "reason": reason, "code": code}).encode()


def _frame(opcode: int, payload: bytes) -> bytes:
    """A server's frame: final, unmasked."""
    head = bytes([0x80 | opcode])
    if len(payload) < 126:
        head += bytes([len(payload)])
    elif len(payload) < 1 << 16:
        head += bytes([126]) + struct.pack(">H", len(payload))
    else:
        head += bytes([127]) + struct.pack(">Q", len(payload))
    return head + payload


def _take(reader: Any, count: int) -> bytes:
    data = reader.read(count)
    if len(data) != count:
        raise ConnectionError("the client closed the stream")
    return data


def _read_frame(reader: Any) -> tuple[int, bytes]:
    """A client's frame (masked, as a client's must be) from ``reader`` (the socket's file): opcode, payload."""
    first, second = _take(reader, 2)
    length = second & 0x7F
    if length == 126:
        (length,) = struct.unpack(">H", _take(reader, 2))
    elif length == 127:
        (length,) = struct.unpack(">Q", _take(reader, 8))
    if not second & 0x80:
        raise ConnectionError("an unmasked frame from a client")
    mask = _take(reader, 4)
    payload = bytes(byte ^ mask[index % 4] for index, byte in enumerate(_take(reader, length)))
    return first & 0x0F, payload


class PortForwardServer:
    """The API server's port-forward, on loopback. ``pods`` maps a pod's name to the host its ports lie at here;
    ``forbidden`` makes every forward a 403, as RBAC without ``create`` on ``pods/portforward`` does. ``opened``
    counts the streams it opened."""

    def __init__(self, namespace: str, pods: dict[str, str] | None = None):
        self.namespace = namespace
        self.pods = dict(pods or {})
        self.forbidden = False
        self.opened = 0
        self._sockets: list[socket.socket] = []
        double = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                double._sockets.append(self.request)
                double._serve(self.request)

        self._server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.address = self._server.server_address[:2]
        serve_in_background(self._server, "port-forward-double")

    def core(self) -> Any:
        from kubernetes import client

        configuration = client.Configuration()
        configuration.host = f"http://{self.address[0]}:{self.address[1]}"
        return client.CoreV1Api(client.ApiClient(configuration))

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.close()

    def _serve(self, sock: socket.socket) -> None:
        try:
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = sock.recv(4096)
                if not chunk:
                    return
                head += chunk
            request_line, *lines = head.split(b"\r\n\r\n", 1)[0].decode().split("\r\n")
            headers = {name.strip().lower(): value.strip() for name, _, value in
                       (line.partition(":") for line in lines)}
            url = urlparse(request_line.split()[1])
            parts = url.path.strip("/").split("/")  # api v1 namespaces NS pods NAME portforward
            port = int(parse_qs(url.query)["ports"][0])
            if len(parts) != 7 or parts[:3] != ["api", "v1", "namespaces"] or parts[4] != "pods" \
                    or parts[6] != "portforward":
                return self._refuse(sock, 404, "NotFound", "the server could not find the requested resource")
            namespace, name = parts[3], parts[5]
            if self.forbidden:
                return self._refuse(sock, 403, "Forbidden", f'pods "{name}" is forbidden: User "tester" cannot '
                                    f'create resource "pods/portforward" in API group "" in the namespace '
                                    f'"{namespace}"')
            if namespace != self.namespace or name not in self.pods:
                return self._refuse(sock, 404, "NotFound", f'pods "{name}" not found')
            if PROTOCOL not in [offer.strip() for offer in headers.get("sec-websocket-protocol", "").split(",")]:
                return self._refuse(sock, 400, "BadRequest", "no websocket protocol this server speaks")
            accept = base64.b64encode(hashlib.sha1(headers["sec-websocket-key"].encode() + _GUID).digest())
            sock.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                         b"Sec-WebSocket-Accept: " + accept + b"\r\nSec-WebSocket-Protocol: " + PROTOCOL.encode()
                         + b"\r\n\r\n")
            self.opened += 1
            port_bytes = struct.pack("<H", port)
            sock.sendall(_frame(_BINARY, b"\x00" + port_bytes) + _frame(_BINARY, b"\x01" + port_bytes))
            try:
                target = socket.create_connection((self.pods[name], port), timeout=5)
            except OSError as error:
                message = (f"error forwarding port {port} to pod {name}, uid : failed to execute portforward in "
                           f"network namespace: dial tcp4 {self.pods[name]}:{port}: connect: {error.strerror}")
                sock.sendall(_frame(_BINARY, b"\x01" + message.encode()) + _frame(_CLOSE, struct.pack(">H", 1000)))
                return
            target.settimeout(None)
            self._sockets.append(target)
            threading.Thread(target=self._to_client, args=(target, sock), daemon=True).start()
            self._from_client(sock, target)
        except (OSError, ValueError, KeyError, IndexError):
            pass
        finally:
            with contextlib.suppress(OSError):
                sock.close()

    @staticmethod
    def _refuse(sock: socket.socket, code: int, reason: str, message: str) -> None:
        body = _status(code, reason, message)
        sock.sendall(f"HTTP/1.1 {code} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
                     "\r\nConnection: close\r\n\r\n".encode() + body)

    @staticmethod
    def _from_client(sock: socket.socket, target: socket.socket) -> None:
        reader = sock.makefile("rb")
        try:
            while True:
                opcode, payload = _read_frame(reader)
                if opcode == _CLOSE:
                    return
                if opcode == _PING:
                    sock.sendall(_frame(_PONG, payload))
                elif opcode == _BINARY and payload[:1] == b"\x00":
                    target.sendall(payload[1:])
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                target.shutdown(socket.SHUT_RDWR)
            target.close()

    @staticmethod
    def _to_client(target: socket.socket, sock: socket.socket) -> None:
        try:
            while data := target.recv(1 << 16):
                sock.sendall(_frame(_BINARY, b"\x00" + data))
            sock.sendall(_frame(_CLOSE, struct.pack(">H", 1000)))
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
