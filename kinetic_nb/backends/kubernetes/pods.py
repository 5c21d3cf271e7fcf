"""What a job's pods say about its hosts: state, reason, and how each one ended.

Pure functions over pods shaped as the API returns them: ``V1Pod`` objects from
the official client, or plain dicts (``kubectl get pod -o json``,
``ApiClient().sanitize_for_serialization``). No ``kubernetes`` import, except
to turn a client object into its JSON shape.

The kubelet and the pods' statuses play the local supervisor's part: a pod
that ended gives its host's exit code, signal and reason (OOMKilled, Evicted,
Error); a pod that stays Pending past a bound fails its host with the
scheduler's reason (Unschedulable, ImagePullBackOff).
"""

from __future__ import annotations

import dataclasses
import datetime
import signal as signals
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from kinetic_nb.backends.kubernetes.manifests import (
    CONTAINER_NAME,
    JOB_COMPLETION_INDEX_ANNOTATION,
    LWS_WORKER_INDEX_LABEL,
    ROLE_LABEL,
)
from kinetic_nb.backends.kubernetes.root import ROOT_ROLE
from kinetic_nb.backends.kubernetes.settings import DEFAULT_PENDING_TIMEOUT_S
from kinetic_nb.runner.protocol import ExitSummary, HostState

__all__ = [
    "PodExitSummary",
    "PodHostState",
    "RootFailure",
    "as_api_dict",
    "host_states",
    "one_line",
    "pod_exit_summaries",
    "pod_host_state",
    "root_failure",
    "stuck_pending",
]

#: A reason longer than this is cut: it is shown in one panel line.
MAX_REASON_CHARS = 300
#: Last lines of a container's termination message kept as its host's
#: ``stderr_tail`` (as many as the host agent keeps of a host's stderr).
TERMINATION_TAIL_LINES = 20
#: A longer line of a termination message is cut to this many characters.
MAX_TAIL_LINE_CHARS = 1000
#: Exit codes above this mean "killed by signal (code - 128)", by the shell's and the kubelet's convention.
_SIGNAL_EXIT_BASE = 128
#: Container waiting reasons that say the container is merely being created.
_ROUTINE_WAITING = frozenset({"ContainerCreating", "PodInitializing"})
#: Termination reasons that add nothing to the exit code.
_PLAIN_TERMINATION = frozenset({"Error", "Completed"})

_api_client: Any = None


def as_api_dict(obj: Any) -> dict[str, Any]:
    """An API object (a ``V1Pod``, a created ``V1Job``, ...) as the API's JSON (camelCase keys,
    timestamps as strings); a dict is returned as it is."""
    if isinstance(obj, Mapping):
        return dict(obj)
    global _api_client
    if _api_client is None:
        from kubernetes.client import ApiClient

        _api_client = ApiClient()
    return _api_client.sanitize_for_serialization(obj)


@dataclasses.dataclass(frozen=True)
class PodHostState:
    """One host as its pod shows it.

    Attributes
    ----------
    index : int or None
        The host index, from the LeaderWorkerSet worker-index label or the
        Job completion-index annotation; None for a pod that has neither.
    state : str
        A :class:`~kinetic_nb.runner.protocol.HostState` value: ``pending``,
        ``running``, ``succeeded``, ``failed`` (``lost`` when the pod's node
        stopped reporting).
    reason : str
        What the panel shows next to the state: ``"Unschedulable: 0/4 nodes
        are available: ..."``, ``"ImagePullBackOff: ..."``, ``"OOMKilled"``,
        ``"Evicted: ..."``; empty when there is nothing to add.
    exit_code, signal : int or None, str or None
        How the host's container ended: exit code 137 is ``SIGKILL``.
    message_tail : tuple of str
        The last lines of the ended container's termination message, whatever
        its reason: its last log lines, under ``FallbackToLogsOnError``, when it
        failed (``No module named 'kinetic_nb'``, a bucket's 403), or the
        runtime's own words (a ``StartError``'s).
    """

    index: int | None
    state: str
    reason: str = ""
    exit_code: int | None = None
    signal: str | None = None
    pod_name: str = ""
    created_at: float | None = None
    finished_at: float | None = None
    message_tail: tuple[str, ...] = ()
    #: The pod is being deleted (by a cancel, or by the Job controller after another host failed).
    deleted: bool = False
    #: A Pending pod's cause as the API names it: its container's waiting reason
    #: (``ImagePullBackOff``, ``ContainerCreating``), else its scheduling condition's (``Unschedulable``).
    waiting_reason: str = ""
    #: The pod's ``metadata.uid``: Events of an earlier pod of the same name are not this one's.
    pod_uid: str = ""

    @property
    def ended(self) -> bool:
        return self.state in (HostState.SUCCEEDED.value, HostState.FAILED.value)


def _timestamp(value: Any) -> float | None:
    if value is None or value == "":
        return None
    moment = value if isinstance(value, datetime.datetime) else datetime.datetime.fromisoformat(str(value))
    if moment.tzinfo is None:  # the API's times are UTC
        moment = moment.replace(tzinfo=datetime.UTC)
    return moment.timestamp()


def _index(metadata: Mapping[str, Any]) -> int | None:
    labels = metadata.get("labels") or {}
    annotations = metadata.get("annotations") or {}
    for raw in (labels.get(LWS_WORKER_INDEX_LABEL), annotations.get(JOB_COMPLETION_INDEX_ANNOTATION),
                labels.get(JOB_COMPLETION_INDEX_ANNOTATION)):
        if raw is not None and str(raw).isdigit():
            return int(raw)
    return None


def one_line(reason: str | None, message: str | None) -> str:
    """``reason: message`` (either alone when the other is empty) on one line, cut to :data:`MAX_REASON_CHARS`."""
    text = f"{reason}: {message}" if reason and message else (reason or message or "")
    text = " ".join(text.split())
    return text if len(text) <= MAX_REASON_CHARS else text[: MAX_REASON_CHARS - 3] + "..."


def _container_status(status: Mapping[str, Any]) -> dict[str, Any]:
    statuses = status.get("containerStatuses") or []
    for entry in statuses:
        if entry.get("name") == CONTAINER_NAME:
            return entry
    return statuses[0] if statuses else {}


def _signal_name(terminated: Mapping[str, Any]) -> str | None:
    number = terminated.get("signal")
    code = terminated.get("exitCode")
    if not number and isinstance(code, int) and code > _SIGNAL_EXIT_BASE:
        number = code - _SIGNAL_EXIT_BASE
    try:
        return signals.Signals(int(number)).name if number else None
    except ValueError:
        return None


def message_tail(message: str | None) -> tuple[str, ...]:
    """The last :data:`TERMINATION_TAIL_LINES` non-blank lines of a termination message, each cut to a length."""
    lines = [line.rstrip() for line in (message or "").splitlines() if line.strip()]
    return tuple(line if len(line) <= MAX_TAIL_LINE_CHARS else line[: MAX_TAIL_LINE_CHARS - 3] + "..."
                 for line in lines[-TERMINATION_TAIL_LINES:])


def _ended(base: dict[str, Any], terminated: Mapping[str, Any], pod_reason: str = "") -> PodHostState:
    code = terminated.get("exitCode")
    # The message (often the container's last log lines) is the tail, never part of the one-line reason.
    reason = pod_reason or ("" if terminated.get("reason") in _PLAIN_TERMINATION else
                            one_line(terminated.get("reason"), None))
    state = HostState.SUCCEEDED.value if code == 0 and not pod_reason else HostState.FAILED.value
    return PodHostState(**base, state=state, reason=reason, exit_code=code, signal=_signal_name(terminated),
                        finished_at=_timestamp(terminated.get("finishedAt")),
                        message_tail=message_tail(terminated.get("message")))


def pod_host_state(pod: Any) -> PodHostState:
    """The kinetic host state a pod stands for, with the reason the panel can show.

    Parameters
    ----------
    pod : V1Pod or dict
        As the API returns it.

    Returns
    -------
    PodHostState
        Pending with the scheduler's or image puller's reason; running;
        succeeded; failed with exit code, signal and reason (OOMKilled,
        Evicted, Error). A container that ended and was started again (a
        LeaderWorkerSet pod: see ``k8s_manifests.HOST_SCRIPT``) counts as
        ended, with its first run's exit.
    """
    pod = as_api_dict(pod)
    metadata, status = pod.get("metadata") or {}, pod.get("status") or {}
    base = {
        "index": _index(metadata),
        "pod_name": metadata.get("name", ""),
        "pod_uid": metadata.get("uid", ""),
        "created_at": _timestamp(metadata.get("creationTimestamp")),
        "deleted": bool(metadata.get("deletionTimestamp")),
    }
    phase = status.get("phase") or "Pending"
    container = _container_status(status)
    current = container.get("state") or {}
    last = (container.get("lastState") or {}).get("terminated")
    if phase == "Failed":
        pod_reason = one_line(status.get("reason"), status.get("message"))  # Evicted, DeadlineExceeded, ...
        if current.get("terminated"):
            return _ended(base, current["terminated"], pod_reason)
        return PodHostState(**base, state=HostState.FAILED.value, reason=pod_reason or "Failed")
    if phase == "Succeeded":
        return _ended(base, current.get("terminated") or {"exitCode": 0})
    if current.get("terminated"):
        return _ended(base, current["terminated"])
    if last and container.get("restartCount", 0) > 0:
        return _ended(base, last)
    if phase == "Running":
        return PodHostState(**base, state=HostState.RUNNING.value)
    if phase == "Unknown":
        return PodHostState(**base, state=HostState.LOST.value,
                            reason=one_line(status.get("reason"), status.get("message")) or "node not reporting")
    cause, reason = _pending_reason(status, current)
    return PodHostState(**base, state=HostState.PENDING.value, reason=reason, waiting_reason=cause)


def _pending_reason(status: Mapping[str, Any], current: Mapping[str, Any]) -> tuple[str, str]:
    """The cause as the API names it, and the one-line reason the panel shows."""
    waiting = current.get("waiting") or {}
    if waiting.get("reason") and waiting["reason"] not in _ROUTINE_WAITING:
        return waiting["reason"], one_line(waiting["reason"], waiting.get("message"))  # ImagePullBackOff, ...
    for condition in status.get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
            cause = condition.get("reason") or "Unschedulable"
            return cause, one_line(cause, condition.get("message"))
    return waiting.get("reason", ""), waiting.get("reason", "")


def host_states(pods: Iterable[Any]) -> dict[int, PodHostState]:
    """Each host's state, keyed by host index; pods with no index are left out.

    When two pods claim one host (a replacement next to a pod being deleted),
    the one not being deleted wins, then the newer one.
    """
    chosen: dict[int, PodHostState] = {}
    for pod in pods:
        state = pod_host_state(pod)
        if state.index is None:
            continue
        held = chosen.get(state.index)
        if held is None or (held.deleted, -(held.created_at or 0)) > (state.deleted, -(state.created_at or 0)):
            chosen[state.index] = state
    return chosen


def stuck_pending(pods: Iterable[Any], now: float,
                  pending_timeout_s: float = DEFAULT_PENDING_TIMEOUT_S) -> dict[int, PodHostState]:
    """The hosts whose pod has been Pending for more than ``pending_timeout_s`` seconds at ``now``.

    Parameters
    ----------
    pods : iterable of V1Pod or dict
    now : float
        Seconds since the epoch (``time.time()``).
    pending_timeout_s : float

    Returns
    -------
    dict of int to PodHostState
        Keyed by host index; each state's ``reason`` is the scheduler's.
    """
    return {index: state for index, state in host_states(pods).items()
            if state.state == HostState.PENDING.value and state.created_at is not None
            and now - state.created_at > pending_timeout_s}


@dataclasses.dataclass(frozen=True)
class PodExitSummary(ExitSummary):
    """An :class:`ExitSummary` read from a pod, with the pod's reason.

    Stored as a plain ``exit.json``, reason included, so every reader of exit
    records (another kernel too) can read it.
    """

    #: The host's pod never ran (stuck Pending); ``exit_code`` and ``signal`` are None.
    never_started: bool = False

    def describe(self) -> str:
        if self.exit_code is not None or self.signal is not None:
            return super().describe()
        if self.never_started:
            text = f"never started: {self.reason}"
        else:
            text = f"ended without an exit code ({self.reason or 'its pod gave none'})"
        return text + (" (stopped after another host failed)" if self.stopped else "")

    def to_json(self) -> bytes:
        fields = {field.name for field in dataclasses.fields(ExitSummary)}
        return ExitSummary(**{name: getattr(self, name) for name in fields}).to_json()


def _root_summary(index: int, root: RootFailure, now: float) -> PodExitSummary:
    return dataclasses.replace(_summary(index, None, now=now, never_started=True, reason=root.reason),
                               stderr_tail=root.last_lines)


def _summary(index: int, state: PodHostState | None, *, now: float, reason: str = "",
             recorded_success: bool = False, stopped: bool = False, never_started: bool = False) -> PodExitSummary:
    signal = state.signal if state else None
    return PodExitSummary(
        host_index=index,
        exit_code=None if signal or state is None else state.exit_code,
        signal=signal,
        recorded_success=recorded_success,
        stopped=stopped,
        ended_at=(state.finished_at if state and state.finished_at else now),
        reason=reason if reason else (state.reason if state else ""),
        stderr_tail=state.message_tail if state else (),
        never_started=never_started,
    )


@dataclasses.dataclass(frozen=True)
class RootFailure:
    """The job's root pod failed: why, in one line, and its last lines (its termination message)."""

    reason: str
    last_lines: tuple[str, ...] = ()


def root_failure(pods: Iterable[Any]) -> RootFailure | None:
    """How the job's root pod failed; None while it has not. Its failure ends the job: the cluster deletes
    the workload with the root, so hosts still without a pod never get one."""
    for pod in map(as_api_dict, pods):
        labels = (pod.get("metadata") or {}).get("labels") or {}
        if labels.get(ROLE_LABEL) != ROOT_ROLE:
            continue
        state = pod_host_state(pod)
        if state.state == HostState.FAILED.value and not state.deleted:
            ended = f"exit code {state.exit_code}" if state.exit_code is not None else state.reason or "failed"
            return RootFailure(one_line(f"the job's root pod {state.pod_name} failed ({ended}); it ends the job",
                                        None), state.message_tail)
    return None


def pod_exit_summaries(
    hosts: int,
    states: Mapping[int, PodHostState],
    recorded: Mapping[int, ExitSummary],
    *,
    now: float,
    launched_at: float | None,
    cancelled: bool,
    recorded_success: Callable[[int], bool],
    pending_timeout_s: float = DEFAULT_PENDING_TIMEOUT_S,
    pending_failures: Mapping[int, str] | None = None,
    waiting: Mapping[int, str] | None = None,
    root_failed: RootFailure | None = None,
) -> dict[int, PodExitSummary]:
    """How the hosts without an exit record ended, as far as their pods say.

    Parameters
    ----------
    hosts : int
        The job's host count.
    states : mapping of int to PodHostState
        From :func:`host_states`.
    recorded : mapping of int to ExitSummary
        The exit records already stored; those hosts are skipped.
    now : float
        Seconds since the epoch.
    launched_at : float or None
        When the job's objects were created, if known.
    cancelled : bool
        Whether the job was cancelled (``cancel.json`` exists).
    recorded_success : callable
        Whether host i recorded success in its own status (read only for hosts that ended).
    pending_timeout_s : float
    pending_failures : mapping of int to str, optional
        Pending hosts whose wait can never end, with the reason
        (:func:`~kinetic_nb.backends.kubernetes.events.pending_verdicts`): they fail now.
    waiting : mapping of int to str, optional
        Why each Pending host waits, as the panel says it; the reason of a
        host Pending past the bound (default: its pod's own reason).
    root_failed : RootFailure, optional
        How the job's root pod failed (:func:`root_failure`): every host still
        Pending or without a pod fails now, with its reason and last lines.

    Returns
    -------
    dict of int to PodExitSummary
        A pod that ended gives its exit (``stopped`` when it was deleted, by a
        cancel or by the Job controller after another host failed); a pod
        whose wait can never end, or Pending past the bound, a never-started
        failure with the reason; a pod that is gone, "stopped" once the job was cancelled or
        another host failed. Hosts still pending or running are left out.
    """
    found: dict[int, PodExitSummary] = {}
    for index in range(hosts):
        state = states.get(index)
        if index in recorded or state is None:
            continue
        if state.ended:
            found[index] = _summary(index, state, now=now, stopped=state.deleted,
                                    recorded_success=recorded_success(index))
        elif state.state == HostState.PENDING.value and root_failed is not None:
            found[index] = _root_summary(index, root_failed, now)
        elif state.state == HostState.PENDING.value and (pending_failures or {}).get(index):
            found[index] = _summary(index, None, now=now, never_started=True, reason=pending_failures[index])
        elif (state.state == HostState.PENDING.value and state.created_at is not None
              and now - state.created_at > pending_timeout_s):
            why = (waiting or {}).get(index) or state.reason
            found[index] = _summary(index, None, now=now, never_started=True,
                                    reason=f"its pod was Pending for more than {pending_timeout_s:g} s"
                                           + (f": {why}" if why else ""))
    someone_failed = any(summary.failed for summary in [*recorded.values(), *found.values()])
    for index in range(hosts):
        if index in recorded or index in found or index in states:
            continue
        if root_failed is not None and not cancelled:
            found[index] = _root_summary(index, root_failed, now)
        elif cancelled or someone_failed:
            found[index] = _summary(index, None, now=now, stopped=True, reason="its pod was deleted")
        elif launched_at is not None and now - launched_at > pending_timeout_s:
            if recorded_success(index):
                found[index] = _summary(index, None, now=now, recorded_success=True, reason="its pod is gone")
            else:
                found[index] = _summary(index, None, now=now, never_started=True,
                                        reason=f"no pod was created for it in {pending_timeout_s:g} s "
                                               "(kubectl describe the job's LeaderWorkerSet or Job for why)")
    return found
