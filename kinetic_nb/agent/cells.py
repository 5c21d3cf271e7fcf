"""A session's cells as its agent sees them: every host back to idle after a failed or interrupted cell,
within the grace period, or the session ends; and the idle timeout.

A host marks a failed cell with ``control/cell-{seq}-failed.json``, the client
an interrupt with ``control/cell-{seq}-interrupt.json`` (the agent then sends
SIGINT to each host's process) and each new cell with
``control/cell-{seq}-submitted.json`` (the idle clock): all seen in the
agent's one listing of ``control/``. Host-safe.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any, Protocol

from kinetic_nb.runner import protocol
from kinetic_nb.runner.protocol import CancelRequest, HostState, HostStatus, JobPlan
from kinetic_nb.runner.records import read_host_status
from kinetic_nb.storage import Storage


class Agent(Protocol):
    """What the cell watch uses of its agent (``agent.supervisor.Agent``)."""

    storage: Storage
    key: bytes
    plan: JobPlan
    hosts: dict[int, Any]
    cancelled: bool

    def stop_all(self) -> None: ...

    def verified(self, name: str) -> bool: ...

    def write_record(self, name: str, data: bytes, *, exclusive: bool = False) -> bool: ...


class CellWatch:
    """The agent's part in a session's cells."""

    def __init__(self, agent: Agent):
        self.agent = agent
        #: Cells whose hosts must all be back to idle by a deadline (after a failure or an interrupt).
        self._returns_due: dict[int, float] = {}
        self._cell_events: set[str] = set()
        self._last_cell_at = time.time()

    def look(self, names: list[str]) -> None:
        for name in names:
            parsed = protocol.parse_cell_control(name)
            if parsed is None or name in self._cell_events or not self.agent.verified(name):
                continue
            self._cell_events.add(name)
            seq, what = parsed
            if what == "submitted":
                self._last_cell_at = time.time()
            elif what in ("failed", "interrupt"):
                if what == "interrupt":
                    self._interrupt_hosts()
                self._returns_due.setdefault(seq, time.monotonic() + self.agent.plan.grace_s)
        self._check_returns()
        self._check_idle()

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
            except OSError:
                statuses[index] = None
        return statuses

    def _check_returns(self) -> None:
        """End the session when a host has not come back from a failed or interrupted cell within the grace."""
        if not self._returns_due or self.agent.cancelled:
            return
        statuses = self._statuses()
        for seq, due in sorted(self._returns_due.items()):
            stuck = [index for index, status in statuses.items() if self.agent.hosts[index].alive and not (
                status is not None and (status.cell > seq or  # on a later cell: it came back from this one
                                        (status.cell == seq and status.state == HostState.IDLE.value)))]
            if not stuck:
                del self._returns_due[seq]
            elif time.monotonic() >= due:
                self.end_session(f"host{'s' if len(stuck) > 1 else ''} {', '.join(map(str, stuck))} did not come "
                                 f"back from cell {seq} within {self.agent.plan.grace_s:g} s (blocked in a "
                                 "collective or in C code, where no interrupt reaches)")
                return

    def _check_idle(self) -> None:
        idle_s = self.agent.plan.idle_timeout_s
        if not idle_s or self.agent.cancelled or time.time() - self._last_cell_at < idle_s:
            return
        if all(status is not None and status.state == HostState.IDLE.value for status in self._statuses().values()):
            self.end_session(f"idle for {idle_s:g} s (--idle-timeout)")
        else:
            self._last_cell_at = time.time()  # a cell still runs: busy, not idle

    def end_session(self, why: str) -> None:
        print(f"kinetic agent: the session ended: {why}", file=sys.stderr, flush=True)
        self.agent.cancelled = True
        request = CancelRequest(reason=why, at=time.time())
        self.agent.write_record(protocol.CANCEL, request.to_json(), exclusive=True)
        self.agent.stop_all()
