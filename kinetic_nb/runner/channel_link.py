"""One connection of a session's channel (``runner.channel``): where a hub is, how a peer proves itself to it,
and the encrypted frames both ends exchange once it has.

A connection starts with a challenge each way under a key derived from the
session's key (the key itself never travels): the peer sends ``MAGIC``, a
nonce and its role; the hub answers with its nonce and a proof over both; the
peer answers with its own proof. Both ends then hold a key of that connection
alone, and every frame is encrypted and authenticated under it (AES-256-GCM):
the nonce is the frame's direction and its number in the stream, so a frame
altered, replayed, reordered or moved to another connection does not decrypt,
and a network peer learns the frames' sizes only.

A hub is at a TCP address (``host:port``) or, for a session on this machine,
at a Unix socket in a directory only its user can enter (``unix:/path``).
Host-safe: the standard library and ``cryptography``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import hmac
import json
import secrets
import socket
import struct
import threading
import time

from kinetic_nb.errors import ChannelClosed, IntegrityError
from kinetic_nb.runner.job_keys import derived_key

__all__ = ["HANDSHAKE_TIMEOUT_S", "MAX_FRAME_BYTES", "Address", "Arrival", "Link", "connect", "format_address",
           "frame_body", "open_socket", "parse_address"]

#: Where a hub listens: ``(host, port)`` on TCP, or the path of a Unix socket (a session on this machine).
Address = tuple[str, int] | str
#: How an announced address names a Unix socket (``unix:/path``).
UNIX_PREFIX = "unix:"
MAGIC = b"KNC2"
_NONCE_BYTES = 32
_PROOF_BYTES = 32
#: A role is a short word (``notebook``, ``host-12``, ``agent-3``): a longer one is not a peer's.
MAX_ROLE_BYTES = 64
#: A frame larger than this is refused (objects larger than ``runner.relayed.CARRY_MAX_BYTES`` travel by storage).
MAX_FRAME_BYTES = 64 << 20
#: Seconds a connection may take to prove itself, all of it: one deadline for the whole handshake, not per read.
HANDSHAKE_TIMEOUT_S = 10.0
#: The nonce of a frame starts with its direction: the two directions of a connection never share a nonce.
_FROM_PEER = b"\0\0\0\1"
_FROM_HUB = b"\0\0\0\2"
_TAG_BYTES = 16


@functools.cache
def cipher_classes() -> tuple[type, type[Exception]]:
    """``cryptography``'s AES-GCM and its error for a frame that does not verify, loaded once, when a channel is
    first used (a hub loads them as it opens: never for the first time while out of descriptors)."""
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    return AESGCM, InvalidTag


def parse_address(text: str) -> Address | None:
    """``host:port`` as a pair, ``unix:/path`` as the path; None when ``text`` is neither."""
    if text.startswith(UNIX_PREFIX):
        path = text[len(UNIX_PREFIX):]
        return path if path.startswith("/") else None
    host, _, port = text.rpartition(":")
    return (host, int(port)) if host and port.isdigit() else None


def format_address(address: Address) -> str:
    """The text :func:`parse_address` reads back."""
    return UNIX_PREFIX + address if isinstance(address, str) else f"{address[0]}:{address[1]}"


def channel_key(key: bytes) -> bytes:
    return derived_key(key, "channel")


def _proof(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"\0".join(parts), hashlib.sha256).digest()


def open_socket(address: Address, timeout: float) -> socket.socket:
    """A connected socket to ``address`` (TCP without Nagle's delay, or a Unix socket)."""
    if isinstance(address, str):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            sock.connect(address)
        except BaseException:
            sock.close()
            raise
        return sock
    sock = socket.create_connection(address, timeout=timeout)
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _receive_exactly(sock: socket.socket, count: int, deadline: float | None = None) -> bytes:
    data = bytearray()
    while len(data) < count:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the handshake took too long")
            sock.settimeout(left)
        chunk = sock.recv(count - len(data))
        if not chunk:
            raise ChannelClosed("the other end closed the channel")
        data += chunk
    return bytes(data)


def frame_body(header: dict, data: bytes | None = b"") -> bytes:
    """A frame's plaintext: its header's length, the header (JSON) and the data. The same for every link a record
    goes to: only its sealing (:meth:`Link.send_bodies`) is the connection's."""
    head = json.dumps(header, separators=(",", ":")).encode()
    return b"".join((struct.pack(">I", len(head)), head, data or b""))


class Link:
    """One proven connection, either end: frames out and in, each encrypted under the connection's key, its
    nonce the frame's direction and number."""

    def __init__(self, sock: socket.socket, key: bytes, *, hub_side: bool, role: str):
        self.sock = sock
        self.role = role
        self._cipher = cipher_classes()[0](key)
        self._out, self._in = (_FROM_HUB, _FROM_PEER) if hub_side else (_FROM_PEER, _FROM_HUB)
        self._sent = 0
        self._received = 0
        self._send_lock = threading.RLock()
        self.closed = False
        #: Bytes this end has sent, frames' lengths and tags included (its frames sent are ``sent_frames``).
        self.sent_bytes = 0

    def send(self, header: dict, data: bytes | None = b"") -> None:
        self.send_bodies([frame_body(header, data)])

    def send_bodies(self, bodies: list[bytes]) -> None:
        """Send frames whose plaintext :func:`frame_body` built (once, however many links it goes to), sealed
        here and written in one go."""
        with self._send_lock:
            out = self.seal(bodies)
            try:
                self.sock.sendall(out)
            except OSError as error:
                self.close()
                raise ChannelClosed(f"the channel broke: {error}") from None

    def seal(self, bodies: list[bytes]) -> bytes:
        """The frames of ``bodies`` as they go on the wire: each encrypted under this connection's key, its nonce
        this direction and the frame's number. Frames must be written in the order they were sealed: a caller
        that writes them itself (the hub, without blocking) keeps that order."""
        with self._send_lock:
            out = bytearray()
            for body in bodies:
                length = struct.pack(">I", len(body) + _TAG_BYTES)
                out += length
                out += self._cipher.encrypt(self._out + struct.pack(">Q", self._sent), body, length)
                self._sent += 1
            self.sent_bytes += len(out)
            return bytes(out)

    @property
    def sent_frames(self) -> int:
        """Frames this end has sent."""
        return self._sent

    def receive(self) -> tuple[dict, bytes]:
        """The next frame's header and data; ``IntegrityError`` (and the connection closed) for one that is not
        this connection's next."""
        try:
            length = _receive_exactly(self.sock, 4)
            sealed = _receive_exactly(self.sock, self.frame_size(length))
        except OSError as error:
            self.close()
            raise ChannelClosed(f"the channel broke: {error}") from None
        return self.open_frame(length, sealed)

    def frame_size(self, length: bytes) -> int:
        """The size of the sealed frame whose 4-byte ``length`` came first; ``IntegrityError`` (and the connection
        closed) for one outside the limits."""
        (size,) = struct.unpack(">I", length)
        if size > MAX_FRAME_BYTES or size < _TAG_BYTES + 4:
            self.close()
            raise IntegrityError(f"a channel frame of {size} bytes, outside the limits")
        return size

    def open_frame(self, length: bytes, sealed: bytes) -> tuple[dict, bytes]:
        """The header and data of the frame ``length + sealed``, which must be this connection's next: one that
        does not verify raises ``IntegrityError`` and closes the connection."""
        try:
            body = self._cipher.decrypt(self._in + struct.pack(">Q", self._received), sealed, length)
        except cipher_classes()[1]:
            self.close()
            raise IntegrityError("a channel frame that does not verify (altered, replayed or out of order): "
                                 "the connection is closed") from None
        self._received += 1
        (head_length,) = struct.unpack(">I", body[:4])
        header = json.loads(body[4:4 + head_length])
        if not isinstance(header, dict):
            raise ValueError("a channel frame whose header is not an object")
        return header, body[4 + head_length:]

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.sock.close()


def connect(address: Address, key: bytes, role: str, *, timeout: float = HANDSHAKE_TIMEOUT_S) -> Link:
    """A proven connection to the hub at ``address`` as ``role``; ``OSError`` when it cannot be reached (or does
    not answer within ``timeout``, the whole handshake), ``IntegrityError`` when it does not prove the session's
    key."""
    secret = channel_key(key)
    deadline = time.monotonic() + timeout
    sock = open_socket(address, timeout)
    try:
        mine = secrets.token_bytes(_NONCE_BYTES)
        role_bytes = role.encode()
        sock.sendall(MAGIC + mine + struct.pack(">H", len(role_bytes)) + role_bytes)
        theirs = _receive_exactly(sock, _NONCE_BYTES, deadline)
        proof = _receive_exactly(sock, _PROOF_BYTES, deadline)
        if not hmac.compare_digest(proof, _proof(secret, b"hub", mine, theirs, role_bytes)):
            raise IntegrityError(f"the channel at {format_address(address)} does not hold this session's key")
        sock.sendall(_proof(secret, b"peer", mine, theirs, role_bytes))
        sock.settimeout(None)
    except BaseException:
        sock.close()
        raise
    return Link(sock, _proof(secret, b"link", mine, theirs, role_bytes), hub_side=False, role=role)


class Arrival:
    """The hub's side of :func:`connect` for one accepted connection, a step each time its socket is readable,
    with no thread of its own: :meth:`step` returns the :class:`Link` once the peer has proven itself, None while
    it has not said enough yet, and raises (``IntegrityError``, ``ChannelClosed``, ``OSError``) for a peer that
    never will. ``deadline`` is when the whole handshake must be over (the hub closes it then)."""

    def __init__(self, sock: socket.socket, secret: bytes, deadline: float):
        self.sock = sock
        self.deadline = deadline
        self._secret = secret
        self._buffer = bytearray()
        self._hello: tuple[bytes, bytes, bytes] | None = None  # their nonce, ours, their role
        sock.setblocking(False)

    @property
    def answered(self) -> bool:
        """Whether it has said who it is and been answered (only its proof is missing)."""
        return self._hello is not None

    def _want(self) -> int:
        if self._hello is not None:
            return _PROOF_BYTES
        fixed = len(MAGIC) + _NONCE_BYTES + 2
        if len(self._buffer) < fixed:
            return fixed
        (length,) = struct.unpack(">H", self._buffer[fixed - 2:fixed])
        if length > MAX_ROLE_BYTES:
            raise IntegrityError(f"a role of {length} bytes: not a kinetic_nb peer")
        return fixed + length

    def step(self) -> Link | None:
        while True:
            want = self._want()
            if len(self._buffer) < want:
                try:
                    chunk = self.sock.recv(want - len(self._buffer))
                except BlockingIOError:
                    return None
                if not chunk:
                    raise ChannelClosed("closed before it proved itself")
                self._buffer += chunk
                if self._hello is None and len(self._buffer) >= len(MAGIC) and self._buffer[:len(MAGIC)] != MAGIC:
                    raise IntegrityError("not a kinetic_nb channel")
                continue
            if self._hello is None:
                theirs = bytes(self._buffer[len(MAGIC):len(MAGIC) + _NONCE_BYTES])
                role_bytes = bytes(self._buffer[len(MAGIC) + _NONCE_BYTES + 2:want])
                mine = secrets.token_bytes(_NONCE_BYTES)
                answer = mine + _proof(self._secret, b"hub", theirs, mine, role_bytes)
                if self.sock.send(answer) != len(answer):  # a fresh socket's buffer takes 64 bytes at once
                    raise ChannelClosed("could not answer the peer's challenge at once")
                self._hello = (theirs, mine, role_bytes)
                self._buffer.clear()
                continue
            theirs, mine, role_bytes = self._hello
            if not hmac.compare_digest(bytes(self._buffer), _proof(self._secret, b"peer", theirs, mine, role_bytes)):
                raise IntegrityError("a peer that does not hold this session's key")
            self.sock.setblocking(True)
            return Link(self.sock, _proof(self._secret, b"link", theirs, mine, role_bytes), hub_side=True,
                        role=role_bytes.decode(errors="replace"))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()
