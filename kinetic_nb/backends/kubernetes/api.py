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
    """The three API groups the backend calls (``CoreV1Api``, ``BatchV1Api``, ``CustomObjectsApi``), and which
    cluster they talk to, as a cell's notice names it (``source``).

    Tests pass a double with the same methods; :func:`connect` builds the real ones.
    """

    core: Any
    batch: Any
    custom: Any
    source: str = ""


def connect(settings: KubernetesSettings) -> KubernetesApi:
    """API clients for the cluster a user means: the kubeconfig's context (``settings.context``, else the
    current one) wins; the in-cluster config (this pod's service account) only where there is no kubeconfig
    context, so a notebook in one cluster's pod can still target another through its kubeconfig.

    Raises
    ------
    KineticError
        One line: the ``k8s`` extra is missing, or there are no credentials.
    """
    try:
        from kubernetes import client, config
    except ImportError as error:
        raise KineticError("the kubernetes backend needs the official client: "
                           "pip install 'kubernetes>=30'") from error
    # KUBECONFIG as it is now (the client reads it once, at its import; a notebook may set it later).
    config_file = os.environ.get("KUBECONFIG") or None
    try:
        context = settings.context or _current_context(config, config_file)
        if context is not None or not os.environ.get("KUBERNETES_SERVICE_HOST"):
            api_client = config.new_client_from_config(config_file=config_file, context=context)
            source = f"kubeconfig context {context}"
        else:
            configuration = client.Configuration()
            config.load_incluster_config(client_configuration=configuration)
            api_client = client.ApiClient(configuration)
            source = "in-cluster config (this pod's service account)"
    except (config.ConfigException, OSError) as error:
        raise KineticError(f"no Kubernetes credentials ({error}); run `gcloud container clusters "
                           "get-credentials CLUSTER` or set KUBECONFIG") from error
    return KubernetesApi(core=client.CoreV1Api(api_client), batch=client.BatchV1Api(api_client),
                         custom=client.CustomObjectsApi(api_client), source=source)


def _current_context(config: Any, config_file: str | None) -> str | None:
    """The kubeconfig's current context, or None where there is no kubeconfig or it names none."""
    try:
        _, current = config.list_kube_config_contexts(config_file=config_file)
    except (config.ConfigException, OSError):
        return None
    return (current or {}).get("name") or None


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
