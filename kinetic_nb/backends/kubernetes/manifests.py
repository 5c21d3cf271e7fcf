"""The Kubernetes objects one kinetic job becomes, as plain dicts shaped like the API's JSON.

A multi-host TPU slice becomes one LeaderWorkerSet (``leaderworkerset.x-k8s.io/v1``),
whose group of ``size`` pods GKE places on one TPU slice. Anything else (a
single host, GPU hosts, CPU hosts) becomes an Indexed Job, with a headless
Service when it has more than one host so that host 0 has a DNS name.

Every object here is owned (``ownerReferences``) by the job's root Job,
created before them (:mod:`kinetic_nb.backends.kubernetes.root`), so the cluster
deletes them, pods included, when the root goes.

Every host pod runs the host agent, ``python -m kinetic_nb.agent --job URI``
(which runs the runner, uploads its output, and writes the host's exit
record), behind a few lines of ``sh`` (:data:`HOST_SCRIPT`) that refuse to
run a host's part twice, and gets the environment the runner, JAX and torch
need: the host index from the downward API, the coordinator from
``LWS_LEADER_ADDRESS`` on a LeaderWorkerSet, and the plan's own ``env`` last.

Pure functions, no ``kubernetes`` import: the manifests are tested offline.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kinetic_nb.accelerators import (
    GPU_NODE_SELECTOR,
    MACHINE_TYPE_SELECTOR,
    TPU_NODE_SELECTOR,
    Accelerator,
    resolve_accelerator,
)
from kinetic_nb.agent import bootstrap
from kinetic_nb.backends.kubernetes.kubelet_text import (
    field_reference,
    literal,
    literal_command,
    literal_env,
    reference,
)
from kinetic_nb.runner.channel import CHANNEL_ENV
from kinetic_nb.runner.frameworks import COORDINATOR_ENV, NVIDIA_DIR
from kinetic_nb.runner.host_variables import job_variables
from kinetic_nb.runner.job_keys import KEY_ENV, KEY_FILE_ENV
from kinetic_nb.runner.protocol import JobPlan

if TYPE_CHECKING:
    from kinetic_nb.backends.base import JobSecrets
    from kinetic_nb.backends.kubernetes.settings import KubernetesSettings

__all__ = [
    "JOB_LABEL", "LWS_API_VERSION", "LWS_GROUP", "LWS_PLURAL", "LWS_VERSION", "build_manifests", "job_selector",
    "leader_host", "object_metadata", "pod_metadata", "resource_name",
    "uses_leader_worker_set",
]

LWS_GROUP = "leaderworkerset.x-k8s.io"
LWS_VERSION = "v1"
LWS_API_VERSION = f"{LWS_GROUP}/{LWS_VERSION}"
LWS_KIND = "LeaderWorkerSet"
LWS_PLURAL = "leaderworkersets"
#: The LeaderWorkerSet controller labels each pod with its index in the group (leader 0).
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
#: The Job controller annotates (and, since Kubernetes 1.28, labels) each pod of an Indexed Job with its index.
JOB_COMPLETION_INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
#: Asks the LeaderWorkerSet controller to give each group a node topology of its
#: own: with the node pool as the topology, one group (one job) lands on one TPU
#: slice (GKE makes a node pool per multi-host slice) and never straddles two.
LWS_EXCLUSIVE_TOPOLOGY_ANNOTATION = "leaderworkerset.sigs.k8s.io/exclusive-topology"
#: GKE's label naming a node's node pool: one multi-host TPU slice.
NODE_POOL_LABEL = "cloud.google.com/gke-nodepool"
#: GKE label whose value selects the TPU slice shape (``4x4``) within a TPU node pool.
TPU_TOPOLOGY_SELECTOR = "cloud.google.com/gke-tpu-topology"
TPU_RESOURCE = "google.com/tpu"
GPU_RESOURCE = "nvidia.com/gpu"

#: Carried by every object and pod of a job, so listing its pods, cancelling it
#: and cleaning it up are each one label selector. Its value is :func:`resource_name`.
JOB_LABEL = "kinetic-nb/job"
#: The job id exactly as kinetic_nb spells it (a label value has tighter rules).
JOB_ID_ANNOTATION = "kinetic-nb/job-id"
ROLE_LABEL = "kinetic-nb/role"
#: The role of an Indexed Job's host pods (a LeaderWorkerSet's are ``leader`` and ``worker``; the root's ``root``).
HOST_ROLE = "host"
MANAGED_BY = {"app.kubernetes.io/managed-by": "kinetic-nb"}

#: The one container of every host pod.
CONTAINER_NAME = "host"
#: The module every host pod runs, and the root runs with ``--watch``: the host agent,
#: the same on every backend (it starts the runner, uploads its output, writes ``exit.json``).
AGENT_MODULE = "kinetic_nb.agent"
#: A GPU or CPU host's ``/dev/shm``: memory-backed and as large as the node
#: allows, instead of the container runtime's 64 MiB, which NCCL's shared-memory
#: transport and torch's DataLoader workers outgrow. It counts as the pod's memory.
SHM_VOLUME = "kinetic-shm"
SHM_DIR = "/dev/shm"
#: What a GPU or CPU host requests besides its accelerators: enough that it is no
#: longer BestEffort (the first pod evicted under memory pressure), small enough to
#: fit any node its accelerator implies. No limits: a host may use the node.
HOST_REQUESTS = {"cpu": "1", "memory": "4Gi"}
#: A TPU host has its node to itself (every chip of it): it requests this share of the machine's vCPUs and
#: memory, so that it is Burstable rather than BestEffort (the first target of an OOM kill) and leaves the rest
#: for what GKE reserves and runs on every node. No limits: a host may use the whole node.
TPU_HOST_SHARE = 0.5
#: Each TPU host machine type's vCPUs and memory (GiB), from Compute Engine's machine types.
TPU_MACHINES = {
    "ct4p-hightpu-4t": (240, 407),
    "ct5lp-hightpu-1t": (24, 48), "ct5lp-hightpu-4t": (112, 192), "ct5lp-hightpu-8t": (224, 384),
    "ct5p-hightpu-4t": (208, 448),
    "ct6e-standard-1t": (44, 176), "ct6e-standard-4t": (180, 720), "ct6e-standard-8t": (180, 1440),
}
#: A container that fails without writing ``/dev/termination-log`` gets its last
#: log lines as its termination message (at most 80 lines, 2 KiB): the words of
#: a host that never got as far as uploading a log (no ``kinetic_nb`` in the
#: image, a bucket it may not read) reach the cell's error through the pod.
TERMINATION_MESSAGE_POLICY = "FallbackToLogsOnError"
#: The job's key reaches a pod as a file of the job's Secret, mounted read-only (the agent and the
#: bootstrap read the file that ``KINETIC_JOB_KEY_FILE`` names), never as a variable: nothing the
#: container's processes inherit holds it. Readable by any uid, since images run as users of their own;
#: only this job's processes share the pod.
KEY_VOLUME = "kinetic-key"
KEY_DIR = "/var/run/kinetic/key"
KEY_FILE = f"{KEY_DIR}/key"
#: An emptyDir for the cell's scratch files and ``KINETIC_OUTPUT_DIR``.
SCRATCH_VOLUME = "kinetic-scratch"
SCRATCH_DIR = "/kinetic"
#: Between SIGTERM and SIGKILL when a pod is deleted: time to flush the last log
#: chunk. JAX traps SIGTERM, so waiting longer would only delay a cancel.
TERMINATION_GRACE_S = 5
#: A finished Indexed Job stays at most this long. The root Job's end normally
#: removes it much sooner; this bounds it where the root still waits on a host
#: that left no exit record.
JOB_TTL_AFTER_FINISHED_S = 24 * 3600
#: Added to the plan's timeout for ``activeDeadlineSeconds`` (the root's, and an
#: Indexed Job's): the hosts' agents and the client stop a job that runs too long
#: with a clearer message; the deadline is the cluster's backstop for when
#: neither does.
DEADLINE_MARGIN_S = 60
#: Longest resource name. Kubernetes derives longer names from it (pods
#: ``{name}-0-15``, StatefulSets ``{name}-0`` whose pods carry a revision-hash
#: label ``{name}-0-{10 chars}``, the root's pods ``{name}-root-{5 chars}``), and
#: each must stay a 63-character DNS label.
MAX_NAME_LENGTH = 40
#: Characters of the job id's hash kept when a name has to be shortened.
_NAME_HASH_CHARS = 6

#: Runs once per container start. The first start runs the host agent (``exec``,
#: so the agent's own exit code, OOMKilled included, is the container's). A later
#: start finds the host's (its first process's) ``status.json`` or ``exit.json`` already stored and
#: parks instead of running the cell a second time: a LeaderWorkerSet's pods must
#: have ``restartPolicy: Always``, so the kubelet restarts a host that ended, and
#: a pod the StatefulSet recreates after an eviction would start over; a host
#: whose end is already recorded (cancelled, or failed by the client while its
#: pod was Pending) must not start late. The first run's exit stays in the pod's
#: ``lastState.terminated``, where the backend reads it. The check is host-safe
#: Python; any error in it means "run". An image with ``python3`` and no
#: ``python`` (many stock images) runs both with ``python3``. First, where GKE's
#: device plugin mounted the NVIDIA driver (a GPU pod; it sets no variable for it,
#: nor does a stock Python image), the driver goes on ``PATH`` and
#: ``LD_LIBRARY_PATH``, ahead of what the image set, in every image mode: without
#: it torch and JAX see no CUDA.
_ALREADY_STARTED = (
    "import os, sys\n"
    "from kinetic_nb.runner import protocol\n"
    "from kinetic_nb.runner.host_variables import resolve_host_index\n"
    "from kinetic_nb.storage import open_storage\n"
    'index = (resolve_host_index(os.environ) or 0) * int(os.environ.get("LOCAL_WORLD_SIZE") or 1)\n'
    'storage = open_storage(os.environ["KINETIC_JOB_URI"])\n'
    "sys.exit(0 if storage.exists(protocol.host_status(index)) or storage.exists(protocol.host_exit(index)) else 1)\n"
)
HOST_SCRIPT = f"""\
if [ -d {NVIDIA_DIR}/lib64 ]; then
  PATH="{NVIDIA_DIR}/bin:$PATH"
  LD_LIBRARY_PATH="{NVIDIA_DIR}/lib64${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}"
  export PATH LD_LIBRARY_PATH
fi
python=python
command -v python >/dev/null 2>&1 || python=python3
if "$python" -c '{_ALREADY_STARTED}' 2>/dev/null; then
  echo "kinetic_nb: host $KINETIC_HOST_INDEX of job $KINETIC_JOB_ID has run already; not running the cell again" >&2
  trap 'kill $! 2>/dev/null; exit 0' TERM INT
  while :; do sleep 3600 & wait $!; done
fi
if [ "$1" = python ]; then shift; exec "$python" "$@"; fi
exec "$@"
"""
#: ``$0`` of :data:`HOST_SCRIPT`, as ``ps`` and error messages show it.
HOST_SCRIPT_NAME = "kinetic-host"
#: Runs the bootstrap of the prebuilt and build image modes: every stock Python image has ``python3``.
BOOTSTRAP_PYTHON = "python3"
#: Where a host pod installs its environment: on the scratch volume, which outlives a restarted
#: container, so the kubelet's restart of a LeaderWorkerSet pod finds it installed.
ENVIRONMENT_DIR = f"{SCRATCH_DIR}/environment"

_INVALID_NAME_CHARS = re.compile(r"[^a-z0-9-]+")



def resource_name(job_id: str) -> str:
    """The Kubernetes name of a job's objects: a DNS-1035 label of at most :data:`MAX_NAME_LENGTH`.

    Parameters
    ----------
    job_id : str
        A kinetic job id such as ``kn-20261129-234752-3e8d32`` (which is kept as it is).

    Returns
    -------
    str
        Lowercase letters, digits and ``-``, starting with a letter; a name that
        had to be changed or shortened ends with a hash of ``job_id``, so two
        ids never share a name.
    """
    name = _INVALID_NAME_CHARS.sub("-", job_id.lower()).strip("-")
    name = re.sub(r"-{2,}", "-", name)
    if not name[:1].isalpha():
        name = f"kn-{name}".rstrip("-")
    if name != job_id or len(name) > MAX_NAME_LENGTH:
        digest = hashlib.sha256(job_id.encode()).hexdigest()[:_NAME_HASH_CHARS]
        name = f"{name[:MAX_NAME_LENGTH - _NAME_HASH_CHARS - 1].rstrip('-')}-{digest}"
    return name


def job_selector(job_id: str) -> str:
    """The label selector of every object and pod of ``job_id``."""
    return f"{JOB_LABEL}={resource_name(job_id)}"


def leader_host(job_id: str, namespace: str) -> str:
    """The DNS name of host 0, for both kinds of workload.

    A LeaderWorkerSet's leader pod is ``{name}-0`` in the headless Service
    ``{name}`` that the LeaderWorkerSet controller creates; an Indexed Job's
    pod 0 has the hostname ``{name}-0`` and the subdomain of the Service
    ``{name}`` created with it. Either way: ``{name}-0.{name}.{namespace}``
    (the form the LeaderWorkerSet controller puts in ``LWS_LEADER_ADDRESS``).
    """
    name = resource_name(job_id)
    return f"{name}-0.{name}.{namespace}"


def uses_leader_worker_set(acc: Accelerator, hosts: int) -> bool:
    """A multi-host TPU slice is one LeaderWorkerSet; everything else an Indexed Job."""
    return acc.kind == "tpu" and hosts > 1


def build_manifests(plan: JobPlan, job_uri: str, settings: KubernetesSettings, *,
                    owner: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every object to create for ``plan`` after its root Job, in creation order, each owned by ``owner``.

    Parameters
    ----------
    plan : JobPlan
        The stored plan; its accelerator decides the workload and the node pool.
    job_uri : str
        The job's storage URI (``gs://bucket/prefix/{job_id}``) the pods read and write.
    settings : KubernetesSettings
        Namespace, image (required), service account, coordinator port, extra node selectors.
    owner : mapping
        The ``ownerReferences`` entry every object gets: the job's root Job,
        whose uid is known once it is created
        (:func:`kinetic_nb.backends.kubernetes.root.root_owner_reference`).

    Returns
    -------
    list of dict
        ``[LeaderWorkerSet]`` for a multi-host TPU slice; else ``[Job]``, or
        ``[Service, Job]`` when there is more than one host (the Service first, so
        host 0's name resolves as soon as its pod exists).
    """
    acc = resolve_accelerator(plan.accelerator)
    image = settings.require_image()
    if uses_leader_worker_set(acc, plan.hosts):
        manifests = [_leader_worker_set(plan, acc, job_uri, settings, image)]
    else:
        job = _indexed_job(plan, acc, job_uri, settings, image)
        manifests = [_headless_service(plan, settings), job] if plan.hosts > 1 else [job]
    for manifest in manifests:
        manifest["metadata"]["ownerReferences"] = [dict(owner)]
    return manifests


def object_metadata(plan: JobPlan, settings: KubernetesSettings, *, name: str | None = None,
                    role: str | None = None) -> dict[str, Any]:
    """An object's name (default :func:`resource_name`), namespace, job label and job id annotation."""
    labels = {JOB_LABEL: resource_name(plan.job_id), **MANAGED_BY}
    if role is not None:
        labels[ROLE_LABEL] = role
    return {
        "name": name or resource_name(plan.job_id),
        "namespace": settings.namespace,
        "labels": labels,
        "annotations": {JOB_ID_ANNOTATION: plan.job_id},
    }


def pod_metadata(plan: JobPlan, role: str) -> dict[str, Any]:
    """A pod template's job label, ``role`` label and job id annotation."""
    return {
        "labels": {JOB_LABEL: resource_name(plan.job_id), ROLE_LABEL: role, **MANAGED_BY},
        "annotations": {JOB_ID_ANNOTATION: plan.job_id},
    }


def _leader_worker_set(plan: JobPlan, acc: Accelerator, job_uri: str, settings: KubernetesSettings,
                       image: str) -> dict[str, Any]:
    metadata = object_metadata(plan, settings)
    metadata["annotations"][LWS_EXCLUSIVE_TOPOLOGY_ANNOTATION] = NODE_POOL_LABEL
    return {
        "apiVersion": LWS_API_VERSION,
        "kind": LWS_KIND,
        "metadata": metadata,
        "spec": {
            "replicas": 1,
            # Workers start with the leader: the hosts wait for each other at kinetic's own start barrier.
            "startupPolicy": "LeaderCreated",
            # One headless Service named after the set: the leader is {name}-0.{name}, see leader_host().
            "networkConfig": {"subdomainPolicy": "Shared"},
            "leaderWorkerTemplate": {
                "size": plan.hosts,
                # Never recreate the group behind the user's back: a new group would run the cell
                # again from the start. A failure ends the job; the client reports it.
                "restartPolicy": "None",
                "leaderTemplate": _pod_template(plan, acc, job_uri, settings, image, role="leader", lws=True),
                "workerTemplate": _pod_template(plan, acc, job_uri, settings, image, role="worker", lws=True),
            },
        },
    }


def _indexed_job(plan: JobPlan, acc: Accelerator, job_uri: str, settings: KubernetesSettings,
                 image: str) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "completionMode": "Indexed",
        "completions": plan.hosts,
        "parallelism": plan.hosts,
        # A failed host fails the job: no pod is retried, so no cell runs twice.
        "backoffLimit": 0,
        "ttlSecondsAfterFinished": JOB_TTL_AFTER_FINISHED_S,
        "template": _pod_template(plan, acc, job_uri, settings, image, role=HOST_ROLE, lws=False),
    }
    if plan.timeout_s is not None:
        spec["activeDeadlineSeconds"] = math.ceil(plan.timeout_s) + DEADLINE_MARGIN_S
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": object_metadata(plan, settings), "spec": spec}


def _headless_service(plan: JobPlan, settings: KubernetesSettings) -> dict[str, Any]:
    name = resource_name(plan.job_id)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_metadata(plan, settings),
        "spec": {
            "clusterIP": "None",
            # Hosts look each other up before they are Ready.
            "publishNotReadyAddresses": True,
            # Host pods only: the root's pod carries the job label too.
            "selector": {JOB_LABEL: name, ROLE_LABEL: HOST_ROLE},
            "ports": [{"name": "coordinator", "port": settings.coordinator_port,
                       "targetPort": settings.coordinator_port}],
        },
    }


def _pod_template(plan: JobPlan, acc: Accelerator, job_uri: str, settings: KubernetesSettings, image: str, *,
                  role: str, lws: bool) -> dict[str, Any]:
    name = resource_name(plan.job_id)
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": image,
        "command": installing_first(settings, "/bin/sh", "-c", HOST_SCRIPT, HOST_SCRIPT_NAME),
        "args": literal_command("python", "-m", AGENT_MODULE, "--job", job_uri),
        "env": host_environment(plan, acc, job_uri, settings, lws=lws),
        "ports": [{"name": "coordinator", "containerPort": settings.coordinator_port}],
        "volumeMounts": [{"name": SCRATCH_VOLUME, "mountPath": SCRATCH_DIR}],
        "terminationMessagePolicy": TERMINATION_MESSAGE_POLICY,
    }
    if plan.session:  # the session's hub (on host 0)
        container["ports"].append({"name": "channel", "containerPort": settings.channel_port})
    resources = _accelerator_resources(acc)
    if resources:
        container["resources"] = {"requests": dict(resources), "limits": dict(resources)}
    volumes: list[dict[str, Any]] = [{"name": SCRATCH_VOLUME, "emptyDir": {}}]
    container.setdefault("resources", {}).setdefault("requests", {}).update(host_requests(acc))
    # Data loaders share tensors through /dev/shm, which a container gets 64 MiB of unless it mounts its own.
    container["volumeMounts"].append({"name": SHM_VOLUME, "mountPath": SHM_DIR})
    volumes.append({"name": SHM_VOLUME, "emptyDir": {"medium": "Memory"}})
    spec: dict[str, Any] = {
        # A StatefulSet's pods (a LeaderWorkerSet's) must say Always; HOST_SCRIPT keeps a host to one run.
        "restartPolicy": "Always" if lws else "Never",
        "terminationGracePeriodSeconds": TERMINATION_GRACE_S,
        # No variables for every Service in the namespace: they could shadow $(VAR) references.
        "enableServiceLinks": False,
        "containers": [container],
        "volumes": volumes,
    }
    with_key_file(spec, plan)
    node_selector = {**accelerator_node_selector(acc), **settings.node_selector}
    if node_selector:
        spec["nodeSelector"] = node_selector
    if settings.service_account:
        spec["serviceAccountName"] = settings.service_account
    if not lws and plan.hosts > 1:
        spec["subdomain"] = name  # pod i is {name}-{i}.{name}: host 0 is the coordinator
    return {"metadata": pod_metadata(plan, role), "spec": spec}


def host_requests(acc: Accelerator) -> dict[str, str]:
    """What a host requests besides its accelerators: :data:`TPU_HOST_SHARE` of a TPU host's machine, else
    :data:`HOST_REQUESTS`."""
    if acc.kind != "tpu":
        return dict(HOST_REQUESTS)
    cpus, memory_gib = TPU_MACHINES[acc.machine_type]
    return {"cpu": str(int(cpus * TPU_HOST_SHARE)), "memory": f"{int(memory_gib * TPU_HOST_SHARE)}Gi"}


def installing_first(settings: KubernetesSettings, *command: str, requirements: bool = True) -> list[str]:
    """``command`` as a container's ``command``; in the prebuilt and build image modes, behind the bootstrap
    (:mod:`kinetic_nb.agent.bootstrap`) that installs the job's signed environment first."""
    from kinetic_nb.backends.host_environment import bootstrap_source
    from kinetic_nb.backends.kubernetes.image_modes import ImageMode

    if settings.mode is ImageMode.CUSTOM:
        return literal_command(*command)
    options = () if requirements else ("--no-requirements",)
    return literal_command(BOOTSTRAP_PYTHON, "-c", bootstrap_source(), *options, "--", *command)


def accelerator_node_selector(acc: Accelerator) -> dict[str, str]:
    if acc.kind == "tpu":
        selector = {TPU_NODE_SELECTOR: acc.gke_accelerator, TPU_TOPOLOGY_SELECTOR: acc.topology}
        if acc.machine_type:  # the topology alone matches pools whose hosts hold other chip counts
            selector[MACHINE_TYPE_SELECTOR] = acc.machine_type
        return selector
    if acc.kind == "gpu":
        return {GPU_NODE_SELECTOR: acc.gke_accelerator}
    return {}


def _accelerator_resources(acc: Accelerator) -> dict[str, str]:
    if acc.kind == "tpu":
        return {TPU_RESOURCE: str(acc.devices_per_host)}
    if acc.kind == "gpu":
        return {GPU_RESOURCE: str(acc.devices_per_host)}
    return {}


def secret_name(job_id: str) -> str:
    """The job's Secret: its key and its ``-e`` values, which never enter storage or a manifest's literals."""
    return f"{resource_name(job_id)}-secrets"


def secret_env(plan: JobPlan) -> list[dict[str, Any]]:
    """``env`` entries that name the job's key file and take each ``-e`` value from the job's Secret."""
    return [literal(KEY_FILE_ENV, KEY_FILE)] + [
        {"name": name, "valueFrom": {"secretKeyRef": {"name": secret_name(plan.job_id), "key": name}}}
        for name in plan.env_names]


def with_key_file(pod: dict[str, Any], plan: JobPlan) -> dict[str, Any]:
    """``pod`` (a pod spec) with the job's key, from its Secret, mounted read-only in its one container."""
    pod.setdefault("volumes", []).append({"name": KEY_VOLUME, "secret": {
        "secretName": secret_name(plan.job_id), "items": [{"key": KEY_ENV, "path": KEY_FILE.rsplit("/", 1)[1]}],
        "defaultMode": 0o444}})
    [container] = pod["containers"]
    container.setdefault("volumeMounts", []).append({"name": KEY_VOLUME, "mountPath": KEY_DIR, "readOnly": True})
    return pod


def secret_manifest(plan: JobPlan, settings: KubernetesSettings, secrets: JobSecrets,
                    owner: dict[str, Any]) -> dict[str, Any]:
    """The job's Secret, owned by its root Job: created before the pods, deleted with the job."""
    metadata = object_metadata(plan, settings, name=secret_name(plan.job_id))
    metadata["ownerReferences"] = [owner]
    return {"apiVersion": "v1", "kind": "Secret", "metadata": metadata, "type": "Opaque",
            "stringData": {name: str(value) for name, value in secrets.environment().items()}}  # plain text for the API


def host_environment(plan: JobPlan, acc: Accelerator, job_uri: str, settings: KubernetesSettings, *,
                     lws: bool) -> list[dict[str, Any]]:
    """The container's ``env`` list, in order (a ``$(VAR)`` sees only the variables before it).

    On a LeaderWorkerSet the controller's webhook puts ``LWS_LEADER_ADDRESS``,
    ``LWS_GROUP_SIZE`` and ``LWS_WORKER_INDEX`` in front of this list, so they
    can be referenced here.
    """
    port = str(settings.coordinator_port)
    env = literal_env(job_variables(plan, job_uri, f"{SCRATCH_DIR}/outputs"))  # named once, for every launcher
    if lws:
        index_path = f"metadata.labels['{LWS_WORKER_INDEX_LABEL}']"
        name = resource_name(plan.job_id)
        env += [
            field_reference("KINETIC_HOST_INDEX", index_path),
            # Set here, the LeaderWorkerSet webhook adds no TPU variables of its own: it skips a
            # container that has TPU_WORKER_ID, so the hostnames it would add are given too.
            field_reference("TPU_WORKER_ID", index_path),
            literal("TPU_WORKER_HOSTNAMES", ",".join(
                [f"{name}-0.{name}"] + [f"{name}-0-{i}.{name}" for i in range(1, plan.hosts)])),
            # JAX's own cluster detection does not know LeaderWorkerSets: the runner passes this on.
            reference(COORDINATOR_ENV, f"$(LWS_LEADER_ADDRESS):{port}"),
            reference("MASTER_ADDR", "$(LWS_LEADER_ADDRESS)"),
        ]
        if plan.session:  # the session's hub, beside host 0's agent (runner.channel)
            env.append(reference(CHANNEL_ENV, f"$(LWS_LEADER_ADDRESS):{settings.channel_port}"))
    else:
        env.append(field_reference("JOB_COMPLETION_INDEX", f"metadata.annotations['{JOB_COMPLETION_INDEX_ANNOTATION}']"))
        env.append(reference("KINETIC_HOST_INDEX", "$(JOB_COMPLETION_INDEX)"))
        if plan.hosts == 1:
            # No Service for one host: it is its own coordinator, on the loopback.
            env.append(literal(COORDINATOR_ENV, f"127.0.0.1:{port}"))
            env.append(literal("MASTER_ADDR", "127.0.0.1"))
        else:
            env.append(literal("MASTER_ADDR", leader_host(plan.job_id, settings.namespace)))
        if plan.session:  # the session's hub, beside host 0's agent (runner.channel)
            leader = "127.0.0.1" if plan.hosts == 1 else leader_host(plan.job_id, settings.namespace)
            env.append(literal(CHANNEL_ENV, f"{leader}:{settings.channel_port}"))
    # Each process's rank (RANK, LOCAL_RANK, ...) is set by the pod's agent as it starts it (a pod is a host,
    # which may run several): runner.host_variables.process_environment.
    if settings.mode.value != "custom":  # the prebuilt and build image modes install into the scratch volume
        env.append(literal(bootstrap.DIRECTORY_ENV, ENVIRONMENT_DIR))
    env += secret_env(plan)  # the job's key file and the user's own -e values, last: they win
    return env
