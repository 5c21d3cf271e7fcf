"""``JobHandle``: one job as the notebook sees it: its hosts, its wait, its outcome, its cancel."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from kinetic_nb.backends import Backend
from kinetic_nb.client.handle import STACKS_WAIT_S, Handle
from kinetic_nb.client.outcome import resolve_outcome
from kinetic_nb.client.poller import JobPoller
from kinetic_nb.client.waiting import wait_for
from kinetic_nb.errors import (
    IntegrityError,
    JobCancelledError,
    KineticTimeoutError,
    ObjectExistsError,
    ObjectNotFoundError,
)
from kinetic_nb.runner import protocol
from kinetic_nb.runner.envelope import write_sealed
from kinetic_nb.runner.logs import read_log
from kinetic_nb.runner.protocol import CancelRequest, FirstFailure, JobPlan, ResultPayload
from kinetic_nb.runner.records import read_record, unverified_line, write_record
from kinetic_nb.state import JobSnapshot, JobStatus
from kinetic_nb.storage import Storage

logger = logging.getLogger(__name__)

__all__ = ["JobHandle", "remove_job_objects"]

#: After a cancel, how long to wait for the hosts to be gone.
CANCEL_WAIT_S = 10.0
#: Deletes in flight when a job's objects are removed (one request each on gs://).
DELETE_WORKERS = 8
#: jupyter_client interrupts a kernel right before it asks it to shut down for
#: a restart (then SIGTERM at about 2.5 s, SIGKILL at 5 s). After an interrupt
#: the cell returns at once, and the job is cancelled only when no shutdown
#: request has arrived within this window, so a restart leaves the job running.
RESTART_WINDOW_S = 2.0
#: The hosts' agents stop a job at its timeout; the client steps in only this much later.
TIMEOUT_SLACK_S = 5.0
#: Once a host has failed on its own, how long to let the others' records land
#: before deciding (the cell still raises well within a second of the failure).
SETTLE_S = 0.3


class JobHandle(Handle):
    """A submitted job: wait for it, read its hosts and logs, get its outcome, cancel it."""

    def __init__(self, storage: Storage, plan: JobPlan, backend: Backend, *, key: bytes | None,
                 echo: Callable[[str, str], None] | None = None, submitted_at: float | None = None,
                 detached: bool = False, keep: bool = False):
        self.storage = storage
        self.plan = plan
        self.backend = backend
        #: The job's key: every record read is verified under it. None only for a job from before
        #: signing that the caller chose to trust (``attach(..., trust_unsigned=True)``).
        self.key = key
        #: handle.json's revision: each write counts up from the highest this handle has seen.
        self._handle_revision = 0
        #: A detached job is never cancelled by an interrupt of whoever waits for it.
        self.detached = detached
        #: Keep every object after a success (by default only handle.json and outputs/ stay).
        self.keep = keep
        self.outputs: dict[str, Any] = {}
        #: ``--out`` names the leader's cell did not bind (warned about; the rest came back).
        self.missing_outputs: tuple[str, ...] = ()
        #: Set in a kernel (the magic does): whether the kernel is shutting down, which
        #: tells a restart's interrupt from the user's. None: cancel at once on an interrupt.
        self.shutting_down: Callable[[], bool] | None = None
        self.poller = JobPoller(storage, plan, backend, key=key, submitted_at=submitted_at, on_leader_output=echo)
        self._snapshot: JobSnapshot | None = None
        self._payload: ResultPayload | None = None
        self._leader: Any = None
        self._status_recorded = False
        self._submitted_wall = submitted_at if submitted_at is not None else time.time()

    @property
    def job_id(self) -> str:
        return self.plan.job_id

    @property
    def uri(self) -> str:
        return self.storage.uri

    def logs(self, host: int = protocol.LEADER_INDEX) -> str:
        """Host ``host``'s stdout and stderr so far."""
        if not 0 <= host < self.plan.hosts:
            raise ValueError(f"host {host} is out of range for a {self.plan.hosts}-host job")
        text = read_log(self.storage, host, self.key, session=self.plan.session)
        if not text and self._payload is not None:  # cleaned up after success: the tail the poller kept
            text = "".join(f"{line}\n" for line in self.poller.snapshot().hosts[host].log_tail)
        return text

    # -- waiting and the outcome -----------------------------------------------------

    def wait(self, timeout: float | None = None, *, on_snapshot: Callable[[JobSnapshot], None] | None = None
             ) -> JobStatus:
        """Wait until every host has ended; return the job's state.

        ``timeout`` bounds this wait only (the job goes on); the plan's own
        timeout stops the job and raises ``KineticTimeoutError``. An
        interrupt cancels the job (unless it is detached) and re-raises
        ``KeyboardInterrupt``. ``on_snapshot`` sees the job at most every
        ``SNAPSHOT_INTERVAL_S``, and always once more at the end.
        """
        return self._wait_until(lambda snapshot: snapshot.status.done, timeout, on_snapshot).status

    def _wait_until(self, ready: Callable[[JobSnapshot], bool], timeout: float | None,
                    on_snapshot: Callable[[JobSnapshot], None] | None) -> JobSnapshot:
        deadline = None if timeout is None else time.monotonic() + timeout

        def check(snapshot: JobSnapshot) -> None:
            self._check_timeout(on_snapshot)
            if deadline is not None and time.monotonic() > deadline:
                raise KineticTimeoutError(f"job {self.job_id} has not finished after {timeout:g} s; it goes on")

        try:
            snapshot = wait_for(self.snapshot, ready, on_snapshot=on_snapshot, between=check)
            if on_snapshot is not None:
                on_snapshot(snapshot)
            if self.stopped_at_timeout:
                raise self._timeout_error(snapshot)
            return snapshot
        except KeyboardInterrupt as interrupt:
            if self.detached:
                interrupt.add_note(f"kinetic_nb: job {self.job_id} is detached and goes on; "
                                   f"%kinetic attach {self.job_id} to wait for it again")
                raise
            if self.shutting_down is None:  # a script: the interrupt may end it, so cancel now
                self.cancel("interrupted")
                interrupt.add_note(f"kinetic_nb: cancelled job {self.job_id} and stopped its {self.plan.hosts} hosts")
                raise
            # A kernel: control comes back at once; the cancel follows unless a shutdown does.
            threading.Thread(target=self._cancel_unless_shutting_down, name=f"kinetic-cancel-{self.job_id}",
                             daemon=True).start()
            interrupt.add_note(f"kinetic_nb: cancelling job {self.job_id} and its {self.plan.hosts} hosts "
                               f"(a kernel restart leaves it running: %kinetic attach {self.job_id})")
            raise

    def _cancel_unless_shutting_down(self) -> None:
        """Cancel after an interrupt, unless the kernel turns out to be restarting or shutting down.

        Jupyter interrupts a kernel right before it asks it to shut down for a
        restart; the kernel's shutdown request is what tells the two apart.
        """
        deadline = time.monotonic() + RESTART_WINDOW_S
        while time.monotonic() < deadline:
            if self.shutting_down():
                logger.info("kernel shutting down: job %s goes on", self.job_id)
                return
            time.sleep(0.02)
        try:
            self.cancel("interrupted")
        except Exception:  # a background thread: say it, do not lose it
            logger.warning("could not cancel job %s after an interrupt", self.job_id, exc_info=True)

    @property
    def stopped_at_timeout(self) -> bool:
        """Whether the job was stopped because it ran past the plan's timeout (by its agent or by this client)."""
        request = self.poller.cancel_request
        return request is not None and request.reason == CancelRequest.TIMEOUT

    def _check_timeout(self, on_snapshot: Callable[[JobSnapshot], None] | None) -> None:
        """The client's backstop: stop the job a little after its timeout if its agent has not."""
        started = self.plan.created_at or self.poller.submitted_at
        if self.plan.timeout_s is not None and time.time() - started > self.plan.timeout_s + TIMEOUT_SLACK_S:
            self._stop_for_timeout(on_snapshot)

    def _stop_for_timeout(self, on_snapshot: Callable[[JobSnapshot], None] | None) -> None:
        """The client's backstop for an agent that did not stop the job at its timeout."""
        self.cancel(CancelRequest.TIMEOUT)
        snapshot = self.snapshot()
        if on_snapshot is not None:
            on_snapshot(snapshot)
        raise self._timeout_error(snapshot)

    def _timeout_error(self, snapshot: JobSnapshot) -> KineticTimeoutError:
        where = [f"host {h.index}: {h.state}, phase {h.phase}" + (f", last line: {h.last_line}" if h.last_line else "")
                 for h in snapshot.hosts]
        return KineticTimeoutError(
            f"job {self.job_id} ran past its timeout of {self.plan.timeout_s:g} s and was stopped; " + "; ".join(where)
        )

    def result(self, timeout: float | None = None, *,
               on_snapshot: Callable[[JobSnapshot], None] | None = None) -> Any:
        """The leader's value, or the right host's own exception (see ``results``).

        It returns once every host has ended, or raises as soon as one host
        has failed on its own account: the others are then stopped after the
        grace period, while the notebook goes on.
        """
        if self._payload is None:
            snapshot = self._wait_until(lambda snap: snap.decided, timeout, on_snapshot)
            shown = snapshot.status.done  # the wait showed it: the panel's last word already
            if not shown:
                # A moment for a lower-indexed host's own failure to land: the choice stays the lowest host's.
                settle = time.monotonic() + SETTLE_S
                while not snapshot.status.done and time.monotonic() < settle:
                    time.sleep(0.02)
                    snapshot = self.snapshot()
            if snapshot.lost:
                self._report_lost_hosts(snapshot.lost)
            decided = JobStatus.FAILED
            try:
                self._payload = resolve_outcome(
                    self.storage, self.plan, snapshot.status, self.poller.exits, lambda: self.poller.listing,
                    self.describe_host, lost=snapshot.lost, key=self.key,
                )
                decided = JobStatus.SUCCEEDED
            except JobCancelledError:
                decided = JobStatus.CANCELLED
                raise
            finally:
                if on_snapshot is not None and not shown:
                    # Decided while a host's end may still be being recorded: the panel's last word is the outcome.
                    on_snapshot(snapshot if snapshot.status.done else dataclasses.replace(snapshot, status=decided))
                self._record_outcome(decided)
            self.outputs = dict(self._payload.outputs)
            self.missing_outputs = self._payload.missing_outputs
        return self._payload.result

    def _report_lost_hosts(self, lost: list[int]) -> None:
        """Tell the agents of a lost host, as an agent tells of a failed one: they stop theirs after the grace."""
        record = FirstFailure(host_index=lost[0], at=time.time(), description="was lost (no heartbeat)")
        try:
            write_record(self.storage, self.key, protocol.FAILED, record.to_json(), exclusive=True)
        except ObjectExistsError:
            pass  # an agent saw a failure first
        except Exception:  # bookkeeping must not hide the outcome
            logger.warning("could not record the lost hosts of %s", self.job_id, exc_info=True)

    def _record_outcome(self, status: JobStatus) -> None:
        """Note the outcome in handle.json; after a success, remove all but handle.json and outputs/."""
        if self._status_recorded:
            return
        self._status_recorded = True
        try:
            if status is JobStatus.SUCCEEDED and not self.keep:
                remove_job_objects(self.storage, keep=(protocol.HANDLE, protocol.OUTPUTS_DIR + "/"))
            self.write_record(status=str(status), decided_at=time.time())
        except Exception:  # bookkeeping must not hide the outcome
            logger.warning("could not record the outcome of %s", self.job_id, exc_info=True)
        try:  # a cluster's objects: a LeaderWorkerSet's parked pods hold their TPUs
            self.backend.cleanup(self.plan)
        except Exception:
            logger.warning("could not clean up the cluster objects of %s", self.job_id, exc_info=True)

    def stacks(self, host: int | None = None, *, wait: float = STACKS_WAIT_S) -> dict[int, str]:
        """Every running host's Python stacks, all threads, even while blocked in C code.

        Each host's agent makes its host dump its stacks into storage; a host
        that has not answered within ``wait`` seconds is reported as "no
        answer", never waited for. Hosts that have ended are left out.

        Parameters
        ----------
        host : int, optional
            Only this host.
        wait : float
            Seconds to wait for the answers.

        Returns
        -------
        dict of int to str
            Host index to its stacks, as ``faulthandler`` prints them.
        """
        if host is not None and not 0 <= host < self.plan.hosts:
            raise ValueError(f"host {host} is out of range for a {self.plan.hosts}-host job")
        running = [h.index for h in self.poller.poll().hosts if h.exit is None and host in (None, h.index)]
        return self.ask_for_stacks(running, wait) if running else {}

    def ask_for_stacks(self, hosts: list[int], wait: float = STACKS_WAIT_S) -> dict[int, str]:
        """Write the next stacks request and collect the answers of ``hosts`` for ``wait`` seconds at most."""
        asked = [protocol.parse_stacks_request(i.name) for i in self.storage.list(protocol.CONTROL_DIR + "/")]
        seq = max([number for number in asked if number is not None], default=-1) + 1
        write_record(self.storage, self.key, protocol.stacks_request(seq),
                     json.dumps({"at": time.time(), "hosts": hosts}).encode())
        wanted = {protocol.host_stacks(index, seq): index for index in hosts}
        answers: dict[int, str] = {}
        deadline = time.monotonic() + wait
        while True:
            for info in self.storage.list(protocol.HOSTS_DIR + "/"):
                index = wanted.get(info.name)
                if index is not None and index not in answers:
                    answers[index] = self._read_shown(info.name, index).decode(errors="replace")
            if len(answers) == len(hosts) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        return {index: answers.get(index, f"no answer: host {index} did not answer within {wait:g} s\n")
                for index in hosts}

    def _read_shown(self, name: str, index: int) -> bytes:
        """A host's record to show, once it verifies; the line that says it did not, otherwise."""
        try:
            return read_record(self.storage, self.key, name) if self.key is not None else self.storage.read_bytes(name)
        except IntegrityError:
            return unverified_line(index, name).encode() + b"\n"

    def cancel(self, reason: str = "cancelled by the user") -> None:
        """Stop every host; returns once they are gone (or after a bounded wait)."""
        if self.status().done:
            return
        self.backend.cancel(self.storage, self.plan, reason, self.key)
        deadline = time.monotonic() + CANCEL_WAIT_S
        while not self.status().done and time.monotonic() < deadline:
            time.sleep(0.05)

    # -- reattaching ---------------------------------------------------------------

    def write_record(self, **outcome: Any) -> None:
        """Store handle.json, signed: what lists the job and lets any kernel of this user attach to it."""
        if self.key is None:
            raise IntegrityError(f"job {self.job_id} has no key here: its record cannot be signed")
        self._handle_revision += 1  # readers never go back to a lower one: an older handle replayed is ignored
        record = {**self.to_dict(), **outcome, "revision": self._handle_revision}
        write_sealed(self.storage, protocol.HANDLE, self.key, json.dumps(record).encode())

    def to_dict(self) -> dict[str, Any]:
        """What handle.json holds: enough to list the job and attach to it from any kernel."""
        record = {"job_id": self.job_id, "uri": self.uri, "backend": self.backend.name, "hosts": self.plan.hosts,
                  "accelerator": self.plan.accelerator, "submitted_at": self._submitted_wall}
        options = self.backend.options()
        if options:  # where a cluster job lives: namespace, context, ...
            record["backend_options"] = options
        return record


def remove_job_objects(storage: Storage, keep: Iterable[str] = ()) -> None:
    """Delete a job's objects, except those whose names start with one of ``keep``
    (with nothing kept, a ``file://`` job's directory goes too)."""
    keep = tuple(keep)
    doomed = [info.name for info in storage.list() if not info.name.startswith(keep)]

    def delete(name: str) -> None:
        try:
            storage.delete(name)
        except ObjectNotFoundError:
            pass

    # A remote store answers one delete per request: several in flight.
    with concurrent.futures.ThreadPoolExecutor(max_workers=DELETE_WORKERS) as pool:
        list(pool.map(delete, doomed))
    root = storage.local_path()
    if root:  # file://: also the directories the deletes left empty
        for directory, _, _ in sorted(os.walk(root), key=lambda entry: -len(entry[0])):
            if directory != root or not keep:
                try:
                    os.rmdir(directory)
                except OSError:
                    pass  # not empty: something was kept, or a file appeared
