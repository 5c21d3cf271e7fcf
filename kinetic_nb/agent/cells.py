"""A session's cells as its agent sees them: every host back to idle after a failed or interrupted cell,
within the grace period, or the session ends; a cell's timeout; and the idle timeout.

A host marks a failed cell with ``control/cell-{seq}-failed.json``, the client
an interrupt with ``control/cell-{seq}-interrupt.json`` (the agent then sends
SIGINT to each host's process; a host raises ``KeyboardInterrupt`` only in the
cell the interrupt names, and withdraws a queued one before it starts) and each
new cell with ``control/cell-{seq}-submitted.json``, which carries the cell's
timeout: all seen in the agent's one listing of ``control/``. The agent owns a
cell's timeout, so it holds with no kernel: when a cell has run that long, the
agent writes its interrupt (reason ``timeout``) as the notebook would. The
grace for coming back counts from when the hosts reach the cell, never from an
interrupt of a cell still queued behind another. Host-safe.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any, Protocol

from kinetic_nb.errors import IntegrityError, StorageError
from kinetic_nb.runner import protocol
from kinetic_nb.runner.protocol import CancelRequest, HostState, HostStatus, JobPlan
from kinetic_nb.runner.records import read_host_status, read_record
from kinetic_nb.storage import Storage, patiently


class Agent(Protocol):
    """What the cell watch uses of its agent (``agent.supervisor.Agent``)."""

    storage: Storage
    key: bytes
    plan: JobPlan
    hosts: dict[int, Any]
    cancelled: bool

    def stop_all(self, because: str = ...) -> None: ...

    def verified(self, name: str) -> bool: ...

    def write_record(self, name: str, data: bytes, *, exclusive: bool = False) -> bool: ...


class CellWatch:
    """The agent's part in a session's cells."""

    def __init__(self, agent: Agent):
        self.agent = agent
        #: Cells whose hosts must all be back to idle (after a failure or an interrupt): by a deadline that
        #: starts when a host is seen in the cell (None until then: the cell may still be queued).
        self._returns_due: dict[int, float | None] = {}
        self._cell_events: set[str] = set()
        self._last_cell_at = time.time()
        self._busy = False
        #: Cells with a timeout, and when a host was first seen running each (None: not yet).
        self._timeouts: dict[int, float] = {}
        self._started: dict[int, float | None] = {}

    def look(self, names: list[str]) -> None:
        for name in names:
            parsed = protocol.parse_cell_control(name)
            if parsed is None or name in self._cell_events or not self.agent.verified(name):
                continue
            self._cell_events.add(name)
            seq, what = parsed
            if what == "submitted":
                self._last_cell_at = time.time()
                timeout = self._submitted_timeout(name)
                if timeout:
                    self._timeouts[seq], self._started[seq] = timeout, None
            elif what in ("failed", "interrupt"):
                if what == "interrupt":
                    self._timeouts.pop(seq, None)  # interrupted already: its timeout has nothing left to do
                    self._interrupt_hosts()
                self._returns_due.setdefault(seq, None)
        statuses = self._statuses() if self._returns_due or self._timeouts else None
        if statuses is not None:
            self._check_timeouts(statuses)
            self._check_returns(statuses)
        self._check_idle()

    def _submitted_timeout(self, name: str) -> float | None:
        try:
            record = json.loads(read_record(self.agent.storage, self.agent.key, name))
            timeout = record.get("timeout")
            return float(timeout) if timeout else None
        except (OSError, ValueError, TypeError, AttributeError, StorageError, IntegrityError):
            return None

    def _check_timeouts(self, statuses: dict[int, HostStatus | None]) -> None:
        """Interrupt a cell that has run past its timeout, as the notebook would (its kernel may be gone)."""
        now = time.monotonic()
        for seq, timeout in list(self._timeouts.items()):
            if all(_back_from(seq, status) for status in statuses.values()):
                del self._timeouts[seq]  # over, on every host
                continue
            if self._started[seq] is None:
                if any(status is not None and status.cell == seq and status.state != HostState.IDLE.value
                       for status in statuses.values()):
                    self._started[seq] = now
                continue
            if now - self._started[seq] >= timeout:
                del self._timeouts[seq]
                request = {"at": time.time(), "reason": "timeout", "timeout": timeout}
                name = protocol.cell_control(seq, "interrupt")
                self.agent.write_record(name, json.dumps(request).encode(), exclusive=True)
                print(f"kinetic agent: cell {seq} ran past its timeout of {timeout:g} s; interrupting it",
                      file=sys.stderr, flush=True)
                self._cell_events.add(name)
                self._interrupt_hosts()
                self._returns_due.setdefault(seq, None)

    def _interrupt_hosts(self) -> None:
        """SIGINT to each host's own process: ``KeyboardInterrupt`` in the cell, wherever Python runs."""
        for host in self.agent.hosts.values():
            if host.alive:
                try:
                    os.kill(host.pid, signal.SIGINT)
                except ProcessLookupError:
                    pass

    def _statuses(self) -> dict[int, HostStatus | None]:
        statuses: dict[int, HostStatus | None] = {}
        for index in self.agent.hosts:
            try:
                statuses[index] = read_host_status(self.agent.storage, self.agent.key, index)
            except (OSError, StorageError):  # unreadable, or a storage that does not answer: not known
                statuses[index] = None
        return statuses

    def _check_returns(self, statuses: dict[int, HostStatus | None]) -> None:
        """End the session when a host has not come back from a failed or interrupted cell within the grace,
        counted from when a host is first seen in that cell."""
        if not self._returns_due or self.agent.cancelled:
            return
        now = time.monotonic()
        for seq, due in sorted(self._returns_due.items()):
            alive = {index: status for index, status in statuses.items() if self.agent.hosts[index].alive}
            if all(_back_from(seq, status) for status in alive.values()):
                del self._returns_due[seq]
                continue
            if due is None:  # the clock starts once a host is in the cell (a queued one may wait behind others)
                if any(status is not None and status.cell >= seq for status in alive.values()):
                    self._returns_due[seq] = now + self.agent.plan.grace_s
                continue
            stuck = [index for index, status in alive.items() if not _back_from(seq, status)]
            if now >= due:
                self.end_session(f"{protocol.hosts_named(stuck)} did not come "
                                 f"back from cell {seq} within {self.agent.plan.grace_s:g} s (blocked in a "
                                 "collective or in C code, where no interrupt reaches)")
                return

    def idle(self) -> bool:
        """Whether every host is idle, with no cell's return or timeout to watch (on the hosts' statuses as
        the channel carries them: no request)."""
        if self._returns_due or self._timeouts:
            return False
        return all(status is not None and status.state == HostState.IDLE.value for status in self._statuses().values())

    def _check_idle(self) -> None:
        """End the session once no cell has run for the idle timeout, counted from the end of the last one:
        a cell that runs is never idle time, however long it runs."""
        idle_s = self.agent.plan.idle_timeout_s
        if not idle_s or self.agent.cancelled or time.time() - self._last_cell_at < idle_s:
            return
        if all(status is not None and status.state == HostState.IDLE.value for status in self._statuses().values()):
            if self._busy:  # the cell that kept it busy has just ended: the idle time starts now
                self._busy = False
                self._last_cell_at = time.time()
                return
            self.end_session(f"idle for {idle_s:g} s (--idle-timeout)")
        else:
            self._busy = True  # looked at again on every look until its cell ends

    def end_session(self, why: str) -> None:
        print(f"kinetic agent: the session ended: {why}", file=sys.stderr, flush=True)
        self.agent.cancelled = True
        request = CancelRequest(reason=why, at=time.time())
        with patiently():
            self.agent.write_record(protocol.CANCEL, request.to_json(), exclusive=True)
        self.agent.stop_all(f"as the session ended ({why})")


def _back_from(seq: int, status: HostStatus | None) -> bool:
    """Whether a host is done with cell ``seq``: on a later cell, or idle after it."""
    return status is not None and (status.cell > seq or (status.cell == seq and status.state == HostState.IDLE.value))
