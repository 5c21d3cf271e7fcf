"""``kinetic_nb.doctor()`` and ``%kinetic doctor``.

The Kubernetes checks run through the real ``kubernetes`` client against
``RecordingApiServer`` (tests/backends/k8s_api_server.py); the bucket checks
against the real fake-gcs-server the gs:// tests use. The bucket's IAM policy
comes from Google's IAM API, which cannot run here: those tests pass
``iam_policy_double``, a test double of that one client call
(``readiness.bucket_iam_policy``), named as such.
"""

from __future__ import annotations

import pytest

from kinetic_nb import readiness as doctor_module
from kinetic_nb.accelerators import resolve_accelerator
from kinetic_nb.readiness import doctor, required_permissions

from .backends.k8s_api_server import RecordingApiServer

NODE_LABELS = {"cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
               "cloud.google.com/gke-tpu-topology": "4x4", "node.kubernetes.io/instance-type": "ct5lp-hightpu-4t"}
GSA = "kinetic-runner@ml-proj.iam.gserviceaccount.com"
OPTIONS = {"namespace": "ml-team", "service_account": "kinetic-runner", "image": "img:1"}


@pytest.fixture
def server():
    running = RecordingApiServer()
    running.nodes = [{"apiVersion": "v1", "kind": "Node", "metadata": {"name": f"gke-tpu-{i}", "labels": NODE_LABELS}}
                     for i in range(4)]
    running.add({"apiVersion": "v1", "kind": "ServiceAccount",
                 "metadata": {"name": "kinetic-runner", "namespace": "ml-team",
                              "annotations": {"iam.gke.io/gcp-service-account": GSA}}})
    yield running
    running.close()


def iam_policy_double(bindings):
    """A test double of ``readiness.bucket_iam_policy`` (Google's IAM API, which cannot run here)."""
    asked = []

    def policy(bucket):
        asked.append(bucket)
        return bindings
    policy.asked = asked
    return policy


def by_name(report):
    return {check.name: check for check in report.checks}


def test_a_ready_cluster_and_bucket_pass_every_check(server, gcs_root):
    policy = iam_policy_double({"roles/storage.objectUser": {f"serviceAccount:{GSA}"}})
    report = doctor("tpu-v5e-16", gcs_root, backend_options=OPTIONS, api=server.api(), iam_policy=policy)
    assert report.ok, report.table()
    assert [check.name for check in report.checks] == [
        "cluster reachable", "namespace", "LeaderWorkerSet API", "node pool", "permissions", "storage",
        "pods reach the bucket"]
    assert by_name(report)["cluster reachable"].detail == "Kubernetes v1.31.4-gke.1256000"
    assert policy.asked == ["kinetic-tests"]
    # One SelfSubjectAccessReview per verb and resource the backend uses, in the job's namespace.
    reviews = [request.body["spec"]["resourceAttributes"] for request in server.sent("POST")
               if request.path == "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews"]
    assert [(item["group"], item["resource"], item["verb"]) for item in reviews] == required_permissions(
        resolve_accelerator("tpu-v5e-16"))
    assert {item["namespace"] for item in reviews} == {"ml-team"}
    assert ("leaderworkerset.x-k8s.io", "leaderworkersets", "create") in required_permissions(
        resolve_accelerator("tpu-v5e-16"))
    # The storage probe was deleted.
    from kinetic_nb.storage import open_storage
    assert not [info for info in open_storage(gcs_root).list() if info.name.startswith(".kinetic-doctor")]
    assert "fix:" not in report.table()


def test_each_failure_comes_with_the_command_that_fixes_it(server, gcs_root):
    server.lws_installed = False
    server.nodes = []
    server.denied = {("create", "leaderworkersets"), ("list", "events")}
    policy = iam_policy_double({"roles/storage.objectViewer": {f"serviceAccount:{GSA}"}})
    report = doctor("tpu-v5e-16", gcs_root, backend_options=OPTIONS, api=server.api(), iam_policy=policy)
    assert not report.ok
    checks = by_name(report)
    assert checks["LeaderWorkerSet API"].fix == (
        "kubectl apply --server-side -f https://github.com/kubernetes-sigs/lws/releases/download/v0.9.0/manifests.yaml")
    assert checks["node pool"].status == "warn"  # a pool scaled to zero has no nodes yet
    assert checks["node pool"].fix == ("gcloud container node-pools create tpu-v5e-16 --cluster CLUSTER --location "
                                       "LOCATION --machine-type ct5lp-hightpu-4t --tpu-topology 4x4 --num-nodes 4")
    assert checks["may create leaderworkersets.leaderworkerset.x-k8s.io"].fix == (
        "kubectl create role kinetic-create-leaderworkersets --verb=create "
        "--resource=leaderworkersets.leaderworkerset.x-k8s.io -n ml-team && kubectl create rolebinding "
        "kinetic-create-leaderworkersets --role=kinetic-create-leaderworkersets "
        "--user=$(gcloud config get-value account) -n ml-team")
    assert checks["may list events"].status == "fail"
    assert "permissions" not in checks
    assert checks["pods reach the bucket"].fix == (
        f"gcloud storage buckets add-iam-policy-binding gs://kinetic-tests --member=serviceAccount:{GSA} "
        "--role=roles/storage.objectUser")
    table = report.table()
    for check in report.checks:
        if check.status == "fail":
            assert check.fix and check.fix in table


def test_a_missing_namespace_and_service_account_are_named(server, gcs_root):
    options = {**OPTIONS, "namespace": "nowhere", "service_account": "nobody"}
    report = doctor("cpu", gcs_root, backend_options=options, api=server.api(), iam_policy=iam_policy_double({}))
    checks = by_name(report)
    assert (checks["namespace"].status, checks["namespace"].fix) == ("fail", "kubectl create namespace nowhere")
    assert checks["pods' service account"].fix == "kubectl create serviceaccount nobody -n nowhere"
    assert "node pool" not in checks and "LeaderWorkerSet API" not in checks  # cpu: nothing to select


def test_a_service_account_reaching_the_bucket_as_its_own_principal_passes(server, gcs_root):
    principal = ("principal://iam.googleapis.com/projects/123/locations/global/workloadIdentityPools/"
                 "ml-proj.svc.id.goog/subject/ns/ml-team/sa/plain")
    server.add({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "plain", "namespace": "ml-team"}})
    options = {**OPTIONS, "service_account": "plain"}
    granted = doctor("cpu", gcs_root, backend_options=options, api=server.api(),
                     iam_policy=iam_policy_double({"roles/storage.objectAdmin": {principal}}))
    assert by_name(granted)["pods reach the bucket"].status == "ok"
    refused = doctor("cpu", gcs_root, backend_options=options, api=server.api(), iam_policy=iam_policy_double({}))
    assert by_name(refused)["pods reach the bucket"].fix.startswith(
        "gcloud storage buckets add-iam-policy-binding gs://kinetic-tests --member=principal://iam.googleapis.com/"
        "projects/PROJECT_NUMBER/locations/global/workloadIdentityPools/PROJECT_ID.svc.id.goog/subject/ns/ml-team/"
        "sa/plain")


def test_an_unwritable_bucket_and_an_unreachable_cluster_fail_with_their_fixes(server, gcs_root, monkeypatch):
    missing_bucket = "gs://no-such-bucket-kinetic/x"
    server.close()  # nothing answers any more
    report = doctor("cpu", missing_bucket, backend_options=OPTIONS, api=server.api(),
                    iam_policy=iam_policy_double({}))
    checks = by_name(report)
    assert checks["cluster reachable"].status == "fail"
    assert checks["cluster reachable"].fix == "gcloud container clusters get-credentials CLUSTER --location LOCATION"
    assert checks["storage"].status == "fail"
    assert checks["storage"].fix == ("gcloud storage buckets add-iam-policy-binding gs://no-such-bucket-kinetic "
                                     "--member=user:$(gcloud config get-value account) --role=roles/storage.objectUser")
    assert "pods reach the bucket" not in checks  # not asked of a cluster that does not answer
    assert "\n" not in checks["storage"].detail


def test_no_google_login_is_fixed_by_logging_in_not_by_a_role(server, monkeypatch):
    for variable in ("STORAGE_EMULATOR_HOST", "GOOGLE_APPLICATION_CREDENTIALS"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("HOME", "/nonexistent")  # no gcloud application-default credentials either
    monkeypatch.setenv("CLOUDSDK_CONFIG", "/nonexistent")
    monkeypatch.setenv("GCE_METADATA_HOST", "127.0.0.1:9")  # and no metadata server to ask
    check = doctor_module._storage_check("gs://some-bucket/kinetic")
    assert check.status == "fail" and "needs Google Cloud credentials" in check.detail
    assert check.fix == "gcloud auth application-default login"


def test_the_magic_prints_the_table(server, gcs_root, monkeypatch, capsys):
    from IPython.core.interactiveshell import InteractiveShell

    policy = iam_policy_double({"roles/storage.objectUser": {f"serviceAccount:{GSA}"}})
    monkeypatch.setattr(doctor_module, "connect", lambda settings: server.api())
    monkeypatch.setattr(doctor_module, "bucket_iam_policy", policy)
    monkeypatch.setenv("KINETIC_NAMESPACE", "ml-team")
    shell = InteractiveShell.instance()
    try:
        shell.run_line_magic("load_ext", "kinetic_nb")
        result = shell.run_line_magic("kinetic", f"doctor -a tpu-v5e-16 --storage {gcs_root} "
                                                 "--service-account kinetic-runner")
    finally:
        InteractiveShell.clear_instance()
    out = capsys.readouterr().out
    assert result is None
    assert out.splitlines()[0].split() == ["check", "status", "detail"]
    assert "pods reach the bucket" in out and "fail" not in out
    assert policy.asked == ["kinetic-tests"]
