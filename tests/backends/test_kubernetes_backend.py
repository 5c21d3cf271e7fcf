"""The kubernetes backend through its interface, against a test double of the Kubernetes API.

No real API server can run here (no cluster, no network): ``FakeKubernetes``
(``k8s_cluster.py``) stands in for the three API groups the backend calls,
records what it creates and deletes, and returns pods the tests script (from
``data/pods.json``, shaped as the API returns them). Storage is real
(``file://``). The end-to-end test against a real cluster is
``test_kubernetes_e2e.py``.
"""

from __future__ import annotations

import json
import logging
import pathlib
import subprocess
import sys

import pytest

from kinetic_nb.backends import get_backend
from kinetic_nb.backends import kubernetes as k8s
from kinetic_nb.backends.kubernetes import KubernetesBackend, KubernetesSettings
from kinetic_nb.errors import KineticError, KineticWarning
from kinetic_nb.runner import protocol
from kinetic_nb.runner.protocol import ExitSummary, HostStatus
from kinetic_nb.storage import open_storage

from .k8s_cluster import FakeKubernetes, api_exception
from .test_kubernetes_manifests import JOB_ID, job_plan

PODS = json.loads((pathlib.Path(__file__).parent / "data" / "pods.json").read_text())["items"]
BY_CASE = {pod["metadata"]["annotations"]["test.kinetic-nb/case"]: pod for pod in PODS}
CREATED = 1795996075.0  # when the fixture pods were created
SETTINGS = KubernetesSettings(namespace="ml-team", image="registry.example/kinetic-jax:1.0")


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
        backend.launch(job_storage, plan)
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


def test_the_backend_needs_an_image_before_anything_is_stored(monkeypatch):
    monkeypatch.delenv("KINETIC_IMAGE", raising=False)
    backend = get_backend("kubernetes")
    assert isinstance(backend, KubernetesBackend) and backend.name == "kubernetes"
    with pytest.raises(ValueError, match="pass --image IMAGE or set KINETIC_IMAGE"):
        backend.coordinator_address(JOB_ID)


def test_get_backend_reads_the_environment(monkeypatch):
    monkeypatch.setenv("KINETIC_NAMESPACE", "ml-team")
    monkeypatch.setenv("KINETIC_IMAGE", "img:1")
    backend = get_backend("kubernetes")
    assert backend.coordinator_address(JOB_ID) == f"{JOB_ID}-0.{JOB_ID}.ml-team:8476"


def test_importing_the_backends_does_not_import_the_kubernetes_client():
    code = ("import sys, kinetic_nb.backends, kinetic_nb.backends.kubernetes; "
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


def test_launch_creates_the_manifests_with_strict_field_validation(api, job_storage):
    backend, plan = launched(api, job_storage)
    assert list(api.objects) == [("LeaderWorkerSet", JOB_ID)]
    assert api.created("LeaderWorkerSet") == backend.manifests(job_storage, plan)
    [(_, options)] = [entry for entry in api.calls if entry[0].startswith("create")]
    assert options["field_validation"] == "Strict" and options["namespace"] == "ml-team"


def test_launch_of_cpu_hosts_creates_the_service_before_the_job(api, job_storage):
    launched(api, job_storage, "cpu-3-hosts")
    assert [call for call, _ in api.calls] == ["create Service", "create Job"]


def test_no_leader_worker_set_controller_is_a_clear_error(api, job_storage):
    api.fail["LeaderWorkerSet"] = api_exception(404, "Not Found", "the server could not find the requested resource")
    with pytest.raises(KineticError, match=r"no LeaderWorkerSet API .* install the LeaderWorkerSet controller"):
        launched(api, job_storage)


def test_a_failed_launch_removes_what_it_created(api, job_storage):
    api.fail["Job"] = api_exception(403, "Forbidden", 'jobs.batch is forbidden: User "me" cannot create resource')
    with pytest.raises(KineticError, match=r"not allowed to create Job .* in namespace ml-team: jobs.batch is forbidden"):
        launched(api, job_storage, "cpu-3-hosts")
    assert api.objects == {}


def test_a_second_launch_of_a_job_leaves_the_first_ones_objects_alone(api, job_storage):
    backend, plan = launched(api, job_storage)
    with pytest.raises(KineticError, match="already exists"), pytest.warns(KineticWarning):
        backend.launch(job_storage, plan)
    assert list(api.objects) == [("LeaderWorkerSet", JOB_ID)]


# -- cancel and cleanup ---------------------------------------------------------------------


def test_cancel_records_it_and_deletes_everything_by_one_label(api, job_storage):
    backend, plan = launched(api, job_storage, "cpu-3-hosts")
    backend.cancel(job_storage, plan, "interrupted")
    assert json.loads(job_storage.read_bytes(protocol.CANCEL))["reason"] == "interrupted"
    assert api.objects == {}
    deletions = [(call, options) for call, options in api.calls if call.startswith("delete")]
    assert {call for call, _ in deletions} == {"delete LeaderWorkerSet", "delete Job", "delete Service"}
    assert all(options["label_selector"] == f"kinetic-nb/job={JOB_ID}" for _, options in deletions)
    assert {options.get("propagation_policy") for call, options in deletions if call != "delete Service"} == {
        "Foreground"}


def test_cleanup_is_background_and_quiet(api, job_storage, caplog):
    backend, plan = launched(api, job_storage)
    backend.cleanup(plan)
    assert api.objects == {}
    assert {options.get("propagation_policy") for call, options in api.calls if call == "delete LeaderWorkerSet"} == {
        "Background"}
    api.batch.delete_collection_namespaced_job = _raise(api_exception(500, "Internal Server Error", "etcd is sad"))
    with caplog.at_level(logging.WARNING):
        backend.cleanup(plan)
    assert "etcd is sad" in caplog.text
    with pytest.raises(KineticError, match="could not delete all of job .*Job: etcd is sad"):
        backend.cancel(job_storage, plan, "by the user")


def test_a_cluster_without_the_leader_worker_set_api_can_still_cancel_a_job(api, job_storage):
    backend, plan = launched(api, job_storage, "tpu-v5e-8")
    api.custom.delete_collection_namespaced_custom_object = _raise(api_exception(404, "Not Found", "no such API"))
    backend.cancel(job_storage, plan, "by the user")
    assert api.objects == {}


def _raise(error):
    def fail(*args, **kwargs):
        raise error
    return fail


# -- exit summaries -------------------------------------------------------------------------


def test_exit_summaries_read_stored_records_and_fill_in_from_pods(api, job_storage):
    backend, plan = launched(api, job_storage, clock=Clock(CREATED + 60))
    leader = ExitSummary(host_index=0, exit_code=0, recorded_success=True, ended_at=CREATED + 50)
    job_storage.write_bytes(protocol.host_exit(0), leader.to_json())
    api.pod_source = lambda: [BY_CASE["running"], BY_CASE["parked-after-exit-1"], BY_CASE["unschedulable"],
                              BY_CASE["crashloop-after-oom"]]
    summaries = backend.exit_summaries(job_storage, plan, job_storage.list())
    assert set(summaries) == {0, 1, 3}  # host 2 is Pending, not yet past the bound
    assert summaries[0] == leader
    assert summaries[1].exit_code == 1 and summaries[1].failed
    assert summaries[3].describe() == "was killed by SIGKILL (OOMKilled)"
    stored = ExitSummary.from_json(job_storage.read_bytes(protocol.host_exit(3)))  # what the barrier reads
    assert (stored.signal, stored.exit_code, stored.failed) == ("SIGKILL", None, True)
    assert [call for call, _ in api.calls].count("list pods") == 1
    [(_, options)] = [entry for entry in api.calls if entry[0] == "list pods"]
    assert options["label_selector"] == f"kinetic-nb/job={JOB_ID}" and options["namespace"] == "ml-team"


def test_a_pod_stuck_pending_fails_the_job_with_the_schedulers_reason(api, job_storage):
    clock = Clock(CREATED + 60)
    backend, plan = launched(api, job_storage, clock=clock)
    api.pod_source = lambda: [BY_CASE["running"], BY_CASE["unschedulable"]]
    assert backend.exit_summaries(job_storage, plan, job_storage.list()) == {}
    clock.now = CREATED + SETTINGS.pending_timeout_s + 1
    assert set(backend.stuck_hosts(plan)) == {2}
    summaries = backend.exit_summaries(job_storage, plan, job_storage.list())
    assert summaries[2].failed
    assert "never started: its pod was Pending for more than 600 s: Unschedulable: 0/4 nodes are available" in (
        summaries[2].describe())
    assert summaries[1].stopped and summaries[3].stopped  # no pods, and the job has failed
    assert ExitSummary.from_json(job_storage.read_bytes(protocol.host_exit(2))).failed


def test_a_success_recorded_by_the_host_comes_with_its_pods_exit(api, job_storage):
    backend, plan = launched(api, job_storage, "tpu-v5e-8", clock=Clock(CREATED + 60))
    status = HostStatus(host_index=0, state="succeeded", phase="teardown", started_at=CREATED, updated_at=CREATED,
                        pid=1, hostname="pod")
    job_storage.write_bytes(protocol.host_status(0), status.to_json())
    api.pod_source = lambda: [BY_CASE["succeeded"]]
    [summary] = backend.exit_summaries(job_storage, plan, job_storage.list()).values()
    assert summary.recorded_success and summary.exit_code == 0 and not summary.failed


def test_polling_costs_one_pod_listing_per_interval_and_one_read_per_record(api, job_storage, monkeypatch):
    backend = KubernetesBackend(SETTINGS, api=api, pod_list_interval_s=3600)
    plan = job_plan("tpu-v5e-16")
    job_storage.write_bytes(protocol.PLAN, plan.to_json())
    api.pod_source = lambda: [BY_CASE["running"]]
    for _ in range(5):
        backend.exit_summaries(job_storage, plan, job_storage.list())
    assert [call for call, _ in api.calls].count("list pods") == 1
    for index in range(plan.hosts):
        job_storage.write_bytes(protocol.host_exit(index), ExitSummary(host_index=index, exit_code=0).to_json())
    reads = []
    read_bytes = job_storage.read_bytes
    monkeypatch.setattr(job_storage, "read_bytes", lambda name: reads.append(name) or read_bytes(name))
    for _ in range(5):
        assert len(backend.exit_summaries(job_storage, plan, job_storage.list())) == plan.hosts
    assert sorted(reads) == sorted(protocol.host_exit(index) for index in range(plan.hosts))  # each once
    assert [call for call, _ in api.calls].count("list pods") == 1  # every host has a record: no listing


def test_an_api_error_while_polling_is_logged_and_leaves_the_records(api, job_storage, caplog):
    backend, plan = launched(api, job_storage)
    job_storage.write_bytes(protocol.host_exit(0), ExitSummary(host_index=0, exit_code=1).to_json())
    api.core.list_namespaced_pod = _raise(api_exception(503, "Service Unavailable", "the API server is restarting"))
    with caplog.at_level(logging.WARNING):
        summaries = backend.exit_summaries(job_storage, plan, job_storage.list())
    assert set(summaries) == {0}
    assert "the API server is restarting" in caplog.text


def test_pod_states_from_client_objects(job_storage):
    api = FakeKubernetes(client_objects=True)
    backend, plan = launched(api, job_storage)
    api.pod_source = lambda: [BY_CASE["running"], BY_CASE["unschedulable"]]
    states = backend.host_states(plan)
    assert (states[0].state, states[2].state) == ("running", "pending")
    assert states[2].reason.startswith("Unschedulable")
