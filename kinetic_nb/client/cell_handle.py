"""``CellHandle``: one cell on a group of hosts, a one-shot job's only cell or a session's cell ``seq``.

One type for both, with one set of methods (``result``, ``leader_result``,
``wait``, ``stacks``, ``interrupt``, ``cancel``, ``summary``, ``watch``,
``timeline``, ``hosts``, ``logs``). What differs is where the cell lives and
what its end means:

- a one-shot job's cell is its whole group: its records and outcome are the
  job's own (``result.pkl`` at the job's root, as the seed's rules expect), it
  is done when every host has ended, its timeout counts from submission, and
  an interrupt cancels the job (a kernel restart's leaves it running);
- a session's cell lives in ``cells/{seq}/`` under the cell's own key, the
  hosts' session-level records name the cell they are on, it is done when
  every host is back to idle, its timeout is its own, and an interrupt sends
  ``KeyboardInterrupt`` into the cell on every host; its outcome is deleted
  once read.

How a cell stops (interrupt, cancel, timeout) is ``client.cell_stopping``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import sys
import time
from collections.abc import Callable
from typing import Any, Protocol

from kinetic_nb import views
from kinetic_nb.client.cell_stopping import CellStopping
from kinetic_nb.client.host_group import STACKS_WAIT_S, HostGroup, check_host, remove_job_objects
from kinetic_nb.client.outcome import read_leader, resolve_outcome
from kinetic_nb.client.poller import JobPoller
from kinetic_nb.client.profile import GATHER_WAIT_S, MergedProfile, merged_profile, trace_path
from kinetic_nb.client.waiting import FIRST_POLL_S, WOKEN_FIRST_POLL_S, wait_for
from kinetic_nb.errors import (
    CellInterrupted,
    JobCancelledError,
    KineticTimeoutError,
    ObjectNotFoundError,
)
from kinetic_nb.runner import protocol
from kinetic_nb.runner.group import ONLY_CELL, cell_key
from kinetic_nb.runner.logs import shown_text
from kinetic_nb.runner.protocol import CancelRequest, Phase
from kinetic_nb.runner.relayed import STORE_INTERVAL_S
from kinetic_nb.state import HostSnapshot, HostState, JobSnapshot, JobStatus, phase_words

__all__ = ["CellHandle", "JobHandle", "Session"]

logger = logging.getLogger(__name__)

#: The hosts' agents stop a cell at its timeout; the notebook steps in only this much later.
TIMEOUT_SLACK_S = 5.0
#: Once a host has failed on its own, how long to let the others' records land
#: before deciding (the cell still raises well within a second of the failure).
SETTLE_S = 0.3
#: A timeout's note says where this many hosts were (a slice of 256 hosts would make it a page; the panel has all).
WHERE_HOSTS = 8
#: After a cell returned, how long its panel follows the hosts it showed as being stopped, to show them stopped
#: (the agent's SIGTERM, then SIGKILL after ``TERM_TO_KILL_S``; a one-shot job's cancel waits for a restart first).
SETTLED_WAIT_S = 15.0
#: How long a finished session cell waits for the hosts' last output to be stored (the agent writes it at once).
OUTPUT_WAIT_S = 2.0
#: A host's state as a failure's description says it (``describe_host``), where "was <state>" would not read.
_STATE_PHRASES = {HostState.SUCCEEDED.value: "had finished the cell", HostState.RUNNING.value: "was still running",
                  HostState.READY.value: "was waiting for the others", HostState.PENDING.value: "had not started",
                  HostState.QUIET.value: "was quiet"}


#: A withdrawn cell's row, for each host: it never ran the cell.
WITHDRAWN_LINE = "withdrawn before it started"


def _running(snapshot: JobSnapshot, *, one_shot: bool = False) -> list[int]:
    """The hosts that have not ended the cell: a one-shot job's every live process; of a session, the hosts
    that started it (a pending one is still on an earlier cell)."""
    return [host.index for host in snapshot.hosts
            if not host.ended and (one_shot or host.state != HostState.PENDING.value)]


class Session(Protocol):
    """What a cell uses of its session (``sessions.Session``)."""

    group: HostGroup
    session_id: str
    #: The session's records: through its direct channel while that is up, else plain storage.
    records: Any
    #: Its direct channel to the hosts (a session on a bucket), or None.
    channel: Any

    def ended(self, *, hosts_ended: bool | None = None) -> str | None: ...

    def sleep(self, seconds: float) -> None: ...

    def share(self, name: str, body: bytes, key: bytes | None = None, *, sealed_as: str | None = None,
              exclusive: bool = False) -> None: ...


class CellHandle(CellStopping):
    """One cell on a group of hosts: wait for it, read its hosts and logs, get its outcome, stop it.

    Parameters
    ----------
    group : HostGroup
        The hosts that run it.
    session : Session, optional
        The session the cell is ``seq`` of; None for a one-shot job's only cell.
    seq : int
        The cell's number in its group.
    timeout : float, optional
        A session cell's own timeout (a one-shot job's is in its plan).
    echo : callable, optional
        Where the leader's output goes as it arrives.
    profiled : bool
        Whether the cell runs under its framework's profiler on every host (``profile()`` merges the traces).
    name : str, optional
        The cell as the notebook knows it (``In[4]``), for the panel's header.
    stored_after : float, optional
        A session cell just submitted: when (``time.time()``) before it was stored (see ``JobPoller``).
    """

    def __init__(self, group: HostGroup, *, session: Session | None = None, seq: int = ONLY_CELL,
                 timeout: float | None = None, echo: Callable[[str, str], None] | None = None,
                 name: str | None = None, profiled: bool = False, stored_after: float | None = None):
        self.group = group
        #: Whether the cell was asked to run under its framework's profiler on every host (``profile()``).
        self.profiled = profiled
        #: Where the merged trace is saved (``--profile-dir``); None: the notebook's folder (the kernel's cwd).
        self.profile_dir: str | None = None
        self._profile: MergedProfile | None = None
        self.session = session
        self.seq = seq
        self.plan = group.plan
        self.timeout = timeout
        self.outputs: dict[str, Any] = {}
        #: ``--out`` names the leader's cell did not bind (warned about; the rest came back).
        self.missing_outputs: tuple[str, ...] = ()
        if session is None:  # a one-shot job: its cell is the whole group, at its root, under its key
            self.storage, self.key, self.poller = group.storage, group.key, group.poller
            if name:  # the panel names the cell as the notebook does, as a session cell's does
                self.poller.label = f"{name} · job {group.plan.job_id}"
        else:
            self.storage = session.records.child(protocol.cell_dir(seq))
            self.key = cell_key(group.key, seq)
            self.poller = JobPoller(session.records, dataclasses.replace(self.plan, job_id=self.job_id), group.backend,
                                    key=group.key, on_leader_output=echo, cell=seq, stored_after=stored_after,
                                    label=f"{name or f'cell {seq}'} · session {session.session_id}")
        #: A session cell's outcome objects being deleted on a bucket, in the background, once it was decided.
        self.cleanup: concurrent.futures.Future | None = None
        self._payload: Any = None
        self._failure: BaseException | None = None
        self._leader: Any = None
        self._snapshot: JobSnapshot | None = None
        #: The cell as the notebook names it (``In[4]``); "" for a cell from the API.
        self.cell_name = name or ""
        #: How messages name the cell: as the notebook does (``In[4]``), else by its number or job.
        self.name = name or (f"job {self.job_id}" if session is None else f"cell {seq} of session {session.session_id}")
        #: The panel's last word, once the outcome is decided (``result()``): the outcome, each host as it ended.
        self.final: JobSnapshot | None = None
        #: A session cell this kernel has just stored, not waited on yet: nothing of it can be there to read.
        self._unread = stored_after is not None

    @property
    def one_shot(self) -> bool:
        """Whether this is a one-shot job's only cell (its end is the group's end)."""
        return self.session is None

    @property
    def job_id(self) -> str:
        return self.plan.job_id if self.session is None else f"{self.session.session_id}/{protocol.cell_dir(self.seq)}"

    @property
    def uri(self) -> str:
        return self.storage.uri

    @property
    def backend(self) -> Any:
        """The backend that runs the cell's hosts."""
        return self.group.backend

    def __repr__(self) -> str:
        hosts = f"{self.plan.hosts} host{'' if self.plan.hosts == 1 else 's'}"
        return f"<{type(self).__name__} {self.job_id} {hosts} {self.status()}>"

    # -- reading -----------------------------------------------------------------------------

    def snapshot(self) -> JobSnapshot:
        """The hosts as they are now; only records that changed are read.

        A host that has turned quiet gets its stacks fetched, once, so the
        panel can show where it is stuck.
        """
        snapshot = self.poller.poll()
        quiet = [h.index for h in snapshot.hosts if h.state == HostState.QUIET and h.index not in self.poller.stacks]
        if quiet:
            for index in quiet:
                self.poller.stacks[index] = ""  # asked: a watcher polling meanwhile does not ask again
            self.poller.stacks.update(self.group.ask_for_stacks(quiet, STACKS_WAIT_S))
            snapshot = self.poller.snapshot()
        self._snapshot = snapshot
        return snapshot

    def profile(self, *, wait: float = GATHER_WAIT_S) -> MergedProfile:
        """A profiled cell's (``--profile``) hosts' traces merged into one Chrome trace, one process per host,
        aligned on the cell's barrier; where it is, and which hosts it lacks and why. Merged once, after the
        cell's outcome; a host still running gets ``wait`` seconds to store its trace.

        Raises
        ------
        ValueError
            When the cell was not profiled (no host stored a profile, and none was asked for).
        """
        if self._profile is not None:
            return self._profile
        storage = getattr(self.storage, "plain", self.storage)  # the hosts store traces beside the channel
        if not self.profiled and not storage.list(protocol.PROFILE_DIR + "/"):
            raise ValueError(f"cell {self.job_id} was not profiled (%%kinetic --profile, or %kinetic profile before "
                             "a session's cell)")

        def ended(rank: int) -> bool:
            return (self._snapshot or self.snapshot()).hosts[rank].ended

        copy = trace_path(self.cell_name or self.job_id.replace("/", "-"), self.profile_dir)
        self._profile = merged_profile(storage, self.key, self.plan.world_size, self.poller.plan.name_of, ended,
                                       str(copy), wait, cell=self.cell_name)
        return self._profile

    def status(self) -> JobStatus:
        """PENDING, RUNNING, SUCCEEDED, FAILED or CANCELLED: once ``result()`` has decided the outcome, that
        outcome (as the panel's last word says it), while a host it stopped may still be ending."""
        if self.final is not None:
            return self.final.status
        return self.snapshot().status

    def hosts(self) -> list[HostSnapshot]:
        """Every host's state, phase, last log line and (once it ended) exit summary."""
        return list(self.snapshot().hosts)

    def describe_host(self, index: int) -> str:
        """How one host ended (or where it is), its phase and last log lines, as a verb phrase."""
        host = (self._snapshot or self.snapshot()).hosts[index]
        summary = host.exit
        if summary is not None:
            text = summary.describe()
        elif host.state == HostState.LOST:
            text = "was lost (no heartbeat and no exit record)"
            if self.poller.platform.problem:  # the platform may know why: a storage error, say
                text += f" ({self.poller.platform.problem})"
        else:
            text = _STATE_PHRASES.get(host.state, f"was {host.state}")
        if summary is not None and summary.recorded_success:
            return text + " after recording success"
        if host.updated_at is not None:
            text += f" while {phase_words(host.phase)}"
        lines = [shown for shown in map(shown_text, host.log_tail) if shown.strip()][-5:]
        if lines:
            text += "; last log lines:\n" + "\n".join(f"    {line}" for line in lines)
        # What the host's own log does not hold: its agent's last words, say. A session host's stderr tail spans
        # every cell it ran: only a one-shot job's is this cell's.
        others = [shown_text(line) for line in (summary.stderr_tail if summary and self.one_shot else ())
                  if line not in host.log_tail]
        if others:
            text += "\n  last lines recorded with its end:\n" + "\n".join(f"    {line}" for line in others[-8:])
        return text

    # -- showing ------------------------------------------------------------------------------

    def summary(self) -> str:
        """A plain-text table: the state and each host's state, phase and exit."""
        return views.render("text", self.snapshot())

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self) if cycle else self.summary())

    def _repr_html_(self) -> str:
        """A static snapshot that survives in a saved notebook and on nbviewer."""
        return views.render("html", self.snapshot())

    def watch(self) -> None:
        """Show the live panel (or its text twin) and keep it current in the background; return at once.

        The hosts' agent stops them at their timeout; the display only reads.
        """
        views.render("watch", self)

    def timeline(self) -> Any:
        """A matplotlib Figure: one row per host, one bar per phase (needs the ``plots`` extra)."""
        return views.render("timeline", self.snapshot())

    # -- the leader's own value ---------------------------------------------------------------

    def leader_result(self) -> Any:
        """The leader's own value as soon as it has recorded it, whatever happened to the other hosts.

        ``result()`` applies the outcome rules (a worker's failure fails the
        cell); this reads only the leader's payload, so a finished value is
        never lost to a stuck worker, a cancel or an interrupt. Raises the
        leader's own exception if it failed, and ``ObjectNotFoundError`` while
        it has recorded nothing.
        """
        if self._payload is not None:
            return self._payload.result
        if self._leader is None:
            self._leader = read_leader(self.storage, self.key)
        if self._leader is None:
            raise ObjectNotFoundError(f"the leader of {self.job_id} has recorded no result yet")
        if not self._leader.payload.success:
            raise self._leader.exception(self.job_id)
        self.outputs = dict(self._leader.payload.outputs)
        return self._leader.payload.result

    # -- the hosts ------------------------------------------------------------------------------

    def logs(self, host: int = protocol.LEADER_INDEX) -> str:
        """Host ``host``'s stdout and stderr during this cell (a one-shot job's: its whole log); ``host`` is a
        process's rank where hosts run several."""
        check_host(host, self.plan.world_size)
        if self.session is None:
            return self.group.logs(host)
        self.snapshot()
        return "".join(f"{line}\n" for line in self.poller.records[host].lines())

    def stacks(self, host: int | None = None, *, wait: float = STACKS_WAIT_S) -> dict[int, str]:
        """Every running host's Python stacks, all threads, even while blocked in C code: host index to its
        stacks, ``host`` only if given; a host that has not answered within ``wait`` seconds is reported as
        "no answer" (see ``HostGroup.stacks``)."""
        return self.group.stacks(host, wait=wait)

    # -- waiting and the outcome ----------------------------------------------------------------

    def wait(self, timeout: float | None = None, *, on_snapshot: Callable[[JobSnapshot], None] | None = None
             ) -> JobStatus:
        """Wait until the cell has ended on every host; return its state.

        ``timeout`` bounds this wait only (the cell goes on); the cell's own
        timeout stops it and raises ``KineticTimeoutError``. ``on_snapshot``
        sees the hosts at most every ``SNAPSHOT_INTERVAL_S``, and always once
        more at the end.
        """
        snapshot = self._wait(lambda snapshot: snapshot.status.done, timeout, on_snapshot)
        if on_snapshot is not None:
            on_snapshot(snapshot)
        return snapshot.status

    def result(self, timeout: float | None = None, *,
               on_snapshot: Callable[[JobSnapshot], None] | None = None) -> Any:
        """The leader's value, or the right host's own exception (the seed's rules, root cause first).

        It raises as soon as one host has failed on its own account, a
        one-shot cell and a session cell alike; the hosts still running are
        then stopped (a one-shot job's) or interrupted (a session's). An
        interrupt raises ``CellInterrupted`` (a ``KeyboardInterrupt``) at
        once: a one-shot job is cancelled (unless it is detached; in a kernel
        only when no restart follows), a session's cell gets
        ``KeyboardInterrupt`` on every host and the session stays up when
        every host is back to idle, and a session cell still queued is
        withdrawn. When the session ended during the cell, the exception says
        so and that ``restart()`` starts it again. ``on_snapshot`` sees the
        panel's last word last: ``final``.
        """
        if self._payload is not None:
            return self._payload.result
        if self._failure is not None:  # read once: a session cell's objects are gone, the exception stays
            raise self._failure
        try:
            snapshot = self._wait_for_outcome(timeout, on_snapshot)
        except BaseException:
            if self.final is not None and on_snapshot is not None:  # stopped: the panel's last word says how
                on_snapshot(self.final)
            raise
        decided = JobStatus.FAILED
        try:
            self._payload = resolve_outcome(self.storage, self.poller.plan, snapshot.status, self.poller.exits,
                                            self._listing, self.describe_host, key=self.key,
                                            lost=snapshot.lost if self.session is None else (), cell=self.cell_name)
            decided = JobStatus.SUCCEEDED
        except BaseException as error:
            stopped_by = self._stopped_by(error)
            decided = JobStatus.CANCELLED if isinstance(error, JobCancelledError) else JobStatus.FAILED
            if self.session is not None:
                with contextlib.suppress(Exception):  # leader_result() still has the leader's own value
                    self._leader = read_leader(self.storage, self.key)
            self._failure = self._explained(error, stopped_by)
            self._decide(snapshot, decided, stopped_by)
            if self._failure is error:
                raise
            raise self._failure from None
        finally:
            if self.final is None:
                self._decide(snapshot, decided)
            if on_snapshot is not None:
                on_snapshot(self.final)
            self._after_outcome(decided, snapshot)
        self.outputs = dict(self._payload.outputs)
        self.missing_outputs = self._payload.missing_outputs
        return self._payload.result

    def _decide(self, snapshot: JobSnapshot, status: JobStatus, stopped_by: str = "") -> JobSnapshot:
        """The panel's last word (``final``): the cell's outcome, each host as it ended, and a host still
        running as being stopped, which it is: a one-shot job's hosts are cancelled, a session cell's
        interrupted (after a failure; after an interrupt or a timeout that was asked already)."""
        running = _running(snapshot, one_shot=self.one_shot)
        if stopped_by == "withdrawn":  # it never started: each host, still on the cell before it, is done with it
            hosts = tuple(dataclasses.replace(host, state=HostState.STOPPED.value, phase="",
                                              last_line=WITHDRAWN_LINE) if host.state == HostState.PENDING.value
                          else host for host in snapshot.hosts)
        elif status is JobStatus.SUCCEEDED or not running:
            hosts = snapshot.hosts
        else:
            hosts = tuple(dataclasses.replace(host, state=HostState.STOPPING.value) if host.index in running else host
                          for host in snapshot.hosts)
        self.final = dataclasses.replace(snapshot, status=status, stopped_by=stopped_by, hosts=hosts)
        self.poller.end_echo()  # the cell's lines end here, whatever its hosts print while being stopped
        return self.final

    def settled(self, wait: float = SETTLED_WAIT_S) -> JobSnapshot | None:
        """``final`` once the hosts it showed as being stopped have ended (at most ``wait`` seconds), each as it
        ended; None when there were none, or they have not ended by then."""
        final = self.final
        if final is None or not any(host.state == HostState.STOPPING.value for host in final.hosts):
            return None
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            now = self.snapshot()
            if all(now.hosts[host.index].ended for host in final.hosts if host.state == HostState.STOPPING.value):
                hosts = tuple(now.hosts[host.index] if host.state == HostState.STOPPING.value else host
                              for host in final.hosts)
                self.final = dataclasses.replace(final, hosts=hosts, taken_at=now.taken_at)
                return self.final
            time.sleep(0.1)
        return None

    def _stop_the_rest(self, snapshot: JobSnapshot) -> JobSnapshot:
        """After a failure decided the cell, its hosts still running are stopped now, not after the grace (a
        one-shot job's cancelled, a session cell's interrupted), and waited for a moment: their output so far
        reaches the cell and their rows say stopped, alike in both kinds of cell. One that takes longer is
        shown as being stopped (``settled`` follows it)."""
        running = _running(snapshot, one_shot=self.one_shot)
        # A one-shot job's host with no end recorded is a live process, a leader that succeeded and waits in its
        # framework's teardown too: it goes with the others, not after the grace.
        alive = [host.index for host in snapshot.hosts if host.exit is None] if self.session is None else running
        if not alive:
            return snapshot
        try:
            if self.session is None:
                self.group.request_cancel(CancelRequest.AFTER_FAILURE)
            else:
                self.interrupt()
        except Exception:  # best effort: the agents stop them after the grace anyway
            logger.debug("could not stop the rest of %s", self.job_id, exc_info=True)
            return snapshot
        deadline = time.monotonic() + OUTPUT_WAIT_S
        while any(not snapshot.hosts[index].ended for index in running) and time.monotonic() < deadline:
            self.sleep(0.01)
            snapshot = self.snapshot()
        return snapshot

    def _stopped_by(self, error: BaseException) -> str:
        """``"timeout"`` or ``"interrupt"`` when the cell ended as stopped on request, else ``""``."""
        if not isinstance(error, JobCancelledError):
            return ""
        if self.session is None:  # as its cancel record says (an API cancel stays a cancel)
            reason = self.poller.cancel_request.reason if self.poller.cancel_request else ""
            return {CancelRequest.TIMEOUT: "timeout", "interrupted": "interrupt"}.get(reason, "")
        if self.interrupted_at_timeout() is not None:
            return "timeout"
        # Interrupted while queued: every host found the interrupt while it loaded the cell, and none ran it.
        hosts = (self._snapshot or self.snapshot()).hosts
        return "withdrawn" if all(host.phase == Phase.PAYLOAD_LOAD.value for host in hosts) else "interrupt"

    def _wait_for_outcome(self, timeout: float | None, on_snapshot: Callable[[JobSnapshot], None] | None
                          ) -> JobSnapshot:
        """Wait until the outcome can be decided: every host ended, or one failed on its own account (then a
        moment for a lower-indexed host's own failure to land: the choice stays the lowest host's)."""
        if self.session is None:
            ready: Callable[[JobSnapshot], bool] = lambda snap: snap.decided  # noqa: E731
        else:
            ready = lambda snap: snap.decided or self._session_cell_ready(snap)  # noqa: E731
        snapshot = self._wait(ready, timeout, on_snapshot)
        settle = time.monotonic() + SETTLE_S
        while not snapshot.status.done and time.monotonic() < settle:
            self.sleep(0.02)
            snapshot = self.snapshot()
        if not snapshot.status.done:
            snapshot = self._stop_the_rest(snapshot)
        if self.session is not None:
            snapshot = self._output_in(snapshot)
        if snapshot.lost and self.session is None:
            self.group.report_lost_hosts(snapshot.lost)
        return snapshot

    @property
    def _woken(self) -> bool:
        """Whether this cell's wait is woken by its hosts (a local disk's socket, not a session's channel)."""
        return self.group.woken and not (self.session is not None and self.session.channel is not None)

    def sleep(self, seconds: float) -> None:
        """Sleep, woken early (locally) when a host has news."""
        (self.group.sleep if self.session is None else self.session.sleep)(seconds)

    def _listing(self) -> list[Any]:
        """The cell's records as the seed's rules read them: the poll's last listing of a one-shot job's
        objects, one listing of a session cell's directory."""
        return self.poller.listing if self.session is None else self.storage.list()

    def _explained(self, error: BaseException, stopped_by: str) -> BaseException:
        """The exception the cell raises: a cell stopped on request raises one line (and a session's fate),
        whichever kind of cell it is; a failure as the outcome rules chose it, with the session's end if it
        ended."""
        if stopped_by == "timeout":
            timeout = (self.plan.timeout_s if self.session is None else self.interrupted_at_timeout()) or self.timeout
            stopped: BaseException = KineticTimeoutError(
                f"{self.name} ran past its timeout of {timeout or 0:g} s and was stopped on every host")
            stopped.add_note(self._where_each_host_was())
        elif stopped_by == "interrupt":
            stopped = CellInterrupted(f"{self.name} was interrupted on every host")
        elif stopped_by == "withdrawn":
            stopped = CellInterrupted(f"{self.name} was withdrawn before it started")
        else:
            if self.session is not None and isinstance(error, Exception) and self.session.ended(
                    hosts_ended=self._session_ended(self._snapshot or self.snapshot())) is not None:
                error.add_note(self._fate())
            return error
        if self.session is not None:
            stopped.add_note(self._fate())
        return stopped

    def _where_each_host_was(self) -> str:
        """Each host's phase and last line when the cell was stopped: where a cell past its timeout was."""
        snapshot = self._snapshot or self.snapshot()
        said = [f"{snapshot.name_of(host.index)}: {phase_words(host.phase)}"
                + (f", last line: {host.last_line}" if host.last_line else "") for host in snapshot.hosts[:WHERE_HOSTS]]
        more = len(snapshot.hosts) - WHERE_HOSTS
        return "; ".join(said) + (f"; and {more} more hosts (the panel shows each)" if more > 0 else "")

    def _after_outcome(self, decided: JobStatus, snapshot: JobSnapshot) -> None:
        """A one-shot job notes its outcome (and after a success removes all but handle.json and outputs/);
        a session cell's outcome objects are deleted once read, as a one-shot job's are: a long session does
        not pile up every cell's values. A cell's payload stays (its name is how the session numbers its
        cells), and so do the hosts' output (``logs()``) and their ends of it (a later cell's held names)."""
        if self.session is None:
            self.group.record_outcome(decided)
            return
        for line in self.session.memory_growth.note(snapshot.hosts, self.poller.plan.name_of):
            print(line, file=sys.stderr, flush=True)  # once per host and session, in the cell's output
        # A listing and a round of deletes (on a bucket, requests; on a disk, about a millisecond): never on
        # the way to the cell's value.
        self.cleanup = self.session.background.submit(self._remove_outcome)

    def _remove_outcome(self) -> None:
        storage = getattr(self.storage, "plain", self.storage)
        relay = getattr(self.storage, "relay", None)
        if relay is not None and relay.up:  # through the channel: what the hosts store comes a moment later
            time.sleep(STORE_INTERVAL_S + 0.5)
        try:
            remove_job_objects(storage, keep=(protocol.PAYLOAD, "log/", protocol.CELL_DONE_PREFIX,
                                              protocol.PROFILE_DIR + "/"))
        except Exception:
            logger.debug("could not remove the outcome of cell %s", self.seq, exc_info=True)

    def _wait(self, ready: Callable[[JobSnapshot], bool], timeout: float | None,
              on_snapshot: Callable[[JobSnapshot], None] | None) -> JobSnapshot:
        """The one wait loop, with this cell's deadlines, its interrupt and (locally) the hosts' wakeup."""
        deadline = None if timeout is None else time.monotonic() + timeout
        # The agent stops the cell at its timeout; the notebook steps in only if it has not, a while later.
        if self.session is None:
            started = self.plan.created_at or self.poller.submitted_at
            cell_deadline = None if self.plan.timeout_s is None else (
                time.monotonic() + started + self.plan.timeout_s + TIMEOUT_SLACK_S - time.time())
        else:
            cell_deadline = None if self.timeout is None else (
                time.monotonic() + self.timeout + self.plan.grace_s + TIMEOUT_SLACK_S)

        def check(snapshot: JobSnapshot) -> None:
            now = time.monotonic()
            if cell_deadline is not None and now > cell_deadline:
                self._stop_for_timeout()
            if deadline is not None and now > deadline:
                raise KineticTimeoutError(f"{self.name} has not finished after {timeout:g} s; it goes on")

        # Woken by its hosts, a cell just stored is first looked at when they have news (a look before is a
        # look at nothing, with the CPU its hosts need to load it).
        sleep_first, self._unread = self._unread and self._woken, False
        try:
            return wait_for(self.snapshot, ready, on_snapshot=on_snapshot, between=check, sleep=self.sleep,
                            first_pause=WOKEN_FIRST_POLL_S if self._woken else FIRST_POLL_S,
                            hosts=self.plan.world_size, sleep_first=sleep_first)
        except KeyboardInterrupt as interrupt:
            raise self._interrupted(interrupt) from None

    # -- a session's cell -----------------------------------------------------------------------

    def _session_cell_ready(self, snapshot: JobSnapshot) -> bool:
        """Done, or the session ended and its hosts' ends are recorded (their agent stops them within the grace)."""
        return snapshot.status.done or (self._session_ended(snapshot) and (
            all(host.exit is not None for host in snapshot.hosts) or self.group.status().done))

    def _output_in(self, snapshot: JobSnapshot) -> JobSnapshot:
        """Wait (a moment at most) for the cell's last output from each host done with it: the leader's, so
        that its output precedes the value; a failed host's (its last line is its failure's), so that its
        drill-down ends with it; where a host did not succeed, so that the panel's rows (which a session cell
        that succeeded does not show) end with every host's last line, on a local disk, where each host's agent
        marks its output stored. A host stopped, or still running (being stopped), is not waited for: a worker
        that printed nothing more stores no end of its output."""
        every_host = self.storage.local_path() is not None and any(
            host.state != HostState.SUCCEEDED.value for host in snapshot.hosts)
        wanted = [host.index for host in snapshot.hosts if host.exit is None and host.ended and (
            every_host or host.index == protocol.LEADER_INDEX or host.state == HostState.FAILED.value)]
        deadline = time.monotonic() + OUTPUT_WAIT_S
        while not self.poller.output_complete.issuperset(wanted) and time.monotonic() < deadline:
            self.session.sleep(0.002)  # the agent wakes it once the chunk is stored
            snapshot = self.snapshot()
            wanted = [index for index in wanted if snapshot.hosts[index].exit is None]
        return snapshot

    @staticmethod
    def _session_ended(snapshot: JobSnapshot) -> bool:
        """Whether the session has ended, as its hosts' records tell: however it ends (a stop from any kernel,
        its idle timeout, a failure), its agent ends every host, and each host's end is recorded. So a poll
        needs no look at the stop request (a read that finds nothing, on every look of every cell)."""
        return any(host.exit for host in snapshot.hosts)


#: What ``submit`` returned before a cell's handle was one type: the same class, under the name scripts know.
JobHandle = CellHandle
