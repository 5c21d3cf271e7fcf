"""The build image mode: an image with the user's requirements, made by Cloud Build once per requirements.

The image is ``{registry}/kinetic-env:{tag}``, where the tag is a hash of what
goes into it: the base image (the notebook's Python), the requirements file's
bytes and the pods' own packages (:func:`~kinetic_nb.backends.host_environment.host_packages`).
kinetic_nb itself is not in it: each pod installs the notebook's own wheel at
its start (seconds, ``--no-deps``), so a new kinetic_nb never rebuilds the
image. When the registry already has the tag, nothing is built.

Both calls go to Google's REST APIs through ``google-auth``'s
``AuthorizedSession`` (installed with the ``gcs`` extra), with the notebook's
Application Default Credentials: the registry's Docker v2 API (is the tag
there?) and Cloud Build's ``projects.locations.builds.create`` (a build with no
source: the Dockerfile and requirements travel in the build's one step), whose
long-running operation is polled until it ends. Tests pass a double of the
session (``tests/backends/test_kubernetes_cloud_build.py``).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import sys
import time
from collections.abc import Callable
from typing import Any

from kinetic_nb.backends import google_api
from kinetic_nb.errors import KineticError

__all__ = ["IMAGE_NAME", "authorized_session", "build_location", "build_request", "builds_url", "ensure_image",
           "image_exists", "image_reference", "image_tag", "repository_path", "wanted_image"]

#: The repository the build mode's images go to, within the user's registry.
IMAGE_NAME = "kinetic-env"
CLOUD_BUILD_API = "https://cloudbuild.googleapis.com/v1"
#: Where the doctor looks the registry's repository up (an Artifact Registry repository is an API resource).
ARTIFACT_REGISTRY_API = "https://artifactregistry.googleapis.com/v1"
#: Cloud Build's own Docker builder.
DOCKER_BUILDER = "gcr.io/cloud-builders/docker"
#: A build's limit: installing jax[tpu] or torch and pushing takes minutes, not hours.
BUILD_TIMEOUT_S = 3600
#: How often the build's operation is read while it runs.
POLL_INTERVAL_S = 10.0
#: Manifest media types a registry may answer with (a single image, or a multi-platform index).
MANIFEST_TYPES = ", ".join([
    "application/vnd.docker.distribution.manifest.v2+json", "application/vnd.docker.distribution.manifest.list.v2+json",
    "application/vnd.oci.image.manifest.v1+json", "application/vnd.oci.image.index.v1+json"])
_ARTIFACT_REGISTRY = re.compile(r"^(?P<region>[a-z0-9-]+)-docker\.pkg\.dev/(?P<project>[^/]+)/(?P<repository>[^/]+)$")
_CONTAINER_REGISTRY = re.compile(r"^([a-z]+\.)?gcr\.io/(?P<project>[^/]+)$")


def image_tag(requirements: bytes, base_image: str, packages: list[str]) -> str:
    """The tag of the image these inputs make: the first 16 hex digits of their hash."""
    digest = hashlib.sha256(json.dumps([base_image, sorted(packages)]).encode() + b"\0" + requirements)
    return digest.hexdigest()[:16]


def image_reference(registry: str, tag: str) -> str:
    return f"{registry.rstrip('/')}/{IMAGE_NAME}:{tag}"


def wanted_image(requirements: bytes, registry: str, base_image: str, packages: list[str]) -> str:
    """The image the build mode runs for these inputs (there or not yet)."""
    return image_reference(registry, image_tag(requirements, base_image, packages))


def build_location(registry: str) -> tuple[str, str]:
    """The project and Cloud Build location that build into ``registry``; a one-line ValueError otherwise."""
    registry = registry.rstrip("/")
    match = _ARTIFACT_REGISTRY.match(registry)
    if match:  # a regional repository builds in its region; a multi-region one (us, europe, asia) globally
        region = match["region"]
        return match["project"], region if any(character.isdigit() for character in region) else "global"
    match = _CONTAINER_REGISTRY.match(registry)
    if match:
        return match["project"], "global"
    raise ValueError(f"registry {registry!r} is not an Artifact Registry repository "
                     "(REGION-docker.pkg.dev/PROJECT/REPOSITORY) or gcr.io/PROJECT")


def builds_url(registry: str) -> str:
    """Cloud Build's ``builds`` collection in the project and location that build into ``registry``."""
    project, location = build_location(registry)
    return f"{CLOUD_BUILD_API}/projects/{project}/locations/{location}/builds"


def repository_path(registry: str) -> str | None:
    """``projects/P/locations/L/repositories/R`` of an Artifact Registry ``registry``; None for gcr.io."""
    match = _ARTIFACT_REGISTRY.match(registry.rstrip("/"))
    if match is None:
        return None
    return f"projects/{match['project']}/locations/{match['region']}/repositories/{match['repository']}"


def dockerfile(base_image: str, packages: list[str]) -> str:
    quoted = " ".join(f"'{package}'" for package in packages)
    return (f"FROM {base_image}\n"
            "COPY requirements.txt /kinetic/requirements.txt\n"
            f"RUN pip install --no-cache-dir {quoted} -r /kinetic/requirements.txt\n")


def build_request(image: str, requirements: bytes, base_image: str, packages: list[str]) -> dict[str, Any]:
    """The body of ``builds.create``: one step writes the Dockerfile and requirements and builds; Cloud
    Build pushes ``image``."""
    files = {"Dockerfile": dockerfile(base_image, packages).encode(), "requirements.txt": requirements}
    script = "set -e\n" + "".join(f"echo {base64.b64encode(data).decode()} | base64 -d > {name}\n"
                                  for name, data in files.items()) + f"docker build -t '{image}' .\n"
    return {"steps": [{"name": DOCKER_BUILDER, "entrypoint": "bash", "args": ["-c", script]}],
            "images": [image], "timeout": f"{BUILD_TIMEOUT_S}s",
            "tags": ["kinetic-nb"]}


def image_exists(session: Any, image: str) -> bool:
    """Whether the registry has ``image`` (``HOST/PATH:TAG``), from its Docker v2 API: 200 yes, 404 no."""
    name, tag = image.rsplit(":", 1)
    host, path = name.split("/", 1)
    answer = session.get(f"https://{host}/v2/{path}/manifests/{tag}", headers={"Accept": MANIFEST_TYPES})
    if answer.status_code == 200:
        return True
    if answer.status_code == 404:
        return False
    raise KineticError(f"could not look up {image} in its registry: HTTP {answer.status_code} {answer.text[:200]}")


def authorized_session() -> Any:
    """An ``AuthorizedSession`` with the notebook's Application Default Credentials, or a one-line KineticError."""
    return google_api.authorized_session("the build image mode")[0]


def ensure_image(requirements: bytes, *, registry: str, base_image: str, packages: list[str],
                 session: Any = None, notify: Callable[[str], None] | None = None,
                 sleep: Callable[[float], None] = time.sleep) -> str:
    """The image with ``requirements`` installed on ``base_image``: found in ``registry``, else built there.

    Parameters
    ----------
    requirements : bytes
        The requirements file's bytes.
    registry : str
        ``REGION-docker.pkg.dev/PROJECT/REPOSITORY`` (or ``gcr.io/PROJECT``); its project runs the build.
    base_image : str
        What the image starts from (the notebook's Python: ``python:3.11-slim``).
    packages : list of str
        The pods' own packages (cloudpickle, google-cloud-storage), installed with the requirements.
    session : optional
        An ``AuthorizedSession`` (default: one from Application Default Credentials); a test passes a double.
    notify : callable, optional
        Hears what is happening, one line at a time (default: printed to stderr).

    Raises
    ------
    KineticError
        One line: no credentials, the API's refusal, or a failed build (with its log's address).
    """
    notify = notify or (lambda line: print(line, file=sys.stderr))
    url = builds_url(registry)
    image = wanted_image(requirements, registry, base_image, packages)
    session = session if session is not None else authorized_session()
    if image_exists(session, image):
        return image
    notify(f"kinetic_nb: building {image} with Cloud Build (once for these requirements; minutes)")
    answer = session.post(url, json=build_request(image, requirements, base_image, packages))
    if answer.status_code != 200:
        raise KineticError(f"Cloud Build refused the build of {image}: HTTP {answer.status_code} "
                           f"{error_message(answer)}")
    operation = answer.json()
    while not operation.get("done"):
        sleep(POLL_INTERVAL_S)
        answer = session.get(f"{CLOUD_BUILD_API}/{operation['name']}")
        if answer.status_code != 200:
            raise KineticError(f"could not follow the build of {image}: HTTP {answer.status_code} {error_message(answer)}")
        operation = answer.json()
    build = operation.get("response") or operation.get("metadata", {}).get("build", {})
    if operation.get("error") or build.get("status") != "SUCCESS":
        why = (operation.get("error") or {}).get("message") or build.get("statusDetail") or build.get("status")
        raise KineticError(f"the Cloud Build build of {image} failed: {why}; its log: {build.get('logUrl', '?')}")
    notify(f"kinetic_nb: built {image}")
    return image


def error_message(answer: Any) -> str:
    """A Google API's own message from an error answer, else the start of its body."""
    try:
        return answer.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return answer.text[:200]
