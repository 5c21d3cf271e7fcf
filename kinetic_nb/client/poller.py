"""The one poller: a job's stored records, read incrementally, become snapshots.

On a bucket each poll is one listing of the job's objects. The listing's
versions say which objects changed; only those are read: a status that changed,
an exit record once, a log chunk once (chunks are append-only). When nothing
changed, a poll costs the listing alone. On a local disk a poll looks by name
at what may have changed, a one-shot job and a session's cell by the same
rules: the few records that decide the outcome and the leader's output at every
poll, a host's records once it ended or failed, every host's at a slower pace
and once all have ended; its cost follows what changed, not the number of
hosts. Every record is
verified under the job's key before it is parsed or shown (``runner.records``),
and read only up to its kind's limit (``runner.protocol.limits``; one listed
over it is not read at all): one that fails either is never rendered, and the
host's log says "unverified record from host i" in its place. The snapshots are the
view model of ``kinetic_nb.state``; the poller is what feeds it from storage
and the backend.
"""

from __future__ import annotations

import collections
import collections.abc
import concurrent.futures
import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable

from kinetic_nb.backends import Backend
from kinetic_nb.backends.base import PlatformView
from kinetic_nb.client.echo import LeaderEcho
from kinetic_nb.client.local_looks import LocalLooks
from kinetic_nb.errors import IntegrityError, ObjectNotFoundError
from kinetic_nb.runner import protocol
from kinetic_nb.runner.envelope import read_limited
from kinetic_nb.runner.frame_locals import FrameLocals
from kinetic_nb.runner.logs import LogScreen, shown_text
from kinetic_nb.runner.protocol import CancelRequest, ExitSummary, HostStatus, JobPlan, Phase
from kinetic_nb.runner.records import open_log_chunk, open_record, unverified_line
from kinetic_nb.state import (
    LOST_CONFIRM_S,
    HostSnapshot,
    HostState,
    JobSnapshot,
    JobStatus,
    host_state,
    is_chatter,
    is_quiet,
    job_status,
    may_become_chatter,
)
from kinetic_nb.storage import ObjectInfo, Storage

logger = logging.getLogger(__name__)

__all__ = ["LOG_TAIL_LINES", "JobPoller"]

#: Lines of each host's log the poller keeps for the panel's drill-down.
LOG_TAIL_LINES = 200
#: How much older than a cell's submission a record on a local disk must be to be known as an earlier cell's:
#: the disk's clock for file times runs up to a few milliseconds behind (the kernel's coarse clock).
STORED_BEFORE_SLACK_S = 0.05
#: Records read at once on a remote store.
READERS = 16
class _HostRecords:
    """What the poller has read of one host so far."""

    def __init__(self) -> None:
        self.status: HostStatus | None = None
        self.exit: ExitSummary | None = None
        self.heartbeat_at: float | None = None
        #: When this notebook first saw the heartbeat past its limit (monotonic; None: not since it last changed).
        self.silent_since: float | None = None
        #: When the host last printed or changed phase (the newest such object's time).
        self.active_at: float | None = None
        self.tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
        #: The names of this host's records that did not verify (none of their content was used).
        self.unverified: list[str] = []
        #: The log as a terminal shows it: a progress bar's ``\r`` rewrites its line.
        self.screen = LogScreen()
        #: The newest complete line worth its row: not blank, not chatter, not its framework's teardown.
        self.own_line = ""
        #: Counts what changed here: a host's snapshot is built again only when this moved.
        self.revision = 0

    def add_log(self, stream: str, text: str) -> None:
        self.revision += 1
        lines = self.screen.feed(stream, text)
        self.tail.extend(lines)
        if stream != protocol.FRAMEWORK_OUTPUT:  # teardown noise stays in the log (the tail), off the row
            self.own_line = next((shown for shown in map(shown_text, reversed(lines))
                                  if shown.strip() and not is_chatter(shown)), self.own_line)

    def refuse(self, index: int, name: str) -> None:
        """A record that did not verify: remembered by name, and said in the log in its place."""
        self.revision += 1
        self.unverified.append(name)
        self.add_log(protocol.STDERR, unverified_line(index, name) + "\n")

    def lines(self) -> tuple[str, ...]:
        return (*self.tail, *self.screen.partial())

    def last_line(self) -> str:
        """The newest line worth showing, as plain text (``shown_text``): not blank, not framework chatter, not a
        line that may become chatter, not what the framework printed in its teardown."""
        partial = self.screen.partial(leaving_out=protocol.FRAMEWORK_OUTPUT)
        for shown in map(shown_text, reversed(partial)):
            if shown.strip() and not may_become_chatter(shown):
                return shown
        return self.own_line


class JobPoller(LocalLooks):
    """Reads a job's records incrementally: one listing per poll (on a local disk, the few that changed by name).

    With ``cell=None`` it reads a whole job: its hosts' states are their own
    records'. With ``cell=seq`` it reads one cell of a session: a host's state
    is where its session-level status says it is against that cell, and its
    output is the cell's own log chunks (``cells/{seq}/log/``), so a cell's
    cost does not grow with the cells before it.
    """

    def __init__(self, storage: Storage, plan: JobPlan, backend: Backend, *, key: bytes | None,
                 submitted_at: float | None = None,
                 on_leader_output: Callable[[str, str], None] | None = None,
                 cell: int | None = None, label: str = "", stored_after: float | None = None):
        self.storage = storage
        self.plan = plan
        self.key = key
        self.backend = backend
        self.submitted_at = submitted_at if submitted_at is not None else time.time()
        self.on_leader_output = on_leader_output
        self._echo = LeaderEcho(on_leader_output) if on_leader_output is not None else None
        self.records = [_HostRecords() for _ in range(plan.world_size)]
        self._listing: list[ObjectInfo] = []
        self.platform = PlatformView()
        #: Stacks fetched for hosts that turned quiet, by host index.
        self.stacks: dict[int, str] = {}
        self.requests = collections.Counter()  # "list" and "read": what polling has cost
        #: A session's cell this poller reads (None: a whole job).
        self.cell = cell
        #: A cell this notebook just stored on a local disk: when, before it was stored. A host's status stored
        #: before then is its earlier cell's (the host is pending for this one), and is not read: a cell reads
        #: each host's end of it, and a status only where a host moved while it ran. (A bucket's times are its
        #: own clock's, not this machine's: there every changed status is read.)
        self.stored_after = stored_after if storage.local_path() is not None else None
        #: What the panel's header calls it (a session's cell: ``In[4] · session ks-...``).
        self.label = label
        #: A cell's poller on a local disk: per host, the next of the cell's log chunks to look for.
        self.next_chunk = [0] * plan.world_size
        #: Hosts whose output for the cell is all stored (their agent wrote the cell's last chunk).
        self.output_complete: set[int] = set()
        #: A cell on a local disk: when the next look at every host's records is due (monotonic), the hosts whose
        #: end of the cell is read, and the version of the first failure's record last seen (a host's end). A cell's
        #: first look at every host comes one interval in, as the later ones do: a quick cell's hosts are looked
        #: at once, by its last look (a look at its start finds them where the last cell left them).
        self._every_host_look_at = 0.0
        if cell is not None:
            self._schedule_every_host_look()
        self._cell_ended: set[int] = set()
        #: A cell's hosts that have loaded it (their marker at its barrier, in the cell's folder), and when: one
        #: still on the last cell by its status is in this one, and running it once every host is.
        self._cell_ready: dict[int, float | None] = {}
        self._first_failure_seen: str | None = None
        self._looked_at_every_end = False
        #: A one-shot job on a local disk: every host below this one has ended (its exit record is found), and the
        #: host that failed first (its agent's first-failure record), looked at every look until its end is read.
        self._ended_below = 0
        self._failed_first: int | None = None
        #: ... and the hosts whose records and output were looked at once their end was: nothing of them changes.
        self._read_to_the_end: set[int] = set()
        #: ... and its records below its own folder as last looked at by name (with the folder: ``listing``).
        self._looked_at: dict[str, ObjectInfo] = {}
        #: A cell's host snapshots as last built, with the revision of the records each was built from.
        self._built: dict[int, tuple[int, HostSnapshot]] = {}
        #: A cell the notebook interrupted: once every host is back, it ended as cancelled.
        self.interrupted = False
        self._versions: dict[str, str] = {}
        self._status = JobStatus.PENDING
        self._cancelled = False
        #: Why the job was cancelled (``CancelRequest.TIMEOUT`` when its agent stopped it at the plan's timeout).
        self.cancel_request: CancelRequest | None = None
        self._started = False
        #: handle.json's highest revision read so far: an older one replayed is ignored.
        self._handle_revision = 0
        self._lock = threading.Lock()  # a background watcher and the caller may poll at once

    @property
    def listing(self) -> list[ObjectInfo]:
        """The job's objects as last looked at: a bucket's last listing; on a local disk, a one-shot job's own
        folder as its last look listed it and its hosts' records as last looked at by name."""
        return [*self._listing, *self._looked_at.values()] if self._looked_at else self._listing

    @property
    def exits(self) -> dict[int, ExitSummary]:
        return {i: r.exit for i, r in enumerate(self.records) if r.exit is not None}

    def _read(self, info: ObjectInfo) -> bytes | None:
        """``info``'s record as stored (None: gone); ``IntegrityError`` when it is over its kind's limit."""
        self.requests["read"] += 1
        data = self._fetch(info)
        if isinstance(data, IntegrityError):
            raise data
        return data

    def _fetch(self, info: ObjectInfo) -> bytes | IntegrityError | None:
        """``info``'s record as stored, read up to its kind's limit (``protocol.limits``); the error that refuses
        it when its listed size, or what is there now, is over that; None when it is gone."""
        try:
            return read_limited(self.storage, info.name, listed_size=info.size)
        except ObjectNotFoundError:
            return None
        except IntegrityError as error:  # over its limit: refused, nothing of it read
            return error

    def poll(self) -> JobSnapshot:
        """Read what changed (one listing on a bucket, records by name on a local disk); the job as it is now."""
        with self._lock:
            if self.cell is not None:
                if self.storage.local_path() is not None:
                    self._look_by_name()
                else:  # the hosts' records, and the cell's (its output, its hosts' ends): two listings at once
                    self.requests["list"] += 2
                    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
                        hosts, output = pool.map(self.storage.list, (protocol.HOSTS_DIR + "/",
                                                                     protocol.cell_dir(self.cell) + "/"))
                    self._absorb([*hosts, *output])
                self._close_echo_when_done()
                snapshot = self.snapshot()
                self._status = snapshot.status
                return snapshot
            if not self._status.done:
                if self.storage.local_path() is not None and not self.plan.session:  # a session's hosts: listed
                    self._look_at_job_by_name()
                else:
                    self.requests["list"] += 1
                    self._listing = self.storage.list()
                    self._absorb(self._listing)
                self._observe_platform()
                self._close_echo_when_done()
                if self._cleaned_up_status() is not None:
                    self._status = self._cleaned_up_status()
                    return self.snapshot()
                snapshot = self.snapshot()
                self._status = job_status(self.plan, self.exits, started=self._started, cancelled=self._cancelled,
                                          lost=snapshot.lost)
            return self.snapshot()

    def _verified(self, name: str, data: bytes) -> bytes:
        """``data`` read as ``name``, once it verifies (``IntegrityError`` otherwise); as it is for a job from
        before signing that its user chose to trust (``key=None``)."""
        return open_record(self.key, name, data, where=f"{self.storage.uri}/{name}")

    def _cleaned_up_status(self) -> JobStatus | None:
        """A job cleaned up after its outcome keeps only handle.json, which records that outcome."""
        listed = {info.name: info for info in self._listing}
        if protocol.PLAN in listed or protocol.HANDLE not in listed:
            return None
        data = self._read(listed[protocol.HANDLE])
        if data is None:
            return None
        record = json.loads(self._verified(protocol.HANDLE, data))
        revision = int(record.get("revision", 0))
        if revision < self._handle_revision:
            return None  # an older handle replayed over the newest: never go back
        self._handle_revision = revision
        recorded = record.get("status")
        return JobStatus(recorded) if recorded else None

    def _absorb(self, listing: list[ObjectInfo]) -> None:
        changed: list[tuple[int, str, ObjectInfo]] = []
        ended: list[tuple[int, str, ObjectInfo]] = []
        # A host whose end of this cell is listed: that record is its status, whatever its status.json says now.
        done = {parsed[1] for info in listing if (parsed := protocol.parse_cell_done(info.name)) is not None
                and parsed[0] == self.cell} | self._cell_ended if self.cell is not None else set()
        for info in listing:
            if info.name == protocol.CANCEL:
                self._absorb_cancel(info)
                continue
            if self.cell is not None:
                in_cell = protocol.parse_cell_log_chunk(info.name)
                if in_cell is not None:
                    if in_cell[0] == self.cell and in_cell[1] < self.plan.world_size \
                            and self._versions.get(info.name) != info.version:
                        changed.append((in_cell[1], "log", info))
                    continue
                ready = protocol.parse_cell_ready(info.name)
                if ready is not None:
                    if ready[0] == self.cell:
                        self._saw_ready(ready[1], info.updated)
                    continue
                ended_cell = protocol.parse_cell_done(info.name)
                if ended_cell is not None:  # a host's status as the cell left it: stored at once, by its own name
                    if ended_cell[0] == self.cell and ended_cell[1] < self.plan.world_size \
                            and info.name not in self._versions:
                        changed.append((ended_cell[1], "status", info))
                    continue
            parsed = protocol.parse_host_object(info.name)
            if parsed is None or parsed[0] >= self.plan.world_size:
                continue
            index, kind, _ = parsed
            records = self.records[index]
            self._started = True
            if kind == "heartbeat":
                if info.updated != records.heartbeat_at:
                    records.heartbeat_at, records.silent_since = info.updated, None
                    records.revision += 1
            elif kind == "stacks" or self._versions.get(info.name) == info.version or (kind == "status" and (
                    index in done or self._before_the_cell(info))):
                continue  # stacks are read on request (``stacks()``); an unchanged record is not read again
            elif kind == "exit":
                ended.append((index, kind, info))  # taken after this listing's log chunks: output precedes an end
            elif kind == "log" and self.cell is not None:
                continue  # what the host printed before its first cell
            else:
                changed.append((index, kind, info))
        changed += ended
        for (index, kind, info), data in zip(changed, self._read_all([info for _, _, info in changed]), strict=True):
            self._absorb_record(index, kind, info, data)

    def _saw_ready(self, index: int, at: float | None) -> None:
        """Host ``index`` has loaded this cell (its barrier marker is there): its row says so, and every row
        does once the last host has (the barrier lets them all go)."""
        if index >= self.plan.world_size or index in self._cell_ready:
            return
        self._cell_ready[index] = at
        changed = range(self.plan.world_size) if len(self._cell_ready) == self.plan.world_size else (index,)
        for moved in changed:
            self.records[moved].revision += 1

    def _before_the_cell(self, info: ObjectInfo) -> bool:
        """Whether ``info`` was stored before this cell was (with room for a disk's coarse clock)."""
        return self.stored_after is not None and info.updated is not None \
            and info.updated < self.stored_after - STORED_BEFORE_SLACK_S

    def _read_all(self, infos: list[ObjectInfo]) -> list[bytes | IntegrityError | None]:
        """The records listed, in order (as :meth:`_fetch`): read together on a remote store, where each read is a
        round trip (a cell's end brings every host's status and last chunk at once), one by one on a local disk."""
        self.requests["read"] += len(infos)
        if len(infos) < 2 or self.storage.local_path() is not None:
            return [self._fetch(info) for info in infos]
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(len(infos), READERS)) as pool:
            return list(pool.map(self._fetch, infos))

    def _close_echo_when_done(self) -> None:
        if self._echo is not None and (self.records[protocol.LEADER_INDEX].exit is not None
                                       or protocol.LEADER_INDEX in self.output_complete):
            self._echo.close()  # the leader's last chunk is in: no line of it grows any more

    def end_echo(self) -> None:
        """Echo nothing more of the leader's output: the cell's outcome is decided (``LeaderEcho.end``)."""
        if self._echo is not None:
            self._echo.end()

    def _absorb_cancel(self, info: ObjectInfo) -> None:
        if self._cancelled or self._versions.get(info.name) == info.version:
            return
        self._versions[info.name] = info.version
        try:
            data = self._read(info)
            self.cancel_request = CancelRequest.from_json(self._verified(info.name, data)) if data else None
            self._cancelled = data is not None
        except IntegrityError as error:  # a forged cancel: the hosts' agents ignore it too
            logger.warning("ignored: %s", error)

    def _absorb_record(self, index: int, kind: str, info: ObjectInfo, data: bytes | IntegrityError | None) -> None:
        """One changed record of host ``index`` as read (None: gone; an error: over its limit, so not read),
        verified before anything of it is used."""
        records = self.records[index]
        if data is None:
            return
        self._versions[info.name] = info.version
        records.revision += 1
        if self.cell is not None and protocol.parse_cell_done(info.name) is not None:
            self._cell_ended.add(index)
        try:
            if isinstance(data, IntegrityError):
                raise data
            if kind == "status":
                status = HostStatus.from_json(self._verified(info.name, data))
                if records.status is None or status.revision >= records.status.revision:  # never go back
                    records.status = status
                if self.cell is not None and status.cell != self.cell:
                    return  # another cell's move: not this cell's activity
            elif kind == "exit":
                records.exit = ExitSummary.from_json(self._verified(info.name, data))
                return
            else:
                chunk = open_log_chunk(self.key, info.name, data, where=f"{self.storage.uri}/{info.name}")
                self.next_chunk[index] = max(self.next_chunk[index], self._chunk_number(info.name) + 1)
                if self.cell is not None and chunk.end:
                    self.output_complete.add(index)
                for stream, text in chunk.segments:
                    records.add_log(stream, text)
                    if index == protocol.LEADER_INDEX and self._echo is not None:
                        self._echo.feed(stream, text)
        except IntegrityError:
            records.refuse(index, info.name)
            return
        records.active_at = max(records.active_at or 0.0, info.updated or time.time())

    def _observe_platform(self) -> None:
        """What only the platform sees: a pod evicted, an agent that died (the backend keeps its own pace). On a
        local disk, where a look lists only the job's own folder, the backend gets the job's whole listing, made
        if it reads it (Kubernetes on a shared disk does; the local, ssh and Ray backends never do)."""
        listing = self._listing if self.storage.local_path() is None or self.plan.session else _ListedOnUse(self)
        self.platform = self.backend.observe(self.storage, self.plan, listing, self.exits, self.key)
        for index, summary in self.platform.exits.items():
            if index < self.plan.world_size and self.records[index].exit is None:
                self.records[index].exit = summary
                self.records[index].revision += 1

    def _platform_reasons(self) -> dict[int, str]:
        """Why hosts that have not started yet are waiting, from the platform (a pod's scheduler reason)."""
        return {index: reason for index, reason in self.platform.waiting.items() if not self.records[index].status}

    def snapshot(self) -> JobSnapshot:
        """The job as last read, without a listing (a platform backend may answer from its cache)."""
        now = time.time()
        hosts = [self._built_cell_host(index) if self.cell is not None else self._job_host(index, now)
                 for index in range(self.plan.world_size)]
        hosts = self._with_quiet(hosts, now)
        status = self._cell_status(hosts) if self.cell is not None else self._status
        return JobSnapshot(self.plan.job_id, self.backend.name, self.plan.accelerator, status,
                           self.submitted_at, now, tuple(hosts), label=self.label,
                           procs_per_host=self.plan.procs_per_host)

    def _host(self, index: int, state: str, status: HostStatus | None, started_at: float | None,
              waiting: str = "") -> HostSnapshot:
        """Host ``index`` in ``state``, as far as ``status`` (None: nothing of it yet) tells; ``waiting``: why,
        when nothing does."""
        records = self.records[index]
        return HostSnapshot(
            index=index, state=state, phase=status.phase if status else Phase.STARTUP.value, started_at=started_at,
            updated_at=status.updated_at if status else None, heartbeat_at=records.heartbeat_at,
            last_line=records.last_line(), log_tail=records.lines(),
            # The host's own words (its exception's, which may hold escapes), as text the panel shows.
            message=shown_text(status.message) if status else waiting,
            traceback=shown_text(status.traceback) if status else "",
            exit=records.exit, history=tuple((phase, float(at)) for phase, at in status.history) if status else (),
            memory=_memory(status.memory) if status else {},
            frame_locals=_frame_locals(status.frame_locals) if status else (),
            profiled=_span(status.profiled) if status else (),
        )

    def _job_host(self, index: int, now: float) -> HostSnapshot:
        records = self.records[index]
        status = records.status
        state = host_state(status, records.exit, records.heartbeat_at, now)
        if state == HostState.LOST.value:  # lost once it stays silent for LOST_CONFIRM_S more of this notebook's time
            records.silent_since = records.silent_since or time.monotonic()
            if time.monotonic() - records.silent_since < LOST_CONFIRM_S:
                state = host_state(status, None, None, now)
        return self._host(index, state, status, status.started_at if status else None,
                          self._platform_reasons().get(index, ""))

    def _built_cell_host(self, index: int) -> HostSnapshot:
        """Host ``index`` as this cell sees it, built again only when its records changed (it depends on nothing
        else): a look at a large slice builds the hosts that moved."""
        revision = self.records[index].revision
        built = self._built.get(index)
        if built is None or built[0] != revision:
            built = self._built[index] = (revision, self._cell_host(index))
        return built[1]

    def _cell_host(self, index: int) -> HostSnapshot:
        """Host ``index`` as this cell sees it: pending while on an earlier cell, its cell's outcome once back
        to idle (by then its failure payload is stored), its end if its process ended."""
        records = self.records[index]
        status = records.status
        if records.exit is not None:
            state = HostState.FAILED.value if records.exit.failed else HostState.STOPPED.value
        elif status is None or status.cell < self.cell:
            return self._cell_host_by_marker(index)
        elif status.cell > self.cell or status.state == HostState.IDLE.value:
            failed = status.cell == self.cell and status.cell_failed
            stopped = failed and (status.cell_stopped or status.message.split(":", 1)[0].endswith("HostStoppedError"))
            state = (HostState.STOPPED if stopped else HostState.FAILED if failed else HostState.SUCCEEDED).value
        elif status.state in (HostState.FAILED.value, HostState.STOPPED.value):
            state = HostState.RUNNING.value  # its failure counts once it is back to idle
        else:
            state = status.state
        current = status if status is not None and status.cell == self.cell else None  # what it says of this cell
        return self._host(index, state, current, current.history[0][1] if current and current.history else None)

    def _cell_host_by_marker(self, index: int) -> HostSnapshot:
        """Host ``index`` before its status tells of this cell (a status is stored a moment later, and on a local
        disk every host's is looked at every ``EVERY_HOST_LOOK_S``): pending, ready once its marker at the cell's
        barrier is there, running once every host's is."""
        if index not in self._cell_ready:
            return self._host(index, HostState.PENDING.value, None, None)
        every = len(self._cell_ready) == self.plan.world_size
        state, phase = (HostState.RUNNING, Phase.EXECUTE) if every else (HostState.READY, Phase.START_BARRIER)
        return dataclasses.replace(self._host(index, state.value, None, self._cell_ready[index]), phase=phase.value)

    def _cell_status(self, hosts: list[HostSnapshot]) -> JobStatus:
        if all(host.state == HostState.SUCCEEDED.value for host in hosts):
            return JobStatus.SUCCEEDED
        if not all(host.ended for host in hosts):
            return JobStatus.RUNNING if any(host.phase != Phase.STARTUP.value for host in hosts) else JobStatus.PENDING
        # Stopped as asked (an interrupt, the cell's timeout) with no host failed or gone: the cell was stopped.
        stopped_only = all(host.state in (HostState.SUCCEEDED.value, HostState.STOPPED.value) and host.exit is None
                           for host in hosts)
        return JobStatus.CANCELLED if stopped_only else JobStatus.FAILED

    def _with_quiet(self, hosts: list[HostSnapshot], now: float) -> list[HostSnapshot]:
        """A running host silent (no output, no phase change) for the grace since another ended is quiet: shown
        with its stacks, once fetched (the handle asks for them)."""
        if self.cell is not None:
            ends = [host.ended_at for host in hosts if host.ended and host.ended_at]
        else:
            ends = [records.exit.ended_at for records in self.records if records.exit and records.exit.ended_at]
        first_end = min(ends, default=None)
        return [dataclasses.replace(host, state=HostState.QUIET.value, stacks=shown_text(self.stacks.get(host.index, "")))
                if host.state == HostState.RUNNING.value and is_quiet(
                    max(filter(None, (self.records[host.index].active_at, host.updated_at)), default=None),
                    first_end, self.plan.grace_s, now)
                else host for host in hosts]


class _ListedOnUse(collections.abc.Sequence):
    """A job's whole listing (one ``storage.list()``), made the first time it is read, and then once only."""

    def __init__(self, poller: JobPoller):
        self._poller = poller
        self._listing: list[ObjectInfo] | None = None

    def _listed(self) -> list[ObjectInfo]:
        if self._listing is None:
            self._poller.requests["list"] += 1
            self._listing = self._poller.storage.list()
        return self._listing

    def __getitem__(self, index: int | slice) -> ObjectInfo | list[ObjectInfo]:
        return self._listed()[index]

    def __len__(self) -> int:
        return len(self._listed())


def _frame_locals(records: object) -> tuple[FrameLocals, ...]:
    """A status's failing frames as the display reads them; anything malformed left out."""
    if not isinstance(records, list):
        return ()
    return tuple(frame for record in records if (frame := FrameLocals.from_dict(record)) is not None)


def _span(span: object) -> tuple[float, float] | tuple[()]:
    """A status's profiled span as ``(start, end)``; anything malformed, none."""
    if isinstance(span, list) and len(span) == 2 and all(isinstance(at, (int, float)) for at in span):
        return float(span[0]), float(span[1])
    return ()


def _memory(figures: object) -> dict[str, int]:
    """A status's memory figures as the display reads them: byte counts by name, anything else left out."""
    if not isinstance(figures, dict):
        return {}
    return {name: value for name, value in figures.items()
            if isinstance(name, str) and isinstance(value, int) and not isinstance(value, bool) and value >= 0}
