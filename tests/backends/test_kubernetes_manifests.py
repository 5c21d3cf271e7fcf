"""The kubernetes backend's manifests, validated offline.

- The root Job, the Job, the Service and every pod template against the Kubernetes API's own
  schemas, shipped per Kubernetes version by ``kubernetes-validate`` (strict:
  an unknown field is an error), for the oldest version we support and the
  newest the package ships; ``ownerReferences`` with them (and the
  LeaderWorkerSet's metadata as any object's ObjectMeta).
- The LeaderWorkerSet against a hand-copied subset of its CRD's
  openAPIV3Schema (``data/leaderworkerset_crd_v1.yaml``, see its header), as
  each supported LeaderWorkerSet release has it (``crd_schema.LWS_RELEASES``:
  v0.5 to v0.9), with a strict structural checker (``crd_schema.py``) that
  validates the pod templates inside it as core/v1 PodTemplateSpecs; the
  templates also on their own as PodTemplate and Pod.
- Each host's environment, resolved the way the kubelet resolves it for the
  pod the controllers make (``k8s_cluster.py``), through the runner's own host
  index resolution and coordinator choice: host i is host i, and everyone
  meets at host 0.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
from unittest import mock

import kubernetes_validate
import pytest

from kinetic_nb.accelerators import accelerator_names, resolve_accelerator
from kinetic_nb.backends.base import JobSecrets
from kinetic_nb.backends.kubernetes import manifests as km
from kinetic_nb.backends.kubernetes import root as k8s_root
from kinetic_nb.backends.kubernetes.backend import KubernetesBackend, KubernetesSettings
from kinetic_nb.backends.kubernetes.pods import host_states
from kinetic_nb.client.plan import make_plan, resolve_slice
from kinetic_nb.errors import KineticError
from kinetic_nb.runner import frameworks
from kinetic_nb.runner.channel import CHANNEL_ENV, parse_address
from kinetic_nb.runner.host_variables import process_environment, resolve_host_index
from kinetic_nb.runner.protocol import JobPlan

from .crd_schema import LWS_RELEASES, check_custom_resource, load_crd
from .k8s_cluster import container_command, container_environment, dns_name, pods_for, secret_files, to_client_object

#: The oldest Kubernetes we support (Indexed Jobs label their pods with the completion
#: index from 1.28; GKE's oldest supported minor is newer still), and the newest schema shipped.
SCHEMA_VERSIONS = ("1.30", kubernetes_validate.utils.latest_version())
JOB_ID = "kn-20261129-234752-3e8d32"
URI = f"gs://ml-bucket/jobs/{JOB_ID}"
SETTINGS = KubernetesSettings(namespace="ml-team", image="registry.example/kinetic-jax:1.0", coordinator_port=29500)
#: Each image mode's settings: ``custom`` runs the image as it is; ``prebuilt`` (the stock image) and
#: ``build`` (the image Cloud Build made) run the bootstrap first, with its source inline in the command.
MODE_SETTINGS = {
    "custom": SETTINGS,
    "prebuilt": dataclasses.replace(SETTINGS, image=None, image_mode="prebuilt", requirements="requirements.txt"),
    "build": dataclasses.replace(SETTINGS, image="us-docker.pkg.dev/ml-proj/kinetic/kinetic-env:0123456789abcdef",
                                 image_mode="build", registry="us-docker.pkg.dev/ml-proj/kinetic",
                                 requirements="requirements.txt"),
}
#: A user's variables, with what the kubelet would otherwise expand: they must arrive as written.
USER_ENV = {"XLA_FLAGS": "--xla_dump_to=/tmp/dump", "TRICKY": "$(HOME) and a$$b and $PATH"}
#: What the job's Secret holds: its key and the -e values (never a manifest's literal values).
SECRETS = JobSecrets(key=bytes(range(32)), env=USER_ENV)


def secret_value(name: str, key: str) -> str:
    """The job's Secret, as the kubelet resolves a ``secretKeyRef`` from it."""
    assert name == km.secret_name(JOB_ID)
    return SECRETS.environment()[key]
#: The uid the API server gave the root Job (a made-up one: any uid must flow through unchanged).
ROOT_UID = "6f1c2a0e-9b3d-4c57-8e21-0d4f5a6b7c8d"
OWNER = k8s_root.root_owner_reference(JOB_ID, ROOT_UID)

#: accelerator -> (workload kind, hosts, devices per host, GKE accelerator, topology, machine type)
SHAPES = {
    "tpu-v5e-16": ("LeaderWorkerSet", 4, 4, "tpu-v5-lite-podslice", "4x4", "ct5lp-hightpu-4t"),
    # 2x4 is also one host of 8 chips (tpu-v6e-8, ct6e-standard-8t): tpu-v6e-2x4 is two hosts of 4.
    "tpu-v6e-2x4": ("LeaderWorkerSet", 2, 4, "tpu-v6e-slice", "2x4", "ct6e-standard-4t"),
    "tpu-v6e-8": ("Job", 1, 8, "tpu-v6e-slice", "2x4", "ct6e-standard-8t"),
    # 2x4 is also two hosts of 4 chips (ct5lp-hightpu-4t): tpu-v5e-8 is one host of 8.
    "tpu-v5e-8": ("Job", 1, 8, "tpu-v5-lite-podslice", "2x4", "ct5lp-hightpu-8t"),
    "gpu-h100x8": ("Job", 1, 8, "nvidia-h100-80gb", None, None),
}
#: The issue's four shapes, plus CPU hosts (an Indexed Job with a Service).
CASES = [*SHAPES, "cpu-3-hosts"]


def job_plan(case: str, *, settings: KubernetesSettings = SETTINGS, timeout: float | None = None) -> JobPlan:
    # "cpu-N-hosts" is N CPU hosts (-n N); anything else an accelerator's name.
    accelerator, hosts = ("cpu", int(case.split("-")[1])) if case.startswith("cpu-") else (case, None)
    acc, host_count = resolve_slice(hosts, accelerator)
    backend = KubernetesBackend(settings, api=object())  # no API call: coordinator_address is pure
    return make_plan(job_id=JOB_ID, acc=acc, hosts=host_count, framework="jax",
                     coordinator_address=backend.coordinator_address(JOB_ID), simulated=False, timeout=timeout,
                     env_names=sorted(USER_ENV))


def manifests_for(case: str, **options) -> tuple[JobPlan, list[dict]]:
    plan = job_plan(case, **options)
    return plan, km.build_manifests(plan, URI, options.get("settings", SETTINGS), owner=OWNER)


def root_for(case: str, **options) -> dict:
    return k8s_root.root_job(job_plan(case, **options), URI, options.get("settings", SETTINGS))


def templates(manifests: list[dict]) -> list[dict]:
    found = []
    for manifest in manifests:
        if manifest["kind"] == "LeaderWorkerSet":
            template = manifest["spec"]["leaderWorkerTemplate"]
            found += [template["leaderTemplate"], template["workerTemplate"]]
        elif manifest["kind"] == "Job":
            found.append(manifest["spec"]["template"])
    return found


def validate_core(resource: dict) -> None:
    for version in SCHEMA_VERSIONS:
        kubernetes_validate.validate(resource, version, strict=True)


def as_pod_template(template: dict) -> dict:
    return {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t", "namespace": "ml-team"},
            "template": template}


def as_pod(template: dict) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {**template["metadata"], "name": "p"},
            "spec": template["spec"]}


# -- shape ------------------------------------------------------------------------------


@pytest.mark.parametrize("accelerator", SHAPES)
def test_each_shape_becomes_its_workload_on_its_node_pool(accelerator):
    kind, hosts, devices, gke_accelerator, topology, machine_type = SHAPES[accelerator]
    _, manifests = manifests_for(accelerator)
    assert [manifest["kind"] for manifest in manifests] == [kind]  # one host: no Service
    workload = manifests[0]
    if kind == "LeaderWorkerSet":
        assert workload["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
        spec = workload["spec"]
        assert spec["replicas"] == 1
        assert spec["leaderWorkerTemplate"]["size"] == hosts
        assert spec["leaderWorkerTemplate"]["restartPolicy"] == "None"  # a failed group is never recreated
    else:
        spec = workload["spec"]
        assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", hosts, hosts)
        assert spec["backoffLimit"] == 0
    for template in templates(manifests):
        pod = template["spec"]
        [container] = pod["containers"]
        if accelerator.startswith("tpu"):  # half its machine's vCPUs and memory (not BestEffort), no limit on them
            cpus, memory = km.TPU_MACHINES[machine_type]
            assert container["resources"] == {
                "requests": {km.TPU_RESOURCE: str(devices), "cpu": str(cpus // 2), "memory": f"{memory // 2}Gi"},
                "limits": {km.TPU_RESOURCE: str(devices)}}
        else:  # a GPU host also asks for CPU and memory (not BestEffort), with no limit on them
            assert container["resources"] == {"requests": {km.GPU_RESOURCE: str(devices), "cpu": "1", "memory": "4Gi"},
                                              "limits": {km.GPU_RESOURCE: str(devices)}}
        if topology:
            assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": gke_accelerator,
                                           "cloud.google.com/gke-tpu-topology": topology,
                                           "node.kubernetes.io/instance-type": machine_type}
        else:
            assert pod["nodeSelector"] == {"cloud.google.com/gke-accelerator": gke_accelerator}
        assert pod["restartPolicy"] == ("Always" if kind == "LeaderWorkerSet" else "Never")
        assert container["args"] == ["python", "-m", "kinetic_nb.agent", "--job", URI]
        assert container["image"] == SETTINGS.image
        # A host that fails before its agent uploads a log still leaves its last lines, in its pod's status.
        assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"


@pytest.mark.parametrize("case", CASES)
def test_a_leader_worker_set_asks_for_one_node_pool_per_group_so_a_job_never_straddles_two_slices(case):
    _, manifests = manifests_for(case)
    for manifest in manifests:
        annotations = manifest["metadata"]["annotations"]
        if manifest["kind"] == "LeaderWorkerSet":
            assert annotations["leaderworkerset.sigs.k8s.io/exclusive-topology"] == "cloud.google.com/gke-nodepool"
        else:  # an Indexed Job's hosts are one node each, or GPU/CPU nodes: no slice to keep together
            assert "leaderworkerset.sigs.k8s.io/exclusive-topology" not in annotations
    for template in templates(manifests):  # on the set, where the controller reads it, not on its pods
        assert "leaderworkerset.sigs.k8s.io/exclusive-topology" not in template["metadata"]["annotations"]


def test_cpu_hosts_get_an_indexed_job_and_a_headless_service_for_host_0():
    _, (service, job) = manifests_for("cpu-3-hosts")
    assert (service["kind"], job["kind"]) == ("Service", "Job")
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert job["spec"]["template"]["spec"]["subdomain"] == service["metadata"]["name"]
    assert job["spec"]["template"]["spec"]["containers"][0]["resources"] == {"requests": {"cpu": "1", "memory": "4Gi"}}
    assert "nodeSelector" not in job["spec"]["template"]["spec"]


@pytest.mark.parametrize("case", CASES)
def test_every_host_gets_a_memory_backed_dev_shm(case):
    _, manifests = manifests_for(case)
    for template in templates(manifests):
        pod = template["spec"]
        mounts = {mount["mountPath"]: mount["name"] for mount in pod["containers"][0]["volumeMounts"]}
        volumes = {volume["name"]: volume for volume in pod["volumes"]}
        # NCCL and DataLoader workers (on a TPU host too) outgrow the runtime's 64 MiB
        assert volumes[mounts["/dev/shm"]]["emptyDir"] == {"medium": "Memory"}


def test_every_tpu_host_machine_is_known_and_its_request_leaves_room_on_the_node():
    for name in accelerator_names():
        acc = resolve_accelerator(name)
        if acc.kind == "tpu":
            cpus, memory = km.TPU_MACHINES[acc.machine_type]
            requests = km.host_requests(acc)
            assert 0 < int(requests["cpu"]) <= cpus * 0.5 and 0 < int(requests["memory"][:-2]) <= memory * 0.5


@pytest.mark.parametrize("case", CASES)
def test_everything_carries_the_job_label_so_one_selector_finds_it(case):
    _, manifests = manifests_for(case)
    manifests = [root_for(case), *manifests]
    key, value = km.job_selector(JOB_ID).split("=")
    for manifest in manifests:
        assert manifest["metadata"]["labels"][key] == value
        assert manifest["metadata"]["namespace"] == "ml-team"
    for template in templates(manifests):
        assert template["metadata"]["labels"][key] == value
        assert template["metadata"]["annotations"][km.JOB_ID_ANNOTATION] == JOB_ID
    for manifest in manifests:
        if manifest["kind"] == "Service":  # the hosts, not the root's pod, which has the job label too
            assert manifest["spec"]["selector"] == {key: value, km.ROLE_LABEL: km.HOST_ROLE}


def test_a_timeout_becomes_the_jobs_deadline_with_a_margin_for_the_clients_own_stop():
    _, [job] = manifests_for("tpu-v5e-8", timeout=120.5)
    assert job["spec"]["activeDeadlineSeconds"] == 121 + km.DEADLINE_MARGIN_S
    _, [job] = manifests_for("tpu-v5e-8")
    assert "activeDeadlineSeconds" not in job["spec"]  # the root's deadline bounds it


# -- the root Job -------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_the_root_bounds_the_job_with_the_plans_timeout_and_a_margin(case):
    root = root_for(case, timeout=3600.2)
    assert root["spec"]["activeDeadlineSeconds"] == 3601 + km.DEADLINE_MARGIN_S == k8s_root.root_deadline_s(
        job_plan(case, timeout=3600.2))


@pytest.mark.parametrize("case", CASES)
def test_without_a_timeout_the_root_still_ends_the_job_after_the_default_lifetime(case):
    root = root_for(case)
    assert root["spec"]["activeDeadlineSeconds"] == k8s_root.DEFAULT_MAX_LIFETIME_S == 7 * 24 * 3600


def test_the_root_is_a_small_job_that_watches_once_and_is_deleted_soon_after_it_ends():
    root = root_for("tpu-v5e-16")
    assert (root["apiVersion"], root["kind"]) == ("batch/v1", "Job")
    assert root["metadata"]["name"] == k8s_root.root_name(JOB_ID) == f"{JOB_ID}-root"
    assert root["metadata"]["labels"][km.ROLE_LABEL] == "root"
    assert "ownerReferences" not in root["metadata"]  # it is the owner
    spec = root["spec"]
    assert spec["ttlSecondsAfterFinished"] == k8s_root.ROOT_TTL_AFTER_FINISHED_S <= 600
    assert spec["backoffLimit"] == 0
    assert "completionMode" not in spec and "parallelism" not in spec  # one pod
    # A node drained or preempted under the root is not its failure: the Job starts another pod.
    assert spec["podFailurePolicy"]["rules"] == [
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]
    pod = spec["template"]["spec"]
    [container] = pod["containers"]
    assert pod["restartPolicy"] == "Never"
    assert container["command"] == ["python", "-m", "kinetic_nb.agent", "--job", URI, "--watch"]
    assert "args" not in container
    assert container["image"] == SETTINGS.image
    env = container_environment(spec["template"], container, secrets=secret_value)
    assert (env["KINETIC_JOB_ID"], env["KINETIC_JOB_URI"]) == (JOB_ID, URI)
    # The key, to verify the plan it watches and the records it counts: a mounted file, not a variable.
    assert "KINETIC_JOB_KEY" not in env
    files = secret_files(spec["template"], container, secrets=secret_value)
    assert files == {env["KINETIC_JOB_KEY_FILE"]: SECRETS.key.hex()}
    # Small, and no accelerator: the watcher only reads storage.
    assert container["resources"]["requests"] == {"cpu": "50m", "memory": "256Mi"}
    assert set(container["resources"]["limits"]) == {"memory"}


def test_the_root_runs_as_the_hosts_service_account_on_any_node():
    settings = KubernetesSettings(namespace="ml-team", image="img:1", service_account="kinetic-runner",
                                  node_selector={"cloud.google.com/gke-nodepool": "v5e-pool"})
    pod = root_for("tpu-v5e-16", settings=settings)["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "kinetic-runner"  # it reads the bucket as the hosts do
    assert pod["containers"][0]["image"] == "img:1"
    assert "nodeSelector" not in pod and "tolerations" not in pod  # never on a (tainted) accelerator node
    assert "serviceAccountName" not in root_for("tpu-v5e-16")["spec"]["template"]["spec"]


@pytest.mark.parametrize("case", CASES)
def test_every_other_object_is_owned_by_the_root_with_the_uid_the_api_server_gave_it(case):
    root = root_for(case)
    _, manifests = manifests_for(case)
    for manifest in manifests:
        [reference] = manifest["metadata"]["ownerReferences"]
        assert reference == {"apiVersion": root["apiVersion"], "kind": root["kind"],
                             "name": root["metadata"]["name"], "uid": ROOT_UID,
                             "controller": False, "blockOwnerDeletion": True}
        # An owner is looked up in its dependent's namespace: they must share it.
        assert manifest["metadata"]["namespace"] == root["metadata"]["namespace"]
    for template in templates(manifests):  # pods belong to their LeaderWorkerSet or Job, not to the root
        assert "ownerReferences" not in template["metadata"]


def test_the_root_pod_is_no_host():
    """The root's pod carries the job label, so a listing of the job's pods includes it: it has no host index."""
    root = root_for("tpu-v5e-16")
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {
        **root["spec"]["template"]["metadata"], "name": f"{root['metadata']['name']}-x7k2p", "namespace": "ml-team",
        "labels": {**root["spec"]["template"]["metadata"]["labels"], "batch.kubernetes.io/job-name": "x"}},
        "spec": root["spec"]["template"]["spec"], "status": {"phase": "Running"}}
    assert host_states([pod]) == {}


def test_settings_add_a_service_account_and_node_selectors():
    settings = KubernetesSettings(namespace="ml-team", image="img:1", service_account="kinetic-runner",
                                  node_selector={"cloud.google.com/gke-nodepool": "v5e-pool"})
    _, manifests = manifests_for("tpu-v5e-16", settings=settings)
    for template in templates(manifests):
        assert template["spec"]["serviceAccountName"] == "kinetic-runner"
        assert template["spec"]["nodeSelector"]["cloud.google.com/gke-nodepool"] == "v5e-pool"
        assert template["spec"]["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == "4x4"


def test_no_image_in_the_custom_mode_is_one_line_naming_the_flag_and_the_variable():
    for build in (lambda plan, settings: km.build_manifests(plan, URI, settings, owner=OWNER),
                  lambda plan, settings: k8s_root.root_job(plan, URI, settings)):
        with pytest.raises(ValueError, match=r"give image=IMAGE \(--image in %%kinetic\) or set KINETIC_IMAGE") as caught:
            build(job_plan("tpu-v5e-8"), KubernetesSettings(namespace="ml-team", image_mode="custom"))
        assert "\n" not in str(caught.value)


# -- schemas ----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODE_SETTINGS)
@pytest.mark.parametrize("case", CASES)
def test_core_objects_and_pod_templates_validate_against_the_kubernetes_schemas(case, mode):
    settings = MODE_SETTINGS[mode]
    _, manifests = manifests_for(case, settings=settings)
    manifests = [root_for(case, timeout=60.0, settings=settings), root_for(case, settings=settings), *manifests]
    for manifest in manifests:
        if manifest["kind"] in ("Job", "Service"):
            validate_core(manifest)
        else:  # a custom resource's metadata is every object's ObjectMeta, ownerReferences included
            validate_core({"apiVersion": "v1", "kind": "ConfigMap", "metadata": manifest["metadata"]})
    for template in templates(manifests):
        validate_core(as_pod_template(template))
        validate_core(as_pod(template))
    for pod in pods_for(manifests):  # as the controllers make them, with the webhook's variables
        validate_core(pod)


@pytest.mark.parametrize("mode", MODE_SETTINGS)
@pytest.mark.parametrize("release", LWS_RELEASES)
@pytest.mark.parametrize("accelerator", ["tpu-v5e-16", "tpu-v6e-2x4"])
def test_leader_worker_set_conforms_to_every_supported_releases_crd(accelerator, release, mode):
    """Pod templates included, as core/v1 PodTemplateSpecs, for the oldest and newest Kubernetes we support."""
    _, [lws] = manifests_for(accelerator, settings=MODE_SETTINGS[mode])
    assert check_custom_resource(lws, load_crd(release), SCHEMA_VERSIONS) == []


@pytest.mark.parametrize("mode", ["prebuilt", "build"])
def test_the_image_modes_that_install_first_run_the_bootstrap_in_every_pod_template(mode):
    """So the schema tests above do cover the bootstrap's command, volume and variables, not the custom mode twice."""
    settings = MODE_SETTINGS[mode]
    for case in CASES:
        _, manifests = manifests_for(case, settings=settings)
        for template in templates([root_for(case, settings=settings), *manifests]):
            [container] = template["spec"]["containers"]
            assert container["command"][:2] == [km.BOOTSTRAP_PYTHON, "-c"], (case, container["command"][:2])
            assert container["image"] == settings.require_image()


def lws_with(**template_fields) -> dict:
    _, [lws] = manifests_for("tpu-v5e-16")
    lws["spec"]["leaderWorkerTemplate"].update(template_fields)
    return lws


@pytest.mark.parametrize("release", LWS_RELEASES)
def test_recreate_group_after_start_is_accepted_from_v0_9_only(release):
    """kubernetes-sigs/lws#757 made it a restartPolicy value in v0.9; v0.8 had it only as an annotation."""
    errors = check_custom_resource(lws_with(restartPolicy="RecreateGroupAfterStart"), load_crd(release))
    if release_number(release) >= (0, 9):
        assert errors == []
    else:
        assert errors == [".spec.leaderWorkerTemplate.restartPolicy: 'RecreateGroupAfterStart' is not one of "
                          "['Default', 'RecreateGroupOnPodRestart', 'None']"]


def release_number(release: str) -> tuple[int, ...]:
    """``v0.10.1`` as (0, 10, 1): releases compare as numbers (as text, v0.10 would come before v0.9)."""
    return tuple(int(part) for part in release.lstrip("v").split("."))


def test_releases_compare_as_numbers():
    assert release_number("v0.10") > release_number("v0.9") > release_number("v0.8.1")


@pytest.mark.parametrize("release", LWS_RELEASES)
def test_the_projects_restart_policy_is_accepted_by_every_supported_release(release):
    """The manifest as built, its restartPolicy untouched: None (a failed group is not recreated: the cell
    reports it), which came in v0.5 (kubernetes-sigs/lws#214), the oldest release kinetic_nb supports."""
    _, [lws] = manifests_for("tpu-v5e-16")
    assert lws["spec"]["leaderWorkerTemplate"]["restartPolicy"] == "None"
    assert check_custom_resource(lws, load_crd(release)) == []


@pytest.mark.parametrize("template", ["leaderTemplate", "workerTemplate"])
def test_a_misspelt_field_inside_a_pod_template_of_the_leader_worker_set_fails(template):
    _, [lws] = manifests_for("tpu-v5e-16")
    container = lws["spec"]["leaderWorkerTemplate"][template]["spec"]["containers"][0]
    container["imagePullPolicyy"] = "Always"
    errors = check_custom_resource(lws, load_crd())
    assert len(errors) == 1
    assert errors[0].startswith(f".spec.leaderWorkerTemplate.{template}.spec.containers.0: Additional properties are "
                                "not allowed ('imagePullPolicyy' was unexpected) (core/v1 PodTemplateSpec")
    del container["imagePullPolicyy"]
    lws["spec"]["leaderWorkerTemplate"][template]["spec"]["restartPolicy"] = 7  # a wrong type, too
    assert check_custom_resource(lws, load_crd())


def test_the_validators_do_catch_mistakes():
    """Neither check is vacuous: a misspelt field, a bad enum value and a missing field are caught."""
    _, [lws] = manifests_for("tpu-v5e-16")
    crd = load_crd()
    lws["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "Never"
    lws["spec"]["leaderWorkerTemplate"]["sizee"] = 4
    lws["spec"]["networkConfig"] = {}
    errors = check_custom_resource(lws, crd)
    assert any("restartPolicy" in error and "not one of" in error for error in errors)
    assert any("sizee: unknown field" in error for error in errors)
    assert any("networkConfig.subdomainPolicy: required" in error for error in errors)
    assert check_custom_resource({**lws, "apiVersion": "leaderworkerset.x-k8s.io/v1beta1"}, crd)

    _, [job] = manifests_for("tpu-v5e-8")
    job["spec"]["template"]["spec"]["restartPolicyy"] = "Never"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_core(job)
    _, [job] = manifests_for("tpu-v5e-8")
    job["spec"]["completions"] = "one"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_core(job)
    _, [job] = manifests_for("tpu-v5e-8")
    del job["metadata"]["ownerReferences"][0]["uid"]  # an owner reference must name its owner's uid
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_core(job)
    root = root_for("tpu-v5e-8")
    root["spec"]["podFailurePolicy"]["rules"][0]["onPodConditions"][0]["typ"] = "DisruptionTarget"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_core(root)


def test_the_real_client_reads_the_root_and_its_owner_references_without_loss():
    """The objects go through the official client's models on their way (``V1Job``, ``V1OwnerReference``)."""
    root = root_for("tpu-v5e-8", timeout=10.0)
    _, [job] = manifests_for("tpu-v5e-8")
    from kubernetes.client import ApiClient

    for manifest in (root, job):
        assert ApiClient().sanitize_for_serialization(to_client_object(manifest, "V1Job")) == manifest


# -- each host's environment --------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_every_host_resolves_its_own_index_and_meets_the_others_at_host_0(case):
    plan, manifests = manifests_for(case)
    pods = pods_for(manifests)
    assert len(pods) == plan.hosts
    port = str(SETTINGS.coordinator_port)
    if plan.hosts > 1:
        leader = dns_name(pods[0])
        assert leader is not None
        expected_coordinator = f"{leader}:{port}"
        assert plan.coordinator_address == expected_coordinator  # the plan records where hosts meet
        container_ports = pods[0]["spec"]["containers"][0]["ports"]
        assert {"name": "coordinator", "containerPort": SETTINGS.coordinator_port} in container_ports
    else:
        expected_coordinator = f"127.0.0.1:{port}"  # a lone host is its own coordinator
    for index, pod in enumerate(pods):
        env = container_environment(pod, secrets=secret_value)
        assert resolve_host_index(env) == index
        with mock.patch.dict(os.environ, env, clear=True):
            assert frameworks.coordinator_address(plan) == expected_coordinator
        assert f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}" == expected_coordinator
        assert "RANK" not in env and env["WORLD_SIZE"] == str(plan.world_size)
        for rank in plan.ranks_of(index):  # the pod's agent gives each of its processes its own rank
            started = process_environment(plan, rank, "/kinetic/outputs", env)
            assert (started["RANK"], started["LOCAL_RANK"], started["GROUP_RANK"]) == (
                str(rank), str(rank % plan.procs_per_host), str(index))
        assert env["KINETIC_HOST_INDEX"] == str(index)
        assert (env["KINETIC_JOB_ID"], env["KINETIC_JOB_URI"], env["KINETIC_NUM_HOSTS"]) == (
            JOB_ID, URI, str(plan.hosts))
        assert "KINETIC_LOG_UPLOAD" not in env  # the agent uploads the runner's output
        for name, value in USER_ENV.items():
            assert env[name] == value  # from the Secret, exactly as given (a Secret's value is never expanded)
        # The key is a file of the mounted Secret, which holds nothing else; no variable holds it.
        assert "KINETIC_JOB_KEY" not in env and SECRETS.key.hex() not in env.values()
        assert secret_files(pod, secrets=secret_value) == {env["KINETIC_JOB_KEY_FILE"]: SECRETS.key.hex()}
        assert not any("$(" in value and name not in USER_ENV for name, value in env.items()), env
        assert container_command(pod, env) == ["/bin/sh", "-c", km.HOST_SCRIPT, km.HOST_SCRIPT_NAME,
                                               "python", "-m", "kinetic_nb.agent", "--job", URI]


@pytest.mark.parametrize("case", CASES)
def test_a_sessions_hosts_are_told_that_its_hub_listens_on_host_0_after_the_coordinator(case):
    """A session's hub (``runner.channel``) listens beside host 0's agent, one port after the coordinator's: every
    host's environment names it as it names the coordinator, and host 0's container declares the port. A one-shot
    job has no hub."""
    plan = dataclasses.replace(job_plan(case), session=True)
    pods = pods_for(km.build_manifests(plan, URI, SETTINGS, owner=OWNER))
    leader = dns_name(pods[0]) if plan.hosts > 1 else "127.0.0.1"
    for pod in pods:
        env = container_environment(pod, secrets=secret_value)
        assert parse_address(env[CHANNEL_ENV]) == (leader, SETTINGS.coordinator_port + 1)
        assert {"name": "channel", "containerPort": SETTINGS.coordinator_port + 1} in pod["spec"]["containers"][0]["ports"]
    for pod in pods_for(manifests_for(case)[1]):
        assert CHANNEL_ENV not in container_environment(pod, secrets=secret_value)
        assert [port["name"] for port in pod["spec"]["containers"][0]["ports"]] == ["coordinator"]


def test_the_coordinator_port_leaves_room_for_the_channels():
    with pytest.raises(ValueError, match="65534"):
        KubernetesSettings(namespace="ml-team", coordinator_port=65535)


@pytest.mark.parametrize("interpreters", [("python", "python3"), ("python3",)])
def test_the_host_command_runs_python3_where_the_image_has_no_python(tmp_path, interpreters):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in interpreters:  # each prints its own name, whatever it is asked to run
        (bin_dir / name).write_text(f'#!/bin/sh\n[ "$1" = -c ] && exit 1\necho "{name} $*"\n')
        (bin_dir / name).chmod(0o755)
    _, manifests = manifests_for("cpu-3-hosts")
    [pod, *_] = pods_for(manifests)
    command = container_command(pod, container_environment(pod, secrets=secret_value))
    ran = subprocess.run(command, env={"PATH": str(bin_dir)}, capture_output=True, text=True, check=True)
    assert ran.stdout == f"{interpreters[0]} -m kinetic_nb.agent --job {URI}\n"


@pytest.mark.parametrize("mode", ["custom", "prebuilt", "build"])
@pytest.mark.parametrize("driver", [True, False], ids=["with the driver", "without"])
def test_a_gpu_pod_puts_the_driver_gke_mounts_on_its_paths_before_the_agent_starts(tmp_path, mode, driver):
    """GKE's device plugin mounts the NVIDIA driver at /usr/local/nvidia and sets no variable for it: the host
    script puts it ahead of the image's own PATH and LD_LIBRARY_PATH, in every image mode; elsewhere it
    changes nothing. (The driver's directory is played by one under tmp_path.)"""
    nvidia = tmp_path / "nvidia"
    if driver:
        (nvidia / "lib64").mkdir(parents=True)
    script = km.HOST_SCRIPT.replace(frameworks.NVIDIA_DIR, str(nvidia))
    _, manifests = manifests_for("gpu-h100x8", settings=MODE_SETTINGS[mode])
    [pod] = pods_for(manifests)
    command = container_command(pod, container_environment(pod, secrets=secret_value))
    assert km.HOST_SCRIPT in command  # after the bootstrap, in the prebuilt mode
    shown = subprocess.run(["/bin/sh", "-c", script, km.HOST_SCRIPT_NAME, "/bin/sh", "-c",
                            'printf "%s\n%s\n" "$PATH" "$LD_LIBRARY_PATH"'],
                           env={"PATH": "/usr/bin:/bin", "LD_LIBRARY_PATH": "/opt/image/lib"},
                           capture_output=True, text=True, check=True).stdout.splitlines()
    if driver:
        assert shown == [f"{nvidia}/bin:/usr/bin:/bin", f"{nvidia}/lib64:/opt/image/lib"]
    else:
        assert shown == ["/usr/bin:/bin", "/opt/image/lib"]


@pytest.mark.parametrize("accelerator", ["tpu-v5e-16", "tpu-v6e-2x4"])
def test_tpu_hosts_get_worker_ids_and_hostnames_that_match_the_slices_pods(accelerator):
    _, manifests = manifests_for(accelerator)
    pods = pods_for(manifests)
    hostnames = ",".join(f"{pod['spec']['hostname']}.{pod['spec']['subdomain']}" for pod in pods)
    for index, pod in enumerate(pods):
        env = container_environment(pod, secrets=secret_value)
        assert env["TPU_WORKER_ID"] == env["LWS_WORKER_INDEX"] == str(index)
        assert env["TPU_WORKER_HOSTNAMES"] == hostnames
        names = [entry["name"] for entry in pod["spec"]["containers"][0]["env"]]
        assert names.count("TPU_WORKER_ID") == 1 and "TPU_NAME" not in names  # the webhook added none of its own


# -- names ------------------------------------------------------------------------------------


@pytest.mark.parametrize("job_id", [JOB_ID, "My_Job.2026", "7-starts-with-a-digit", "x" * 90, "kn--a--b-",
                                    "kn-20261129-234752-3e8d32-with-a-long-suffix-for-tests"])
def test_resource_names_are_dns_labels_short_enough_for_every_derived_name(job_id):
    name = km.resource_name(job_id)
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name)
    assert len(name) <= km.MAX_NAME_LENGTH
    root = k8s_root.root_name(job_id)
    # pods, revision hashes, the root and its pod
    for derived in (f"{name}-0-15", f"{name}-0-{'a' * 10}", f"{name}-99-x7k2p", root, f"{root}-x7k2p"):
        assert len(derived) <= 63 and re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", derived)
    if job_id == JOB_ID:
        assert name == JOB_ID  # kinetic's own ids are kept as they are


def test_different_ids_that_clean_up_alike_keep_different_names():
    assert km.resource_name("Job_A") != km.resource_name("job-a")
    assert km.resource_name("x" * 90) != km.resource_name("x" * 91)


@pytest.mark.parametrize("case", CASES)
def test_no_secret_is_a_literal_anywhere_in_the_manifests(case):
    plan, manifests = manifests_for(case)
    text = json.dumps([k8s_root.root_job(plan, URI, SETTINGS), *manifests])
    for secret in (SECRETS.key.hex(), *USER_ENV.values()):
        assert json.dumps(secret)[1:-1] not in text
    secret = km.secret_manifest(plan, SETTINGS, SECRETS, OWNER)
    assert secret["kind"] == "Secret" and secret["metadata"]["ownerReferences"] == [OWNER]
    assert secret["stringData"] == {**USER_ENV, "KINETIC_JOB_KEY": SECRETS.key.hex()}


@pytest.mark.parametrize("accelerator", ["tpu-v2-8", "tpu-v3-32"])
def test_a_tpu_generation_gke_does_not_offer_is_refused_in_one_line(accelerator):
    """v2 and v3 are Cloud TPU VMs only: no node selector, no machine type to ask for."""
    backend = KubernetesBackend(SETTINGS, api=object())  # refused before any API call
    with pytest.raises(KineticError, match=rf"^{accelerator}: GKE has no node pool of this TPU generation .*-b tpu-vm$"):
        backend.preflight(job_plan(accelerator))

