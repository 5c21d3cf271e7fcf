"""One poller turns a job's stored records into snapshots for the panel and the client.

Each poll is one listing of the job's objects. The listing's versions say which
objects changed; only those are read: a status that changed, an exit record
once, a log chunk once (chunks are append-only). When nothing changed, a poll
costs the listing alone, whatever the number of hosts.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import re
import threading
import time
from collections.abc import Callable

from kinetic_nb.backends import Backend
from kinetic_nb.backends.base import PlatformView
from kinetic_nb.errors import ObjectNotFoundError
from kinetic_nb.results import JobStatus, is_peer_loss, job_status
from kinetic_nb.runner import protocol
from kinetic_nb.runner.protocol import CancelRequest, ExitSummary, HostState, HostStatus, JobPlan, Phase
from kinetic_nb.runner.status import HEARTBEAT_INTERVAL_S
from kinetic_nb.storage import ObjectInfo, Storage

#: Lines of each host's log the poller keeps for the panel's drill-down.
LOG_TAIL_LINES = 200
#: A host with no exit record whose heartbeat is older than this is lost: its
#: process is gone or unreachable (a few heartbeats, with room for a busy host).
LOST_AFTER_S = 5 * HEARTBEAT_INTERVAL_S
#: Lines a framework prints for itself on every run (JAX's CPU collectives
#: announce each gloo connection): kept in the logs, but never shown as a
#: host's last line nor echoed as the leader's output.
CHATTER = re.compile(r"^\[Gloo\] Rank \d+ is connected to \d+ peer ranks\b.*$")


def without_chatter(text: str) -> str:
    """``text`` less the lines that are framework chatter."""
    if "[Gloo]" not in text:
        return text
    return "".join(line for line in text.splitlines(keepends=True) if not CHATTER.match(line.rstrip("\n")))


#: Host states that need no attention.
FINE_STATES = frozenset({HostState.PENDING.value, HostState.READY.value, HostState.RUNNING.value,
                         HostState.SUCCEEDED.value})


@dataclasses.dataclass(frozen=True)
class HostSnapshot:
    """One host at one poll."""

    index: int
    state: str
    phase: str
    started_at: float | None = None
    updated_at: float | None = None
    heartbeat_at: float | None = None
    last_line: str = ""
    log_tail: tuple[str, ...] = ()
    message: str = ""
    traceback: str = ""
    exit: ExitSummary | None = None
    history: tuple[tuple[str, float], ...] = ()

    @property
    def is_leader(self) -> bool:
        return self.index == protocol.LEADER_INDEX

    @property
    def fine(self) -> bool:
        return self.state in FINE_STATES

    @property
    def failed_on_its_own(self) -> bool:
        """Failed, died or was lost, not as a consequence of another host's failure (rule 6)."""
        if self.state == HostState.LOST.value:
            return True
        if self.state != HostState.FAILED.value:
            return False
        if self.exit is not None and self.message == "":
            return True  # ended without reporting why: killed, or crashed
        return not is_peer_loss(self.message)

    @property
    def exit_summary(self) -> str:
        return self.exit.describe() if self.exit else ""

    @property
    def ended_at(self) -> float | None:
        return self.exit.ended_at if self.exit else None

    def elapsed(self, now: float) -> float:
        if self.started_at is None:
            return 0.0
        return max(0.0, (self.ended_at or now) - self.started_at)


@dataclasses.dataclass(frozen=True)
class JobSnapshot:
    """The whole job at one poll: what the panel draws."""

    job_id: str
    backend: str
    accelerator: str
    status: JobStatus
    submitted_at: float
    taken_at: float
    hosts: tuple[HostSnapshot, ...]

    @property
    def elapsed(self) -> float:
        ends = [host.ended_at for host in self.hosts if host.ended_at]
        end = max(ends) if self.status.done and ends else self.taken_at
        return max(0.0, end - self.submitted_at)

    def counts(self) -> collections.Counter:
        return collections.Counter(host.state for host in self.hosts)

    @property
    def lost(self) -> list[int]:
        return [host.index for host in self.hosts if host.state == HostState.LOST.value]

    @property
    def decided(self) -> bool:
        """Whether the outcome is known: every host ended, or one failed on its own account."""
        return self.status.done or any(host.failed_on_its_own for host in self.hosts)


def host_state(status: HostStatus | None, summary: ExitSummary | None, heartbeat_at: float | None,
               now: float) -> str:
    """A host's state from its own record and, once it ended, the backend's.

    A host without an exit record whose heartbeat stopped is lost.
    """
    if summary is not None:
        if summary.stopped or summary.exit_code == protocol.EXIT_STOPPED:
            return HostState.STOPPED.value
        if summary.failed:
            return HostState.FAILED.value
        return HostState.SUCCEEDED.value
    if heartbeat_at is not None and now - heartbeat_at > LOST_AFTER_S:
        return HostState.LOST.value
    return status.state if status else HostState.PENDING.value


class _HostRecords:
    """What the poller has read of one host so far."""

    def __init__(self) -> None:
        self.status: HostStatus | None = None
        self.exit: ExitSummary | None = None
        self.heartbeat_at: float | None = None
        self.tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
        self.partial = ""  # a line still being written

    def add_log(self, text: str) -> None:
        text = self.partial + text
        lines = text.split("\n")
        self.partial = lines.pop()
        self.tail.extend(lines)

    def lines(self) -> tuple[str, ...]:
        return (*self.tail, self.partial) if self.partial else tuple(self.tail)


class JobPoller:
    """Reads a job's records incrementally, one listing per poll."""

    def __init__(self, storage: Storage, plan: JobPlan, backend: Backend, *, submitted_at: float | None = None,
                 on_leader_output: Callable[[str, str], None] | None = None):
        self.storage = storage
        self.plan = plan
        self.backend = backend
        self.submitted_at = submitted_at if submitted_at is not None else time.time()
        self.on_leader_output = on_leader_output
        self.records = [_HostRecords() for _ in range(plan.hosts)]
        self.listing: list[ObjectInfo] = []
        self.platform = PlatformView()
        self.requests = collections.Counter()  # "list" and "read": what polling has cost
        self._versions: dict[str, str] = {}
        self._status = JobStatus.PENDING
        self._cancelled = False
        #: Why the job was cancelled (``CancelRequest.TIMEOUT`` when its agent stopped it at the plan's timeout).
        self.cancel_request: CancelRequest | None = None
        self._started = False
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

    def _cleaned_up_status(self) -> JobStatus | None:
        """A job cleaned up after its outcome keeps only handle.json, which records that outcome."""
        names = {info.name for info in self.listing}
        if protocol.PLAN in names or protocol.HANDLE not in names:
            return None
        data = self._read(protocol.HANDLE)
        recorded = json.loads(data).get("status") if data else None
        return JobStatus(recorded) if recorded else None

    def _absorb(self, listing: list[ObjectInfo]) -> None:
        ended: list[ObjectInfo] = []
        for info in listing:
            if info.name == protocol.CANCEL:
                if not self._cancelled:
                    data = self._read(info.name)
                    self.cancel_request = CancelRequest.from_json(data) if data else None
                self._cancelled = True
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
            if kind == "status":
                records.status = HostStatus.from_json(data)
            else:
                for stream, text in protocol.decode_log_chunk(data):
                    records.add_log(text)
                    if index == protocol.LEADER_INDEX and self.on_leader_output is not None:
                        shown = without_chatter(text)
                        if shown:
                            self.on_leader_output(shown, stream)
        for info in ended:
            data = self._read(info.name)
            if data is not None:
                index = protocol.parse_host_object(info.name)[0]
                self.records[index].exit = ExitSummary.from_json(data)
        # What only the platform sees: a pod evicted, an agent that died (the backend keeps its own pace).
        self.platform = self.backend.observe(self.storage, self.plan, listing, self.exits)
        for index, summary in self.platform.exits.items():
            if index < self.plan.hosts and self.records[index].exit is None:
                self.records[index].exit = summary

    def _platform_reasons(self) -> dict[int, str]:
        """Why hosts that have not started yet are waiting, from the platform (a pod's scheduler reason)."""
        return {index: reason for index, reason in self.platform.waiting.items() if not self.records[index].status}

    def snapshot(self) -> JobSnapshot:
        now = time.time()
        hosts = []
        waiting_because = self._platform_reasons()
        for index, records in enumerate(self.records):
            status, lines = records.status, records.lines()
            hosts.append(HostSnapshot(
                index=index,
                state=host_state(status, records.exit, records.heartbeat_at, now),
                phase=status.phase if status else Phase.STARTUP.value,
                started_at=status.started_at if status else None,
                updated_at=status.updated_at if status else None,
                heartbeat_at=records.heartbeat_at,
                last_line=next((line for line in reversed(lines) if line.strip() and not CHATTER.match(line)), ""),
                log_tail=lines,
                message=status.message if status else waiting_because.get(index, ""),
                traceback=status.traceback if status else "",
                exit=records.exit,
                history=tuple((phase, float(at)) for phase, at in status.history) if status else (),
            ))
        return JobSnapshot(self.plan.job_id, self.backend.name, self.plan.accelerator, self._status,
                           self.submitted_at, now, tuple(hosts))

