"""Turn a finished job's host records into the cell's value or exception.

The rules (DESIGN, "How the client turns host records into the cell's outcome"):

1. The leader's payload reports a failure: raise the leader's exception.
2. The leader's payload reports success and the job SUCCEEDED: return its
   value. Worker objects are never listed.
3. The leader reports success but the job FAILED: raise the lowest-indexed
   failing host's exception, with a note naming the other failing hosts.
4. No leader payload: the same worker rule; if no host wrote a payload, an
   error naming the missing object and every host's exit summary.
5. Only the payload that is re-raised is downloaded; unreadable or
   success-claiming worker payloads are skipped with a warning. Single-host
   jobs skip the listing. A listing that fails never becomes the error: it is
   a warning and a note, and the job's failure is raised from what is known
   (the leader's payload, the hosts' exit summaries and last log lines).
   A leader payload that exists but cannot be unpickled in this process is
   reported as such (``UnreadableResultError``), never as missing.
6. Root cause first: a failure that is a known consequence of losing a peer
   ranks after a host's own failure.

A re-raised host exception that failed outside the cell's code carries a note
saying when, in a user's words ("It failed while loading the cell, before the
cell's code ran"), for the leader and for a worker.

Messages name the cell as the notebook does (``In[5]``) and where to look (the
job or session id, ``%kinetic logs``), never a storage object.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import warnings
from collections.abc import Callable, Collection, Mapping

import cloudpickle

from kinetic_nb.client.remote_traceback import render_remote_traceback
from kinetic_nb.errors import (
    HostExitError,
    IntegrityError,
    JobCancelledError,
    JobFailedError,
    KineticWarning,
    ObjectNotFoundError,
    RemoteHostError,
    UnreadableResultError,
)
from kinetic_nb.runner import protocol
from kinetic_nb.runner.envelope import load_payload
from kinetic_nb.runner.frame_locals import FrameLocals, locals_notes
from kinetic_nb.runner.protocol import ExitSummary, JobPlan, Phase, ResultPayload
from kinetic_nb.state import JobStatus, is_peer_loss, phase_words
from kinetic_nb.storage import ObjectInfo, Storage

logger = logging.getLogger(__name__)

#: A session cell's id (``ks-…/cells/000002``): messages name its session, never its storage folder.
_SESSION_CELL = re.compile(r"^(?P<session>[^/]+)/cells/(?P<seq>\d+)$")
#: The protocol's phases in order: a failure before the cell's code ran, or after.
_PHASE_ORDER = [phase.value for phase in Phase]


def cell_words(job_id: str, cell: str = "") -> str:
    """How a message names a cell: ``In[5] (job kn-…)``, ``In[5] (session ks-…)``.

    Parameters
    ----------
    job_id : str
        The cell's id: a one-shot job's, or ``{session}/cells/{seq}`` for a session's cell.
    cell : str
        The cell as the notebook knows it (``In[5]``); "" for a cell from the API, then named by its number
        in its session (``cell 2 of session ks-…``) or by its job.

    Returns
    -------
    str
    """
    session = _SESSION_CELL.match(job_id)
    place = f"session {session['session']}" if session else f"job {job_id}"
    if cell:
        return f"{cell} ({place})"
    return f"cell {int(session['seq'])} of {place}" if session else place


def _logs_hint(job_id: str, host_index: int) -> str:
    """Where a host's whole output is: a one-shot job's by its id; a session's cell, which no id names, as the
    notebook's last cell (``%kinetic logs`` with no id)."""
    if _SESSION_CELL.match(job_id):
        return f" %kinetic logs --host {host_index} shows its output until the next %%kinetic cell."
    return f" %kinetic logs {job_id} --host {host_index} shows its output."


@dataclasses.dataclass
class HostFailure:
    """One host's payload record, where it was read from, and what the rules ask of it."""

    host_index: int
    payload: ResultPayload
    uri: str
    #: How messages name it: ``host 2``, or ``host 1, process 0 (rank 2)`` (``JobPlan.name_of``).
    name: str = ""

    def __post_init__(self) -> None:
        self.name = self.name or f"host {self.host_index}"

    @property
    def stopped(self) -> bool:
        return self.payload.stopped

    @property
    def type_name(self) -> str:
        return self.payload.exception_type

    @property
    def message(self) -> str:
        return self.payload.exception_message

    @property
    def is_consequence(self) -> bool:
        """A follow-on of another host's failure (rule 6), not this host's own."""
        return self.stopped or is_peer_loss(f"{self.type_name}: {self.message}")

    def exception(self, job_id: str = "") -> BaseException:
        """The remote exception as its own type, carrying the remote traceback."""
        try:
            error = cloudpickle.loads(self.payload.exception)
        except Exception:  # noqa: BLE001 - whatever stops it, the type name and message still tell
            error = RemoteHostError(f"{self.type_name}: {self.message}")
        if isinstance(error, SystemExit):  # from a host that predates HostExitError: never end the caller
            code, error = error.code, HostExitError(f"the cell on {self.name} exited with SystemExit")
            error.code = code
        attach_remote_traceback(error, self.payload.traceback, self.name, job_id)
        return error


class RemoteTraceback(Exception):
    """Carries a host's traceback text as the cause of the re-raised exception."""

    def __init__(self, text: str):
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return f'\n"""\n{self.text.rstrip()}\n"""'


def attach_remote_traceback(error: BaseException, text: str, host: int | str, job_id: str) -> None:
    """Show the frames of ``host`` (its index, or its name: ``host 1, process 0 (rank 2)``): as the cause in
    plain Python, as the whole traceback in IPython."""
    if not text:
        return
    error.__cause__ = RemoteTraceback(text)

    def render_traceback() -> list[str]:
        return render_remote_traceback(text, type(error).__name__, host if isinstance(host, str) else f"host {host}",
                                       list(getattr(error, "__notes__", ())))

    try:
        error._render_traceback_ = render_traceback  # IPython shows this instead of local frames
    except (AttributeError, TypeError):
        pass


def read_leader(storage: Storage, key: bytes | None) -> HostFailure | None:
    """The leader's own payload as it recorded it (success or failure), or None while it has recorded nothing:
    what ``leader_result()`` of a job or a cell reads, whatever the other hosts did."""
    return read_failure(storage, protocol.RESULT, protocol.LEADER_INDEX, warn=False, strict=True, key=key)


def read_failure(storage: Storage, name: str, host_index: int, *, warn: bool, key: bytes | None,
                 strict: bool = False, host_name: str = "") -> HostFailure | None:
    """Download and decode one payload into its record; skip an unreadable or success-claiming one.

    Parameters
    ----------
    storage : Storage
        The job's storage.
    name : str
        The payload object (``result.pkl`` or ``result-worker-{i}.pkl``); messages never name it.
    host_index : int
        The host that wrote it.
    warn : bool
        Warn (``KineticWarning``) when an unreadable payload is skipped.
    key : bytes or None
        The job's key: the payload is verified before it is unpickled, and
        ``IntegrityError`` raised when it does not verify. None reads a job
        from before signing, only when the caller chose to trust it.
    strict : bool
        Raise ``UnreadableResultError`` for a payload that exists but cannot
        be unpickled here, instead of skipping it.
    host_name : str
        How messages name the host (default ``host {host_index}``).

    Returns
    -------
    HostFailure or None
        The ``ResultPayload`` record with where it came from; None when the
        object is missing, unreadable, or a worker's that claims success.
    """
    uri = f"{storage.uri}/{name}"
    host_name = host_name or f"host {host_index}"
    try:
        payload = ResultPayload.from_dict(load_payload(storage, name, key))  # streamed, verified first
    except ObjectNotFoundError:
        return None
    except IntegrityError:
        raise  # never skipped as merely unreadable: the caller says which object failed and why
    except Exception as error:
        if strict:
            raise UnreadableResultError(
                f"{host_name} recorded its outcome, but it cannot be unpickled here: "
                f"{type(error).__name__}: {error} (a class or module the hosts have and this notebook lacks?)"
            ) from error
        if warn:
            warnings.warn(f"skipping the unreadable outcome of {host_name}: {error}", KineticWarning, 3)
        return None
    if payload.success and host_index != protocol.LEADER_INDEX:
        warnings.warn(f"skipping the outcome of {host_name}: a worker's that claims success", KineticWarning, 3)
        return None
    return HostFailure(host_index, payload, uri, host_name)


def _hosts_text(indices: list[int]) -> str:
    return protocol.host_ranges(indices, limit=protocol.MAX_RANGES)


def _raise_host_failure(failure: HostFailure, job_id: str, others: list[int], extra: list[str] = (),
                        *, many: str = "hosts", cell: str = "") -> None:
    error = failure.exception(job_id)
    note = f"Reported by {failure.name} of {cell_words(job_id, cell)}.{_logs_hint(job_id, failure.host_index)}"
    if others:
        note += f" Other {many} that also reported a failure: {_hosts_text(others)}."
    error.add_note(note)
    _add_notes(error, [*_phase_notes(failure), *extra])
    raise error from error.__cause__


def _raise_leader_failure(failure: HostFailure, job_id: str, extra: list[str] = ()) -> None:
    error = failure.exception(job_id)
    _add_notes(error, [*_phase_notes(failure), *extra])
    raise error from error.__cause__


def _raise_tampered(error: IntegrityError, next_verified: HostFailure | None) -> None:
    error.add_note("Nothing was unpickled from it.")
    if next_verified is not None:
        error.add_note(f"The next verified failure: {next_verified.name}: "
                       f"{next_verified.type_name}: {next_verified.message}")
    raise error


def _phase_notes(failure: HostFailure) -> list[str]:
    """When it failed, if not in the cell's code (whose traceback says where), then the first few variables of
    its failing frame (text its host made)."""
    frames = [frame for record in failure.payload.frame_locals if (frame := FrameLocals.from_dict(record))]
    return [*phase_note(failure.payload.phase), *locals_notes(frames, failure.name)]


def phase_note(phase: str) -> list[str]:
    """``["It failed while loading the cell, before the cell's code ran."]``; nothing for a failure in the
    cell's code (or with no phase recorded)."""
    if not phase or phase == Phase.EXECUTE.value:
        return []
    if phase not in _PHASE_ORDER:
        return [f"It failed while {phase_words(phase)}."]
    when = "before" if _PHASE_ORDER.index(phase) < _PHASE_ORDER.index(Phase.EXECUTE.value) else "after"
    return [f"It failed while {phase_words(phase)}, {when} the cell's code ran."]


def _add_notes(error: BaseException, notes: list[str]) -> None:
    for note in notes:
        error.add_note(note)


def _list_failing_hosts(list_job: Callable[[], list[ObjectInfo]], where: str) -> tuple[list[int], list[str]]:
    """The hosts whose failure payload is listed, and the notes to add when the listing itself failed.

    The listing's own error never replaces the job's failure (a bucket briefly
    unreachable, a permission error on a reattach): it is a warning, and the
    failure is built from what is known without it.
    """
    try:
        listing = list_job()
    except Exception as error:  # noqa: BLE001 - a listing's failure is a warning, never the job's error
        message = f"could not list the hosts' outcomes of {where}: {type(error).__name__}: {error}"
        warnings.warn(message, KineticWarning, 3)
        return [], [message[0].upper() + message[1:] + "; the hosts are described by how they ended."]
    return sorted(index for info in listing if (index := protocol.parse_worker_result(info.name)) is not None), []


def warn_missing_outputs(payload: ResultPayload, job_id: str, cell: str = "") -> None:
    """Warn about ``--out`` names the leader's cell did not bind when it ran (the value and the rest still come)."""
    if payload.missing_outputs:
        warnings.warn(f"-o/--out {', '.join(payload.missing_outputs)}: not bound on the leader when "
                      f"{cell_words(job_id, cell)} ended, so not brought back; the cell's value and other variables "
                      "were", KineticWarning, 4)


def warn_teardown_crashes(exits: Mapping[int, ExitSummary]) -> None:
    for index in sorted(exits):
        summary = exits[index]
        if summary.recorded_success and (summary.signal or summary.exit_code not in (0, None)):
            warnings.warn(
                f"host {index} ended badly after recording success ({summary.describe()}); the outcome stands",
                KineticWarning,
                3,
            )


def resolve_outcome(
    storage: Storage,
    plan: JobPlan,
    status: JobStatus,
    exits: Mapping[int, ExitSummary],
    list_job: Callable[[], list[ObjectInfo]],
    describe_host: Callable[[int], str],
    lost: Collection[int] = (),
    *,
    key: bytes | None,
    cell: str = "",
) -> ResultPayload:
    """The leader's success payload record, or raise the right host's exception.

    Every payload is verified under the job's ``key`` before it is unpickled
    (``key=None`` only for a job from before signing that the caller chose to
    trust). A payload that fails verification is never unpickled: when it is
    the one that would be raised (the leader's, or the lowest failing
    worker's), ``IntegrityError`` names it, with the next verified host's
    error as a note.

    ``list_job`` is called at most once, and never for a succeeded or
    single-host job; ``describe_host(i)`` gives host i's exit summary and
    last log lines for the no-payload error; ``lost`` are hosts whose
    heartbeat stopped with no exit record. Called before every host has
    ended, it decides on the records so far (the client does that once a
    host has failed on its own account). ``cell`` is how the notebook names
    the cell (``In[5]``), for the messages.
    """
    where = cell_words(plan.job_id, cell)
    warn_teardown_crashes(exits)
    tampered: IntegrityError | None = None  # the first payload that failed verification, leader first
    unreadable_leader: UnreadableResultError | None = None
    try:
        leader = read_leader(storage, key)
    except IntegrityError as error:
        leader, tampered = None, error
    except UnreadableResultError as error:
        leader, unreadable_leader = None, error
    if tampered is not None and (status is JobStatus.SUCCEEDED or plan.world_size == 1):
        raise tampered  # a leader "success" that does not verify never returns a value
    if unreadable_leader is not None and (status is JobStatus.SUCCEEDED or plan.world_size == 1):
        raise unreadable_leader
    leader_ok = leader is not None and leader.payload.success
    if leader is not None and not leader_ok and not leader.is_consequence:
        _raise_leader_failure(leader, plan.job_id)  # rule 1
    if leader_ok and status is JobStatus.SUCCEEDED:
        warn_missing_outputs(leader.payload, plan.job_id, cell)
        return leader.payload  # rule 2
    if status is JobStatus.CANCELLED:
        raise JobCancelledError(f"{where} was cancelled")
    if plan.world_size == 1:
        if leader is not None and not leader_ok:
            _raise_leader_failure(leader, plan.job_id)
        raise _no_payload_error(where, plan, [protocol.LEADER_INDEX], describe_host, leader_ok, exits)

    # Rules 3, 4 and 6: the lowest-indexed host that failed on its own account.
    failing, listing_notes = _list_failing_hosts(list_job, where)
    consequence: HostFailure | None = None
    for index in failing:
        try:
            failure = read_failure(storage, protocol.worker_result(index), index, warn=True, key=key,
                                   host_name=plan.name_of(index))
        except IntegrityError as error:
            tampered = tampered or error
            continue
        if failure is None:
            continue
        if failure.is_consequence:
            consequence = consequence or failure
            continue
        if tampered is not None:  # it would have been raised: the verified error is only a note
            _raise_tampered(tampered, failure)
        extra = []
        if leader is not None and not leader_ok and not leader.stopped:  # stopped: it did not fail
            extra.append(f"The leader (host 0) failed as a consequence: {leader.type_name}: {leader.message}")
        _raise_host_failure(failure, plan.job_id, [i for i in failing if i != index], extra, many=_many(plan),
                            cell=cell)
    if tampered is not None:
        _raise_tampered(tampered, consequence)
    # A host that died or was lost without a payload failed on its own account:
    # it ranks before every consequence, the leader's included.
    leader_failed = leader is not None and not leader_ok
    dead = [i for i in range(plan.world_size) if (i in lost or (i in exits and exits[i].failed))
            and i not in failing and not (i == protocol.LEADER_INDEX and leader is not None)]
    consequences = []
    if leader_failed and not leader.stopped:  # stopped after the failure: no failure of its own
        consequences.append(f"The leader (host 0) failed as a consequence: {leader.type_name}: {leader.message}")
    listed = not listing_notes
    if dead:
        error = _no_payload_error(where, plan, dead, describe_host, leader_ok, exits, listed=listed)
        _add_notes(error, [*consequences, *listing_notes])
        raise error
    if leader_failed:
        _raise_leader_failure(leader, plan.job_id, listing_notes)
    if consequence is not None:
        _raise_host_failure(consequence, plan.job_id, [i for i in failing if i != consequence.host_index],
                            many=_many(plan), cell=cell)
    if unreadable_leader is not None:  # no host's own failure to raise: the leader's record is the news
        _add_notes(unreadable_leader, listing_notes)
        raise unreadable_leader
    error = _no_payload_error(where, plan, dead, describe_host, leader_ok, exits, listed=listed)
    _add_notes(error, listing_notes)
    raise error


def _no_payload_error(
    where: str,
    plan: JobPlan,
    culprits: list[int],
    describe_host: Callable[[int], str],
    leader_ok: bool,
    exits: Mapping[int, ExitSummary],
    *,
    listed: bool = True,
) -> JobFailedError:
    """Rule 4's last case: no payload to raise; say that no host reported why, and how every host ended.

    Of several hosts that died without a payload, the first to end is named as
    the cause: when a leader dies, JAX aborts its peers a moment later.
    """
    never = float("inf")
    culprits = sorted(culprits, key=lambda i: (exits[i].ended_at if i in exits else never, i))
    # The hosts are named below, with how they ended: never the storage objects they did not write.
    if leader_ok and not listed:
        head = f"{where} failed after the leader succeeded; the other hosts' outcomes could not be listed"
    elif leader_ok:
        head = f"{where} failed after the leader succeeded, and no failing host reported why"
    elif not listed:
        head = f"{where} failed: the leader reported no outcome, and the other hosts' outcomes could not be listed"
    else:
        head = f"{where} failed and no host reported an outcome"
    if culprits:
        head += f"; {plan.name_of(culprits[0])} {describe_host(culprits[0]).splitlines()[0].split(';')[0]}"
        if len(culprits) > 1:
            head += f" first, then {_many(plan)} {_hosts_text(culprits[1:])} ended too"
    lines = [head + "."]
    for index in range(plan.world_size):
        lines.append(f"{plan.name_of(index)} {describe_host(index)}")
    return JobFailedError("\n".join(lines))


def _many(plan: JobPlan) -> str:
    """How a list of the plan's processes is introduced: ``hosts 3, 5``, or ``ranks 3, 5``."""
    return "ranks" if plan.procs_per_host > 1 else "hosts"
