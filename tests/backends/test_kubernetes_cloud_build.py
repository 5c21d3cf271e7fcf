"""The build image mode against ``RegistryAndCloudBuildDouble`` (``google_api_double.py``): a double of the HTTP
calls, not Google's APIs.

Cloud Build and Artifact Registry cannot be reached here, so these tests check
what kinetic_nb sends (URLs, the build request, the polling of the build's
operation) and how it reads the answers, against a double of the
``AuthorizedSession`` the module calls. Whether Google's services accept that
request is not tested here (docs/gke.md says so).
"""

from __future__ import annotations

import base64

import pytest

from kinetic_nb.backends.kubernetes import cloud_build
from kinetic_nb.backends.kubernetes.backend import KubernetesBackend
from kinetic_nb.backends.kubernetes.settings import KubernetesSettings
from kinetic_nb.errors import KineticError

from .google_api_double import RegistryAndCloudBuildDouble
from .test_kubernetes_manifests import job_plan

REGISTRY = "us-docker.pkg.dev/my-project/kinetic"
PACKAGES = ["cloudpickle>=2.2", "google-cloud-storage>=3.2"]


def ensure(double, requirements=b"jax[tpu]\n", **options):
    return cloud_build.ensure_image(requirements, registry=REGISTRY, base_image="python:3.11-slim",
                                    packages=PACKAGES, session=double, notify=lambda line: None,
                                    sleep=lambda seconds: None, **options)


def test_an_image_the_registry_has_is_not_built_again():
    tag = cloud_build.image_tag(b"jax[tpu]\n", "python:3.11-slim", PACKAGES)
    double = RegistryAndCloudBuildDouble(images={f"{REGISTRY}/kinetic-env:{tag}"})
    assert ensure(double) == f"{REGISTRY}/kinetic-env:{tag}"
    [(verb, url, headers)] = double.calls
    assert (verb, url) == ("GET", f"https://us-docker.pkg.dev/v2/my-project/kinetic/kinetic-env/manifests/{tag}")
    assert "application/vnd.oci.image.index.v1+json" in headers["Accept"]


def test_a_missing_image_is_built_by_cloud_build_in_the_registrys_project_and_region():
    double = RegistryAndCloudBuildDouble(polls=3)
    image = ensure(double)
    posts = [call for call in double.calls if call[0] == "POST"]
    [(_, url, request)] = posts
    assert url == "https://cloudbuild.googleapis.com/v1/projects/my-project/locations/global/builds"
    assert request["images"] == [image]
    script = request["steps"][0]["args"][1]
    files = {line.split("> ")[1]: base64.b64decode(line.split()[1]) for line in script.splitlines()
             if "base64 -d" in line}
    assert files["requirements.txt"] == b"jax[tpu]\n"
    assert files["Dockerfile"].decode().startswith("FROM python:3.11-slim\n")
    assert "'cloudpickle>=2.2' 'google-cloud-storage>=3.2' -r /kinetic/requirements.txt" in files["Dockerfile"].decode()
    assert script.rstrip().endswith(f"docker build -t '{image}' .")
    assert [call[1] for call in double.calls if call[0] == "GET"][1:] == [
        "https://cloudbuild.googleapis.com/v1/operations/build-1"] * 3


def test_a_regional_repository_builds_in_its_region():
    double = RegistryAndCloudBuildDouble()
    cloud_build.ensure_image(b"jax\n", registry="europe-west4-docker.pkg.dev/p/r", base_image="python:3.11-slim",
                             packages=[], session=double, notify=lambda line: None, sleep=lambda seconds: None)
    assert [url for verb, url, _ in double.calls if verb == "POST"] == [
        "https://cloudbuild.googleapis.com/v1/projects/p/locations/europe-west4/builds"]


def test_the_tag_changes_with_the_requirements_and_the_python_only():
    tag = cloud_build.image_tag(b"jax\n", "python:3.11-slim", PACKAGES)
    assert tag == cloud_build.image_tag(b"jax\n", "python:3.11-slim", list(reversed(PACKAGES)))
    assert tag != cloud_build.image_tag(b"jax==0.4.30\n", "python:3.11-slim", PACKAGES)
    assert tag != cloud_build.image_tag(b"jax\n", "python:3.12-slim", PACKAGES)


def test_a_failed_build_is_one_line_with_its_log():
    with pytest.raises(KineticError, match=r"failed: step 0 exited 1; its log: https://console/logs/1$") as caught:
        ensure(RegistryAndCloudBuildDouble(outcome="FAILURE"))
    assert "\n" not in str(caught.value)


def test_a_registry_that_is_not_googles_is_refused():
    with pytest.raises(ValueError, match="is not an Artifact Registry repository"):
        cloud_build.ensure_image(b"", registry="docker.io/me", base_image="python:3.11-slim", packages=[],
                                 session=RegistryAndCloudBuildDouble())


def test_the_backend_builds_in_preflight_and_its_pods_use_the_built_image(tmp_path, monkeypatch):
    requirements = tmp_path / "requirements.txt"
    requirements.write_bytes(b"jax[tpu]\n")
    double = RegistryAndCloudBuildDouble()
    monkeypatch.setattr(cloud_build, "authorized_session", lambda: double)
    monkeypatch.setattr(cloud_build, "POLL_INTERVAL_S", 0.0)  # the double's build is done at its second look
    settings = KubernetesSettings(image_mode="build", requirements=str(requirements), registry=REGISTRY)
    backend = KubernetesBackend(settings)
    plan = job_plan("tpu-v5e-16")
    backend.preflight(plan)
    root, lws = backend.manifests(type("S", (), {"uri": "gs://b/jobs/x"})(), plan, "uid-1")
    image = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["image"]
    assert image.startswith(f"{REGISTRY}/kinetic-env:") and root["spec"]["template"]["spec"]["containers"][0]["image"] == image
    # The pods still install the notebook's kinetic_nb first (not baked in: a new kinetic_nb never rebuilds).
    assert lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["command"][0] == "python3"


def test_the_build_mode_needs_a_registry_and_requirements():
    with pytest.raises(ValueError, match="needs a registry"):
        KubernetesSettings(image_mode="build", requirements="r.txt").require_environment()
    with pytest.raises(ValueError, match="builds an image from --requirements FILE"):
        KubernetesSettings(image_mode="build", registry=REGISTRY).require_environment()
