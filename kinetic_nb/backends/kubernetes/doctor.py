"""``kinetic_nb.doctor()`` and ``%kinetic doctor``: is this notebook ready to run cells on GKE, and if not, the fix.

Each check says ok, warn (may be fine: a node pool scaled to zero has no
nodes to see) or fail, with the exact command that fixes a failure:

- the cluster is reachable (kubeconfig or in-cluster credentials);
- the namespace exists;
- the LeaderWorkerSet API is served (multi-host TPU slices only);
- nodes carry the labels the accelerator's pods select;
- this user may do each thing the backend does (a SelfSubjectAccessReview
  per verb and resource);
- the job storage is readable and writable from the notebook (an object is
  written, read back and deleted);
- the pods' Kubernetes service account reaches the bucket: its Workload
  Identity Google service account, or the service account's own principal, is
  granted an object role in the bucket's IAM policy (Google's IAM API, through
  ``google-cloud-storage``);
- the image mode has what it needs: the ``--requirements`` file has no line
  only this machine can satisfy; ``prebuilt``: the pods reach the package
  index, which needs a pod (a warning, with the command that checks it);
  ``build``: the registry's Artifact Registry repository exists, the Cloud
  Build API is enabled and this user may create builds (Google's REST APIs,
  through ``google-auth``), and whether the image for these requirements is
  built yet.

Not checked here: the image's Python and kinetic_nb versions, and whether the
pods reach the package index (each needs a pod; every host compares the
versions with the plan's when it starts, and pip's failure is in its log).
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from kinetic_nb.accelerators import Accelerator, kinetic_spellings, resolve_accelerator
from kinetic_nb.backends.kubernetes.api import KubernetesApi, api_message, connect
from kinetic_nb.backends.kubernetes.backend import API_TIMEOUT_S, KubernetesBackend
from kinetic_nb.backends.kubernetes.doctor_report import FAIL, OK, WARN, Check, DoctorReport
from kinetic_nb.backends.kubernetes.kinetic_profile import kinetic_target
from kinetic_nb.backends.kubernetes.manifests import (
    LWS_GROUP,
    LWS_PLURAL,
    LWS_VERSION,
    accelerator_node_selector,
    uses_leader_worker_set,
)
from kinetic_nb.backends.kubernetes.settings import KubernetesSettings
from kinetic_nb.errors import KineticError

logger = logging.getLogger(__name__)

__all__ = ["Check", "DoctorReport", "doctor", "required_permissions"]

#: The LeaderWorkerSet release the fix installs: the newest one kinetic_nb's manifests are checked against.
LWS_INSTALL_VERSION = "v0.9.0"
#: The GKE annotation that binds a Kubernetes service account to a Google service account (Workload Identity).
WORKLOAD_IDENTITY_ANNOTATION = "iam.gke.io/gcp-service-account"
#: Bucket roles that let a member read, write and delete objects (what hosts do with job storage).
OBJECT_ROLES = frozenset({"roles/storage.objectUser", "roles/storage.objectAdmin", "roles/storage.admin"})
#: The role the fix grants: objects read, written, listed and deleted, and nothing about the bucket itself.
GRANTED_ROLE = "roles/storage.objectUser"
#: Where the storage probe is written under the storage root; deleted at once.
PROBE_PREFIX = ".kinetic-doctor"

def required_permissions(acc: Accelerator) -> list[tuple[str, str, str]]:
    """``(API group, resource, verb)`` for everything the backend does with a job of ``acc``."""
    needed = [("batch", "jobs", verb) for verb in ("create", "delete", "get")]
    needed += [("", "secrets", verb) for verb in ("create", "get")]
    needed += [("", "services", verb) for verb in ("create", "delete")]
    needed += [("", "pods", "list"), ("", "events", "list")]
    if uses_leader_worker_set(acc, acc.hosts):
        needed += [(LWS_GROUP, LWS_PLURAL, verb) for verb in ("create", "delete")]
    return needed


def _cluster_checks(api: KubernetesApi, settings: KubernetesSettings, acc: Accelerator) -> list[Check]:
    from kubernetes import client

    namespace = settings.namespace
    try:
        version = client.VersionApi(api.core.api_client).get_code(_request_timeout=API_TIMEOUT_S)
    except Exception as error:  # noqa: BLE001 - any failure here is "unreachable", with its reason
        return [Check("cluster reachable", FAIL, f"no answer from the API server: {api_message(error)}",
                      "gcloud container clusters get-credentials CLUSTER --location LOCATION")]
    checks = [Check("cluster reachable", OK, f"Kubernetes {version.git_version}")]
    try:
        api.core.read_namespace(namespace, _request_timeout=API_TIMEOUT_S)
        checks.append(Check("namespace", OK, namespace))
    except Exception as error:  # noqa: BLE001 - reported as a row
        if getattr(error, "status", None) == 404:
            checks.append(Check("namespace", FAIL, f"{namespace} does not exist", f"kubectl create namespace {namespace}"))
        else:
            checks.append(Check("namespace", WARN, f"could not read namespace {namespace}: {api_message(error)}"))
    if uses_leader_worker_set(acc, acc.hosts):
        checks.append(_leader_worker_set_check(api))
    if acc.kind != "cpu":
        checks.append(_node_check(api, acc))
    checks.append(_workload_identity_check(api))
    checks += _permission_checks(api, namespace, acc)
    return checks


def _leader_worker_set_check(api: KubernetesApi) -> Check:
    fix = (f"kubectl apply --server-side -f https://github.com/kubernetes-sigs/lws/releases/download/"
           f"{LWS_INSTALL_VERSION}/manifests.yaml")
    try:
        api.custom.get_api_resources(LWS_GROUP, LWS_VERSION, _request_timeout=API_TIMEOUT_S)
    except Exception as error:  # noqa: BLE001 - reported as a row
        if getattr(error, "status", None) == 404:
            return Check("LeaderWorkerSet API", FAIL, f"{LWS_GROUP}/{LWS_VERSION} is not served", fix)
        return Check("LeaderWorkerSet API", WARN, f"could not ask for {LWS_GROUP}/{LWS_VERSION}: {api_message(error)}")
    return Check("LeaderWorkerSet API", OK, f"{LWS_GROUP}/{LWS_VERSION} (multi-host TPU slices)")


def kinetic_up_command(acc: Accelerator) -> str:
    """How to make a cluster for ``acc`` from nothing (keras-kinetic's ``kinetic up``), or reach an existing one."""
    spelled = next((name.split(":", 1)[1] for name in kinetic_spellings(acc.name)), None)
    existing = "an existing cluster: gcloud container clusters get-credentials CLUSTER --location LOCATION"
    if acc.kind == "cpu":
        spelled = "cpu"
    if spelled is None:
        return f"{existing}; keras-kinetic's kinetic up makes no {acc.name} pool (docs/gke.md has the node pool)"
    return (f"pip install keras-kinetic && kinetic up --project PROJECT --zone ZONE --accelerator {spelled} "
            f"(or, for {existing})")


def node_pool_command(acc: Accelerator) -> str:
    """The ``gcloud`` command that creates a node pool whose nodes carry ``acc``'s labels."""
    pool = acc.name
    if acc.kind == "tpu":
        return (f"gcloud container node-pools create {pool} --cluster CLUSTER --location LOCATION "
                f"--machine-type {acc.machine_type} --tpu-topology {acc.topology} --num-nodes {acc.hosts}")
    return (f"gcloud container node-pools create {pool} --cluster CLUSTER --location LOCATION "
            f"--accelerator type={acc.gke_accelerator},count={acc.devices_per_host},gpu-driver-version=latest "
            "--machine-type MACHINE_TYPE --num-nodes 1")


def _node_check(api: KubernetesApi, acc: Accelerator) -> Check:
    labels = accelerator_node_selector(acc)
    selector = ",".join(f"{key}={value}" for key, value in labels.items())
    try:
        nodes = api.core.list_node(label_selector=selector, _request_timeout=API_TIMEOUT_S)
    except Exception as error:  # noqa: BLE001 - reported as a row
        return Check("node pool", WARN, f"could not list nodes: {api_message(error)}")
    count = len(nodes.items)
    if count >= acc.hosts:
        return Check("node pool", OK, f"{count} node(s) with {selector}")
    return Check("node pool", WARN, f"{count} node(s) with {selector} now, {acc.hosts} needed (fine if a pool "
                 "with these labels scales up from zero)", node_pool_command(acc))


#: The label GKE puts on a node whose pool runs its metadata server: Workload Identity, for pods there.
METADATA_SERVER_LABEL = "iam.gke.io/gke-metadata-server-enabled"


def _workload_identity_check(api: KubernetesApi) -> Check:
    """Whether the cluster's nodes run GKE's metadata server: without it (Workload Identity off), a pod reaches
    the bucket as its node's service account, not as the Kubernetes service account bound to a Google one."""
    name = "Workload Identity"
    try:
        nodes = api.core.list_node(label_selector=f"{METADATA_SERVER_LABEL}=true", _request_timeout=API_TIMEOUT_S)
    except Exception as error:  # noqa: BLE001 - reported as a row
        return Check(name, WARN, f"could not list nodes: {api_message(error)}")
    if nodes.items:
        return Check(name, OK, f"{len(nodes.items)} node(s) run GKE's metadata server: pods act as their "
                               "Kubernetes service account's Google one")
    return Check(name, WARN, f"no node runs GKE's metadata server ({METADATA_SERVER_LABEL}): Workload Identity is "
                             "off (or only pools scaled to zero have it), and pods would reach the bucket as their "
                             "node's service account",
                 "gcloud container clusters update CLUSTER --location LOCATION --workload-pool=PROJECT_ID.svc.id.goog "
                 "&& gcloud container node-pools update POOL --cluster CLUSTER --location LOCATION "
                 "--workload-metadata=GKE_METADATA")


def _permission_checks(api: KubernetesApi, namespace: str, acc: Accelerator) -> list[Check]:
    from kubernetes import client

    authorization = client.AuthorizationV1Api(api.core.api_client)
    denied, unknown = [], []
    for group, resource, verb in required_permissions(acc):
        review = {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
                  "spec": {"resourceAttributes": {"namespace": namespace, "verb": verb, "group": group,
                                                  "resource": resource}}}
        try:
            answer = authorization.create_self_subject_access_review(review, _request_timeout=API_TIMEOUT_S)
        except Exception as error:  # noqa: BLE001 - reported as a row
            unknown.append(f"{verb} {resource}: {api_message(error)}")
            continue
        if not answer.status.allowed:
            denied.append((group, resource, verb))
    checks = []
    for group, resource, verb in denied:
        qualified = f"{resource}.{group}" if group else resource
        role = f"kinetic-{verb}-{resource}".replace(".", "-")
        checks.append(Check(f"may {verb} {qualified}", FAIL, f"not allowed in namespace {namespace}",
                            f"kubectl create role {role} --verb={verb} --resource={qualified} -n {namespace} && "
                            f"kubectl create rolebinding {role} --role={role} "
                            f"--user=$(gcloud config get-value account) -n {namespace}"))
    if unknown:
        checks.append(Check("permissions", WARN, "could not ask: " + "; ".join(unknown)))
    elif not denied:
        checks.append(Check("permissions", OK, f"all {len(required_permissions(acc))} verbs the backend uses, "
                                               f"in namespace {namespace}"))
    return checks


def _storage_check(uri: str) -> Check:
    from kinetic_nb.storage import open_storage

    name = f"{PROBE_PREFIX}/{secrets.token_hex(6)}"
    data = b"kinetic_nb doctor probe"
    bucket = _bucket(uri)
    fix = (f"gcloud storage buckets add-iam-policy-binding gs://{bucket} "
           f"--member=user:$(gcloud config get-value account) --role={GRANTED_ROLE}") if bucket else ""
    try:
        storage = open_storage(uri)
        storage.write_bytes(name, data)
        try:
            read = storage.read_bytes(name)
        finally:
            storage.delete(name)
    except Exception as error:  # noqa: BLE001 - reported as a row
        if type(error.__cause__).__name__ == "DefaultCredentialsError":  # no login yet: a role would not help
            fix = "gcloud auth application-default login"
        return Check("storage", FAIL, f"{uri} is not writable and readable from here: "
                     f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}", fix)
    if read != data:
        return Check("storage", FAIL, f"{uri} returned other bytes than were written", fix)
    return Check("storage", OK, f"{uri} written, read back and deleted")


def _bucket(uri: str) -> str:
    return uri[len("gs://"):].split("/", 1)[0] if uri.startswith("gs://") else ""


def bucket_iam_policy(bucket: str) -> dict[str, set[str]]:
    """The bucket's IAM bindings (role -> members), from Google's IAM API through ``google-cloud-storage``."""
    from google.cloud import storage as gcs

    policy = gcs.Client().bucket(bucket).get_iam_policy(requested_policy_version=3)
    return {binding["role"]: set(binding["members"]) for binding in policy.bindings}


def _service_account_check(api: KubernetesApi, settings: KubernetesSettings, uri: str,
                           iam_policy: Callable[[str], Mapping[str, Iterable[str]]]) -> Check:
    bucket = _bucket(uri)
    account = settings.service_account or "default"
    namespace = settings.namespace
    try:
        service_account = api.core.read_namespaced_service_account(account, namespace, _request_timeout=API_TIMEOUT_S)
    except Exception as error:  # noqa: BLE001 - reported as a row
        if getattr(error, "status", None) == 404:
            return Check("pods' service account", FAIL, f"{namespace}/{account} does not exist",
                         f"kubectl create serviceaccount {account} -n {namespace}")
        return Check("pods' service account", WARN, f"could not read {namespace}/{account}: {api_message(error)}")
    annotations = (service_account.metadata.annotations or {}) if service_account.metadata else {}
    google_account = annotations.get(WORKLOAD_IDENTITY_ANNOTATION)
    try:
        bindings = {role: set(members) for role, members in iam_policy(bucket).items()}
    except Exception as error:  # noqa: BLE001 - reported as a row
        return Check("pods reach the bucket", WARN, f"could not read the IAM policy of gs://{bucket}: {error}")
    members = set().union(*(bindings.get(role, set()) for role in OBJECT_ROLES))
    principal_suffix = f".svc.id.goog/subject/ns/{namespace}/sa/{account}"
    if google_account and f"serviceAccount:{google_account}" in members:
        return Check("pods reach the bucket", OK, f"{namespace}/{account} is {google_account}, which may use "
                                                  f"objects in gs://{bucket}")
    if any(member.startswith("principal://") and member.endswith(principal_suffix) for member in members):
        return Check("pods reach the bucket", OK, f"{namespace}/{account} may use objects in gs://{bucket} "
                                                  "(Workload Identity principal)")
    if google_account:
        fix = (f"gcloud storage buckets add-iam-policy-binding gs://{bucket} "
               f"--member=serviceAccount:{google_account} --role={GRANTED_ROLE}")
        return Check("pods reach the bucket", FAIL, f"{namespace}/{account} is {google_account}, which has no "
                                                    f"object role on gs://{bucket}", fix)
    fix = (f"gcloud storage buckets add-iam-policy-binding gs://{bucket} --member=principal://iam.googleapis.com/"
           f"projects/PROJECT_NUMBER/locations/global/workloadIdentityPools/PROJECT_ID{principal_suffix} "
           f"--role={GRANTED_ROLE}")
    return Check("pods reach the bucket", FAIL, f"{namespace}/{account} has no object role on gs://{bucket} "
                                                "(neither its Workload Identity principal nor a Google service "
                                                "account it is bound to)", fix)


def doctor(accelerator: str | None = None, storage: str | None = None, *,
           backend_options: Mapping[str, Any] | None = None, api: KubernetesApi | None = None,
           iam_policy: Callable[[str], Mapping[str, Iterable[str]]] | None = None,
           google_session: Any = None) -> DoctorReport:
    """Check that cells can run on the cluster with ``accelerator`` and ``storage``; a table of checks with fixes.

    Parameters
    ----------
    accelerator : str, optional
        e.g. ``tpu-v5e-16``; default ``cpu`` (no accelerator checks).
    storage : str, optional
        The job storage root (``gs://BUCKET/PREFIX``); default ``$KINETIC_STORAGE``,
        else the storage checks are skipped.
    backend_options : mapping, optional
        The kubernetes backend's settings (``namespace``, ``service_account``, ...,
        and ``config``), as ``submit`` takes them.
    api : KubernetesApi, optional
        Default: :func:`~kinetic_nb.backends.kubernetes.backend.connect`.
    iam_policy : callable, optional
        ``bucket -> {role: members}``; default :func:`bucket_iam_policy` (Google's IAM API).
    google_session : optional
        What calls Google's REST APIs for the build mode's checks (Artifact
        Registry, Cloud Build, Resource Manager); default an ``AuthorizedSession``
        from Application Default Credentials, made only in the build mode; a test passes a double.

    Returns
    -------
    DoctorReport
        ``report.ok`` is False when a check failed; ``print(report)`` shows the table.
    """
    acc = resolve_accelerator(accelerator or "cpu")
    settings = KubernetesBackend.from_options(**dict(backend_options or {})).settings
    storage = storage or os.environ.get("KINETIC_STORAGE") or None
    checks: list[Check] = []
    target = kinetic_target()
    target = target if target is not None and settings.context == target.context else None
    if target is not None:
        checks.append(Check("keras-kinetic profile", OK, target.describe()))
    try:
        api = api if api is not None else connect(settings)
    except KineticError as error:  # no cluster of kinetic's: make one; else fetch the credentials of the one named
        checks.append(Check("cluster reachable", FAIL, str(error),
                            target.get_credentials if target is not None else kinetic_up_command(acc)))
        api = None
    if api is not None:
        checks += _cluster_checks(api, settings, acc)
    from kinetic_nb.backends.kubernetes.doctor_image import (  # its rows are Checks: imported here
        authorized_session,
        image_checks,
    )

    checks += image_checks(settings, (lambda: google_session) if google_session is not None else authorized_session,
                           acc)
    if storage:
        checks.append(_storage_check(storage))
        if storage.startswith("gs://") and api is not None and checks[0].status == OK:
            checks.append(_service_account_check(api, settings, storage, iam_policy or bucket_iam_policy))
    else:
        checks.append(Check("storage", WARN, "no job storage given: pods reach only gs:// storage",
                            "%env KINETIC_STORAGE=gs://BUCKET/kinetic (or --storage gs://BUCKET/kinetic)"))
    return DoctorReport(tuple(checks))
