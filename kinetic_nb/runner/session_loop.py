"""A session's host: up once, the framework initialized once, one namespace kept from cell to cell.

After the plan check and the coordinated start (the same as a one-shot job's),
the host waits for ``cells/{seq}/payload.pkl`` (one object, looked at with a
growing pause, never a listing), then for each cell:

- loads the cell's payload (verified under the cell's own key) and adds the
  notebook values it ships to the namespace;
- meets the other hosts at the cell's barrier (``cells/{seq}/ready-{i}``, the
  leader's verdict in ``cells/{seq}/.leader_ready``), so a host that cannot
  load the cell stops it everywhere before anyone enters a collective;
- runs it, with SIGINT raising ``KeyboardInterrupt`` only while it runs;
- writes the cell's outcome as a job does (the leader's ``result.pkl``, a
  worker's ``result-worker-{i}.pkl`` only on failure) in the cell's directory;
- goes back to idle, its status naming the cell, how it went and the names the
  namespace now holds.

A failure, ``SystemExit`` and ``KeyboardInterrupt`` included, fails the cell
and leaves the namespace as the cell left it; the host stays up. Whether the
session survives the failure is its agent's call (every host back to idle
within the grace period). Host-safe.
"""

from __future__ import annotations

import builtins
import contextlib
import signal
import sys
import time
from collections.abc import Iterator
from typing import Any, Protocol

from kinetic_nb.errors import HostStoppedError, IntegrityError, ObjectNotFoundError
from kinetic_nb.runner import envelope, frameworks, job_keys, protocol
from kinetic_nb.runner.barrier import CellMarkers, meet
from kinetic_nb.runner.cell import execute_cell, load_notebook_values
from kinetic_nb.runner.protocol import FirstFailure, HostState, Phase
from kinetic_nb.runner.records import read_record, write_record
from kinetic_nb.runner.wakeup import open_wakeup, wake, wake_clients, wakeup_path
from kinetic_nb.storage import Storage


class HostRun(Protocol):
    """What a session's loop uses of its host's run (``runner.execute.HostRun``): its records and reports."""

    storage: Storage
    plan: Any
    key: bytes
    host_index: int
    is_leader: bool
    status: Any
    phase: Phase
    filename: str
    failure_line: str
    failure_traceback: str
    outcome_storage: Storage
    outcome_key: bytes

    def begin_cell(self, storage: Storage, key: bytes) -> None: ...

    def enter(self, phase: Phase, state: HostState | None = None) -> None: ...

    def report_success(self, value: Any, namespace: dict[str, Any], out_names: list[str]) -> None: ...

    def report_failure(self, error: BaseException, *, stopped: bool = False) -> None: ...

#: First and longest pause between two looks for the next cell: short right after a cell (the next
#: one often follows at once), longer when idle, so idle hosts cost storage little.
FIRST_LOOK_S = 0.001
MAX_LOOK_LOCAL_S = 0.02
MAX_LOOK_REMOTE_S = 1.0
#: An idle host's longest pause between two looks for the next cell when its wakeup socket is open.
IDLE_LOOK_LOCAL_S = 1.0
#: For this long after a cell the next one is looked for at least this often.
BUSY_S = 1.0
BUSY_LOOK_S = 0.002
BUSY_LOOK_REMOTE_S = 0.02
#: How often a host waiting for the next cell looks for the session's stop (its agent signals it anyway).
CANCEL_LOOK_S = 1.0
#: A phase a cell stays in longer than this is written (the panel shows the cell running, or a host waiting at
#: its barrier); a quick cell's phases reach storage with its end, in one write.
STATUS_DEFER_S = 0.05
#: The longest a cell's barrier waits: its hosts are up, so the plan's start window for hosts that are still
#: being scheduled (Kubernetes adds its pending limit, 45 minutes) is not a cell's to wait.
CELL_BARRIER_TIMEOUT_S = 300.0
#: Keys of a cell's payload that only sessions use.
CELL_SEQ = "seq"
CELL_FRAMEWORK = "framework"
#: Names a namespace always holds that are no cell's.
_HIDDEN = frozenset({"__builtins__", "__name__"})


def cell_key(key: bytes, seq: int) -> bytes:
    """The key of cell ``seq``'s records: a record of one cell never verifies as another's."""
    return job_keys.derived_key(key, protocol.cell_dir(seq))


def held_names(namespace: dict[str, Any]) -> list[str]:
    return sorted(name for name in namespace if name not in _HIDDEN)


class SessionLoop:
    """Runs a session's cells on one host, through ``run``'s records and reports."""

    def __init__(self, run: HostRun):
        self.run = run
        self.storage = run.storage
        self.plan = run.plan
        self.namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
        self.initialized = False
        #: A SIGINT arrived outside a cell (the agent interrupts every host at once, and this one had not yet
        #: entered the cell): the cell checks, on entering, whether the interrupt was meant for it.
        self._interrupt_pending = False
        self._max_look = MAX_LOOK_LOCAL_S if self.storage.local_path() else MAX_LOOK_REMOTE_S
        #: On a local disk the notebook (and the cell's leader) wake this host at once through a socket.
        self.wakeup = open_wakeup(self.plan.job_id, run.host_index) if self.storage.local_path() else None

    def _sleep(self, seconds: float) -> None:
        if self.wakeup is not None:
            self.wakeup.sleep(seconds)
        else:
            time.sleep(seconds)

    def serve(self) -> int:
        """Initialize the framework (unless the first cell that imports it will), then run cells until stopped."""
        run = self.run
        if self.plan.framework not in ("auto", "none"):
            run.enter(Phase.DISTRIBUTED_INIT, HostState.RUNNING)
            frameworks.initialize(self.plan, run.host_index)
            self.initialized = True
        run.status.update(state=HostState.IDLE, cell=0, names=held_names(self.namespace))
        run.status_defer_s = STATUS_DEFER_S  # a quick cell's status is written once, when it is done
        signal.signal(signal.SIGINT, self._note_interrupt)  # an interrupt reaches a cell, never the loop
        seq = 1
        try:
            while self._wait_for(seq):
                self._run_cell(seq)
                seq += 1
        finally:
            if self.wakeup is not None:
                self.wakeup.close()
        return protocol.EXIT_OK

    def _wait_for(self, seq: int) -> bool:
        """Wait for cell ``seq``'s payload; False once the session is stopped.

        Right after a cell the next one often follows at once (a loop, a
        script): the first second looks every few milliseconds, then less often.
        """
        payload = f"{protocol.cell_dir(seq)}/{protocol.PAYLOAD}"
        pause, busy_until = FIRST_LOOK_S, time.monotonic() + BUSY_S
        # Idle on a local disk, the notebook wakes this host through its socket when it submits a cell (and
        # the agent stops it with a signal): a slow look is only a safety net for a wakeup that went missing.
        idle_look = IDLE_LOOK_LOCAL_S if self.wakeup is not None else self._max_look
        # On a bucket each look is a request: a busy look every few milliseconds would be hundreds per cell.
        busy_look = BUSY_LOOK_S if self.storage.local_path() else BUSY_LOOK_REMOTE_S
        next_cancel_look = 0.0
        while True:
            if self.storage.exists(payload):
                return True
            now = time.monotonic()
            if now >= next_cancel_look:  # the agent also stops its hosts itself: a slower look will do
                if self.storage.exists(protocol.CANCEL):
                    return False
                next_cancel_look = now + CANCEL_LOOK_S
            self._sleep(pause)
            cap = busy_look if time.monotonic() < busy_until else idle_look
            pause = min(pause * 1.5, cap)

    def _run_cell(self, seq: int) -> None:
        run = self.run
        cell_storage = self.storage.child(protocol.cell_dir(seq))
        run.begin_cell(cell_storage, cell_key(run.key, seq))
        run.status.update(state=HostState.RUNNING, phase=Phase.PAYLOAD_LOAD, cell=seq, cell_failed=False,
                          record=False, defer_s=STATUS_DEFER_S)
        try:
            if self.interrupted(seq):  # interrupted while it waited behind another cell: it never runs
                raise KeyboardInterrupt(f"cell {seq} was withdrawn before it started")
            cell = envelope.load_sealed(cell_storage, protocol.PAYLOAD, run.outcome_key)
            run.filename = cell[protocol.CELL_FILENAME]
            values = load_notebook_values(cell, run.host_index)
            run.enter(Phase.START_BARRIER, HostState.READY)
            self.cell_barrier(cell_storage)
            self.namespace.update(values)
            if not self.initialized and cell.get(CELL_FRAMEWORK, "none") != "none":
                run.enter(Phase.DISTRIBUTED_INIT, HostState.RUNNING)
                frameworks.initialize(_with_framework(self.plan, cell[CELL_FRAMEWORK]), run.host_index)
                self.initialized = True
            run.enter(Phase.EXECUTE, HostState.RUNNING)
            print(protocol.CELL_MARK.format(seq=seq), end="", flush=True)  # the agent: logs from here are this cell's
            with self._interruptible(seq):
                self._stop_if_interrupted_early(seq)
                value = execute_cell(cell[protocol.CELL_SOURCE], run.filename, self.namespace,
                                     host_index=run.host_index, leader=run.is_leader)
            sys.stdout.flush()
            sys.stderr.flush()
            if run.is_leader:
                run.report_success(value, self.namespace, cell[protocol.CELL_OUT_NAMES])
            failed = False
        except HostStoppedError as stop:
            run.report_failure(stop, stopped=True)
            failed = True
        except BaseException as error:  # noqa: BLE001 - SystemExit and KeyboardInterrupt fail the cell, not the host
            run.report_failure(error)
            self._tell_the_agent(seq, error)
            failed = True
        sys.stderr.flush()
        print(protocol.CELL_END_MARK.format(seq=seq), end="", flush=True)  # the agent stores the cell's output now
        # Back to idle in the phase the cell ended in (nothing is torn down), with its failure as it was shown.
        run.status.update(state=HostState.IDLE, cell=seq, cell_failed=failed, names=held_names(self.namespace),
                          message=run.failure_line if failed else "",
                          traceback=run.failure_traceback if failed else "")
        if self.wakeup is not None:  # the notebooks waiting on this cell look now
            wake_clients(self.plan.job_id)

    def _note_interrupt(self, signum: int, frame: Any) -> None:
        self._interrupt_pending = True

    def interrupted(self, seq: int) -> bool:
        """Whether the notebook (or the agent, at the cell's timeout) asked to interrupt cell ``seq``: a record
        verified under the session's key, so that nobody else can stop a cell."""
        name = protocol.cell_control(seq, "interrupt")
        try:
            read_record(self.storage, self.run.key, name)
        except (ObjectNotFoundError, IntegrityError):
            return False
        return True

    def _stop_if_interrupted_early(self, seq: int) -> None:
        """An interrupt that reached this host before the cell ran (while it loaded the cell or met its
        peers) stops the cell now, as it would have a moment later; one meant for another cell does not."""
        if self._interrupt_pending:
            self._interrupt_pending = False
            if self.interrupted(seq):
                raise KeyboardInterrupt(f"cell {seq} was interrupted before it started on host {self.run.host_index}")

    @contextlib.contextmanager
    def _interruptible(self, seq: int) -> Iterator[None]:
        """SIGINT raises ``KeyboardInterrupt`` in cell ``seq``, and only there, and only when the interrupt is
        meant for it: the agent signals every host, and one that asks about a queued cell is ignored here."""
        def interrupt_if_meant(signum: int, frame: Any) -> None:
            if self.interrupted(seq):
                raise KeyboardInterrupt

        previous = signal.signal(signal.SIGINT, interrupt_if_meant)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)

    def cell_barrier(self, cell_storage: Storage) -> None:
        """The cell's coordinated start, by the start's own protocol: every host has loaded it, or nobody runs it."""
        run = self.run
        cell_storage.write_bytes(protocol.cell_ready(run.host_index), b"")
        if not run.is_leader and self.wakeup is not None:
            wake(wakeup_path(self.plan.job_id, protocol.LEADER_INDEX))

        def wake_workers() -> None:
            if self.wakeup is not None:
                for index in range(1, self.plan.hosts):
                    wake(wakeup_path(self.plan.job_id, index))

        meet(cell_storage, run.outcome_key, leader=run.is_leader, hosts=self.plan.hosts,
             timeout=min(self.plan.barrier_timeout_s, CELL_BARRIER_TIMEOUT_S),
             sighting=CellMarkers(cell_storage, self.plan.hosts), what="cell barrier",
             sleep=self._sleep, max_pause=self._max_look, on_go=wake_workers)

    def _tell_the_agent(self, seq: int, error: BaseException) -> None:
        """The first failure of a cell: the agent then checks that every host comes back to idle."""
        record = FirstFailure(host_index=self.run.host_index, at=time.time(),
                              description=f"{type(error).__name__} in cell {seq}")
        with contextlib.suppress(Exception):  # the agent also sees the host's status
            write_record(self.storage, self.run.key, protocol.cell_control(seq, "failed"), record.to_json(),
                         exclusive=True)


def _with_framework(plan: Any, framework: str) -> Any:
    import dataclasses

    return dataclasses.replace(plan, framework=framework)
