"""Ports for a job's coordinator and hub on host 0: chosen where little else lands, and checked before they are bound.

A launch asks host 0 for free ports (the ssh probe, a warm agent), and the
framework binds the coordinator's much later, in host 0's process (JAX's
coordination service, torch's store). A port free when asked can be taken in
between, and the framework cannot be handed a socket already bound: so the
ports are chosen below the kernel's ephemeral range, where no outgoing
connection or ``bind(port 0)`` on the machine is given one, and host 0 checks
the coordinator's port just before the framework binds it, failing in one line
(JAX itself dies of a segmentation fault on a port in use).

Host-safe: the standard library only. :func:`free_ports` is also run, as its
source, by the ssh probe on a host that has no kinetic_nb yet.
"""

from __future__ import annotations

import errno
import socket

from kinetic_nb.errors import CoordinatorPortTakenError

__all__ = ["check_coordinator_port", "free_ports"]


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports free on this machine now, below its ephemeral range where it has room there.

    Parameters
    ----------
    count : int
        How many ports.

    Returns
    -------
    list of int
        Ports that were all free at once (each held while the others were found), chosen at random from the lower
        half of the range below ``net.ipv4.ip_local_port_range`` (16384-32767 by default), where the kernel gives
        no connection a port; any free port where that range is too small or full.
    """
    import random
    import socket

    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ranges:
            ephemeral_low = int(ranges.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 0
    first = max(1024, ephemeral_low // 2)
    held, found = [], []
    try:
        for _ in range(64 * count if ephemeral_low - first >= 1024 else 0):
            if len(found) == count:
                break
            port = random.randrange(first, ephemeral_low)
            probe = socket.socket()
            try:
                probe.bind(("", port))
            except OSError:
                probe.close()
                continue
            held.append(probe)
            found.append(port)
        while len(found) < count:  # no room below the ephemeral range: any port the kernel gives
            probe = socket.socket()
            held.append(probe)
            probe.bind(("", 0))
            found.append(probe.getsockname()[1])
    finally:
        for probe in held:
            probe.close()
    return found


def check_coordinator_port(address: str, host_label: str = "host 0") -> None:
    """Fail in one line if ``address``'s port is taken on this machine: called on the coordinator's host just
    before its framework binds it (which, for JAX, would kill the process with a segmentation fault).

    Parameters
    ----------
    address : str
        The coordinator's ``host:port``.
    host_label : str
        How the error names this host.

    Raises
    ------
    CoordinatorPortTakenError
        Another process holds the port (it was free when the launch chose it).
    """
    port = int(address.rsplit(":", 1)[1])
    family = socket.AF_INET6 if socket.has_ipv6 else socket.AF_INET
    try:
        probe = socket.socket(family, socket.SOCK_STREAM)
    except OSError:  # no IPv6 on this host after all
        family, probe = socket.AF_INET, socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    with probe:
        # As the frameworks bind it: reusing a port whose last connection is closing, every address of both families.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        try:
            probe.bind(("::" if family == socket.AF_INET6 else "", port))
        except OSError as error:
            if error.errno != errno.EADDRINUSE:
                raise
            raise CoordinatorPortTakenError(
                f"{host_label}'s coordinator port {port} was taken by another process after the launch chose it: "
                "nothing of the cell ran; run it again (the next launch picks another port)") from None
