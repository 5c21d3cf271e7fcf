"""How a cell stops: a user's interrupt, a cancel, a timeout, and the one line that says what became of it.

``CellHandle``'s part (``client.cell_handle``). A one-shot job's cell is its
job: an interrupt cancels it (a kernel restart's leaves it running, detached).
A session's cell gets ``KeyboardInterrupt`` on every host (the session's agent
sends it), a cell still queued behind another is withdrawn before it starts,
and the session stays up once every host is back to idle; the agent ends it
when they are not, within the grace. The agent owns a cell's timeout; the
notebook steps in only when the agent did not.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

from kinetic_nb.errors import CellInterrupted, IntegrityError, JobCancelledError, ObjectExistsError, ObjectNotFoundError
from kinetic_nb.runner import protocol
from kinetic_nb.runner.protocol import CancelRequest, JobPlan
from kinetic_nb.runner.records import read_record
from kinetic_nb.runner.wakeup import agent_wakeup_path, wake
from kinetic_nb.state import HostState, JobSnapshot, JobStatus
from kinetic_nb.storage import Storage

logger = logging.getLogger(__name__)


class CellStopping:
    """Interrupting, cancelling and timing out a cell: the attributes and methods named below are the handle's."""

    name: str
    seq: int
    plan: JobPlan
    timeout: float | None
    storage: Storage
    #: The session the cell belongs to (None: a one-shot job's), its hosts' group, the poller of its records.
    session: Any
    group: Any
    poller: Any
    _snapshot: JobSnapshot | None
    _failure: BaseException | None
    # The handle's own (``client.cell_handle``): named here, defined there.
    snapshot: Callable[[], JobSnapshot]
    _decide: Callable[..., JobSnapshot]
    _explained: Callable[..., BaseException]
    _session_ended: Callable[[JobSnapshot], bool]

    def _interrupted(self, interrupt: KeyboardInterrupt) -> CellInterrupted:
        """What an interrupt of the wait raises, one line and what became of the cell, once the cell is stopped
        as far as this kind of cell stops at once (``final`` says the rest)."""
        if self.session is None:
            self.group.cancel_after_interrupt(interrupt)  # its note says what becomes of the job
            notes, stopped_by = list(getattr(interrupt, "__notes__", ())), "interrupt"
            what = (f"stopped waiting for {self.name}, which goes on" if self.group.detached else
                    f"{self.name} was interrupted on every host")
        else:
            note, withdrawn = self._interrupt_and_report(wait=False)
            notes, stopped_by = [note], "withdrawn" if withdrawn else "interrupt"
            what = f"{self.name} was {'withdrawn before it started' if withdrawn else 'interrupted on every host'}"
        error = CellInterrupted(what)
        for note in notes:
            error.add_note(note)
        if not (self.session is None and self.group.detached):  # a detached job's panel goes on
            self._failure = error
            self._decide(self._snapshot or self.snapshot(), JobStatus.CANCELLED, stopped_by)
        return error

    @property
    def stopped_at_timeout(self) -> bool:
        """Whether a one-shot job was stopped because it ran past its plan's timeout (by its agent or here)."""
        request = self.poller.cancel_request
        return self.session is None and request is not None and request.reason == CancelRequest.TIMEOUT

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
        ended = self.session.ended() or (stuck and f"{protocol.hosts_named(stuck)} did not come back")
        if not ended:
            return f"kinetic_nb: every host is back to idle and session {self.session.session_id} is up"
        return (f"kinetic_nb: session {self.session.session_id} ended: {ended}; %kinetic restart (or "
                "session.restart()) starts it again")

    def _interrupt_and_report(self, *, timeout: float | None = None, wait: bool = True) -> tuple[str, bool]:
        """Interrupt, wait for every host to be back (or the session to end; ``wait=False``: a user's interrupt
        frees the kernel at once, as a one-shot cell's does), and say which it was; and whether
        the cell was withdrawn: queued behind another, no host had started it, and none will (each host finds
        the interrupt before it runs the cell), so nothing is waited for. Whatever happens meanwhile (a second
        interrupt, a storage error) is said in that line: it never replaces the interrupt the user made."""
        session_id = self.session.session_id
        deadline = time.monotonic() + self.plan.grace_s + 5
        try:
            self.interrupt(timeout=timeout)
            if all(host.state == HostState.PENDING.value for host in self.snapshot().hosts):
                return f"kinetic_nb: no host had started it; session {session_id} goes on with the cell before it", True
            if not wait:
                return (f"kinetic_nb: interrupting it on every host; session {session_id} stays up once they are "
                        f"back to idle (its agent ends it if they are not within {self.plan.grace_s:g} s)"), False
            while time.monotonic() < deadline:
                snapshot = self.snapshot()
                if snapshot.status.done or self._session_ended(snapshot):
                    break
                time.sleep(0.05)
            return self._fate([host.index for host in self.snapshot().hosts if not host.exit and host.state in (
                HostState.RUNNING.value, HostState.READY.value)]), False
        except KeyboardInterrupt:  # a second interrupt: stop waiting, and still say what is known
            return (f"kinetic_nb: not waiting for the hosts to come back (interrupted again); the session's agent "
                    f"ends session {session_id} unless every host is back to idle within "
                    f"{self.plan.grace_s:g} s (%kinetic sessions shows its state)"), False
        except Exception as error:  # the note is best effort: the interrupt is what is raised
            logger.debug("after the interrupt of cell %s", self.seq, exc_info=True)
            return (f"kinetic_nb: could not learn whether session {session_id} is still up after "
                    f"the interrupt ({type(error).__name__}: {error}); %kinetic sessions shows its state"), False

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
        request = {"at": time.time(), "reason": "user"} if timeout is None else {
            "at": time.time(), "reason": "timeout", "timeout": timeout}
        try:
            self.session.share(protocol.cell_control(self.seq, "interrupt"), json.dumps(request).encode())
        except ObjectExistsError:
            pass
        if self.storage.local_path() is not None:  # the agent acts on it now, not at its next look at storage
            wake(agent_wakeup_path(self.session.session_id))

    def cancel(self, reason: str = "cancelled by the user") -> None:
        """Stop the cell: a one-shot job's hosts are stopped (returns once they are gone, or after a bounded
        wait); a session's cell is interrupted, and the session's hosts stay up."""
        if self.session is None:
            self.group.cancel(reason)
        else:
            self.interrupt()

    def _stop_for_timeout(self) -> None:
        """The notebook's backstop for an agent that did not stop the cell at its timeout: it stops the cell as
        the agent would have, and raises what the agent's stop would have."""
        if self.session is None:
            self.cancel(CancelRequest.TIMEOUT)
        else:
            self._interrupt_and_report(timeout=self.timeout)
        self._failure = self._explained(JobCancelledError(f"{self.name} ran past its timeout"), "timeout")
        self._decide(self.snapshot(), JobStatus.CANCELLED, "timeout")
        raise self._failure
