"""The one poller: a job's stored records, read incrementally, become snapshots.

Each poll is one listing of the job's objects. The listing's versions say which
objects changed; only those are read: a status that changed, an exit record
once, a log chunk once (chunks are append-only). When nothing changed, a poll
costs the listing alone, whatever the number of hosts. Every record is
verified under the job's key before it is parsed or shown (``runner.records``):
one that fails is never rendered, and the host's log says "unverified record
from host i" in its place. The snapshots are the
view model of ``kinetic_nb.state``; the poller is what feeds it from storage
and the backend.
"""

from __future__ import annotations

import collections
import json
import logging
import threading
import time
from collections.abc import Callable

from kinetic_nb.backends import Backend
from kinetic_nb.backends.base import PlatformView
from kinetic_nb.client.echo import LeaderEcho
from kinetic_nb.errors import IntegrityError, ObjectNotFoundError
from kinetic_nb.runner import protocol
from kinetic_nb.runner.logs import LogScreen
from kinetic_nb.runner.protocol import CancelRequest, ExitSummary, HostStatus, JobPlan, Phase
from kinetic_nb.runner.records import open_log_chunk, open_record, unverified_line
from kinetic_nb.state import (
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


class _HostRecords:
    """What the poller has read of one host so far."""

    def __init__(self) -> None:
        self.status: HostStatus | None = None
        self.exit: ExitSummary | None = None
        self.heartbeat_at: float | None = None
        #: When the host last printed or changed phase (the newest such object's time).
        self.active_at: float | None = None
        self.tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
        #: The names of this host's records that did not verify (none of their content was used).
        self.unverified: list[str] = []
        #: The log as a terminal shows it: a progress bar's ``\r`` rewrites its line.
        self.screen = LogScreen()

    def add_log(self, stream: str, text: str) -> None:
        self.tail.extend(self.screen.feed(stream, text))

    def refuse(self, index: int, name: str) -> None:
        """A record that did not verify: remembered by name, and said in the log in its place."""
        self.unverified.append(name)
        self.add_log(protocol.STDERR, unverified_line(index, name) + "\n")

    def lines(self) -> tuple[str, ...]:
        return (*self.tail, *self.screen.partial())

    def last_line(self) -> str:
        """The newest line worth showing: not blank, not framework chatter, not a line that may become chatter."""
        partial = self.screen.partial()
        for line in reversed(partial):
            if line.strip() and not may_become_chatter(line):
                return line
        return next((line for line in reversed(self.tail) if line.strip() and not is_chatter(line)), "")


class JobPoller:
    """Reads a job's records incrementally, one listing per poll."""

    def __init__(self, storage: Storage, plan: JobPlan, backend: Backend, *, key: bytes | None,
                 submitted_at: float | None = None,
                 on_leader_output: Callable[[str, str], None] | None = None):
        self.storage = storage
        self.plan = plan
        self.key = key
        self.backend = backend
        self.submitted_at = submitted_at if submitted_at is not None else time.time()
        self.on_leader_output = on_leader_output
        self._echo = LeaderEcho(on_leader_output) if on_leader_output is not None else None
        self.records = [_HostRecords() for _ in range(plan.hosts)]
        self.listing: list[ObjectInfo] = []
        self.platform = PlatformView()
        #: Stacks fetched for hosts that turned quiet, by host index.
        self.stacks: dict[int, str] = {}
        self.requests = collections.Counter()  # "list" and "read": what polling has cost
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
    def exits(self) -> dict[int, ExitSummary]:
        return {i: r.exit for i, r in enumerate(self.records) if r.exit is not None}

    def _read(self, name: str) -> bytes | None:
        self.requests["read"] += 1
        try:
            return self.storage.read_bytes(name)
        except ObjectNotFoundError:
            return None

    def poll(self) -> JobSnapshot:
        """One listing; read what changed; return the job as it is now."""
        with self._lock:
            if not self._status.done:
                self.requests["list"] += 1
                self.listing = self.storage.list()
                self._absorb(self.listing)
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
        names = {info.name for info in self.listing}
        if protocol.PLAN in names or protocol.HANDLE not in names:
            return None
        data = self._read(protocol.HANDLE)
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
        ended: list[ObjectInfo] = []
        for info in listing:
            if info.name == protocol.CANCEL:
                if not self._cancelled and self._versions.get(info.name) != info.version:
                    self._versions[info.name] = info.version
                    data = self._read(info.name)
                    try:
                        self.cancel_request = CancelRequest.from_json(self._verified(info.name, data)) if data else None
                        self._cancelled = data is not None
                    except IntegrityError as error:  # a forged cancel: the hosts' agents ignore it too
                        logger.warning("ignored: %s", error)
                continue
            parsed = protocol.parse_host_object(info.name)
            if parsed is None or parsed[0] >= self.plan.hosts:
                continue
            index, kind, _ = parsed
            records = self.records[index]
            self._started = True
            if kind == "heartbeat":
                records.heartbeat_at = info.updated
                continue
            if kind == "stacks":
                continue  # read on request, by JobHandle.stacks()
            if self._versions.get(info.name) == info.version:
                continue
            if kind == "exit":
                ended.append(info)
                self._versions[info.name] = info.version
                continue
            data = self._read(info.name)
            if data is None:
                continue
            self._versions[info.name] = info.version
            try:
                if kind == "status":
                    status = HostStatus.from_json(self._verified(info.name, data))
                    if records.status is None or status.revision >= records.status.revision:  # never go back
                        records.status = status
                else:
                    segments = open_log_chunk(self.key, info.name, data, where=f"{self.storage.uri}/{info.name}")
                    for stream, text in segments.segments:
                        records.add_log(stream, text)
                        if index == protocol.LEADER_INDEX and self._echo is not None:
                            self._echo.feed(stream, text)
            except IntegrityError:
                records.refuse(index, info.name)
                continue
            records.active_at = max(records.active_at or 0.0, info.updated)
        for info in ended:
            data = self._read(info.name)
            if data is not None:
                index = protocol.parse_host_object(info.name)[0]
                try:
                    self.records[index].exit = ExitSummary.from_json(self._verified(info.name, data))
                except IntegrityError:
                    self.records[index].refuse(index, info.name)
        # What only the platform sees: a pod evicted, an agent that died (the backend keeps its own pace).
        self.platform = self.backend.observe(self.storage, self.plan, listing, self.exits, self.key)
        for index, summary in self.platform.exits.items():
            if index < self.plan.hosts and self.records[index].exit is None:
                self.records[index].exit = summary
        if self._echo is not None and self.records[protocol.LEADER_INDEX].exit is not None:
            self._echo.close()  # the leader's last chunk came before its exit record: no line grows any more

    def _platform_reasons(self) -> dict[int, str]:
        """Why hosts that have not started yet are waiting, from the platform (a pod's scheduler reason)."""
        return {index: reason for index, reason in self.platform.waiting.items() if not self.records[index].status}

    def snapshot(self) -> JobSnapshot:
        """The job as last read, without a listing (a platform backend may answer from its cache)."""
        now = time.time()
        hosts = []
        waiting_because = self._platform_reasons()
        ends = [records.exit.ended_at for records in self.records if records.exit is not None and records.exit.ended_at]
        first_end = min(ends) if ends else None
        for index, records in enumerate(self.records):
            status, lines = records.status, records.lines()
            state = host_state(status, records.exit, records.heartbeat_at, now)
            if state == HostState.RUNNING and is_quiet(records.active_at, first_end, self.plan.grace_s, now):
                state = HostState.QUIET.value
            hosts.append(HostSnapshot(
                index=index,
                state=state,
                phase=status.phase if status else Phase.STARTUP.value,
                started_at=status.started_at if status else None,
                updated_at=status.updated_at if status else None,
                heartbeat_at=records.heartbeat_at,
                last_line=records.last_line(),
                log_tail=lines,
                message=status.message if status else waiting_because.get(index, ""),
                traceback=status.traceback if status else "",
                exit=records.exit,
                history=tuple((phase, float(at)) for phase, at in status.history) if status else (),
                stacks=self.stacks.get(index, ""),
            ))
        return JobSnapshot(self.plan.job_id, self.backend.name, self.plan.accelerator, self._status,
                           self.submitted_at, now, tuple(hosts))

