"""A loopback TCP forwarder: what a port-forward to a session's hub is, with a delay each way and a cut.

``TcpForward(target, one_way_s=0.0125)`` listens on a free loopback port and
passes every byte on to ``target`` (an address, or a local hub's Unix socket)
and back, each ``one_way_s`` later (a round trip costs twice that, as a
request through the tests' delay proxy costs its delay once); :meth:`cut`
closes every connection and stops listening, as a killed ``kubectl
port-forward`` does.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
import time

from kinetic_nb.runner.channel_link import Address, open_socket


class TcpForward:
    def __init__(self, target: Address, *, one_way_s: float = 0.0):
        self.target = target
        self.one_way_s = one_way_s
        self._server = socket.create_server(("127.0.0.1", 0))
        self.address = self._server.getsockname()[:2]
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self.cut_at: float | None = None
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            try:
                upstream = open_socket(self.target, 10.0)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                if self.cut_at is not None:
                    client.close()
                    upstream.close()
                    return
                self._sockets += [client, upstream]
            self._pipe(client, upstream)
            self._pipe(upstream, client)

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        pending: queue.Queue[tuple[float, bytes]] = queue.Queue()

        def read() -> None:
            while True:
                try:
                    data = source.recv(1 << 16)
                except OSError:
                    data = b""
                pending.put((time.monotonic() + self.one_way_s, data))
                if not data:
                    return

        def write() -> None:
            while True:
                due, data = pending.get()
                time.sleep(max(0.0, due - time.monotonic()))
                if not data:
                    with contextlib.suppress(OSError):
                        sink.shutdown(socket.SHUT_WR)
                    return
                try:
                    sink.sendall(data)
                except OSError:
                    return

        threading.Thread(target=read, daemon=True).start()
        threading.Thread(target=write, daemon=True).start()

    def cut(self) -> None:
        """Every connection closed, and no new one: the forward is gone."""
        with self._lock:
            self.cut_at = time.monotonic()
            sockets, self._sockets = self._sockets, []
        with contextlib.suppress(OSError):
            self._server.close()
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()

    close = cut

    def __enter__(self) -> TcpForward:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cut()
