"""Sessions: a slice kept up across cells, its hosts' namespaces kept from cell to cell.

``start(hosts=4)`` starts the hosts once (and the framework once) and returns
a :class:`Session` when every host is idle; ``session.run(source)`` sends one
cell to every host and returns a :class:`CellHandle` with the one-shot
handle's methods. Each cell has its own records under ``cells/{seq}/`` and
the seed's outcome rules; a failed cell keeps the session when every host is
back to idle within the grace period, and ends it otherwise (the host agent
decides, with or without a client). A session stops itself after its idle
timeout.

Everything is in storage under ``{root}/sessions/{session_id}/``, signed as a
job's records are (each cell's under its own derived key), so ``sessions()``
and ``attach_session()`` work from any kernel of the same user.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from kinetic_nb.backends import Backend, get_backend
from kinetic_nb.client import post_mortem
from kinetic_nb.client.background import BackgroundWork
from kinetic_nb.client.catalog_records import listed_ids, owned_here, printable
from kinetic_nb.client.cell_handle import CellHandle
from kinetic_nb.client.host_group import HostGroup
from kinetic_nb.client.keys import load_key
from kinetic_nb.client.launch import choose_backend, launch_hosts, print_to_stdout, storage_root
from kinetic_nb.client.memory_growth import MemoryGrowth
from kinetic_nb.client.plan import (
    backend_slice,
    check_protocol,
    check_shape,
    choose_framework,
    new_job_id,
    prepare_cell,
)
from kinetic_nb.client.waiting import wait_for
from kinetic_nb.errors import (
    ChannelClosed,
    IntegrityError,
    KineticError,
    KineticTimeoutError,
    ObjectExistsError,
    ObjectNotFoundError,
    StorageError,
)
from kinetic_nb.runner import protocol
from kinetic_nb.runner.channel import NOTEBOOK, STORED, Channel, parse_address
from kinetic_nb.runner.envelope import read_sealed, seal
from kinetic_nb.runner.group import cell_key
from kinetic_nb.runner.job_keys import SESSION
from kinetic_nb.runner.protocol import CancelRequest, HostState, HostStatus, JobPlan, LeaderReady, process_label
from kinetic_nb.runner.records import open_record, read_exit, read_host_status, read_record
from kinetic_nb.runner.relayed import CARRY_MAX_BYTES, Relay, RelayedStorage, hosts_agreed
from kinetic_nb.runner.wakeup import wake, wakeup_path
from kinetic_nb.state import JobSnapshot, JobStatus
from kinetic_nb.storage import Storage, default_root, open_storage

logger = logging.getLogger(__name__)

__all__ = ["Session", "SessionEndedError", "attach_session", "sessions", "start"]

#: A session with no cell for this long stops itself (a forgotten TPU slice costs money).
DEFAULT_IDLE_TIMEOUT_S = 3600.0
#: A session id, matched whole (``fullmatch``): ASCII digits only, and nothing after it (not even a newline).
SESSION_ID = re.compile(r"ks-[0-9]{8}-[0-9]{6}-[0-9a-f]+")


class SessionEndedError(KineticError):
    """The session is no longer up (stopped, idle too long, or ended by a failure); ``restart()`` starts it again."""


class Session:
    """A slice kept up across cells. Run cells with :meth:`run`; ``stop``, ``restart``."""

    def __init__(self, group: HostGroup, *, echo: Callable[[str, str], None] | None = None):
        #: The session's hosts: their states, logs, stacks, and stopping them.
        self.group = group
        self.echo = echo
        self.cells_run = 0
        #: Each host's memory after each cell: a host that keeps growing is said once (``client.memory_growth``).
        self.memory_growth = MemoryGrowth()
        #: A decided cell's outcome removed, off the next cell's way.
        self.background = BackgroundWork(f"kinetic-cleanup-{group.plan.job_id}")
        self._ended_hosts = False
        #: The last cell run from this kernel: its poll read the leader's status when the cell ended.
        self._last_cell: CellHandle | None = None
        self._last_seq = 0
        self._lock = threading.Lock()
        #: The direct channel to the session's hub (``runner.channel``) while it is up; cells read their records
        #: through :attr:`records`, which is plain storage without it.
        self.channel: Channel | None = None
        self._relay = self._new_relay()
        self.records = RelayedStorage(self._relay)
        self._announced: tuple[str, int] | bool | None = False  # False: not looked up yet
        self._next_join = 0.0
        self._said_no_channel = False
        self._channel_problem: str | None = None
        self._channel_seen = 0

    @property
    def session_id(self) -> str:
        return self.group.job_id

    @property
    def plan(self) -> JobPlan:
        return self.group.plan

    @property
    def storage(self) -> Storage:
        return self.group.storage

    def __repr__(self) -> str:
        return f"<Session {self.session_id} {self.plan.hosts} host{'' if self.plan.hosts == 1 else 's'} {self.state()}>"

    # -- state ---------------------------------------------------------------------------

    def ended(self, *, hosts_ended: bool | None = None) -> str | None:
        """Why the session ended, or None while it is up.

        Asked on every poll of a cell, so it costs little: the stop request
        by name, then whether a host's end is recorded: ``hosts_ended`` when
        the caller has just looked (a cell's poll has), else each exit record
        by name on a local disk and one listing of the hosts' records
        elsewhere (one request, where each record by name is one per host).
        """
        if self._channel_up and hosts_ended is None:  # however it ends, its hosts' ends come through the channel
            hosts_ended = any((parsed := protocol.parse_host_object(name)) is not None and parsed[1] == "exit"
                              for name, *_ in self._relay.mirror.entries(protocol.HOSTS_DIR + "/"))
            if not hosts_ended:
                return None
        try:
            if self._may_exist(protocol.CANCEL):
                return CancelRequest.from_json(read_record(self.storage, self.group.key, protocol.CANCEL)).reason
        except (ObjectNotFoundError, IntegrityError):  # none, or a forged one: the agents ignore it too
            pass
        if not self._ended_hosts and hosts_ended is None:
            hosts_ended = any(read_exit(self.storage, self.group.key, index) is not None for index in self._exits_listed())
        if self._ended_hosts or hosts_ended:
            self._ended_hosts = True
            return "its hosts have ended"
        return None

    def _may_exist(self, name: str) -> bool:
        """False where a local disk says ``name`` is not there (one stat, where reading it walks its folders from
        the storage's root: most of what asking whether the session ended cost a cell); True elsewhere."""
        path = self.storage.local_path(name)
        return path is None or os.path.lexists(path)

    def _exits_listed(self) -> list[int]:
        """The hosts whose exit record may exist: those a stat finds on a local disk, those a listing of the
        hosts' records names elsewhere."""
        if self.storage.local_path() is not None:
            return [index for index in range(self.plan.world_size) if self._may_exist(protocol.host_exit(index))]
        listed = (protocol.parse_host_object(info.name) for info in self.storage.list(protocol.HOSTS_DIR + "/"))
        return [item[0] for item in listed if item is not None and item[1] == "exit" and item[0] < self.plan.world_size]

    def _verified_exits(self, indices: list[int]) -> set[int]:
        """The hosts of ``indices`` whose exit record verifies: read together on a remote store, where each read
        is a round trip (a thousand hosts' ends, one after another, took minutes on a busy bucket)."""
        def ended(index: int) -> bool:
            return read_exit(self.storage, self.group.key, index) is not None

        if len(indices) < 2 or self.storage.local_path() is not None:
            return {index for index in indices if ended(index)}
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(len(indices), EXIT_READERS)) as pool:
            return {index for index, verified in zip(indices, pool.map(ended, indices), strict=True) if verified}

    def state(self) -> str:
        return "up" if self.ended() is None else "ended"

    def held_names(self) -> list[str]:
        """The names the leader's namespace holds after the last cell that ended: through the channel, its latest
        status as carried; else its end of this kernel's last cell, unless a later cell (another kernel's) has
        ended since, whose end record is then read (each cell's is looked up by name: one request when there is
        none, however old the session)."""
        if self._channel_up:  # the leader's latest status, as the channel carried it
            name = protocol.host_status(protocol.LEADER_INDEX)
            data = self._relay.mirror.get(name)
            if isinstance(data, bytes):
                with contextlib.suppress(IntegrityError, ValueError):
                    return list(HostStatus.from_json(open_record(self.group.key, name, data, where=name)).names)
        last = self._last_cell
        status = last.poller.records[protocol.LEADER_INDEX].status \
            if last is not None and last.seq == self._last_seq else None
        while (newer := self._end_of(self._last_seq + 1)) is not None:
            status, self._last_seq = newer, self._last_seq + 1
        if status is None and self._last_seq:  # a kernel that attached: the last cell's end, as its leader left it
            status = self._end_of(self._last_seq)
        if status is None:  # no cell has ended yet: the leader's status as stored
            status = read_host_status(self.storage, self.group.key, protocol.LEADER_INDEX)
        return list(status.names) if status is not None else []

    def host_status(self, rank: int) -> HostStatus | None:
        """Rank ``rank``'s status as it is now: its ``status.json``, or its end of this kernel's last cell where
        that is newer (on a local disk ``status.json`` follows a cell that succeeded a moment later)."""
        status = read_host_status(self.records, self.group.key, rank)
        end = self._end_of(self._last_seq, rank) if self._last_seq else None
        return end if end is not None and (status is None or end.revision > status.revision) else status

    def _end_of(self, seq: int, rank: int = protocol.LEADER_INDEX) -> HostStatus | None:
        """Rank ``rank``'s status as cell ``seq`` left it (``cells/{seq}/done-{rank}``), or None while it has not
        ended there (through the channel, as it carried it)."""
        name = protocol.cell_done(seq, rank)
        try:
            return HostStatus.from_json(read_record(self.records, self.group.key, name))
        except (ObjectNotFoundError, IntegrityError, ValueError):
            return None

    def summary(self) -> str:
        """Hosts, their states, uptime, cells run and the idle countdown, as text."""
        snapshot = self.group.snapshot()
        uptime = time.time() - self.plan.created_at
        shape = f"{self.plan.hosts} host{'' if self.plan.hosts == 1 else 's'}" + (f" x {self.plan.procs_per_host} processes"
                                               if self.plan.procs_per_host > 1 else "")
        lines = [f"session {self.session_id} · {snapshot.backend} · {self.plan.accelerator} · {shape} "
                 f"· framework {self.plan.framework} · up {uptime:.0f} s · {self._last_seq} cells"]
        if self.plan.idle_timeout_s:
            last = max((host.updated_at or 0.0 for host in snapshot.hosts), default=0.0)
            left = self.plan.idle_timeout_s - (time.time() - max(last, self.plan.created_at))
            lines[0] += f" · stops itself after {max(0.0, left):.0f} s idle"
        ended = self.ended()
        if ended:
            lines.append(f"ended: {ended}")
        for host in snapshot.hosts:  # one row per process: its rank, or host.process where hosts run several
            label = process_label(host.index, self.plan.procs_per_host)
            lines.append(f"{label:>5}{'*' if host.is_leader else ' '}  {host.state:<9}  {host.last_line[:100]}")
        return "\n".join(lines)

    # -- the direct channel -----------------------------------------------------------------

    @property
    def _channel_up(self) -> bool:
        return self.channel is not None and self.channel.broken is None

    def join_channel(self) -> bool:
        """Open the direct channel to the session's hub, where it has one and this backend can reach it; whether
        it is up. Where it cannot be opened (or broke), the cell says why once and goes through storage, and it
        is tried again a minute later."""
        if self._channel_up:
            return True
        if self._channel_problem is not None:  # said once, before the next cell (never at a session's end)
            self._say_no_channel(self._channel_problem)
            self._channel_problem = None
        if self._announced is False:
            try:
                record = json.loads(read_record(self.storage, self.group.key, protocol.CHANNEL))
                self._announced = parse_address(str(record.get("address", "")))
            except (ObjectNotFoundError, IntegrityError, ValueError, AttributeError):
                self._announced = None  # a session with no hub (a local disk, a backend without one)
            if self._announced is not None and not self._hosts_use_channel():
                self._announced = None  # the hub closed when the hosts' start verdict said no
                self._say_no_channel("not every host of the session could join it")
        if self._announced is None or time.monotonic() < self._next_join:
            return False
        try:
            route = self.group.backend.channel_route(self.plan, self._announced)
            if route is None:
                self._announced = None
                return False
            channel = Channel.open(route, self.group.key, NOTEBOOK, timeout=CHANNEL_OPEN_S,
                                   on_broken=self._channel_broke)
        except (OSError, IntegrityError, KineticError) as error:
            self._next_join = time.monotonic() + CHANNEL_RETRY_S
            self._say_no_channel(f"it could not be opened ({error})")
            return False
        if not hosts_agreed(channel.mirror, self.group.key):  # a host could not join it: for the session's life
            channel.close("the session's hosts do not use it")
            self._announced, self._channel_problem = None, None
            self._say_no_channel("not every host of the session could join it")
            return False
        self.channel = channel
        self._relay = self._new_relay()  # a relay that fell back stays plain: a new channel, a new one
        self.records = RelayedStorage(self._relay)
        self._relay.attach(channel.send, channel.mirror)
        return True

    def _hosts_use_channel(self) -> bool:
        """Whether the hosts' start verdict, as stored, says their cells travel through the channel."""
        try:
            verdict = LeaderReady.from_json(read_record(self.storage, self.group.key, protocol.LEADER_READY))
        except (ObjectNotFoundError, IntegrityError, ValueError, TypeError):
            return False
        return verdict.go and verdict.channel

    def _new_relay(self) -> Relay:
        return Relay(self.group.storage, serves=lambda name: name.startswith((protocol.HOSTS_DIR + "/",
                                                                             protocol.CELLS_DIR + "/")))

    def _channel_broke(self, reason: str) -> None:
        self._relay.fall_back(reason)
        self._next_join = time.monotonic() + CHANNEL_RETRY_S
        self._channel_problem = f"it broke ({reason})"

    def _say_no_channel(self, why: str) -> None:
        if not self._said_no_channel:
            self._said_no_channel = True
            print(f"kinetic_nb: session {self.session_id}'s direct channel: {why}; its cells travel through "
                  f"storage (tried again after {CHANNEL_RETRY_S:g} s)", file=sys.stderr, flush=True)

    def share(self, name: str, body: bytes, key: bytes | None = None, *, sealed_as: str | None = None,
              exclusive: bool = False) -> None:
        """Store record ``name`` sealed under ``key`` as ``sealed_as`` (the session's key, as ``name``, by
        default), and pass it through the channel while it is up: its hosts and agent hear it at once, storage
        keeps it."""
        data = seal(key or self.group.key, sealed_as or name, body)
        self.storage.write_bytes(name, data, exclusive=exclusive)
        self._pass_on(name, data)

    def _pass_on(self, name: str, data: bytes) -> None:
        if self._channel_up:
            with contextlib.suppress(ChannelClosed):
                self.channel.send(name, data if len(data) <= CARRY_MAX_BYTES else STORED)

    def _keep(self, name: str, body: bytes) -> None:
        """``share`` a small record off the cell's way, through the channel first (it carries it whole): a storage
        that does not answer is a line in the log (the agent has the record; the cell says what an outage means)."""
        data = seal(self.group.key, name, body)
        self._pass_on(name, data)  # first: the agent has it at once, however long storage takes
        try:
            self.storage.write_bytes(name, data)
        except StorageError as error:
            logger.warning("session %s: %s", self.session_id, protocol.storage_error_words(error))

    def sleep(self, seconds: float) -> None:
        """Pause between two looks at a cell: less when the channel brings something."""
        if self._channel_up:  # what arrived since the last pause ends this one at once
            self._channel_seen = self.channel.mirror.wait(seconds, since=self._channel_seen)
        else:
            self.group.sleep(seconds)

    def close_channel(self) -> None:
        if self.channel is not None:
            self.channel.close("closed by the notebook")
            self._relay.fall_back("closed by the notebook")
            self.channel = None

    # -- cells ---------------------------------------------------------------------------

    def run(self, source: str, *, out: Iterable[str] = (), namespace: Mapping[str, Any] | None = None,
            timeout: float | None = None, cell_name: str = "kinetic cell", echo: Any = None,
            profile: bool = False) -> CellHandle:
        """Send ``source`` to every host; a handle on the cell (``result()``, ``hosts()``, ``logs()``, ...).

        ``profile=True`` runs it under its framework's profiler on every host (``CellHandle.profile()``).
        Names the hosts already hold are taken from the hosts, never shipped
        from ``namespace``; other names the cell reads from ``namespace`` are
        shipped as a one-shot job ships them.
        """
        ended = self.ended()
        if ended is not None:
            raise SessionEndedError(f"session {self.session_id} has ended ({ended}): restart it (%kinetic restart, "
                                    "or session.restart())")
        check_shape(timeout=timeout)
        out = list(out)
        if self.storage.local_path() is None:
            self.join_channel()
        held = self.held_names()
        # With framework "auto", the hosts initialize the one the first cell that imports one uses.
        profiled = {protocol.CELL_PROFILE: True} if profile else {}  # under its framework's profiler on every host

        def extra(modules: set[str]) -> dict[str, Any]:
            if self.plan.framework == "auto":
                return {protocol.CELL_FRAMEWORK: choose_framework("auto", modules), **profiled}
            return profiled
        payload = prepare_cell(source, namespace or {}, filename=f"<{cell_name}>", out=out, held=held, extra=extra)
        self.group.open_wakeup()  # before the cell is stored: its hosts wake this notebook when they are done
        stored_after = time.time()
        seq = self._submit(payload.data, timeout)
        printer = print_to_stdout if echo is True else (echo or self.echo)
        # The panel names the cell as the notebook does (In[4]); a cell from the API by its number.
        name = cell_name.removeprefix("kinetic ") if cell_name != "kinetic cell" else None
        self._last_cell = CellHandle(self.group, session=self, seq=seq, timeout=timeout, echo=printer, name=name,
                                     profiled=profile, stored_after=stored_after)
        return self._last_cell

    def cell(self, seq: int) -> CellHandle:
        """A handle on cell ``seq`` of this session, run from this kernel or another (its outcome, hosts, logs)."""
        if not (isinstance(seq, int) and seq >= 1):
            raise ValueError(f"cells are numbered from 1, got {seq!r}")
        if not self.storage.child(protocol.cell_dir(seq)).exists(protocol.PAYLOAD):  # asked, not downloaded
            raise ValueError(f"session {self.session_id} has no cell {seq}")
        return CellHandle(self.group, session=self, seq=seq, echo=self.echo)

    def _submit(self, data: bytes, timeout: float | None = None) -> int:
        """Store the cell under the next free number: cells from two kernels run one at a time, in order."""
        with self._lock:
            seq = self._last_seq + 1
            while True:
                name = f"{protocol.cell_dir(seq)}/{protocol.PAYLOAD}"
                try:
                    self.share(name, data, cell_key(self.group.key, seq), sealed_as=protocol.PAYLOAD, exclusive=True)
                    break
                except ObjectExistsError:
                    logger.debug("%s taken by another kernel", name)
                    seq += 1
            self._last_seq = seq
            self.cells_run += 1
        if self.storage.local_path() is not None:  # the hosts are on this machine: wake them now
            for index in range(self.plan.world_size):
                wake(wakeup_path(self.session_id, index))
        # The cell's timeout travels with it: the agent enforces it, with or without this kernel. Through the
        # channel the agent has it at once: storage keeps it in the background, off the cell's way.
        submitted = (protocol.cell_control(seq, "submitted"), json.dumps({"at": time.time(), "timeout": timeout}).encode())
        if self._channel_up:
            threading.Thread(target=self._keep, args=submitted, name=f"kinetic-submitted-{seq}").start()
        else:
            self.share(*submitted)
        return seq

    def post_mortem(self, rank: int, expression: str, *, frame: str = "raised") -> str:
        """The text of ``expression`` evaluated on ``rank`` in the frame its last cell failed in, as ``%debug``
        would (``frame="cell"``: the cell's own innermost frame, where the failure left the cell's code). The
        other hosts are not touched; the host keeps the frame until its next cell starts.

        Raises
        ------
        PostMortemError
            The host keeps no failing frame, the expression raised there, or no answer came.
        """
        last = self._last_cell
        if last is not None and last.cleanup is not None:  # its questions and answers live beside the outcome
            last.cleanup.result()
        return post_mortem.ask(self, rank, expression, frame=frame)

    # -- lifecycle -----------------------------------------------------------------------

    def stop(self, reason: str = "stopped by the user") -> str:
        """Stop every host and the agent, whatever state they are in (some may have ended already); wait a
        while for them; say what happened, in one line. The session's records stay (``gc`` removes them)."""
        try:
            read_record(self.storage, self.group.key, protocol.CANCEL)  # stopped already: its agents know
        except (ObjectNotFoundError, IntegrityError, StorageError):  # not stopped, or not known (no answer)
            try:
                self.group.backend.cancel(self.storage, self.plan, reason, self.group.key)
            except StorageError as unreachable:  # its bucket does not answer: say what becomes of the session
                return self._stopped_without_storage(unreachable, self._tell_the_agent_to_stop(reason))
            self._tell_the_agent_to_stop(reason)  # the agent hears it at once
        deadline = time.monotonic() + STOP_WAIT_S
        running = set(range(self.plan.world_size))
        while True:
            running -= self._verified_exits([index for index in self._exits_listed() if index in running])
            agent_gone = self.group.backend.agent_gone(self.plan.job_id)
            if (not running and agent_gone is not False) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        self.group.close_wakeup()
        self.close_channel()
        self.group.backend.release(self.plan)  # its connections to the hosts (ssh's), kept for cells no longer coming
        if running:
            return (f"session {self.session_id}: asked to stop, but {protocol.hosts_named(running)} had not ended "
                    f"after {STOP_WAIT_S:g} s")
        hosts = f"its {self.plan.hosts} host{'s' if self.plan.hosts > 1 else ''}"
        if agent_gone is False:
            return f"session {self.session_id} stopped: {hosts} have ended; its agent had not after {STOP_WAIT_S:g} s"
        return f"session {self.session_id} stopped: {hosts} {'and its agent have' if agent_gone else 'have'} ended"

    def _tell_the_agent_to_stop(self, reason: str) -> bool:
        """The stop request through the direct channel, where it is up (the agent hears it at once); whether it
        went."""
        if not self._channel_up:
            return False
        try:
            self.channel.send(protocol.CANCEL, seal(self.group.key, protocol.CANCEL,
                                                    CancelRequest(reason=reason, at=time.time()).to_json()))
        except ChannelClosed:
            return False
        return True

    def _stopped_without_storage(self, error: StorageError, told: bool) -> str:
        """The notebook lets the session go when its bucket does not answer, and says what becomes of it: its agent
        asked to stop it (through the channel, where it is up; a local agent is signalled), and ended by it at its
        idle timeout if it did not hear (the agent keeps that rule through an outage)."""
        deadline = time.monotonic() + STOP_WAIT_S
        while (gone := self.group.backend.agent_gone(self.plan.job_id)) is False and time.monotonic() < deadline:
            time.sleep(0.05)
        self.group.close_wakeup()
        self.close_channel()
        self.group.backend.release(self.plan)
        if gone:
            return (f"session {self.session_id} stopped: its agent has ended, though its storage does not answer "
                    f"({protocol.storage_error_words(error)})")
        how = " through the session's channel" if told else ""
        unheard = (f"it ends the session after {self.plan.idle_timeout_s:g} s idle (--idle-timeout) if it did not hear"
                   if self.plan.idle_timeout_s else
                   "if it did not hear, stop the session from a notebook that reaches its bucket (%kinetic sessions)")
        return (f"session {self.session_id}: its storage does not answer ({protocol.storage_error_words(error)}); its "
                f"agent was asked to stop it{how}, and {unheard}")

    def restart(self, *, on_snapshot: Callable[[JobSnapshot], None] | None = None) -> Session:
        """Stop this session and start a fresh one of the same shape (fresh state); ``on_snapshot`` sees its
        hosts start, as ``start``'s does."""
        self.stop("stopped for a restart")
        return _start_from(self.group, echo=self.echo, on_snapshot=on_snapshot)


#: How long ``stop`` waits for the hosts and the agent to be gone.
STOP_WAIT_S = 10.0
#: Hosts' exit records read at once on a remote store, as a session stops.
EXIT_READERS = 16
#: How long opening the direct channel may take, and how long after a failure it is tried again.
CHANNEL_OPEN_S = 5.0
CHANNEL_RETRY_S = 60.0


# -- starting, finding ---------------------------------------------------------------------------


def _root(storage: str | None) -> Storage:
    return open_storage(storage or default_root()).child(protocol.SESSIONS_DIR)


def start(*, hosts: int | None = None, accelerator: str | None = None, backend: str | Backend = "local",
          framework: str = "auto", env: Mapping[str, str] | None = None, storage: str | None = None,
          idle_timeout: float | None = DEFAULT_IDLE_TIMEOUT_S, grace: float | None = None,
          backend_options: Mapping[str, Any] | None = None, echo: Any = True, quiet: bool = False,
          ready_timeout: float = 300.0, on_snapshot: Callable[[JobSnapshot], None] | None = None,
          procs_per_host: int | None = None) -> Session:
    """Start a session: the hosts once, the framework once; returns when every host is idle.

    Parameters
    ----------
    hosts, accelerator, backend, framework, env, storage, grace, backend_options, procs_per_host
        As :func:`kinetic_nb.submit`; ``framework="auto"`` initializes the
        framework when the first cell imports it (and runs one process per
        host unless ``procs_per_host`` says otherwise).
    idle_timeout : float or None
        Seconds without a cell before the session stops itself (None or 0: never).
    echo : bool or callable
        Print each cell's leader output (or call ``echo(text, stream)``).
    ready_timeout : float
        Seconds to wait for every host to be idle.
    on_snapshot : callable, optional
        Sees the hosts as they start (a live panel), and once more when they are all idle or one failed.
    """
    if framework not in ("auto", "jax", "torch", "none"):
        raise ValueError(f"framework must be auto, jax, torch or none, got {framework!r}")
    check_shape(hosts=hosts, grace=grace, idle_timeout=idle_timeout, procs_per_host=procs_per_host)
    chosen = choose_backend(backend, backend_options)
    acc, host_count = backend_slice(chosen, hosts, accelerator)
    root = open_storage(storage or storage_root(chosen)).child(protocol.SESSIONS_DIR)
    group = launch_hosts(new_job_id("ks"), SESSION, root, chosen, acc, host_count, framework=framework,
                         env=env or {}, quiet=quiet, detached=True, grace=grace, idle_timeout=idle_timeout or None,
                         procs_per_host=procs_per_host)
    session = Session(group, echo=print_to_stdout if echo is True else (echo or None))
    try:
        _wait_until_idle(session, ready_timeout, on_snapshot)
    except BaseException:  # an interrupt, or a display that failed: a session that never started is not left up
        with contextlib.suppress(Exception):
            session.stop("stopped: its start did not finish")
        raise
    return session


def _wait_until_idle(session: Session, timeout: float, on_snapshot: Callable[[JobSnapshot], None] | None) -> None:
    deadline = time.monotonic() + timeout

    def check(snapshot: JobSnapshot) -> None:
        ended = session.ended()
        if ended is not None or snapshot.status.done or any(host.exit for host in snapshot.hosts):
            if on_snapshot is not None:  # the panel's last word: the hosts as they ended
                on_snapshot(session.group.snapshot())
            try:
                CellHandle(session.group).result()  # the hosts' failures at the start, by the seed's rules
            except BaseException as error:
                raise SessionEndedError(f"session {session.session_id} did not start: {error}") from error
            raise SessionEndedError(f"session {session.session_id} did not start: {ended}")
        if time.monotonic() > deadline:
            session.stop("stopped: its hosts were not ready in time")
            raise KineticTimeoutError(f"session {session.session_id}: hosts were not idle after {timeout:g} s")

    snapshot = wait_for(session.group.snapshot, lambda snap: all(host.state == HostState.IDLE.value for host in snap.hosts),
                        on_snapshot=on_snapshot, between=check, hosts=session.plan.world_size)
    if on_snapshot is not None:
        on_snapshot(dataclasses.replace(snapshot, status=JobStatus.SUCCEEDED, label=f"session {session.session_id} (framework {session.plan.framework}) is up"))


def _start_from(group: HostGroup, *, echo: Any, on_snapshot: Callable[[JobSnapshot], None] | None = None) -> Session:
    plan = group.plan
    record = json.loads(read_sealed(group.storage, protocol.HANDLE, group.key))
    return start(hosts=plan.hosts, accelerator=plan.accelerator if plan.accelerator != "cpu" else None,
                 backend=get_backend(record.get("backend", "local"), **record.get("backend_options", {})),
                 framework=plan.framework, storage=group.storage.uri.rsplit(f"/{protocol.SESSIONS_DIR}/", 1)[0],
                 idle_timeout=plan.idle_timeout_s, grace=plan.grace_s, echo=echo, quiet=True,
                 on_snapshot=on_snapshot, procs_per_host=plan.procs_per_host)


def attach_session(session_id: str, *, storage: str | None = None, echo: Any = True) -> Session:
    """A running session from any kernel of the same user: its hosts and their state as they are."""
    if not SESSION_ID.fullmatch(session_id):
        raise ValueError(f"{printable(repr(session_id))} is not a session id (they look like "
                         "ks-20250101-120000-a1b2c3; %kinetic sessions lists them)")
    session_storage = _root(storage).child(session_id)
    local = session_storage.local_path()
    if local and os.path.lexists(local) and not owned_here(session_storage):
        raise IntegrityError(f"session {session_id} is not yours: its directory belongs to another user")
    key = load_key(session_id, SESSION)
    if key is None:
        if not session_storage.exists(protocol.PLAN):
            raise ObjectNotFoundError(f"no session {session_id} in {_root(storage).uri} (%kinetic sessions lists "
                                      "them)")
        raise IntegrityError(f"session {session_id} is not yours: this user has no key for it")
    try:
        plan = JobPlan.from_json(read_sealed(session_storage, protocol.PLAN, key))
        record = json.loads(read_sealed(session_storage, protocol.HANDLE, key))
    except ObjectNotFoundError:
        raise ObjectNotFoundError(f"no session {session_id} in {_root(storage).uri}") from None
    check_protocol(plan, f"session {session_id}")
    backend = get_backend(record.get("backend", "local"), **record.get("backend_options", {}))
    group = HostGroup(session_storage, plan, backend, key=key, submitted_at=record.get("submitted_at"), detached=True)
    session = Session(group, echo=print_to_stdout if echo is True else (echo or None))
    seqs = [int(info.name.split("/")[1]) for info in session_storage.list(protocol.CELLS_DIR + "/")
            if info.name.endswith("/" + protocol.PAYLOAD)]
    session._last_seq = max(seqs, default=0)
    session.cells_run = len(seqs)
    return session


def sessions(*, storage: str | None = None, limit: int = 20) -> list[dict[str, Any]]:
    """This user's ``limit`` most recent sessions under ``storage``, newest first: id, hosts, accelerator, state.

    Only this user's are listed (a key here and, on ``file://``, a directory this user owns); one whose
    records cannot be read is listed with the state ``UNREADABLE: <reason>``, and never stops the others.
    """
    root = _root(storage)
    found: list[dict[str, Any]] = []
    for session_id, _ in listed_ids(root, SESSION_ID, protocol.HANDLE):
        if len(found) >= limit:
            break
        if owned_here(root.child(session_id)) is False or load_key(session_id, SESSION) is None:
            continue  # another user's, or planted: not listed
        try:
            session = attach_session(session_id, storage=storage, echo=False)
            ended = session.ended()
            found.append({"session_id": session_id, "hosts": session.plan.hosts,
                          "accelerator": printable(session.plan.accelerator),
                          "state": "up" if ended is None else printable(f"ended: {ended}"),
                          "cells": session.cells_run})
        except ObjectNotFoundError:
            continue  # gone while it was listed
        except (KineticError, OSError, ValueError, TypeError, LookupError) as error:
            logger.debug("session %s cannot be listed", session_id, exc_info=True)
            reason = printable(str(error).splitlines()[0] if str(error) else type(error).__name__)
            found.append({"session_id": session_id, "hosts": 0, "accelerator": "", "cells": 0,
                          "state": f"UNREADABLE: {reason}"})
    return found
