"""The coordinated start: nobody enters user code unless every host is ready.

Each host reports ``ready`` in its status once it has checked the plan and
loaded the payload. The leader waits for all of them and then writes
``.leader_ready`` with its verdict; workers wait for that object. A host that
fails or dies before the barrier turns the verdict into "abort", so every host
stops with "stopped: host k failed in phase P" instead of hanging in a
collective.
"""

from __future__ import annotations

import time

from kinetic_nb.errors import HostStoppedError, IntegrityError, KineticTimeoutError, ObjectNotFoundError
from kinetic_nb.runner import protocol
from kinetic_nb.runner.protocol import ExitSummary, HostState, HostStatus, JobPlan, LeaderReady, Phase
from kinetic_nb.runner.records import read_record, write_record
from kinetic_nb.storage import Storage

#: First and longest pause between two looks at storage while waiting.
_FIRST_POLL_S = 0.002
_POLL_GROWTH = 1.3
_MAX_POLL_S = 0.1


def _polls(deadline: float):
    """Yield until ``deadline``, sleeping a little longer each time."""
    pause = _FIRST_POLL_S
    while time.monotonic() < deadline:
        yield
        time.sleep(pause)
        pause = min(pause * _POLL_GROWTH, _MAX_POLL_S)


class _HostWatcher:
    """Reads the hosts' records from one listing, skipping objects it has already read (and any that does not verify)."""

    def __init__(self, storage: Storage, key: bytes):
        self._storage = storage
        self._key = key
        self._seen: dict[str, str] = {}
        self.statuses: dict[int, HostStatus] = {}
        self.failed: dict[int, str] = {}  # host -> phase it failed in

    def refresh(self, prefix: str = protocol.HOSTS_DIR + "/") -> None:
        changed = []
        for info in self._storage.list(prefix):
            parsed = protocol.parse_host_object(info.name)
            if parsed is None or parsed[1] not in ("status", "exit") or self._seen.get(info.name) == info.version:
                continue
            changed.append((parsed, info))
        # Statuses first: a host's exit record names the phase its last status was in.
        changed.sort(key=lambda item: item[0][1] != "status")
        for (host, kind, _), info in changed:
            try:
                data = read_record(self._storage, self._key, info.name)
            except (ObjectNotFoundError, IntegrityError):
                continue
            self._seen[info.name] = info.version
            if kind == "status":
                status = HostStatus.from_json(data)
                if host in self.statuses and status.revision < self.statuses[host].revision:
                    continue  # an older status replayed: never go back
                self.statuses[host] = status
                if status.state == HostState.FAILED.value:
                    self.failed.setdefault(host, status.phase)
            else:
                exit_summary = ExitSummary.from_json(data)
                if exit_summary.failed:
                    last = self.statuses.get(host)
                    self.failed.setdefault(host, last.phase if last else Phase.STARTUP.value)

    def ready(self) -> set[int]:
        waiting = {HostState.READY.value, HostState.RUNNING.value}
        return {host for host, status in self.statuses.items() if status.state in waiting}

    def first_failure(self) -> tuple[int, str] | None:
        if not self.failed:
            return None
        host = min(self.failed)
        return host, self.failed[host]


def wait_as_leader(storage: Storage, plan: JobPlan, key: bytes) -> None:
    """Wait until every host is ready, then tell the workers to go.

    Raises ``HostStoppedError`` (after telling the workers to abort) when a
    host fails first, and ``KineticTimeoutError`` when hosts never get ready.
    """
    watcher = _HostWatcher(storage, key)
    for _ in _polls(time.monotonic() + plan.barrier_timeout_s):
        watcher.refresh()
        failure = watcher.first_failure()
        if failure is not None:
            host, phase = failure
            write_verdict(storage, key, LeaderReady(False, host, phase))
            raise HostStoppedError(protocol.stopped_message(host, phase))
        if len(watcher.ready()) == plan.hosts:
            write_verdict(storage, key, LeaderReady(True))
            return
    missing = sorted(set(range(plan.hosts)) - watcher.ready())
    write_verdict(storage, key, LeaderReady(False, missing[0], Phase.STARTUP.value))
    raise KineticTimeoutError(
        f"start barrier: hosts {', '.join(map(str, missing))} were not ready after {plan.barrier_timeout_s:g} s"
    )


def write_verdict(storage: Storage, key: bytes, verdict: LeaderReady) -> None:
    """The leader's verdict at a barrier (the job's start, or a session's cell), sealed."""
    write_record(storage, key, protocol.LEADER_READY, verdict.to_json())


def leader_said_go(storage: Storage, key: bytes) -> bool:
    """Whether the leader's verdict in ``storage`` is go (False while there is none, or none that verifies);
    ``HostStoppedError`` if abort."""
    try:
        verdict = LeaderReady.from_json(read_record(storage, key, protocol.LEADER_READY))
    except (ObjectNotFoundError, IntegrityError):
        return False
    if not verdict.go:
        raise HostStoppedError(protocol.stopped_message(verdict.failed_host, verdict.failed_phase))
    return True


def wait_as_worker(storage: Storage, plan: JobPlan, key: bytes) -> None:
    """Wait for the leader's verdict; raise ``HostStoppedError`` if it says abort.

    A worker also watches the leader itself, so a leader that dies before it
    writes a verdict does not leave the worker waiting.
    """
    watcher = _HostWatcher(storage, key)
    # The leader gives up after barrier_timeout_s; leave it time to say so.
    for _ in _polls(time.monotonic() + plan.barrier_timeout_s + 30):
        if leader_said_go(storage, key):
            return
        watcher.refresh(f"{protocol.HOSTS_DIR}/{protocol.LEADER_INDEX}/")
        if protocol.LEADER_INDEX in watcher.failed:
            raise HostStoppedError(
                protocol.stopped_message(protocol.LEADER_INDEX, watcher.failed[protocol.LEADER_INDEX])
            )
    raise KineticTimeoutError(f"start barrier: no word from the leader after {plan.barrier_timeout_s + 30:g} s")
