"""The doctor's rows for the kubernetes backend's image mode (see :mod:`kinetic_nb.backends.kubernetes.doctor`).

- every mode: which one, and that ``--requirements`` has no line only this
  machine can satisfy (:mod:`kinetic_nb.backends.requirements`);
- ``prebuilt``: whether the pods reach the package index cannot be seen from
  the notebook (the pods' network is the cluster's): a warning with the
  ``kubectl run`` command that tries it from a pod;
- ``build``: the registry's Artifact Registry repository exists and holds
  docker images, the Cloud Build API is enabled and this user may create and
  follow builds (``testIamPermissions``), and whether the image for these
  requirements is built yet. These go to Google's REST APIs through
  ``google-auth``'s ``AuthorizedSession``, as the build itself does; tests
  pass a double of it (``tests/backends/google_api_double.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kinetic_nb.accelerators import Accelerator
from kinetic_nb.backends.host_environment import host_packages, package_version
from kinetic_nb.backends.kubernetes import cloud_build
from kinetic_nb.backends.kubernetes.cloud_build import authorized_session
from kinetic_nb.backends.kubernetes.doctor_report import FAIL, OK, WARN, Check
from kinetic_nb.backends.kubernetes.image_modes import ImageMode
from kinetic_nb.backends.kubernetes.settings import KubernetesSettings
from kinetic_nb.backends.requirements import FRAMEWORK_PACKAGES, host_requirements
from kinetic_nb.errors import KineticError

__all__ = ["authorized_session", "image_checks"]

#: The Resource Manager call that says which of a project's permissions this user holds.
RESOURCE_MANAGER_API = "https://cloudresourcemanager.googleapis.com/v1"
#: What the build mode does in Cloud Build: create a build, then follow it.
BUILD_PERMISSIONS = ("cloudbuild.builds.create", "cloudbuild.builds.get")
#: The role the fix grants for them.
BUILD_ROLE = "roles/cloudbuild.builds.editor"
#: A small package on every index the pods may use: what the prebuilt mode's reachability check downloads.
INDEX_PROBE_PACKAGE = "cloudpickle"
#: Who "this user" is, in a fix command.
THIS_USER = "user:$(gcloud config get-value account)"


def image_checks(settings: KubernetesSettings, google_session: Callable[[], Any],
                 accelerator: Accelerator | None = None) -> list[Check]:
    """The image mode's rows: what it is, the requirements file, then the mode's own needs. In the custom mode
    on TPUs or GPUs, a warning that the image must bring the framework (the other modes add it)."""
    mode = settings.mode
    try:
        settings.require_environment()
    except ValueError as error:
        fix = ("%env KINETIC_REGISTRY=REGION-docker.pkg.dev/PROJECT_ID/kinetic" if mode is ImageMode.BUILD
               and not settings.registry else "%env KINETIC_REQUIREMENTS=requirements.txt"
               if mode is ImageMode.BUILD else "%env KINETIC_IMAGE_MODE=prebuilt (or %env KINETIC_IMAGE=IMAGE)")
        return [Check("image mode", FAIL, f"{mode}: {error}", fix)]
    version = package_version()
    if mode is ImageMode.CUSTOM:
        checks = [Check("image mode", OK, f"custom: {settings.image} as it is (it needs kinetic_nb {version} and "
                                          "what your cells import; each host compares versions at its start)")]
        if accelerator is not None and accelerator.kind in ("tpu", "gpu"):
            wanted = " or ".join(package for (kind, _), package in FRAMEWORK_PACKAGES.items()
                                 if kind == accelerator.kind)
            checks.append(Check("framework", WARN, f"the custom mode adds no framework: {settings.image} must have "
                                                   f"{wanted} for {accelerator.name} (not checked here)"))
        return checks
    requirements = None
    checks = [Check("image mode", OK, f"{mode}: each pod installs kinetic_nb {version} at its start"
                    + (f" into {settings.require_image()}" if mode is ImageMode.PREBUILT else ""))]
    if settings.requirements:
        try:
            requirements = host_requirements(settings.requirements)
            checks.append(Check("requirements", OK, f"{settings.requirements}: every line is for the network"))
        except ValueError as error:
            checks.append(Check("requirements", FAIL, str(error), f"edit {settings.requirements} as said"))
    if mode is ImageMode.PREBUILT:
        checks.append(_index_check(settings))
    else:
        checks += _build_checks(settings, requirements, google_session)
    return checks


def _index_check(settings: KubernetesSettings) -> Check:
    account = f" --overrides='{{\"spec\":{{\"serviceAccountName\":\"{settings.service_account}\"}}}}'" \
        if settings.service_account else ""
    return Check("pods reach the package index", WARN,
                 "not checked: the pods pip-install from PyPI (or the index your requirements name) at their "
                 "start, through the cluster's network, which the notebook does not share (a private cluster "
                 "needs Cloud NAT); this command runs a pod that tries",
                 f"kubectl run kinetic-index-check -n {settings.namespace} --rm -i --restart=Never "
                 f"--image={settings.require_image()}{account} -- python3 -m pip download --no-deps "
                 f"--dest /tmp/kinetic-index-check {INDEX_PROBE_PACKAGE}")


def _service_disabled(answer: Any) -> bool:
    """Whether a Google API's 403 says the API is not enabled in the project (rather than a missing permission)."""
    try:
        error = answer.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    reasons = {detail.get("reason") for detail in error.get("details") or () if isinstance(detail, dict)}
    return "SERVICE_DISABLED" in reasons or "has not been used in project" in str(error.get("message", ""))


def _build_checks(settings: KubernetesSettings, requirements: bytes | None,
                  google_session: Callable[[], Any]) -> list[Check]:
    registry = settings.registry or ""
    try:
        project, location = cloud_build.build_location(registry)
    except ValueError as error:
        return [Check("registry", FAIL, str(error), "%env KINETIC_REGISTRY=REGION-docker.pkg.dev/PROJECT_ID/kinetic")]
    try:
        session = google_session()
    except KineticError as error:
        missing_package = isinstance(error.__cause__, ImportError)
        return [Check("Google credentials", FAIL, str(error), "pip install 'google-cloud-storage>=3.2'" if missing_package
                      else "gcloud auth application-default login")]
    checks = [_repository_check(session, registry, project), _cloud_build_check(session, registry, project, location)]
    if requirements is not None and checks[0].status == OK:
        image = cloud_build.wanted_image(requirements, registry, settings.require_image_base(),
                                         host_packages("gs://"))
        try:
            built = cloud_build.image_exists(session, image)
        except KineticError as error:
            checks.append(Check("image for the requirements", WARN, str(error)))
        else:
            checks.append(Check("image for the requirements", OK, f"{image} is built" if built else
                                f"{image} is not built yet: the first cell builds it (minutes), later ones reuse it"))
    return checks


def _repository_check(session: Any, registry: str, project: str) -> Check:
    path = cloud_build.repository_path(registry)
    if path is None:
        return Check("registry", WARN, f"{registry} is not an Artifact Registry repository, which the doctor can "
                                       "look up: use REGION-docker.pkg.dev/PROJECT_ID/REPOSITORY")
    location, repository = path.split("/")[3], path.split("/")[5]
    create = (f"gcloud artifacts repositories create {repository} --repository-format=docker "
              f"--location={location} --project={project}")
    answer = session.get(f"{cloud_build.ARTIFACT_REGISTRY_API}/{path}")
    if answer.status_code == 200:
        kind = str(answer.json().get("format", "")).lower()
        if kind and kind != "docker":
            return Check("registry", FAIL, f"{registry} is a {kind} repository, not a docker one",
                         f"{create.replace(f'create {repository} ', f'create {repository}-docker ')} and then "
                         f"%env KINETIC_REGISTRY={registry.rstrip('/')}-docker")
        return Check("registry", OK, f"{registry} (Artifact Registry, docker)")
    if answer.status_code == 404:
        return Check("registry", FAIL, f"{registry}: project {project} has no repository {repository} in "
                                       f"{location}", create)
    if answer.status_code == 403 and _service_disabled(answer):
        return Check("registry", FAIL, f"the Artifact Registry API is not enabled in project {project}",
                     f"gcloud services enable artifactregistry.googleapis.com --project={project}")
    if answer.status_code == 403:
        return Check("registry", FAIL, f"{registry}: not allowed to read it ({cloud_build.error_message(answer)})",
                     f"gcloud artifacts repositories add-iam-policy-binding {repository} --location={location} "
                     f"--project={project} --member={THIS_USER} --role=roles/artifactregistry.reader")
    return Check("registry", WARN, f"could not look up {registry}: HTTP {answer.status_code} "
                                   f"{cloud_build.error_message(answer)}")


def _cloud_build_check(session: Any, registry: str, project: str, location: str) -> Check:
    grant = (f"gcloud projects add-iam-policy-binding {project} --member={THIS_USER} --role={BUILD_ROLE}")
    answer = session.get(f"{cloud_build.builds_url(registry)}?pageSize=1")
    if answer.status_code == 403 and _service_disabled(answer):
        return Check("Cloud Build", FAIL, f"the Cloud Build API is not enabled in project {project}",
                     f"gcloud services enable cloudbuild.googleapis.com --project={project}")
    if answer.status_code == 403:
        return Check("Cloud Build", FAIL, f"not allowed to use Cloud Build in project {project} "
                                          f"({cloud_build.error_message(answer)})", grant)
    if answer.status_code != 200:
        return Check("Cloud Build", WARN, f"could not list builds in project {project}: HTTP {answer.status_code} "
                                          f"{cloud_build.error_message(answer)}")
    answer = session.post(f"{RESOURCE_MANAGER_API}/projects/{project}:testIamPermissions",
                          json={"permissions": list(BUILD_PERMISSIONS)})
    if answer.status_code != 200:
        return Check("Cloud Build", WARN, f"the API answers, but could not ask for {', '.join(BUILD_PERMISSIONS)}: "
                                          f"HTTP {answer.status_code} {cloud_build.error_message(answer)}")
    missing = sorted(set(BUILD_PERMISSIONS) - set(answer.json().get("permissions") or ()))
    if missing:
        return Check("Cloud Build", FAIL, f"this user lacks {', '.join(missing)} in project {project}", grant)
    return Check("Cloud Build", OK, f"enabled in project {project}; this user may create builds (in {location})")
