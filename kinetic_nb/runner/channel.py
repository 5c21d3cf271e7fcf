"""A session's direct channel: records travel from whoever writes them to whoever waits on them, not through a
bucket.

The hub lives in the agent of the session's leader host. It listens on one
TCP address, which it announces sealed in ``channel.json``; its hosts get it
in their environment (:data:`CHANNEL_ENV`), a notebook from that record,
through whatever route its backend knows (locally the address itself). A
message is one record as storage would hold it: a name below the session and
the sealed bytes the writer would store (so a reader verifies it under the
cell's key as it verifies the same object read from storage), or, for an
object too large to carry, a notice that it is in storage. The hub keeps the
latest of each name, gives a newcomer what it holds, and passes every message
on: to notebooks all of it, to hosts what hosts read (no host's records, no
output). Storage stays the record: every writer still stores what it sends,
later and at most once a second per name (``runner.relayed``).

Nobody without the session's key can join or speak: a connection starts with
a challenge each way under a key derived from the session's key, and every
frame carries an HMAC under a key of that connection, over its direction and
its number in the stream, so a frame altered, replayed, reordered or moved to
another connection is refused and the connection closed. Host-safe: the
standard library only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import hmac
import ipaddress
import json
import logging
import os
import queue
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable

from kinetic_nb.errors import ChannelClosed, IntegrityError
from kinetic_nb.runner import protocol
from kinetic_nb.runner.job_keys import derived_key

logger = logging.getLogger(__name__)

__all__ = ["CHANNEL_ENV", "Channel", "Hub", "Joining", "Link", "Mirror", "Stored", "agent_role", "connect", "host_role",
           "parse_address"]

#: How a session's host is told where its hub listens (``host:port``).
CHANNEL_ENV = "KINETIC_CHANNEL"
_MAGIC = b"KNC1"
_NONCE_BYTES = 32
_TAG_BYTES = 32
#: A frame larger than this is refused (objects larger than ``runner.relayed.CARRY_MAX_BYTES`` travel by storage).
MAX_FRAME_BYTES = 64 << 20
#: Seconds a connection may take to prove itself.
HANDSHAKE_TIMEOUT_S = 10.0
#: Pause between two tries to join a hub that does not answer (yet).
JOIN_RETRY_S = 0.2
NOTEBOOK = "notebook"


def host_role(index: int) -> str:
    """How the process of rank ``index`` (a host's, where each runs one) names itself on the channel."""
    return f"host-{index}"


def agent_role(index: int) -> str:
    """How the agent of host ``index`` (one of an agent per host, not the hub's) names itself on the channel."""
    return f"agent-{index}"


def parse_address(text: str) -> tuple[str, int] | None:
    """``host:port`` as a pair; None when ``text`` is not one."""
    host, _, port = text.rpartition(":")
    return (host, int(port)) if host and port.isdigit() else None


def channel_key(key: bytes) -> bytes:
    return derived_key(key, "channel")


def _tag(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"\0".join(parts), hashlib.sha256).digest()


def _receive_exactly(sock: socket.socket, count: int) -> bytes:
    data = bytearray()
    while len(data) < count:
        chunk = sock.recv(count - len(data))
        if not chunk:
            raise ChannelClosed("the other end closed the channel")
        data += chunk
    return bytes(data)


@dataclasses.dataclass(frozen=True)
class Stored:
    """An object the channel does not carry (too large): read it from storage."""


STORED = Stored()


class Link:
    """One proven connection, either end: frames out and in, each tagged under the connection's key, numbered
    each way."""

    def __init__(self, sock: socket.socket, key: bytes, *, outgoing: bytes, incoming: bytes, role: str):
        self.sock = sock
        self.role = role
        self._key = key
        self._out, self._in = outgoing, incoming
        self._sent = 0
        self._received = 0
        self._send_lock = threading.Lock()
        self.closed = False

    def send(self, header: dict, data: bytes | None = b"") -> None:
        head = json.dumps(header, separators=(",", ":")).encode()
        body = struct.pack(">I", len(head)) + head + (data or b"")
        with self._send_lock:
            tag = _tag(self._key, self._out, struct.pack(">Q", self._sent), body)
            self._sent += 1
            try:
                self.sock.sendall(struct.pack(">I", len(body)) + tag + body)
            except OSError as error:
                self.close()
                raise ChannelClosed(f"the channel broke: {error}") from None

    def receive(self) -> tuple[dict, bytes]:
        """The next frame's header and data; ``IntegrityError`` (and the connection closed) for one that is not
        this connection's next."""
        try:
            (length,) = struct.unpack(">I", _receive_exactly(self.sock, 4))
            if length > MAX_FRAME_BYTES:
                raise IntegrityError(f"a channel frame of {length} bytes, over the limit")
            tag = _receive_exactly(self.sock, _TAG_BYTES)
            body = _receive_exactly(self.sock, length)
        except OSError as error:
            self.close()
            raise ChannelClosed(f"the channel broke: {error}") from None
        expected = _tag(self._key, self._in, struct.pack(">Q", self._received), body)
        if not hmac.compare_digest(tag, expected):
            self.close()
            raise IntegrityError("a channel frame that does not verify (altered, replayed or out of order): "
                                 "the connection is closed")
        self._received += 1
        (head_length,) = struct.unpack(">I", body[:4])
        header = json.loads(body[4:4 + head_length])
        return header, body[4 + head_length:]

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.sock.close()


def connect(address: tuple[str, int], key: bytes, role: str, *, timeout: float = HANDSHAKE_TIMEOUT_S) -> Link:
    """A proven connection to the hub at ``address`` as ``role`` (:data:`NOTEBOOK`, :func:`host_role`,
    :func:`agent_role`); ``OSError``
    when it cannot be reached, ``IntegrityError`` when the hub does not prove the session's key."""
    secret = channel_key(key)
    sock = socket.create_connection(address, timeout=timeout)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        mine = secrets.token_bytes(_NONCE_BYTES)
        role_bytes = role.encode()
        sock.sendall(_MAGIC + mine + struct.pack(">H", len(role_bytes)) + role_bytes)
        theirs = _receive_exactly(sock, _NONCE_BYTES)
        proof = _receive_exactly(sock, _TAG_BYTES)
        if not hmac.compare_digest(proof, _tag(secret, b"hub", mine, theirs, role_bytes)):
            raise IntegrityError(f"the channel at {address[0]}:{address[1]} does not hold this session's key")
        sock.sendall(_tag(secret, b"peer", mine, theirs, role_bytes))
        sock.settimeout(None)
    except BaseException:
        sock.close()
        raise
    return Link(sock, _tag(secret, b"link", mine, theirs, role_bytes), outgoing=b"peer", incoming=b"hub", role=role)


def _accept(sock: socket.socket, secret: bytes) -> Link:
    """The hub's side of :func:`connect`."""
    sock.settimeout(HANDSHAKE_TIMEOUT_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if _receive_exactly(sock, len(_MAGIC)) != _MAGIC:
        raise IntegrityError("not a kinetic_nb channel")
    theirs = _receive_exactly(sock, _NONCE_BYTES)
    (length,) = struct.unpack(">H", _receive_exactly(sock, 2))
    role_bytes = _receive_exactly(sock, length)
    mine = secrets.token_bytes(_NONCE_BYTES)
    sock.sendall(mine + _tag(secret, b"hub", theirs, mine, role_bytes))
    if not hmac.compare_digest(_receive_exactly(sock, _TAG_BYTES), _tag(secret, b"peer", theirs, mine, role_bytes)):
        raise IntegrityError("a peer that does not hold this session's key")
    sock.settimeout(None)
    return Link(sock, _tag(secret, b"link", theirs, mine, role_bytes), outgoing=b"hub", incoming=b"peer",
                role=role_bytes.decode(errors="replace"))


#: A mirror keeps the records of this many latest cells (older ones are storage's), and of each host's output
#: outside cells this many chunks: a long session's mirrors do not grow with its age.
KEEP_CELLS = 4
KEEP_HOST_CHUNKS = 64


class Mirror:
    """The latest of each record the channel has carried: its bytes (or :data:`STORED`), a version and when it
    arrived; :meth:`wait` returns when something new does. Only the last :data:`KEEP_CELLS` cells are kept:
    :meth:`covers` says whether a name is one the mirror can answer for."""

    def __init__(self) -> None:
        self._objects: dict[str, tuple[bytes | Stored, str, float]] = {}
        self._changed = threading.Condition()
        self._count = 0
        #: Cells before this one have been let go (their records are storage's).
        self.oldest_cell = 0

    def put(self, name: str, data: bytes | Stored, at: float | None = None) -> None:
        with self._changed:
            self._count += 1
            self._objects[name] = (data, f"c{self._count}", at or time.time())
            self._let_go(name)
            self._changed.notify_all()

    def _let_go(self, name: str) -> None:
        """A new cell lets the oldest kept one go; a host's new output chunk, its oldest kept one."""
        seq = protocol.cell_of(name)
        if seq is not None and seq - KEEP_CELLS + 1 > self.oldest_cell:
            self.oldest_cell = seq - KEEP_CELLS + 1
            for old in [old for old in self._objects if (protocol.cell_of(old) or self.oldest_cell) < self.oldest_cell]:
                del self._objects[old]
        host = protocol.parse_host_object(name)
        if host is not None and host[1] == "log":
            self._objects.pop(protocol.host_log_chunk(host[0], host[2] - KEEP_HOST_CHUNKS), None)

    def covers(self, name: str) -> bool:
        """Whether ``name`` is not of a cell this mirror has let go."""
        seq = protocol.cell_of(name)
        return seq is None or seq >= self.oldest_cell

    def get(self, name: str) -> bytes | Stored | None:
        entry = self._objects.get(name)
        return entry[0] if entry is not None else None

    def entries(self, prefix: str = "") -> list[tuple[str, int, str, float]]:
        """``(name, size, version, updated)`` of each record whose name starts with ``prefix``, by name."""
        with self._changed:
            items = [(name, entry) for name, entry in self._objects.items() if name.startswith(prefix)]
        return sorted((name, len(data) if isinstance(data, bytes) else 0, version, at)
                      for name, (data, version, at) in items)

    def wake(self) -> None:
        with self._changed:
            self._count += 1
            self._changed.notify_all()

    def wait(self, seconds: float, since: int | None = None) -> int:
        """Wait up to ``seconds`` for a record newer than ``since`` (default: now); the count now."""
        with self._changed:
            start = self._count if since is None else since
            self._changed.wait_for(lambda: self._count != start, timeout=seconds)
            return self._count


def _message(name: str, data: bytes | Stored, at: float) -> tuple[dict, bytes | None]:
    stored = isinstance(data, Stored)
    return {"name": name, "at": at, **({"stored": True} if stored else {})}, None if stored else data


def _record(header: dict, data: bytes) -> tuple[str, bytes | Stored, float]:
    name = header.get("name")
    if not isinstance(name, str) or not name or name.startswith("/") or ".." in name.split("/"):
        raise IntegrityError(f"a channel record with no usable name: {name!r}")
    return name, STORED if header.get("stored") else data, float(header.get("at") or time.time())


class _Outbox:
    """What the hub sends one peer, in order, from a thread of its own: a slow peer (a notebook far away)
    never holds up the others."""

    def __init__(self, link: Link):
        self.link = link
        self._queue: queue.SimpleQueue[tuple[dict, bytes | None] | None] = queue.SimpleQueue()
        threading.Thread(target=self._send_loop, name=f"kinetic-hub-to-{link.role}", daemon=True).start()

    def put(self, header: dict, data: bytes | None = b"") -> None:
        self._queue.put((header, data))

    def _send_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                self.link.send(*item)
            except ChannelClosed:
                return

    def close(self) -> None:
        self.link.close()
        self._queue.put(None)


class Hub:
    """The session's end of every connection, in the leader's agent, listening at ``address``: it keeps the latest
    of each record, gives it to each newcomer, and passes every record on (to notebooks all, to hosts and agents
    what hosts read). Once every one of its ``hosts`` (and ``agents``: the other hosts' agents, where each host has
    its own) has joined, it tells the hosts so (``complete``): the leader's start verdict then says that the
    cells travel through the channel.

    At an IP address the hub listens there alone; at a name (a pod's DNS name, which may not resolve yet on the
    pod that bears it) on every interface, so that a port-forward, which reaches the pod's loopback, finds it
    too; the name is what it announces.

    ``on_record(name, data)`` hears each record a peer sends (the agent learns the hosts' start verdict);
    ``on_lost(role)`` each host or agent that goes (everyone then goes back to storage: see the agent).
    """

    def __init__(self, key: bytes, address: tuple[str, int] = ("127.0.0.1", 0), *, hosts: int, agents: int = 0,
                 procs_per_host: int = 1, on_record: Callable[[str, bytes | Stored], None] | None = None,
                 on_lost: Callable[[str], None] | None = None):
        self._secret = channel_key(key)
        self.mirror = Mirror()
        self._on_record = on_record
        #: Who must have joined before the hub says ``complete``: every host, and the other hosts' agents (on a
        #: backend with an agent per host: their records, the hosts' output, reach notebooks through it too).
        self._expected = {host_role(index) for index in range(hosts)} | {agent_role(index) for index in range(1, agents + 1)}
        self._host_roles = {host_role(index) for index in range(hosts)}
        #: Processes per host: an agent (``agent_role(host)``) reads the statuses of its host's processes.
        self._procs_per_host = procs_per_host
        self._on_lost = on_lost
        self._peers: list[_Outbox] = []
        self._joined: set[str] = set()
        self._lock = threading.Lock()
        named = not _is_ip_address(address[0])
        self._server = socket.create_server(("", address[1]) if named else address)
        self.address = self._server.getsockname()[:2]
        #: Where it says it listens (``channel.json``): the name it was given, else the address it listens at.
        self.announced = f"{address[0]}:{self.address[1]}" if named else f"{self.address[0]}:{self.address[1]}"
        self._closed = False

    def start(self) -> None:
        """Start accepting (after any fork: the threads are this process's alone)."""
        threading.Thread(target=self._accept_loop, name="kinetic-hub", daemon=True).start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(sock,), name="kinetic-hub-peer", daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        try:
            link = _accept(sock, self._secret)
        except (OSError, IntegrityError, ValueError) as error:
            logger.info("channel: refused a connection: %s", error)
            with contextlib.suppress(OSError):
                sock.close()
            return
        peer = _Outbox(link)
        with self._lock:  # what the hub holds, then everything after it: nothing is missed or doubled
            for name, _, _, at in self.mirror.entries():
                data = self.mirror.get(name)
                if data is not None and self._wants(link, name):
                    peer.put(*_message(name, data, at))
            peer.put({"caught_up": True})
            self._peers.append(peer)
            if link.role in self._expected:
                self._joined.add(link.role)
                if self._joined == self._expected:  # every host is here: they may agree to use the channel
                    for other in self._peers:
                        if other.link.role in self._host_roles:
                            other.put({"complete": True})
        try:
            while True:
                header, data = link.receive()
                name, record, at = _record(header, data)
                self.publish(name, record, at=at, origin=link)
        except (ChannelClosed, IntegrityError, ValueError) as error:
            if isinstance(error, IntegrityError | ValueError):
                logger.warning("channel: %s from %s", error, link.role)
        finally:
            peer.close()
            with self._lock:
                if peer in self._peers:
                    self._peers.remove(peer)
            if self._on_lost is not None and link.role != NOTEBOOK and not self._closed:
                self._on_lost(link.role)

    def _wants(self, link: Link, name: str) -> bool:
        """Notebooks read everything; hosts and agents what hosts read (no host's records, no cell's output), and
        an agent its own host's processes' statuses."""
        if link.role == NOTEBOOK:
            return True
        host = protocol.parse_host_object(name)
        if host is not None:
            return host[1] == "status" and link.role == agent_role(host[0] // self._procs_per_host)
        return protocol.parse_cell_log_chunk(name) is None

    def publish(self, name: str, data: bytes | Stored, *, at: float | None = None, origin: Link | None = None) -> None:
        """Keep ``name`` and pass it to every other peer that reads such records."""
        at = at or time.time()
        with self._lock:
            self.mirror.put(name, data, at)
            for peer in self._peers:
                if peer.link is not origin and self._wants(peer.link, name):
                    peer.put(*_message(name, data, at))
        if origin is not None and self._on_record is not None:
            self._on_record(name, data)

    def peers(self) -> list[str]:
        with self._lock:
            return [peer.link.role for peer in self._peers]

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._server.close()
        with self._lock:
            for peer in self._peers:
                peer.close()
            self._peers.clear()


class Channel:
    """A peer's end: its link to the hub, and a :class:`Mirror` of what the hub passed on, kept by a thread.

    ``broken`` says why the channel went (None while it is up); ``on_broken(reason)`` hears it once.
    """

    def __init__(self, link: Link, *, on_broken: Callable[[str], None] | None = None):
        self.link = link
        self.mirror = Mirror()
        self.broken: str | None = None
        self._on_broken = on_broken
        self._caught_up = threading.Event()
        #: Set when the hub says every host of the session has joined.
        self.complete = threading.Event()
        threading.Thread(target=self._receive_loop, name=f"kinetic-channel-{link.role}", daemon=True).start()

    @classmethod
    def open(cls, address: tuple[str, int], key: bytes, role: str, *, timeout: float = HANDSHAKE_TIMEOUT_S,
             on_broken: Callable[[str], None] | None = None) -> Channel:
        channel = cls(connect(address, key, role, timeout=timeout), on_broken=on_broken)
        if not channel._caught_up.wait(timeout):
            channel.close("the hub sent nothing")
            raise ChannelClosed(f"the channel at {address[0]}:{address[1]} sent nothing in {timeout:g} s")
        return channel

    def _receive_loop(self) -> None:
        try:
            while True:
                header, data = self.link.receive()
                if header.get("caught_up"):
                    self._caught_up.set()
                    continue
                if header.get("complete"):
                    self.complete.set()
                    continue
                name, record, at = _record(header, data)
                self.mirror.put(name, record, at)
        except (ChannelClosed, IntegrityError, ValueError) as error:
            self._break(str(error))

    def _break(self, reason: str) -> None:
        if self.broken is None:
            self.broken = reason
            self.link.close()
            self.mirror.wake()
            if self._on_broken is not None:
                self._on_broken(reason)

    def send(self, name: str, data: bytes | Stored) -> None:
        """Pass ``name`` to the hub (and keep it here); a broken channel raises ``ChannelClosed``."""
        if self.broken is not None:
            raise ChannelClosed(self.broken)
        at = time.time()
        self.mirror.put(name, data, at)
        try:
            self.link.send(*_message(name, data, at))
        except ChannelClosed as error:
            self._break(str(error))
            raise

    def close(self, reason: str = "closed") -> None:
        self._break(reason)


class Joining:
    """Joining the hub at ``address`` as ``role``, in the background, tried again while the hub does not answer:
    on a backend whose hosts start apart (Ray), a host may look for the hub before the leader's agent listens.

    A hub that answers without the session's key is not tried again. ``settle()`` stops trying and gives the
    channel, if joined; ``abandon(reason)`` stops trying without waiting for a try under way, and closes what it
    joins; ``wait(timeout)`` waits for the outcome without stopping. After ``give_up_after_s``, if given, it
    stops by itself; ``then(channel, error)`` hears the outcome either way (not once told to stop).
    """

    def __init__(self, address: tuple[str, int], key: bytes, role: str, *,
                 on_broken: Callable[[str], None] | None = None, give_up_after_s: float | None = None,
                 then: Callable[[Channel | None, str], None] | None = None):
        self.channel: Channel | None = None
        #: Why the last try failed ("" once joined).
        self.error = ""
        self._stop = threading.Event()
        self._done = threading.Event()
        self._abandoned: str | None = None
        threading.Thread(target=self._keep_trying, args=(address, key, role, on_broken, give_up_after_s, then),
                         name=f"kinetic-join-{role}", daemon=True).start()

    def _keep_trying(self, address, key, role, on_broken, give_up_after_s, then) -> None:
        deadline = None if give_up_after_s is None else time.monotonic() + give_up_after_s
        while not self._stop.is_set():
            try:
                self.channel = Channel.open(address, key, role, on_broken=on_broken)
                self.error = ""
                if self._abandoned is not None:  # joined as it was abandoned: leave at once
                    self.channel.close(self._abandoned)
                break
            except IntegrityError as error:  # someone else's hub, or not this session's key: never will be
                self.error = str(error)
                break
            except OSError as error:  # not listening yet, or not reachable from here
                self.error = f"{address[0]}:{address[1]}: {error}"
                if deadline is not None and time.monotonic() > deadline:
                    break
                self._stop.wait(JOIN_RETRY_S)
        self._done.set()
        if then is not None and not self._stop.is_set():
            then(self.channel, self.error)

    def wait(self, timeout: float) -> Channel | None:
        """The channel once joined within ``timeout``; None if not (still trying, or given up)."""
        self._done.wait(timeout)
        return self.channel

    def settle(self) -> Channel | None:
        """Stop trying (a try under way finishes: at most a handshake's timeout); the channel, if joined."""
        self._stop.set()
        self._done.wait(2 * HANDSHAKE_TIMEOUT_S)
        return self.channel

    def abandon(self, reason: str) -> None:
        """Stop trying, without waiting: the channel is not to be used, joined now or by a try under way."""
        self._abandoned = reason
        self._stop.set()
        if self.channel is not None:
            self.channel.close(reason)


def _is_ip_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def announced_address() -> tuple[str, int] | None:
    """The hub's address as this host's environment gives it, or None (no channel here)."""
    text = os.environ.get(CHANNEL_ENV, "")
    return parse_address(text) if text else None
