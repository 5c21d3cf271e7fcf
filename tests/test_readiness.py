"""``kinetic_nb.doctor()`` and ``%kinetic doctor``.

The Kubernetes checks run through the real ``kubernetes`` client against
``RecordingApiServer`` (tests/backends/k8s_api_server.py); the bucket checks
against the real fake-gcs-server the gs:// tests use. The bucket's IAM policy
comes from Google's IAM API, which cannot run here: those tests pass
``iam_policy_double``, a test double of that one client call
(``readiness.bucket_iam_policy``), named as such. The build image mode's
checks call Artifact Registry, Cloud Build and Resource Manager, which cannot
run here either: they go through ``RegistryAndCloudBuildDouble``
(tests/backends/google_api_double.py), the double the build tests use.
"""

from __future__ import annotations

import json

import pytest

from kinetic_nb.accelerators import resolve_accelerator
from kinetic_nb.backends.host_environment import host_packages
from kinetic_nb.backends.kubernetes import cloud_build
from kinetic_nb.backends.kubernetes import doctor as doctor_module
from kinetic_nb.backends.kubernetes import doctor_image as readiness_image
from kinetic_nb.backends.kubernetes.doctor import doctor, required_permissions
from kinetic_nb.backends.kubernetes.image_modes import stock_image
from kinetic_nb.errors import KineticError

from .backends.google_api_double import RegistryAndCloudBuildDouble
from .backends.k8s_api_server import RecordingApiServer

NODE_LABELS = {"cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
               "cloud.google.com/gke-tpu-topology": "4x4", "node.kubernetes.io/instance-type": "ct5lp-hightpu-4t",
               "iam.gke.io/gke-metadata-server-enabled": "true"}
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
        "cluster reachable", "namespace", "LeaderWorkerSet API", "node pool", "Workload Identity", "permissions",
        "image mode", "framework", "storage", "pods reach the bucket"]
    assert by_name(report)["image mode"].detail.startswith("custom: img:1 as it is (it needs kinetic_nb ")
    # A custom image on TPUs: kinetic_nb adds no framework there (the other modes do), so it says what must be in it.
    framework = by_name(report)["framework"]
    assert (framework.status, framework.detail) == (
        "warn", "the custom mode adds no framework: img:1 must have jax[tpu] for tpu-v5e-16 (not checked here)")
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
    assert checks["Workload Identity"].status == "warn"  # no node runs GKE's metadata server
    assert "--workload-pool=PROJECT_ID.svc.id.goog" in checks["Workload Identity"].fix
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


# -- the image mode ---------------------------------------------------------------------------------

REGISTRY = "us-docker.pkg.dev/ml-proj/kinetic"
REPOSITORY = "projects/ml-proj/locations/us/repositories/kinetic"
PREBUILT = {"namespace": "ml-team", "service_account": "kinetic-runner", "image_mode": "prebuilt"}


def build_options(tmp_path, text="jax[tpu]\n", registry=REGISTRY):
    requirements = tmp_path / "requirements.txt"
    requirements.write_text(text)
    return {"namespace": "ml-team", "image_mode": "build", "registry": registry, "requirements": str(requirements)}


def image_rows(report):
    names = ("image mode", "requirements", "pods reach the package index", "Google credentials", "registry",
             "Cloud Build", "image for the requirements")
    return {check.name: check for check in report.checks if check.name in names}


def test_prebuilt_says_the_index_needs_a_pod_and_gives_the_command_that_tries(server):
    report = doctor("cpu", backend_options=PREBUILT, api=server.api())
    rows = image_rows(report)
    assert list(rows) == ["image mode", "pods reach the package index"]
    assert rows["image mode"].status == "ok" and rows["image mode"].detail.endswith(f"into {stock_image()}")
    index = rows["pods reach the package index"]
    assert index.status == "warn" and index.detail.startswith("not checked: the pods pip-install from PyPI")
    assert index.fix == (
        f"kubectl run kinetic-index-check -n ml-team --rm -i --restart=Never --image={stock_image()} "
        """--overrides='{"spec":{"serviceAccountName":"kinetic-runner"}}' -- python3 -m pip download --no-deps """
        "--dest /tmp/kinetic-index-check cloudpickle")
    assert report.ok  # a warning: the cluster may well reach PyPI


def test_a_requirements_line_only_this_machine_can_satisfy_fails_with_its_line(server, tmp_path):
    requirements = tmp_path / "requirements.txt"
    requirements.write_text("jax[tpu]\n-e ./my_lib\n")
    report = doctor("cpu", backend_options={**PREBUILT, "requirements": str(requirements)}, api=server.api())
    check = image_rows(report)["requirements"]
    assert check.status == "fail" and not report.ok
    assert check.detail.startswith(f"{requirements}, line 2: '-e ./my_lib' is an editable install of a directory")
    assert check.fix == f"edit {requirements} as said"
    requirements.write_text("jax[tpu]\n")
    assert image_rows(doctor("cpu", backend_options={**PREBUILT, "requirements": str(requirements)},
                             api=server.api()))["requirements"].status == "ok"


def test_a_ready_build_mode_checks_the_repository_cloud_build_and_the_image(server, tmp_path):
    double = RegistryAndCloudBuildDouble(repositories={REPOSITORY: "DOCKER"})
    report = doctor("cpu", backend_options=build_options(tmp_path), api=server.api(), google_session=double)
    rows = image_rows(report)
    assert list(rows) == ["image mode", "requirements", "registry", "Cloud Build", "image for the requirements"]
    assert all(check.status == "ok" for check in rows.values()), report.table()
    image = cloud_build.wanted_image(b"jax[tpu]\n", REGISTRY, stock_image(), host_packages("gs://"))
    assert rows["image for the requirements"].detail == (
        f"{image} is not built yet: the first cell builds it (minutes), later ones reuse it")
    assert [(verb, url) for verb, url, _ in double.calls] == [
        ("GET", f"https://artifactregistry.googleapis.com/v1/{REPOSITORY}"),
        ("GET", "https://cloudbuild.googleapis.com/v1/projects/ml-proj/locations/global/builds?pageSize=1"),
        ("POST", "https://cloudresourcemanager.googleapis.com/v1/projects/ml-proj:testIamPermissions"),
        ("GET", f"https://us-docker.pkg.dev/v2/ml-proj/kinetic/kinetic-env/manifests/{image.rsplit(':', 1)[1]}"),
    ]
    assert double.calls[2][2] == {"permissions": ["cloudbuild.builds.create", "cloudbuild.builds.get"]}
    built = RegistryAndCloudBuildDouble(repositories={REPOSITORY: "DOCKER"}, images={image})
    report = doctor("cpu", backend_options=build_options(tmp_path), api=server.api(), google_session=built)
    assert image_rows(report)["image for the requirements"].detail == f"{image} is built"


BUILD_FAILURES = {
    "no repository": (dict(), "registry",
                      "gcloud artifacts repositories create kinetic --repository-format=docker --location=us "
                      "--project=ml-proj"),
    "not a docker repository": (dict(repositories={REPOSITORY: "MAVEN"}), "registry",
                                "gcloud artifacts repositories create kinetic-docker --repository-format=docker "
                                f"--location=us --project=ml-proj and then %env KINETIC_REGISTRY={REGISTRY}-docker"),
    "Artifact Registry disabled": (dict(disabled={"artifactregistry"}), "registry",
                                   "gcloud services enable artifactregistry.googleapis.com --project=ml-proj"),
    "repository not readable": (dict(denied={"artifactregistry"}), "registry",
                                "gcloud artifacts repositories add-iam-policy-binding kinetic --location=us "
                                "--project=ml-proj --member=user:$(gcloud config get-value account) "
                                "--role=roles/artifactregistry.reader"),
    "Cloud Build disabled": (dict(repositories={REPOSITORY: "DOCKER"}, disabled={"cloudbuild"}), "Cloud Build",
                             "gcloud services enable cloudbuild.googleapis.com --project=ml-proj"),
    "Cloud Build denied": (dict(repositories={REPOSITORY: "DOCKER"}, denied={"cloudbuild"}), "Cloud Build",
                           "gcloud projects add-iam-policy-binding ml-proj --member=user:$(gcloud config get-value "
                           "account) --role=roles/cloudbuild.builds.editor"),
    "no permission to build": (dict(repositories={REPOSITORY: "DOCKER"}, permissions={"cloudbuild.builds.get"}),
                               "Cloud Build", "gcloud projects add-iam-policy-binding ml-proj --member=user:$(gcloud "
                                              "config get-value account) --role=roles/cloudbuild.builds.editor"),
}


@pytest.mark.parametrize("failure", BUILD_FAILURES)
def test_each_build_mode_failure_comes_with_its_fix(server, tmp_path, failure):
    answers, row, fix = BUILD_FAILURES[failure]
    report = doctor("cpu", backend_options=build_options(tmp_path), api=server.api(),
                    google_session=RegistryAndCloudBuildDouble(**answers))
    check = image_rows(report)[row]
    assert (check.status, check.fix) == ("fail", fix), check
    assert "\n" not in check.detail and not report.ok
    assert "image for the requirements" not in image_rows(report) or row != "registry"


def test_the_build_mode_without_a_registry_credentials_or_a_google_registry_says_what_to_do(server, tmp_path,
                                                                                         monkeypatch):
    options = build_options(tmp_path)
    missing = doctor("cpu", backend_options={**options, "registry": None}, api=server.api(),
                     google_session=RegistryAndCloudBuildDouble())
    assert image_rows(missing)["image mode"].fix == "%env KINETIC_REGISTRY=REGION-docker.pkg.dev/PROJECT_ID/kinetic"

    def no_credentials():
        raise KineticError("the build image mode needs Google credentials: run "
                           "`gcloud auth application-default login`")
    monkeypatch.setattr(readiness_image, "authorized_session", no_credentials)
    check = image_rows(doctor("cpu", backend_options=options, api=server.api()))["Google credentials"]
    assert (check.status, check.fix) == ("fail", "gcloud auth application-default login")

    gcr = doctor("cpu", backend_options=build_options(tmp_path, registry="gcr.io/ml-proj"), api=server.api(),
                 google_session=RegistryAndCloudBuildDouble())
    assert image_rows(gcr)["registry"].status == "warn"
    elsewhere = doctor("cpu", backend_options=build_options(tmp_path, registry="docker.io/me"), api=server.api(),
                       google_session=RegistryAndCloudBuildDouble())
    assert image_rows(elsewhere)["registry"].status == "fail"


def test_with_no_cluster_the_fix_is_kinetic_up_and_with_kinetics_profile_its_credentials(tmp_path, monkeypatch):
    """No kubeconfig at all: the fix makes a cluster for the accelerator asked for (keras-kinetic's `kinetic up`,
    in its spelling of the slice). A keras-kinetic profile whose cluster this machine has no credentials for: the
    doctor says which profile it follows, and the fix fetches that cluster's credentials."""
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-kubeconfig"))
    report = doctor("tpu-v5p-16", None, backend_options={"image": "img:1"})
    cluster = by_name(report)["cluster reachable"]
    assert (cluster.status, cluster.fix) == ("fail", "pip install keras-kinetic && kinetic up --project PROJECT "
                                                     "--zone ZONE --accelerator v5p-8 (or, for an existing cluster: "
                                                     "gcloud container clusters get-credentials CLUSTER --location "
                                                     "LOCATION)")  # keras-kinetic counts v5p in chips
    (tmp_path / "profiles.json").write_text(json.dumps({"current": "dev", "profiles": {"dev": {
        "project": "ml-proj", "zone": "us-east5-a", "cluster": "kinetic-cluster", "namespace": "default"}}}))
    monkeypatch.setenv("KINETIC_PROFILES_FILE", str(tmp_path / "profiles.json"))
    report = doctor("tpu-v5p-16", None, backend_options={"image": "img:1"})
    checks = by_name(report)
    assert checks["keras-kinetic profile"].detail == ("keras-kinetic profile dev: cluster kinetic-cluster in us-east5-a, "
                                                      "project ml-proj, namespace default")
    assert checks["cluster reachable"].fix == ("gcloud container clusters get-credentials kinetic-cluster --zone "
                                               "us-east5-a --project ml-proj")
