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
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from kinetic_nb import views
from kinetic_nb.client.host_group import STACKS_WAIT_S, HostGroup, check_host, remove_job_objects
from kinetic_nb.client.outcome import read_leader, resolve_outcome
from kinetic_nb.client.poller import JobPoller
from kinetic_nb.client.profile import GATHER_WAIT_S, MergedProfile, merged_profile
from kinetic_nb.client.waiting import wait_for
from kinetic_nb.errors import (
    CellInterrupted,
    IntegrityError,
    JobCancelledError,
    KineticTimeoutError,
    ObjectExistsError,
    ObjectNotFoundError,
)
from kinetic_nb.runner import protocol
from kinetic_nb.runner.group import ONLY_CELL, cell_key
from kinetic_nb.runner.protocol import CancelRequest
from kinetic_nb.runner.records import read_record
from kinetic_nb.runner.relayed import STORE_INTERVAL_S
from kinetic_nb.state import HostSnapshot, HostState, JobSnapshot, JobStatus
from kinetic_nb.storage.defaults import user_directory

__all__ = ["CellHandle", "JobHandle", "Session"]

logger = logging.getLogger(__name__)

#: The hosts' agents stop a cell at its timeout; the notebook steps in only this much later.
TIMEOUT_SLACK_S = 5.0
#: Once a host has failed on its own, how long to let the others' records land
#: before deciding (the cell still raises well within a second of the failure).
SETTLE_S = 0.3
#: How long a finished session cell waits for the hosts' last output to be stored (the agent writes it at once).
OUTPUT_WAIT_S = 2.0


class Session(Protocol):
    """What a cell uses of its session (``sessions.Session``)."""

    group: HostGroup
    session_id: str
    #: The session's records: through its direct channel while that is up, else plain storage.
    records: Any

    def ended(self, *, hosts_ended: bool | None = None) -> str | None: ...

    def sleep(self, seconds: float) -> None: ...

    def share(self, name: str, body: bytes, key: bytes | None = None, *, sealed_as: str | None = None,
              exclusive: bool = False) -> None: ...


class CellHandle:
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
    """

    def __init__(self, group: HostGroup, *, session: Session | None = None, seq: int = ONLY_CELL,
                 timeout: float | None = None, echo: Callable[[str, str], None] | None = None,
                 name: str | None = None, profiled: bool = False):
        self.group = group
        #: Whether the cell was asked to run under its framework's profiler on every host (``profile()``).
        self.profiled = profiled
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
        else:
            self.storage = session.records.child(protocol.cell_dir(seq))
            self.key = cell_key(group.key, seq)
            self.poller = JobPoller(session.records, dataclasses.replace(self.plan, job_id=self.job_id), group.backend,
                                    key=group.key, on_leader_output=echo, cell=seq,
                                    label=f"{name or f'cell {seq}'} · session {session.session_id}")
        #: A session cell's outcome objects being deleted on a bucket, in the background, once it was decided.
        self.cleanup: threading.Thread | None = None
        self._payload: Any = None
        self._failure: BaseException | None = None
        self._leader: Any = None
        self._snapshot: JobSnapshot | None = None

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
        return f"<{type(self).__name__} {self.job_id} {self.plan.hosts} hosts {self.status()}>"

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

        copy = user_directory("profiles") / f"{self.job_id.replace('/', '-')}.trace.json.gz"
        self._profile = merged_profile(storage, self.key, self.plan.world_size, self.poller.plan.name_of, ended,
                                       str(copy), wait)
        return self._profile

    def status(self) -> JobStatus:
        """PENDING, RUNNING, SUCCEEDED, FAILED or CANCELLED."""
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
            text = f"was {host.state}"
        if summary is not None and summary.recorded_success:
            return text + " after recording success"
        if host.updated_at is not None:
            text += f" in phase {host.phase}"
        lines = [line for line in host.log_tail if line.strip()][-5:]
        if lines:
            text += "; last log lines:\n" + "\n".join(f"    {line}" for line in lines)
        others = [line for line in (summary.stderr_tail if summary else ()) if line not in host.log_tail]
        if others:  # what the host's own log does not hold: its agent's last words, say
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
        return self._wait(lambda snapshot: snapshot.status.done, timeout, on_snapshot).status

    def result(self, timeout: float | None = None, *,
               on_snapshot: Callable[[JobSnapshot], None] | None = None) -> Any:
        """The leader's value, or the right host's own exception (the seed's rules, root cause first).

        It raises as soon as one host has failed on its own account. An
        interrupt cancels a one-shot job (unless it is detached; in a kernel
        only when no restart follows) and re-raises ``KeyboardInterrupt``; in
        a session it sends ``KeyboardInterrupt`` into the cell on every host
        and raises ``CellInterrupted``, and the session stays up when every
        host is back to idle within the grace period. When the session ended
        during the cell, the exception says so and that ``restart()`` starts
        it again.
        """
        if self._payload is not None:
            return self._payload.result
        if self._failure is not None:  # read once: a session cell's objects are gone, the exception stays
            raise self._failure
        snapshot, shown = self._wait_for_outcome(timeout, on_snapshot)
        status = snapshot.status
        if status is JobStatus.CANCELLED and self.session is not None:
            status = JobStatus.FAILED  # an interrupted cell's KeyboardInterrupts are its outcome
        decided = JobStatus.FAILED
        try:
            self._payload = resolve_outcome(self.storage, self.poller.plan, status, self.poller.exits,
                                            self._listing, self.describe_host, key=self.key,
                                            lost=snapshot.lost if self.session is None else ())
            decided = JobStatus.SUCCEEDED
        except BaseException as error:
            if isinstance(error, JobCancelledError):
                decided = JobStatus.CANCELLED
            if self.session is not None:
                with contextlib.suppress(Exception):  # leader_result() still has the leader's own value
                    self._leader = read_leader(self.storage, self.key)
            self._failure = self._explained(error, snapshot)
            if self._failure is error:
                raise
            raise self._failure from error
        finally:
            if on_snapshot is not None and not shown:
                # Decided while a host's end may still be being recorded: the panel's last word is the outcome.
                on_snapshot(snapshot if snapshot.status.done else dataclasses.replace(snapshot, status=decided))
            self._after_outcome(decided, snapshot)
        self.outputs = dict(self._payload.outputs)
        self.missing_outputs = self._payload.missing_outputs
        return self._payload.result

    def _wait_for_outcome(self, timeout: float | None, on_snapshot: Callable[[JobSnapshot], None] | None
                          ) -> tuple[JobSnapshot, bool]:
        """Wait until the outcome can be decided; the snapshot, and whether ``on_snapshot`` has seen it last."""
        if self.session is not None:
            return self._wait(self._session_cell_ready, timeout, on_snapshot), True
        snapshot = self._wait(lambda snap: snap.decided, timeout, on_snapshot, show_last=False)
        shown = snapshot.status.done
        if shown:
            if on_snapshot is not None:
                on_snapshot(snapshot)
        else:  # a moment for a lower-indexed host's own failure to land: the choice stays the lowest host's
            settle = time.monotonic() + SETTLE_S
            while not snapshot.status.done and time.monotonic() < settle:
                time.sleep(0.02)
                snapshot = self.snapshot()
        if snapshot.lost:
            self.group.report_lost_hosts(snapshot.lost)
        return snapshot, shown

    def _listing(self) -> list[Any]:
        """The cell's records as the seed's rules read them: the poll's last listing of a one-shot job's
        objects, one listing of a session cell's directory."""
        return self.poller.listing if self.session is None else self.storage.list()

    def _explained(self, error: BaseException, snapshot: JobSnapshot) -> BaseException:
        """The exception the cell raises: a session cell interrupted at its timeout raises the timeout; one
        whose session ended says so."""
        if self.session is None:
            return error
        ended = self.session.ended(hosts_ended=self._session_ended(snapshot))
        if isinstance(error, KeyboardInterrupt):
            timeout = self.interrupted_at_timeout()
            if timeout is None:
                return error
            timed_out = KineticTimeoutError(f"cell {self.seq} ran past its timeout of {timeout:g} s and was "
                                            "interrupted")
            timed_out.add_note(self._fate())
            return timed_out
        if ended is not None and isinstance(error, Exception):
            error.add_note(self._fate())
        return error

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
        if self.storage.local_path() is not None:
            self._remove_outcome()
        else:  # on a bucket a listing and a round of deletes: not on the way to the cell's value
            self.cleanup = threading.Thread(target=self._remove_outcome, name=f"kinetic-cleanup-{self.job_id}",
                                            daemon=True)
            self.cleanup.start()

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
              on_snapshot: Callable[[JobSnapshot], None] | None, *, show_last: bool = True) -> JobSnapshot:
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
                self._stop_for_timeout(on_snapshot)
            if deadline is not None and now > deadline:
                name = f"job {self.job_id}" if self.session is None else f"cell {self.seq} of session {self.session.session_id}"
                raise KineticTimeoutError(f"{name} has not finished after {timeout:g} s; it goes on")

        try:
            sleep = self.group.sleep if self.session is None else self.session.sleep
            snapshot = wait_for(self.snapshot, ready, on_snapshot=on_snapshot, between=check, sleep=sleep)
            if self.session is not None:
                snapshot = self._output_in(snapshot)
            elif self.stopped_at_timeout:
                if on_snapshot is not None:
                    on_snapshot(snapshot)
                raise self._timeout_error(snapshot)
            if on_snapshot is not None and show_last:
                on_snapshot(snapshot)
            return snapshot
        except KeyboardInterrupt as interrupt:
            if self.session is None:
                self.group.cancel_after_interrupt(interrupt)
                raise
            interrupted = CellInterrupted(f"cell {self.seq} was interrupted on every host")
            interrupted.add_note(self._interrupt_and_report())
            raise interrupted from None

    # -- a one-shot job's cell ------------------------------------------------------------------

    @property
    def stopped_at_timeout(self) -> bool:
        """Whether a one-shot job was stopped because it ran past its plan's timeout (by its agent or here)."""
        request = self.poller.cancel_request
        return self.session is None and request is not None and request.reason == CancelRequest.TIMEOUT

    def _timeout_error(self, snapshot: JobSnapshot) -> KineticTimeoutError:
        where = [f"host {h.index}: {h.state}, phase {h.phase}" + (f", last line: {h.last_line}" if h.last_line else "")
                 for h in snapshot.hosts]
        return KineticTimeoutError(
            f"job {self.job_id} ran past its timeout of {self.plan.timeout_s:g} s and was stopped; " + "; ".join(where)
        )

    # -- a session's cell -----------------------------------------------------------------------

    def _session_cell_ready(self, snapshot: JobSnapshot) -> bool:
        """Done, or the session ended and its hosts' ends are recorded (their agent stops them within the grace)."""
        return snapshot.status.done or (self._session_ended(snapshot) and (
            all(host.exit is not None for host in snapshot.hosts) or self.group.status().done))

    def _output_in(self, snapshot: JobSnapshot) -> JobSnapshot:
        """Wait (a moment at most) for the cell's last output: the leader's, so that its output precedes the
        value; after a failure every host's, so that the panel's drill-downs end with each host's last line."""
        wanted = [host.index for host in snapshot.hosts if host.exit is None and (
            host.index == protocol.LEADER_INDEX or snapshot.status is not JobStatus.SUCCEEDED)]
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

    def interrupted_at_timeout(self) -> float | None:
        """The timeout the agent interrupted this session cell at, or None when nobody did for a timeout."""
        if self.session is None:
            return None
        try:
            record = json.loads(read_record(self.group.storage, self.group.key,
                                            protocol.cell_control(self.seq, "interrupt")))
        except (ObjectNotFoundError, IntegrityError, ValueError):
            return None
        if not isinstance(record, dict) or record.get("reason") != "timeout":
            return None
        return float(record.get("timeout") or 0)

    def _fate(self, stuck: list[int] | None = None) -> str:
        """The session's fate after this cell, in one line (``stuck``: hosts that did not come back)."""
        ended = self.session.ended() or (stuck and f"hosts {', '.join(map(str, stuck))} did not come back")
        if not ended:
            return f"kinetic_nb: every host is back to idle and session {self.session.session_id} is up"
        return (f"kinetic_nb: session {self.session.session_id} ended: {ended}; %kinetic restart (or "
                "session.restart()) starts it again")

    def _interrupt_and_report(self, *, timeout: float | None = None) -> str:
        """Interrupt, wait for every host to be back (or the session to end), and say which it was. Whatever
        happens meanwhile (a second interrupt, a storage error) is said in that line: it never replaces the
        interrupt the user made."""
        session_id = self.session.session_id
        deadline = time.monotonic() + self.plan.grace_s + 5
        try:
            self.interrupt(timeout=timeout)
            while time.monotonic() < deadline:
                snapshot = self.snapshot()
                if snapshot.status.done or self._session_ended(snapshot):
                    break
                time.sleep(0.05)
            return self._fate([host.index for host in self.snapshot().hosts if not host.exit and host.state in (
                HostState.RUNNING.value, HostState.READY.value)])
        except KeyboardInterrupt:  # a second interrupt: stop waiting, and still say what is known
            return (f"kinetic_nb: not waiting for the hosts to come back (interrupted again); the session's agent "
                    f"ends session {session_id} unless every host is back to idle within "
                    f"{self.plan.grace_s:g} s (%kinetic sessions shows its state)")
        except Exception as error:  # the note is best effort: the interrupt is what is raised
            logger.debug("after the interrupt of cell %s", self.seq, exc_info=True)
            return (f"kinetic_nb: could not learn whether session {session_id} is still up after "
                    f"the interrupt ({type(error).__name__}: {error}); %kinetic sessions shows its state")

    # -- stopping -------------------------------------------------------------------------------

    def interrupt(self, *, timeout: float | None = None) -> None:
        """Stop the cell on every host.

        A session's cell gets ``KeyboardInterrupt`` on every host (the
        session's agent sends it), and the session stays up; a cell still
        queued behind another is withdrawn before it starts, and the running
        one is left alone. A one-shot job's cell is its job: it is cancelled.
        ``timeout``: the cell's own, which it ran past (the agent normally
        interrupts it first).
        """
        if self.session is None:
            self.cancel("interrupted")
            return
        self.poller.interrupted = True
        request = {"at": time.time(), "reason": "user"} if timeout is None else {
            "at": time.time(), "reason": "timeout", "timeout": timeout}
        try:
            self.session.share(protocol.cell_control(self.seq, "interrupt"), json.dumps(request).encode())
        except ObjectExistsError:
            pass

    def cancel(self, reason: str = "cancelled by the user") -> None:
        """Stop the cell: a one-shot job's hosts are stopped (returns once they are gone, or after a bounded
        wait); a session's cell is interrupted, and the session's hosts stay up."""
        if self.session is None:
            self.group.cancel(reason)
        else:
            self.interrupt()

    def _stop_for_timeout(self, on_snapshot: Callable[[JobSnapshot], None] | None) -> None:
        """The notebook's backstop for an agent that did not stop the cell at its timeout."""
        if self.session is None:
            self.cancel(CancelRequest.TIMEOUT)
            snapshot = self.snapshot()
            if on_snapshot is not None:
                on_snapshot(snapshot)
            raise self._timeout_error(snapshot)
        note = self._interrupt_and_report(timeout=self.timeout)
        error = KineticTimeoutError(f"cell {self.seq} ran past its timeout of {self.timeout:g} s and was interrupted")
        error.add_note(note)
        raise error


#: What ``submit`` returned before a cell's handle was one type: the same class, under the name scripts know.
JobHandle = CellHandle
