"""The backend through the real ``kubernetes`` client, over HTTP, against a server that answers like the API server.

``RecordingApiServer`` (``k8s_api_server.py``) runs in a thread on the
loopback and records every request, so these tests check what goes over the
wire: verb, URL, query (``fieldValidation=Strict``, ``propagationPolicy``,
selectors), body (the manifests, owned by the root's server-given uid), and how
the client's ``ApiException`` for 404 (no namespace / no LeaderWorkerSet API),
403 and 409 becomes the backend's one-line errors.
"""

from __future__ import annotations

import json
import pathlib

import pytest

from kinetic_nb.backends.kubernetes.backend import KubernetesBackend, KubernetesSettings
from kinetic_nb.backends.kubernetes.manifests import secret_name
from kinetic_nb.backends.kubernetes.root import ROOT_TTL_AFTER_FINISHED_S, root_name
from kinetic_nb.errors import KineticError, KineticWarning
from kinetic_nb.runner import protocol
from kinetic_nb.storage import open_storage

from .k8s_api_server import RecordingApiServer
from .test_kubernetes_manifests import JOB_ID, SECRETS, job_plan

SETTINGS = KubernetesSettings(namespace="ml-team", image="registry.example/kinetic-jax:1.0")
ROOT = root_name(JOB_ID)
DATA = pathlib.Path(__file__).parent / "data"
pytestmark = pytest.mark.filterwarnings("ignore:job storage file.*is local to this machine:kinetic_nb.errors.KineticWarning")


@pytest.fixture
def server():
    running = RecordingApiServer()
    yield running
    running.close()


@pytest.fixture
def job_storage(tmp_path):
    return open_storage(f"file://{tmp_path}/jobs").child(JOB_ID)


#: A minute after the fixture pods were created: far within the pending limit.
NOW = 1795996075.0 + 60


def backend_for(server: RecordingApiServer, settings: KubernetesSettings = SETTINGS) -> KubernetesBackend:
    return KubernetesBackend(settings, api=server.api(), pod_list_interval_s=0.0, event_list_interval_s=0.0,
                             clock=lambda: NOW)


def assert_only_garbage_left(server: RecordingApiServer) -> None:
    """The root is gone, and whatever the launch created besides is owned by it alone: the garbage collector
    (not the API server, which only stores) deletes it."""
    assert ("Job", "ml-team", ROOT) not in server.objects
    for body in server.objects.values():
        [owner] = body["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"]) == ("Job", ROOT)


def launch(server, job_storage, case="tpu-v5e-16", settings=SETTINGS):
    backend, plan = backend_for(server, settings), job_plan(case)
    job_storage.write_bytes(protocol.PLAN, plan.to_json())
    with pytest.warns(KineticWarning):
        backend.launch(job_storage, plan, SECRETS)
    return backend, plan


@pytest.mark.parametrize(("case", "paths"), [
    ("tpu-v5e-16", ["/apis/batch/v1/namespaces/ml-team/jobs", "/api/v1/namespaces/ml-team/secrets",
                    "/apis/leaderworkerset.x-k8s.io/v1/namespaces/ml-team/leaderworkersets"]),
    ("cpu-3-hosts", ["/apis/batch/v1/namespaces/ml-team/jobs", "/api/v1/namespaces/ml-team/secrets",
                     "/api/v1/namespaces/ml-team/services", "/apis/batch/v1/namespaces/ml-team/jobs"]),
])
def test_launch_posts_each_manifest_with_strict_field_validation_owned_by_the_uid_the_server_gave(
        server, job_storage, case, paths):
    backend, plan = launch(server, job_storage, case)
    posts = server.sent("POST")
    assert [request.path for request in posts] == paths
    assert all(request.query == {"fieldValidation": ["Strict"]} for request in posts)
    root_uid = server.objects["Job", "ml-team", ROOT]["metadata"]["uid"]
    assert [request.body for request in posts if request.body["kind"] != "Secret"] == backend.manifests(
        job_storage, plan, root_uid)
    for request in posts[1:]:  # everything after the root is owned by it, by the uid from the 201
        assert request.body["metadata"]["ownerReferences"] == [{
            "apiVersion": "batch/v1", "kind": "Job", "name": ROOT, "uid": root_uid, "controller": False,
            "blockOwnerDeletion": True}]
    root = posts[0].body
    assert root["spec"]["ttlSecondsAfterFinished"] == ROOT_TTL_AFTER_FINISHED_S  # the cluster ends the job alone
    assert "activeDeadlineSeconds" in root["spec"]
    assert backend.job_key(JOB_ID) == SECRETS.key  # read back through GET .../secrets/NAME, base64 and all
    assert server.requests[-1].path == f"/api/v1/namespaces/ml-team/secrets/{secret_name(JOB_ID)}"


def test_a_missing_leader_worker_set_api_is_told_apart_from_a_missing_namespace(server, job_storage):
    server.lws_installed = False
    with pytest.raises(KineticError) as caught:
        launch(server, job_storage)
    assert str(caught.value) == ("the cluster has no LeaderWorkerSet API (leaderworkerset.x-k8s.io/v1): install "
                                 "the LeaderWorkerSet controller first (docs/gke.md)")
    # The root was created, then deleted (which takes what it owns): nothing is left.
    [delete] = server.sent("DELETE")
    assert (delete.path, delete.query) == (f"/apis/batch/v1/namespaces/ml-team/jobs/{ROOT}",
                                          {"propagationPolicy": ["Background"]})
    assert_only_garbage_left(server)


@pytest.mark.parametrize("case", ["tpu-v5e-16", "cpu-3-hosts"])
def test_a_missing_namespace_is_named_with_the_command_that_creates_it(server, job_storage, case):
    settings = KubernetesSettings(namespace="no-such-ns", image="img:1")
    with pytest.raises(KineticError) as caught:
        launch(server, job_storage, case, settings)
    assert str(caught.value) == ("namespace no-such-ns does not exist: create it (kubectl create namespace "
                                 "no-such-ns) or choose another (--namespace, KINETIC_NAMESPACE)")
    assert [request.path for request in server.sent("POST")] == ["/apis/batch/v1/namespaces/no-such-ns/jobs"]


def test_forbidden_is_one_line_with_the_servers_reason_and_leaves_nothing(server, job_storage):
    server.fail["POST", "/api/v1/namespaces/ml-team/services"] = (
        403, "Forbidden", 'services is forbidden: User "me@example.com" cannot create resource "services" in API '
                          'group "" in the namespace "ml-team"')
    with pytest.raises(KineticError) as caught:
        launch(server, job_storage, "cpu-3-hosts")
    assert str(caught.value) == (f"not allowed to create Service {JOB_ID} in namespace ml-team: services is "
                                 'forbidden: User "me@example.com" cannot create resource "services" in API group "" '
                                 'in the namespace "ml-team"')
    assert_only_garbage_left(server)


def test_a_second_launch_conflicts_and_leaves_the_first_ones_objects(server, job_storage):
    backend, plan = launch(server, job_storage)
    before = {key: body["metadata"]["uid"] for key, body in server.objects.items()}
    with pytest.raises(KineticError) as caught, pytest.warns(KineticWarning):
        backend.launch(job_storage, plan, SECRETS)
    assert str(caught.value) == f'could not create Job {ROOT} in namespace ml-team: jobs "{ROOT}" already exists'
    assert {key: body["metadata"]["uid"] for key, body in server.objects.items()} == before
    assert server.sent("DELETE") == []  # not the first launch's root


def test_cancel_deletes_the_root_in_the_foreground_and_cleanup_in_the_background(server, job_storage):
    backend, plan = launch(server, job_storage)
    backend.cancel(job_storage, plan, "by the user", SECRETS.key)
    [delete] = server.sent("DELETE")
    assert (delete.path, delete.query) == (f"/apis/batch/v1/namespaces/ml-team/jobs/{ROOT}",
                                          {"propagationPolicy": ["Foreground"]})
    backend.cleanup(plan)  # the root is gone (404): its objects are deleted by label, each kind
    deletes = server.sent("DELETE")[1:]
    assert [request.path for request in deletes] == [
        f"/apis/batch/v1/namespaces/ml-team/jobs/{ROOT}",
        "/apis/leaderworkerset.x-k8s.io/v1/namespaces/ml-team/leaderworkersets",
        "/apis/batch/v1/namespaces/ml-team/jobs", "/api/v1/namespaces/ml-team/services"]
    assert all(request.query["labelSelector"] == [f"kinetic-nb/job={JOB_ID}"] for request in deletes[1:])


def test_polling_lists_pods_by_label_and_pod_events_by_field_through_the_client(server, job_storage):
    backend, plan = launch(server, job_storage)
    pods = json.loads((DATA / "pods.json").read_text())["items"]
    events = json.loads((DATA / "events.json").read_text())["items"]
    server.pods = [pod for pod in pods if pod["metadata"]["annotations"]["test.kinetic-nb/case"] in (
        "running", "unschedulable")]
    server.events = [event for event in events
                     if event["metadata"]["annotations"]["test.kinetic-nb/scenario"] == "scale-up-triggered"]
    view = backend.observe(job_storage, plan, job_storage.list(), {}, SECRETS.key)
    assert view.waiting == {2: "waiting for TPU nodes: scale-up triggered"}
    listings = {(request.path, json.dumps(request.query)) for request in server.sent("GET")}
    assert listings == {
        ("/api/v1/namespaces/ml-team/pods", json.dumps({"labelSelector": [f"kinetic-nb/job={JOB_ID}"]})),
        ("/api/v1/namespaces/ml-team/events", json.dumps({"fieldSelector": ["involvedObject.kind=Pod"]}))}


# -- which cluster ---------------------------------------------------------------------------------------------


def write_kubeconfig(path: pathlib.Path, servers: dict[str, str], current: str | None) -> pathlib.Path:
    """A kubeconfig with one context per server (``name -> URL``), ``current`` its current context."""
    clusters = [{"name": name, "cluster": {"server": url}} for name, url in servers.items()]
    contexts = [{"name": name, "context": {"cluster": name, "user": "tester", "namespace": "ml-team"}}
                for name in servers]
    config = {"apiVersion": "v1", "kind": "Config", "clusters": clusters, "contexts": contexts,
              "users": [{"name": "tester", "user": {"token": "not-a-secret"}}]}
    if current is not None:
        config["current-context"] = current
    path.write_text(json.dumps(config))  # JSON is YAML
    return path


@pytest.fixture
def in_a_pod(monkeypatch, tmp_path):
    """A notebook in a pod of some cluster: the service host variables and the service account's files."""
    from kubernetes.config import incluster_config

    token, cert = tmp_path / "token", tmp_path / "ca.crt"
    token.write_text("pod-token")
    cert.write_text("not a real certificate")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.3.240.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(token))
    monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(cert))


@pytest.mark.parametrize("named", [False, True], ids=["current context", "named context"])
def test_a_kubeconfig_context_wins_over_the_pod_the_notebook_runs_in(server, in_a_pod, tmp_path, monkeypatch,
                                                                     named, capsys):
    """A notebook in a pod of one cluster targets another through its kubeconfig: the named context, else the
    current one, is the one asked, not the pod's own API server; a launch's notice names it."""
    other = RecordingApiServer()
    try:
        kubeconfig = write_kubeconfig(tmp_path / "config", {"gke-a": server.url, "gke-b": other.url},
                                      current="gke-a")
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
        settings = KubernetesSettings(namespace="ml-team", image="img:1", context="gke-b" if named else None)
        backend = KubernetesBackend(settings)
        expected, idle = (other, server) if named else (server, other)
        assert backend.launch_notices(job_plan("cpu-3-hosts"))[0] == (
            f"kubernetes: kubeconfig context {'gke-b' if named else 'gke-a'}, namespace ml-team")
        backend.pods(job_plan("cpu-3-hosts"))
        assert [request.path.split("?")[0] for request in expected.sent("GET")] == ["/api/v1/namespaces/ml-team/pods"]
        assert idle.sent() == []
    finally:
        other.close()


def test_without_a_kubeconfig_context_the_pods_own_service_account_is_used(in_a_pod, tmp_path, monkeypatch):
    """No kubeconfig (or one that names no current context): the in-cluster config, this pod's cluster."""
    from kinetic_nb.backends.kubernetes.api import connect

    for kubeconfig in (tmp_path / "missing", write_kubeconfig(tmp_path / "config", {"gke-a": "http://x"}, None)):
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
        api = connect(KubernetesSettings(namespace="ml-team"))
        assert api.source == "in-cluster config (this pod's service account)"
        assert api.core.api_client.configuration.host == "https://10.3.240.1:443"


# -- a cluster keras-kinetic made ------------------------------------------------------------------------------


def write_kinetic_profiles(path: pathlib.Path, current: str | None = "dev-tpu") -> pathlib.Path:
    """A profiles file as keras-kinetic 0.0.4's ``kinetic up`` saves it (``kinetic/cli/profiles.py``)."""
    path.write_text(json.dumps({"current": current, "profiles": {
        "dev-tpu": {"cluster": "kinetic-cluster", "namespace": "ml-team", "project": "ml-proj",
                    "zone": "us-central2-b"}}}, indent=2, sort_keys=True) + "\n")
    return path


def test_a_cluster_kinetic_up_made_needs_no_setting_of_kinetic_nb(server, tmp_path, monkeypatch, capsys):
    """With keras-kinetic's active profile and nothing else set, -b kubernetes goes to its cluster's context, its
    namespace, its `kinetic` service account (bound by Workload Identity) and its jobs bucket; the launch's notice
    says so."""
    context = "gke_ml-proj_us-central2-b_kinetic-cluster"
    monkeypatch.setenv("KINETIC_PROFILES_FILE", str(write_kinetic_profiles(tmp_path / "profiles.json")))
    monkeypatch.setenv("KUBECONFIG", str(write_kubeconfig(tmp_path / "config", {context: server.url,
                                                                                "elsewhere": "http://x"},
                                                          current="elsewhere")))
    monkeypatch.delenv("KINETIC_STORAGE")
    monkeypatch.delenv("KINETIC_NAMESPACE", raising=False)
    backend = KubernetesBackend.from_options(image="img:1")
    assert (backend.settings.context, backend.settings.namespace, backend.settings.service_account) == (
        context, "ml-team", "kinetic")
    assert backend.default_storage() == "gs://ml-proj-kn-kinetic-cluster-jobs/kinetic_nb"
    assert backend.launch_notices(job_plan("cpu-3-hosts"))[0] == (
        f"kubernetes: kubeconfig context {context}, namespace ml-team (from keras-kinetic profile dev-tpu: cluster "
        "kinetic-cluster in us-central2-b, project ml-proj, namespace ml-team)")
    backend.pods(job_plan("cpu-3-hosts"))  # the profile's cluster is the one asked
    assert [request.path.split("?")[0] for request in server.sent("GET")] == ["/api/v1/namespaces/ml-team/pods"]
    # What the user sets wins: a named context (and then no bucket of kinetic's), a namespace, a service account.
    named = KubernetesBackend.from_options(image="img:1", context="elsewhere", namespace="other",
                                           service_account="runner")
    assert (named.settings.context, named.settings.namespace, named.settings.service_account) == (
        "elsewhere", "other", "runner")
    assert named.default_storage() is None


@pytest.mark.parametrize("case", ["no file", "no active profile", "malformed"])
def test_without_an_active_kinetic_profile_nothing_changes(tmp_path, monkeypatch, case):
    path = tmp_path / "profiles.json"
    if case == "no active profile":
        write_kinetic_profiles(path, current=None)
    elif case == "malformed":
        path.write_text("{not json")
    monkeypatch.setenv("KINETIC_PROFILES_FILE", str(path))
    settings = KubernetesSettings.resolve(image="img:1")
    assert (settings.context, settings.service_account) == (None, None)
    assert KubernetesBackend(settings).default_storage() is None
