"""A ``ProxyCommand`` for the tests: ssh's connection to a TPU worker's external address, carried to the loopback
``sshd`` standing in for that worker (``python ssh_relay.py ADDRESS PORT``), as the internet carries it to a real
worker. Nothing else listens at the external addresses (TEST-NET-1, 192.0.2.0/24: no route), so a worker that
tried to reach a peer there would never get through."""

from __future__ import annotations

import os
import socket
import sys
import threading


def main() -> None:
    connection = socket.create_connection((sys.argv[1], int(sys.argv[2])))

    def upstream() -> None:
        while data := os.read(0, 65536):
            connection.sendall(data)
        connection.shutdown(socket.SHUT_WR)

    threading.Thread(target=upstream, daemon=True).start()
    while data := connection.recv(65536):
        os.write(1, data)


if __name__ == "__main__":
    main()
