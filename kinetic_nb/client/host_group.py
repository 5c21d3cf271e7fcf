"""``HostGroup``: the hosts of a one-shot job or of a session, as the notebook holds them.

Where their records live and under which key, the backend that runs them and
the record that lists them (``handle.json``): stop them, ask for their stacks,
read a host's whole log. The cells they run are seen through a
:class:`~kinetic_nb.client.cell_handle.CellHandle`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from kinetic_nb.backends import Backend
from kinetic_nb.client.poller import JobPoller
from kinetic_nb.client.waiting import wait_for
from kinetic_nb.errors import IntegrityError, KineticTimeoutError, ObjectExistsError
from kinetic_nb.runner import protocol
from kinetic_nb.runner.envelope import write_sealed
from kinetic_nb.runner.logs import read_log
from kinetic_nb.runner.protocol import FirstFailure, JobPlan
from kinetic_nb.runner.records import read_record, unverified_line, write_record
from kinetic_nb.runner.wakeup import Wakeup, agent_wakeup_path, client_wakeup_path, wake
from kinetic_nb.state import JobSnapshot, JobStatus
from kinetic_nb.storage import Storage

logger = logging.getLogger(__name__)

__all__ = ["STACKS_WAIT_S", "HostGroup", "remove_job_objects"]

#: After a cancel, how long to wait for the hosts to be gone.
CANCEL_WAIT_S = 10.0
#: Deletes in flight when a job's objects are removed (one request each on gs://).
DELETE_WORKERS = 8
#: jupyter_client interrupts a kernel right before it asks it to shut down for
#: a restart (then SIGTERM at about 2.5 s, SIGKILL at 5 s). After an interrupt
#: a one-shot cell returns at once, and its job is cancelled only when no shutdown
#: request has arrived within this window, so a restart leaves the job running.
RESTART_WINDOW_S = 2.0
#: How long a stacks request waits for the hosts' answers: the agent gives each
#: host 1.5 s to dump, and a remote store adds its own latency.
STACKS_WAIT_S = 5.0


class HostGroup:
    """The hosts of a one-shot job or a session: their records, key and backend; stop them, read them."""

    def __init__(self, storage: Storage, plan: JobPlan, backend: Backend, *, key: bytes | None,
                 echo: Callable[[str, str], None] | None = None, submitted_at: float | None = None,
                 detached: bool = False, keep: bool = False):
        self.storage = storage
        self.plan = plan
        self.backend = backend
        #: The group's key: every record read is verified under it. None only for a job from before
        #: signing that the caller chose to trust (``attach(..., trust_unsigned=True)``).
        self.key = key
        #: handle.json's revision: each write counts up from the highest this group has seen.
        self._handle_revision = 0
        #: A detached job is never cancelled by an interrupt of whoever waits for it.
        self.detached = detached
        #: Keep every object after a success (by default only handle.json and outputs/ stay).
        self.keep = keep
        #: Set in a kernel (the magic does): whether the kernel is shutting down, which
        #: tells a restart's interrupt from the user's. None: cancel at once on an interrupt.
        self.shutting_down: Callable[[], bool] | None = None
        #: Every host's records, the whole group's (a one-shot job's cell reads through it too).
        self.poller = JobPoller(storage, plan, backend, key=key, submitted_at=submitted_at, on_leader_output=echo)
        self.outcome_recorded = False
        #: On a local disk the hosts wake the notebook through this socket (:meth:`open_wakeup`); None until
        #: it is made, False where none can be, or once it is closed.
        self._wakeup: Wakeup | bool | None = None
        self._submitted_wall = submitted_at if submitted_at is not None else time.time()

    @property
    def job_id(self) -> str:
        return self.plan.job_id

    @property
    def uri(self) -> str:
        return self.storage.uri

    def __repr__(self) -> str:
        return f"<HostGroup {self.job_id} {self.plan.hosts} hosts>"

    def snapshot(self) -> JobSnapshot:
        """Every host as it is now (one poll of the group's records)."""
        return self.poller.poll()

    def status(self) -> JobStatus:
        return self.snapshot().status

    def wait(self, timeout: float) -> JobStatus:
        """Wait until every host has ended (a stopped session's, say); ``KineticTimeoutError`` after ``timeout``
        seconds. A cell's own wait is its handle's (``CellHandle.wait``)."""
        deadline = time.monotonic() + timeout

        def check(snapshot: JobSnapshot) -> None:
            if time.monotonic() > deadline:
                raise KineticTimeoutError(f"the hosts of {self.job_id} had not all ended after {timeout:g} s")

        return wait_for(self.snapshot, lambda snapshot: snapshot.status.done, between=check,
                        hosts=self.plan.world_size).status

    def open_wakeup(self) -> None:
        """On a local disk, the socket through which the hosts wake this notebook, where they run beside it: a
        session's hosts when they are back to idle, a one-shot job's agent when a host ends (``runner.wakeup``).
        Made once; opened before a cell is submitted, so that no wakeup is lost."""
        if self._wakeup is None:
            self._wakeup = False
            if self.storage.local_path() is not None and self.backend.hosts_beside_the_notebook:
                with contextlib.suppress(OSError):
                    self._wakeup = Wakeup(client_wakeup_path(self.job_id))
                    # A handle dropped before its outcome (detached, given up on) takes its socket with it.
                    self._close_socket = weakref.finalize(self, _close_wakeup, self._wakeup)

    @property
    def woken(self) -> bool:
        """Whether the hosts wake this notebook when it has something to read (a socket on a local disk)."""
        self.open_wakeup()
        return bool(self._wakeup)

    def sleep(self, seconds: float) -> None:
        """Pause between two looks at the hosts: ``seconds`` at most, less when they wake this notebook."""
        self.open_wakeup()
        if self._wakeup:
            self._wakeup.sleep(seconds)
        else:
            time.sleep(seconds)

    def close_wakeup(self) -> None:
        """The socket goes once a one-shot job's outcome is decided, or its session is stopped."""
        if self._wakeup:
            self._close_socket()
        self._wakeup = False

    def logs(self, host: int = protocol.LEADER_INDEX) -> str:
        """Host ``host``'s whole stdout and stderr so far (``host``: a process's rank, where hosts run several)."""
        check_host(host, self.plan.world_size)
        text = read_log(self.storage, host, self.key, session=self.plan.session)
        if not text and self.outcome_recorded:  # cleaned up after success: the tail the poller kept
            text = "".join(f"{line}\n" for line in self.poller.snapshot().hosts[host].log_tail)
        return text

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
        if host is not None:
            check_host(host, self.plan.world_size)
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
            return read_record(self.storage, self.key, name)  # at most its limit; as it is when unsigned and trusted
        except IntegrityError:
            return unverified_line(index, name).encode() + b"\n"

    def cancel(self, reason: str = "cancelled by the user") -> None:
        """Stop every host; returns once they are gone (or after a bounded wait)."""
        if self.status().done:
            return
        self.request_cancel(reason)
        deadline = time.monotonic() + CANCEL_WAIT_S
        while not self.status().done and time.monotonic() < deadline:
            time.sleep(0.05)

    def request_cancel(self, reason: str) -> None:
        """Ask the backend to stop every host, and return: a local agent is woken to act on it at once."""
        self.backend.cancel(self.storage, self.plan, reason, self.key)
        if self.storage.local_path() is not None:
            wake(agent_wakeup_path(self.job_id))

    def cancel_after_interrupt(self, interrupt: KeyboardInterrupt) -> None:
        """An interrupt of a one-shot job's wait cancels the job, unless detached; in a kernel, unless a
        restart follows. The note on ``interrupt`` says which."""
        if self.detached:
            interrupt.add_note(f"kinetic_nb: job {self.job_id} is detached and goes on; "
                               f"%kinetic attach {self.job_id} to wait for it again")
        elif self.shutting_down is None:  # a script: the interrupt may end it, so cancel now
            self.cancel("interrupted")
            interrupt.add_note(f"kinetic_nb: cancelled job {self.job_id} and stopped its {self.plan.hosts} "
                               f"host{'' if self.plan.hosts == 1 else 's'}")
        else:  # a kernel: control comes back at once; the cancel follows unless a shutdown does
            threading.Thread(target=self._cancel_unless_shutting_down, name=f"kinetic-cancel-{self.job_id}",
                             daemon=True).start()
            interrupt.add_note(f"kinetic_nb: cancelling job {self.job_id} and its {self.plan.hosts} "
                               f"host{'' if self.plan.hosts == 1 else 's'} (a kernel restart leaves it running: %kinetic attach {self.job_id})")

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

    def report_lost_hosts(self, lost: list[int]) -> None:
        """Tell the agents of a lost host, as an agent tells of a failed one: they stop theirs after the grace."""
        record = FirstFailure(host_index=lost[0], at=time.time(), description="was lost (no heartbeat)")
        try:
            write_record(self.storage, self.key, protocol.FAILED, record.to_json(), exclusive=True)
        except ObjectExistsError:
            pass  # an agent saw a failure first
        except Exception:  # bookkeeping must not hide the outcome
            logger.warning("could not record the lost hosts of %s", self.job_id, exc_info=True)

    def record_outcome(self, status: JobStatus) -> None:
        """Note the outcome in handle.json; after a success, remove all but handle.json, outputs/ and profile/."""
        if self.outcome_recorded:
            return
        self.outcome_recorded = True
        self.close_wakeup()
        try:
            if status is JobStatus.SUCCEEDED and not self.keep:
                remove_job_objects(self.storage, keep=(protocol.HANDLE, protocol.OUTPUTS_DIR + "/",
                                                      protocol.PROFILE_DIR + "/"))
            self.write_record(status=str(status), decided_at=time.time())
        except Exception:  # bookkeeping must not hide the outcome
            logger.warning("could not record the outcome of %s", self.job_id, exc_info=True)
        try:  # a cluster's objects: a LeaderWorkerSet's parked pods hold their TPUs
            self.backend.cleanup(self.plan)
        except Exception:
            logger.warning("could not clean up the cluster objects of %s", self.job_id, exc_info=True)

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


def _close_wakeup(wakeup: Wakeup) -> None:
    wakeup.close()
    with contextlib.suppress(OSError):  # its directory, unless a host's or another notebook's socket is there
        os.rmdir(os.path.dirname(wakeup.path))


def check_host(host: int, hosts: int) -> None:
    """``ValueError`` naming the host when ``host`` is not one of ``hosts`` (where hosts run several
    processes: a rank, of the world size)."""
    if not (isinstance(host, int) and 0 <= host < hosts):
        raise ValueError(f"host {host!r} is out of range for a {hosts}-host job")


def remove_job_objects(storage: Storage, keep: Iterable[str] = ()) -> None:
    """Delete a job's objects, except those whose names start with one of ``keep``
    (with nothing kept, a ``file://`` job's directory goes too)."""
    keep = tuple(keep)
    doomed = [info.name for info in storage.list() if not info.name.startswith(keep)]
    root = storage.local_path()
    if root or len(doomed) < 2:  # a disk's delete is a system call: no thread earns its start
        storage.delete_many(doomed)
    else:  # a remote store answers one delete per request: several in flight
        with concurrent.futures.ThreadPoolExecutor(max_workers=DELETE_WORKERS) as pool:
            list(pool.map(lambda name: storage.delete_many([name]), doomed))
    if root:  # file://: also the directories the deletes left empty (every one, the job's own too, when none is kept)
        folders = [entry[0] for entry in os.walk(root)] if not keep else \
            {os.path.join(root, *name.split("/")[:depth]) for name in doomed for depth in range(1, name.count("/") + 1)}
        for directory in sorted(folders, key=len, reverse=True):
            if directory != root or not keep:
                try:
                    os.rmdir(directory)
                except OSError:
                    pass  # not empty: something was kept, or a file appeared
