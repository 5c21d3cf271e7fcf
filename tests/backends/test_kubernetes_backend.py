"""The kubernetes backend through its interface, against a test double of the Kubernetes API.

No real API server can run here (no cluster, no network): ``FakeKubernetes``
(``k8s_cluster.py``) stands in for the three API groups the backend calls,
records what it creates and deletes, and returns pods the tests script (from
``data/pods.json``, shaped as the API returns them). Storage is real
(``file://``). The end-to-end test against a real cluster is
``test_kubernetes_e2e.py``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
import subprocess
import sys

import pytest

from kinetic_nb.backends import get_backend
from kinetic_nb.backends.kubernetes import backend as k8s
from kinetic_nb.backends.kubernetes.backend import KubernetesBackend, KubernetesSettings
from kinetic_nb.backends.kubernetes.manifests import secret_name
from kinetic_nb.backends.kubernetes.root import root_name
from kinetic_nb.errors import KineticError, KineticWarning
from kinetic_nb.runner import protocol
from kinetic_nb.runner.protocol import ExitSummary, HostStatus
from kinetic_nb.runner.records import read_exit, read_record, write_record
from kinetic_nb.storage import open_storage

from .k8s_cluster import FakeKubelet, FakeKubernetes, api_exception, pods_for
from .test_kubernetes_manifests import JOB_ID, SECRETS, job_plan

PODS = json.loads((pathlib.Path(__file__).parent / "data" / "pods.json").read_text())["items"]
BY_CASE = {pod["metadata"]["annotations"]["test.kinetic-nb/case"]: pod for pod in PODS}
CREATED = 1795996075.0  # when the fixture pods were created
SETTINGS = KubernetesSettings(namespace="ml-team", image="registry.example/kinetic-jax:1.0")
ROOT = root_name(JOB_ID)


class Clock:
    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def api() -> FakeKubernetes:
    return FakeKubernetes()


@pytest.fixture
def job_storage(tmp_path):
    storage = open_storage(f"file://{tmp_path}/jobs").child(JOB_ID)
    return storage


def launched(api, job_storage, case="tpu-v5e-16", **options):
    backend = KubernetesBackend(SETTINGS, api=api, pod_list_interval_s=0.0, **options)
    plan = job_plan(case)
    job_storage.write_bytes(protocol.PLAN, plan.to_json())
    with pytest.warns(KineticWarning, match="local to this machine"):
        backend.launch(job_storage, plan, SECRETS)
    return backend, plan


# -- settings -----------------------------------------------------------------------------


def test_settings_flag_beats_environment_beats_config_beats_default():
    config = KubernetesSettings(namespace="from-config", image="config/image:1", service_account="config-sa")
    environ = {"KINETIC_NAMESPACE": "from-env", "KINETIC_IMAGE": "env/image:1"}
    settings = KubernetesSettings.resolve(namespace="from-flag", config=config, environ=environ)
    assert (settings.namespace, settings.image, settings.service_account) == ("from-flag", "env/image:1", "config-sa")
    assert settings.coordinator_port == k8s.DEFAULT_COORDINATOR_PORT  # the default
    defaults = KubernetesSettings.resolve(environ={})
    assert (defaults.namespace, defaults.image) == ("default", None)
    assert KubernetesSettings.resolve(environ={"KINETIC_NAMESPACE": "  "}).namespace == "default"  # blank is unset


def test_the_default_coordinator_port_is_clear_of_libtpus_ports():
    """libtpu takes 8470-8482 on a TPU host (8476 among them): a coordinator there collides with the runtime."""
    assert k8s.DEFAULT_COORDINATOR_PORT not in range(8470, 8483)
    assert KubernetesSettings.resolve(environ={}).coordinator_port == k8s.DEFAULT_COORDINATOR_PORT == 29500
    pod = KubernetesBackend(KubernetesSettings(image="img:1"), api=object()).coordinator_address(JOB_ID)
    assert pod.endswith(":29500")


def test_settings_read_every_variable():
    environ = {"KINETIC_NAMESPACE": "ml", "KINETIC_IMAGE": "img:2", "KINETIC_SERVICE_ACCOUNT": "runner",
               "KINETIC_KUBE_CONTEXT": "gke_proj_zone_cluster", "KINETIC_COORDINATOR_PORT": "9000",
               "KINETIC_PENDING_TIMEOUT": "90.5",
               "KINETIC_NODE_SELECTOR": "cloud.google.com/gke-nodepool=v5e, team=ml"}
    settings = KubernetesSettings.resolve(environ=environ)
    assert settings == KubernetesSettings(namespace="ml", image="img:2", service_account="runner",
                                          context="gke_proj_zone_cluster", coordinator_port=9000,
                                          pending_timeout_s=90.5,
                                          node_selector={"cloud.google.com/gke-nodepool": "v5e", "team": "ml"})


@pytest.mark.parametrize(("environ", "message"), [
    ({"KINETIC_COORDINATOR_PORT": "http"}, "KINETIC_COORDINATOR_PORT='http' is not a port number"),
    ({"KINETIC_COORDINATOR_PORT": "70000"}, "coordinator port 70000 is not a TCP port"),
    ({"KINETIC_PENDING_TIMEOUT": "soon"}, "KINETIC_PENDING_TIMEOUT='soon' is not a number of seconds"),
    ({"KINETIC_NODE_SELECTOR": "pool"}, "KINETIC_NODE_SELECTOR='pool' is not comma-separated key=value pairs"),
    ({"KINETIC_NAMESPACE": "ML Team"}, "namespace 'ML Team' is not a valid Kubernetes namespace"),
    ({"KINETIC_IMAGE": "my image"}, "container image 'my image' is not an image reference"),
])
def test_bad_settings_are_one_line_errors(environ, message):
    with pytest.raises(ValueError, match=message) as caught:
        KubernetesSettings.resolve(environ=environ)
    assert "\n" not in str(caught.value)


def test_the_custom_image_mode_needs_an_image_before_anything_is_stored(monkeypatch):
    monkeypatch.delenv("KINETIC_IMAGE", raising=False)
    backend = get_backend("kubernetes", image_mode="custom")
    assert isinstance(backend, KubernetesBackend) and backend.name == "kubernetes"
    with pytest.raises(ValueError, match=r"give image=IMAGE \(--image in %%kinetic\) or set KINETIC_IMAGE"):
        backend.coordinator_address(JOB_ID)


def test_with_no_image_the_pods_install_into_the_notebooks_stock_python_image(monkeypatch):
    monkeypatch.delenv("KINETIC_IMAGE", raising=False)
    settings = get_backend("kubernetes").settings
    assert settings.mode.value == "prebuilt"
    assert settings.require_image() == f"python:{sys.version_info[0]}.{sys.version_info[1]}-slim"


def test_get_backend_reads_the_environment(monkeypatch):
    monkeypatch.setenv("KINETIC_NAMESPACE", "ml-team")
    monkeypatch.setenv("KINETIC_IMAGE", "img:1")
    backend = get_backend("kubernetes")
    assert backend.coordinator_address(JOB_ID) == f"{JOB_ID}-0.{JOB_ID}.ml-team:29500"


def test_importing_the_backends_does_not_import_the_kubernetes_client():
    code = ("import sys, kinetic_nb.backends, kinetic_nb.backends.kubernetes.backend; "
            "print('kubernetes' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert result.stdout.strip() == "False"


def test_connect_without_credentials_is_one_line(monkeypatch, tmp_path):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing-kubeconfig"))
    with pytest.raises(KineticError, match=r"no Kubernetes credentials .*get-credentials") as caught:
        k8s.connect(KubernetesSettings())
    assert "\n" not in str(caught.value)


# -- launch -------------------------------------------------------------------------------


def test_launch_creates_the_root_first_then_the_rest_owned_by_it_with_strict_field_validation(api, job_storage):
    backend, plan = launched(api, job_storage)
    # The root, the LeaderWorkerSet, and the headless Service the LeaderWorkerSet controller made for it.
    # The root, the Secret (before any pod refers to it), the LeaderWorkerSet, and the headless Service
    # the LeaderWorkerSet controller made for it.
    secret = secret_name(JOB_ID)
    assert list(api.objects) == [("Job", ROOT), ("Secret", secret), ("LeaderWorkerSet", JOB_ID), ("Service", JOB_ID)]
    assert api.objects["Secret", secret]["metadata"]["ownerReferences"][0]["uid"] == \
        api.objects["Job", ROOT]["metadata"]["uid"]
    assert backend.job_key(JOB_ID) == SECRETS.key  # read back from the Secret, for a reattach from elsewhere
    root_uid = api.objects["Job", ROOT]["metadata"]["uid"]
    sent = [as_sent(api.objects[key]) for key in [("Job", ROOT), ("LeaderWorkerSet", JOB_ID)]]
    assert sent == backend.manifests(job_storage, plan, root_uid)
    assert api.objects["LeaderWorkerSet", JOB_ID]["metadata"]["ownerReferences"][0]["uid"] == root_uid
    creates = [entry for entry in api.calls if entry[0].startswith("create")]
    assert [call for call, _ in creates] == ["create Job", "create Secret", "create LeaderWorkerSet"]
    assert all(options["field_validation"] == "Strict" and options["namespace"] == "ml-team"
               for _, options in creates)


def test_the_roots_uid_is_read_from_the_clients_own_job_object(job_storage):
    api = FakeKubernetes(client_objects=True)  # the official client answers a create with a V1Job
    launched(api, job_storage, "cpu-3-hosts")
    root_uid = api.objects["Job", ROOT]["metadata"]["uid"]
    assert [api.objects[key]["metadata"]["ownerReferences"][0]["uid"] for key in [("Service", JOB_ID),
                                                                                   ("Job", JOB_ID)]] == [root_uid] * 2


def test_launch_of_cpu_hosts_creates_the_service_before_the_job(api, job_storage):
    launched(api, job_storage, "cpu-3-hosts")
    assert [call for call, _ in api.calls] == ["create Job", "create Secret", "create Service", "create Job"]


def test_no_leader_worker_set_controller_is_a_clear_error_and_leaves_nothing(api, job_storage):
    api.fail["LeaderWorkerSet"] = api_exception(404, "Not Found", "the server could not find the requested resource")
    with pytest.raises(KineticError, match=r"no LeaderWorkerSet API .* install the LeaderWorkerSet controller"):
        launched(api, job_storage)
    assert api.objects == {}


@pytest.mark.parametrize("kind", ["Job", "LeaderWorkerSet"])
def test_a_missing_namespace_is_not_mistaken_for_a_missing_leader_worker_set_api(api, job_storage, kind):
    """Both are 404s; the API server's Status names the namespace in ``details`` for the one, nothing for the other."""
    api.fail[kind] = api_exception(404, "Not Found", 'namespaces "ml-team" not found',
                                   {"name": "ml-team", "kind": "namespaces"})
    with pytest.raises(KineticError) as caught:
        launched(api, job_storage)
    assert str(caught.value) == ("namespace ml-team does not exist: create it (kubectl create namespace ml-team) "
                                 "or choose another (--namespace, KINETIC_NAMESPACE)")
    assert api.objects == {}


def test_a_failed_launch_removes_what_it_created_by_deleting_the_root(api, job_storage):
    api.fail["Service"] = api_exception(403, "Forbidden", 'services is forbidden: User "me" cannot create resource')
    with pytest.raises(KineticError, match=r"not allowed to create Service .* in namespace ml-team: services is "):
        launched(api, job_storage, "cpu-3-hosts")
    assert api.objects == {}
    [(call, options)] = [entry for entry in api.calls if entry[0].startswith("delete")]
    assert (call, options["name"], options["propagation_policy"]) == ("delete Job", ROOT, "Background")


def test_a_root_that_cannot_be_created_is_a_clear_error(api, job_storage):
    api.fail["Job"] = api_exception(403, "Forbidden", 'jobs.batch is forbidden: User "me" cannot create resource')
    with pytest.raises(KineticError, match=rf"not allowed to create Job {ROOT} in namespace ml-team: jobs.batch is "):
        launched(api, job_storage)
    assert api.objects == {} and [call for call, _ in api.calls] == ["create Job"]


def test_a_second_launch_of_a_job_leaves_the_first_ones_objects_alone(api, job_storage):
    backend, plan = launched(api, job_storage)
    before = {key: body["metadata"]["uid"] for key, body in api.objects.items()}
    with pytest.raises(KineticError, match="already exists"), pytest.warns(KineticWarning):
        backend.launch(job_storage, plan, SECRETS)
    assert {key: body["metadata"]["uid"] for key, body in api.objects.items()} == before


# -- cancel and cleanup ---------------------------------------------------------------------


def deletions(api) -> list[tuple[str, dict]]:
    return [(call, options) for call, options in api.calls if call.startswith("delete")]


@pytest.mark.parametrize("case", ["tpu-v5e-16", "cpu-3-hosts"])
def test_cancel_records_it_and_deletes_the_root_in_the_foreground_which_takes_everything(api, job_storage, case):
    backend, plan = launched(api, job_storage, case)
    backend.cancel(job_storage, plan, "interrupted", SECRETS.key)
    assert json.loads(read_record(job_storage, SECRETS.key, protocol.CANCEL))["reason"] == "interrupted"
    assert api.objects == {}  # the garbage collector took the rest
    [(call, options)] = deletions(api)
    assert (call, options["name"], options["namespace"]) == ("delete Job", ROOT, "ml-team")
    # The root stays, terminating, until what it owns is gone: kubectl shows the job until its hosts are.
    assert options["propagation_policy"] == "Foreground"


def test_cleanup_deletes_the_root_in_the_background_and_quietly(api, job_storage, caplog):
    backend, plan = launched(api, job_storage)
    backend.cleanup(plan)
    assert api.objects == {}
    [(call, options)] = deletions(api)
    assert (call, options["name"], options["propagation_policy"]) == ("delete Job", ROOT, "Background")
    api.batch.delete_namespaced_job = _raise(api_exception(500, "Internal Server Error", "etcd is sad"))
    with caplog.at_level(logging.WARNING):
        backend.cleanup(plan)
    assert "etcd is sad" in caplog.text
    with pytest.raises(KineticError, match=f"could not delete all of job .*Job {ROOT}: etcd is sad"):
        backend.cancel(job_storage, plan, "by the user", SECRETS.key)


def made_before_roots(api, job_storage, case):
    """A job launched before roots existed: its objects, as that launch made them, owned by nothing."""
    backend = KubernetesBackend(SETTINGS, api=api, pod_list_interval_s=0.0)
    plan = job_plan(case)
    for manifest in backend.manifests(job_storage, plan, "no-root")[1:]:
        del manifest["metadata"]["ownerReferences"]
        backend._create(manifest)
    return backend, plan


@pytest.mark.parametrize("case", ["tpu-v5e-16", "cpu-3-hosts"])
def test_a_job_without_a_root_is_deleted_by_its_label(api, job_storage, case):
    backend, plan = made_before_roots(api, job_storage, case)
    backend.cancel(job_storage, plan, "by the user", SECRETS.key)
    assert api.objects == {}
    calls = deletions(api)
    assert calls[0][0] == "delete Job" and calls[0][1]["name"] == ROOT  # tried first: not found
    assert {call for call, _ in calls[1:]} == {"delete LeaderWorkerSet", "delete Job", "delete Service"}
    assert all(options["label_selector"] == f"kinetic-nb/job={JOB_ID}" for _, options in calls[1:])


def test_a_cluster_without_the_leader_worker_set_api_can_still_cancel_a_job_without_a_root(api, job_storage):
    backend, plan = made_before_roots(api, job_storage, "tpu-v5e-8")
    api.custom.delete_collection_namespaced_custom_object = _raise(api_exception(404, "Not Found", "no such API"))
    backend.cancel(job_storage, plan, "by the user", SECRETS.key)
    assert api.objects == {}


# -- the root and the garbage collector (the double's, see k8s_cluster.py) ------------------------


@pytest.mark.parametrize("propagation", ["Background", "Foreground"])
@pytest.mark.parametrize("case", ["tpu-v5e-16", "cpu-3-hosts"])
def test_deleting_the_root_deletes_the_workload_the_service_and_their_pods(api, job_storage, tmp_path, case,
                                                                          propagation):
    """What the TTL controller (foreground), a cancel or a cleanup does: no label, no client logic needed."""
    launched(api, job_storage, case)
    assert ("Service", JOB_ID) in api.objects  # the LeaderWorkerSet controller's, or the backend's own
    workload_key = ("LeaderWorkerSet" if case.startswith("tpu") else "Job", JOB_ID)
    kubelet = FakeKubelet(pods_for(api.objects.values()), str(tmp_path))  # pods scheduled, containers not started
    api.pod_source = kubelet.pod_json
    api.on_delete.append(kubelet.collect_with(*workload_key))
    assert len(api.core.list_namespaced_pod("ml-team", label_selector=f"kinetic-nb/job={JOB_ID}").items) > 1
    api.batch.delete_namespaced_job(ROOT, "ml-team", propagation_policy=propagation)
    assert api.objects == {}
    assert api.core.list_namespaced_pod("ml-team", label_selector=f"kinetic-nb/job={JOB_ID}").items == []


def test_the_double_collects_only_what_the_root_owns_and_orphans_when_asked_for_no_policy(api, job_storage):
    """The double is no looser than the collector: another job's objects stay, and a delete without a
    policy (a batch/v1 Job's default is to orphan) keeps the dependents."""
    launched(api, job_storage, "cpu-3-hosts")
    other, other_backend = dataclasses.replace(job_plan("cpu-3-hosts"), job_id="kn-other"), KubernetesBackend(
        SETTINGS, api=api)
    with pytest.warns(KineticWarning):
        other_backend.launch(job_storage, other, SECRETS)
    api.batch.delete_namespaced_job(ROOT, "ml-team")
    assert {name for _, name in api.objects} == {JOB_ID, secret_name(JOB_ID), "kn-other", root_name("kn-other"),
                                                 secret_name("kn-other")}
    assert api.objects["Job", JOB_ID]["metadata"]["ownerReferences"] == []  # orphaned, not deleted
    other_backend.cleanup(other)
    assert {name for _, name in api.objects} == {JOB_ID, secret_name(JOB_ID)}


def test_an_object_whose_owner_reference_names_another_uid_is_collected_at_once(api, job_storage):
    """Why the root's uid must come from the API server's answer: a reference to no live owner is garbage."""
    backend, plan = KubernetesBackend(SETTINGS, api=api), job_plan("tpu-v5e-16")
    root, workload = backend.manifests(job_storage, plan, "a-uid-the-server-never-gave")
    backend._create(root)
    backend._create(workload)
    assert list(api.objects) == [("Job", ROOT)]


def as_sent(stored: dict) -> dict:
    """What the backend sent, from the object the API server stored (without the fields the server sets)."""
    metadata = {key: value for key, value in stored["metadata"].items() if key not in ("uid", "creationTimestamp")}
    return {**stored, "metadata": metadata}


def _raise(error):
    def fail(*args, **kwargs):
        raise error
    return fail


# -- exit summaries -------------------------------------------------------------------------


def test_exit_summaries_read_stored_records_and_fill_in_from_pods(api, job_storage):
    backend, plan = launched(api, job_storage, clock=Clock(CREATED + 60))
    leader = ExitSummary(host_index=0, exit_code=0, recorded_success=True, ended_at=CREATED + 50)
    write_record(job_storage, SECRETS.key, protocol.host_exit(0), leader.to_json())
    api.pod_source = lambda: [BY_CASE["running"], BY_CASE["parked-after-exit-1"], BY_CASE["unschedulable"],
                              BY_CASE["crashloop-after-oom"]]
    summaries = backend.exit_summaries(job_storage, plan, job_storage.list(), SECRETS.key)
    assert set(summaries) == {0, 1, 3}  # host 2 is Pending, not yet past the bound
    assert summaries[0] == leader
    assert summaries[1].exit_code == 1 and summaries[1].failed
    assert summaries[3].describe() == "was killed by SIGKILL (OOMKilled)"
    stored = read_exit(job_storage, SECRETS.key, 3)  # what the barrier reads
    assert (stored.signal, stored.exit_code, stored.failed) == ("SIGKILL", None, True)
    assert [call for call, _ in api.calls].count("list pods") == 1
    [(_, options)] = [entry for entry in api.calls if entry[0] == "list pods"]
    assert options["label_selector"] == f"kinetic-nb/job={JOB_ID}" and options["namespace"] == "ml-team"


def test_a_pod_stuck_pending_fails_the_job_with_the_schedulers_reason(api, job_storage):
    clock = Clock(CREATED + 60)
    backend, plan = launched(api, job_storage, clock=clock)
    api.pod_source = lambda: [BY_CASE["running"], BY_CASE["unschedulable"]]
    assert backend.exit_summaries(job_storage, plan, job_storage.list(), SECRETS.key) == {}
    clock.now = CREATED + SETTINGS.pending_timeout_s + 1
    assert set(backend.stuck_hosts(plan)) == {2}
    summaries = backend.exit_summaries(job_storage, plan, job_storage.list(), SECRETS.key)
    assert summaries[2].failed
    assert "never started: its pod was Pending for more than 2700 s: Unschedulable: 0/4 nodes are available" in (
        summaries[2].describe())
    assert summaries[1].stopped and summaries[3].stopped  # no pods, and the job has failed
    assert read_exit(job_storage, SECRETS.key, 2).failed


def test_a_success_recorded_by_the_host_comes_with_its_pods_exit(api, job_storage):
    backend, plan = launched(api, job_storage, "tpu-v5e-8", clock=Clock(CREATED + 60))
    status = HostStatus(host_index=0, state="succeeded", phase="teardown", started_at=CREATED, updated_at=CREATED,
                        pid=1, hostname="pod")
    write_record(job_storage, SECRETS.key, protocol.host_status(0), status.to_json())
    api.pod_source = lambda: [BY_CASE["succeeded"]]
    [summary] = backend.exit_summaries(job_storage, plan, job_storage.list(), SECRETS.key).values()
    assert summary.recorded_success and summary.exit_code == 0 and not summary.failed


def test_polling_costs_one_pod_listing_per_interval_and_one_read_per_record(api, job_storage, monkeypatch):
    backend = KubernetesBackend(SETTINGS, api=api, pod_list_interval_s=3600)
    plan = job_plan("tpu-v5e-16")
    job_storage.write_bytes(protocol.PLAN, plan.to_json())
    api.pod_source = lambda: [BY_CASE["running"]]
    for _ in range(5):
        backend.exit_summaries(job_storage, plan, job_storage.list(), SECRETS.key)
    assert [call for call, _ in api.calls].count("list pods") == 1
    for index in range(plan.hosts):
        write_record(job_storage, SECRETS.key, protocol.host_exit(index), ExitSummary(host_index=index, exit_code=0).to_json())
    reads = []
    read_bytes, read_bounded = job_storage.read_bytes, job_storage.read_bounded
    monkeypatch.setattr(job_storage, "read_bytes", lambda name: reads.append(name) or read_bytes(name))
    monkeypatch.setattr(job_storage, "read_bounded",  # how a record is read: up to its limit
                        lambda name, max_bytes: reads.append(name) or read_bounded(name, max_bytes))
    for _ in range(5):
        assert len(backend.exit_summaries(job_storage, plan, job_storage.list(), SECRETS.key)) == plan.hosts
    assert sorted(reads) == sorted(protocol.host_exit(index) for index in range(plan.hosts))  # each once
    assert [call for call, _ in api.calls].count("list pods") == 1  # every host has a record: no listing


def test_an_api_error_while_polling_is_logged_and_leaves_the_records(api, job_storage, caplog):
    backend, plan = launched(api, job_storage)
    write_record(job_storage, SECRETS.key, protocol.host_exit(0), ExitSummary(host_index=0, exit_code=1).to_json())
    api.core.list_namespaced_pod = _raise(api_exception(503, "Service Unavailable", "the API server is restarting"))
    with caplog.at_level(logging.WARNING):
        summaries = backend.exit_summaries(job_storage, plan, job_storage.list(), SECRETS.key)
    assert set(summaries) == {0}
    assert "the API server is restarting" in caplog.text


def test_pod_states_from_client_objects(job_storage):
    api = FakeKubernetes(client_objects=True)
    backend, plan = launched(api, job_storage)
    api.pod_source = lambda: [BY_CASE["running"], BY_CASE["unschedulable"]]
    states = backend.host_states(plan)
    assert (states[0].state, states[2].state) == ("running", "pending")
    assert states[2].reason.startswith("Unschedulable")


# -- pending: the pods' Events ----------------------------------------------------------------

EVENTS = json.loads((pathlib.Path(__file__).parent / "data" / "events.json").read_text())["items"]


def scenario(name: str) -> list[dict]:
    return [event for event in EVENTS if event["metadata"]["annotations"]["test.kinetic-nb/scenario"] == name]


@pytest.mark.parametrize("client_objects", [False, True])
def test_a_host_waiting_for_a_scale_up_says_so_in_the_panel_and_keeps_waiting(job_storage, client_objects):
    api = FakeKubernetes(client_objects=client_objects)
    clock = Clock(CREATED + SETTINGS.pending_timeout_s - 1)  # long past the old 600 s bound
    backend, plan = launched(api, job_storage, clock=clock)
    api.pod_source = lambda: [BY_CASE["running"], BY_CASE["unschedulable"]]
    api.event_source = lambda: scenario("scale-up-triggered")
    view = backend.observe(job_storage, plan, job_storage.list(), {}, SECRETS.key)
    assert view.waiting == {2: "waiting for TPU nodes: scale-up triggered"}
    assert view.exits == {}
    [(_, options)] = [entry for entry in api.calls if entry[0] == "list events"]
    assert (options["namespace"], options["field_selector"]) == ("ml-team", "involvedObject.kind=Pod")
    clock.now = CREATED + SETTINGS.pending_timeout_s + 1
    summaries = backend.exit_summaries(job_storage, plan, job_storage.list(), SECRETS.key)
    assert summaries[2].describe() == ("never started: its pod was Pending for more than 2700 s: "
                                       "waiting for TPU nodes: scale-up triggered")


@pytest.mark.parametrize(("pod", "events", "reason"), [
    ("image-pull-backoff", "image-pull-backoff", 'ImagePullBackOff: Back-off pulling image "registry.example/'
                                                 'kinetic-jax:typo" (registry.example/kinetic-jax:typo: not found)'),
    ("unschedulable", "scale-up-failed-quota", "scale-up of TPU nodes failed: Node scale up in zones us-west4-a "
                                               "associated with this pod failed: GCE quota exceeded."),
    ("unschedulable", "not-triggered-no-matching-pool", "no node pool can add TPU nodes for it: pod didn't trigger"),
])
def test_a_wait_that_can_never_end_fails_the_host_at_once_with_the_reason(api, job_storage, pod, events, reason):
    backend, plan = launched(api, job_storage, clock=Clock(CREATED + 60))  # far within the pending limit
    api.pod_source = lambda: [BY_CASE[pod]]
    api.event_source = lambda: scenario(events)
    summaries = backend.exit_summaries(job_storage, plan, job_storage.list(), SECRETS.key)
    index = BY_CASE[pod]["metadata"]["labels"].get("leaderworkerset.sigs.k8s.io/worker-index") or "0"
    summary = summaries[int(index)]
    assert summary.failed and summary.describe().startswith(f"never started: {reason}")
    stored = read_exit(job_storage, SECRETS.key, int(index))
    assert stored.failed  # what the other hosts' start barrier reads: they stop instead of waiting


def test_a_failed_root_fails_the_job_at_once_not_after_the_pending_limit(api, job_storage):
    """The root pod failed while the slice was still scaling up (no host pod yet): the cluster deletes the
    workload with it, so every host fails now with the root's reason and last lines, and the other hosts'
    start barrier reads it, instead of a 45-minute wait for pods that will never come."""
    backend, plan = launched(api, job_storage, clock=Clock(CREATED + 60))
    api.pod_source = lambda: [BY_CASE["root-failed"]]
    summaries = backend.exit_summaries(job_storage, plan, job_storage.list(), SECRETS.key)
    assert sorted(summaries) == list(range(plan.hosts))
    for index, summary in summaries.items():
        assert summary.failed and summary.describe() == ("never started: the job's root pod "
                                                         "kn-20261129-234752-3e8d32-root-x7k2p failed (exit code 1); "
                                                         "it ends the job")
        assert "storage.objects.get" in summary.stderr_tail[-1]
        assert read_exit(job_storage, SECRETS.key, index).failed


def test_events_are_listed_only_while_a_host_is_pending_and_at_most_once_per_interval(job_storage):
    api = FakeKubernetes()
    backend = KubernetesBackend(SETTINGS, api=api, pod_list_interval_s=0.0, event_list_interval_s=3600,
                                clock=Clock(CREATED + 60))
    plan = job_plan("tpu-v5e-16")
    api.pod_source = lambda: [BY_CASE["running"], BY_CASE["unschedulable"]]
    for _ in range(3):
        backend.observe(job_storage, plan, job_storage.list(), {}, SECRETS.key)
    assert [call for call, _ in api.calls].count("list events") == 1
    api.pod_source = lambda: [BY_CASE["running"]]
    fresh = KubernetesBackend(SETTINGS, api=api, pod_list_interval_s=0.0, event_list_interval_s=0.0)
    fresh.observe(job_storage, plan, job_storage.list(), {}, SECRETS.key)
    assert [call for call, _ in api.calls].count("list events") == 1  # nobody Pending: no listing


def test_events_that_cannot_be_listed_leave_the_pods_own_reasons(api, job_storage, caplog):
    backend, plan = launched(api, job_storage, clock=Clock(CREATED + 60))
    api.pod_source = lambda: [BY_CASE["unschedulable"], BY_CASE["image-pull-backoff"]]
    api.core.list_namespaced_event = _raise(api_exception(403, "Forbidden", 'events is forbidden: User "me"'))
    with caplog.at_level(logging.WARNING):
        view = backend.observe(job_storage, plan, job_storage.list(), {}, SECRETS.key)
    assert "events is forbidden" in caplog.text
    assert view.waiting[2].startswith("Unschedulable: 0/4 nodes are available")
    # A back-off's status does not say why the pull failed: the host waits (bounded by the pending limit).
    assert view.waiting[0].startswith('waiting to pull image registry.example/kinetic-jax:typo') and not view.exits


def test_the_pending_limit_is_a_flag_and_ties_the_start_barrier_to_it():
    backend = KubernetesBackend.from_options(pending_timeout_s=600.0, image="img:1")
    assert backend.settings.pending_timeout_s == backend.start_window_s() == 600.0
    config = KubernetesBackend.from_options(config={"pending_timeout_s": 1200.0, "image": "img:1"})
    assert config.start_window_s() == 1200.0
    assert KubernetesBackend(KubernetesSettings(image="img:1")).start_window_s() == 45 * 60
