"""The root Job: what ends a kinetic job on the cluster when no client does.

A LeaderWorkerSet has no deadline and no TTL: with the notebook's kernel gone,
its pods would park and hold their accelerators forever. So every job gets a
small root Job (``{name}-root``), created before anything else, and every
other object of the job (:func:`~kinetic_nb.backends.kubernetes.manifests.build_manifests`)
names it in ``ownerReferences``. The root's one pod runs ``python -m
kinetic_nb.agent --job URI --watch``, which exits 0 once every host has an exit
record or the job was cancelled; the root then completes, and
:data:`ROOT_TTL_AFTER_FINISHED_S` later the cluster deletes it. Whenever the
root goes (that TTL, its deadline and then the TTL, or the client's cancel
and cleanup), the garbage collector deletes the LeaderWorkerSet or Job, the
Service and every pod with it.

Pure functions, no ``kubernetes`` import: tested offline with the manifests.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from kinetic_nb.backends.kubernetes.kubelet_text import literal_env
from kinetic_nb.backends.kubernetes.manifests import (
    AGENT_MODULE,
    DEADLINE_MARGIN_S,
    TERMINATION_GRACE_S,
    TERMINATION_MESSAGE_POLICY,
    installing_first,
    object_metadata,
    pod_metadata,
    resource_name,
    secret_env,
    with_key_file,
)
from kinetic_nb.runner.protocol import JobPlan

if TYPE_CHECKING:
    from kinetic_nb.backends.kubernetes.settings import KubernetesSettings

__all__ = ["DEFAULT_MAX_LIFETIME_S", "ROOT_TTL_AFTER_FINISHED_S", "root_deadline_s", "root_job", "root_name",
           "root_owner_reference"]

#: The root's deadline when the plan has no timeout: every job ends, even one
#: nobody watches. A week outlasts any interactive job or kept-up session worth
#: keeping, and bounds what a forgotten slice costs; pass ``--timeout`` for less.
DEFAULT_MAX_LIFETIME_S = 7 * 24 * 3600
#: The root is deleted this long after it ends, and the garbage collector then
#: deletes the rest of the job. Long enough for a watching notebook to read the
#: pods' last states (it lists them every few seconds) and for a ``kubectl
#: describe`` right after the end; short, because a LeaderWorkerSet's parked pods
#: hold their accelerators until then.
ROOT_TTL_AFTER_FINISHED_S = 120
#: The watcher reads a few small objects every few seconds: a sliver of a CPU.
#: The memory limit stops a runaway from starving its node, and is generous
#: because a watcher killed for memory fails the root, which ends the whole job.
ROOT_RESOURCES = {"requests": {"cpu": "50m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}}
#: The root's name is the job's resource name with this after it.
ROOT_SUFFIX = "-root"
#: The role label of the root Job and its pod, which carry the job label too
#: (``kubectl get -l kinetic-nb/job=...`` shows them).
ROOT_ROLE = "root"
#: The root's one container: it only watches the job's storage.
ROOT_CONTAINER_NAME = "watch"


def root_name(job_id: str) -> str:
    """The name of the job's root Job: ``{resource_name}-root``."""
    return resource_name(job_id) + ROOT_SUFFIX


def root_owner_reference(job_id: str, root_uid: str) -> dict[str, Any]:
    """The ``ownerReferences`` entry that makes an object of ``job_id`` a dependent of its root Job.

    Parameters
    ----------
    job_id : str
    root_uid : str
        The root Job's ``metadata.uid``, from the API server's answer to its creation.

    Returns
    -------
    dict
        Not the controller (the LeaderWorkerSet and Job controllers own their
        pods); ``blockOwnerDeletion``, so a foreground deletion of the root
        lasts until the object is gone.
    """
    return {"apiVersion": "batch/v1", "kind": "Job", "name": root_name(job_id), "uid": root_uid,
            "controller": False, "blockOwnerDeletion": True}


def root_deadline_s(plan: JobPlan) -> int:
    """The root's ``activeDeadlineSeconds``: the plan's timeout plus
    :data:`~kinetic_nb.backends.kubernetes.manifests.DEADLINE_MARGIN_S`, else :data:`DEFAULT_MAX_LIFETIME_S`."""
    if plan.timeout_s is None:
        return DEFAULT_MAX_LIFETIME_S
    return math.ceil(plan.timeout_s) + DEADLINE_MARGIN_S


def root_job(plan: JobPlan, job_uri: str, settings: KubernetesSettings) -> dict[str, Any]:
    """The job's root Job, to create before every other object of the job.

    Its pod runs on any node: no accelerator, and none of the settings' node
    selectors (they would send a CPU pod to tainted accelerator nodes). A pod
    that the cluster takes away (a node drained or preempted) is replaced,
    not counted as a failure; any other failure of the watcher fails the
    root, which ends the job.

    Parameters
    ----------
    plan : JobPlan
        Its timeout sets the deadline (:func:`root_deadline_s`).
    job_uri : str
        The job's storage URI, which the watcher reads.
    settings : KubernetesSettings
        Namespace, image (required) and service account: the watcher reaches
        storage as the hosts do.

    Returns
    -------
    dict
        A ``batch/v1`` Job named :func:`root_name`.
    """
    container: dict[str, Any] = {
        "name": ROOT_CONTAINER_NAME,
        "image": settings.require_image(),
        # In the prebuilt and build image modes the watcher installs kinetic_nb first, not the requirements.
        "command": installing_first(settings, "python", "-m", AGENT_MODULE, "--job", job_uri, "--watch",
                                    requirements=False),
        # The key's file (to verify the plan and the records it counts) and the user's own variables last,
        # as on the hosts: they may say how storage is reached.
        "env": literal_env({"KINETIC_JOB_ID": plan.job_id, "KINETIC_JOB_URI": job_uri, "PYTHONUNBUFFERED": "1"})
        + secret_env(plan),
        "resources": {part: dict(values) for part, values in ROOT_RESOURCES.items()},
        # A watcher that fails (a bucket it may not read, say) leaves its last lines where the client reads them.
        "terminationMessagePolicy": TERMINATION_MESSAGE_POLICY,
    }
    pod: dict[str, Any] = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": TERMINATION_GRACE_S,
        "enableServiceLinks": False,
        "containers": [container],
    }
    with_key_file(pod, plan)
    if settings.service_account:
        pod["serviceAccountName"] = settings.service_account
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": object_metadata(plan, settings, name=root_name(plan.job_id), role=ROOT_ROLE),
        "spec": {
            "backoffLimit": 0,
            "podFailurePolicy": {"rules": [{"action": "Ignore",
                                            "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]},
            "activeDeadlineSeconds": root_deadline_s(plan),
            "ttlSecondsAfterFinished": ROOT_TTL_AFTER_FINISHED_S,
            "template": {"metadata": pod_metadata(plan, ROOT_ROLE), "spec": pod},
        },
    }
