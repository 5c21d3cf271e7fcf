"""The job protocol: object names, the plan, host records, payload keys, phases.

Every name a job's objects are stored under, and every key of the result
payload, is defined here once. The client imports this module; it imports only
the standard library, so the runner stays host-safe.

A job lives under ``{storage root}/{job_id}/``::

    plan.json                    client, once, before any host starts
    payload.pkl                  client, once
    (every object but the empty heartbeat and ready markers carries an HMAC under the job's key: runner.envelope)
    hosts/{i}/status.json        host i, whenever its state or phase changes
    hosts/{i}/heartbeat          host i, rewritten (empty) every few seconds while it lives
    hosts/{i}/log/{seq:06d}.json host i's stdout and stderr, append-only chunks of [stream, text] segments
    hosts/{i}/exit.json          host i's agent (or the backend, for what only the platform sees), when it ends
    hosts/{i}/stacks/{seq}.txt   host i's agent: every thread's Python stack, on request
    .leader_ready                the leader, after the start barrier (go or abort)
    control/cancel.json          a client or an agent: stop every host (the reason: cancelled, timeout)
    control/failed.json          the first agent to see one of its hosts fail (exclusive create)
    control/stacks-{seq}.json    a client: every agent dumps its live hosts' stacks
    result.pkl                   the leader only, success or failure
    result-worker-{i}.pkl        host i > 0, only when it fails
    outputs/                     the cell's files (KINETIC_OUTPUT_DIR)
    handle.json                  client, for listing and reattaching
    cancel.json                  client, when the job is cancelled
"""

from __future__ import annotations

import dataclasses
import enum
import json
import re
import typing
from typing import Any, ClassVar

#: Bumped whenever an object name, a payload key or a record's shape changes
#: incompatibly; a host refuses a plan with another version.
PROTOCOL_VERSION = 4

PLAN = "plan.json"
PAYLOAD = "payload.pkl"
LEADER_READY = ".leader_ready"
RESULT = "result.pkl"
HANDLE = "handle.json"
#: What steers every host's agent: one listing of this prefix per look, whatever the number of hosts.
CONTROL_DIR = "control"
CANCEL = f"{CONTROL_DIR}/cancel.json"
FAILED = f"{CONTROL_DIR}/failed.json"
OUTPUTS_DIR = "outputs"
HOSTS_DIR = "hosts"
#: What a pod installs before its agent starts (the prebuilt-image mode), each object signed:
#: ``install.json`` names the others (the notebook's kinetic_nb wheel, the user's requirements).
ENVIRONMENT_DIR = "environment"
ENVIRONMENT_INSTALL = f"{ENVIRONMENT_DIR}/install.json"

LEADER_INDEX = 0

_WORKER_RESULT_RE = re.compile(r"^result-worker-(\d+)\.pkl$")
_HOST_OBJECT_RE = re.compile(r"^hosts/(\d+)/(status\.json|exit\.json|heartbeat|log/(\d+)\.json|stacks/(\d+)\.txt)$")
_STACKS_REQUEST_RE = re.compile(r"^control/stacks-(\d+)\.json$")

#: The two streams of a host's output, as log chunks name them.
STDOUT = "out"
STDERR = "err"
#: A third kind of log segment: one rich output (``display(...)``, a figure) as the
#: JSON of ``{"data": {mime: ...}, "metadata": {...}}``, in its place among the lines.
DISPLAY = "display"
#: A host's rich output travels in-band on its stdout between these two
#: markers (an OSC escape sequence that no terminal acts on), so it keeps its
#: place among the lines printed around it; the agent's log writer lifts it out
#: into a ``DISPLAY`` segment. JSON escapes ESC, so the end marker cannot occur inside.
DISPLAY_START = "\x1b]kinetic-display;"
DISPLAY_END = "\x1b\\"


def worker_result(host_index: int) -> str:
    """Name of the failure payload of non-leader host ``host_index``."""
    return f"result-worker-{host_index}.pkl"


def result_object(host_index: int) -> str:
    """Name of the payload host ``host_index`` writes (``result.pkl`` for the leader)."""
    return RESULT if host_index == LEADER_INDEX else worker_result(host_index)


def host_status(host_index: int) -> str:
    return f"{HOSTS_DIR}/{host_index}/status.json"


def host_heartbeat(host_index: int) -> str:
    return f"{HOSTS_DIR}/{host_index}/heartbeat"


def host_exit(host_index: int) -> str:
    return f"{HOSTS_DIR}/{host_index}/exit.json"


def host_log_prefix(host_index: int) -> str:
    return f"{HOSTS_DIR}/{host_index}/log/"


def host_log_chunk(host_index: int, seq: int) -> str:
    return f"{host_log_prefix(host_index)}{seq:06d}.json"


def host_stacks(host_index: int, seq: int) -> str:
    """Where host ``host_index``'s agent puts its answer to stacks request ``seq``."""
    return f"{HOSTS_DIR}/{host_index}/stacks/{seq:06d}.txt"


def stacks_request(seq: int) -> str:
    return f"{CONTROL_DIR}/stacks-{seq:06d}.json"


def parse_stacks_request(name: str) -> int | None:
    """The sequence number of a ``control/stacks-{seq}.json`` name, else None."""
    match = _STACKS_REQUEST_RE.match(name)
    return int(match.group(1)) if match else None


def encode_log_chunk(segments: list[tuple[str, str]], cell: int = 0, *, end: bool = False) -> bytes:
    """A log chunk: ``[[stream, text], ...]`` in the order the host wrote them; a session's chunk also
    names its cell, and the cell's last chunk says so: ``{"cell": seq, "end": true, "segments": [...]}``."""
    pairs = [[stream, text] for stream, text in segments]
    if not cell:
        return json.dumps(pairs, ensure_ascii=False).encode()
    return json.dumps({"cell": cell, "end": end, "segments": pairs}, ensure_ascii=False).encode()


class LogChunk(typing.NamedTuple):
    cell: int
    segments: list[tuple[str, str]]
    #: The last chunk of its cell: whatever the host printed during the cell is stored.
    end: bool = False


def decode_log_chunk_of_cell(data: bytes) -> LogChunk:
    """A log chunk with its cell (0 outside a session); text that is not a chunk counts as stdout."""
    try:
        record = json.loads(data)
        if isinstance(record, dict):
            return LogChunk(int(record.get("cell", 0)), [(str(s), str(t)) for s, t in record["segments"]],
                            bool(record.get("end")))
        return LogChunk(0, [(str(stream), str(text)) for stream, text in record])
    except (ValueError, TypeError, KeyError):
        return LogChunk(0, [(STDOUT, data.decode(errors="replace"))])


def decode_log_chunk(data: bytes) -> list[tuple[str, str]]:
    """The ``(stream, text)`` segments of a log chunk."""
    return decode_log_chunk_of_cell(data).segments


def parse_worker_result(name: str) -> int | None:
    """The host index of a ``result-worker-{i}.pkl`` name, else None."""
    match = _WORKER_RESULT_RE.match(name)
    return int(match.group(1)) if match else None


def parse_host_object(name: str) -> tuple[int, str, int | None] | None:
    """Split ``hosts/{i}/...`` into (host index, kind, sequence).

    ``kind`` is ``"status"``, ``"exit"``, ``"heartbeat"``, ``"log"`` or
    ``"stacks"`` (the last two with their sequence number); other names give None.
    """
    match = _HOST_OBJECT_RE.match(name)
    if not match:
        return None
    if match.group(3) is not None:
        return int(match.group(1)), "log", int(match.group(3))
    if match.group(4) is not None:
        return int(match.group(1)), "stacks", int(match.group(4))
    kind = {"status.json": "status", "exit.json": "exit", "heartbeat": "heartbeat"}[match.group(2)]
    return int(match.group(1)), kind, None


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


class HostState(str, enum.Enum):
    """What the panel and ``JobHandle.hosts()`` say about a host."""

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

# Keys of the cell payload (payload.pkl, a cloudpickled dict).
CELL_SOURCE = "source"
CELL_FILENAME = "filename"
CELL_NAMESPACE = "namespace"  # {name: cloudpickled bytes}, unpickled one by one on the host
CELL_OUT_NAMES = "out"

# Exit codes of ``python -m kinetic_nb.runner``.
EXIT_OK = 0
EXIT_FAILED = 1
#: The host stopped on purpose because another host failed first.
EXIT_STOPPED = 3


def _to_json(record: Any) -> bytes:
    return json.dumps(dataclasses.asdict(record), sort_keys=True, indent=1).encode()


@dataclasses.dataclass(frozen=True)
class JobPlan:
    """The one immutable plan every host receives, as ``plan.json``."""

    job_id: str
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
    protocol_version: int = PROTOCOL_VERSION

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
    #: A session's host: the names its namespace holds after its last cell (what the notebook need not ship).
    names: list = dataclasses.field(default_factory=list)
    #: Counts the host's writes of this record: a reader never goes back to a lower one, so an older
    #: signed status replayed over the newest is ignored.
    revision: int = 0

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
    #: The backend stopped this host because another host failed first.
    stopped: bool = False
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

        A host that ended without recording success failed, unless it was
        stopped (by the backend, or by itself at the barrier) after another
        host failed first.
        """
        return not (self.recorded_success or self.stopped or self.exit_code == EXIT_STOPPED)

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
            how += " (stopped after another host failed)"
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
    """``.leader_ready``: the leader's verdict at the start barrier."""

    go: bool
    failed_host: int | None = None
    failed_phase: str | None = None

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
                MISSING_OUTPUTS: "missing_outputs"}
        values = {field: payload[key] for key, field in keys.items() if key in payload}
        values["success"] = bool(values.get("success"))
        values["outputs"] = dict(values.get("outputs") or {})
        values["missing_outputs"] = tuple(values.get("missing_outputs") or ())
        return cls(**values)


# -- sessions: a slice kept up across cells ------------------------------------------------------

SESSIONS_DIR = "sessions"
CELLS_DIR = "cells"
#: Carried to the host's agent in-band on stdout when a session's host starts a cell: its log chunks
#: from there on belong to that cell. Unprintable framing that no program prints by accident.
CELL_MARK = "\x1ekinetic-cell:{seq}\x1e"
#: Printed when the cell ends: the agent stores the cell's output at once, marked as its last.
CELL_END_MARK = "\x1ekinetic-cell-end:{seq}\x1e"
CELL_MARK_RE = re.compile("\x1ekinetic-cell(-end)?:(\\d+)\x1e")


def cell_dir(seq: int) -> str:
    """Where cell ``seq`` of a session keeps its payload and its outcome."""
    return f"{CELLS_DIR}/{seq:06d}"


def cell_ready(host_index: int) -> str:
    """Host ``host_index`` has loaded the cell and waits at its barrier (inside the cell's directory)."""
    return f"ready-{host_index}"


def cell_control(seq: int, what: str) -> str:
    """``control/cell-{seq}-{what}.json``: ``submitted`` (a cell is waiting), ``failed``, ``interrupt``."""
    return f"{CONTROL_DIR}/cell-{seq:06d}-{what}.json"


_CELL_CONTROL_RE = re.compile(r"^control/cell-(\d+)-(\w+)\.json$")


def parse_cell_control(name: str) -> tuple[int, str] | None:
    match = _CELL_CONTROL_RE.match(name)
    return (int(match.group(1)), match.group(2)) if match else None


def stopped_message(host_index: int, phase: str) -> str:
    """The one line a host gives when it stops because ``host_index`` failed."""
    return f"stopped: host {host_index} failed in phase {phase}"
