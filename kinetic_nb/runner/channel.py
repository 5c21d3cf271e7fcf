"""A session's direct channel: records travel from whoever writes them to whoever waits on them, not through a
bucket.

The hub lives in the agent of the session's leader host. It listens where its
hosts are told (``runner.hub_door``: at host 0's address, or for a session on
this machine at a Unix socket only its user can open), and announces that
sealed in ``channel.json``; its hosts get it in their environment
(:data:`CHANNEL_ENV`), a notebook from that record, through whatever route its
backend knows (locally the socket itself). A message is one record as storage
would hold it: a name below the session and the sealed bytes the writer would
store (so a reader verifies it under the cell's key as it verifies the same
object read from storage), or, for an object too large to carry, a notice that
it is in storage. The hub keeps the latest of each name, gives a newcomer what
it holds, and passes every message on: to notebooks all of it, to hosts what
hosts read (no host's records, no output). Storage stays the record: every
writer still stores what it sends, later and at most once a second per name
(``runner.relayed``).

Nobody without the session's key can join or speak, or read what travels: a
connection starts with a challenge each way under a key derived from the
session's key, and every frame is encrypted and authenticated under a key of
that connection, its nonce the frame's direction and number in the stream
(``runner.channel_link``), so a frame altered, replayed, reordered or moved to
another connection is refused and the connection closed. A connection that has
not proven itself costs the hub a socket and no thread, for at most one
handshake deadline (``runner.hub_door``); a proven one costs no thread either:
one thread hears every peer and passes each record on from there, written to
each reader without waiting, and one more writes what a slow reader's socket
did not take, as it drains (so a record to 1,024 hosts wakes no thread, and
a slow peer holds up no other). Host-safe: the standard library and
``cryptography``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import queue
import random
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterator

from kinetic_nb.errors import ChannelClosed, IntegrityError
from kinetic_nb.runner import protocol
from kinetic_nb.runner.channel_link import (
    HANDSHAKE_TIMEOUT_S,
    MAX_FRAME_BYTES,
    Address,
    Link,
    channel_key,
    connect,
    format_address,
    frame_body,
    parse_address,
)
from kinetic_nb.runner.hub_door import Door

logger = logging.getLogger(__name__)

__all__ = ["CHANNEL_ENV", "MAX_FRAME_BYTES", "Address", "Channel", "Hub", "Joining", "Link", "Mirror", "Stored",
           "agent_role", "connect", "format_address", "host_role", "parse_address"]

#: How a session's host is told where its hub listens (``host:port``, or ``unix:/path`` on this machine).
CHANNEL_ENV = "KINETIC_CHANNEL"
#: Pause between two tries to join a hub that is not listening yet. After a try the hub did not answer in time
#: (busy), the pause grows by half up to JOIN_RETRY_MAX_S, with up to a half of it at random: a thousand hosts
#: that found the hub busy do not all come back together, each time, to a hub still busy with their last tries.
JOIN_RETRY_S = 0.2
JOIN_RETRY_MAX_S = 3.0
#: How long one try to join waits for the hub to answer: a busy hub answers the connections waiting at its door
#: in turn, and a host that gave up and came back would only wait at the end of the line again (at 1,024 hosts on
#: two cores, tries of 10 s left a hub that answered a few joins a second accepting thousands of connections whose
#: hosts had given up, and the channel never formed).
JOIN_TRY_S = 60.0
NOTEBOOK = "notebook"


def _one_hosts_word_on_a_cell(name: str) -> bool:
    """A host's own word on a session's cell: ready at its barrier, its end of the cell, its failure payload."""
    if protocol.cell_of(name) is None or not name.startswith(f"{protocol.CELLS_DIR}/"):
        return False
    leaf = name.rsplit("/", 1)[1]
    return (protocol.parse_cell_done(name) is not None or protocol.parse_worker_result(leaf) is not None
            or (protocol.is_cell_marker(name) and leaf != protocol.LEADER_READY))


def host_role(index: int) -> str:
    """How the process of rank ``index`` (a host's, where each runs one) names itself on the channel."""
    return f"host-{index}"


def agent_role(index: int) -> str:
    """How the agent of host ``index`` (one of an agent per host, not the hub's) names itself on the channel."""
    return f"agent-{index}"


@dataclasses.dataclass(frozen=True)
class Stored:
    """An object the channel does not carry (too large): read it from storage."""


STORED = Stored()


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


#: A record every peer reads (hosts and agents as well as notebooks): see :meth:`Hub._audience`.
EVERYONE = "*"


def _record(header: dict, data: bytes) -> tuple[str, bytes | Stored, float]:
    name = header.get("name")
    if not isinstance(name, str) or not name or name.startswith("/") or ".." in name.split("/"):
        raise IntegrityError(f"a channel record with no usable name: {name!r}")
    return name, STORED if header.get("stored") else data, float(header.get("at") or time.time())


#: How often the hub's watching threads look at their peers even if nothing happens (for those that went).
WATCH_WAKE_S = 0.5
#: The most one read from a peer takes before the hub hears the others.
READ_BYTES = 1 << 16


class _Peer:
    """A proven peer as the hub holds it: no thread of its own. What the hub sends it goes in order and never
    waits on it: each frame is sealed as it is put (from :func:`frame_body`'s plaintext, built once for every
    peer a record goes to) and written at once if the peer's socket takes it; what it does not take yet waits
    here, in order, for the hub's writer (:class:`_Watch`). What it sends gathers here until whole frames have
    come, opened in order under the connection's key. A slow peer (a notebook far away) holds up no other, and
    a record to N peers wakes no thread: a thread per peer, woken for each record it sent or was sent, cost the
    hub more than the records (futexes and the interpreter's lock passed between thousands of threads)."""

    def __init__(self, link: Link, writer: _Watch):
        self.link = link
        self._writer = writer
        self._lock = threading.Lock()
        self._pending = bytearray()
        self._incoming = bytearray()

    def put(self, body: bytes) -> None:
        with self._lock:
            if self.link.closed:
                return
            sealed = self.link.seal([body])
            if self._pending:  # behind what waits already: the writer sends it in turn
                self._pending += sealed
                return
            sent = self._write(sealed)
            if sent < len(sealed):
                self._pending += sealed[sent:]
                self._writer.watch(self)

    def _write(self, data: bytes | bytearray) -> int:
        """Write what the socket takes now; how much (all of it for a peer gone: it is closed, and so heard)."""
        try:
            return self.link.sock.send(data, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return 0
        except OSError:
            self.link.close()
            return len(data)

    def flush(self) -> bool:
        """Write what waits, as far as the socket takes it; whether nothing waits any more (or the peer went)."""
        with self._lock:
            if self._pending and not self.link.closed:
                del self._pending[:self._write(self._pending)]
            if self.link.closed:
                self._pending.clear()
            return not self._pending

    def read(self) -> bytes | None:
        """What the peer sent since the last read, without waiting: None when nothing came, b"" once it went."""
        try:
            return self.link.sock.recv(READ_BYTES, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return None
        except OSError:
            return b""

    def frames(self, chunk: bytes) -> Iterator[tuple[dict, bytes]]:
        """The frames ``chunk`` completes, each opened as it is reached (``IntegrityError``, ``ValueError`` for one
        that is not this connection's next: the frames before it are given)."""
        self._incoming += chunk
        while len(self._incoming) >= 4:
            length = bytes(self._incoming[:4])
            size = self.link.frame_size(length)
            if len(self._incoming) < 4 + size:
                return
            sealed = bytes(self._incoming[4:4 + size])
            del self._incoming[:4 + size]
            yield self.link.open_frame(length, sealed)

    def close(self) -> None:
        self.link.close()
        with self._lock:
            self._pending.clear()


class _Watch:
    """One thread of the hub that watches many peers' sockets for one event (readable, or writable), and calls
    ``ready(peer)`` for each that is: True from it, or a peer whose link closed meanwhile (``gone(peer)`` is
    called for it), and the peer is no longer watched."""

    def __init__(self, name: str, event: int, ready: Callable[[_Peer], bool], gone: Callable[[_Peer], None]):
        self._name = name
        self._event = event
        self._ready = ready
        self._gone = gone
        self._selector = selectors.DefaultSelector()
        self._wake_in, self._wake_out = socket.socketpair()
        for end in (self._wake_in, self._wake_out):
            end.setblocking(False)
        self._selector.register(self._wake_in, selectors.EVENT_READ)
        self._added: queue.SimpleQueue[_Peer] = queue.SimpleQueue()
        self._closed = False

    def start(self) -> None:
        threading.Thread(target=self._loop, name=self._name, daemon=True).start()

    def watch(self, peer: _Peer) -> None:
        self._added.put(peer)
        with contextlib.suppress(OSError):  # a full wakeup socket already wakes the loop
            self._wake_out.send(b"\0")

    def _loop(self) -> None:
        look_at = time.monotonic() + WATCH_WAKE_S
        try:
            while not self._closed:
                try:
                    for key, _ in self._selector.select(WATCH_WAKE_S):
                        if key.data is None:
                            with contextlib.suppress(OSError):
                                self._wake_in.recv(4096)
                        else:
                            self._turn_of(key.data)
                    while not self._added.empty():
                        self._add(self._added.get())
                    if time.monotonic() >= look_at:  # every peer, at most every WATCH_WAKE_S: not at every event
                        self._forget_the_closed()
                        look_at = time.monotonic() + WATCH_WAKE_S
                except Exception:  # the hub's peers stay heard: logged, a pause, and on
                    logger.exception("channel: the hub's %s", self._name)
                    time.sleep(WATCH_WAKE_S / 5)
        finally:
            self._selector.close()
            self._wake_in.close()
            self._wake_out.close()

    def _turn_of(self, peer: _Peer) -> None:
        """``ready(peer)``; a peer whose turn fails (a callback's error) is closed and gone, the others stay."""
        try:
            done = self._ready(peer)
        except Exception:  # that peer's alone
            logger.exception("channel: the hub's %s, for %s", self._name, peer.link.role)
            peer.close()
            self._forget(peer.link.sock)
            self._gone(peer)
            return
        if done:
            self._forget(peer.link.sock)

    def _forget_the_closed(self) -> None:
        """Peers whose links were closed elsewhere (a write that failed, the hub closing): a closed socket is no
        longer watched by the system, so it says nothing more."""
        for key in list(self._selector.get_map().values()):
            if key.data is not None and key.data.link.closed:
                self._forget(key.fileobj)
                self._gone(key.data)

    def _add(self, peer: _Peer) -> None:
        sock = peer.link.sock
        if peer.link.closed:  # it went before it was watched (a peer that gave up on a busy hub as it joined)
            self._gone(peer)
            return
        with contextlib.suppress(KeyError):
            old = self._selector.get_key(sock).data
            if old is peer:
                return
            self._forget(sock)  # a peer gone whose descriptor's number this one's has taken
            self._gone(old)
        try:
            self._selector.register(sock, self._event, peer)
        except (ValueError, OSError):  # its socket closed meanwhile: the peer is gone
            self._gone(peer)

    def _forget(self, sock) -> None:
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._selector.unregister(sock)

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._wake_out.send(b"\0")


class Hub:
    """The session's end of every connection, in the leader's agent, listening at ``address``: it keeps the latest
    of each record, gives it to each newcomer, and passes every record on (to notebooks all, to hosts and agents
    what hosts read). Once every one of its ``hosts`` (and ``agents``: the other hosts' agents, where each host has
    its own) has joined, it tells the hosts so (``complete``): the leader's start verdict then says that the
    cells travel through the channel.

    ``address`` is where the hosts are told it is: an IP address (it listens there alone), a name (at the
    addresses the name has here and the loopback, which a port-forward to a pod reaches; never every interface),
    or the path of a Unix socket in a 0700 directory (a session on this machine: no other user can connect); see
    ``runner.hub_door``, which also bounds what connections that have not proven themselves may cost.

    ``on_record(name, data)`` hears each record a peer sends (the agent learns the hosts' start verdict);
    ``on_lost(role)`` each host or agent that goes once every one has joined (everyone then goes back to
    storage: see the agent); one that goes before, as a host whose try to join timed out on a busy hub, may
    join again: until every one is here no one uses the channel, so no one has lost it.
    """

    def __init__(self, key: bytes, address: Address = ("127.0.0.1", 0), *, hosts: int, agents: int = 0,
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
        self._peers: list[_Peer] = []
        #: The same peers by role (several where a role joined twice, notebooks): a record one peer reads costs
        #: the hub that peer, not a look at every peer.
        self._by_role: dict[str, list[_Peer]] = {}
        self._joined: set[str] = set()
        #: Whether the hub has said ``complete`` (every host and agent joined): a peer that goes after it is lost.
        self._complete = False
        self._lock = threading.Lock()
        self._closed = False
        #: Its two threads beside the door's, whatever the peers: one hears them all, one writes to those whose
        #: sockets did not take what was sent at once.
        self._reader = _Watch("kinetic-hub-reader", selectors.EVENT_READ, self._hear, self._leave)
        self._writer = _Watch("kinetic-hub-writer", selectors.EVENT_WRITE, _Peer.flush, lambda peer: None)
        self._door = Door(address, self._secret, self._admit)
        #: Where it listens (the first of its sockets; a Unix socket's path).
        self.address: Address = self._door.address
        #: Where it says it listens (``channel.json``): the name it was given, else the address it listens at.
        self.announced = self._door.announced

    def start(self) -> None:
        """Start accepting (after any fork: the threads are this process's alone)."""
        self._reader.start()
        self._writer.start()
        self._door.start()

    @property
    def refused(self) -> dict[str, int]:
        """How many connections the hub refused, by why (they are logged as counts too)."""
        return dict(self._door.refusals.total)

    def _admit(self, link: Link) -> None:
        """A proven peer: what the hub holds (then everything after it: nothing is missed or doubled), and the
        reader hears it from now on."""
        peer = _Peer(link, self._writer)
        with self._lock:
            for name, _, _, at in self.mirror.entries():
                data = self.mirror.get(name)
                if data is not None and self._wants(link, name):
                    peer.put(frame_body(*_message(name, data, at)))
            peer.put(frame_body({"caught_up": True}))
            self._peers.append(peer)
            self._by_role.setdefault(link.role, []).append(peer)
            if link.role in self._expected:
                self._joined.add(link.role)
                if len(self._joined) == len(self._expected):  # every host is here: they may use the channel
                    self._complete = True
                    complete = frame_body({"complete": True})
                    for other in self._peers:
                        if other.link.role in self._host_roles:
                            other.put(complete)
        self._reader.watch(peer)

    def _hear(self, peer: _Peer) -> bool:
        """Read what ``peer`` sent and pass on each whole frame; True once it has gone (or sent a frame that is not
        its next: it is then closed)."""
        chunk = peer.read()
        if chunk is None:
            return False
        if not chunk:
            self._leave(peer)
            return True
        try:
            for header, data in peer.frames(chunk):
                name, record, at = _record(header, data)
                self.publish(name, record, at=at, origin=peer.link)
        except (IntegrityError, ValueError) as error:
            logger.warning("channel: %s from %s", error, peer.link.role)
            self._leave(peer)
            return True
        return False

    def _leave(self, peer: _Peer) -> None:
        """``peer`` went (or is sent away): it is closed, and once only, the hub hears it (``on_lost``)."""
        peer.close()
        role = peer.link.role
        with self._lock:
            if peer not in self._peers:
                return
            self._peers.remove(peer)
            self._by_role[role].remove(peer)
            if not self._by_role[role]:
                del self._by_role[role]
            joining = not self._complete and role in self._expected
            if joining and role not in self._by_role:
                self._joined.discard(role)
        if joining:  # not everyone was here yet: nobody used the channel, and this one may join again
            logger.info("channel: %s went before every host had joined; it may join again", role)
            return
        if self._on_lost is not None and role != NOTEBOOK and not self._closed:
            self._on_lost(role)

    def _audience(self, name: str) -> str | None:
        """Who reads ``name`` besides the notebooks, who read everything: :data:`EVERYONE` (hosts and agents read
        it), one role, or None (notebooks alone). Hosts and agents read what hosts read (no host's records, no
        cell's output), and an agent its own host's processes' statuses. A host's own word on a cell (ready at
        its barrier, its end of it, its failure) goes to the leader alone, who decides the barrier: passed to
        every host, each cell would cost the hub the square of the hosts."""
        host = protocol.parse_host_object(name)
        if host is not None:
            return agent_role(host[0] // self._procs_per_host) if host[1] == "status" else None
        if _one_hosts_word_on_a_cell(name):
            return host_role(protocol.LEADER_INDEX)
        return EVERYONE if protocol.parse_cell_log_chunk(name) is None else None

    def _wants(self, link: Link, name: str) -> bool:
        """Whether the peer at ``link`` reads ``name`` (see :meth:`_audience`)."""
        if link.role == NOTEBOOK:
            return True
        audience = self._audience(name)
        return audience == EVERYONE or audience == link.role

    def _readers(self, audience: str | None) -> list[_Peer]:
        """The peers joined now that read a record for ``audience``: every one, or the notebooks and that role."""
        if audience == EVERYONE:
            return self._peers
        return self._by_role.get(NOTEBOOK, []) + (self._by_role.get(audience, []) if audience else [])

    def publish(self, name: str, data: bytes | Stored, *, at: float | None = None, origin: Link | None = None) -> None:
        """Keep ``name`` and pass it to every other peer that reads such records: its audience is decided once
        and its frame's plaintext built once, whatever the peers (each link seals it under its own key)."""
        at = at or time.time()
        audience = self._audience(name)
        body = frame_body(*_message(name, data, at))
        with self._lock:
            self.mirror.put(name, data, at)
            for peer in self._readers(audience):
                if peer.link is not origin:
                    peer.put(body)
        if origin is not None and self._on_record is not None:
            self._on_record(name, data)

    def peers(self) -> list[str]:
        with self._lock:
            return [peer.link.role for peer in self._peers]

    def sent(self) -> tuple[int, int]:
        """Frames and bytes the hub has sent its peers still joined (``benchmarks/hub.py`` reads it)."""
        with self._lock:
            links = [peer.link for peer in self._peers]
        return sum(link.sent_frames for link in links), sum(link.sent_bytes for link in links)

    def close(self) -> None:
        self._closed = True
        self._door.close()
        self._reader.close()
        self._writer.close()
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
    def open(cls, address: Address, key: bytes, role: str, *, timeout: float = HANDSHAKE_TIMEOUT_S,
             on_broken: Callable[[str], None] | None = None) -> Channel:
        channel = cls(connect(address, key, role, timeout=timeout), on_broken=on_broken)
        if not channel._caught_up.wait(timeout):
            channel.close("the hub sent nothing")
            raise ChannelClosed(f"the channel at {format_address(address)} sent nothing in {timeout:g} s")
        if channel.broken is not None:  # the hub let it go before it was in (a proof it took too long to see)
            raise ChannelClosed(f"the channel at {format_address(address)} closed as it was joined: {channel.broken}")
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
            self._caught_up.set()  # an opener waiting for the hub's first records hears it at once
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

    def __init__(self, address: Address, key: bytes, role: str, *,
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
        pause = JOIN_RETRY_S / 1.5
        while not self._stop.is_set():
            try:
                self.channel = Channel.open(address, key, role, timeout=JOIN_TRY_S, on_broken=on_broken)
                self.error = ""
                if self._abandoned is not None:  # joined as it was abandoned: leave at once
                    self.channel.close(self._abandoned)
                break
            except IntegrityError as error:  # someone else's hub, or not this session's key: never will be
                self.error = str(error)
                break
            except OSError as error:  # not listening yet, or not reachable from here
                self.error = f"{format_address(address)}: {error}"
                if deadline is not None and time.monotonic() > deadline:
                    break
                not_there_yet = isinstance(error, ConnectionRefusedError | FileNotFoundError)
                pause = JOIN_RETRY_S if not_there_yet else min(pause * 1.5, JOIN_RETRY_MAX_S)
                self._stop.wait(pause * random.uniform(1.0, 1.5))
        self._done.set()
        if then is not None and not self._stop.is_set():
            then(self.channel, self.error)

    def wait(self, timeout: float) -> Channel | None:
        """The channel once joined within ``timeout``; None if not (still trying, or given up)."""
        self._done.wait(timeout)
        return self.channel

    def settle(self) -> Channel | None:
        """Stop trying; the channel, if joined. A try under way is waited for twice a handshake's timeout, then
        abandoned (what it joins later is closed)."""
        self._stop.set()
        if not self._done.wait(2 * HANDSHAKE_TIMEOUT_S):
            self._abandoned = "the hub did not answer in time"
        return self.channel

    def abandon(self, reason: str) -> None:
        """Stop trying, without waiting: the channel is not to be used, joined now or by a try under way."""
        self._abandoned = reason
        self._stop.set()
        if self.channel is not None:
            self.channel.close(reason)


def announced_address() -> Address | None:
    """The hub's address as this host's environment gives it, or None (no channel here)."""
    text = os.environ.get(CHANNEL_ENV, "")
    return parse_address(text) if text else None
