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
import os
import time
from collections.abc import Callable
from typing import Any, Protocol

from kinetic_nb import views
from kinetic_nb.client.echo import LeaderEcho
from kinetic_nb.client.job_handle import remove_job_objects
from kinetic_nb.client.outcome import read_leader, resolve_outcome
from kinetic_nb.client.poller import _HostRecords
from kinetic_nb.client.waiting import wait_for
from kinetic_nb.errors import (
    CellInterrupted,
    IntegrityError,
    KineticTimeoutError,
    ObjectExistsError,
    ObjectNotFoundError,
)
from kinetic_nb.runner import protocol
from kinetic_nb.runner.protocol import ExitSummary, HostState, HostStatus, JobPlan, Phase
from kinetic_nb.runner.records import open_log_chunk, open_record, read_record, write_record
from kinetic_nb.runner.session_loop import cell_key
from kinetic_nb.state import HostSnapshot, JobSnapshot, JobStatus, is_quiet


class Session(Protocol):
    """What a cell uses of its session (``sessions.Session``)."""

    job: Any  # the session's hosts as one long JobHandle
    plan: JobPlan
    storage: Any
    session_id: str
    #: Per host, the number of the next log chunk it will write (what cells read from, on a local disk).
    next_chunk: list[int]
    #: Where the hosts wake this notebook when they are back to idle (a local disk), else None.
    wakeup: Any

    def ended(self) -> str | None: ...

__all__ = ["CellHandle"]

logger = logging.getLogger(__name__)

#: While no host's end is recorded, whether the session was stopped is looked at no more often than this.
ENDED_LOOK_S = 0.05
#: How long a finished cell waits for the leader's output to be stored (the agent writes it at once).
OUTPUT_WAIT_S = 2.0
#: The agent interrupts a cell at its timeout; the notebook does it itself only this much after the grace.
TIMEOUT_SLACK_S = 5.0


class CellHandle:
    """One cell of a session: its outcome by the seed's rules, its hosts, logs and stacks."""

    def __init__(self, session: Session, seq: int, *, timeout: float | None = None,
                 echo: Callable[[str, str], None] | None = None):
        self.session = session
        self.seq = seq
        self.timeout = timeout
        self.echo = echo
        self._echo = LeaderEcho(echo) if echo is not None else None
        self.storage = session.storage.child(protocol.cell_dir(seq))
        self.key = cell_key(session.job.key, seq)
        self.plan = session.plan
        self.outputs: dict[str, Any] = {}
        self._records = [_HostRecords() for _ in range(self.plan.hosts)]
        self._statuses: dict[int, HostStatus] = {}
        self._versions: dict[str, str] = {}
        self._submitted = time.time()
        self._interrupted = False
        self._payload: Any = None
        self._failure: BaseException | None = None
        #: The leader's own payload, once read (``leader_result``).
        self._leader: Any = None
        #: When each host last printed in this cell, and the stacks of those that turned quiet.
        self._active_at: dict[int, float] = {}
        self._stacks: dict[int, str] = {}
        #: Hosts whose output for this cell is all stored (their agent wrote the cell's last chunk).
        self._output_complete: set[int] = set()
        self._next_ended_look = 0.0

    @property
    def job_id(self) -> str:
        return f"{self.session.session_id}/{protocol.cell_dir(self.seq)}"

    def __repr__(self) -> str:
        return f"<CellHandle {self.job_id}>"

    # -- reading ------------------------------------------------------------------------------

    def snapshot(self) -> JobSnapshot:
        """The cell as it is now; only records that changed are read.

        On a local disk each host's few records are looked at by name (a
        stat each, and the next log chunks it expects), which stays as cheap
        after a thousand cells as after one; elsewhere one listing of the
        hosts' records, as a job's poller does.
        """
        if self.session.storage.local_path() is not None:
            self._look_by_name()
        else:
            self._look_by_listing()
        hosts = self._with_quiet(tuple(self._host(index) for index in range(self.plan.hosts)))
        return JobSnapshot(self.job_id, self.session.job.backend.name, self.plan.accelerator, self._status(hosts),
                           self._submitted, time.time(), hosts)

    def _with_quiet(self, hosts: tuple[HostSnapshot, ...]) -> tuple[HostSnapshot, ...]:
        """A host still running the cell, silent for the grace since another finished it, is quiet: shown with
        its stacks (asked for once), as a one-shot job's stuck host is."""
        now = time.time()
        ended = [host.updated_at for host in hosts if host.state not in (
            HostState.PENDING.value, HostState.READY.value, HostState.RUNNING.value) and host.updated_at]
        if not ended:
            return hosts
        quiet = [host.index for host in hosts if host.state == HostState.RUNNING.value and is_quiet(
            max(filter(None, (self._active_at.get(host.index), host.updated_at)), default=None), min(ended),
            self.plan.grace_s, now)]
        asked = [index for index in quiet if index not in self._stacks]
        if asked:
            for index in asked:
                self._stacks[index] = ""
            self._stacks.update(self.session.job.stacks_of(asked))
        return tuple(dataclasses.replace(host, state=HostState.QUIET.value, stacks=self._stacks.get(host.index, ""))
                     if host.index in quiet else host for host in hosts)

    def leader_result(self) -> Any:
        """The leader's own value for this cell as soon as it has recorded it, whatever the other hosts did
        (a stuck worker, an interrupt): ``result()`` applies the outcome rules, this reads the leader alone.
        Raises the leader's own exception if it failed, ``ObjectNotFoundError`` while it has recorded nothing."""
        if self._payload is not None:
            return self._payload.result
        if self._leader is None:
            self._leader = read_leader(self.storage, self.key)
        if self._leader is None:
            raise ObjectNotFoundError(f"the leader of cell {self.seq} of session {self.session.session_id} has "
                                      "recorded no result yet")
        if not self._leader.payload.success:
            raise self._leader.exception(self.job_id)
        self.outputs = dict(self._leader.payload.outputs)
        return self._leader.payload.result

    def _look_by_listing(self) -> None:
        for info in self.session.storage.list(protocol.HOSTS_DIR + "/"):
            parsed = protocol.parse_host_object(info.name)
            if parsed is None or parsed[0] >= self.plan.hosts or self._versions.get(info.name) == info.version:
                continue
            index, kind, seq = parsed
            if kind == "heartbeat":
                self._records[index].heartbeat_at = info.updated
            elif kind == "log":
                if seq >= self.session.next_chunk[index]:  # an earlier cell's chunks were read by its own handle
                    self._absorb(index, kind, info.name, info.version)
                    self.session.next_chunk[index] = max(self.session.next_chunk[index], seq + 1)
            elif kind in ("status", "exit"):
                self._absorb(index, kind, info.name, info.version)

    def _look_by_name(self) -> None:
        storage = self.session.storage
        for index in range(self.plan.hosts):
            for kind, name in (("heartbeat", protocol.host_heartbeat(index)), ("status", protocol.host_status(index)),
                               ("exit", protocol.host_exit(index))):
                try:
                    stat = os.stat(storage.local_path(name))
                except OSError:
                    continue
                if kind == "heartbeat":
                    self._records[index].heartbeat_at = stat.st_mtime
                elif self._versions.get(name) != (version := f"{stat.st_mtime_ns}:{stat.st_size}"):
                    self._absorb(index, kind, name, version)
            while True:  # the chunks written since: numbered in order, never rewritten
                name = protocol.host_log_chunk(index, self.session.next_chunk[index])
                if not os.path.exists(storage.local_path(name)):
                    break
                self._absorb(index, "log", name, "")
                self.session.next_chunk[index] += 1

    def _absorb(self, index: int, kind: str, name: str, version: str) -> None:
        storage, key = self.session.storage, self.session.job.key
        try:
            data = storage.read_bytes(name)
        except ObjectNotFoundError:
            return
        self._versions[name] = version
        try:
            if kind == "log":
                chunk = open_log_chunk(key, name, data, where=f"{storage.uri}/{name}")
            else:
                body = open_record(key, name, data, where=f"{storage.uri}/{name}")
        except IntegrityError:
            self._records[index].refuse(index, name)
            return
        if kind == "status":
            status = HostStatus.from_json(body)
            if index not in self._statuses or status.revision >= self._statuses[index].revision:  # never go back
                self._statuses[index] = status
        elif kind == "exit":
            self._records[index].exit = ExitSummary.from_json(body)
        else:
            if chunk.cell != self.seq:
                return
            if chunk.end:
                self._output_complete.add(index)
            self._active_at[index] = time.time()  # it printed: not quiet
            for stream, text in chunk.segments:
                self._records[index].add_log(stream, text)
                if index == protocol.LEADER_INDEX and self._echo is not None:
                    self._echo.feed(stream, text)
            if chunk.end and index == protocol.LEADER_INDEX and self._echo is not None:
                self._echo.close()  # the cell's last chunk: no line of it grows any more

    def _host(self, index: int) -> HostSnapshot:
        status, records = self._statuses.get(index), self._records[index]
        lines = records.lines()
        if records.exit is not None:
            state = HostState.FAILED.value if records.exit.failed else HostState.STOPPED.value
        elif status is None or status.cell < self.seq:
            state = HostState.PENDING.value  # still on an earlier cell
        elif status.cell > self.seq or status.state == HostState.IDLE.value:
            failed = status.cell == self.seq and status.cell_failed
            stopped = failed and status.message.split(":", 1)[0].endswith("HostStoppedError")
            state = (HostState.STOPPED if stopped else HostState.FAILED if failed else HostState.SUCCEEDED).value
        elif status.state in (HostState.FAILED.value, HostState.STOPPED.value):
            # Its failure counts once it is back to idle: by then its failure payload is stored.
            state = HostState.RUNNING.value
        else:
            state = status.state
        current = status is not None and status.cell == self.seq
        return HostSnapshot(
            index=index, state=state, phase=status.phase if current else Phase.STARTUP.value,
            started_at=(status.history[0][1] if current and status.history else None),
            updated_at=status.updated_at if current else None, heartbeat_at=records.heartbeat_at,
            last_line=records.last_line(),
            log_tail=lines, message=status.message if current else "", traceback=status.traceback if current else "",
            exit=records.exit,
            history=tuple((phase, float(at)) for phase, at in status.history) if current else (),
        )

    def _status(self, hosts: tuple[HostSnapshot, ...]) -> JobStatus:
        states = [host.state for host in hosts]
        if all(state == HostState.SUCCEEDED.value for state in states):
            return JobStatus.SUCCEEDED
        ended = [state for state in states if state not in (HostState.PENDING.value, HostState.READY.value,
                                                              HostState.RUNNING.value, HostState.QUIET.value)]
        if len(ended) < len(states):
            return JobStatus.RUNNING if any(host.phase != Phase.STARTUP.value for host in hosts) else JobStatus.PENDING
        return JobStatus.CANCELLED if self._interrupted and not any(
            host.exit for host in hosts) else JobStatus.FAILED

    def hosts(self) -> list[HostSnapshot]:
        return list(self.snapshot().hosts)

    def status(self) -> JobStatus:
        return self.snapshot().status

    def logs(self, host: int = protocol.LEADER_INDEX) -> str:
        """Host ``host``'s output during this cell."""
        self.snapshot()
        return "".join(f"{line}\n" for line in self._records[host].lines())

    def stacks(self, host: int | None = None) -> dict[int, str]:
        return self.session.job.stacks(host)

    def summary(self) -> str:
        return views.render("text", self.snapshot())

    def watch(self) -> None:
        """Show the cell's live panel (or its text twin), kept current in the background; return at once."""
        views.render("watch", self)

    def timeline(self) -> Any:
        """A matplotlib Figure of the cell: one row per host, one bar per phase."""
        return views.render("timeline", self.snapshot())

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self) if cycle else self.summary())

    def describe_host(self, index: int) -> str:
        host = self.snapshot().hosts[index]
        text = host.exit.describe() if host.exit else f"was {host.state} in phase {host.phase}"
        lines = [line for line in host.log_tail if line.strip()][-5:]
        if lines:
            text += "; last log lines:\n" + "\n".join(f"    {line}" for line in lines)
        return text

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
        ended = self.session.ended()
        exits = {host.index: host.exit for host in snapshot.hosts if host.exit is not None}
        cell_plan = JobPlan(job_id=self.job_id, hosts=self.plan.hosts, accelerator=self.plan.accelerator,
                            devices_per_host=self.plan.devices_per_host, framework=self.plan.framework,
                            coordinator_address=self.plan.coordinator_address,
                            barrier_timeout_s=self.plan.barrier_timeout_s,
                            heartbeat_timeout_s=self.plan.heartbeat_timeout_s,
                            shutdown_timeout_s=self.plan.shutdown_timeout_s)
        status = snapshot.status
        if status is JobStatus.CANCELLED:
            status = JobStatus.FAILED  # an interrupted cell's KeyboardInterrupts are its outcome
        try:
            try:
                self._payload = resolve_outcome(self.storage, cell_plan, status, exits, self.storage.list,
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
        stays: its name is how the session numbers its cells."""
        try:
            remove_job_objects(self.storage, keep=(protocol.PAYLOAD,))
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
            snapshot = self._leader_output_in(snapshot)
            if on_snapshot is not None:
                on_snapshot(snapshot)
            return snapshot
        except KeyboardInterrupt:
            interrupted = CellInterrupted(f"cell {self.seq} was interrupted on every host")
            interrupted.add_note(self._interrupt_and_report())
            raise interrupted from None

    def _leader_output_in(self, snapshot: JobSnapshot) -> JobSnapshot:
        """Wait (a moment at most) for the leader's last chunk of this cell, so its output precedes the value."""
        deadline = time.monotonic() + OUTPUT_WAIT_S
        while protocol.LEADER_INDEX not in self._output_complete and time.monotonic() < deadline \
                and snapshot.hosts[protocol.LEADER_INDEX].exit is None:
            if self.session.wakeup is not None:  # the agent wakes it once the chunk is stored
                self.session.wakeup.sleep(0.002)
            else:
                time.sleep(0.002)
            snapshot = self.snapshot()
        return snapshot

    def _session_ended(self, snapshot: JobSnapshot) -> bool:
        """Whether the session has ended: looked at once a host's end is recorded, and otherwise (a stop
        from another kernel, say) every ENDED_LOOK_S, so that a quick cell's polls stay a few stats."""
        now = time.monotonic()
        if not any(host.exit for host in snapshot.hosts) and now < self._next_ended_look:
            return False
        self._next_ended_look = now + ENDED_LOOK_S
        return self.session.ended() is not None

    def _settled(self, snapshot: JobSnapshot) -> bool:
        """A session that ended: its hosts' ends are recorded (their agent stops them within the grace)."""
        return all(host.exit is not None for host in snapshot.hosts) or self.session.job.status().done

    def interrupt(self, *, timeout: float | None = None) -> None:
        """``KeyboardInterrupt`` in this cell on every host (the session's agent sends it); a cell still queued
        behind another is withdrawn before it starts, and the running one is left alone. ``timeout``: the
        cell's own, which it ran past (the agent normally interrupts it first)."""
        self._interrupted = True
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
        """Interrupt, wait for every host to be back (or the session to end), and say which it was."""
        self.interrupt(timeout=timeout)
        deadline = time.monotonic() + self.plan.grace_s + 5
        try:
            while time.monotonic() < deadline:
                snapshot = self.snapshot()
                if snapshot.status.done:
                    return (f"kinetic_nb: every host is back to idle and session {self.session.session_id} "
                            "is up")
                if self.session.ended() is not None:
                    break
                time.sleep(0.05)
        except KeyboardInterrupt:  # a second interrupt: stop waiting, and still say what is known
            return (f"kinetic_nb: not waiting for the hosts to come back (interrupted again); the session's agent "
                    f"ends session {self.session.session_id} unless every host is back to idle within "
                    f"{self.plan.grace_s:g} s (%kinetic sessions shows its state)")
        stuck = [host.index for host in self.snapshot().hosts if not host.exit and host.state in (
            HostState.RUNNING.value, HostState.READY.value)]
        return (f"kinetic_nb: session {self.session.session_id} ended: "
                f"{self.session.ended() or 'hosts ' + ', '.join(map(str, stuck)) + ' did not come back'}")

    def _stop_for_timeout(self) -> None:
        note = self._interrupt_and_report(timeout=self.timeout)
        error = KineticTimeoutError(f"cell {self.seq} ran past its timeout of {self.timeout:g} s and was interrupted")
        error.add_note(note)
        raise error
