"""Why a job's Pending pods wait, from their statuses and Events: wait on (and say why), or fail now.

A pod on GKE is Pending while the cluster autoscaler adds nodes (a multi-host
TPU node pool scales a whole slice at once, often ten minutes from zero),
while the zone has no capacity for them (a TPU stockout, the most common
first-run condition: the autoscaler keeps trying, and the panel says
"waiting for capacity"), and while its image is pulled (gigabytes for a JAX
image, and a registry that times out is tried again). All of that is progress
or may become progress, and the host keeps waiting, bounded by the pending
limit (``KubernetesSettings.pending_timeout_s``). Some waits never end on
their own, and the host fails at once with the reason instead:

- the image cannot be pulled, by the registry's own final word (not found,
  unauthorized, forbidden), or the container cannot be made at all
  (``InvalidImageName``, ``ErrImageNeverPull``, ``CreateContainerConfigError``);
- the cluster autoscaler did not trigger a scale-up for it
  (``NotTriggerScaleUp``: no node pool matches, or none could fit it), unless
  the matching pool is at its maximum size or in backoff after a failed
  scale-up (it tries again), or another pod of the job did trigger one (that
  scale-up may bring its node too);
- a scale-up for it failed for a reason no retry fixes (``FailedScaleUp``:
  quota exceeded, an invalid TPU topology or reservation), where GKE's
  autoscaler names its reasons (``gke-autoscaling``'s ``FailedScaleUp``
  messages: "GCE out of resources", "failed to appear in time", "Internal
  error" and a reservation not ready or full are retried).

Pure functions over pods' :class:`~kinetic_nb.backends.kubernetes.pods.PodHostState`
and Events shaped as the API returns them (``CoreV1Event`` objects or
``kubectl get events -o json`` dicts). No ``kubernetes`` import.
"""

from __future__ import annotations

import dataclasses
import datetime
import re
from collections.abc import Iterable, Mapping
from typing import Any

from kinetic_nb.backends.kubernetes.pods import PodHostState, as_api_dict, one_line
from kinetic_nb.runner.protocol import HostState

__all__ = ["FATAL_WAITING_REASONS", "PULL_WAITING_REASONS", "PendingVerdict", "pending_verdicts"]

#: Container waiting reasons that no amount of waiting fixes: the image name, or the pod's own configuration
#: (a missing Secret key), is wrong.
FATAL_WAITING_REASONS = frozenset({"InvalidImageName", "ErrImageNeverPull", "CreateContainerConfigError"})
#: A failed pull, which the kubelet tries again: fatal only on the registry's final word (:data:`_NO_SUCH_IMAGE`).
PULL_WAITING_REASONS = frozenset({"ErrImagePull", "ImagePullBackOff"})
#: In a failed pull's message (the kubelet's, the runtime's): the registry has no such image, or refuses it to
#: this node; a timeout, a reset connection or a 429 is tried again.
_NO_SUCH_IMAGE = re.compile(r"not ?found|manifest unknown|unauthorized|forbidden|denied|\b40[13]\b", re.IGNORECASE)
#: In a ``FailedScaleUp`` message: reasons the autoscaler retries, which may succeed (GKE's own wording).
_RETRIED_SCALE_UP = ("GCE out of resources", "failed to appear in time", "Internal error", "Reservation not ready",
                     "Reservation capacity exceeded")
_AT_RISK = " Pod is at risk of not being scheduled."
#: The cluster autoscaler's Events on a pod (reason -> what it says).
SCALE_UP_TRIGGERED = "TriggeredScaleUp"
SCALE_UP_NOT_TRIGGERED = "NotTriggerScaleUp"
SCALE_UP_FAILED = "FailedScaleUp"
_AUTOSCALER_REASONS = frozenset({SCALE_UP_TRIGGERED, SCALE_UP_NOT_TRIGGERED, SCALE_UP_FAILED})
#: The kubelet's image Events: a pull started, ended, or failed (``Failed`` carries the registry's words).
_PULL_REASONS = frozenset({"Pulling", "Pulled", "Failed", "BackOff"})
#: In a ``NotTriggerScaleUp`` message: a pool that matches the pod exists but is full. Capacity
#: frees up when other work ends, so the pod waits (bounded by the pending limit) instead of failing.
_POOL_AT_MAXIMUM = "max node group size reached"
#: In a ``NotTriggerScaleUp`` message: a pool that matches the pod failed to scale up (a stockout, say) and is
#: waiting to try again.
_POOL_IN_BACKOFF = "in backoff after failed scale-up"
#: What a host waits for, by accelerator kind, as the panel says it.
_NODES = {"tpu": "TPU nodes", "gpu": "GPU nodes"}


@dataclasses.dataclass(frozen=True)
class PendingVerdict:
    """What a Pending pod's status and Events say about its host.

    Attributes
    ----------
    waiting : str
        The panel's line while the host waits: ``"waiting for TPU nodes:
        scale-up triggered"``, ``"pulling image IMAGE"``, the scheduler's reason.
    failure : str
        Non-empty when the wait can never end on its own: the host fails now,
        with this reason.
    """

    waiting: str = ""
    failure: str = ""


def _event_time(event: Mapping[str, Any]) -> float:
    series = event.get("series") or {}
    metadata = event.get("metadata") or {}
    for value in (series.get("lastObservedTime"), event.get("lastTimestamp"), event.get("eventTime"),
                  event.get("firstTimestamp"), metadata.get("creationTimestamp")):
        if value:
            moment = value if isinstance(value, datetime.datetime) else datetime.datetime.fromisoformat(
                str(value).replace("Z", "+00:00"))
            if moment.tzinfo is None:
                moment = moment.replace(tzinfo=datetime.UTC)
            return moment.timestamp()
    return 0.0


def events_by_pod(events: Iterable[Any], states: Iterable[PodHostState]) -> dict[str, list[dict[str, Any]]]:
    """Each pod's Events, oldest first, keyed by pod name; an Event of an earlier pod of the same name
    (another uid) is left out."""
    uids = {state.pod_name: state.pod_uid for state in states}
    found: dict[str, list[dict[str, Any]]] = {name: [] for name in uids}
    for event in map(as_api_dict, events):
        involved = event.get("involvedObject") or {}
        name = involved.get("name")
        if involved.get("kind", "Pod") != "Pod" or name not in found:
            continue
        if involved.get("uid") and uids[name] and involved["uid"] != uids[name]:
            continue
        found[name].append(event)
    for listed in found.values():
        listed.sort(key=_event_time)
    return found


def _latest(events: list[dict[str, Any]], reasons: frozenset[str]) -> dict[str, Any] | None:
    matching = [event for event in events if event.get("reason") in reasons]
    return matching[-1] if matching else None


def _image(message: str) -> str:
    """The image an image Event names (``Pulling image "IMAGE"``), else ""."""
    start = message.find('"')
    end = message.find('"', start + 1)
    return message[start + 1:end] if 0 <= start < end else ""


def _failed_pull(events: list[dict[str, Any]]) -> str:
    """The latest failed pull's message, whole (the kubelet's "Failed to pull image ...: why"; its
    "Error: ErrImagePull" says nothing); "" when there is none."""
    said = [event.get("message") or "" for event in events if event.get("reason") == "Failed"]
    said = [message for message in said if not message.startswith("Error: ")]
    return said[-1] if said else ""


def _why(message: str) -> str:
    """The end of a runtime's error chain, which says why (``...: registry.example/x:1: not found``,
    ``...: dial tcp 10.0.0.7:443: i/o timeout``): its last two links."""
    return ": ".join(message.rsplit(": ", 2)[-2:])


def _waited(state: PodHostState, now: float | None) -> str:
    """`` (N min so far)`` since the pod was made, where ``now`` is given."""
    if now is None or state.created_at is None:
        return ""
    return f" ({max(0, int(now - state.created_at) // 60)} min so far)"


def _verdict(state: PodHostState, events: list[dict[str, Any]], nodes: str, job_scale_up: bool,
             now: float | None) -> PendingVerdict:
    if state.waiting_reason in FATAL_WAITING_REASONS | PULL_WAITING_REASONS:
        said = _failed_pull(events)
        detail = _why(said) if said else ""
        reason = state.reason if not detail or detail in state.reason else f"{state.reason} ({detail})"
        final = _NO_SUCH_IMAGE.search(f"{state.reason} {said}") is not None
        if state.waiting_reason in FATAL_WAITING_REASONS or final:
            return PendingVerdict(waiting=state.reason, failure=one_line(reason, None))
        image = _image(said) or _image(state.reason)
        return PendingVerdict(waiting=one_line(f"waiting to pull image {image}{_waited(state, now)}",
                                               detail or state.reason))
    pull = _latest(events, _PULL_REASONS)
    if pull is not None and pull.get("reason") == "Pulling":
        image = _image(pull.get("message") or "")
        return PendingVerdict(waiting=f"pulling image {image}".rstrip())
    autoscaler = _latest(events, _AUTOSCALER_REASONS)
    if autoscaler is not None:
        reason, message = autoscaler.get("reason"), autoscaler.get("message") or ""
        if reason == SCALE_UP_FAILED:
            if any(retried in message for retried in _RETRIED_SCALE_UP):  # a stockout: the autoscaler tries again
                return PendingVerdict(waiting=one_line(f"waiting for capacity{_waited(state, now)}",
                                                       message.removesuffix(_AT_RISK)))
            return PendingVerdict(failure=one_line(f"scale-up of {nodes} failed", message.removesuffix(_AT_RISK)))
        if reason == SCALE_UP_NOT_TRIGGERED:
            if _POOL_IN_BACKOFF in message:
                return PendingVerdict(waiting=one_line(f"waiting for capacity{_waited(state, now)}", message))
            if _POOL_AT_MAXIMUM in message:
                return PendingVerdict(waiting=f"waiting for {nodes}: the matching node pool is at its maximum size")
            if not job_scale_up:
                return PendingVerdict(failure=one_line(f"no node pool can add {nodes} for it", message))
    if job_scale_up:  # this pod's, or another's of the job: a slice's nodes come up together
        return PendingVerdict(waiting=f"waiting for {nodes}: scale-up triggered")
    return PendingVerdict(waiting=state.reason)


def pending_verdicts(states: Mapping[int, PodHostState], events: Iterable[Any], *,
                     accelerator_kind: str, now: float | None = None) -> dict[int, PendingVerdict]:
    """What each Pending host's pod and its Events say: wait on, and why, or fail now.

    Parameters
    ----------
    states : mapping of int to PodHostState
        Every host's pod (:func:`~kinetic_nb.backends.kubernetes.pods.host_states`);
        only the Pending ones get a verdict.
    events : iterable of CoreV1Event or dict
        Events of the namespace's pods; those of other pods are ignored.
    accelerator_kind : str
        ``tpu``, ``gpu`` or ``cpu``: what the panel says the host waits for.
    now : float, optional
        Seconds since the epoch: a wait for capacity or for an image then says how long it has lasted.

    Returns
    -------
    dict of int to PendingVerdict
        Keyed by host index. A scale-up that another pod of the job triggered
        counts for every Pending pod of the job (a TPU slice's nodes come up
        together).
    """
    pending = {index: state for index, state in states.items() if state.state == HostState.PENDING.value}
    by_pod = events_by_pod(events, pending.values())
    job_scale_up = any(event.get("reason") == SCALE_UP_TRIGGERED for listed in by_pod.values() for event in listed)
    nodes = _NODES.get(accelerator_kind, "nodes")
    return {index: _verdict(state, by_pod[state.pod_name], nodes, job_scale_up, now)
            for index, state in pending.items()}
