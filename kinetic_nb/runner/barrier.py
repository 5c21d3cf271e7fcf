"""One barrier protocol, for the start of a job (or a session) and for each cell of a session: nobody enters
user code unless every host is ready.

Every host says it is ready. The leader waits until all have, or one has
failed, and writes its sealed verdict (``.leader_ready``: go, or abort naming
the host and the phase); a worker waits for that verdict and also watches the
leader, so a leader that fails before it gives one does not leave it waiting.
A host that fails or dies before the barrier turns the verdict into "abort",
so every host stops with "stopped: host k failed while loading the cell"
instead of hanging in a collective.

Two ways of seeing the hosts, one protocol:

- at the start, their status records (``ready`` once a host has checked the
  plan and loaded the payload; ``failed``, or an exit record, otherwise):
  :class:`HostStatuses`;
- at a session's cell, markers in the cell's directory (``ready-{i}``) and
  the failure payloads a host writes when it cannot load the cell, since a
  session host writes no status while a quick cell runs: :class:`CellMarkers`.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable
from typing import Protocol

from kinetic_nb.errors import HostStoppedError, IntegrityError, KineticTimeoutError, ObjectNotFoundError
from kinetic_nb.runner import protocol
from kinetic_nb.runner.protocol import ExitSummary, HostState, HostStatus, JobPlan, LeaderReady, Phase, hosts_named
from kinetic_nb.runner.records import read_record, write_record
from kinetic_nb.storage import Storage

#: First and longest pause between two looks at storage while waiting, and the pause's growth.
FIRST_POLL_S = 0.002
POLL_GROWTH = 1.3
MAX_POLL_S = 0.1
#: ... and longer at a large slice's start: the leader's look reads every host's records, a worker looks while
#: the others start, and a large slice takes longer to start, so a fixed pace would cost the square of the
#: hosts (at 512 hosts each host spent 46 ms looking, 22 ms at 128). 0.5 s at 1,024 hosts.
MAX_POLL_PER_HOST_S = 0.0005
#: ... and a worker's, at the start, longer still: each look is a read of the verdict and a listing of the leader's
#: records (two requests on a bucket), and every worker that is up looks while the rest start. At 1,024 hosts a
#: 0.5 s pause was 4,000 requests a second, and on a small machine the CPU the hosts still starting needed (a
#: 1,024-host start on gs:// here had 722 hosts ready after 300 s); 2 s there. A worker hears "go" that much later.
WORKER_POLL_PER_HOST_S = 0.002
#: A worker waits this much longer than the leader: the leader gives up first, and says so.
WORKER_SLACK_S = 30.0
#: The records the leader reads at once at the start, on a bucket (as many as the notebook's looks read).
READERS = 16


class Sighting(Protocol):
    """How the hosts are seen at a barrier."""

    def look(self) -> None:
        """Read what changed (the leader, each poll)."""

    def ready(self) -> set[int]: ...

    def first_failure(self) -> tuple[int, str] | None:
        """The lowest host that failed, and the phase it failed in."""

    def leader_failed(self) -> str | None:
        """A worker's look at the leader alone: the phase it failed in, or None."""


class HostStatuses:
    """The hosts seen through their status and exit records, from one listing, skipping objects it has already
    read (and any that does not verify)."""

    def __init__(self, storage: Storage, key: bytes):
        self._storage = storage
        self._key = key
        self._seen: dict[str, str] = {}
        self.statuses: dict[int, HostStatus] = {}
        self.failed: dict[int, str] = {}  # host -> phase it failed in

    def look(self) -> None:
        self.refresh()

    def leader_failed(self) -> str | None:
        self.refresh(f"{protocol.HOSTS_DIR}/{protocol.LEADER_INDEX}/")
        return self.failed.get(protocol.LEADER_INDEX)

    def refresh(self, prefix: str = protocol.HOSTS_DIR + "/") -> None:
        changed = []
        for info in self._storage.list(prefix):
            parsed = protocol.parse_host_object(info.name)
            if parsed is None or parsed[1] not in ("status", "exit") or self._seen.get(info.name) == info.version:
                continue
            changed.append((parsed, info))
        # Statuses first: a host's exit record names the phase its last status was in.
        changed.sort(key=lambda item: item[0][1] != "status")
        records = self._read_each([info.name for _, info in changed])
        for ((host, kind, _), info), data in zip(changed, records, strict=True):
            if data is None:
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

    def _read_each(self, names: list[str]) -> list[bytes | None]:
        """Each record (None where it is gone or does not verify), in order; on a bucket :data:`READERS` at a time:
        at a start every host's status changes between two looks, and a thousand of them read one by one cost the
        leader a thousand round trips (half a minute at 30 ms each) before it could say go."""
        def read(name: str) -> bytes | None:
            try:
                return read_record(self._storage, self._key, name)
            except (ObjectNotFoundError, IntegrityError):
                return None

        if len(names) < 2 or self._storage.local_path() is not None:
            return [read(name) for name in names]
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(len(names), READERS)) as pool:
            return list(pool.map(read, names))

    def ready(self) -> set[int]:
        waiting = {HostState.READY.value, HostState.RUNNING.value}
        return {host for host, status in self.statuses.items() if status.state in waiting}

    def first_failure(self) -> tuple[int, str] | None:
        if not self.failed:
            return None
        host = min(self.failed)
        return host, self.failed[host]


class CellMarkers:
    """A session's hosts at one cell's barrier: each one's ``ready-{i}`` marker in the cell's directory, and the
    failure payload of a host that could not load the cell."""

    def __init__(self, cell_storage: Storage, hosts: int):
        self._storage = cell_storage
        self._hosts = hosts
        self._names: set[str] = set()

    def look(self) -> None:
        self._names = {info.name for info in self._storage.list()}

    def ready(self) -> set[int]:
        return {index for index in range(self._hosts) if protocol.cell_ready(index) in self._names}

    def first_failure(self) -> tuple[int, str] | None:
        failed = [index for index in range(1, self._hosts) if protocol.worker_result(index) in self._names]
        return (failed[0], Phase.PAYLOAD_LOAD.value) if failed else None

    def leader_failed(self) -> str | None:
        # The leader's outcome before its verdict: it could not load the cell (the verdict, read after this
        # look, tells that apart from a quick cell it ran after saying go).
        return Phase.PAYLOAD_LOAD.value if self._storage.exists(protocol.RESULT) else None


def meet(storage: Storage, key: bytes, *, leader: bool, hosts: int, timeout: float, sighting: Sighting,
         what: str, sleep: Callable[[float], None] = time.sleep, max_pause: float = MAX_POLL_S,
         first_pause: float = FIRST_POLL_S,
         on_verdict: Callable[[], None] | None = None, channel: Callable[[], bool] | None = None) -> LeaderReady:
    """The barrier: return the leader's verdict once it says go; ``HostStoppedError`` when a host failed first
    (the leader tells the workers so), ``KineticTimeoutError`` when hosts never get ready (the leader tells
    them too).

    ``storage`` holds the verdict (the job's, or the cell's directory), sealed under ``key``; ``what`` names the
    barrier in errors; ``sleep`` pauses between looks, from ``first_pause`` growing to ``max_pause`` (a session host's
    may be woken by what it waits for, and then pauses long from the first); ``on_verdict`` runs once the
    leader has written its verdict, go or abort (it wakes the workers, which may then sleep long); ``channel()``, asked by the leader as it says go, is whether the
    hosts' cells travel through the session's channel (the verdict says so to every host).
    """
    deadline = time.monotonic() + timeout + (0.0 if leader else WORKER_SLACK_S)
    pause = min(first_pause, max_pause)
    while time.monotonic() < deadline:
        if leader:
            sighting.look()
            failure = sighting.first_failure()
            if failure is not None:
                write_verdict(storage, key, LeaderReady(False, *failure))
                if on_verdict is not None:
                    on_verdict()
                raise HostStoppedError(protocol.stopped_message(*failure))
            if len(sighting.ready()) == hosts:
                verdict = LeaderReady(True, channel=bool(channel is not None and channel()))
                write_verdict(storage, key, verdict)
                if on_verdict is not None:
                    on_verdict()
                return verdict
        else:
            failed_in = sighting.leader_failed()  # looked at before the verdict: see CellMarkers.leader_failed
            verdict = leader_said_go(storage, key)
            if verdict is not None:
                return verdict
            if failed_in is not None:
                raise HostStoppedError(protocol.stopped_message(protocol.LEADER_INDEX, failed_in))
        sleep(pause)
        pause = min(pause * POLL_GROWTH, max_pause)
    if not leader:
        raise KineticTimeoutError(f"{what}: no word from the leader after {timeout + WORKER_SLACK_S:g} s")
    missing = sorted(set(range(hosts)) - sighting.ready())
    write_verdict(storage, key, LeaderReady(False, missing[0], Phase.STARTUP.value))
    if on_verdict is not None:
        on_verdict()
    raise KineticTimeoutError(f"{what}: {hosts_named(missing)} {'was' if len(missing) == 1 else 'were'} not ready "
                              f"after {timeout:g} s")


def start_barrier(storage: Storage, plan: JobPlan, key: bytes, host_index: int, *,
                  channel: Callable[[], bool] | None = None) -> LeaderReady:
    """A job's (or a session's) start: every host has checked the plan and loaded the payload (and a session's
    has tried to join its channel: ``channel``, see :func:`meet`). The leader's verdict."""
    return meet(storage, key, leader=host_index == protocol.LEADER_INDEX, hosts=plan.world_size,
                timeout=plan.barrier_timeout_s, sighting=HostStatuses(storage, key), what="start barrier",
                channel=channel, max_pause=max(MAX_POLL_S, plan.world_size * (
                    MAX_POLL_PER_HOST_S if host_index == protocol.LEADER_INDEX else WORKER_POLL_PER_HOST_S)))


def write_verdict(storage: Storage, key: bytes, verdict: LeaderReady) -> None:
    """The leader's verdict at a barrier (the job's start, or a session's cell), sealed."""
    write_record(storage, key, protocol.LEADER_READY, verdict.to_json())


def leader_said_go(storage: Storage, key: bytes) -> LeaderReady | None:
    """The leader's verdict in ``storage`` once it is go (None while there is none, or none that verifies);
    ``HostStoppedError`` if abort."""
    try:
        verdict = LeaderReady.from_json(read_record(storage, key, protocol.LEADER_READY))
    except (ObjectNotFoundError, IntegrityError):
        return None
    if not verdict.go:
        raise HostStoppedError(protocol.stopped_message(verdict.failed_host, verdict.failed_phase))
    return verdict
