"""Talking to a cluster: the API clients the backend and the doctor call, and the API server's error messages.

Needs the ``k8s`` extra (the official ``kubernetes`` client), imported only in
:func:`connect`, so importing the backend stays light.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from kinetic_nb.backends.kubernetes.settings import KubernetesSettings
from kinetic_nb.errors import KineticError

__all__ = ["KubernetesApi", "api_message", "connect", "missing_namespace", "status_code"]


@dataclasses.dataclass
class KubernetesApi:
    """The three API groups the backend calls (``CoreV1Api``, ``BatchV1Api``, ``CustomObjectsApi``).

    Tests pass a double with the same methods; :func:`connect` builds the real ones.
    """

    core: Any
    batch: Any
    custom: Any


def connect(settings: KubernetesSettings) -> KubernetesApi:
    """API clients from in-cluster credentials, else kubeconfig (``settings.context``).

    Raises
    ------
    KineticError
        One line: the ``k8s`` extra is missing, or there are no credentials.
    """
    try:
        from kubernetes import client, config
    except ImportError as error:
        raise KineticError("the kubernetes backend needs the official client: "
                           "pip install 'kinetic_nb[k8s]'") from error
    try:
        if os.environ.get("KUBERNETES_SERVICE_HOST") and settings.context is None:
            configuration = client.Configuration()
            config.load_incluster_config(client_configuration=configuration)
            api_client = client.ApiClient(configuration)
        else:
            api_client = config.new_client_from_config(context=settings.context)
    except (config.ConfigException, OSError) as error:
        raise KineticError(f"no Kubernetes credentials ({error}); run `gcloud container clusters "
                           "get-credentials CLUSTER` or set KUBECONFIG") from error
    return KubernetesApi(core=client.CoreV1Api(api_client), batch=client.BatchV1Api(api_client),
                         custom=client.CustomObjectsApi(api_client))


def status_code(error: BaseException) -> int | None:
    return getattr(error, "status", None)


def api_message(error: BaseException) -> str:
    """The API server's own message from an ApiException, else the error's text."""
    try:
        return json.loads(getattr(error, "body", None) or "")["message"]
    except (ValueError, KeyError, TypeError):
        reason = getattr(error, "reason", None)
        return f"{status_code(error)} {reason}" if reason else str(error).splitlines()[0]


def missing_namespace(error: BaseException) -> bool:
    """Whether a 404 is the API server's "namespace not found" (its Status names the namespace in
    ``details``), rather than a missing API, whose Status says only "could not find the requested resource"."""
    try:
        details = json.loads(getattr(error, "body", None) or "").get("details") or {}
    except (ValueError, AttributeError):
        return False
    return details.get("kind") == "namespaces"
