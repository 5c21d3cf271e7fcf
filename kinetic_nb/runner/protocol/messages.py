"""The records hosts, agents and clients exchange (each a frozen dataclass with explicit JSON), phases and states."""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Iterable
from typing import Any, ClassVar

from kinetic_nb.runner.protocol.names import LEADER_INDEX

#: Bumped whenever an object name, a payload key or a record's shape changes
#: incompatibly; a host refuses a plan with another version.
PROTOCOL_VERSION = 7


class Phase(str, enum.Enum):
    """The phases every host goes through, in order (the first only where its pod installs its environment)."""

    ENVIRONMENT_INSTALL = "environment install"
    STARTUP = "startup"
    PLAN_CHECK = "plan check"
    PAYLOAD_LOAD = "payload load"
    START_BARRIER = "start barrier"
    DISTRIBUTED_INIT = "distributed init"
    EXECUTE = "execute"
    RESULT_SERIALIZATION = "result serialization"
    RESULT_UPLOAD = "result upload"
    TEARDOWN = "teardown"

    def __str__(self) -> str:
        return self.value


#: What each phase is called where a user reads it (rows, titles, errors, the timeline, a host's own line): what the
#: host was doing. The protocol's values stay as they are (hosts write them; records and golden files keep them); only
#: the words shown change, here and nowhere else.
PHASE_WORDS = {
    Phase.ENVIRONMENT_INSTALL.value: "installing packages",
    Phase.STARTUP.value: "starting",
    Phase.PLAN_CHECK.value: "checking versions",
    Phase.PAYLOAD_LOAD.value: "loading the cell",
    Phase.START_BARRIER.value: "waiting for the others",
    Phase.DISTRIBUTED_INIT.value: "connecting hosts",
    Phase.EXECUTE.value: "in the cell",
    Phase.RESULT_SERIALIZATION.value: "saving the result",
    Phase.RESULT_UPLOAD.value: "sending the result",
    Phase.TEARDOWN.value: "shutting down",
}


def phase_words(phase: str) -> str:
    """How a user reads a host's phase (``PHASE_WORDS``): ``"payload load"`` -> ``"loading the cell"``.

    Parameters
    ----------
    phase : str
        A ``Phase`` value, as a host wrote it (or "" before it wrote one).

    Returns
    -------
    str
        The words for it; a value this version does not know is shown as it is.
    """
    return PHASE_WORDS.get(phase, phase)


class HostState(str, enum.Enum):
    """What the panel and ``CellHandle.hosts()`` say about a host."""

    PENDING = "pending"
    READY = "ready"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"
    LOST = "lost"
    #: A session's host between cells: up, its framework initialized, its namespace kept.
    IDLE = "idle"
    #: Shown by the client, never written by a host: still running, but it has
    #: printed nothing and changed no phase for ``grace_s`` since another host ended.
    QUIET = "quiet"
    #: Shown by the client, never written by a host: still running when its cell's outcome was decided (an
    #: interrupt, a timeout, another host's failure), and being stopped by kinetic_nb.
    STOPPING = "stopping"

    def __str__(self) -> str:
        return self.value


class Framework(str, enum.Enum):
    NONE = "none"
    JAX = "jax"
    TORCH = "torch"

    def __str__(self) -> str:
        return self.value


# Keys of the result payload (a cloudpickled dict).
SUCCESS = "success"
RESULT_VALUE = "result"
EXCEPTION = "exception"  # the exception, cloudpickled on its own so a payload stays readable
EXCEPTION_TYPE = "exception_type"  # its qualified type name, for when it cannot be rebuilt
EXCEPTION_MESSAGE = "exception_message"
TRACEBACK = "traceback"
PHASE = "phase"
HOST_INDEX = "host_index"
OUTPUTS = "outputs"
SERIALIZATION_FAILED = "serialization_failed"
RESULT_REPR = "result_repr"
#: The ``--out`` names the cell had not bound on the leader when it ended (a warning, not a failure).
MISSING_OUTPUTS = "missing_outputs"
#: True when the host did not fail on its own but was stopped after another host failed.
STOPPED = "stopped"
#: The failing frames' variables as text made on the host (``runner.frame_locals.FrameLocals.to_dict``).
FRAME_LOCALS = "locals"

# Keys of the cell payload (payload.pkl, a cloudpickled dict).
CELL_SOURCE = "source"
CELL_FILENAME = "filename"
CELL_NAMESPACE = "namespace"  # {name: cloudpickled bytes}, unpickled one by one on the host
CELL_OUT_NAMES = "out"
#: A session cell's framework, when the session was started with ``framework="auto"``: the first cell that
#: imports one says which its hosts initialize.
CELL_FRAMEWORK = "framework"
#: True when the cell runs under its framework's profiler on every host (``runner.profiling``).
CELL_PROFILE = "profile"

# Exit codes of ``python -m kinetic_nb.runner``.
EXIT_OK = 0
EXIT_FAILED = 1
#: The host stopped on purpose because another host failed first.
EXIT_STOPPED = 3


def process_name(rank: int, procs_per_host: int) -> str:
    """How a message names process ``rank``: ``host 2`` where each host runs one process, else
    ``host 1, process 0 (rank 2)``."""
    if procs_per_host == 1:
        return f"host {rank}"
    return f"host {rank // procs_per_host}, process {rank % procs_per_host} (rank {rank})"


#: Ranges of hosts a line names at most (``0-3, 5, 7-9``): 1,024 scattered hosts would be a page of numbers.
MAX_RANGES = 12


def host_ranges(indices: Iterable[int], *, limit: int | None = None) -> str:
    """``[1, 2, 3, 5]`` -> ``"1-3, 5"``; past ``limit`` ranges, the rest are counted: ``"1-3, 5, … (40 more)"``."""
    parts: list[tuple[int, int]] = []
    for index in sorted(indices):
        if parts and parts[-1][1] + 1 == index:
            parts[-1] = (parts[-1][0], index)
        else:
            parts.append((index, index))
    words = [str(start) if start == end else f"{start}-{end}" for start, end in parts]
    if limit is None or len(words) <= limit:
        return ", ".join(words)
    more = sum(end - start + 1 for start, end in parts[limit:])
    return ", ".join(words[:limit]) + f", … ({more} more)"


def hosts_named(indices: Iterable[int]) -> str:
    """Hosts as a message names them: ``host 5``, ``hosts 0-3, 7``, ``hosts 722-1023`` (never a page of numbers)."""
    indices = sorted(indices)
    return f"host {indices[0]}" if len(indices) == 1 else f"hosts {host_ranges(indices, limit=MAX_RANGES)}"


def process_label(rank: int, procs_per_host: int) -> str:
    """A process's short name in a table row: ``2``, or ``1.0`` (host.process) where hosts run several."""
    return str(rank) if procs_per_host == 1 else f"{rank // procs_per_host}.{rank % procs_per_host}"


def _to_json(record: Any) -> bytes:
    return json.dumps(dataclasses.asdict(record), sort_keys=True, indent=1).encode()


@dataclasses.dataclass(frozen=True)
class JobPlan:
    """The one immutable plan every host receives, as ``plan.json``.

    A slice is ``hosts`` machines of ``procs_per_host`` processes each: ``world_size`` processes, numbered by
    global rank (``rank = host * procs_per_host + local rank``). Every record is a process's and is keyed by
    its rank (``hosts/{rank}/``: the host's index where each host runs one process); rank 0 is the leader.
    """

    job_id: str
    #: Machines (pods, Ray nodes, VMs): each runs one agent, which starts ``procs_per_host`` processes.
    hosts: int
    accelerator: str
    devices_per_host: int
    framework: str
    coordinator_address: str
    #: Seconds a host waits at the start barrier for the others to be ready.
    barrier_timeout_s: float
    #: Seconds JAX waits for a silent peer before declaring it dead.
    heartbeat_timeout_s: int
    #: Seconds JAX waits for peers at shutdown after a successful cell.
    shutdown_timeout_s: int
    #: Seconds the whole job may run; None means no limit.
    timeout_s: float | None = None
    #: Seconds the other hosts get to report after one fails, before they are stopped.
    grace_s: float = 10.0
    #: The accelerator is simulated with CPU devices (the local backend).
    simulated: bool = False
    #: When the client stored the plan (seconds since the epoch): ``timeout_s`` counts from here,
    #: on every host's agent, with or without a client.
    created_at: float = 0.0
    #: The names of the variables the user set for every host (``-e``); their values never enter
    #: storage: they reach the hosts beside the job's key (an agent's environment, a Secret).
    env_names: tuple[str, ...] = ()
    #: A session: the hosts stay up between cells (``cells/{seq}/``) and keep their namespaces.
    session: bool = False
    #: A session with no cell for this long stops itself, with or without a client; None: never.
    idle_timeout_s: float | None = None
    #: The notebook's Python, cloudpickle and framework versions (``runner.versions``):
    #: a host whose Python or cloudpickle differs refuses the plan, naming both sides.
    client_versions: dict = dataclasses.field(default_factory=dict)
    #: Where the notebook's folder is stored for hosts that do not share its disk (``protocol.WORKDIR``): each
    #: host unpacks it and runs there, with it first on ``sys.path``; "" where the hosts see the folder.
    workdir: str = ""
    #: Processes on each host (torch on GPU hosts: one per GPU); every one gets its rank and device.
    procs_per_host: int = 1
    protocol_version: int = PROTOCOL_VERSION

    @property
    def world_size(self) -> int:
        """How many processes the slice runs: one record set, one rank, each."""
        return self.hosts * self.procs_per_host

    def host_of(self, rank: int) -> int:
        """The host that runs process ``rank``."""
        return rank // self.procs_per_host

    def ranks_of(self, host: int) -> range:
        """The ranks host ``host`` runs."""
        return range(host * self.procs_per_host, (host + 1) * self.procs_per_host)

    def name_of(self, rank: int) -> str:
        """How a message names process ``rank`` (:func:`process_name`)."""
        return process_name(rank, self.procs_per_host)

    @property
    def coordinator_host(self) -> str:
        return self.coordinator_address.rsplit(":", 1)[0]

    @property
    def coordinator_port(self) -> int:
        return int(self.coordinator_address.rsplit(":", 1)[1])

    def to_json(self) -> bytes:
        return _to_json(self)

    @classmethod
    def from_json(cls, data: bytes) -> JobPlan:
        known = {field.name for field in dataclasses.fields(cls)}
        # Unknown fields are dropped, so a plan of another version still loads and is refused by its version.
        record = {key: value for key, value in json.loads(data).items() if key in known}
        record["env_names"] = tuple(record.get("env_names") or ())
        record["client_versions"] = dict(record.get("client_versions") or {})
        return cls(**record)


@dataclasses.dataclass(frozen=True)
class HostStatus:
    """``hosts/{i}/status.json``: where a host is, rewritten whenever that changes.

    Liveness is the separate ``heartbeat`` object's time in a listing, so a
    poller reads a status only when it really changed.
    """

    host_index: int
    state: str
    phase: str
    started_at: float
    updated_at: float
    pid: int
    hostname: str
    #: The first line of the error, for a failed or stopped host.
    message: str = ""
    #: The remote traceback of a failed host, so a panel needs no payload download.
    traceback: str = ""
    #: ``[phase, started_at]`` for every phase entered, in order: the timeline.
    history: list = dataclasses.field(default_factory=list)
    #: A session's host: the cell it is on (or last finished), and how that cell went on it.
    cell: int = 0
    cell_failed: bool = False
    #: A session's host: its last cell was stopped as asked (interrupted by the user, or at its timeout), not
    #: failed (``cell_failed`` is true as well: the cell did not succeed).
    cell_stopped: bool = False
    #: A session's host: the names its namespace holds after its last cell (what the notebook need not ship).
    names: list = dataclasses.field(default_factory=list)
    #: Counts the host's writes of this record: a reader never goes back to a lower one, so an older
    #: signed status replayed over the newest is ignored.
    revision: int = 0
    #: At a cell's end (``runner.memory.measure``): ``rss``, ``peak_rss`` and, where the framework reports
    #: them, ``device`` and ``device_peak``, in bytes.
    memory: dict = dataclasses.field(default_factory=dict)
    #: A failed host's failing frames and their variables, as text (``runner.frame_locals``).
    frame_locals: list = dataclasses.field(default_factory=list)
    #: A profiled cell's span on this host's clock, ``[start, end]`` (``runner.profiling``); empty otherwise.
    profiled: list = dataclasses.field(default_factory=list)

    def to_json(self) -> bytes:
        return _to_json(self)

    @classmethod
    def from_json(cls, data: bytes) -> HostStatus:
        known = {field.name for field in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in json.loads(data).items() if key in known})


@dataclasses.dataclass(frozen=True)
class ExitSummary:
    """``hosts/{i}/exit.json``: how a host's process ended, written by the backend."""

    host_index: int
    exit_code: int | None
    signal: str | None = None
    #: The host had recorded success before it ended (a crash then is a teardown warning).
    recorded_success: bool = False
    #: kinetic_nb stopped this host: its agent or backend (a cancel, another host's failure, a session's end),
    #: or the host itself at a barrier after another failed, as its status recorded. Never read from an exit
    #: code, which a cell's own ``os._exit(n)`` can produce.
    stopped: bool = False
    #: Why kinetic_nb stopped it, in the words its row shows: "interrupted", "at the job's timeout of 3 s",
    #: "after another host failed" (the default when a stopped host's record says nothing).
    stopped_because: str = ""
    ended_at: float = 0.0
    #: The platform's word for it, when it has one (a pod's OOMKilled, Evicted, Unschedulable).
    reason: str = ""
    #: The last lines the host wrote to stderr, for a host that died before it could report.
    stderr_tail: tuple[str, ...] = ()
    #: A storage error the host's agent met while recording the host (ENOSPC, EACCES, ...), named as such.
    storage_error: str = ""

    @property
    def failed(self) -> bool:
        """Whether this host failed on its own account.

        A host that ended without recording success failed, unless kinetic_nb
        stopped it (see ``stopped``).
        """
        return not (self.recorded_success or self.stopped)

    def describe(self) -> str:
        """How the process ended, as a verb phrase: "was killed by SIGKILL", "exited with code 1"."""
        if self.signal:
            how = f"was killed by {self.signal}"
        elif self.exit_code is None:
            how = "ended unrecorded"
        else:
            how = f"exited with code {self.exit_code}"
        if self.reason:
            how += f" ({self.reason})"
        if self.stopped:
            how += f" (stopped {self.stopped_because or 'after another host failed'})"
        if self.storage_error:
            how += f" (storage error: {self.storage_error})"
        return how

    def to_json(self) -> bytes:
        return _to_json(self)

    @classmethod
    def from_json(cls, data: bytes) -> ExitSummary:
        known = {field.name for field in dataclasses.fields(cls)}
        record = {key: value for key, value in json.loads(data).items() if key in known}
        record["stderr_tail"] = tuple(record.get("stderr_tail") or ())
        return cls(**record)


@dataclasses.dataclass(frozen=True)
class LeaderReady:
    """``.leader_ready``: the leader's verdict at the start barrier (a session's: whether its cells travel
    through the channel, every host having joined it; ``runner.channel``)."""

    go: bool
    failed_host: int | None = None
    failed_phase: str | None = None
    channel: bool = False

    def to_json(self) -> bytes:
        return _to_json(self)

    @classmethod
    def from_json(cls, data: bytes) -> LeaderReady:
        return cls(**json.loads(data))


@dataclasses.dataclass(frozen=True)
class FirstFailure:
    """``control/failed.json``: the first host failure an agent saw; every agent stops its hosts ``grace_s`` later."""

    host_index: int
    at: float
    description: str = ""

    def to_json(self) -> bytes:
        return _to_json(self)

    @classmethod
    def from_json(cls, data: bytes) -> FirstFailure:
        known = {field.name for field in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in json.loads(data).items() if key in known})


@dataclasses.dataclass(frozen=True)
class CancelRequest:
    """``control/cancel.json``: why the job is being stopped (``"timeout"`` when the plan's timeout passed)."""

    reason: str
    at: float

    TIMEOUT: ClassVar[str] = "timeout"
    #: The notebook decided the cell on one host's failure and stops the hosts still running it, at once.
    AFTER_FAILURE: ClassVar[str] = "another host failed"

    def to_json(self) -> bytes:
        return _to_json(self)

    @classmethod
    def from_json(cls, data: bytes) -> CancelRequest:
        record = json.loads(data)
        return cls(reason=str(record.get("reason", "")), at=float(record.get("at", 0.0)))


@dataclasses.dataclass(frozen=True)
class ResultPayload:
    """``result.pkl`` / ``result-worker-{i}.pkl``: a host's success or failure, as the client reads it.

    On the wire it is a cloudpickled dict (``to_dict``) keyed by the payload
    keys above: a success carries ``success``, ``result``, ``outputs``,
    ``phase`` and ``host_index`` (and ``missing_outputs`` when an ``--out``
    name was never bound); a failure carries ``success``,
    ``exception``, ``exception_type``, ``exception_message``, ``traceback``,
    ``phase``, ``host_index`` and ``stopped``, plus ``serialization_failed``
    and ``result_repr`` when the value could not be pickled. ``from_dict``
    ignores keys it does not know and defaults those that are missing.
    """

    success: bool
    host_index: int = LEADER_INDEX
    phase: str = ""
    #: The leader's value (a success).
    result: Any = None
    #: The ``--out`` variables, by name (a success).
    outputs: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: The exception, cloudpickled on its own so the payload stays readable when it cannot be rebuilt.
    exception: bytes | None = None
    exception_type: str = ""
    exception_message: str = ""
    traceback: str = ""
    stopped: bool = False
    serialization_failed: bool = False
    result_repr: str | None = None
    #: ``--out`` names the leader's cell never bound (a success still carries the rest).
    missing_outputs: tuple[str, ...] = ()
    #: A failure's frames and their variables, as text (``runner.frame_locals``): never a pickled value.
    frame_locals: tuple[dict, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """The dict that is cloudpickled into the payload object: the keys a host has always written."""
        if self.success:
            payload = {SUCCESS: True, RESULT_VALUE: self.result, OUTPUTS: self.outputs, PHASE: self.phase,
                       HOST_INDEX: self.host_index}
            if self.missing_outputs:
                payload[MISSING_OUTPUTS] = list(self.missing_outputs)
            return payload
        payload = {SUCCESS: False, EXCEPTION: self.exception, EXCEPTION_TYPE: self.exception_type,
                   EXCEPTION_MESSAGE: self.exception_message, TRACEBACK: self.traceback, PHASE: self.phase,
                   HOST_INDEX: self.host_index, STOPPED: self.stopped}
        if self.frame_locals:
            payload[FRAME_LOCALS] = list(self.frame_locals)
        if self.serialization_failed:
            payload[SERIALIZATION_FAILED] = True
            payload[RESULT_REPR] = self.result_repr
        return payload

    @classmethod
    def from_dict(cls, payload: dict[str, Any]) -> ResultPayload:
        """The record of an unpickled payload dict; unknown keys are ignored, missing ones defaulted.

        Raises
        ------
        TypeError
            When ``payload`` is not a dict.
        """
        if not isinstance(payload, dict):
            raise TypeError(f"a {type(payload).__name__}, not a dict")
        keys = {SUCCESS: "success", HOST_INDEX: "host_index", PHASE: "phase", RESULT_VALUE: "result",
                OUTPUTS: "outputs", EXCEPTION: "exception", EXCEPTION_TYPE: "exception_type",
                EXCEPTION_MESSAGE: "exception_message", TRACEBACK: "traceback", STOPPED: "stopped",
                SERIALIZATION_FAILED: "serialization_failed", RESULT_REPR: "result_repr",
                MISSING_OUTPUTS: "missing_outputs", FRAME_LOCALS: "frame_locals"}
        values = {field: payload[key] for key, field in keys.items() if key in payload}
        values["success"] = bool(values.get("success"))
        values["outputs"] = dict(values.get("outputs") or {})
        values["missing_outputs"] = tuple(values.get("missing_outputs") or ())
        values["frame_locals"] = tuple(values.get("frame_locals") or ())
        return cls(**values)


@dataclasses.dataclass(frozen=True)
class PostMortemRequest:
    """``cells/{seq}/post-mortem/{rank}-{n}.json``: the notebook asks ``rank`` to evaluate ``expression`` in the
    frame its cell ``seq`` failed in (``runner.post_mortem``): ``frame`` is ``raised`` (the innermost, as
    ``%debug``) or ``cell`` (the cell's own innermost). The answer, ``...-answer.json``, is
    ``{"ok": bool, "text": str}``."""

    expression: str
    frame: str = "raised"

    def to_json(self) -> bytes:
        return _to_json(self)

    @classmethod
    def from_json(cls, data: bytes) -> PostMortemRequest:
        record = json.loads(data)
        return cls(expression=str(record["expression"]), frame=str(record.get("frame", "raised")))


def stopped_message(host_index: int, phase: str) -> str:
    """The one line a host gives when it stops because ``host_index`` failed."""
    return f"stopped: host {host_index} failed while {phase_words(phase)}"
