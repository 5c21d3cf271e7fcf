"""The host agent's loop: run hosts, record them, and bound the job with no client.

One agent owns one or more hosts of a job (all of them locally, its own on a
pod). It

- forks each host from this lean process, in its own process group, tied to
  the agent's life;
- pumps each host's stdout and stderr into ``hosts/{i}/log/`` chunks, each
  stream kept as itself and only ever as text; the host's rich outputs and
  its cells' boundaries come on a third pipe, its marks pipe
  (``runner.marks``), each in its place among the lines;
- records how each host ended in ``hosts/{i}/exit.json`` (code or signal, the
  last stderr lines, a storage error named as such);
- learns of any host's failure from ``control/failed.json`` (written once, by
  the first agent to see one), then gives its own hosts ``grace_s`` to report
  before stopping them (SIGTERM, then SIGKILL: JAX traps SIGTERM);
- stops its hosts when ``control/cancel.json`` appears, and writes it itself
  (reason ``timeout``) once the plan's timeout has passed;
- answers ``control/stacks-{seq}.json`` with each live host's stacks (a stopped
  process's record says it is stopped);
- beats each host's ``hosts/{i}/heartbeat`` while its process exists, whatever
  its interpreter does (``agent.liveness``);
- publishes ``KINETIC_OUTPUT_DIR`` to ``outputs/`` when its last host ends;
- keeps its hosts' files in a scratch folder held while it or a host lives, and removes the scratch folders
  of agents killed before their end (``agent.scratch``).

The agent's look at ``control/`` is one listing, whatever the number of hosts.
Its part in a session's channel is ``agent.hub_role``; how it stores and
verifies its records, and says its storage errors, ``agent.record_keeping``.
Host-safe: the standard library, the runner and storage only.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import functools
import logging
import os
import selectors
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable

from kinetic_nb.agent import processes
from kinetic_nb.agent.cells import CellWatch
from kinetic_nb.agent.hub_role import HubRole
from kinetic_nb.agent.liveness import Liveness, not_running
from kinetic_nb.agent.record_keeping import RecordKeeping
from kinetic_nb.agent.scratch import Scratch, sweep_in_background
from kinetic_nb.runner import marks, protocol
from kinetic_nb.runner.channel import CHANNEL_ENV, Hub
from kinetic_nb.runner.envelope import read_limited
from kinetic_nb.runner.execute import run_host  # imported once here, not in every forked host
from kinetic_nb.runner.logs import LogChunkWriter
from kinetic_nb.runner.protocol import CancelRequest, ExitSummary, FirstFailure, HostState, JobPlan
from kinetic_nb.runner.records import read_record
from kinetic_nb.runner.redact import Redactor
from kinetic_nb.runner.relayed import Relay
from kinetic_nb.runner.stacks import STACKS_FILE_ENV, STACKS_SIGNAL
from kinetic_nb.runner.wakeup import Wakeup, agent_wakeup_path, remove_session_sockets, wake_clients, wakeup_path
from kinetic_nb.runner.workdir import SCRATCH_DIR_ENV
from kinetic_nb.storage import LocalStorage, Storage, patiently

logger = logging.getLogger(__name__)

#: Between SIGTERM and SIGKILL when stopping a host: time to flush and exit
#: for a host that honours SIGTERM (JAX traps it, so its hosts need the SIGKILL).
TERM_TO_KILL_S = 0.5
#: How often the agent looks at ``control/`` on a local disk (a cancel lands within this).
CONTROL_POLL_LOCAL_S = 0.25
#: The same on remote storage, where each look is a request and 256 agents may be looking.
CONTROL_POLL_REMOTE_S = 1.0
#: With the session's hub here, a notebook's control records arrive through it: storage is listed this often
#: (for a notebook with no channel), every CONTROL_POLL_REMOTE_S while a cell runs.
CONTROL_POLL_IDLE_CHANNEL_S = 10.0
#: Another host's agent with the channel up: storage listed only as a safety net (the leader's agent passes on
#: what it finds there).
CONTROL_POLL_THROUGH_HUB_S = 60.0
#: How long to keep reading a finished host's pipes for its last output.
DRAIN_S = 0.5
#: The selector's mark for the agent's own wakeup socket (a host's pipes are marked by its index).
_WOKEN = object()
#: The most one read of a host's pipe takes (a pipe holds 64 KiB by default).
READ_BYTES = 1 << 16
#: The stream name, among a host's pipes, of its marks pipe (display records and cell boundaries).
MARKS = "marks"
#: How long a host has to answer a stacks request before it is reported as not answering.
STACKS_WAIT_S = 1.5
#: A dump is complete once its file has not grown for this long.
STACKS_SETTLED_S = 0.05
#: stderr lines kept per host for its exit record.
STDERR_TAIL_LINES = 20
#: Loop timeout: how late, at worst, a due action (grace, timeout) is taken.
TICK_S = 0.1
#: What hosts create (outputs, checkpoints, scratch files) is this user's only, whatever the kernel's umask.
HOST_UMASK = 0o077
#: How long an ending agent waits for its sweep of killed agents' scratch folders to finish.
SWEEP_WAIT_S = 5.0


@dataclasses.dataclass
class _Host:
    index: int
    pid: int
    pipes: dict[int, str]  # fd -> stream (stdout, stderr, or MARKS)
    log: LogChunkWriter
    stacks_path: str
    #: Frames read off the host's marks pipe, a partial one waiting for its rest.
    frames: marks.MarkReader = dataclasses.field(default_factory=marks.MarkReader)
    #: Readable when the process ends (Linux 5.3+), so its end wakes the loop at once.
    pidfd: int | None = None
    stop_sent_at: float | None = None
    killed: bool = False
    wait_status: int | None = None
    stderr_tail: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=STDERR_TAIL_LINES))
    stderr_partial: str = ""

    @property
    def alive(self) -> bool:
        return self.wait_status is None

    def add_stderr(self, text: str) -> None:
        lines = (self.stderr_partial + text).split("\n")
        self.stderr_partial = lines.pop()[-1000:]
        self.stderr_tail.extend(line[-1000:] for line in lines if line.strip())

    def stderr_lines(self) -> tuple[str, ...]:
        tail = [*self.stderr_tail, self.stderr_partial] if self.stderr_partial.strip() else list(self.stderr_tail)
        return tuple(tail[-STDERR_TAIL_LINES:])


class Agent(HubRole, RecordKeeping):
    """Supervises the processes ``indices`` (their ranks: every process of a local job, its host's on a pod or a
    Ray node) of the job ``plan`` stored in ``storage``; each is a "host" to the records, keyed by its rank.

    ``key`` (the job's key, bound to it) seals every record the agent writes and
    verifies every control record before the agent acts on it; the hosts it
    forks inherit it in memory, never through their environment.
    ``environment(index, output_dir)`` gives a host's environment;
    ``on_storage_error(text)`` hears the first storage error (the local
    backend keeps it beside the job, where a client finds it even when the
    job's own storage cannot be written).
    """

    def __init__(self, storage: Storage, plan: JobPlan, indices: list[int],
                 environment: Callable[[int, str], dict[str, str]], *, key: bytes,
                 on_storage_error: Callable[[str], None] | None = None, redactor: Redactor | None = None):
        self.pid = os.getpid()
        self.storage = storage
        self.key = key
        self.plan = plan
        self.indices = indices
        self.environment = environment
        self.on_storage_error = on_storage_error
        #: The job's key and ``-e`` values never reach the logs, nor the exit records' stderr lines.
        self.redactor = redactor or Redactor(())
        self.hosts: dict[int, _Host] = {}
        self.selector = selectors.DefaultSelector()
        self.first_failure_at: float | None = None
        self.cancelled = False
        #: Why this agent stopped its hosts, as their rows say it (``stop_all``'s first reason).
        self.stop_reason = ""
        self.storage_error = ""
        self._next_storage_error_line = 0.0
        self._unsaid_storage_errors = 0
        self._storage_error_lock = threading.Lock()
        self.scratch_outputs: str | None = None
        self._scratch = Scratch(plan.job_id)  # held while this agent or a host of it lives
        self._sweep: threading.Thread | None = None
        self.scratch = self._scratch.path
        self._answered_stacks = -1
        #: A session's cells: every host back to idle after a failed or interrupted cell; the idle timeout.
        self.cells = CellWatch(self) if plan.session else None
        self._next_control_look = 0.0
        self._wakeup: Wakeup | None = None
        self._control_poll_s = CONTROL_POLL_LOCAL_S if storage.local_path() else CONTROL_POLL_REMOTE_S
        #: A session's hub (``runner.channel``), when this agent runs every host of a session on a bucket.
        self.hub: Hub | None = None
        #: The leader's hub, which this agent (another host's) joins once its host is forked.
        self._hub_address: tuple[str, int] | None = None
        self._relay: Relay | None = None
        self._listed_control: set[str] = set()
        self._passed_on: set[str] = set()
        self._handled_control: frozenset[str] = frozenset()
        #: Each host's heartbeat, beaten from a thread of this agent's once every host is forked.
        self.liveness = Liveness(lambda name: self.storage.write_bytes(name, b""), read_state=self._recorded_state,
                                 remote=storage.local_path() is None)
        started = plan.created_at or time.time()
        self._deadline = started + plan.timeout_s if plan.timeout_s else None

    # -- starting -------------------------------------------------------------------

    def start_hosts(self) -> None:
        # Hosts write their files to a local directory: the job's own outputs/
        # on file://, made 0700 through the storage and named by a path no other
        # user can redirect; else a folder of this agent's 0700 scratch, published to outputs/ at the end.
        if isinstance(self.storage, LocalStorage):
            self.storage.make_directory(protocol.OUTPUTS_DIR)
            output_dir = self.storage.local_path(protocol.OUTPUTS_DIR)
        else:
            output_dir = self.scratch_outputs = tempfile.mkdtemp(prefix="outputs-", dir=self.scratch)
        sys.stdout.flush()
        sys.stderr.flush()
        # The hosts start together, once every one is forked: a host that ran at once would take the CPU the
        # agent needs to fork the rest (a thousand light hosts on a bucket, each looking for the leader's
        # verdict, left the agent a thousandth of two cores: 1.5 forks a second), and the hub accepts no one
        # until the last fork. Each host waits for the end of this pipe, which comes when the agent closes it.
        gate_read, gate_write = os.pipe()
        for index in self.indices:
            stacks_path = os.path.join(self.scratch, f"stacks-{index}.txt")
            env = {**self.environment(index, output_dir), STACKS_FILE_ENV: stacks_path,
                   SCRATCH_DIR_ENV: self.scratch}  # the shipped folder's copy: removed with the scratch, at the end
            if self.hub is not None:
                env[CHANNEL_ENV] = self.hub.announced
            # os.pipe()'s descriptors are close-on-exec: the host's marks pipe never reaches a program it starts.
            out_read, out_write = os.pipe()
            err_read, err_write = os.pipe()
            marks_read, marks_write = os.pipe()
            pid = os.fork()
            if pid == 0:  # the host
                self._become_host(env, out_write, err_write, marks_write,
                                  (out_read, err_read, marks_read, gate_write), gate_read)
            for fd in (out_write, err_write, marks_write):
                os.close(fd)
            pipes = {out_read: protocol.STDOUT, err_read: protocol.STDERR, marks_read: MARKS}
            # A cell waits for its leader's last chunk: a notebook on this machine is woken when it is stored.
            on_cell_end = (functools.partial(wake_clients, self.plan.job_id)
                           if self.plan.session and index == protocol.LEADER_INDEX and self.storage.local_path()
                           else None)
            log = LogChunkWriter(self.storage, index, self.key, on_error=self._storage_failed, redactor=self.redactor,
                                 on_cell_end=on_cell_end)
            host = self.hosts[index] = _Host(index, pid, pipes, log, stacks_path)
            for fd in pipes:
                os.set_blocking(fd, False)
                self.selector.register(fd, selectors.EVENT_READ, index)
            try:
                host.pidfd = os.pidfd_open(pid)
                self.selector.register(host.pidfd, selectors.EVENT_READ, index)
            except (AttributeError, OSError):
                pass  # no pidfds here: the loop's timeout bounds how late an end is seen
            self.liveness.add(index, session=self.plan.session)
        os.close(gate_read)
        self.liveness.start()  # a thread: only once every host is forked
        self._sweep = sweep_in_background()  # what agents killed before their end left behind them
        if self.hub is not None:
            self._start_hub()
        elif self._hub_address is not None:
            self._start_joining(self._hub_address)
        os.close(gate_write)  # the hosts go

    def _become_host(self, env: dict[str, str], out_write: int, err_write: int, marks_write: int,
                     agent_ends: tuple[int, ...], gate: int) -> None:
        code = protocol.EXIT_FAILED
        try:
            for fd in agent_ends:
                os.close(fd)
            os.setpgid(0, 0)
            os.umask(HOST_UMASK)
            if self.hub is not None:  # the hub's socket is the agent's
                self.hub.close()
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the agent's own handler is not the host's
            processes.die_with_parent(self.pid)
            for other in self.hosts.values():
                for fd in other.pipes:
                    os.close(fd)
                if other.pidfd is not None:
                    os.close(other.pidfd)
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)
            os.dup2(out_write, 1)
            os.dup2(err_write, 2)
            for fd in (out_write, err_write, devnull):
                os.close(fd)
            marks.attach(marks_write)  # the runner's display records and cell boundaries, out of band
            os.environ.clear()
            os.environ.update(env)
            sys.argv = ["python -m kinetic_nb.runner", "--job", self.storage.uri]
            while os.read(gate, 1):  # until every host is forked (the agent closes the pipe; or it died)
                pass
            os.close(gate)
            code = run_host(self.storage.uri, self.key)
        except BaseException:  # noqa: BLE001
            traceback.print_exc()
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:  # noqa: BLE001, S110 - a closed stream must not keep the host from exiting
                    pass
            os._exit(code)

    # -- the loop ---------------------------------------------------------------------

    def _open_wakeup(self) -> None:
        """A local job's or session's agent listens on a socket too: a cancel or an interrupt stored by the
        notebook is acted on at once, not at the next look at storage (a quarter of a second later)."""
        if self.storage.local_path() is None:
            return
        with contextlib.suppress(OSError):
            self._wakeup = Wakeup(agent_wakeup_path(self.plan.job_id))
            self.selector.register(self._wakeup, selectors.EVENT_READ, _WOKEN)

    def run(self) -> None:
        self._open_wakeup()
        try:
            while any(host.alive for host in self.hosts.values()):
                self._pump(TICK_S)
                self._reap()
                self._look_at_control()
                self._enforce_timeout()
                self._stop_survivors_if_due()
        finally:
            self.liveness.stop()
            if self.hub is not None:
                self.hub.close()
            if self._relay is not None:
                self._relay.close()  # what waits to be stored is stored before the agent ends
            self.selector.close()
            if self._wakeup is not None:
                self._wakeup.close()
                with contextlib.suppress(OSError):  # its directory, unless a host's or a notebook's socket is there
                    os.rmdir(os.path.dirname(self._wakeup.path))
            processes.end_adopted_orphans()
            self._scratch.remove()
            if self._sweep is not None:  # a quick job's sweep is not cut short (a daemon thread would be)
                self._sweep.join(SWEEP_WAIT_S)

    def _pump(self, timeout: float) -> None:
        for key, _ in self.selector.select(timeout):
            if key.data is _WOKEN:
                self._wakeup.take()
                self._next_control_look = 0.0  # a notebook stored a control record: look now
                continue
            host = self.hosts[key.data]
            if key.fd in host.pipes:
                self._read(host, key.fd)
        for host in self.hosts.values():
            if host.log.due():
                host.log.flush()

    def _read(self, host: _Host, fd: int) -> bool:
        """Read what one of the host's pipes holds; False once it is closed.

        Before its marks pipe is read, whatever its stdout and stderr pipes
        hold is: the host wrote that before the frame (it flushes first, and
        waits for the frame to be taken before it goes on), so it lands first.
        """
        if fd not in host.pipes:
            return False  # closed meanwhile (its end was read while the marks pipe was)
        if host.pipes[fd] == MARKS:
            for stream_fd in [other for other, stream in host.pipes.items() if stream != MARKS]:
                while self._read_some(host, stream_fd) > 0:
                    pass
        return self._read_some(host, fd) >= 0

    def _read_some(self, host: _Host, fd: int) -> int:
        """One read of one of the host's pipes, fed where it goes: how many bytes (0: none now, -1: closed)."""
        try:
            data = os.read(fd, READ_BYTES)
        except BlockingIOError:
            return 0
        except OSError as error:
            if error.errno != errno.EIO:
                raise
            data = b""
        stream = host.pipes[fd]
        if data:
            if stream == MARKS:
                self._apply_marks(host, data)
            else:
                host.log.feed(data, stream)
                if stream == protocol.STDERR:
                    host.add_stderr(data.decode(errors="replace"))
            return len(data)
        if stream == MARKS and host.frames.pending:
            host.frames.problems.append(f"an unfinished frame of {host.frames.pending} bytes")
            self._apply_marks(host, b"")
        self.selector.unregister(fd)
        os.close(fd)
        del host.pipes[fd]
        return -1

    def _apply_marks(self, host: _Host, data: bytes) -> None:
        """The frames ``data`` completes, applied to the host's log in order; a dropped one is said in the log."""
        for mark in host.frames.feed(data):
            if mark.kind == marks.DISPLAY:
                host.log.add_display(mark.body)
            elif mark.kind == marks.CELL_START:
                host.log.start_cell(mark.body)
                self.liveness.cell_started(host.index)
            elif mark.kind == marks.FRAMEWORK:
                host.log.start_framework_teardown()
            else:
                host.log.end_cell(mark.body)
                self.liveness.cell_ended(host.index)
        for problem in host.frames.problems:
            line = f"kinetic agent: dropped {problem} from host {host.index}'s marks pipe\n"
            host.log.feed(line.encode(), protocol.STDERR)
        host.frames.problems.clear()

    def _reap(self) -> None:
        for host in self.hosts.values():
            if not host.alive:
                continue
            pid, wait_status = os.waitpid(host.pid, os.WNOHANG)
            if pid == 0:
                continue
            host.wait_status = wait_status
            self.liveness.forget(host.index)
            if host.pidfd is not None:
                self.selector.unregister(host.pidfd)
                os.close(host.pidfd)
                host.pidfd = None
            self._kill_group(host, signal.SIGKILL)  # whatever the host left behind
            self._drain(host)
            self._record_exit(host)

    def _drain(self, host: _Host) -> None:
        deadline = time.monotonic() + DRAIN_S
        while host.pipes and time.monotonic() < deadline:
            if not all(self._read(host, fd) for fd in list(host.pipes)):
                continue
            time.sleep(0.005)
        for fd in list(host.pipes):
            self.selector.unregister(fd)
            os.close(fd)
        host.pipes.clear()
        host.log.flush(final=True)

    def _record_exit(self, host: _Host) -> None:
        code = os.waitstatus_to_exitcode(host.wait_status)
        recorded = self._recorded_state(host.index)
        summary = ExitSummary(
            host_index=host.index,
            exit_code=code if code >= 0 else None,
            signal=signal.Signals(-code).name if code < 0 else None,
            recorded_success=recorded == HostState.SUCCEEDED.value,
            # Stopped by this agent, or by itself at a barrier (its status says so); never by its exit code.
            stopped=host.stop_sent_at is not None or recorded == HostState.STOPPED.value,
            stopped_because=self.stop_reason if host.stop_sent_at is not None else "",
            ended_at=time.time(),
            stderr_tail=tuple(self.redactor.text(line) for line in host.stderr_lines()),
            storage_error=self.storage_error,
        )
        if self.plan.session:  # a session host's wakeup socket goes with it, however it ended
            with contextlib.suppress(OSError):
                os.unlink(wakeup_path(self.plan.job_id, host.index))
            if not any(other.alive for other in self.hosts.values()):
                remove_session_sockets(self.plan.job_id)
        if summary.failed:
            self._report_first_failure(host.index, summary)
        last = not any(other.alive for other in self.hosts.values())
        if last:
            self._publish_outputs()  # before the last exit record: the client is done once it lands
        with patiently():  # the record that decides the host's end: ridden out however long storage has failed
            self.write_record(protocol.host_exit(host.index), summary.to_json())
        if self.storage.local_path() is not None:
            # The notebook waiting on a local disk looks now: a host's end decides its cell (a session's too).
            wake_clients(self.plan.job_id)
            if last and not self.plan.session:
                remove_session_sockets(self.plan.job_id)

    def _report_first_failure(self, index: int, summary: ExitSummary) -> None:
        if self.first_failure_at is None:
            self.first_failure_at = time.monotonic()
        record = FirstFailure(host_index=index, at=time.time(), description=summary.describe())
        with patiently():
            self.write_record(protocol.FAILED, record.to_json(), exclusive=True)

    # -- what steers the agent ----------------------------------------------------------

    def _look_at_control(self) -> None:
        now = time.monotonic()
        relay = self._relay
        up = relay is not None and relay.up
        carried = frozenset(name for name, *_ in relay.mirror.entries(protocol.CONTROL_DIR + "/")) \
            if up else frozenset()
        if not up:  # back on storage (the channel broke): at storage's pace from now
            self._next_control_look = min(self._next_control_look, now + self._control_poll_s)
        if now >= self._next_control_look:
            self._next_control_look = now + self._control_look_s()
            try:
                self._listed_control = {info.name for info in self.storage.list(protocol.CONTROL_DIR + "/")}
            except Exception as error:  # noqa: BLE001 - the hosts are still supervised, on what was last listed
                self._storage_failed(protocol.CONTROL_DIR, error)  # (a session's idle timeout still runs)
            if self.hub is not None and up:
                self._pass_on(self._listed_control - carried)
        elif carried <= self._handled_control:
            return  # nothing new through the channel, and storage is not due
        self._handled_control = carried
        names = sorted(self._listed_control | carried)
        if protocol.CANCEL in names and not self.cancelled and self.verified(protocol.CANCEL):
            self.cancelled = True
            self.stop_all(self._cancel_reason())
        if protocol.FAILED in names and self.first_failure_at is None and self.verified(protocol.FAILED):
            self.first_failure_at = now
        requests = sorted(seq for name in names if (seq := protocol.parse_stacks_request(name)) is not None)
        if requests and requests[-1] > self._answered_stacks:
            self._answered_stacks = requests[-1]
            if self.verified(protocol.stacks_request(requests[-1])):
                self.dump_stacks(requests[-1])
        if self.cells is not None:
            self.cells.look(names)

    def _pass_on(self, names: set[str]) -> None:
        """Control records found in storage that the channel has not carried (a notebook without it wrote
        them), passed on through the hub: the other hosts' agents list storage only if the channel breaks."""
        for name in sorted(names - self._passed_on):
            self._passed_on.add(name)
            try:
                self.hub.publish(name, read_limited(self.storage.plain, name))  # up to a control record's limit
            except Exception:  # noqa: BLE001 - gone meanwhile, or unreadable: the agents verify what they act on
                continue

    def _control_look_s(self) -> float:
        """How long until storage's control records are listed again: with the channel up, another host's agent
        hears them through it (from the leader's agent, which lists storage seldom while the session is idle);
        else as ever."""
        if self._relay is None or not self._relay.up:
            return self._control_poll_s
        if self.hub is None:
            return CONTROL_POLL_THROUGH_HUB_S
        if self.cells is not None and self.cells.idle():
            return CONTROL_POLL_IDLE_CHANNEL_S
        return self._control_poll_s

    def stop_on_signal(self, signum: int, frame: object = None) -> None:
        """SIGTERM to the agent (a pod being deleted, a machine shutting down): stop the hosts, record them, end."""
        print(f"kinetic agent: {signal.Signals(signum).name}: stopping the hosts", file=sys.stderr, flush=True)
        self.cancelled = True
        self.stop_all(f"by its agent's {signal.Signals(signum).name}")

    def _cancel_reason(self) -> str:
        """Why the job was cancelled, as a stopped host's row says it: "after an interrupt", "at its timeout"."""
        try:
            reason = CancelRequest.from_json(read_record(self.storage, self.key, protocol.CANCEL)).reason
        except Exception:  # noqa: BLE001 - verified a moment ago; the hosts are stopped whatever it says
            return "as cancelled"
        return {"interrupted": "after an interrupt", CancelRequest.TIMEOUT: self._at_timeout(),
                CancelRequest.AFTER_FAILURE: "after another host failed"}.get(
            reason, f"on request ({reason})")

    def _at_timeout(self) -> str:
        return f"at the timeout of {self.plan.timeout_s:g} s" if self.plan.timeout_s else "at its timeout"

    def _enforce_timeout(self) -> None:
        if self._deadline is None or self.cancelled or time.time() < self._deadline:
            return
        self.cancelled = True
        request = CancelRequest(reason=CancelRequest.TIMEOUT, at=time.time())
        with patiently():
            self.write_record(protocol.CANCEL, request.to_json(), exclusive=True)
        print(f"kinetic agent: job {self.plan.job_id} ran past its timeout of {self.plan.timeout_s:g} s; "
              "stopping its hosts", file=sys.stderr, flush=True)
        self.stop_all(self._at_timeout())

    def _stop_survivors_if_due(self) -> None:
        if self.first_failure_at is not None and time.monotonic() - self.first_failure_at >= self.plan.grace_s:
            self.stop_reason = self.stop_reason or "after another host failed"
            if self.cells is not None and not self.cancelled:
                self.cells.end_session("a host ended")
            self.stop_all()
        now = time.monotonic()
        for host in self.hosts.values():
            if host.alive and host.stop_sent_at is not None and not host.killed and now - host.stop_sent_at >= TERM_TO_KILL_S:
                host.killed = True
                self._kill_group(host, signal.SIGKILL)

    def stop_all(self, because: str = "after another host failed") -> None:
        """SIGTERM to every live host (SIGKILL follows); ``because``: what their rows say, the first reason given."""
        self.stop_reason = self.stop_reason or because
        for host in self.hosts.values():
            if host.alive and host.stop_sent_at is None:
                if self.first_failure_at is not None:  # stopped once a peer failed: what it says now (JAX's
                    host.log.start_framework_teardown()  # "SIGTERM caught", NCCL's abort) is its teardown's
                host.stop_sent_at = time.monotonic()
                self._kill_group(host, signal.SIGTERM)

    # -- stacks ---------------------------------------------------------------------------

    def dump_stacks(self, seq: int) -> None:
        """Ask every live host for its stacks at once, wait for the dumps to settle, store each (or "no answer",
        at once for a stopped process, saying so)."""
        asked: dict[int, int] = {}
        for host in self.hosts.values():
            if not host.alive:
                continue
            stopped = not_running(host.pid)
            if stopped:  # it runs no signal handler until it is continued: nothing to wait for
                self.write_record(protocol.host_stacks(host.index, seq), (
                    f"no answer: host {host.index} {stopped}: process {host.pid} runs nothing, its stacks' dump "
                    "included, until it gets SIGCONT\n").encode())
                continue
            try:
                asked[host.index] = os.path.getsize(host.stacks_path) if os.path.exists(host.stacks_path) else 0
                os.kill(host.pid, STACKS_SIGNAL)
            except (ProcessLookupError, OSError):
                asked.pop(host.index, None)
        deadline = time.monotonic() + STACKS_WAIT_S
        sizes = dict(asked)
        grew_at: dict[int, float] = {}
        pending = set(asked)
        while pending and time.monotonic() < deadline:
            self._pump(0.01)  # the hosts' output keeps flowing meanwhile
            now = time.monotonic()
            for index in list(pending):
                path = self.hosts[index].stacks_path
                size = os.path.getsize(path) if os.path.exists(path) else 0
                if size != sizes[index]:
                    sizes[index], grew_at[index] = size, now
                elif index in grew_at and now - grew_at[index] >= STACKS_SETTLED_S:
                    pending.discard(index)  # it wrote, then stopped writing: the dump is whole
        for index, before in asked.items():
            text = ""
            if sizes[index] > before:
                with open(self.hosts[index].stacks_path, encoding="utf-8", errors="replace") as dump:
                    dump.seek(before)
                    text = dump.read()
            if not text.strip():
                text = f"no answer: host {index} did not dump its stacks within {STACKS_WAIT_S:g} s\n"
            self.write_record(protocol.host_stacks(index, seq), text.encode())

    @staticmethod
    def _kill_group(host: _Host, signum: int) -> None:
        try:
            os.killpg(host.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

