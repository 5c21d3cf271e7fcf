"""One process of the slice: its plan check, and how it reports what happened.

startup -> plan check, then the group's cells (``runner.group``): payload
load -> barrier -> distributed init -> execute -> result serialization ->
result upload, then teardown (a one-shot job) or idle (a session). A failure
in any phase writes this host's failure payload naming the phase, at once; a
one-shot job's host then exits without waiting on its peers. Only the leader
writes ``result.pkl``; a worker writes ``result-worker-{i}.pkl`` only when it
fails.
"""

from __future__ import annotations

import copy
import logging
import os
import sys
import traceback
from typing import Any

import cloudpickle

from kinetic_nb.errors import PlanError, RemoteHostError, ResultSerializationError
from kinetic_nb.runner import envelope, frameworks, marks, protocol, versions
from kinetic_nb.runner.cell import run_cell
from kinetic_nb.runner.channel import announced_address
from kinetic_nb.runner.frame_locals import frame_locals
from kinetic_nb.runner.group import CellGroup
from kinetic_nb.runner.host_variables import HOST_INDEX_VARIABLES, RANK_VARIABLE, resolve_rank
from kinetic_nb.runner.job_keys import KEY_ENV, key_from_environment
from kinetic_nb.runner.protocol import HostState, JobPlan, Phase, ResultPayload, phase_words
from kinetic_nb.runner.redact import Redactor, host_secrets
from kinetic_nb.runner.relayed import Relay, RelayedStorage
from kinetic_nb.runner.stacks import enable_stack_dumps
from kinetic_nb.runner.status import StatusReporter
from kinetic_nb.runner.workdir import enter_workdir
from kinetic_nb.storage import Storage, open_storage, patiently

logger = logging.getLogger(__name__)

__all__ = ["HostRun", "cell_traceback", "exception_type_name", "run_cell", "run_host"]

#: A repr longer than this is cut: it travels in an error message.
_MAX_REPR = 2000


def run_host(job_uri: str, key: bytes | None = None) -> int:
    """Run this host's part of the job at ``job_uri``; return the process exit code.

    The host's agent collects this process's output and records how it ended.
    ``key`` is the job's key, handed over in memory by the agent that forked
    this host; without it, the key is taken out of the environment
    (``python -m kinetic_nb.runner``) before any user code runs.
    """
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=True)
    enable_stack_dumps()
    from_environment = key_from_environment(os.environ)  # out of the environment before any user code runs
    key = key if key is not None else from_environment
    key_hex = key.hex() if key is not None else None
    storage = open_storage(job_uri)
    host_index = resolve_rank(os.environ)  # its rank: the host's index where each host runs one process
    relay = None
    if announced_address() is not None and storage.local_path() is None:
        # A session's host whose hub listens nearby: its records go through the channel once it is joined.
        relay = Relay(storage, serves=lambda name: name.startswith(protocol.CELLS_DIR + "/"),
                      holds=protocol.is_cell_marker)
        storage = RelayedStorage(relay)
    try:
        return HostRun(storage, host_index, key, key_hex=key_hex).run()
    finally:
        if relay is not None:
            relay.close()  # what waits to be stored is stored before the host ends


def exception_type_name(exc: BaseException) -> str:
    cls = type(exc)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def cell_traceback(exc: BaseException, filename: str) -> str:
    """The traceback text from the cell's first frame on (all frames if the cell never ran)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != filename:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb or exc.__traceback__))


def _shippable_exception(exc: BaseException, redactor: Redactor) -> bytes:
    """The exception pickled, its secrets masked; one that cannot be is replaced by a RemoteHostError.

    The pickled bytes are checked for every secret: an exception that keeps
    one where masking its arguments cannot reach travels as its type and its
    masked message only.
    """
    substitute = RemoteHostError(redactor.text(f"{exception_type_name(exc)}: {exc}"))
    try:
        masked = _masked(exc, redactor) if redactor else exc
        data = cloudpickle.dumps(masked)
        cloudpickle.loads(data)
    except Exception as error:  # noqa: BLE001 - whatever stops it, the substitute travels
        substitute = RemoteHostError(f"{substitute} (could not be pickled: {error})")
        return cloudpickle.dumps(substitute)
    if any(secret.encode() in data for secret in redactor.secrets):
        return cloudpickle.dumps(substitute)
    return data


def _masked(exc: BaseException, redactor: Redactor) -> BaseException:
    """A copy of ``exc`` whose string arguments and notes have their secrets masked."""
    masked = copy.copy(exc)
    masked.args = tuple(redactor.text(arg) if isinstance(arg, str) else arg for arg in exc.args)
    if getattr(exc, "__notes__", None):
        masked.__notes__ = [redactor.text(note) for note in exc.__notes__]
    return masked


def _describe(value: Any) -> str:
    cls = type(value)
    name = cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    return f"a {name}"


def _safe_repr(value: Any) -> str:
    try:
        text = repr(value)
    except Exception as error:  # noqa: BLE001 - a user's __repr__ may raise anything
        text = f"<repr failed: {error!r}>"
    return text if len(text) <= _MAX_REPR else text[:_MAX_REPR] + "..."


class HostRun:
    """The phases of one host, with the records they leave behind."""

    def __init__(self, storage: Storage, host_index: int | None, key: bytes | None, *, key_hex: str | None = None):
        self.storage = storage
        #: The job's key: records are verified before use and signed when written. Without it, nothing is.
        self.key = key
        self._key_hex = key_hex
        self.redactor = Redactor(())
        self.index_was_given = host_index is not None
        self.host_index = host_index if host_index is not None else protocol.LEADER_INDEX
        self.is_leader = self.host_index == protocol.LEADER_INDEX
        self.status = StatusReporter(storage, self.host_index, key)
        self.filename = "<kinetic cell>"
        self.plan: JobPlan | None = None
        self.phase = Phase.STARTUP
        self.failure_reported = False
        #: Where this host's outcome goes, under which key: the job's own; a session's current cell's.
        self.outcome_storage = storage
        self.outcome_key = key
        self.failure_line = ""
        #: The remote traceback of this host's failure (none for a host stopped because another failed).
        self.failure_traceback = ""
        #: Its failing frames' variables, as text (``runner.frame_locals``), and the failure itself, kept by a
        #: session's host for ``%kinetic pm`` until its next cell.
        self.failure_locals: list[dict] = []
        self.failure: BaseException | None = None
        #: A phase entered is written at once (None), or after this many seconds unless a write came first:
        #: a session's cell spends milliseconds in each, and each write is a storage request on every host.
        self.status_defer_s: float | None = None

    @property
    def raw_secrets(self) -> frozenset[bytes | str]:
        """Values a local may hold that the redactor's text forms miss: the key's bytes."""
        return frozenset({self.key}) if self.key else frozenset()

    def begin_cell(self, storage: Storage, key: bytes) -> None:
        """A session's next cell: its outcome goes to ``storage`` under ``key``, and nothing of the last
        cell's failure carries over."""
        self.outcome_storage, self.outcome_key = storage, key
        self.failure_reported = False
        self.failure_line = self.failure_traceback = ""
        if self.failure is not None:  # the last failure's frames, and what they hold (device memory), let go now:
            traceback.clear_frames(self.failure.__traceback__)  # they sit in a cycle no refcount would free
        self.failure_locals, self.failure = [], None
        self.phase = Phase.PAYLOAD_LOAD

    def enter(self, phase: Phase, state: HostState | None = None) -> None:
        self.phase = phase
        self.status.update(state=state, phase=phase, record=self.status_defer_s is None, defer_s=self.status_defer_s)

    def run(self) -> int:
        """Check the plan, then run this host's part of the group: the one cell of a one-shot job, or a
        session's cells (``runner.group``)."""
        try:
            self.status.start()
            self.enter(Phase.PLAN_CHECK)
            self.plan = self._check_plan()
            if self.plan.workdir:  # hosts that do not share the notebook's disk run in a copy of its folder
                enter_workdir(self.storage, self.key, self.plan.workdir, self.plan.job_id)
        except BaseException as error:  # noqa: BLE001 - SystemExit and KeyboardInterrupt are failures too
            self.report_failure(error)
            return protocol.EXIT_FAILED
        return CellGroup(self).serve()

    def _check_plan(self) -> JobPlan:
        if self.key is None:
            raise PlanError(f"no job key in this host's environment ({KEY_ENV}): it cannot verify the plan, "
                            "and refuses to run a job it cannot verify")
        plan = JobPlan.from_json(envelope.read_sealed(self.storage, protocol.PLAN, self.key))
        if plan.protocol_version != protocol.PROTOCOL_VERSION:
            raise PlanError(
                f"the plan speaks protocol version {plan.protocol_version}, this host's kinetic_nb "
                f"speaks {protocol.PROTOCOL_VERSION}: install the same kinetic_nb version everywhere"
            )
        shape = f"a {plan.hosts}-host job" + (f" of {plan.world_size} processes" if plan.procs_per_host > 1 else "")
        if not self.index_was_given and plan.world_size > 1:
            raise PlanError(f"no host index or rank in the environment "
                            f"({', '.join((RANK_VARIABLE, *HOST_INDEX_VARIABLES))}) for {shape}")
        if self.host_index >= plan.world_size:
            raise PlanError(f"{'rank' if plan.procs_per_host > 1 else 'host index'} {self.host_index} is out of "
                            f"range for {shape}")
        here = versions.installed_versions()
        refused = versions.refusal(plan.client_versions, here)
        if refused:
            raise PlanError(refused)
        for note in versions.framework_notes(plan.client_versions, here):
            print(f"kinetic_nb: {note}", file=sys.stderr)
        self.redactor = host_secrets(self._key_hex, plan.env_names)
        return plan

    def report_success(self, value: Any, namespace: dict[str, Any], out_names: list[str]) -> None:
        self.enter(Phase.RESULT_SERIALIZATION)
        # A name the cell did not bind after all (a branch not taken) costs only itself: the client warns.
        missing = tuple(name for name in out_names if name not in namespace)
        outputs = {name: namespace[name] for name in out_names if name in namespace}
        payload = ResultPayload(success=True, result=value, outputs=outputs, phase=Phase.EXECUTE.value,
                                host_index=self.host_index, missing_outputs=missing)
        # Pickled into a spool, signed in the same pass, and streamed up: a large
        # value is not held twice in memory (the object and its bytes).
        with envelope.spool() as pickled:
            sealing = envelope.SealingWriter(pickled, self.outcome_key, protocol.RESULT)
            try:
                cloudpickle.dump(payload.to_dict(), sealing)
            except Exception as error:
                self._report_unpicklable(value, outputs, error)
                raise
            self.enter(Phase.RESULT_UPLOAD)
            with patiently():  # the cell's outcome: ridden out however long storage has failed
                self.outcome_storage.write_file(protocol.RESULT, sealing.stored(), exclusive=True)

    def _report_unpicklable(self, value: Any, outputs: dict[str, Any], error: Exception) -> None:
        """Name what could not be pickled, and ship its repr instead."""
        culprit, what = value, "the leader's value"
        for name, output in outputs.items():
            try:
                cloudpickle.dumps(output)
            except Exception:  # noqa: BLE001 - any pickling error names this variable
                culprit, what = output, f"the --out variable {name!r}"
                break
        text = _safe_repr(culprit)
        failure = ResultSerializationError(f"{what} ({_describe(culprit)}) could not be pickled: {error}; its repr: {text}")
        failure.__cause__ = error
        self.report_failure(failure, serialization_failed_repr=text)

    def report_failure(
        self, error: BaseException, *, stopped: bool = False, serialization_failed_repr: str | None = None
    ) -> None:
        """Write this host's failure payload and final status, at once."""
        if self.failure_reported:
            return  # the first report, nearest the cause, stands
        self.failure_reported = True
        state = HostState.STOPPED if stopped else HostState.FAILED
        first_line = self.failure_line = self.redactor.text(f"{exception_type_name(error)}: {error}".splitlines()[0])
        remote_traceback = self.redactor.text(cell_traceback(error, self.filename))
        self.failure_traceback = "" if stopped else remote_traceback
        if not stopped:
            self.failure = error
            self.failure_locals = [frame.to_dict() for frame in
                                   frame_locals(error, self.filename, self.redactor, self.raw_secrets)]
        self.status.update(state=state, phase=self.phase, message=first_line, traceback=self.failure_traceback,
                           frame_locals=self.failure_locals)
        # One line in the log: the traceback travels in the payload, and the
        # leader's log is echoed into the cell, which raises it anyway. A stop
        # the user asked for says nothing there: its record and row say it.
        name = self.plan.name_of(self.host_index) if self.plan is not None else f"host {self.host_index}"
        if not stopped and frameworks.lost_a_peer(first_line):
            # A peer's failure, as the framework says it (and says again as it winds down): the host's log keeps
            # it, the cell's output and the host's row do not (its row shows its failure's own line).
            marks.framework_teardown_starts()
        if not (stopped and isinstance(error, KeyboardInterrupt)):  # an interrupt asked for: its row says it
            print(f"{name} {'stopped' if stopped else 'failed'} while {phase_words(self.phase)}: {first_line}",
                  file=sys.stderr)
        if stopped and not self.is_leader:
            return  # a stopped worker reports nothing: it did not fail on its own
        if self.key is None:
            self.status.stop()
            return  # nothing can be signed: the status and the exit record say why
        in_session = self.plan is not None and self.plan.session
        payload = ResultPayload(
            success=False,
            exception=_shippable_exception(error, self.redactor),
            exception_type=exception_type_name(error),
            exception_message=self.redactor.text(str(error)),
            traceback=remote_traceback,
            phase=self.phase.value,
            host_index=self.host_index,
            stopped=stopped,
            serialization_failed=serialization_failed_repr is not None,
            result_repr=serialization_failed_repr,
            frame_locals=tuple(self.failure_locals),
        )
        try:
            name = protocol.result_object(self.host_index)
            with patiently():
                envelope.write_sealed(self.outcome_storage, name, self.outcome_key,
                                      cloudpickle.dumps(payload.to_dict()), exclusive=True)
        except Exception:
            logger.exception("host %d could not write its failure payload", self.host_index)
        finally:
            if not in_session:  # a session's host lives on after a failed cell
                self.status.stop()

    def tear_down(self) -> None:
        """Leave the framework's group; a problem now is a warning, the outcome is recorded.

        What is printed from here on (gloo's "Connection closed by peer" when
        a peer failed, NCCL's abort, the warning below) is the framework's
        teardown: kept in the host's log, never echoed into the cell nor shown
        as the row's last line of a host that succeeded.
        """
        if frameworks.joins_a_group(self.plan):
            marks.framework_teardown_starts()
        try:
            frameworks.shut_down(self.plan)
        except BaseException as error:  # noqa: BLE001
            print(f"{self.plan.name_of(self.host_index)}: teardown after success failed: {error!r}", file=sys.stderr)
        finally:
            self.status.stop()
