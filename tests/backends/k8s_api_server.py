"""A local HTTP server that answers the way the Kubernetes API server does, and records every request.

The official ``kubernetes`` client talks to it over real HTTP (``Configuration.host``
pointed at it), so a test sees what the backend really sends (verb, path,
query, body) and how the client turns the answers into exceptions. It plays
only what the backend and the doctor use, as the API server documents it:

- creating a Job, Service, Secret or LeaderWorkerSet in a namespace: ``201``
  with the stored object (``metadata.uid``, ``creationTimestamp``); ``409
  AlreadyExists`` for a second object of that name; ``404`` naming the
  namespace (``details.kind: namespaces``) when the namespace does not exist;
  ``404`` with no details when the group/version is not served (no
  LeaderWorkerSet CRD installed);
- deleting one Job (``200`` with a Status; ``404`` when absent), and
  collections by label selector;
- reading a Secret, a ServiceAccount (:meth:`add`) or a namespace; listing pods
  (by label selector; :attr:`pods`, or what :attr:`pod_source` returns, as a
  kubelet double reports them), Events, nodes;
- discovery of an API group/version, ``/version``, and
  ``SelfSubjectAccessReview`` (``201``, allowed unless :attr:`denied` names the
  verb and resource).

``fail`` forces an answer for a request (``(verb, path prefix) -> (code,
reason, message)``), e.g. a 403 for creating Services. ``on_delete`` listeners
hear ``(kind, name)`` of every object deleted by name (a kubelet double's pods
go with their owner, as the garbage collector would take them), and
:meth:`counts` tells the requests by kind (verb and path). No process is started:
the server runs in a thread and stops with :meth:`close`.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import json
import re
import uuid
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from kinetic_nb.backends.kubernetes import manifests as km

from ..serving import serve_in_background

#: (group/version prefix, plural) -> kind, for the collections the backend creates in.
COLLECTIONS = {
    ("api/v1", "services"): "Service",
    ("api/v1", "secrets"): "Secret",
    ("api/v1", "serviceaccounts"): "ServiceAccount",
    ("apis/batch/v1", "jobs"): "Job",
    (f"apis/{km.LWS_GROUP}/{km.LWS_VERSION}", km.LWS_PLURAL): "LeaderWorkerSet",
}
_NAMESPACED = re.compile(r"^/(api/v1|apis/[^/]+/[^/]+)/namespaces/([^/]+)/([^/]+)(?:/([^/]+))?$")


@dataclasses.dataclass
class Request:
    """One request as the server received it."""

    verb: str
    path: str
    query: dict[str, list[str]]
    body: Any

    def one(self, name: str) -> str | None:
        values = self.query.get(name)
        return values[0] if values else None


def status(code: int, reason: str, message: str, details: dict[str, Any] | None = None) -> dict[str, Any]:
    """A ``metav1.Status`` as the API server sends it with an error."""
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "details": details or {}, "code": code}


class RecordingApiServer:
    """See the module docstring. ``url`` is what ``Configuration.host`` takes."""

    def __init__(self, *, namespaces: tuple[str, ...] = ("default", "ml-team"), lws_installed: bool = True):
        self.namespaces = set(namespaces)
        self.lws_installed = lws_installed
        self.requests: list[Request] = []
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}  # (kind, namespace, name)
        self.fail: dict[tuple[str, str], tuple[int, str, str]] = {}
        self.pods: list[dict[str, Any]] = []
        #: What a pod listing answers from (a kubelet double's ``pod_json``): :attr:`pods` unless replaced.
        self.pod_source: Any = lambda: self.pods
        self.on_delete: list[Any] = []
        self.events: list[dict[str, Any]] = []
        self.nodes: list[dict[str, Any]] = []
        #: (verb, resource) pairs a SelfSubjectAccessReview answers "not allowed" for.
        self.denied: set[tuple[str, str]] = set()
        self.version = {"major": "1", "minor": "31", "emulationMajor": "1", "emulationMinor": "31",
                        "gitVersion": "v1.31.4-gke.1256000", "gitCommit": "4a5f8b2c3d1e0f9a8b7c6d5e4f3a2b1c0d9e8f7a",
                        "gitTreeState": "clean", "buildDate": "2026-10-02T21:17:45Z", "goVersion": "go1.23.4 X:boringcrypto",
                        "compiler": "gc", "platform": "linux/amd64"}
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_request(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                parts = urlsplit(self.path)
                request = Request(self.command, parts.path, parse_qs(parts.query),
                                  json.loads(raw) if raw else None)
                server.requests.append(request)
                code, body = server.answer(request)
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_DELETE = do_PUT = do_PATCH = do_request

            def log_message(self, *args: Any) -> None:  # quiet: the requests are recorded
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = serve_in_background(self._server, "fake-apiserver")
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def api(self) -> Any:
        """The backend's :class:`~kinetic_nb.backends.kubernetes.backend.KubernetesApi` of real clients talking to this server."""
        from kubernetes import client

        from kinetic_nb.backends.kubernetes.api import KubernetesApi

        configuration = client.Configuration()
        configuration.host = self.url
        api_client = client.ApiClient(configuration)
        return KubernetesApi(core=client.CoreV1Api(api_client), batch=client.BatchV1Api(api_client),
                             custom=client.CustomObjectsApi(api_client))

    def add(self, manifest: dict[str, Any]) -> None:
        """Store ``manifest`` as if it had been created (a ServiceAccount, say)."""
        kind, metadata = manifest["kind"], manifest["metadata"]
        self.objects[kind, metadata["namespace"], metadata["name"]] = copy.deepcopy(manifest)

    def sent(self, verb: str | None = None) -> list[Request]:
        return [request for request in self.requests if verb is None or request.verb == verb]

    def counts(self, start: int = 0, end: int | None = None) -> Counter[tuple[str, str]]:
        """The requests ``start`` to ``end`` (positions in :attr:`requests`) by kind: ``(verb, path)``, query left
        out, so one listing of 64 pods is one ``("GET", ".../pods")`` and a read of each pod is 64 kinds."""
        return Counter((request.verb, request.path) for request in self.requests[start:end])

    def secret_value(self, name: str, key: str) -> str:
        """What a ``secretKeyRef`` resolves to, for a kubelet double (``KeyError`` for a missing Secret or key)."""
        [secret] = [body for (kind, _, stored), body in self.objects.items() if kind == "Secret" and stored == name]
        return secret["stringData"][key]

    # -- answers ----------------------------------------------------------------------------

    def answer(self, request: Request) -> tuple[int, Any]:
        for (verb, prefix), (code, reason, message) in self.fail.items():
            if request.verb == verb and request.path.startswith(prefix):
                return code, status(code, reason, message)
        path = request.path
        if path.rstrip("/") == "/version":
            return 200, self.version
        if path == "/api/v1/nodes":
            return 200, self._list(request, "NodeList", self.nodes)
        if path.startswith("/api/v1/namespaces/") and path.count("/") == 4 and request.verb == "GET":
            namespace = path.rsplit("/", 1)[1]
            if namespace not in self.namespaces:
                return 404, status(404, "NotFound", f'namespaces "{namespace}" not found',
                                   {"name": namespace, "kind": "namespaces"})
            return 200, {"kind": "Namespace", "apiVersion": "v1", "metadata": {"name": namespace},
                         "status": {"phase": "Active"}}
        if path == f"/apis/{km.LWS_GROUP}/{km.LWS_VERSION}":
            return self._discovery()
        if path == "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews" and request.verb == "POST":
            return self._access_review(request.body)
        match = _NAMESPACED.match(path)
        if not match:
            return 404, status(404, "NotFound", "the server could not find the requested resource")
        group_version, namespace, plural, name = match.groups()
        if group_version.startswith(f"apis/{km.LWS_GROUP}/") and not self.lws_installed:
            return 404, status(404, "NotFound", "the server could not find the requested resource")
        if plural == "pods" and request.verb == "GET":
            return 200, self._list(request, "PodList", [pod for pod in self.pod_source()
                                                        if pod["metadata"]["namespace"] == namespace])
        if plural == "events" and request.verb == "GET":
            return 200, self._list(request, "EventList", [event for event in self.events
                                                          if event["metadata"]["namespace"] == namespace])
        kind = COLLECTIONS.get((group_version, plural))
        if kind is None:
            return 404, status(404, "NotFound", "the server could not find the requested resource")
        if namespace not in self.namespaces:
            return 404, status(404, "NotFound", f'namespaces "{namespace}" not found',
                               {"name": namespace, "kind": "namespaces"})
        if request.verb == "POST" and name is None:
            return self._create(kind, namespace, plural, request.body)
        if request.verb == "GET" and name is not None:
            stored = self.objects.get((kind, namespace, name))
            if stored is None:
                return 404, status(404, "NotFound", f'{plural} "{name}" not found', {"name": name, "kind": plural})
            return 200, self._as_read(stored)
        if request.verb == "DELETE":
            return self._delete(kind, namespace, plural, name, request)
        return 405, status(405, "MethodNotAllowed", "the server does not allow this method on the requested resource")

    def _list(self, request: Request, kind: str, items: list[dict[str, Any]]) -> dict[str, Any]:
        selector = request.one("labelSelector")
        if selector:
            wanted = dict(part.split("=", 1) for part in selector.split(","))
            items = [item for item in items
                     if all((item["metadata"].get("labels") or {}).get(key) == value for key, value in wanted.items())]
        field = request.one("fieldSelector")
        if field:
            key, value = field.split("=", 1)
            assert key == "involvedObject.kind", key
            items = [item for item in items if item["involvedObject"]["kind"] == value]
        return {"kind": kind, "apiVersion": "v1", "metadata": {"resourceVersion": "1"}, "items": copy.deepcopy(items)}

    def _create(self, kind: str, namespace: str, plural: str, body: dict[str, Any]) -> tuple[int, Any]:
        name = body["metadata"]["name"]
        if (kind, namespace, name) in self.objects:
            return 409, status(409, "AlreadyExists", f'{plural} "{name}" already exists',
                               {"name": name, "kind": plural})
        stored = copy.deepcopy(body)
        stored["metadata"].update(namespace=namespace, uid=str(uuid.uuid4()), resourceVersion="1",
                                  creationTimestamp=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
        self.objects[kind, namespace, name] = stored
        return 201, self._as_read(stored)

    @staticmethod
    def _as_read(stored: dict[str, Any]) -> dict[str, Any]:
        """What a read returns: a Secret's ``stringData`` folded into base64 ``data``, as the server stores it."""
        import base64

        answer = copy.deepcopy(stored)
        if answer.get("kind") == "Secret" and "stringData" in answer:
            answer["data"] = {key: base64.b64encode(value.encode()).decode()
                              for key, value in answer.pop("stringData").items()}
        return answer

    def _delete(self, kind: str, namespace: str, plural: str, name: str | None, request: Request) -> tuple[int, Any]:
        if name is None:  # a collection, by label selector
            selector = dict(part.split("=", 1) for part in (request.one("labelSelector") or "").split(",") if part)
            for key in [key for key, body in self.objects.items() if key[0] == kind and key[1] == namespace
                        and all(body["metadata"]["labels"].get(k) == v for k, v in selector.items())]:
                del self.objects[key]
            return 200, {"kind": f"{kind}List", "apiVersion": "v1", "metadata": {}, "items": []}
        if (kind, namespace, name) not in self.objects:
            return 404, status(404, "NotFound", f'{plural} "{name}" not found', {"name": name, "kind": plural})
        del self.objects[kind, namespace, name]
        for listener in self.on_delete:
            listener(kind, name)
        return 200, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                     "details": {"name": name, "kind": plural}}

    def _discovery(self) -> tuple[int, Any]:
        if not self.lws_installed:
            return 404, status(404, "NotFound", "the server could not find the requested resource")
        return 200, {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": f"{km.LWS_GROUP}/{km.LWS_VERSION}",
                     "resources": [{"name": km.LWS_PLURAL, "singularName": "leaderworkerset", "namespaced": True,
                                    "kind": "LeaderWorkerSet", "verbs": ["create", "delete", "deletecollection",
                                                                         "get", "list", "patch", "update", "watch"],
                                    "shortNames": ["lws"]}]}

    def _access_review(self, body: dict[str, Any]) -> tuple[int, Any]:
        attributes = body["spec"]["resourceAttributes"]
        allowed = (attributes["verb"], attributes["resource"]) not in self.denied
        answer = copy.deepcopy(body)
        answer["metadata"] = {"creationTimestamp": None}
        answer["status"] = {"allowed": allowed} if allowed else {
            "allowed": False, "reason": "no RBAC policy matched"}
        return 201, answer
