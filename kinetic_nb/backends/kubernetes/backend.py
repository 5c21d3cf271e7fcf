"""The ``kubernetes`` backend: a job's hosts are pods on a (GKE) cluster.

A multi-host TPU slice becomes one LeaderWorkerSet, anything else an Indexed
Job (see :mod:`kinetic_nb.backends.kubernetes.manifests`), all owned by the job's
root Job, created first (:mod:`kinetic_nb.backends.kubernetes.root`): the root bounds
the job's life with no client, and deleting it (cancel, cleanup) deletes the
rest. Each pod runs the host agent against the job's storage, normally
``gs://``. This backend adds what only the platform sees: it turns the pods'
statuses into the hosts' ``exit.json`` records where a host left none (see
:mod:`kinetic_nb.backends.kubernetes.pods`), including a failure for a pod stuck
Pending past ``pending_timeout_s``, or whose wait can never end (a wrong
image, no node pool to scale up: :mod:`kinetic_nb.backends.kubernetes.events`).

Needs the ``k8s`` extra (the official ``kubernetes`` client), imported only
when the backend first talks to a cluster, so ``import kinetic_nb.backends``
stays light. Credentials come from the pod's service account when running in
a cluster, else from kubeconfig (``gcloud container clusters get-credentials``).

Settings (namespace, container image, service account, ...) are resolved per
field: an explicit argument (a magic flag) > a ``KINETIC_*`` environment
variable > a config object (``%config KineticMagics...``) > the default. See
:class:`~kinetic_nb.backends.kubernetes.settings.KubernetesSettings`.
"""

from __future__ import annotations

import base64
import dataclasses
import logging
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from kinetic_nb.accelerators import resolve_accelerator
from kinetic_nb.backends.base import Backend, BackendFlag, JobSecrets, PlatformView, register
from kinetic_nb.backends.forward import answers
from kinetic_nb.backends.host_environment import host_packages, store_environment
from kinetic_nb.backends.kubernetes.api import KubernetesApi, api_message, connect, missing_namespace, status_code
from kinetic_nb.backends.kubernetes.events import PendingVerdict, pending_verdicts
from kinetic_nb.backends.kubernetes.image_modes import ImageMode
from kinetic_nb.backends.kubernetes.kinetic_profile import kinetic_target
from kinetic_nb.backends.kubernetes.manifests import (
    LWS_GROUP,
    LWS_PLURAL,
    LWS_VERSION,
    build_manifests,
    job_selector,
    leader_host,
    resource_name,
    secret_manifest,
    secret_name,
)
from kinetic_nb.backends.kubernetes.pods import (
    PodExitSummary,
    PodHostState,
    as_api_dict,
    host_states,
    pod_exit_summaries,
    pod_host_state,
    root_failure,
    stuck_pending,
)
from kinetic_nb.backends.kubernetes.port_forward import pod_port_forward
from kinetic_nb.backends.kubernetes.root import root_job, root_name, root_owner_reference
from kinetic_nb.backends.kubernetes.settings import DEFAULT_COORDINATOR_PORT, DEFAULT_NAMESPACE, KubernetesSettings
from kinetic_nb.backends.requirements import framework_requirement, host_requirements, with_framework
from kinetic_nb.errors import KineticError, KineticWarning
from kinetic_nb.runner import protocol
from kinetic_nb.runner.job_keys import KEY_ENV, key_from_text
from kinetic_nb.runner.protocol import ExitSummary, HostState, JobPlan
from kinetic_nb.runner.records import read_exit, recorded_success, store_exit
from kinetic_nb.storage import ObjectInfo, Storage

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_COORDINATOR_PORT", "DEFAULT_NAMESPACE", "KubernetesApi", "KubernetesBackend", "KubernetesSettings",
    "PodExitSummary", "PodHostState", "connect", "host_states", "pod_host_state", "stuck_pending",
]

#: A job's pods are listed at most this often: the client polls storage several
#: times a second, and each listing is a request to the API server.
POD_LIST_INTERVAL_S = 2.0
#: The Events of a job's Pending pods are listed at most this often: they change
#: slowly (the autoscaler and the kubelet report every few seconds), and a listing
#: covers every pod of the namespace.
EVENT_LIST_INTERVAL_S = 5.0
#: Only the pods' Events are read: the autoscaler, scheduler and kubelet report on pods.
POD_EVENTS = "involvedObject.kind=Pod"
#: Seconds one API request may take before it is given up.
API_TIMEOUT_S = 30.0
#: Storage the pods can reach on their own (a file:// path only through a shared mount).
REMOTE_STORAGE_SCHEMES = ("gs://",)

#: What the panel says of a host whose pod runs and has not reported yet, in the prebuilt and build
#: image modes: the pod's bootstrap is installing (the runner's first status ends that), or its agent starting.
INSTALLING = "environment install: pip is installing kinetic_nb and the requirements"

#: Propagation when cancelling: the root Job stays (terminating) until everything
#: it owns and their pods are gone, so ``kubectl get`` shows the job until its hosts are.
CANCEL_PROPAGATION = "Foreground"
#: Propagation when cleaning up after an outcome, or after a failed launch: nothing to wait for.
CLEANUP_PROPAGATION = "Background"


@register
class KubernetesBackend(Backend):
    """Runs a job's hosts as pods: one LeaderWorkerSet, or an Indexed Job.

    Parameters
    ----------
    settings : KubernetesSettings, optional
        Default: :meth:`KubernetesSettings.resolve` from the environment.
    api : KubernetesApi, optional
        Default: :func:`connect` on first use.
    pod_list_interval_s : float
        A job's pods are listed at most this often.
    clock : callable
        Wall-clock time (``time.time``), for the pending bound.
    """

    name = "kubernetes"
    summary = "pods on a (GKE) cluster, the job in Cloud Storage (docs/gke.md)"
    ships_workdir = True
    flags = (
        BackendFlag("--namespace", "namespace", "Kubernetes namespace (default $KINETIC_NAMESPACE, then 'default').",
                    metavar="NS", setting=True),
        BackendFlag("--image", "image", "Container image: with kinetic_nb and your packages installed (custom "
                    "mode), or the base the pods install into (prebuilt mode; default python:X.Y-slim, the "
                    "notebook's version) (default $KINETIC_IMAGE).", metavar="IMAGE", setting=True),
        BackendFlag("--image-mode", "image_mode",
                    "prebuilt: each pod installs the notebook's kinetic_nb and --requirements at its start; "
                    "build: Cloud Build makes an image with --requirements once, then pods install only "
                    "kinetic_nb; custom: --image has everything (default $KINETIC_IMAGE_MODE, then custom "
                    "with --image, else prebuilt).", metavar="MODE", setting=True),
        BackendFlag("--requirements", "requirements",
                    "A pip requirements file the pods install, e.g. jax[tpu] (default $KINETIC_REQUIREMENTS).",
                    metavar="FILE", setting=True),
        BackendFlag("--registry", "registry",
                    "Where --image-mode build puts its images, e.g. us-docker.pkg.dev/PROJECT/kinetic "
                    "(default $KINETIC_REGISTRY).", metavar="REGISTRY", setting=True),
        BackendFlag("--service-account", "service_account",
                    "The pods' Kubernetes service account, e.g. one that may write the bucket "
                    "(default $KINETIC_SERVICE_ACCOUNT, then the namespace's default).", metavar="NAME", setting=True),
        BackendFlag("--pending-timeout", "pending_timeout_s",
                    "Seconds a host's pod may wait for nodes and its image (default $KINETIC_PENDING_TIMEOUT, "
                    "then 2700); a wait that can never end fails at once.", metavar="S", type=float, setting=True),
    )
    has_doctor = True

    @classmethod
    def doctor(cls, accelerator: str | None, storage: str | None, options: Mapping[str, Any]) -> Any:
        """The cluster's, the image mode's and the bucket's readiness (:func:`~.doctor.doctor`)."""
        from kinetic_nb.backends.kubernetes.doctor import doctor

        return doctor(accelerator, storage, backend_options=options)

    @classmethod
    def from_options(cls, *, config: Mapping[str, Any] | None = None, **options: Any) -> KubernetesBackend:
        """Settings from ``options`` (see ``KubernetesSettings.resolve``); ``config`` holds ``%config`` defaults."""
        defaults = {key: value for key, value in (config or {}).items() if value is not None}
        return cls(KubernetesSettings.resolve(**options, config=KubernetesSettings(**defaults) if defaults else None))

    def __init__(self, settings: KubernetesSettings | None = None, *, api: KubernetesApi | None = None,
                 pod_list_interval_s: float = POD_LIST_INTERVAL_S,
                 event_list_interval_s: float = EVENT_LIST_INTERVAL_S, clock: Callable[[], float] = time.time):
        self.settings = settings if settings is not None else KubernetesSettings.resolve()
        self._api = api
        self._pod_list_interval_s = pod_list_interval_s
        self._event_list_interval_s = event_list_interval_s
        self._clock = clock
        self._launched_at: dict[str, float] = {}
        self._cancelled: set[str] = set()
        #: Exit records already read or stored, so a poll reads each at most once; those this
        #: backend stored keep their pods' reasons (exit.json has no field for one).
        self._exits: dict[tuple[str, int], ExitSummary] = {}
        self._pods: dict[str, tuple[float, list[dict[str, Any]]]] = {}
        self._events: tuple[float, list[dict[str, Any]]] | None = None
        #: Each job's Pending hosts as their pods and Events last said, for the panel.
        self._verdicts: dict[str, dict[int, PendingVerdict]] = {}
        self._lock = threading.Lock()
        #: The build image mode's image, once Cloud Build made it (or found it made).
        self._built_image: str | None = None

    @property
    def api(self) -> KubernetesApi:
        if self._api is None:
            self._api = connect(self.settings)
        return self._api

    # -- the Backend interface -----------------------------------------------------

    def preflight(self, plan: JobPlan) -> None:
        """Read ``--requirements``, refusing a line a pod cannot satisfy (a path on this machine: see
        :mod:`~kinetic_nb.backends.requirements`); in the build image mode, make sure its image
        exists (Cloud Build makes it once per requirements: minutes the first time, a registry lookup after).
        A TPU slice GKE has no node pool for (v2, v3: Cloud TPU VMs only) is refused first, in one line."""
        acc = resolve_accelerator(plan.accelerator)
        if acc.kind == "tpu" and acc.gke_accelerator is None:
            raise KineticError(f"{acc.name}: GKE has no node pool of this TPU generation (it offers v4, v5e, v5p "
                               "and v6e); run it on Cloud TPU VMs with -b tpu-vm")
        requirements = self._host_requirements(plan)
        if requirements is not None and self.settings.mode is ImageMode.BUILD and self._built_image is None:
            from kinetic_nb.backends.kubernetes.cloud_build import ensure_image

            self._built_image = ensure_image(requirements, registry=self.settings.registry or "",
                                             base_image=self.settings.require_image_base(),
                                             packages=host_packages("gs://"))

    def _host_requirements(self, plan: JobPlan) -> bytes | None:
        """What the pods pip-install besides kinetic_nb: ``--requirements`` (checked), and the cell's
        framework for the accelerator unless they name it (:func:`framework_requirement`); None: nothing."""
        requirements = host_requirements(self.settings.requirements) if self.settings.requirements else None
        if self.settings.mode is ImageMode.CUSTOM:
            return requirements
        return with_framework(requirements, framework_requirement(resolve_accelerator(plan.accelerator).kind,
                                                                  plan.framework, requirements))

    def default_storage(self) -> str | None:
        """The jobs bucket of the cluster keras-kinetic's ``kinetic up`` made, when that is the cluster."""
        target = kinetic_target()
        return target.storage if target is not None and self.settings.context == target.context else None

    def launch_notices(self, plan: JobPlan) -> list[str]:
        """The cluster and namespace, as :func:`connect` chose the cluster (a kubeconfig context, or this
        pod's); and the framework the pods install for the cell, where kinetic_nb added it."""
        source = getattr(self.api, "source", "") or "the configured cluster"
        notices = [f"kubernetes: {source}, namespace {self.settings.namespace}"]
        target = kinetic_target()
        if target is not None and self.settings.context == target.context:
            notices[0] += f" (from {target.describe()})"
        if self.settings.mode is not ImageMode.CUSTOM:
            user = host_requirements(self.settings.requirements) if self.settings.requirements else None
            added = framework_requirement(resolve_accelerator(plan.accelerator).kind, plan.framework, user)
            if added is not None:
                notices.append(f"the pods install {added} for {plan.accelerator} (this notebook's version); name "
                               f"{added.split('[')[0].split('=')[0]} in --requirements to choose another")
            if self.settings.mode is ImageMode.PREBUILT and (added or user) and not plan.session:
                # Each one-shot job's pods are new: what they install, they install again, minutes each time.
                notices.append("each one-shot job's pods install it again (minutes a cell): a session (%kinetic "
                               "start) installs it once for all its cells, and --image-mode build once for good")
        return notices

    def pod_settings(self) -> KubernetesSettings:
        """The settings the pods are made with: in the build image mode, with the image Cloud Build made."""
        if self.settings.mode is ImageMode.BUILD:
            if self._built_image is None:
                raise KineticError("the build image mode's image is made in preflight(), which did not run")
            return dataclasses.replace(self.settings, image=self._built_image)
        return self.settings

    def start_window_s(self) -> float:
        """The pending limit: one host's pod may wait that long for nodes after another's started."""
        return self.settings.pending_timeout_s

    def coordinator_address(self, job_id: str) -> str:
        """``{name}-0.{name}.{namespace}:{port}``: host 0's DNS name.

        On a LeaderWorkerSet each pod's ``KINETIC_COORDINATOR_ADDRESS``, built
        from ``LWS_LEADER_ADDRESS``, overrides it (with the same value); a
        single host uses the loopback. Called once per submission before
        anything is stored, so a missing image fails before the job exists.
        """
        self.settings.require_environment()
        return f"{leader_host(job_id, self.settings.namespace)}:{self.settings.coordinator_port}"

    def manifests(self, storage: Storage, plan: JobPlan, root_uid: str) -> list[dict[str, Any]]:
        """The objects :meth:`launch` creates for ``plan``, in order: the root Job, then the
        rest, owned by the root (whose uid, ``root_uid``, the API server gives when it is created)."""
        owner = root_owner_reference(plan.job_id, root_uid)
        settings = self.pod_settings()
        return [root_job(plan, storage.uri, settings), *build_manifests(plan, storage.uri, settings, owner=owner)]

    def launch(self, storage: Storage, plan: JobPlan, secrets: JobSecrets) -> None:
        """Create the job's root Job, then the rest owned by it; on a failure delete the root
        (which takes what was created with it) and raise.

        A conflict on the root means another launch of this job: its objects are left alone.

        Raises
        ------
        KineticError
            One line: the API server's reason (no LeaderWorkerSet controller,
            forbidden, quota, ...).
        """
        if not storage.uri.startswith(REMOTE_STORAGE_SCHEMES):
            warnings.warn(f"job storage {storage.uri} is local to this machine: the pods reach it only if the "
                          "same path is mounted in them; use --storage gs://BUCKET/PREFIX", KineticWarning,
                          stacklevel=2)
        settings = self.pod_settings()
        if settings.mode is not ImageMode.CUSTOM:  # before any pod exists: the pods install it first
            requirements = self._host_requirements(plan) if settings.mode is ImageMode.PREBUILT else None
            store_environment(storage, secrets.key, requirements=requirements)
        root = self._create(root_job(plan, storage.uri, settings))
        owner = root_owner_reference(plan.job_id, as_api_dict(root)["metadata"]["uid"])
        try:
            # The Secret first: the key and the -e values reach the pods only through it.
            for manifest in [secret_manifest(plan, settings, secrets, owner),
                             *build_manifests(plan, storage.uri, settings, owner=owner)]:
                self._create(manifest)
        except KineticError:
            self._delete(plan.job_id, CLEANUP_PROPAGATION, quiet=True)
            raise
        self._launched_at[plan.job_id] = self._clock()

    def cancel(self, storage: Storage, plan: JobPlan, reason: str, key: bytes | None) -> None:
        """Record ``cancel.json``, then delete the job's root Job: everything it owns, pods included, goes with it."""
        super().cancel(storage, plan, reason, key)
        self._cancelled.add(plan.job_id)
        self._delete(plan.job_id, CANCEL_PROPAGATION)

    def channel_route(self, plan: JobPlan, announced: tuple[str, int]) -> tuple[str, int] | None:
        """A session's hub listens beside host 0's agent, on its pod: reached at the pod's address where this
        notebook is on the cluster's network (in the cluster, or in its VPC), else through a port-forward by the
        Kubernetes API, as ``kubectl port-forward`` reaches it (a ``KineticError`` in one line when the API
        refuses it). None while host 0's pod is not there."""
        pods = self.pods(plan, fresh=True)
        leader = host_states(pods).get(protocol.LEADER_INDEX)
        if leader is None or leader.ended:
            return None
        port = announced[1]
        status = next((pod.get("status") or {} for pod in pods if pod["metadata"]["name"] == leader.pod_name), {})
        if status.get("podIP") and answers((status["podIP"], port)):
            return status["podIP"], port
        return pod_port_forward(self.api, self.settings.namespace, leader.pod_name, port)

    def cleanup(self, plan: JobPlan) -> None:
        """Delete whatever is left of the job on the cluster (after its outcome is recorded); never raises."""
        self._delete(plan.job_id, CLEANUP_PROPAGATION, quiet=True)

    def exit_summaries(self, storage: Storage, plan: JobPlan, listing: list[ObjectInfo],
                       key: bytes | None) -> dict[int, ExitSummary]:
        """The stored ``exit.json`` records, completed from the pods for hosts that have none.

        A host whose pod ended, was stuck Pending past the bound, or is gone
        after a cancel or another host's failure gets a record, which is also
        stored as ``hosts/{i}/exit.json`` (the backend writes exit records, as
        the local supervisor does), so the other hosts' start barrier and a
        later reader see it. Each record is read once; pods are listed at
        most every ``pod_list_interval_s``, and only while a host has no
        record; an API error is logged and leaves the stored records as they
        are. Give it the job's full listing on every poll.
        """
        names = {info.name: info for info in listing}
        summaries: dict[int, ExitSummary] = {}
        for index in range(plan.world_size):  # a record per process; a pod runs procs_per_host of them
            name = protocol.host_exit(index)
            if (plan.job_id, index) in self._exits:
                summaries[index] = self._exits[plan.job_id, index]
            elif name in names:
                stored = read_exit(storage, key, index)  # one that does not verify is as good as none
                if stored is not None:
                    summaries[index] = self._exits[plan.job_id, index] = stored
        if len(summaries) == plan.world_size:
            return summaries
        try:
            pods = self.pods(plan)
        except Exception as error:  # noqa: BLE001 - polling must survive a flaky API server
            logger.warning("could not list the pods of %s: %s", plan.job_id, api_message(error))
            return summaries
        plan_info = names.get(protocol.PLAN)
        states = host_states(pods)
        verdicts = self._pending_verdicts(plan, states)
        # A pod is a host: it has ended on its own records once every one of its processes has one.
        ended_hosts = {host: summaries[plan.ranks_of(host)[0]] for host in range(plan.hosts)
                       if all(rank in summaries for rank in plan.ranks_of(host))}
        found = pod_exit_summaries(
            plan.hosts, states, ended_hosts, now=self._clock(),
            launched_at=self._launched_at.get(plan.job_id, plan_info.updated if plan_info else None),
            cancelled=protocol.CANCEL in names or plan.job_id in self._cancelled,
            recorded_success=lambda host: recorded_success(storage, key, plan.ranks_of(host)[0]),
            pending_timeout_s=self.settings.pending_timeout_s,
            pending_failures={index: verdict.failure for index, verdict in verdicts.items() if verdict.failure},
            waiting={index: verdict.waiting for index, verdict in verdicts.items()},
            root_failed=root_failure(pods),
        )
        for host, summary in found.items():
            for rank in plan.ranks_of(host):  # the pod's end is each of its processes' that has none of its own
                if rank in summaries:
                    continue
                if rank != host:
                    summary = dataclasses.replace(summary, host_index=rank,
                                                  recorded_success=recorded_success(storage, key, rank))
                summaries[rank] = self._exits[plan.job_id, rank] = store_exit(storage, key, summary)
        return summaries

    def observe(self, storage: Storage, plan: JobPlan, listing: list[ObjectInfo],
                recorded: Mapping[int, ExitSummary], key: bytes | None) -> PlatformView:
        """Pod ends for hosts with no record of their own, and why pods that have not started are waiting."""
        summaries = self.exit_summaries(storage, plan, listing, key)
        exits = {index: summary for index, summary in summaries.items() if index not in recorded}
        waiting: dict[int, str] = {}
        if len(summaries) < plan.world_size:
            states = host_states(self._listed_pods(plan))  # this look's listing: a look lists the pods once
            verdicts = self._verdicts.get(plan.job_id, {})
            waiting = {rank: verdicts[host].waiting if host in verdicts else state.reason
                       for host, state in states.items() for rank in plan.ranks_of(host) if rank not in summaries}
            if self.settings.mode is not ImageMode.CUSTOM:
                names = {info.name for info in listing}
                waiting.update({rank: INSTALLING for host, state in states.items() for rank in plan.ranks_of(host)
                                if state.state == HostState.RUNNING.value and rank not in summaries
                                and protocol.host_status(rank) not in names})
            waiting = {index: text for index, text in waiting.items() if text}
        return PlatformView(exits=exits, waiting=waiting)

    def job_key(self, job_id: str) -> bytes | None:
        """The job's key read back from its Secret (which lives until the job is collected), else None."""
        try:
            secret = as_api_dict(self.api.core.read_namespaced_secret(secret_name(job_id), self.settings.namespace,
                                                                      _request_timeout=API_TIMEOUT_S))
        except Exception as error:  # noqa: BLE001 - no key is an answer: the caller says what to do
            logger.info("no Secret for %s: %s", job_id, api_message(error))
            return None
        encoded = (secret.get("data") or {}).get(KEY_ENV)
        return key_from_text(base64.b64decode(encoded).decode(), where=f"the Secret of {job_id}") if encoded else None

    def options(self) -> dict[str, object]:
        return {key: value for key, value in dataclasses.asdict(self.settings).items() if value is not None}

    # -- pods ----------------------------------------------------------------------

    def pods(self, plan: JobPlan, *, fresh: bool = False) -> list[dict[str, Any]]:
        """The job's pods as the API's JSON (one label selector), listed at most every ``pod_list_interval_s``."""
        now = time.monotonic()
        with self._lock:
            cached = self._pods.get(plan.job_id)
            if cached is not None and not fresh and now - cached[0] < self._pod_list_interval_s:
                return cached[1]
        listed = self.api.core.list_namespaced_pod(self.settings.namespace, label_selector=job_selector(plan.job_id),
                                                   _request_timeout=API_TIMEOUT_S)
        pods = [as_api_dict(pod) for pod in (listed.items if hasattr(listed, "items") else listed["items"])]
        with self._lock:
            self._pods[plan.job_id] = (now, pods)
        return pods

    def _listed_pods(self, plan: JobPlan) -> list[dict[str, Any]]:
        """The job's pods as last listed (none before the first listing), without asking the API server again:
        a look that takes longer than ``pod_list_interval_s`` (64 hosts' records on a busy machine) must not
        list them a second time."""
        with self._lock:
            cached = self._pods.get(plan.job_id)
        return cached[1] if cached is not None else []

    def host_states(self, plan: JobPlan) -> dict[int, PodHostState]:
        """Each host's pod state and reason, for the panel (Pending: Unschedulable, ImagePullBackOff, ...)."""
        return host_states(self.pods(plan))

    def pod_events(self, *, fresh: bool = False) -> list[dict[str, Any]]:
        """The namespace's pod Events as the API's JSON, listed at most every ``event_list_interval_s``."""
        now = time.monotonic()
        with self._lock:
            if self._events is not None and not fresh and now - self._events[0] < self._event_list_interval_s:
                return self._events[1]
        listed = self.api.core.list_namespaced_event(self.settings.namespace, field_selector=POD_EVENTS,
                                                     _request_timeout=API_TIMEOUT_S)
        events = [as_api_dict(event) for event in (listed.items if hasattr(listed, "items") else listed["items"])]
        with self._lock:
            self._events = (now, events)
        return events

    def _pending_verdicts(self, plan: JobPlan, states: Mapping[int, PodHostState]) -> dict[int, PendingVerdict]:
        """What the Pending hosts' pods and Events say (no Events listed while no host is Pending)."""
        if not any(state.state == HostState.PENDING.value for state in states.values()):
            self._verdicts.pop(plan.job_id, None)
            return {}
        try:
            events = self.pod_events()
        except Exception as error:  # noqa: BLE001 - the pods' own statuses still say the most
            logger.warning("could not list the pod events of namespace %s: %s", self.settings.namespace,
                           api_message(error))
            events = []
        verdicts = pending_verdicts(states, events, accelerator_kind=resolve_accelerator(plan.accelerator).kind,
                                    now=self._clock())
        self._verdicts[plan.job_id] = verdicts
        return verdicts

    def stuck_hosts(self, plan: JobPlan) -> dict[int, PodHostState]:
        """Hosts whose pod has been Pending longer than ``settings.pending_timeout_s``."""
        return stuck_pending(self.pods(plan), self._clock(), self.settings.pending_timeout_s)

    # -- helpers ---------------------------------------------------------------------

    def _create(self, manifest: dict[str, Any]) -> Any:
        """Create ``manifest`` and return the API server's answer (with its uid), or raise a one-line KineticError."""
        namespace = self.settings.namespace
        # Strict: the API server rejects a field it does not know instead of dropping it.
        options = {"field_validation": "Strict", "_request_timeout": API_TIMEOUT_S}
        kind = manifest["kind"]
        try:
            if kind == "Service":
                created = self.api.core.create_namespaced_service(namespace, manifest, **options)
            elif kind == "Secret":
                created = self.api.core.create_namespaced_secret(namespace, manifest, **options)
            elif kind == "Job":
                created = self.api.batch.create_namespaced_job(namespace, manifest, **options)
            elif kind == "LeaderWorkerSet":
                created = self.api.custom.create_namespaced_custom_object(LWS_GROUP, LWS_VERSION, namespace,
                                                                          LWS_PLURAL, manifest, **options)
            else:  # pragma: no cover - the manifests are only these
                raise ValueError(f"cannot create a {kind}")
        except Exception as error:
            raise KineticError(self._create_failure(manifest, error)) from error
        logger.info("created %s %s/%s", kind, namespace, manifest["metadata"]["name"])
        return created

    def _create_failure(self, manifest: dict[str, Any], error: BaseException) -> str:
        kind, name, namespace = manifest["kind"], manifest["metadata"]["name"], self.settings.namespace
        status = status_code(error)
        if status == 404 and missing_namespace(error):
            return (f"namespace {namespace} does not exist: create it (kubectl create namespace {namespace}) "
                    "or choose another (--namespace, KINETIC_NAMESPACE)")
        if kind == "LeaderWorkerSet" and status == 404:
            return (f"the cluster has no LeaderWorkerSet API ({LWS_GROUP}/{LWS_VERSION}): install the "
                    "LeaderWorkerSet controller first (docs/gke.md)")
        if status == 403:
            return f"not allowed to create {kind} {name} in namespace {namespace}: {api_message(error)}"
        return f"could not create {kind} {name} in namespace {namespace}: {api_message(error)}"

    def _delete(self, job_id: str, propagation: str, *, quiet: bool = False) -> None:
        """Delete the job's root Job: the garbage collector deletes everything it owns, pods included.

        A job with no root left (its TTL passed, or it was launched before
        roots existed) is deleted kind by kind by its label instead.
        """
        namespace = self.settings.namespace
        try:
            self.api.batch.delete_namespaced_job(root_name(job_id), namespace, propagation_policy=propagation,
                                                 _request_timeout=API_TIMEOUT_S)
        except Exception as error:  # noqa: BLE001 - reported below, or quiet
            if status_code(error) == 404:
                self._delete_by_label(job_id, propagation, quiet=quiet)
                return
            self._deletion_failed(job_id, [f"Job {root_name(job_id)}: {api_message(error)}"], quiet=quiet)
        finally:
            with self._lock:
                self._pods.pop(job_id, None)

    def _delete_by_label(self, job_id: str, propagation: str, *, quiet: bool = False) -> None:
        """Delete the job's LeaderWorkerSet, Job and Service by its label; a kind that is not there is fine."""
        namespace, selector = self.settings.namespace, job_selector(job_id)
        options = {"label_selector": selector, "propagation_policy": propagation, "_request_timeout": API_TIMEOUT_S}
        deletions = [
            ("LeaderWorkerSet", lambda: self.api.custom.delete_collection_namespaced_custom_object(
                LWS_GROUP, LWS_VERSION, namespace, LWS_PLURAL, **options)),
            ("Job", lambda: self.api.batch.delete_collection_namespaced_job(namespace, **options)),
            ("Service", lambda: self.api.core.delete_collection_namespaced_service(
                namespace, label_selector=selector, _request_timeout=API_TIMEOUT_S)),
        ]
        failures = []
        for kind, delete in deletions:
            try:
                delete()
            except Exception as error:  # noqa: BLE001 - every kind is tried; the failures are reported together
                if status_code(error) == 404:  # no such API (no LeaderWorkerSet controller): nothing of that kind
                    continue
                failures.append(f"{kind}: {api_message(error)}")
        if failures:
            self._deletion_failed(job_id, failures, quiet=quiet)

    def _deletion_failed(self, job_id: str, failures: list[str], *, quiet: bool) -> None:
        message = (f"could not delete all of job {job_id} ({resource_name(job_id)}) in {self.settings.namespace}: "
                   + "; ".join(failures))
        if not quiet:
            raise KineticError(message)
        logger.warning("%s", message)

