"""Each host's heartbeat, beaten by its agent: ``hosts/{i}/heartbeat`` for every host process that exists.

A host's own interpreter does not beat: a framework holding its GIL (a long C
call, a distributed init on a loaded machine) starved that thread, and the
notebook called a working host lost. The agent holds each host's pid and
pidfd and sees it end, so it answers for it: one thread of its own, started
once every host is forked, rewrites the heartbeat of each host it has not
reaped, whether that process runs or is stopped (SIGSTOP: the notebook shows
it quiet by the quiet rule, never lost). A host is lost only when its agent is
gone or cut off: a killed agent takes its hosts with it (their parent-death
signal) and leaves no exit record.

Pace: every ``HEARTBEAT_INTERVAL_S`` while a host is busy, every
``IDLE_HEARTBEAT_INTERVAL_S`` while a session's host is idle. The agent knows
a session's host is idle from its marks pipe's cell boundaries (a cell's end:
idle; a cell's start: busy, and beaten within ``GATHER_S`` when its last beat
is older than the busy pace, else a busy pace after it); before its first cell, from its status (read at
each round until it is first seen idle, or its first cell starts). A round
costs one write per host that is due and nothing else; a cell's start costs a
lookup per host and one round (gathered for every host), with no write for a
host beaten less than the busy pace ago: on this thread, never on the cell's way.

Host-safe: the standard library, the runner and storage only.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable

from kinetic_nb.errors import StorageError
from kinetic_nb.runner import protocol
from kinetic_nb.runner.protocol import HostState
from kinetic_nb.runner.status import HEARTBEAT_INTERVAL_S, IDLE_HEARTBEAT_INTERVAL_S

logger = logging.getLogger(__name__)

__all__ = ["GATHER_S", "Liveness", "not_running"]

#: Heartbeats written at once on remote storage, where each is a request: an agent of 256 hosts on a bucket would
#: otherwise spend a round's whole interval on one round's requests, one after another.
REMOTE_WRITERS = 16
#: A round beats a host whose last beat is at most this much younger than its pace: rounds come at the busy pace,
#: and a host beaten a moment after the last round must not wait a whole round more.
ROUND_SLACK_S = 0.25
#: After a cell starts on a host that was idle, how long the beater waits for the other hosts' starts of the same
#: cell (their marks come within milliseconds), so that one round beats them all.
GATHER_S = 0.05
#: ``/proc/PID/stat`` states of a process that exists and runs nothing, and how a user reads each.
_NOT_RUNNING = {"T": "is stopped by a signal (SIGSTOP or SIGTSTP)", "t": "is stopped by a debugger (tracing stop)"}


def not_running(pid: int) -> str:
    """Why process ``pid`` runs nothing though it exists (``"is stopped by a signal (SIGSTOP or SIGTSTP)"``),
    from its ``/proc/PID/stat`` state; "" when it runs, is gone, or this system has no ``/proc``."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            state = stat.read().rsplit(b")", 1)[1].split()[0].decode()  # after the name, which may hold anything
    except (OSError, IndexError, UnicodeDecodeError):
        return ""
    return _NOT_RUNNING.get(state, "")


@dataclasses.dataclass
class _Beaten:
    """What the beater knows of one host."""

    #: A session's host between cells: beaten at the idle pace.
    idle: bool = False
    #: A session's host before its first cell's start: whether it is idle yet is read from its status.
    unsure: bool = False
    #: When its heartbeat was last written (monotonic).
    beaten_at: float = -math.inf


class Liveness:
    """Beats ``hosts/{i}/heartbeat`` for an agent's hosts from one thread of the agent's (see the module's
    docstring).

    ``write(name)`` stores an empty object (the agent's storage, through its
    session's channel when that is up); ``read_state(index)`` is a host's
    recorded ``HostState`` value or None, asked only of a session's host
    before its first cell. ``remote``: each write is a request (a bucket), so
    a round's writes go out together.
    """

    def __init__(self, write: Callable[[str], None], *, read_state: Callable[[int], str | None],
                 remote: bool = False, busy_s: float = HEARTBEAT_INTERVAL_S,
                 idle_s: float = IDLE_HEARTBEAT_INTERVAL_S):
        self._write = write
        self._read_state = read_state
        self._remote = remote
        self._busy_s = busy_s
        self._idle_s = idle_s
        self._hosts: dict[int, _Beaten] = {}
        self._lock = threading.Lock()
        #: Set when a round is wanted before the next one is due (a cell's start, a channel that came up).
        self._wake = threading.Event()
        self._stop = threading.Event()
        #: The next round beats every host, due or not (a channel came up: its mirror has no heartbeat yet).
        self._everyone = False
        self._failing = False
        self._thread: threading.Thread | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    # -- what the agent tells it ------------------------------------------------------------------

    def add(self, index: int, *, session: bool) -> None:
        """A host just forked: beaten from the first round on (a session's, at the busy pace until it is idle)."""
        with self._lock:
            self._hosts[index] = _Beaten(unsure=session)

    def start(self) -> None:
        """Start beating: once every host is forked (a thread alive across a ``fork`` may hold a lock the host
        would inherit held)."""
        if self._remote:
            self._pool = concurrent.futures.ThreadPoolExecutor(REMOTE_WRITERS, thread_name_prefix="kinetic-beat")
        self._thread = threading.Thread(target=self._run, name="kinetic-liveness", daemon=True)
        self._thread.start()

    def cell_started(self, index: int) -> None:
        """Host ``index`` started a session's cell (its marks pipe said so): busy from now on, and beaten at once
        if it was idle longer than the busy pace (a reader now allows it only ``state.LOST_AFTER_S``)."""
        with self._lock:
            host = self._hosts.get(index)
            if host is None:
                return
            was_idle, host.idle, host.unsure = host.idle, False, False
        if was_idle:  # the beater may be asleep for the idle pace: it looks again
            self._wake.set()

    def cell_ended(self, index: int) -> None:
        """Host ``index`` ended a session's cell: idle until its next cell starts."""
        with self._lock:
            host = self._hosts.get(index)
            if host is not None:
                host.idle, host.unsure = True, False

    def forget(self, index: int) -> None:
        """Host ``index`` ended (reaped): its exit record speaks for it from now on."""
        with self._lock:
            self._hosts.pop(index, None)

    def beat_now(self) -> None:
        """Beat every host at once, due or not (a session's channel came up: its readers hear heartbeats
        through it from now on, and its mirror has none yet)."""
        with self._lock:
            self._everyone = True
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=1)  # a round's write in flight on a slow bucket: not worth a longer wait
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    # -- the beater's thread ----------------------------------------------------------------------

    def _run(self) -> None:
        next_round = time.monotonic()  # the first round at once: every host is forked
        while not self._stop.is_set():
            if self._wake.wait(max(0.0, next_round - time.monotonic())):
                self._wake.clear()
                if self._stop.wait(GATHER_S):  # the other hosts' starts of the same cell
                    return
            self.beat_round()
            next_round = self._next_due()

    def beat_round(self) -> list[int]:
        """Beat every host that is due (every host after :meth:`beat_now`); return their indices. Then learn
        which hosts came to idle before their first cell (for the next rounds): the reads never hold a beat up."""
        now = time.monotonic()
        with self._lock:
            everyone, self._everyone = self._everyone, False
            due = [index for index, host in self._hosts.items()
                   if everyone or now - host.beaten_at >= self._pace(host) - ROUND_SLACK_S]
            for index in due:
                self._hosts[index].beaten_at = now
        if self._pool is not None and len(due) > 1:
            list(self._pool.map(self._beat, due))
        else:
            for index in due:
                self._beat(index)
        self._learn_first_idle()
        return due

    def _pace(self, host: _Beaten) -> float:
        return self._idle_s if host.idle else self._busy_s

    def _next_due(self) -> float:
        """When the next host is due (monotonic): an agent whose hosts are all idle sleeps for the idle pace."""
        with self._lock:
            return min((host.beaten_at + self._pace(host) for host in self._hosts.values()),
                       default=time.monotonic() + self._busy_s)

    def _learn_first_idle(self) -> None:
        """A session's host before its first cell: idle once its status says so (its marks pipe says nothing
        until a cell starts)."""
        with self._lock:
            unsure = [index for index, host in self._hosts.items() if host.unsure]
        if self._pool is not None and len(unsure) > 1:  # a read per host, on a bucket: at a thousand hosts' start
            states = list(self._pool.map(self._idle, unsure))  # a round's reads in a row took longer than a round
        else:
            states = [self._idle(index) for index in unsure]
        for index, idle in zip(unsure, states, strict=True):
            if idle:
                with self._lock:
                    host = self._hosts.get(index)
                    if host is not None and host.unsure:  # no cell started meanwhile
                        host.idle, host.unsure = True, False

    def _idle(self, index: int) -> bool:
        try:
            return self._read_state(index) == HostState.IDLE.value
        except Exception:  # noqa: BLE001 - unread, it stays at the busy pace: the safe side
            return False

    def _beat(self, index: int) -> None:
        name = protocol.host_heartbeat(index)
        try:
            self._write(name)
        except Exception as error:  # a heartbeat must never take the agent down; said once per outage
            if not self._failing:
                logger.warning("could not write %s: %s", name, error, exc_info=not isinstance(error, StorageError))
            self._failing = True
            return
        self._failing = False
