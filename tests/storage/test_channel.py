"""A session's direct channel (``runner.channel``): a cell on a bucket travels notebook -> hub -> hosts and
back without the bucket, the channel refuses what does not verify, a channel cut mid-cell leaves the cell to
storage, and a second kernel sees the same cells.

The hub is real (the session's agent's), the hosts are real processes, storage
is fake-gcs-server; a notebook's route to the hub goes through a loopback TCP
forward that the test can cut, as a killed port-forward is.
"""

from __future__ import annotations

import itertools
import socket
import threading
import time

import pytest

import kinetic_nb
from kinetic_nb.backends.local import LocalBackend
from kinetic_nb.client.sessions import attach_session
from kinetic_nb.errors import ChannelClosed, IntegrityError, JobFailedError
from kinetic_nb.runner import protocol
from kinetic_nb.runner.channel import Channel, Hub, Joining, connect
from kinetic_nb.runner.channel_link import HANDSHAKE_TIMEOUT_S, Arrival, channel_key
from kinetic_nb.runner.envelope import seal
from kinetic_nb.runner.job_keys import new_key
from kinetic_nb.storage import open_storage
from tests.tcp_forward import TcpForward

from .test_cell_cost import RequestCount

HOSTS = 4
GUARD_S = 30.0


def wait_until(predicate, what: str, guard: float = GUARD_S) -> None:
    deadline = time.monotonic() + guard
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {guard:g} s")
        time.sleep(0.02)


class ForwardedLocal(LocalBackend):
    """The local backend, its notebook reaching the hub through a forward the test holds."""

    def __init__(self) -> None:
        super().__init__()
        self.forward: TcpForward | None = None

    def channel_route(self, plan, announced):
        self.forward = TcpForward(announced)
        return self.forward.address


# -- the channel alone ---------------------------------------------------------------------------------------


@pytest.fixture
def hub_and_key():
    """A hub of a 2-host session, listening; closed after the test."""
    key = new_key()
    hub = Hub(key, hosts=2)
    hub.start()
    yield hub, key
    hub.close()


class Tap:
    """A connection's socket with every frame it sends kept (``frames``), and optionally altered on the way."""

    def __init__(self, sock):
        self._sock = sock
        self.frames: list[bytes] = []
        self.alter = None

    def sendall(self, data):
        self.frames.append(bytes(data))
        return self._sock.sendall(self.alter(bytes(data)) if self.alter else data)

    def __getattr__(self, name):
        return getattr(self._sock, name)


def _closed_by_the_hub(link) -> bool:
    link.sock.settimeout(5)
    try:
        while data := link.sock.recv(1 << 16):  # whatever the hub had sent before, then the end
            pass
        return data == b""  # whatever the hub had sent is read first
    except OSError:
        return True


@pytest.mark.parametrize("attack", ["altered", "replayed", "reordered"])
def test_a_frame_that_is_altered_replayed_or_reordered_is_refused_and_its_connection_closed(attack, hub_and_key):
    hub, key = hub_and_key
    link = connect(hub.address, key, "notebook")
    try:
        tap = link.sock = Tap(link.sock)
        link.send({"name": "cells/000001/ready-1", "at": time.time()}, b"first")
        wait_until(lambda: hub.mirror.get("cells/000001/ready-1") == b"first", "the first record arrived")
        if attack == "altered":  # one bit of the record, after the tag was made over the intact frame
            tap.alter = lambda data: data[:-1] + bytes([data[-1] ^ 1])
            link.send({"name": "cells/000001/ready-3", "at": time.time()}, b"third")
        elif attack == "replayed":  # the first frame again, word for word
            tap.sendall(tap.frames[0])
        else:  # the next frame's tag with a later number: as if one frame were dropped in between
            link._sent += 1
            link.send({"name": "cells/000001/ready-3", "at": time.time()}, b"third")
        assert _closed_by_the_hub(link), "the hub kept a connection that sent a frame that does not verify"
        assert hub.mirror.get("cells/000001/ready-3") is None
        wait_until(lambda: hub.peers() == [], "the hub let the connection go")
    finally:
        link.close()


def test_nobody_without_the_sessions_key_joins_or_is_joined(hub_and_key):
    hub, key = hub_and_key
    with pytest.raises((IntegrityError, ConnectionError)):
        connect(hub.address, new_key(), "notebook", timeout=5)
    wait_until(lambda: hub.peers() == [], "the hub let the connection go")
    impostor = Hub(new_key(), hosts=1)  # a listener that does not hold the key: the peer refuses it
    impostor.start()
    try:
        with pytest.raises(IntegrityError, match="does not hold this session's key"):
            connect(impostor.address, key, "notebook", timeout=5)
    finally:
        impostor.close()


def test_a_newcomer_gets_what_the_hub_holds_and_hosts_get_no_hosts_records(hub_and_key):
    hub, key = hub_and_key
    hub.publish("hosts/1/status.json", b"status")
    hub.publish("cells/000001/payload.pkl", b"payload")
    notebook = Channel.open(hub.address, key, "notebook")
    host = Channel.open(hub.address, key, "host-1")
    assert notebook.mirror.get("hosts/1/status.json") == b"status"
    assert host.mirror.get("hosts/1/status.json") is None
    assert host.mirror.get("cells/000001/payload.pkl") == b"payload"
    notebook.send("cells/000002/payload.pkl", b"next")
    wait_until(lambda: host.mirror.get("cells/000002/payload.pkl") == b"next", "the host heard the next cell")
    notebook.close()
    host.close()


def test_a_hosts_word_on_a_cell_goes_to_the_leader_and_the_notebook_alone(hub_and_key):
    """Ready markers, ends of a cell and failure payloads are the leader's to read (it decides the barrier) and the
    notebook's: sent to every host, a cell of N hosts would cost the hub N x N messages."""
    hub, key = hub_and_key
    leader, worker = Channel.open(hub.address, key, "host-0"), Channel.open(hub.address, key, "host-1")
    other, notebook = Channel.open(hub.address, key, "host-2"), Channel.open(hub.address, key, "notebook")
    words = [f"cells/000004/{protocol.cell_ready(1)}", protocol.cell_done(4, 1),
             f"cells/000004/{protocol.worker_result(1)}"]
    for name in words:
        worker.send(name, b"word")
    worker.send(f"cells/000004/{protocol.LEADER_READY}", b"go")  # the last sent: every word before it has arrived
    for reader in (leader, notebook):
        wait_until(lambda reader=reader: reader.mirror.get(f"cells/000004/{protocol.LEADER_READY}") == b"go",
                   "the verdict passed on")
        assert all(reader.mirror.get(name) == b"word" for name in words)
    leader.send(f"cells/000005/{protocol.LEADER_READY}", b"go")
    wait_until(lambda: other.mirror.get(f"cells/000005/{protocol.LEADER_READY}") == b"go", "another host heard it")
    assert other.mirror.get(f"cells/000004/{protocol.LEADER_READY}") == b"go"  # what all hosts read, it heard
    assert [name for name in words if other.mirror.get(name) is not None] == []
    for channel in (leader, worker, other, notebook):
        channel.close()


def test_a_record_one_peer_reads_costs_the_hub_a_look_at_its_name_not_at_every_peer(hub_and_key, monkeypatch):
    """A host's word on a cell goes to the leader and the notebook: the hub decides who reads it once, from its
    name, rather than asking of each of its N peers whether it reads it (N x N looks at names per cell, since
    each of N hosts says ready and done)."""
    hub, key = hub_and_key
    hosts = [Channel.open(hub.address, key, f"host-{index}") for index in range(24)]
    notebook = Channel.open(hub.address, key, "notebook")
    wait_until(lambda: len(hub.peers()) == 25, "every peer joined")
    looks = []
    parse = protocol.parse_host_object
    here = threading.current_thread()  # the peers' mirrors, in this process too, look at what they receive

    def counted(name):
        if threading.current_thread() is here:
            looks.append(name)
        return parse(name)

    monkeypatch.setattr(protocol, "parse_host_object", counted)
    hub.publish(protocol.cell_done(7, 5), b"done")
    hub.publish(protocol.host_status(5), b"status")
    assert len(looks) <= 2 * 2, f"{len(looks)} looks at 2 names with 25 peers joined"  # the hub's, the mirror's
    wait_until(lambda: notebook.mirror.get(protocol.host_status(5)) == b"status", "the notebook heard the status")
    assert hosts[0].mirror.get(protocol.cell_done(7, 5)) == b"done"
    assert [index for index, host in enumerate(hosts[1:], 1) if host.mirror.get(protocol.cell_done(7, 5))] == []
    for channel in (*hosts, notebook):
        channel.close()


def _threads_for(roles: list[str]) -> int:
    """The threads of this process named for one of ``roles`` (a hub's threads for a peer bear its role)."""
    return sum(thread.name.rsplit("-", 2)[-2:] in [role.split("-") for role in roles]
               for thread in threading.enumerate())


def test_a_peer_costs_the_hub_no_thread_and_a_record_wakes_none(hub_and_key):
    """The hub hears every peer from one thread, and writes a record to each peer from the thread that hears it,
    without waiting (what a socket does not take waits for its one writer): no thread per peer, woken for each
    record it sends or is sent (at 1,024 hosts, threads woken and put to sleep were most of the hub's work)."""
    hub, key = hub_and_key
    roles = [f"host-{index}" for index in range(100, 120)]  # no other test's
    hosts = [Channel.open(hub.address, key, role) for role in roles]
    wait_until(lambda: len(hub.peers()) == 20, "every peer joined")
    assert _threads_for(roles) == len(roles)  # the peers' own (each channel's), none in the hub
    hub.publish("cells/000002/payload.pkl", b"payload")
    wait_until(lambda: all(host.mirror.get("cells/000002/payload.pkl") == b"payload" for host in hosts),
               "every host heard the payload")
    for channel in hosts:
        channel.close()


def test_a_peer_that_reads_nothing_holds_up_no_other_and_gets_every_record_in_order_once_it_reads(hub_and_key):
    hub, key = hub_and_key
    stalled = connect(hub.address, key, "host-1")  # joined, reading nothing: its socket fills
    host = Channel.open(hub.address, key, "host-0")
    wait_until(lambda: len(hub.peers()) == 2, "both joined")
    record = bytes(64 << 10)
    for seq in range(1, 201):  # 12.5 MiB: far more than a socket holds
        hub.publish(f"control/cell-{seq:06d}-submitted.json", b"%d" % seq + record)
    wait_until(lambda: host.mirror.get("control/cell-000200-submitted.json") is not None, "the other host heard all")
    names = []
    while len(names) < 200:  # every record, in order
        header, data = stalled.receive()
        if "name" in header:
            names.append(header["name"])
            assert data.startswith(b"%d" % len(names)) and len(data) > len(record)
    assert names == [f"control/cell-{seq:06d}-submitted.json" for seq in range(1, 201)]
    stalled.close()
    host.close()


def test_a_record_the_hub_fails_to_hear_loses_the_peer_that_sent_it_alone():
    """One thread hears every peer: an error while it passes on one peer's record (the agent's callback) sends
    that peer away, and the others are still heard."""
    key = new_key()

    def on_record(name, data):
        if name == "control/bad.json":
            raise RuntimeError("the agent's own error")

    hub = Hub(key, hosts=2, on_record=on_record)
    hub.start()
    try:
        bad, good = Channel.open(hub.address, key, "host-0"), Channel.open(hub.address, key, "host-1")
        bad.send("control/bad.json", b"x")
        wait_until(lambda: bad.broken is not None, "the peer whose record failed was let go")
        good.send("control/good.json", b"y")
        wait_until(lambda: hub.mirror.get("control/good.json") == b"y", "the other peer is still heard")
        assert hub.peers() == ["host-1"]
        good.close()
    finally:
        hub.close()


# -- a session on a bucket -------------------------------------------------------------------------------------


def test_a_session_cell_on_a_bucket_travels_through_the_channel_and_storage_still_gets_every_record(gcs_root,
                                                                                                 monkeypatch):
    from kinetic_nb.storage import gcs as kinetic_gcs

    session = kinetic_nb.start(hosts=HOSTS, framework="none", storage=gcs_root, idle_timeout=600, echo=False)
    try:
        assert session.run("x = 41").result(timeout=GUARD_S) is None
        assert session.channel is not None and session.channel.broken is None
        # The hosts met at the cell's barrier through the channel, not the bucket.
        assert session.channel.mirror.get(f"{protocol.cell_dir(1)}/{protocol.cell_ready(3)}") == b""
        session._last_cell.cleanup.result()  # the last cell's objects removed (in the background) before counting
        count = RequestCount(kinetic_gcs._client(), monkeypatch)
        count.on = True
        handle = session.run("x + 1")
        assert handle.result(timeout=GUARD_S) == 42
        count.on = False
        # The notebook's own requests: the payload, and the cell's timeout in the background: no look at all.
        assert count.kinds.get("GET object", 0) == 0 and count.kinds.get("GET list", 0) == 0, count.kinds
        # Storage is still the record: every host's status names the cell, within a second or so.
        plain = open_storage(session.storage.uri)

        def stored_idle_after_cell_2() -> bool:
            from kinetic_nb.runner.records import read_host_status
            statuses = [read_host_status(plain, session.group.key, index) for index in range(HOSTS)]
            return all(status is not None and status.cell == 2 and status.state == "idle" for status in statuses)

        wait_until(stored_idle_after_cell_2, "every host's status of cell 2 was stored")
    finally:
        session.stop()


def test_a_channel_cut_mid_cell_leaves_the_cell_to_storage_and_it_ends_by_the_usual_rules(gcs_root, capsys):
    backend = ForwardedLocal()
    session = kinetic_nb.start(hosts=HOSTS, framework="none", storage=gcs_root, idle_timeout=600, echo=False,
                               backend=backend)
    try:
        assert session.run("import time, os\nx = 1").result(timeout=GUARD_S) is None
        assert backend.forward is not None and session.channel.broken is None
        handle = session.run("time.sleep(1.5)\nx + 1")
        time.sleep(0.5)
        backend.forward.cut()
        assert handle.result(timeout=GUARD_S) == 2
        assert session.channel.broken is not None
        # The next cells go through storage, and the failure rules hold there: the lowest failing host's own error.
        failing = session.run("if int(os.environ['KINETIC_HOST_INDEX']) >= 2:\n"
                              "    raise ValueError(f\"no on {os.environ['KINETIC_HOST_INDEX']}\")\n")
        with pytest.raises(ValueError, match="no on 2"):
            failing.result(timeout=GUARD_S)
        said = capsys.readouterr().err
        assert said.count("direct channel: it broke") == 1, said
        assert session.run("x + 2").result(timeout=GUARD_S) == 3
    finally:
        session.stop()


@pytest.mark.parametrize("second_route", ["storage", "channel"])
def test_a_second_kernel_sees_the_cells_the_first_runs_through_the_channel(gcs_root, monkeypatch, second_route):
    first = kinetic_nb.start(hosts=HOSTS, framework="none", storage=gcs_root, idle_timeout=600, echo=False)
    try:
        assert first.run("x = 1").result(timeout=GUARD_S) is None
        second = attach_session(first.session_id, storage=gcs_root, echo=False)
        if second_route == "storage":  # the second kernel's route is refused: it works through storage
            monkeypatch.setattr(LocalBackend, "channel_route", lambda self, plan, announced: None)
        assert second.run("x = x + 10\nx").result(timeout=GUARD_S) == 11
        assert (second.channel is not None) == (second_route == "channel")
        assert first.run("x = x + 100\nx").result(timeout=GUARD_S) == 111
        assert first.channel is not None and first.channel.broken is None
        assert second.cell(3).logs() == ""
        assert second.run("x").result(timeout=GUARD_S) == 111
        assert first.run("x * 2").result(timeout=GUARD_S) == 222
        seqs = sorted(int(info.name.split("/")[1]) for info in open_storage(first.storage.uri).list("cells/")
                      if info.name.endswith("/" + protocol.PAYLOAD))
        assert seqs == [1, 2, 3, 4, 5]
    finally:
        first.stop()


def test_a_forged_record_on_the_channel_is_refused_by_its_reader(gcs_root):
    """A record passed on by the hub is verified as the same object read from storage would be: a cell's
    payload sealed under another key never runs."""
    session = kinetic_nb.start(hosts=2, framework="none", storage=gcs_root, idle_timeout=600, echo=False)
    try:
        assert session.run("x = 5").result(timeout=GUARD_S) is None
        forged = seal(new_key(), protocol.PAYLOAD, b"not a cell")
        session.channel.send(f"{protocol.cell_dir(2)}/{protocol.PAYLOAD}", forged)
        handle = session.run("x")  # the next free number is 2 in storage; the hosts hold a forged cell 2
        with pytest.raises(IntegrityError):
            handle.result(timeout=GUARD_S)
    finally:
        session.stop()



def test_a_mirror_keeps_the_latest_cells_only_and_says_so():
    from kinetic_nb.runner.channel import KEEP_CELLS, Mirror

    mirror = Mirror()
    for seq in range(1, 11):
        mirror.put(f"{protocol.cell_dir(seq)}/payload.pkl", b"cell")
        mirror.put(protocol.cell_control(seq, "submitted"), b"record")
        mirror.put(f"hosts/0/log/{seq:06d}.json", b"chunk")
    kept = sorted({int(name.split("/")[1]) for name, *_ in mirror.entries("cells/")})
    assert kept == list(range(11 - KEEP_CELLS, 11))
    assert len(mirror.entries("control/")) == KEEP_CELLS
    assert not mirror.covers(f"{protocol.cell_dir(10 - KEEP_CELLS)}/result.pkl")
    assert mirror.covers(f"{protocol.cell_dir(11 - KEEP_CELLS)}/result.pkl") and mirror.covers("hosts/0/status.json")


def test_a_name_written_ten_times_in_a_second_is_stored_at_most_once_a_second_and_last_as_written(tmp_path):
    from kinetic_nb.runner.relayed import STORE_INTERVAL_S, WriteBehind

    stored = []
    storage = open_storage(str(tmp_path))
    real = storage.write_bytes

    def write_bytes(name, data, *, exclusive=False):
        stored.append((time.monotonic(), name, data))
        real(name, data, exclusive=exclusive)

    storage.write_bytes = write_bytes
    behind = WriteBehind(storage)
    for revision in range(10):
        behind.put("hosts/0/status.json", b"%d" % revision)
        time.sleep(0.1)
    time.sleep(STORE_INTERVAL_S * 1.2)  # the last one stored on its schedule (closing would store it at once)
    behind.close()
    times = [at for at, _, _ in stored]
    assert all(later - earlier >= STORE_INTERVAL_S * 0.99 for earlier, later in itertools.pairwise(times)), times
    assert 1 <= len(stored) <= 2 and storage.read_bytes("hosts/0/status.json") == b"9"


def test_the_hub_says_complete_only_once_every_host_has_joined(hub_and_key):
    """The leader's start verdict puts the session's cells on the channel only when the hub has said that every
    host joined it: one host that could not join keeps every host on storage, none waits on a channel."""
    hub, key = hub_and_key
    leader = Channel.open(hub.address, key, "host-0")
    notebook = Channel.open(hub.address, key, "notebook")
    assert not leader.complete.wait(0.3)
    worker = Channel.open(hub.address, key, "host-1")
    assert leader.complete.wait(5) and worker.complete.wait(5)
    assert not notebook.complete.is_set()
    for channel in (leader, worker, notebook):
        channel.close()


def test_a_host_that_goes_before_every_host_joined_may_join_again_and_one_that_goes_after_is_lost():
    """A host whose try to join timed out on a busy hub (it was let in, then gave up and tries again) goes before
    every host is here: nobody uses the channel yet, so it is no loss (the hub used to close, and every host of a
    256-host session went to storage); it joins again and the hub says complete. Once it has, a host that goes is
    lost (everyone then goes back to storage)."""
    key = new_key()
    lost: list[str] = []
    hub = Hub(key, hosts=3, on_lost=lost.append)
    hub.start()
    try:
        leader = Channel.open(hub.address, key, "host-0")
        Channel.open(hub.address, key, "host-1").close()  # let in, then gone: its try timed out
        wait_until(lambda: hub.peers() == ["host-0"], "the host that went was let go")
        last = Channel.open(hub.address, key, "host-2")
        assert not leader.complete.wait(0.3)  # host 1 is missing: nobody may use the channel
        again = Channel.open(hub.address, key, "host-1")
        assert all(channel.complete.wait(5) for channel in (leader, last, again))
        assert lost == [] and hub.peers() == ["host-0", "host-2", "host-1"]
        again.close()
        wait_until(lambda: lost == ["host-1"], "a host that went after every host joined was lost")
        for channel in (leader, last):
            channel.close()
    finally:
        hub.close()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_host_that_looks_for_the_hub_before_it_listens_joins_once_it_does():
    """On Ray a host may look for the hub before the leader's agent listens: it keeps trying until the leader's
    verdict, so the session's first cells do not fall to storage for a start that came in another order."""
    key = new_key()
    address = ("127.0.0.1", _free_port())
    joining = Joining(address, key, "host-1")
    assert joining.wait(0.5) is None and "refused" in joining.error.lower(), joining.error
    hub = Hub(key, address, hosts=2)
    hub.start()
    try:
        leader = Channel.open(hub.address, key, "host-0")
        channel = joining.wait(GUARD_S)
        assert channel is not None and joining.error == ""
        assert joining.settle() is channel and channel.complete.wait(5) and leader.complete.wait(5)
        channel.close()
        leader.close()
    finally:
        hub.close()


def test_a_host_waiting_at_a_busy_hubs_door_keeps_its_place_until_the_hub_answers():
    """A hub busy with a thousand hosts' joins answers the connections at its door in turn: a host that gave up
    after a handshake's timeout and came back would wait at the end of the line again, and the hub would go on
    accepting connections whose hosts had left (at 1,024 hosts on two cores the channel never formed). Here the
    hub listens, and accepts only after a handshake's timeout: the host's first connection joins."""
    key = new_key()
    hub = Hub(key, ("127.0.0.1", 0), hosts=1)
    try:
        joining = Joining(hub.address, key, "host-0")
        time.sleep(HANDSHAKE_TIMEOUT_S + 1)
        hub.start()
        channel = joining.wait(GUARD_S)
        assert channel is not None and channel.complete.wait(5), joining.error
        assert hub.refused == {}  # no connection of the host's was left behind at the door
        channel.close()
    finally:
        hub.close()


def test_a_join_the_hub_lets_go_before_it_is_in_fails_at_once_not_at_its_timeout():
    """A busy hub lets a host go whose proof it did not see in time: the host hears the close and tries again at
    once, not after its try's whole wait (60 s: at 256 hosts started together, 64 of them sat out the leader's
    wait for every host to join, and the session's cells went through storage)."""
    key = new_key()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()

        def hub_that_lets_go():
            sock, _ = listener.accept()
            arrival = Arrival(sock, channel_key(key), time.monotonic() + GUARD_S)
            while arrival.step() is None:  # proven: then let go, as a hub does one it saw too late
                time.sleep(0.01)
            sock.close()

        threading.Thread(target=hub_that_lets_go, daemon=True).start()
        started = time.monotonic()
        with pytest.raises(ChannelClosed, match="closed as it was joined"):
            Channel.open(listener.getsockname(), key, "host-1", timeout=GUARD_S)
        assert time.monotonic() - started < GUARD_S / 2


def test_a_hub_given_a_name_listens_at_its_addresses_and_the_loopback_and_announces_the_name():
    """On a pod or an ssh host the hub is given host 0's name: it listens at the addresses the name has here and
    on the loopback (a port-forward reaches a pod's loopback), never on every interface, and announces the name;
    at an address, that alone."""
    key, port = new_key(), _free_port()
    named = Hub(key, ("localhost", port), hosts=1)
    at_address = Hub(key, ("127.0.0.1", 0), hosts=1)
    try:
        assert named.announced == f"localhost:{port}"
        assert {address[0] for address in named._door.listening} <= {"127.0.0.1", "::1"}
        assert at_address.announced == f"127.0.0.1:{at_address.address[1]}"
        named.start()
        Channel.open(("127.0.0.1", port), key, "host-0").close()
    finally:
        named.close()
        at_address.close()


def test_joining_stops_when_told_or_when_the_hub_does_not_hold_the_sessions_key(hub_and_key):
    """``settle`` ends the tries at once when nothing listens (a host that cannot join goes on by storage), and
    a hub without the session's key is never tried again, nor given up on later by a deadline."""
    nowhere = Joining(("127.0.0.1", _free_port()), new_key(), "host-1")
    started = time.monotonic()
    assert nowhere.settle() is None and time.monotonic() - started < 2 and "refused" in nowhere.error.lower()
    hub, key = hub_and_key
    joined = Joining(hub.address, key, "host-1")
    assert joined.wait(5) is not None
    joined.abandon("the session's hosts did not all join the channel")  # the verdict said no: it leaves
    assert joined.channel.broken == "the session's hosts did not all join the channel"
    heard = []
    stranger = Joining(hub.address, new_key(), "host-1", give_up_after_s=GUARD_S,
                       then=lambda channel, error: heard.append((channel, error)))
    assert stranger.wait(5) is None and heard == [(None, stranger.error)] and "key" in stranger.error
    given_up = Joining(("127.0.0.1", _free_port()), new_key(), "agent-1", give_up_after_s=0.5,
                       then=lambda channel, error: heard.append((channel, error)))
    wait_until(lambda: len(heard) == 2, "an agent that cannot reach its hub gives up after its deadline", 5)
    assert heard[1] == (None, given_up.error) and "refused" in given_up.error.lower()


@pytest.mark.parametrize("victim", [0, 2], ids=["leader", "worker"])
def test_a_host_killed_mid_cell_on_the_channel_fails_the_cell_naming_it_and_ends_the_session(gcs_root, victim):
    """A host that dies leaves the channel: everyone goes back to storage, the cell fails by the usual rules
    (the dead host named, with its signal), and the session ends, with no wait on a channel nobody feeds."""
    session = kinetic_nb.start(hosts=3, framework="none", storage=gcs_root, idle_timeout=600, echo=False, grace=2)
    try:
        assert session.run("import os, signal, time").result(timeout=GUARD_S) is None
        started = time.monotonic()
        handle = session.run(f"if os.environ['KINETIC_HOST_INDEX'] == '{victim}':\n"
                             "    os.kill(os.getpid(), signal.SIGKILL)\n"
                             "time.sleep(60)")
        with pytest.raises(JobFailedError, match=f"host {victim} was killed by SIGKILL") as info:
            handle.result(timeout=GUARD_S)
        assert time.monotonic() - started < GUARD_S
        assert "session" in "\n".join(getattr(info.value, "__notes__", [])) and session.ended() is not None
    finally:
        session.stop()
