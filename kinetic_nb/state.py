"""The pure view model of a job: its status, each host's state, snapshots of both.

Everything here is a value or a pure function of values: no backend, no
storage, no IO. The poller (``kinetic_nb.client.poller``) produces these snapshots
from a job's stored records; the display (``kinetic_nb.notebook.display``) and the
client read them. A host's state is one word of ``HostState``, the wire
vocabulary of ``runner/protocol.py``, re-exported here so there is only one.

A display is fed by a ``SnapshotSource``: anything with a ``plan`` (for the
job's id and host count before the first poll) and a ``snapshot()`` method.
A ``CellHandle`` is one; so is a test's fake.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import re
from collections.abc import Collection, Mapping
from typing import Protocol

from kinetic_nb.runner import protocol
from kinetic_nb.runner.environment_install import LOG_PREFIX as ENVIRONMENT_LOG_PREFIX
from kinetic_nb.runner.frameworks import lost_a_peer
from kinetic_nb.runner.protocol import (
    ExitSummary,
    HostState,
    HostStatus,
    JobPlan,
    Phase,
    phase_words,
    process_name,
)
from kinetic_nb.runner.status import HEARTBEAT_INTERVAL_S, IDLE_HEARTBEAT_INTERVAL_S

__all__ = [
    "CHATTER",
    "CHATTER_STARTS",
    "FINE_STATES",
    "IDLE_LOST_AFTER_S",
    "INIT_LOST_AFTER_S",
    "LOST_AFTER_S",
    "LOST_CONFIRM_S",
    "SNAPSHOT_INTERVAL_S",
    "HostSnapshot",
    "HostState",
    "JobSnapshot",
    "JobStatus",
    "SnapshotSource",
    "host_state",
    "is_chatter",
    "is_peer_loss",
    "job_status",
    "may_become_chatter",
    "phase_words",
]

#: A host with no exit record whose heartbeat is older than this is lost: its agent, which beats for each host
#: process that exists (running or stopped, whatever its interpreter does: ``agent.liveness``), is gone or cut
#: off (a few heartbeats, with room for a loaded machine). A host that exists but does nothing is quiet, not lost.
LOST_AFTER_S = 5 * HEARTBEAT_INTERVAL_S
#: The same while a host starts (pending, or ready at the start barrier) and in the framework's distributed init:
#: a host's own thread beat once, and the framework held the interpreter while it connected to its peers; the agent
#: beats now, so this only leaves room for an agent whose machine is loaded by every host's start or init at once
#: (an agent lets its hosts go together: at 256 light hosts on gs:// on two cores, it beat host 0 later than
#: LOST_AFTER_S while they all started). The framework's own init timeout bounds that phase, the start barrier's
#: timeout the start.
INIT_LOST_AFTER_S = 60.0
#: An idle session host is beaten seldom (``runner.status.IDLE_HEARTBEAT_INTERVAL_S``): lost after four missed beats.
IDLE_LOST_AFTER_S = 4 * IDLE_HEARTBEAT_INTERVAL_S
#: A host found silent past its limit is called lost only if no new heartbeat arrives within this much more of
#: the notebook's own time: a machine that paused as a whole (every process, and every clock, jumping ahead)
#: makes every host look silent at once, and a live host beats again within one interval of waking.
LOST_CONFIRM_S = HEARTBEAT_INTERVAL_S + 1.0
#: A live view is redrawn at most this often (each redraw is a widget message).
SNAPSHOT_INTERVAL_S = 0.25
#: Lines a framework prints for itself on every run: JAX's CPU collectives
#: announce each gloo connection, and the JAX coordination service its start
#: (C++ INFO lines, or Python logging's when the user turned it on); a pod that
#: installed its environment, what pip said then (``runner.environment``). Kept in
#: the logs, but never shown as a host's last line nor echoed as the leader's
#: output. Errors and warnings from the same places are never chatter.
CHATTER = re.compile(
    r"^(\[Gloo\] Rank \d+ is connected to \d+ peer ranks\b.*"
    r"|I0000 00:00:[\d.]+ +\d+ (coordination_service|coordination_service_agent|client_server|"
    r"coordination_service_rpc_handler|grpc_server)\.cc:\d+\] .*"
    r"|INFO:jax\._src\.distributed:(Starting|Connecting to) JAX distributed service on .*"
    r"|USDT:[\d-]+ [\d:]+ \d+:\d+ SyncActivityProfilerHandler\.cpp:\d+\] profiler_(start|stop)"  # torch's profiler
    r"|" + re.escape(ENVIRONMENT_LOG_PREFIX) + r".*)$"
)
#: How each kind of ``CHATTER`` line starts: a line still being written that
#: may become one is held back from the cell until it is complete.
CHATTER_STARTS = ("[Gloo] Rank ", "I0000 00:00:", "INFO:jax._src.distributed:", "USDT:", ENVIRONMENT_LOG_PREFIX)
#: Host states that need no attention.
FINE_STATES = frozenset({HostState.PENDING.value, HostState.READY.value, HostState.RUNNING.value, HostState.IDLE.value,
                         HostState.SUCCEEDED.value})
#: Host states a cell's host does not leave: it is done with the cell (a session's host stays up, idle).
ENDED_STATES = frozenset({HostState.SUCCEEDED.value, HostState.FAILED.value, HostState.STOPPED.value,
                          HostState.LOST.value})


class JobStatus(str, enum.Enum):
    """The state of a whole job."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    def __str__(self) -> str:
        return self.value

    @property
    def done(self) -> bool:
        return self in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED)


def job_status(
    plan: JobPlan,
    exits: Mapping[int, ExitSummary],
    *,
    started: bool,
    cancelled: bool,
    lost: Collection[int] = (),
) -> JobStatus:
    """The job's state once every host has ended or been lost (RUNNING or PENDING before).

    Parameters
    ----------
    plan : JobPlan
        The job's plan (for its number of hosts).
    exits : mapping of int to ExitSummary
        How each host that ended did so.
    started : bool
        Whether any host has written a record yet.
    cancelled : bool
        Whether the job was cancelled (a stopped job is then CANCELLED, not FAILED).
    lost : collection of int
        Hosts whose heartbeat stopped with no exit record.

    Returns
    -------
    JobStatus
    """
    if len(set(exits) | set(lost)) < plan.world_size:
        return JobStatus.RUNNING if started else JobStatus.PENDING
    if lost or any(summary.failed for summary in exits.values()):
        return JobStatus.FAILED
    if any(summary.stopped for summary in exits.values()):
        return JobStatus.CANCELLED if cancelled else JobStatus.FAILED
    return JobStatus.SUCCEEDED


def is_peer_loss(text: str) -> bool:
    """Whether an error's ``"Type: message"`` is a known consequence of losing a peer.

    Parameters
    ----------
    text : str
        The error as ``"Type: message"``.

    Returns
    -------
    bool
        True for a follow-on of another host's failure (the outcome rules' rule 6).
    """
    return lost_a_peer(text) or text.split(":", 1)[0].endswith("HostStoppedError")




def is_chatter(line: str) -> bool:
    """Whether a complete line is framework chatter (``CHATTER``)."""
    return bool(CHATTER.match(line))


def may_become_chatter(partial: str) -> bool:
    """Whether a line still being written may turn out to be chatter, once complete.

    Parameters
    ----------
    partial : str
        The line so far (no newline yet).

    Returns
    -------
    bool
        True while ``partial`` agrees with how some kind of chatter line
        starts (those are log lines: their newline follows at once); a line
        being rewritten (``\\r``) never is.
    """
    if not partial or "\r" in partial:
        return False
    return any(start.startswith(partial) or partial.startswith(start) for start in CHATTER_STARTS)


@dataclasses.dataclass(frozen=True)
class HostSnapshot:
    """One host at one poll."""

    index: int
    #: A ``HostState`` value.
    state: str
    phase: str
    started_at: float | None = None
    updated_at: float | None = None
    heartbeat_at: float | None = None
    #: Its newest line worth a row, as plain text (``runner.logs.shown_text``).
    last_line: str = ""
    #: Its last lines as it printed them, escapes and all (shown through ``shown_text``).
    log_tail: tuple[str, ...] = ()
    message: str = ""
    traceback: str = ""
    exit: ExitSummary | None = None
    history: tuple[tuple[str, float], ...] = ()
    #: Every thread's Python stack, fetched once when the host turned quiet.
    stacks: str = ""
    #: At its last cell's end (``HostStatus.memory``): ``rss``, ``peak_rss``, and ``device``, ``device_peak``
    #: where its framework reports them, in bytes; empty before that.
    memory: Mapping[str, int] = dataclasses.field(default_factory=dict)
    #: A failed host's failing frames and their variables, as text its host made (``runner.frame_locals``).
    frame_locals: tuple = ()
    #: A profiled cell's span on this host, ``(start, end)`` on its clock; empty when it was not profiled.
    profiled: tuple = ()

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
    def row_line(self) -> str:
        """The line its row shows: its own failure's line once it failed (a peer's loss as its framework said
        it, too: what the framework printed after that stays in the log), else the last line it printed."""
        if self.state == HostState.FAILED.value and self.message:
            return self.message
        return self.last_line

    @property
    def ended(self) -> bool:
        """Done with the cell: its process ended, or (a session's host) it is back to idle after it."""
        return self.state in ENDED_STATES

    @property
    def ended_at(self) -> float | None:
        """When it was done with the cell: its process's end, else its last status (a session's host)."""
        if self.exit is not None:
            return self.exit.ended_at
        return self.updated_at if self.state in ENDED_STATES and self.state != HostState.LOST.value else None

    def elapsed(self, now: float) -> float:
        if self.started_at is None:
            return 0.0
        return max(0.0, (self.ended_at or now) - self.started_at)


@dataclasses.dataclass(frozen=True)
class JobSnapshot:
    """The whole job at one poll: what the panel draws. ``hosts`` holds one entry per process, by rank (one per
    host where each host runs one process: ``procs_per_host``)."""

    job_id: str
    backend: str
    accelerator: str
    status: JobStatus
    submitted_at: float
    taken_at: float
    hosts: tuple[HostSnapshot, ...]
    #: What the user calls it, shown before the id (a session's cell: ``In[4]``).
    label: str = ""
    #: Processes on each host: ``hosts[rank]`` runs on host ``rank // procs_per_host``.
    procs_per_host: int = 1
    #: What stopped a CANCELLED cell, when the user asked for it: ``"interrupt"``, ``"timeout"``, or
    #: ``"withdrawn"`` (a session cell interrupted while queued, before any host started it).
    stopped_by: str = ""

    @property
    def status_word(self) -> str:
        """The state as the panel's header says it: INTERRUPTED or TIMED OUT for a stop the user asked for."""
        if self.status is JobStatus.CANCELLED and self.stopped_by:
            return {"interrupt": "INTERRUPTED", "timeout": "TIMED OUT", "withdrawn": "WITHDRAWN"}.get(
                self.stopped_by, str(self.status))
        return str(self.status)

    def name_of(self, rank: int) -> str:
        """``host 2``, or ``host 1, process 0 (rank 2)`` where hosts run several processes."""
        return process_name(rank, self.procs_per_host)

    def by_host(self) -> list[tuple[int, tuple[HostSnapshot, ...]]]:
        """Each host's index and its processes, in rank order."""
        per = self.procs_per_host
        return [(host, self.hosts[host * per:(host + 1) * per]) for host in range((len(self.hosts) + per - 1) // per)]

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

    Parameters
    ----------
    status : HostStatus or None
        The host's last ``status.json``, if any was read.
    summary : ExitSummary or None
        How the host ended, once it did.
    heartbeat_at : float or None
        When the host's agent last rewrote its heartbeat.
    now : float
        The time of the poll.

    Returns
    -------
    str
        A ``HostState`` value; a host without an exit record whose heartbeat
        stopped is lost (its agent is gone: a stopped host is still beaten for).
    """
    if summary is not None:
        if summary.stopped:
            return HostState.STOPPED.value
        if summary.failed:
            return HostState.FAILED.value
        return HostState.SUCCEEDED.value
    starting = status is None or status.state in (HostState.PENDING.value, HostState.READY.value) \
        or status.phase == Phase.DISTRIBUTED_INIT.value
    idle = status is not None and status.state == HostState.IDLE.value
    allowed = INIT_LOST_AFTER_S if starting else IDLE_LOST_AFTER_S if idle else LOST_AFTER_S
    if heartbeat_at is not None and now - heartbeat_at > allowed:
        return HostState.LOST.value
    return status.state if status else HostState.PENDING.value


def is_quiet(active_at: float | None, others_ended_at: float | None, grace_s: float, now: float) -> bool:
    """Whether a running host has been silent (no output, no phase change) for ``grace_s`` since another ended.

    A slow checkpoint that keeps printing is not quiet; one that prints
    nothing is shown as quiet with its stacks, and the cell keeps waiting.
    """
    if others_ended_at is None or active_at is None:
        return False
    return now - max(active_at, others_ended_at) >= grace_s


class SnapshotSource(Protocol):
    """What a display is fed by: the job's plan, and the job as it is now."""

    #: The job's plan: its id and number of hosts, known before the first poll.
    plan: JobPlan

    def snapshot(self) -> JobSnapshot:
        """The job as it is now."""
