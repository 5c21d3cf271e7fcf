"""``CellHandle``: one cell of a session, with the one-shot handle's methods.

Its hosts' states for this cell come from their session-level records
(``hosts/{i}/status.json`` names the cell a host is on, log chunks name the
cell they belong to); its outcome from ``cells/{seq}/`` by the seed's rules.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from kinetic_nb.client.handle import STACKS_WAIT_S, Handle
from kinetic_nb.client.job_handle import remove_job_objects
from kinetic_nb.client.outcome import read_leader, resolve_outcome
from kinetic_nb.client.poller import JobPoller
from kinetic_nb.client.waiting import wait_for
from kinetic_nb.errors import (
    CellInterrupted,
    IntegrityError,
    KineticTimeoutError,
    ObjectExistsError,
    ObjectNotFoundError,
)
from kinetic_nb.runner import protocol
from kinetic_nb.runner.protocol import HostState, JobPlan
from kinetic_nb.runner.records import read_record, write_record
from kinetic_nb.runner.group import cell_key
from kinetic_nb.state import JobSnapshot, JobStatus


class Session(Protocol):
    """What a cell uses of its session (``sessions.Session``)."""

    job: Any  # the session's hosts as one long JobHandle
    plan: JobPlan
    storage: Any
    session_id: str
    #: Where the hosts wake this notebook when they are back to idle (a local disk), else None.
    wakeup: Any

    def ended(self, *, hosts_ended: bool | None = None) -> str | None: ...

__all__ = ["CellHandle"]

logger = logging.getLogger(__name__)

#: While no host's end is recorded, whether the session was stopped is looked at no more often than this.
ENDED_LOOK_S = 0.05
#: How long a finished cell waits for the leader's output to be stored (the agent writes it at once).
OUTPUT_WAIT_S = 2.0
#: The agent interrupts a cell at its timeout; the notebook does it itself only this much after the grace.
TIMEOUT_SLACK_S = 5.0


class CellHandle(Handle):
    """One cell of a session: its outcome by the seed's rules, its hosts, logs and stacks."""

    def __init__(self, session: Session, seq: int, *, timeout: float | None = None,
                 echo: Callable[[str, str], None] | None = None, name: str | None = None):
        self.session = session
        self.seq = seq
        self.timeout = timeout
        self.echo = echo
        #: Where the cell's outcome is stored, under the cell's own key.
        self.storage = session.storage.child(protocol.cell_dir(seq))
        self.key = cell_key(session.job.key, seq)
        self.plan = session.plan
        self.outputs: dict[str, Any] = {}
        #: The session's hosts' records, read for this cell, with the cell's own output.
        self.poller = JobPoller(session.storage, dataclasses.replace(self.plan, job_id=self.job_id),
                                session.job.backend, key=session.job.key, on_leader_output=echo, cell=seq,
                                label=f"{name or f'cell {seq}'} · session {session.session_id}")
        self._payload: Any = None
        self._failure: BaseException | None = None
        self._leader: Any = None
        self._snapshot: JobSnapshot | None = None
        self._next_ended_look = 0.0

    @property
    def job_id(self) -> str:
        return f"{self.session.session_id}/{protocol.cell_dir(self.seq)}"

    def ask_for_stacks(self, hosts: list[int], wait: float = STACKS_WAIT_S) -> dict[int, str]:
        return self.session.job.ask_for_stacks(hosts, wait)

    def logs(self, host: int = protocol.LEADER_INDEX) -> str:
        """Host ``host``'s output during this cell."""
        self.snapshot()
        return "".join(f"{line}\n" for line in self.poller.records[host].lines())

    def stacks(self, host: int | None = None) -> dict[int, str]:
        """Every running host's Python stacks (see ``JobHandle.stacks``)."""
        return self.session.job.stacks(host)

    # -- the outcome ---------------------------------------------------------------------------

    def result(self, timeout: float | None = None, *,
               on_snapshot: Callable[[JobSnapshot], None] | None = None) -> Any:
        """The leader's value, or the right host's own exception (the seed's rules, root cause first).

        When the session ended during the cell, the exception says so and
        that ``restart()`` starts it again. An interrupt sends
        ``KeyboardInterrupt`` into the cell on every host; the session stays
        up when every host is back to idle within the grace period.
        """
        if self._payload is not None:
            return self._payload.result
        if self._failure is not None:  # read once: its objects are gone, the exception stays
            raise self._failure
        snapshot = self._wait(timeout, on_snapshot)
        ended = self.session.ended(hosts_ended=any(host.exit for host in snapshot.hosts))
        exits = {host.index: host.exit for host in snapshot.hosts if host.exit is not None}
        status = snapshot.status
        if status is JobStatus.CANCELLED:
            status = JobStatus.FAILED  # an interrupted cell's KeyboardInterrupts are its outcome
        try:
            try:
                self._payload = resolve_outcome(self.storage, self.poller.plan, status, exits, self.storage.list,
                                                self.describe_host, key=self.key)
            except BaseException:
                with contextlib.suppress(Exception):  # leader_result() still has the leader's own value
                    self._leader = read_leader(self.storage, self.key)
                raise
            finally:
                self._forget_outcome()
        except KeyboardInterrupt as interrupt:
            timeout = self.interrupted_at_timeout()
            if timeout is None:
                self._failure = interrupt
                raise
            error = KineticTimeoutError(f"cell {self.seq} ran past its timeout of {timeout:g} s and was interrupted")
            error.add_note(self._fate())
            self._failure = error
            raise error from interrupt
        except BaseException as error:
            if ended is not None and isinstance(error, Exception):
                error.add_note(f"The session {self.session.session_id} ended: {ended}. "
                               "%kinetic restart (or session.restart()) starts it again.")
            self._failure = error
            raise
        self.outputs = dict(self._payload.outputs)
        return self._payload.result

    def _forget_outcome(self) -> None:
        """Delete the cell's outcome objects once read (the leader's value, the workers' failures, the barrier's
        markers), as a one-shot job's are: a long session does not pile up every cell's values. The payload
        stays (its name is how the session numbers its cells), and so does the hosts' output (``logs()``)."""
        try:
            remove_job_objects(self.storage, keep=(protocol.PAYLOAD, "log/"))
        except Exception:
            logger.debug("could not remove the outcome of cell %s", self.seq, exc_info=True)

    def _wait(self, timeout: float | None, on_snapshot: Callable[[JobSnapshot], None] | None) -> JobSnapshot:
        deadline = None if timeout is None else time.monotonic() + timeout
        # The agent interrupts the cell at its timeout; the notebook steps in only if it has not, a while later.
        cell_deadline = None if self.timeout is None else (time.monotonic() + self.timeout + self.plan.grace_s
                                                           + TIMEOUT_SLACK_S)
        def ready(snapshot: JobSnapshot) -> bool:
            return snapshot.status.done or (self._session_ended(snapshot) and self._settled(snapshot))

        def check(snapshot: JobSnapshot) -> None:
            now = time.monotonic()
            if cell_deadline is not None and now > cell_deadline:
                self._stop_for_timeout()
            if deadline is not None and now > deadline:
                raise KineticTimeoutError(f"cell {self.seq} of session {self.session.session_id} has not "
                                          f"finished after {timeout:g} s; it goes on")

        def sleep(seconds: float) -> None:
            wakeup = self.session.wakeup
            if wakeup is not None:  # the hosts wake it when they are back to idle
                wakeup.sleep(seconds)
            else:
                time.sleep(seconds)

        try:
            snapshot = wait_for(self.snapshot, ready, on_snapshot=on_snapshot, between=check, sleep=sleep)
            snapshot = self._output_in(snapshot)
            if on_snapshot is not None:
                on_snapshot(snapshot)
            return snapshot
        except KeyboardInterrupt:
            interrupted = CellInterrupted(f"cell {self.seq} was interrupted on every host")
            interrupted.add_note(self._interrupt_and_report())
            raise interrupted from None

    def _output_in(self, snapshot: JobSnapshot) -> JobSnapshot:
        """Wait (a moment at most) for the cell's last output: the leader's, so that its output precedes the
        value; after a failure every host's, so that the panel's drill-downs end with each host's last line."""
        wanted = [host.index for host in snapshot.hosts if host.exit is None and (
            host.index == protocol.LEADER_INDEX or snapshot.status is not JobStatus.SUCCEEDED)]
        deadline = time.monotonic() + OUTPUT_WAIT_S
        while not self.poller.output_complete.issuperset(wanted) and time.monotonic() < deadline:
            if self.session.wakeup is not None:  # the agent wakes it once the chunk is stored
                self.session.wakeup.sleep(0.002)
            else:
                time.sleep(0.002)
            snapshot = self.snapshot()
            wanted = [index for index in wanted if snapshot.hosts[index].exit is None]
        return snapshot

    def _session_ended(self, snapshot: JobSnapshot) -> bool:
        """Whether the session has ended: looked at once a host's end is recorded, and otherwise (a stop
        from another kernel, say) every ENDED_LOOK_S, so that a quick cell's polls stay a few stats."""
        now = time.monotonic()
        if not any(host.exit for host in snapshot.hosts) and now < self._next_ended_look:
            return False
        self._next_ended_look = now + ENDED_LOOK_S
        return self.session.ended(hosts_ended=any(host.exit for host in snapshot.hosts)) is not None

    def _settled(self, snapshot: JobSnapshot) -> bool:
        """A session that ended: its hosts' ends are recorded (their agent stops them within the grace)."""
        return all(host.exit is not None for host in snapshot.hosts) or self.session.job.status().done

    def interrupt(self, *, timeout: float | None = None) -> None:
        """``KeyboardInterrupt`` in this cell on every host (the session's agent sends it); a cell still queued
        behind another is withdrawn before it starts, and the running one is left alone. ``timeout``: the
        cell's own, which it ran past (the agent normally interrupts it first)."""
        self.poller.interrupted = True
        request = {"at": time.time(), "reason": "user"} if timeout is None else {
            "at": time.time(), "reason": "timeout", "timeout": timeout}
        try:
            write_record(self.session.storage, self.session.job.key, protocol.cell_control(self.seq, "interrupt"),
                         json.dumps(request).encode())
        except ObjectExistsError:
            pass

    def interrupted_at_timeout(self) -> float | None:
        """The timeout the agent interrupted this cell at, or None when nobody did for a timeout."""
        try:
            record = json.loads(read_record(self.session.storage, self.session.job.key,
                                            protocol.cell_control(self.seq, "interrupt")))
        except (ObjectNotFoundError, IntegrityError, ValueError):
            return None
        if not isinstance(record, dict) or record.get("reason") != "timeout":
            return None
        return float(record.get("timeout") or 0)

    def _fate(self) -> str:
        """The session's fate after this cell, in one line."""
        ended = self.session.ended()
        if ended is None:
            return f"kinetic_nb: every host is back to idle and session {self.session.session_id} is up"
        return (f"kinetic_nb: session {self.session.session_id} ended: {ended}; %kinetic restart (or "
                "session.restart()) starts it again")

    cancel = interrupt

    def _interrupt_and_report(self, *, timeout: float | None = None) -> str:
        """Interrupt, wait for every host to be back (or the session to end), and say which it was. Whatever
        happens meanwhile (a second interrupt, a storage error) is said in that line: it never replaces the
        interrupt the user made."""
        deadline = time.monotonic() + self.plan.grace_s + 5
        try:
            self.interrupt(timeout=timeout)
            while time.monotonic() < deadline:
                snapshot = self.snapshot()
                if snapshot.status.done:
                    return (f"kinetic_nb: every host is back to idle and session {self.session.session_id} "
                            "is up")
                if self.session.ended(hosts_ended=any(host.exit for host in snapshot.hosts)) is not None:
                    break
                time.sleep(0.05)
            stuck = [host.index for host in self.snapshot().hosts if not host.exit and host.state in (
                HostState.RUNNING.value, HostState.READY.value)]
            return (f"kinetic_nb: session {self.session.session_id} ended: "
                    f"{self.session.ended() or 'hosts ' + ', '.join(map(str, stuck)) + ' did not come back'}")
        except KeyboardInterrupt:  # a second interrupt: stop waiting, and still say what is known
            return (f"kinetic_nb: not waiting for the hosts to come back (interrupted again); the session's agent "
                    f"ends session {self.session.session_id} unless every host is back to idle within "
                    f"{self.plan.grace_s:g} s (%kinetic sessions shows its state)")
        except Exception as error:  # the note is best effort: the interrupt is what is raised
            logger.debug("after the interrupt of cell %s", self.seq, exc_info=True)
            return (f"kinetic_nb: could not learn whether session {self.session.session_id} is still up after "
                    f"the interrupt ({type(error).__name__}: {error}); %kinetic sessions shows its state")

    def _stop_for_timeout(self) -> None:
        note = self._interrupt_and_report(timeout=self.timeout)
        error = KineticTimeoutError(f"cell {self.seq} ran past its timeout of {self.timeout:g} s and was interrupted")
        error.add_note(note)
        raise error
