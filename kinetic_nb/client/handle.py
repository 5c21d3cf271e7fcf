"""What a cell's handle reads and shows, whichever group it runs on: its snapshot (with a quiet host's
stacks), its hosts, the panel and its text twin, the timeline, and the leader's own value.

:class:`~kinetic_nb.client.cell_handle.CellHandle` is the one handle type; this
base keeps its reading and showing apart from its waiting, deciding and stopping.
It reads through one :class:`~kinetic_nb.client.poller.JobPoller` (a whole
one-shot job's, or one session cell's).
"""

from __future__ import annotations

from typing import Any

from kinetic_nb import views
from kinetic_nb.client.host_group import STACKS_WAIT_S
from kinetic_nb.client.outcome import read_leader
from kinetic_nb.client.poller import JobPoller
from kinetic_nb.errors import ObjectNotFoundError
from kinetic_nb.runner.protocol import JobPlan, ResultPayload
from kinetic_nb.state import HostSnapshot, HostState, JobSnapshot, JobStatus
from kinetic_nb.storage import Storage

__all__ = ["Handle"]


class Handle:
    """A cell's hosts as the notebook reads and shows them, and the leader's own value."""

    poller: JobPoller
    plan: JobPlan
    #: Where the cell's outcome is stored (``result.pkl`` and the workers' failures), and its key.
    storage: Storage
    key: bytes | None
    outputs: dict[str, Any]
    _payload: ResultPayload | None
    _snapshot: JobSnapshot | None
    _leader: Any

    @property
    def job_id(self) -> str:
        raise NotImplementedError

    def ask_for_stacks(self, hosts: list[int], wait: float = STACKS_WAIT_S) -> dict[int, str]:
        """The stacks of ``hosts``, asked for at once; a host that has not answered within ``wait`` seconds
        is reported as "no answer"."""
        raise NotImplementedError

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
            self.poller.stacks.update(self.ask_for_stacks(quiet, STACKS_WAIT_S))
            snapshot = self.poller.snapshot()
        self._snapshot = snapshot
        return snapshot

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
