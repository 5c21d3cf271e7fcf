"""Where a session's hub listens (``runner.channel``), and who gets past its door.

Where: at an IP address, there alone; at a name (host 0's name as an ssh
config or a pod's DNS gives it), at the addresses the name resolves to on this
machine and on the loopback (a port-forward reaches a pod's loopback), never
on every interface; for a session on this machine, at a Unix socket in a 0700
directory of the session's own, so that no other user can even connect.

Who: a connection must prove it holds the session's key (``runner.channel_link``)
before the hub spends anything on it but a socket. Every connection still
proving itself is stepped by one thread, with no thread of its own; at most
:data:`MAX_ARRIVALS` of them are held at once (to make room for a new one, the
oldest that has not even said who it is goes: a peer says so as it connects
and proves itself a round trip later, so a flood of connections that say
nothing cannot keep it out), and each has one deadline for the whole
handshake. The accept loop never ends but with the hub: out of
file descriptors it lets the oldest arrival go, or pauses; any other error is
logged and the loop goes on. Refusals are logged as counts, at most once every
:data:`REFUSAL_LOG_INTERVAL_S`, so a flood does not become a flood of lines.
Host-safe: the standard library only.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import ipaddress
import logging
import os
import selectors
import socket
import stat
import threading
import time
from collections.abc import Callable

from kinetic_nb.errors import ChannelClosed, IntegrityError
from kinetic_nb.runner import channel_link
from kinetic_nb.runner.channel_link import Address, Arrival, Link, format_address
from kinetic_nb.runner.wakeup import session_socket_directory
from kinetic_nb.storage.defaults import user_directory

logger = logging.getLogger(__name__)

__all__ = ["MAX_ARRIVALS", "Door", "listen", "local_hub_path"]

#: Connections still proving themselves that the hub holds at once; a newer one makes the oldest go (once that one
#: has had ARRIVAL_GRACE_S to speak: until then the hub holds up to twice as many, then stops accepting a moment).
MAX_ARRIVALS = 128
#: Connections the kernel queues before the hub takes them: as many as it allows (a full queue drops a peer's
#: connection attempt, which it then makes again only a second later).
LISTEN_BACKLOG = socket.SOMAXCONN
#: Pause of the accept loop when the process has no descriptor to spare and no arrival to let go for one.
ACCEPT_BACKOFF_S = 0.1
#: How long a new connection may take to say who it is before it may be let go for a newer one: a peer says so
#: as it connects, but its thread may be descheduled between connect() and send() on a busy host; without this
#: a flood let a peer go within the same turn it was accepted, before its first bytes could be read.
ARRIVAL_GRACE_S = 0.02
#: Connections accepted in one go before the loop looks at the others again.
ACCEPTS_PER_TURN = 64
#: The loop wakes at least this often (deadlines, the refusal log, a close).
LOOP_WAKE_S = 0.5
#: Refusals are logged as counts, at most this often.
REFUSAL_LOG_INTERVAL_S = 10.0
#: Where a port-forward to a pod arrives: the pod's loopback.
LOOPBACK = "127.0.0.1"
#: The longest path a Unix socket may have (``sun_path``, its terminating zero included).
UNIX_PATH_MAX = 108
#: What accept() says when the process or machine is out of descriptors or memory: wait, then go on.
_OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
#: What accept() says about one connection that went before it was taken: go on.
_ONE_CONNECTION = frozenset({errno.ECONNABORTED, errno.EPROTO, errno.EPERM, errno.ENETDOWN, errno.ENOPROTOOPT,
                             errno.EHOSTDOWN, errno.ENONET, errno.EHOSTUNREACH, errno.EOPNOTSUPP,
                             errno.ENETUNREACH, errno.EINTR})


def _is_ip_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _resolve(name: str) -> list[str]:
    """The addresses ``name`` has here. A pod's DNS name may not resolve yet on the pod that bears it: then, if
    its first label is this machine's own name, that name's addresses (a pod's ``/etc/hosts`` holds it)."""
    try:
        found = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except socket.gaierror as error:
        own = socket.gethostname()
        if name.split(".")[0] != own.split(".")[0]:
            raise OSError(f"the hub's name {name} does not resolve here ({error})") from None
        found = socket.getaddrinfo(own, None, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(info[4][0] for info in found))


def local_hub_path(session_id: str, fallback_directory: str) -> str:
    """Where the hub of a session on this machine listens: ``hub.sock`` in the session's own 0700 directory,
    beside its wakeup sockets (``runner.wakeup``); where that path is too long for a Unix socket, in
    ``fallback_directory`` (the agent's 0700 scratch directory)."""
    directory = session_socket_directory(session_id)
    path = str(directory / "hub.sock")
    if len(os.fsencode(path)) >= UNIX_PATH_MAX:
        return os.path.join(fallback_directory, "hub.sock")
    user_directory("agents")  # 0700, this user's
    with contextlib.suppress(FileExistsError):
        os.mkdir(directory, 0o700)
    return path


def _listen_tcp(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=LISTEN_BACKLOG)


def _listen_unix(path: str) -> socket.socket:
    """A Unix socket at ``path``, in a directory that must be this user's alone (0700), itself 0600."""
    directory = os.path.dirname(path)
    info = os.lstat(directory)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
        raise PermissionError(f"the hub's directory {directory} is not this user's alone (0700): not listening "
                              "there")
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)  # left by an agent that was killed
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        os.chmod(path, 0o600)
        sock.listen(LISTEN_BACKLOG)
    except BaseException:
        sock.close()
        raise
    return sock


def listen(address: Address) -> list[socket.socket]:
    """The listening sockets for a hub told to be at ``address`` (see the module's docstring); ``OSError`` in one
    line where it cannot listen there."""
    if isinstance(address, str):
        return [_listen_unix(address)]
    host, port = address
    if _is_ip_address(host):
        return [_listen_tcp(host, port)]
    resolved = _resolve(host)
    sockets: list[socket.socket] = []
    try:
        for candidate in resolved:
            try:
                sockets.append(_listen_tcp(candidate, port or (sockets[0].getsockname()[1] if sockets else 0)))
            except OSError as error:
                if error.errno != errno.EADDRNOTAVAIL:  # an address of the name's that is not this machine's
                    raise
        if not sockets:
            raise OSError(f"the hub's name {host} resolves to {', '.join(resolved)}: none of them is this "
                          "machine's")
        if LOOPBACK not in resolved:
            sockets.append(_listen_tcp(LOOPBACK, sockets[0].getsockname()[1]))
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


class _Refusals:
    """Refused connections by why: counted, and logged as counts at most every REFUSAL_LOG_INTERVAL_S."""

    def __init__(self) -> None:
        #: Every refusal since the door opened, by why.
        self.total: collections.Counter[str] = collections.Counter()
        self._unsaid: collections.Counter[str] = collections.Counter()
        self._next_at = 0.0

    def note(self, why: str) -> None:
        self.total[why] += 1
        self._unsaid[why] += 1
        self.say_if_due()

    def say_if_due(self) -> None:
        now = time.monotonic()
        if self._unsaid and now >= self._next_at:
            logger.warning("channel: refused %s", "; ".join(f"{count} connection{'s' if count > 1 else ''}: {why}"
                                                            for why, count in self._unsaid.items()))
            self._unsaid.clear()
            self._next_at = now + REFUSAL_LOG_INTERVAL_S


class Door:
    """The hub's listening sockets and the loop that lets only proven peers in: ``admit(link)`` gets each
    (and may raise: that peer is then refused, the loop goes on). ``address`` is where it listens (the first
    socket's), ``announced`` what it says (the name it was given, with the port)."""

    def __init__(self, address: Address, secret: bytes, admit: Callable[[Link], None], *,
                 max_arrivals: int = MAX_ARRIVALS):
        channel_link.cipher_classes()
        self._listeners = listen(address)
        self._secret = secret
        self._admit = admit
        self._max_arrivals = max_arrivals
        self._arrivals: collections.OrderedDict[socket.socket, Arrival] = collections.OrderedDict()
        self.refusals = _Refusals()
        self._closed = False
        self._unix_path = address if isinstance(address, str) else None
        self._owner = os.getpid()  # a forked child closes its copy without removing the agent's socket
        if self._unix_path is not None:
            self.address: Address = self._unix_path
            self.announced = format_address(self._unix_path)
        else:
            self.address = self._listeners[0].getsockname()[:2]
            named = not _is_ip_address(address[0])
            self.announced = f"{address[0] if named else self.address[0]}:{self.address[1]}"
        #: Every address it listens at (``getsockname()`` of each socket).
        self.listening = [sock.getsockname() for sock in self._listeners]

    def start(self) -> None:
        for sock in self._listeners:
            sock.setblocking(False)
        threading.Thread(target=self._loop, name="kinetic-hub", daemon=True).start()

    def _loop(self) -> None:
        selector = selectors.DefaultSelector()
        listening, resume_at = False, 0.0
        try:
            while not self._closed:
                try:
                    if not listening and time.monotonic() >= resume_at:
                        for sock in self._listeners:
                            selector.register(sock, selectors.EVENT_READ)
                        listening = True
                    for key, _ in selector.select(self._wait(listening, resume_at)):
                        if key.data is not None:
                            self._step(key.data, selector)
                        elif listening:
                            pause = self._accept(key.fileobj, selector)
                            if pause:  # nothing to spare yet: stop listening a moment, then take them again
                                for sock in self._listeners:
                                    selector.unregister(sock)
                                listening, resume_at = False, time.monotonic() + pause
                    self._expire(selector)
                    self.refusals.say_if_due()
                except Exception as error:  # noqa: BLE001 - the door stays open: logged, a pause, and on
                    if self._closed:
                        return
                    self.refusals.note(f"the hub's own error ({type(error).__name__}: {error})")
                    time.sleep(ACCEPT_BACKOFF_S)
        finally:
            selector.close()
            for arrival in list(self._arrivals.values()):
                arrival.close()
            self._arrivals.clear()

    def _wait(self, listening: bool, resume_at: float) -> float:
        now = time.monotonic()
        wake = now + LOOP_WAKE_S
        if self._arrivals:
            wake = min(wake, next(iter(self._arrivals.values())).deadline)
        if not listening:
            wake = min(wake, resume_at)
        return max(0.0, wake - now)

    def _accept(self, listener: socket.socket, selector: selectors.BaseSelector) -> float:
        """Take what waits on ``listener``; how long to stop listening (0: go on) when the process has nothing to
        spare for it or every arrival is still within its grace."""
        for _ in range(ACCEPTS_PER_TURN):
            if len(self._arrivals) >= self._max_arrivals:
                pause = self._let_one_go(selector, f"let go unproven: {self._max_arrivals} connections were proving "
                                                   "themselves")
                if pause and len(self._arrivals) >= 2 * self._max_arrivals:
                    return pause  # (within the grace the cap may be overrun, to twice the cap at most)
            try:
                sock, _ = listener.accept()
            except BlockingIOError:
                return 0.0
            except OSError as error:
                if error.errno in _OUT_OF_RESOURCES:
                    self.refusals.note(f"accept failed: {os.strerror(error.errno)}")
                    pause = self._let_one_go(selector, "let go unproven to free a descriptor")
                    if pause:
                        return pause
                    continue
                if error.errno in _ONE_CONNECTION:
                    self.refusals.note(f"accept failed: {os.strerror(error.errno)}")
                    continue
                raise
            try:
                arrival = Arrival(sock, self._secret, time.monotonic() + channel_link.HANDSHAKE_TIMEOUT_S)
                selector.register(sock, selectors.EVENT_READ, arrival)
            except (OSError, ValueError) as error:
                sock.close()
                self.refusals.note(f"could not be watched ({error})")
                continue
            self._arrivals[sock] = arrival
            self._step(arrival, selector)  # a peer says who it is as it connects: answered at once
        return 0.0

    def _let_one_go(self, selector: selectors.BaseSelector, why: str) -> float:
        """Let the arrival go that a new connection may take the place of: the oldest that has not even said who it
        is (a peer does so as it connects, then proves itself within a round trip), else the oldest; never one
        within ARRIVAL_GRACE_S of its accept. 0 when one went, else how long until one may (at least a moment)."""
        if not self._arrivals:
            return ACCEPT_BACKOFF_S  # nothing to let go: the process itself is out of descriptors
        arrival = next((each for each in self._arrivals.values() if not each.answered),
                       next(iter(self._arrivals.values())))  # accepted in order: the first is the oldest
        wait = arrival.deadline - channel_link.HANDSHAKE_TIMEOUT_S + ARRIVAL_GRACE_S - time.monotonic()
        if wait > 0:
            return max(wait, 0.01)
        self._drop(arrival, selector, why)
        return 0.0

    def _step(self, arrival: Arrival, selector: selectors.BaseSelector) -> None:
        try:
            link = arrival.step()
        except IntegrityError:
            self._drop(arrival, selector, "did not prove the session's key")
            return
        except (ChannelClosed, OSError, ValueError):
            self._drop(arrival, selector, "closed before it proved itself")
            return
        if link is None:
            return
        self._forget(arrival, selector)
        try:
            self._admit(link)
        except Exception as error:  # noqa: BLE001 - a thread that would not start: that peer alone goes
            link.close()
            self.refusals.note(f"proven, but could not be served ({type(error).__name__}: {error})")

    def _expire(self, selector: selectors.BaseSelector) -> None:
        now = time.monotonic()
        while self._arrivals:
            oldest = next(iter(self._arrivals.values()))
            if oldest.deadline > now:
                return
            self._drop(oldest, selector, f"did not prove itself within {channel_link.HANDSHAKE_TIMEOUT_S:g} s")

    def _forget(self, arrival: Arrival, selector: selectors.BaseSelector) -> None:
        self._arrivals.pop(arrival.sock, None)
        with contextlib.suppress(KeyError, ValueError, OSError):
            selector.unregister(arrival.sock)

    def _drop(self, arrival: Arrival, selector: selectors.BaseSelector, why: str) -> None:
        self._forget(arrival, selector)
        arrival.close()
        self.refusals.note(why)

    def close(self) -> None:
        """Stop listening (the loop ends within LOOP_WAKE_S, closing what was still proving itself)."""
        self._closed = True
        for sock in self._listeners:
            with contextlib.suppress(OSError):
                sock.close()
        if self._unix_path is not None and os.getpid() == self._owner:
            with contextlib.suppress(OSError):
                os.unlink(self._unix_path)
