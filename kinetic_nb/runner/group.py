"""A group of hosts runs numbered cells: one path for every cell, a one-shot job's or a session's.

A one-shot ``%%kinetic`` cell is a group that runs one cell and ends: its
payload is named in the plan (``payload.pkl``, its hash in the plan), its one
barrier is the start barrier, its outcome lands at the job's root where the
seed's rules expect it (``result.pkl``, ``result-worker-{i}.pkl``), and it has
no idle state: after the cell the host leaves the framework's group and exits.

A session is a group kept up. After the plan check and the start barrier the
host initializes the framework (or leaves that to the first cell that imports
one) and waits for ``cells/{seq}/payload.pkl`` (one object, looked at with a
growing pause, never a listing); its cells' records live in ``cells/{seq}/``
under the cell's own key, and each cell meets the other hosts at the cell's
barrier (``cells/{seq}/ready-{i}``, the leader's verdict in
``cells/{seq}/.leader_ready``). SIGINT raises ``KeyboardInterrupt`` only while
a cell runs, and only when the interrupt names that cell. After a cell the host
goes back to idle, its status naming the cell, how it went and the names the
namespace now holds; a failure (``SystemExit`` and ``KeyboardInterrupt``
included) fails the cell and leaves the namespace as the cell left it.
Whether the session survives a failed cell is its agent's call (every host
back to idle within the grace period).

Either way a cell is the same phases: payload load, barrier, distributed init
(once per group), execute, then the leader's result or a host's failure. Host-safe.
"""

from __future__ import annotations

import builtins
import concurrent.futures
import contextlib
import dataclasses
import io
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from typing import IO, Any, Protocol

from kinetic_nb.errors import (
    ChannelClosed,
    HostStoppedError,
    IntegrityError,
    ObjectNotFoundError,
    ObjectTooLargeError,
    StorageError,
)
from kinetic_nb.runner import envelope, frameworks, job_keys, marks, protocol
from kinetic_nb.runner.barrier import CellMarkers, meet, start_barrier
from kinetic_nb.runner.cell import execute_cell, load_notebook_values
from kinetic_nb.runner.channel import STORED, Channel, Joining, announced_address, host_role
from kinetic_nb.runner.post_mortem import PostMortem
from kinetic_nb.runner.profiling import CellProfiler
from kinetic_nb.runner.protocol import FirstFailure, HostState, JobPlan, LeaderReady, Phase, PostMortemRequest
from kinetic_nb.runner.records import open_record, read_record, write_record
from kinetic_nb.runner.relayed import CARRY_MAX_BYTES, RelayedStorage
from kinetic_nb.runner.wakeup import (
    WOKEN_HOSTS_ENV,
    last_to_end,
    open_wakeup,
    wake,
    wake_clients,
    wakeup_path,
)
from kinetic_nb.storage import Storage

__all__ = ["CellGroup", "cell_key", "held_names"]


class HostRun(Protocol):
    """What a group uses of its host's run (``runner.execute.HostRun``): its records and reports."""

    storage: Storage
    plan: JobPlan
    key: bytes
    host_index: int
    is_leader: bool
    status: Any
    phase: Phase
    filename: str
    failure_line: str
    failure_traceback: str
    failure_locals: list
    failure: BaseException | None
    redactor: Any
    raw_secrets: frozenset
    status_defer_s: float | None

    def begin_cell(self, storage: Storage, key: bytes) -> None: ...

    def enter(self, phase: Phase, state: HostState | None = None) -> None: ...

    def report_success(self, value: Any, namespace: dict[str, Any], out_names: list[str]) -> None: ...

    def report_failure(self, error: BaseException, *, stopped: bool = False) -> None: ...

    def tear_down(self) -> None: ...

#: First and longest pause between two looks for the next cell: short right after a cell (the next
#: one often follows at once), longer when idle, so idle hosts cost storage little.
FIRST_LOOK_S = 0.001
MAX_LOOK_LOCAL_S = 0.02
MAX_LOOK_REMOTE_S = 1.0
#: An idle host's longest pause between two looks for the next cell when its wakeup socket is open.
IDLE_LOOK_LOCAL_S = 1.0
#: An idle host's longest pause on a disk it shares with a notebook that cannot wake it (the host on another
#: machine, on NFS, say): ten looks a second per host keep the disk's server calm and the next cell prompt.
IDLE_LOOK_SHARED_S = 0.1
#: With the channel up, the cell comes through it: only the leader looks at storage, for a cell from a notebook
#: that has no channel: BUSY_LOOK_REMOTE_S after a cell, the pause growing to this when idle.
IDLE_LOOK_CHANNEL_S = 10.0
#: How long the leader, once every host is ready at the start, waits for the hub's word that all joined it (each
#: host joins before it says it is ready; another host's agent joins beside it, and may be slower on a busy node).
ALL_JOINED_WAIT_S = 10.0
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
#: A one-shot job's one cell: the one its plan names.
ONLY_CELL = 1
#: Names a namespace always holds that are no cell's.
_HIDDEN = frozenset({"__builtins__", "__name__"})


def cell_key(key: bytes, seq: int) -> bytes:
    """The key of cell ``seq``'s records: a record of one cell never verifies as another's."""
    return job_keys.derived_key(key, protocol.cell_dir(seq))


def held_names(namespace: dict[str, Any]) -> list[str]:
    return sorted(name for name in namespace if name not in _HIDDEN)


@dataclasses.dataclass(frozen=True)
class CellPlace:
    """Where a cell's payload and outcome live, and the key its records are sealed under."""

    seq: int
    storage: Storage
    key: bytes


class CellGroup:
    """Runs a group's cells on one host, through ``run``'s records and reports: one cell, or a session's."""

    def __init__(self, run: HostRun):
        self.run = run
        self.storage = run.storage
        self.plan = run.plan
        #: A session is a group kept up; a one-shot job's group runs the cell its plan names and ends.
        self.kept = bool(self.plan.session)
        self.namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
        self.initialized = False
        #: A SIGINT arrived outside a cell (the agent interrupts every host at once, and this one had not yet
        #: entered the cell): the cell checks, on entering, whether the interrupt was meant for it.
        self._interrupt_pending = False
        self._max_look = MAX_LOOK_LOCAL_S if self.storage.local_path() else MAX_LOOK_REMOTE_S
        #: Storage did not answer this host's last look for the next cell (said once, until it answers).
        self._storage_failing = False
        self._helper: concurrent.futures.ThreadPoolExecutor | None = None
        #: On a local disk the notebook (and the cell's leader) wake a session's host at once through a socket,
        #: where the hosts run beside the notebook.
        self.wakeup = open_wakeup(self.plan.job_id, run.host_index) \
            if self.kept and self.storage.local_path() and os.environ.get(WOKEN_HOSTS_ENV) else None
        #: A session's channel to its hub (``runner.channel``), once open: cells and records travel through it.
        self.channel: Channel | None = None
        #: Joining the hub, from before this host says it is ready until the leader's verdict.
        self._joining: Joining | None = None
        self._channel_seen = 0
        #: A session host's last failure, kept for ``%kinetic pm`` until its next cell starts.
        self.post_mortem: PostMortem | None = None
        #: The cell whose barrier this host waits at, if it does: an interrupt for it ends the wait.
        self._meeting: int | None = None

    def _sleep(self, seconds: float) -> None:
        if self._meeting is not None and self._interrupt_pending and self.interrupted(self._meeting):
            # Interrupted while it waits for its peers at the cell's barrier (a peer found the interrupt while
            # it loaded the cell, and will never come): it stops too, rather than wait out the barrier.
            self._interrupt_pending = False
            raise KeyboardInterrupt(f"cell {self._meeting} was interrupted before it started on host "
                                    f"{self.run.host_index}")
        if self.wakeup is not None:
            self.wakeup.sleep(seconds)
        elif self._channel_up:
            self._channel_seen = self.channel.mirror.wait(seconds, since=self._channel_seen)
        else:
            time.sleep(seconds)

    @property
    def _channel_up(self) -> bool:
        return self.channel is not None and self.channel.broken is None

    def _join_channel(self) -> None:
        """Start joining the session's hub, when this host was told where it is and its storage can go behind it,
        and keep trying until the leader's start verdict (on Ray the hub may not listen yet). A host that cannot
        join goes on through storage, and so does every host: the channel is used only when the leader's start
        verdict says every host joined it."""
        address = announced_address()
        if address is None or not isinstance(self.storage, RelayedStorage):
            return
        self._joining = Joining(address, self.run.key, host_role(self.run.host_index),
                                on_broken=self.storage.relay.fall_back)

    def _all_joined(self) -> bool:
        """The leader, as it says go: whether the hub has said that every host joined."""
        if self._joining is None:
            return False
        deadline = time.monotonic() + ALL_JOINED_WAIT_S
        channel = self._joining.wait(ALL_JOINED_WAIT_S)
        return channel is not None and channel.complete.wait(max(0.0, deadline - time.monotonic()))

    def _use_channel(self, verdict: LeaderReady) -> None:
        """From here on, this host's records go through the channel, when the verdict says every host's do; the
        leader passes the verdict on through it, so that its agent and the notebooks know it too."""
        if self._joining is None:
            return
        joining, self._joining = self._joining, None
        if not verdict.channel:  # a host did not join: this one, maybe (a try under way is not waited for)
            joining.abandon("the session's hosts did not all join the channel")
            if joining.channel is None:
                print(f"kinetic host {self.run.host_index}: no channel to the session's hub "
                      f"({joining.error or 'no answer yet'}); "
                      "the session's cells travel through storage", file=sys.stderr, flush=True)
            return
        self.channel = joining.settle()  # joined (the hub counted it): at most its first records away
        if self.channel is None:  # joined and lost at once: its leaving sends every host back to storage
            return
        self.storage.relay.attach(self.channel.send, self.channel.mirror)
        if self.run.is_leader:
            with contextlib.suppress(ChannelClosed):
                self.channel.send(protocol.LEADER_READY, envelope.seal(self.run.key, protocol.LEADER_READY,
                                                                       verdict.to_json()))

    def serve(self) -> int:
        """Run the group's cells; return the host's exit code."""
        if not self.kept:
            return self._serve_once()
        run = self.run
        try:
            self._join_channel()  # before this host says it is ready: the leader's verdict says if all joined
            run.enter(Phase.START_BARRIER, HostState.READY)
            verdict = start_barrier(self.storage, self.plan, run.key, run.host_index, channel=self._all_joined)
            self._use_channel(verdict)
            if self.plan.framework not in ("auto", "none"):  # "auto": the first cell that imports one says which
                self._initialize(self.plan.framework)
        except BaseException as error:  # noqa: BLE001 - the session never came up
            return self._exit_code(self._report(error, stopped=isinstance(error, HostStoppedError)))
        run.status.update(state=HostState.IDLE, cell=0, names=held_names(self.namespace))
        run.status_defer_s = STATUS_DEFER_S  # a quick cell's status is written once, when it is done
        signal.signal(signal.SIGINT, self._note_interrupt)  # an interrupt reaches a cell, never the loop
        seq = 1
        try:
            while (payload := self._wait_for(seq)) is not None:
                with payload:
                    self._run_cell(CellPlace(seq, self.storage.child(protocol.cell_dir(seq)), cell_key(run.key, seq)),
                                   payload)
                seq += 1
        finally:
            if self.wakeup is not None:
                self.wakeup.close()
            if self.channel is not None:
                self.channel.close("the host is done")
        return protocol.EXIT_OK

    def _serve_once(self) -> int:
        """A one-shot job: its one cell, at the job's root under the job's key; then the host ends."""
        run = self.run
        error = self._run_cell(CellPlace(ONLY_CELL, self.storage, run.key))
        if error is not None:
            return self._exit_code(error)
        run.status.update(state=HostState.SUCCEEDED, phase=Phase.TEARDOWN)
        run.tear_down()
        return protocol.EXIT_OK

    def _wait_for(self, seq: int) -> IO[bytes] | None:
        """Wait for cell ``seq``'s payload; the payload, open (a look is an attempt to open it: on a bucket,
        the request that finds it is the first of its read); None once the session is stopped.

        Right after a cell the next one often follows at once (a loop, a
        script): where no socket wakes the host, the first second looks every
        few milliseconds, then less often.
        """
        payload = f"{protocol.cell_dir(seq)}/{protocol.PAYLOAD}"
        if self._channel_up:
            found = self._wait_on_channel(payload)
            if found is not False:
                return found
        # On a local disk beside the notebook, the notebook wakes this host through its socket when it submits a
        # cell (and the agent stops it with a signal), busy or idle: a slow look is only a safety net for a wakeup
        # that went missing, and looking every few milliseconds after a cell would only take the CPU the others need.
        woken = self.wakeup is not None
        idle_look = IDLE_LOOK_LOCAL_S if woken else IDLE_LOOK_SHARED_S if self.storage.local_path() else self._max_look
        pause, busy_until = (idle_look, 0.0) if woken else (FIRST_LOOK_S, time.monotonic() + BUSY_S)
        # On a bucket each look is a request: a busy look every few milliseconds would be hundreds per cell.
        busy_look = BUSY_LOOK_S if self.storage.local_path() else BUSY_LOOK_REMOTE_S
        next_cancel_look = 0.0
        while True:
            with self._storage_may_fail():
                with contextlib.suppress(ObjectNotFoundError):
                    return self.storage.open_read(payload)
                now = time.monotonic()
                if woken or now >= next_cancel_look:  # on a bucket each look is a request
                    self._answer_post_mortem()
                if now >= next_cancel_look:  # the agent also stops its hosts itself: a slower look will do
                    if self.storage.exists(protocol.CANCEL):
                        return None
                    next_cancel_look = now + CANCEL_LOOK_S
            self._sleep(pause)
            cap = busy_look if time.monotonic() < busy_until else idle_look
            pause = min(pause * 1.5, cap)

    def _wait_on_channel(self, payload: str) -> IO[bytes] | bool | None:
        """Wait for the payload through the channel: the payload, open; None once the session is stopped (its
        agent stops the hosts with a signal too); False when the channel broke meanwhile (storage then).

        Only the leader looks at storage, seldom when idle, for a cell from a notebook with no channel, and
        passes it on through the channel to the others.
        """
        pause = BUSY_LOOK_REMOTE_S
        next_look = time.monotonic() + pause
        while self._channel_up:
            with self._storage_may_fail():
                with contextlib.suppress(ObjectNotFoundError):
                    return self.storage.open_read(payload)
                self._answer_post_mortem()
            now = time.monotonic()
            if self.run.is_leader and now >= next_look:
                with self._storage_may_fail():
                    try:
                        return self._share(payload)
                    except ObjectNotFoundError:
                        pass
                pause = min(pause * 1.5, IDLE_LOOK_CHANNEL_S)
                next_look = now + pause
            self._sleep(max(0.0, next_look - time.monotonic()) if self.run.is_leader else IDLE_LOOK_CHANNEL_S)
        return False

    @contextlib.contextmanager
    def _storage_may_fail(self) -> Iterator[None]:
        """A look for the next cell that storage could not answer is a look that found nothing: an idle host
        waits on (its agent ends the session at its idle timeout, or when told); said once per outage."""
        try:
            yield
        except StorageError as error:
            if not self._storage_failing:
                print(f"kinetic host {self.run.host_index}: storage does not answer ({error}); waiting for the "
                      "next cell", file=sys.stderr, flush=True)
            self._storage_failing = True
        else:
            self._storage_failing = False

    def _share(self, name: str) -> IO[bytes]:
        """A cell found in storage, passed on to the other hosts through the channel (or the news that it is
        there, when it is too large to carry); the payload, open. One larger than the channel carries is never
        read whole: it is streamed from storage as it is verified, as every host reads it."""
        plain = self.storage.plain
        try:
            data: bytes | None = plain.read_bounded(name, CARRY_MAX_BYTES)
        except ObjectTooLargeError:
            data = None
        with contextlib.suppress(Exception):
            self.channel.send(name, data if data is not None else STORED)
        return io.BytesIO(data) if data is not None else plain.open_read(name)

    def _report(self, error: BaseException, *, stopped: bool) -> BaseException:
        self.run.report_failure(error, stopped=stopped)
        return error

    @staticmethod
    def _exit_code(error: BaseException) -> int:
        return protocol.EXIT_STOPPED if isinstance(error, HostStoppedError) else protocol.EXIT_FAILED

    def _initialize(self, framework: str) -> None:
        self.run.enter(Phase.DISTRIBUTED_INIT, HostState.RUNNING)
        plan = self.plan if framework == self.plan.framework else dataclasses.replace(self.plan, framework=framework)
        frameworks.initialize(plan, self.run.host_index)
        self.initialized = True

    def _meet(self, place: CellPlace) -> None:
        """The cell's barrier: a one-shot job's is its start barrier; a session's cells meet on markers."""
        if self.kept:
            self.cell_barrier(place.storage)
        else:
            start_barrier(self.storage, self.plan, self.run.key, self.run.host_index)

    def _run_cell(self, place: CellPlace, payload: IO[bytes] | None = None) -> BaseException | None:
        """Run one cell (its payload open already, or read from ``place``); return its failure on this host
        (reported already), or None."""
        run, seq = self.run, place.seq
        self.post_mortem = None  # the last failure's frames, and what they hold, are let go before a cell runs
        run.begin_cell(place.storage, place.key)
        if self._channel_up:  # the barrier markers of cells before the last are nobody's to store any more
            self.storage.relay.let_go(lambda name: (protocol.cell_marker_seq(name) or seq) >= seq - 1)
        if self.kept:
            marks.cell_started(seq)  # the agent: logs from here are the cell's (taken by the time it runs)
            # The last cell's memory figures go too: a host that dies in this cell has none of this cell's.
            run.status.update(state=HostState.RUNNING, phase=Phase.PAYLOAD_LOAD, cell=seq, cell_failed=False,
                              profiled=[], memory={}, record=False, defer_s=STATUS_DEFER_S)
        else:
            run.enter(Phase.PAYLOAD_LOAD)
        failure: BaseException | None = None
        stopped = False  # the cell was stopped as asked (an interrupt, its timeout), not failed
        profiler: CellProfiler | None = None
        try:
            # Interrupted while it waited behind another cell, it never runs: asked while the payload loads (on a
            # bucket each is a round trip).
            withdrawn = self._asking(self._withdrawn, seq) if self.kept else None
            # Verified, then unpickled.
            cell = envelope.load_sealed(place.storage, protocol.PAYLOAD, place.key) if payload is None else \
                envelope.load_sealed_file(payload, protocol.PAYLOAD, place.key,
                                          where=f"{place.storage.uri}/{protocol.PAYLOAD}")
            if withdrawn is not None and withdrawn.result():
                raise KeyboardInterrupt(f"cell {seq} was withdrawn before it started")
            run.filename = cell[protocol.CELL_FILENAME]
            values = load_notebook_values(cell, run.host_index)
            run.enter(Phase.START_BARRIER, HostState.READY)
            self._meeting = seq if self.kept else None
            try:
                self._meet(place)
            finally:
                self._meeting = None
            passed_barrier_at = time.time()
            # A name the hosts hold is theirs: a notebook that did not know yet (another kernel's cell bound
            # it a moment ago) ships its own, which fills only names this namespace lacks.
            self.namespace.update({name: value for name, value in values.items() if name not in self.namespace})
            framework = cell.get(protocol.CELL_FRAMEWORK, self.plan.framework)
            if not self.initialized and framework not in ("auto", "none"):
                self._initialize(framework)
            run.enter(Phase.EXECUTE, HostState.RUNNING)
            if cell.get(protocol.CELL_PROFILE):  # in the execute phase: starting a profiler is no barrier's wait
                profiler = CellProfiler(framework, seq, run.host_index, passed_barrier_at)
                profiler.start()
            if self.kept:
                marks.taken()  # the cell's start is the agent's before anything the cell prints
            try:
                with self._interruptible(seq), profiler.span() if profiler else contextlib.nullcontext():
                    self._stop_if_interrupted_early(seq)
                    value = execute_cell(cell[protocol.CELL_SOURCE], run.filename, self.namespace,
                                         host_index=run.host_index, leader=run.is_leader)
            finally:
                if profiler is not None:  # stored before the cell's outcome: the notebook reads both once it has that
                    self._store_profile(place, profiler)
            sys.stdout.flush()
            sys.stderr.flush()
            if run.is_leader:  # a worker's value is never pickled: only the leader owns the cell's value
                run.report_success(value, self.namespace, cell[protocol.CELL_OUT_NAMES])
        except BaseException as error:  # noqa: BLE001 - SystemExit and KeyboardInterrupt fail the cell too
            # An interrupt the notebook (or the agent, at the cell's timeout) asked for stops the cell: asked
            # for, it is no failure, and no host is shown failed for it.
            stopped = isinstance(error, HostStoppedError) or (
                self.kept and isinstance(error, KeyboardInterrupt) and self.interrupted(seq))
            failure = self._report(error, stopped=stopped)
            if self.kept:  # its peers may be at the cell's barrier, waiting for what this host now failed to do
                self._wake_peers()
            if self.kept and not stopped:
                self._tell_the_agent(seq, error)
        if not self.kept:
            return failure
        if run.failure is not None and run.failure_locals:  # it failed in the cell: its frames stay for questions
            self.post_mortem = PostMortem(seq, run.failure, run.filename, run.redactor, run.raw_secrets)
        marks.cell_ended(seq)  # the agent stores the cell's output now (what was printed before included)
        # Back to idle in the phase the cell ended in (nothing is torn down), with its failure as it was shown.
        failed = failure is not None
        # The cell's end by its own name, at once (through the channel status.json is stored at most once a second,
        # and the names the leader holds after a cell are read from it: ``Session.held_names``), and before
        # status.json: a notebook that sees this host idle sees its end of the cell in the same look. After a quick
        # cell that succeeded on a local disk (status.json still says idle: nothing of the cell was written), it
        # follows a moment later, with the next cell's start if that comes first: a cell's readers read its end by
        # name, and rewriting a file by rename makes the disk write it out (ext4 does, to keep a replaced file
        # whole). A failure's status, or one that says the cell runs, is written at once.
        later = self.wakeup is not None and not failed and run.status.stored_state() == HostState.IDLE.value
        run.status.update(state=HostState.IDLE, cell=seq, cell_failed=failed, cell_stopped=failed and stopped,
                          names=held_names(self.namespace),
                          message=run.failure_line if failed else "",
                          traceback=run.failure_traceback if failed else "",
                          frame_locals=run.failure_locals if failed else [],
                          record=not later, defer_s=STATUS_DEFER_S if later else None,
                          first=lambda data: write_record(self.storage, run.key, protocol.cell_done(seq, run.host_index),
                                                          data))
        # The notebooks waiting on this cell look now: once every host has stored its end, or at a failure.
        if self.wakeup is not None and (failed or last_to_end(place.storage.local_path(protocol.CELL_ENDS),
                                                              self.plan.world_size)):
            wake_clients(self.plan.job_id)
        return failure

    def _store_profile(self, place: CellPlace, profiler: CellProfiler) -> None:
        """Stop the profiler and store this host's record in the cell's folder (storage's own way, never the
        channel: a trace is large); its span goes in the status, for the panel's timeline."""
        data = profiler.record()
        storage = place.storage.plain if isinstance(place.storage, RelayedStorage) else place.storage
        try:
            envelope.write_sealed(storage, protocol.host_profile(self.run.host_index), place.key, data)
        except Exception as error:  # noqa: BLE001 - the cell's outcome matters more than its profile
            print(f"kinetic host {self.run.host_index}: its profile could not be stored: {error}", file=sys.stderr)
        self.run.status.update(profiled=[profiler.marker_at or profiler.barrier_at, profiler.ended_at or time.time()],
                               record=False)

    def _answer_post_mortem(self) -> None:
        """Answer the notebook's next question about this host's last failure, if it asked one (``%kinetic pm``):
        a look at one name, and only while a failure is kept."""
        kept = self.post_mortem
        if kept is None:
            return
        rank = self.run.host_index
        try:
            request = PostMortemRequest.from_json(
                read_record(self.storage, self.run.key, protocol.post_mortem_request(kept.seq, rank, kept.next)))
        except ObjectNotFoundError:
            return
        except (IntegrityError, ValueError, KeyError, TypeError):  # not the notebook's: skipped, never evaluated
            kept.next += 1
            return
        answer = kept.answer(request)
        with contextlib.suppress(Exception):
            write_record(self.storage, self.run.key, protocol.post_mortem_answer(kept.seq, rank, kept.next),
                         json.dumps(answer).encode())
        kept.next += 1
        if self.wakeup is not None:
            wake_clients(self.plan.job_id)

    def _asking(self, question: Callable[[int], bool], seq: int) -> concurrent.futures.Future[bool]:
        """``question(seq)``, asked beside what the caller does next on a bucket; at once on a local disk."""
        if self.storage.local_path() is not None or self._channel_up:  # a stat, or what the channel carried
            answer: concurrent.futures.Future[bool] = concurrent.futures.Future()
            answer.set_result(question(seq))
            return answer
        if self._helper is None:
            self._helper = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kinetic-ask")
        return self._helper.submit(question, seq)

    def _withdrawn(self, seq: int) -> bool:
        """Whether cell ``seq`` was interrupted before it started: with the channel up, as the channel carried
        it (an interrupt from a notebook with no channel still reaches the host as its agent's signal)."""
        if self._channel_up:
            return self._carried_interrupt(seq)
        return self.interrupted(seq)

    def _carried_interrupt(self, seq: int) -> bool:
        name = protocol.cell_control(seq, "interrupt")
        data = self.channel.mirror.get(name)
        if not isinstance(data, bytes):
            return False
        try:
            open_record(self.run.key, name, data, where=f"the channel's {name}")
        except IntegrityError:
            return False
        return True

    @property
    def _plain_storage(self) -> Storage:
        return self.storage.plain if isinstance(self.storage, RelayedStorage) else self.storage

    def _note_interrupt(self, signum: int, frame: Any) -> None:
        self._interrupt_pending = True
        if self.wakeup is not None:  # a host asleep at a cell's barrier looks at once
            wake(self.wakeup.path)

    def interrupted(self, seq: int) -> bool:
        """Whether the notebook (or the agent, at the cell's timeout) asked to interrupt cell ``seq``: a record
        verified under the session's key, so that nobody else can stop a cell."""
        if self._channel_up and self._carried_interrupt(seq):
            return True
        name = protocol.cell_control(seq, "interrupt")
        try:
            read_record(self._plain_storage, self.run.key, name)
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

        if not self.kept:  # a one-shot job's host is interrupted as any process is
            yield
            return
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

        # Woken through its socket by whatever it waits for (a worker's ready, the leader's verdict, a peer's failure,
        # an interrupt), a host looks again only as a safety net: a look every few milliseconds while its peers get
        # ready would cost each host more the more hosts there are.
        pauses = {"first_pause": IDLE_LOOK_LOCAL_S, "max_pause": IDLE_LOOK_LOCAL_S} if self.wakeup is not None \
            else {"max_pause": self._max_look}
        meet(cell_storage, run.outcome_key, leader=run.is_leader, hosts=self.plan.world_size,
             timeout=min(self.plan.barrier_timeout_s, CELL_BARRIER_TIMEOUT_S),
             sighting=CellMarkers(cell_storage, self.plan.world_size), what="cell barrier", sleep=self._sleep,
             on_verdict=self._wake_peers, **pauses)

    def _wake_peers(self) -> None:
        """Wake the other hosts at the cell's barrier: the leader's verdict, or a host's failure, is there to read."""
        if self.wakeup is None:
            return
        if self.run.is_leader:
            for index in range(1, self.plan.world_size):
                wake(wakeup_path(self.plan.job_id, index))
        else:
            wake(wakeup_path(self.plan.job_id, protocol.LEADER_INDEX))

    def _tell_the_agent(self, seq: int, error: BaseException) -> None:
        """The first failure of a cell: the agent then checks that every host comes back to idle."""
        record = FirstFailure(host_index=self.run.host_index, at=time.time(),
                              description=f"{type(error).__name__} in cell {seq}")
        with contextlib.suppress(Exception):  # the agent also sees the host's status
            write_record(self.storage, self.run.key, protocol.cell_control(seq, "failed"), record.to_json(),
                         exclusive=True)
