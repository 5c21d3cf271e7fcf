"""Stand-ins for the parts of a Kubernetes cluster the kubernetes backend relies on.

No real API server, controller or kubelet can run here (no cluster, no
network), so these small doubles play their documented parts, and nothing more:

- the LeaderWorkerSet controller and its pod webhook: the pods a
  LeaderWorkerSet becomes (names, labels, annotations, hostname, subdomain)
  and the variables the webhook puts in front of each container's env
  (``LWS_LEADER_ADDRESS``, ``LWS_GROUP_SIZE``, ``LWS_WORKER_INDEX``; the TPU
  variables unless the container already has ``TPU_WORKER_ID``), following
  ``pkg/utils/pod/pod_utils.go`` and ``pkg/utils/accelerators/tpu.go`` of
  kubernetes-sigs/lws;
- the Job controller: an Indexed Job's pods (hostname ``{job}-{i}``, the
  completion-index annotation and label, ``JOB_COMPLETION_INDEX`` added to the
  env when missing); the root Job's pod is not played (its watcher is the host
  agent's ``--watch`` mode, tested with the agent);
- the garbage collector: deleting an object with ``Background`` or
  ``Foreground`` propagation deletes its dependents (the objects whose
  ``ownerReferences`` name its uid, kind and name), and theirs, unless a
  dependent still has another owner; ``Orphan`` only removes the references.
  A delete without a policy uses the API's default: ``Orphan`` for a
  ``batch/v1`` Job (kept for compatibility; ``kubectl`` asks for background),
  ``Background`` for everything else. An object created with owners that are
  all gone (or that a reference names wrongly: another uid, kind or name) is
  collected at once, as the collector would do shortly after. Here every
  deletion completes at once, so foreground and background differ only in
  what a real cluster shows meanwhile (a foreground owner stays, terminating,
  until its blocking dependents are gone); the GC's part for pods, deleted
  with their LeaderWorkerSet or Job, is :meth:`FakeKubelet.collect_with`;
- the kubelet: a container's environment resolved the way the kubelet does it
  (in order; ``valueFrom.fieldRef`` from the pod; ``$(VAR)`` expanded against
  the variables before it, ``$$`` to ``$``, an undefined reference left as it
  is) and its command and args expanded against that environment; a failed
  container's last log lines as its termination message under
  ``FallbackToLogsOnError``;
- :class:`FakeKubernetes`: the three API groups the backend calls, recording
  what was created (with a uid, as the API server answers) and deleted, and
  returning pods that a test scripts; creating a LeaderWorkerSet also creates
  the headless Service its controller makes (named after it, owned by it);
- :class:`FakeKubelet`: runs each host pod's real container command (the
  real host agent, which runs the real runner) as a local process with the
  pod's resolved environment, and reports the pods' statuses as the API would.
"""

from __future__ import annotations

import base64
import copy
import datetime
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any

from kinetic_nb.backends.kubernetes import manifests as km
from kinetic_nb.backends.kubernetes import root as k8s_root

LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
LWS_GROUP_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/group-index"
LWS_SIZE_ANNOTATION = "leaderworkerset.sigs.k8s.io/size"
LWS_LEADER_REQUESTS_TPUS = "leaderworkerset.sigs.k8s.io/leader-requests-tpus"
JOB_NAME_LABEL = "batch.kubernetes.io/job-name"


#: The image's kinetic_nb is the one under test (a worktree's, not whichever one the interpreter installs).
IMAGE_PYTHONPATH = os.path.dirname(os.path.dirname(os.path.abspath(km.__file__)))
#: The kubelet's cut of a log used as a termination message (``FallbackToLogsOnError``): 80 lines, 2048 bytes.
FALLBACK_LOG_LINES = 80
FALLBACK_LOG_BYTES = 2048


def now_rfc3339(offset_s: float = 0.0) -> str:
    moment = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=offset_s)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


# -- the kubelet's expansion and environment -------------------------------------------


def expand(text: str, defined: dict[str, str]) -> str:
    """The kubelet's ``$(VAR)`` expansion (k8s third_party/forked/golang/expansion)."""
    out, cursor = [], 0
    while cursor < len(text):
        char = text[cursor]
        if char == "$" and cursor + 1 < len(text):
            following = text[cursor + 1]
            if following == "$":
                out.append("$")
                cursor += 2
                continue
            if following == "(":
                closing = text.find(")", cursor + 2)
                if closing != -1:
                    name = text[cursor + 2:closing]
                    out.append(defined.get(name, f"$({name})"))
                    cursor = closing + 1
                    continue
                out.append("$(")
                cursor += 2
                continue
            out.append("$" + following)
            cursor += 2
            continue
        out.append(char)
        cursor += 1
    return "".join(out)


_SUBSCRIPT = re.compile(r"^metadata\.(labels|annotations)\['([^']+)'\]$")


def field_value(pod: dict[str, Any], path: str) -> str:
    """What the downward API gives for ``fieldRef.fieldPath``."""
    match = _SUBSCRIPT.match(path)
    if match:
        values = pod["metadata"].get(match.group(1)) or {}
        if match.group(2) not in values:
            raise KeyError(f"{path}: the pod has no such {match.group(1)[:-1]}")
        return values[match.group(2)]
    simple = {
        "metadata.name": pod["metadata"]["name"],
        "metadata.namespace": pod["metadata"]["namespace"],
        "spec.nodeName": pod["spec"].get("nodeName", "node-a"),
        "spec.serviceAccountName": pod["spec"].get("serviceAccountName", "default"),
    }
    return simple[path]


def container_environment(pod: dict[str, Any], container: dict[str, Any] | None = None, *,
                          secrets: Any = None) -> dict[str, str]:
    """The container's environment as the kubelet resolves it (enableServiceLinks: false: no Service variables).

    ``secrets(name, key)`` gives a Secret's value for ``secretKeyRef`` (the kubelet
    refuses to start a container whose Secret or key is missing: ``KeyError`` here).
    """
    container = container or pod["spec"]["containers"][0]
    assert pod["spec"].get("enableServiceLinks") is False
    resolved: dict[str, str] = {}
    for entry in container.get("env", []):
        source = entry.get("valueFrom", {})
        if "secretKeyRef" in source:
            if secrets is None:
                raise KeyError(f"{entry['name']}: no Secret store given to resolve secretKeyRef")
            resolved[entry["name"]] = secrets(source["secretKeyRef"]["name"], source["secretKeyRef"]["key"])
        elif "fieldRef" in source:
            resolved[entry["name"]] = field_value(pod, source["fieldRef"]["fieldPath"])
        else:
            resolved[entry["name"]] = expand(entry.get("value", ""), resolved)
    return resolved


def secret_files(pod: dict[str, Any], container: dict[str, Any] | None = None, *,
                 secrets: Any) -> dict[str, str]:
    """The files the kubelet puts in the container from Secret volumes: their paths in the container and texts.

    ``secrets(name, key)`` gives each item's value (``KeyError`` for a missing
    Secret or key: the kubelet refuses to start such a container).
    """
    container = container or pod["spec"]["containers"][0]
    volumes = {volume["name"]: volume for volume in pod["spec"].get("volumes", [])}
    files: dict[str, str] = {}
    for mount in container.get("volumeMounts", []):
        source = volumes[mount["name"]].get("secret")  # KeyError: a mount of no volume, which the API refuses
        if source is None:
            continue
        assert mount.get("readOnly") is True, mount  # a Secret is never written through its mount
        for item in source["items"]:  # only what is named: the -e values stay out of the key's directory
            files[f"{mount['mountPath']}/{item['path']}"] = secrets(source["secretName"], item["key"])
    return files


def container_command(pod: dict[str, Any], environment: dict[str, str]) -> list[str]:
    container = pod["spec"]["containers"][0]
    return [expand(word, environment) for word in [*container.get("command", []), *container.get("args", [])]]


# -- the controllers ---------------------------------------------------------------------


def _requests_tpus(container: dict[str, Any]) -> bool:
    resources = container.get("resources", {})
    return any(int(part.get(km.TPU_RESOURCE, 0)) for part in (resources.get("limits", {}), resources.get("requests", {})))


def _prepend_env(container: dict[str, Any], first: list[dict[str, Any]]) -> None:
    """LWS's addEnvVarsIfNotExists: its variables first, then the container's own that it did not define."""
    names = {entry["name"] for entry in first}
    container["env"] = first + [entry for entry in container.get("env", []) if entry["name"] not in names]


def leader_worker_set_pods(lws: dict[str, Any]) -> list[dict[str, Any]]:
    """The pods of group 0 of ``lws``, as its controller and webhook make them (leader first)."""
    name, namespace = lws["metadata"]["name"], lws["metadata"]["namespace"]
    template = lws["spec"]["leaderWorkerTemplate"]
    size = template["size"]
    leader_tpus = _requests_tpus(template["leaderTemplate"]["spec"]["containers"][0])
    pods = []
    for index in range(size):
        source = template["leaderTemplate"] if index == 0 else template["workerTemplate"]
        pod = {"apiVersion": "v1", "kind": "Pod", **copy.deepcopy(source)}
        pod_name = f"{name}-0" if index == 0 else f"{name}-0-{index}"
        metadata = pod["metadata"]
        metadata.update(name=pod_name, namespace=namespace)
        metadata["labels"] = {**metadata.get("labels", {}), LWS_NAME_LABEL: name, LWS_GROUP_INDEX_LABEL: "0",
                              km.LWS_WORKER_INDEX_LABEL: str(index)}
        metadata["annotations"] = {**metadata.get("annotations", {}), LWS_SIZE_ANNOTATION: str(size)}
        if leader_tpus:
            metadata["annotations"][LWS_LEADER_REQUESTS_TPUS] = "true"
        pod["spec"].update(hostname=pod_name, subdomain=name)  # the StatefulSets' serviceName is the set's name
        for container in pod["spec"]["containers"]:
            _prepend_env(container, [
                {"name": "LWS_LEADER_ADDRESS", "value": f"{name}-0.{name}.{namespace}"},
                {"name": "LWS_GROUP_SIZE", "value": str(size)},
                {"name": "LWS_WORKER_INDEX", "value": str(index)},
            ])
            names = {entry["name"] for entry in container["env"]}
            if _requests_tpus(container) and not names & {"TPU_WORKER_HOSTNAMES", "TPU_WORKER_ID"}:
                hostnames = [f"{name}-0.{name}"] + [f"{name}-0-{i}.{name}" for i in range(1, size)]
                container["env"] += [{"name": "TPU_WORKER_HOSTNAMES", "value": ",".join(hostnames)},
                                     {"name": "TPU_WORKER_ID", "value": str(index)},
                                     {"name": "TPU_NAME", "value": pod_name}]
        pods.append(pod)
    return pods


def indexed_job_pods(job: dict[str, Any]) -> list[dict[str, Any]]:
    """The pods of an Indexed Job, as the Job controller makes them."""
    name, namespace = job["metadata"]["name"], job["metadata"]["namespace"]
    assert job["spec"]["completionMode"] == "Indexed"
    pods = []
    for index in range(job["spec"]["completions"]):
        pod = {"apiVersion": "v1", "kind": "Pod", **copy.deepcopy(job["spec"]["template"])}
        metadata = pod["metadata"]
        metadata.update(name=f"{name}-{index}-x7k2p", namespace=namespace)
        metadata["labels"] = {**metadata.get("labels", {}), JOB_NAME_LABEL: name, "job-name": name,
                              km.JOB_COMPLETION_INDEX_ANNOTATION: str(index)}
        metadata["annotations"] = {**metadata.get("annotations", {}), km.JOB_COMPLETION_INDEX_ANNOTATION: str(index)}
        pod["spec"]["hostname"] = f"{name}-{index}"
        for container in pod["spec"]["containers"]:
            if not any(entry["name"] == "JOB_COMPLETION_INDEX" for entry in container.get("env", [])):
                container.setdefault("env", []).append({"name": "JOB_COMPLETION_INDEX", "valueFrom": {"fieldRef": {
                    "fieldPath": f"metadata.annotations['{km.JOB_COMPLETION_INDEX_ANNOTATION}']"}}})
        pods.append(pod)
    return pods


def is_root(manifest: dict[str, Any]) -> bool:
    return manifest["metadata"].get("labels", {}).get(km.ROLE_LABEL) == k8s_root.ROOT_ROLE


def workload(manifests: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The LeaderWorkerSet or Indexed Job among the backend's objects (not the root Job)."""
    for manifest in manifests:
        if manifest["kind"] in ("LeaderWorkerSet", "Job") and not is_root(manifest):
            return manifest
    raise AssertionError("no workload among the manifests")


def pods_for(manifests: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The host pods the cluster's controllers would make from the backend's objects, host 0 first."""
    found = workload(manifests)
    return leader_worker_set_pods(found) if found["kind"] == "LeaderWorkerSet" else indexed_job_pods(found)


def dns_name(pod: dict[str, Any]) -> str | None:
    """The pod's name in cluster DNS (``hostname.subdomain.namespace``), when it has one."""
    spec = pod["spec"]
    if spec.get("hostname") and spec.get("subdomain"):
        return f"{spec['hostname']}.{spec['subdomain']}.{pod['metadata']['namespace']}"
    return None


# -- the API -------------------------------------------------------------------------------


def api_exception(status: int, reason: str, message: str, details: dict[str, Any] | None = None) -> Exception:
    """An ``ApiException`` whose body is the API server's ``Status`` (``details`` names the object, when it does)."""
    from kubernetes.client import ApiException

    error = ApiException(status=status, reason=reason)
    error.body = json.dumps({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                             "message": message, "reason": reason.replace(" ", ""), "details": details or {},
                             "code": status})
    return error


def _matches(labels: dict[str, str], selector: str) -> bool:
    key, _, value = selector.partition("=")
    return labels.get(key) == value


def _owner_uids(body: dict[str, Any]) -> set[str]:
    return {reference["uid"] for reference in body["metadata"].get("ownerReferences") or []}


def _leader_worker_set_service(lws: dict[str, Any]) -> dict[str, Any]:
    """The headless Service the LeaderWorkerSet controller creates for a set (subdomainPolicy Shared)."""
    name = lws["metadata"]["name"]
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": lws["metadata"]["namespace"],
                         "ownerReferences": [{"apiVersion": lws["apiVersion"], "kind": lws["kind"], "name": name,
                                              "uid": lws["metadata"]["uid"], "controller": True,
                                              "blockOwnerDeletion": True}]},
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                     "selector": {LWS_NAME_LABEL: name}}}


def to_client_object(data: dict[str, Any], model: str) -> Any:
    """A real client model object (``V1Job``, ``V1PodList``, ...) from the API's JSON."""
    from kubernetes import client

    if hasattr(getattr(client, model), "from_dict"):
        return getattr(client, model).from_dict(data)
    return client.ApiClient()._ApiClient__deserialize(data, model)  # older generated clients


def to_client_pod_list(pods: list[dict[str, Any]]) -> Any:
    """A real ``V1PodList`` of ``V1Pod`` objects, from pods as JSON."""
    return to_client_object({"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": pods}, "V1PodList")


#: What a delete without ``propagationPolicy`` does, by kind: batch/v1 Jobs orphan their pods by default.
DEFAULT_PROPAGATION = {"Job": "Orphan"}
#: The client model a create of each core kind returns (custom objects come back as dicts).
CLIENT_MODELS = {"Job": "V1Job", "Service": "V1Service"}


class FakeKubernetes:
    """A test double of ``CoreV1Api``, ``BatchV1Api`` and ``CustomObjectsApi`` as the backend calls them.

    No real API server can run here. It stores created objects by (kind,
    name) with a new ``metadata.uid`` and answers a create with the stored
    object (with ``client_objects=True`` a Job or Service comes back as the
    client's ``V1Job`` or ``V1Service``, as the real client returns them),
    refuses a second object of the same name (409), deletes by name (404 when
    there is none) or by label selector, collects dependents as the garbage
    collector does (see the module docstring), and lists the pods
    :attr:`pod_source` returns (plain dicts, or with ``client_objects=True``
    real ``V1Pod`` objects) and the Events :attr:`event_source` returns. ``fail`` maps a kind to an exception its create
    raises; ``on_delete`` listeners hear ``(kind, name)`` of every object
    deleted, the collected ones included.
    """

    def __init__(self, *, client_objects: bool = False):
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.fail: dict[str, Exception] = {}
        self.pod_source: Any = list  # a callable returning the pods as JSON
        self.event_source: Any = list  # a callable returning the namespace's Events as JSON
        self.client_objects = client_objects
        self.on_delete: list[Any] = []
        self.core = SimpleNamespace(create_namespaced_service=self._creator("Service"),
                                    create_namespaced_secret=self._creator("Secret"),
                                    read_namespaced_secret=self._read_secret,
                                    list_namespaced_pod=self._list_pods,
                                    list_namespaced_event=self._list_events,
                                    delete_collection_namespaced_service=self._deleter("Service"))
        self.batch = SimpleNamespace(create_namespaced_job=self._creator("Job"),
                                     delete_namespaced_job=self._delete_job,
                                     delete_collection_namespaced_job=self._deleter("Job"))
        self.custom = SimpleNamespace(create_namespaced_custom_object=self._create_custom,
                                      delete_collection_namespaced_custom_object=self._delete_custom)

    def secret_value(self, name: str, key: str) -> str:
        """What a ``secretKeyRef`` resolves to (``KeyError`` for a missing Secret or key, as the kubelet refuses)."""
        return self.objects["Secret", name]["stringData"][key]

    def _read_secret(self, name: str, namespace: str, **options: Any) -> dict[str, Any]:
        """A Secret as the API returns it: its ``stringData`` folded into base64 ``data``; 404 when absent."""
        self.calls.append(("read Secret", {"namespace": namespace, "name": name, **options}))
        stored = self.objects.get(("Secret", name))
        if stored is None:
            raise api_exception(404, "Not Found", f'secrets "{name}" not found')
        secret = {key: value for key, value in copy.deepcopy(stored).items() if key != "stringData"}
        secret["data"] = {key: base64.b64encode(value.encode()).decode() for key, value in stored["stringData"].items()}
        return secret

    def created(self, kind: str) -> list[dict[str, Any]]:
        return [manifest for (k, _), manifest in self.objects.items() if k == kind]

    def _creator(self, kind: str):
        def create(namespace: str, body: dict[str, Any], **options: Any) -> Any:
            self.calls.append((f"create {kind}", {"namespace": namespace, **options}))
            if kind in self.fail:
                raise self.fail[kind]
            assert body["kind"] == kind and body["metadata"]["namespace"] == namespace
            stored = self._store(body)
            if kind == "LeaderWorkerSet":
                self._store(_leader_worker_set_service(stored))
            self._collect_orphans()
            if self.client_objects and kind in CLIENT_MODELS:
                return to_client_object(copy.deepcopy(stored), CLIENT_MODELS[kind])
            return copy.deepcopy(stored)
        return create

    def _store(self, body: dict[str, Any]) -> dict[str, Any]:
        key = (body["kind"], body["metadata"]["name"])
        if key in self.objects:
            raise api_exception(409, "Conflict", f'{key[0].lower()}s "{key[1]}" already exists')
        stored = copy.deepcopy(body)
        stored["metadata"].update(uid=str(uuid.uuid4()), creationTimestamp=now_rfc3339())
        self.objects[key] = stored
        return stored

    def _create_custom(self, group: str, version: str, namespace: str, plural: str, body: dict[str, Any],
                       **options: Any) -> dict[str, Any]:
        assert (group, version, plural) == (km.LWS_GROUP, km.LWS_VERSION, km.LWS_PLURAL)
        assert body["apiVersion"] == f"{group}/{version}"
        return self._creator(body["kind"])(namespace, body, **options)

    def _deleter(self, kind: str):
        def delete(namespace: str, *, label_selector: str, **options: Any) -> None:
            self.calls.append((f"delete {kind}", {"namespace": namespace, "label_selector": label_selector,
                                                  **options}))
            for key in [key for key, body in self.objects.items()
                        if key[0] == kind and _matches(body["metadata"].get("labels", {}), label_selector)]:
                if key in self.objects:  # not collected meanwhile
                    self._delete(key, options.get("propagation_policy"))
        return delete

    def _delete_job(self, name: str, namespace: str, **options: Any) -> None:
        self.calls.append(("delete Job", {"name": name, "namespace": namespace, **options}))
        if ("Job", name) not in self.objects:
            raise api_exception(404, "Not Found", f'jobs.batch "{name}" not found')
        self._delete(("Job", name), options.get("propagation_policy"))

    def _delete_custom(self, group: str, version: str, namespace: str, plural: str, **options: Any) -> None:
        assert (group, version, plural) == (km.LWS_GROUP, km.LWS_VERSION, km.LWS_PLURAL)
        self._deleter("LeaderWorkerSet")(namespace, **options)

    # -- the garbage collector

    def _delete(self, key: tuple[str, str], propagation: str | None) -> None:
        body = self.objects.pop(key)
        policy = propagation or DEFAULT_PROPAGATION.get(key[0], "Background")
        assert policy in ("Orphan", "Background", "Foreground"), policy
        for listener in self.on_delete:
            listener(*key)
        uid = body["metadata"]["uid"]
        for dependent_key, dependent in [item for item in self.objects.items() if uid in _owner_uids(item[1])]:
            if dependent_key not in self.objects:  # collected meanwhile, through another owner
                continue
            others = [ref for ref in dependent["metadata"]["ownerReferences"] if ref["uid"] != uid]
            if policy == "Orphan" or any(map(self._exists, others)):
                dependent["metadata"]["ownerReferences"] = others
            else:
                self._delete(dependent_key, policy)

    def _collect_orphans(self) -> None:
        """Delete every object whose owners are all gone (or never were: a reference that names none)."""
        for key, body in list(self.objects.items()):
            references = body["metadata"].get("ownerReferences")
            if key in self.objects and references and not any(map(self._exists, references)):
                self._delete(key, "Background")

    def _exists(self, reference: dict[str, Any]) -> bool:
        owner = self.objects.get((reference["kind"], reference["name"]))
        return owner is not None and owner["metadata"]["uid"] == reference["uid"] and (
            owner["apiVersion"] == reference["apiVersion"])

    def _list_events(self, namespace: str, *, field_selector: str = "", **options: Any) -> Any:
        """The Events :attr:`event_source` returns, in ``namespace``, filtered by ``involvedObject.kind=Pod`` only."""
        self.calls.append(("list events", {"namespace": namespace, "field_selector": field_selector, **options}))
        assert field_selector in ("", "involvedObject.kind=Pod"), field_selector
        events = [event for event in self.event_source() if event["metadata"]["namespace"] == namespace
                  and (not field_selector or event["involvedObject"]["kind"] == "Pod")]
        if self.client_objects:
            return to_client_object({"apiVersion": "v1", "kind": "EventList", "metadata": {}, "items": events},
                                    "CoreV1EventList")
        return SimpleNamespace(items=copy.deepcopy(events))

    def _list_pods(self, namespace: str, *, label_selector: str, **options: Any) -> Any:
        self.calls.append(("list pods", {"namespace": namespace, "label_selector": label_selector, **options}))
        pods = [pod for pod in self.pod_source()
                if pod["metadata"]["namespace"] == namespace and _matches(pod["metadata"]["labels"], label_selector)]
        return to_client_pod_list(pods) if self.client_objects else SimpleNamespace(items=copy.deepcopy(pods))


# -- the kubelet -------------------------------------------------------------------------------


class FakeKubelet:
    """Runs pods' real container commands as local processes and reports their statuses.

    Each pod's command is the backend's own (``sh -c HOST_SCRIPT ... python -m
    kinetic_nb.agent --job URI``) with the environment the kubelet would give
    it, on top of a minimal base (``PATH`` with this interpreter first, so
    ``python`` is the test's). ``dns`` replaces names of cluster DNS, which
    cannot run here, by addresses that resolve on this machine. A pod with
    ``restartPolicy: Always`` is started again when its container ends, as the
    kubelet does; a deleted workload's pods get SIGTERM, then SIGKILL after
    their grace period.
    """

    def __init__(self, pods: list[dict[str, Any]], log_dir: str, *, dns: dict[str, str] | None = None,
                 extra_env: dict[str, str] | None = None, secrets: Any = None,
                 image_pythonpath: str | None = IMAGE_PYTHONPATH, scratch_dir: str | None = None,
                 pod_ip: str = "127.0.0.1", pod_env: dict[int, dict[str, str]] | None = None):
        self.pods = pods
        #: Variables one pod sees otherwise than the kubelet resolves them (what this machine's network cannot
        #: play: a pod whose way to host 0's port is blocked, say), by pod index.
        self.pod_env = pod_env or {}
        #: The address every pod's status reports (``status.podIP``): here, where the notebook reaches its ports.
        self.pod_ip = pod_ip
        #: The image's own kinetic_nb (None: the image has none, as a stock Python image).
        self.image_pythonpath = image_pythonpath
        #: Each pod's scratch volume (``/kinetic``) as a directory of its own below this one.
        self.scratch_dir = scratch_dir
        self.secrets = secrets
        self.log_dir = log_dir
        self.dns = dns or {}
        self.extra_env = extra_env or {}
        self.processes: dict[int, subprocess.Popen] = {}
        self.runs: dict[int, int] = {}
        self.first_exit: dict[int, int] = {}
        self._ended: set[int] = set()  # the pids of containers whose end was noted
        self.reasons: dict[int, str] = {}
        self.deleted: set[int] = set()
        self.created_at = now_rfc3339()
        self._lock = threading.RLock()

    def environment(self, index: int) -> dict[str, str]:
        env = container_environment(self.pods[index], secrets=self.secrets)
        for name, value in env.items():
            for dns_name_, address in self.dns.items():
                value = value.replace(dns_name_, address)
            if self.scratch_dir and value.startswith(km.SCRATCH_DIR + "/"):
                value = os.path.join(self.scratch_dir, f"pod-{index}", value[len(km.SCRATCH_DIR) + 1:])
            if value.startswith(km.KEY_DIR + "/"):
                value = self.volume_path(index, value)
            env[name] = value
        return env

    def volume_path(self, index: int, path: str) -> str:
        """Where pod ``index``'s file ``path`` (in a Secret volume) lies on this machine."""
        return os.path.join(self.log_dir, f"pod-{index}-volumes", path.lstrip("/"))

    def _mount_secrets(self, index: int) -> None:
        """Write the pod's Secret volumes' files, read-only, as the kubelet does before it starts a container."""
        if self.secrets is None:
            return
        for path, text in secret_files(self.pods[index], secrets=self.secrets).items():
            local = self.volume_path(index, path)
            os.makedirs(os.path.dirname(local), exist_ok=True)
            if os.path.exists(local):
                os.chmod(local, 0o600)
            with open(local, "w") as file:
                file.write(text)
            os.chmod(local, 0o444)

    def start(self, index: int | None = None) -> None:
        for position in ([index] if index is not None else range(len(self.pods))):
            self._run(position)

    def _run(self, index: int) -> None:
        self._mount_secrets(index)
        env = self.environment(index)
        command = container_command(self.pods[index], env)
        base = {"PATH": f"{os.path.dirname(sys.executable)}:{os.environ.get('PATH', '/usr/bin:/bin')}",
                "HOME": os.environ.get("HOME", "/tmp"), "TMPDIR": os.environ.get("TMPDIR", "/tmp")}
        if self.image_pythonpath:
            base["PYTHONPATH"] = self.image_pythonpath
        with self._lock:
            self.runs[index] = self.runs.get(index, 0) + 1
            with open(self.log_path(index, self.runs[index]), "wb") as log:
                self.processes[index] = subprocess.Popen(command, env={**base, **env, **self.extra_env,
                                                                              **self.pod_env.get(index, {})},
                                                         stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                                         start_new_session=True,
                                                         cwd=self.log_dir)  # the image's own, not this checkout

    def log_path(self, index: int, run: int = 1) -> str:
        """What the container printed on its ``run``-th start (``kubectl logs``)."""
        return os.path.join(self.log_dir, f"pod-{index}-run-{run}.log")

    def output(self, index: int, run: int = 1) -> str:
        with open(self.log_path(index, run), errors="replace") as log:
            return log.read()

    def step(self) -> None:
        """Note the containers that ended (a pod's status keeps its first run's exit); restart, every time, those
        whose pods say ``restartPolicy: Always``, as the kubelet does (a crash loop restarts for ever)."""
        with self._lock:
            for index, process in list(self.processes.items()):
                code = process.poll()
                if code is None or process.pid in self._ended:
                    continue
                self._ended.add(process.pid)
                self.first_exit.setdefault(index, code)
                if self.pods[index]["spec"]["restartPolicy"] == "Always" and index not in self.deleted:
                    self._run(index)

    def kill(self, index: int, reason: str) -> None:
        """The node kills a container (``reason``: OOMKilled, as the kubelet reports it)."""
        with self._lock:
            self.reasons[index] = reason
            os.killpg(self.processes[index].pid, signal.SIGKILL)
            self.processes[index].wait()

    def delete_all(self, *_: Any) -> None:
        """Pod deletion: SIGTERM, then SIGKILL after the pod's grace period; nothing restarts."""
        with self._lock:
            self.deleted.update(range(len(self.pods)))
            grace = self.pods[0]["spec"]["terminationGracePeriodSeconds"]
            for process in self.processes.values():
                if process.poll() is None:
                    os.killpg(process.pid, signal.SIGTERM)
            for process in self.processes.values():
                try:
                    process.wait(timeout=grace)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()

    def collect_with(self, kind: str, name: str):
        """An ``on_delete`` listener for :class:`FakeKubernetes`: the pods go when their
        LeaderWorkerSet or Job (``kind``, ``name``) goes, as the garbage collector deletes them."""
        def listener(deleted_kind: str, deleted_name: str) -> None:
            if (deleted_kind, deleted_name) == (kind, name):
                self.delete_all()
        return listener

    def close(self) -> None:
        """Stop everything still running (a test's teardown)."""
        self.delete_all()

    # -- the pods as the API shows them

    def pod_json(self) -> list[dict[str, Any]]:
        self.step()
        with self._lock:
            return [self._pod(index) for index in range(len(self.pods)) if index not in self.deleted]

    def _pod(self, index: int) -> dict[str, Any]:
        pod = copy.deepcopy(self.pods[index])
        pod["metadata"]["creationTimestamp"] = self.created_at
        pod["metadata"]["uid"] = f"uid-{index}"
        process = self.processes.get(index)
        status: dict[str, Any] = {"phase": "Pending", "conditions": [
            {"type": "PodScheduled", "status": "True", "lastTransitionTime": self.created_at}]}
        image = pod["spec"]["containers"][0]["image"]
        # imageID is always sent (the official client's models require it): empty until the image is pulled.
        container = {"name": km.CONTAINER_NAME, "image": image, "imageID": "", "ready": False,
                     "restartCount": max(0, self.runs.get(index, 0) - 1), "state": {}, "lastState": {}}
        if process is not None:
            container["imageID"] = f"{image.rsplit(':', 1)[0]}@sha256:{hashlib.sha256(image.encode()).hexdigest()}"
            first = self.first_exit.get(index)
            terminated = None
            if first is not None:
                terminated = {"exitCode": first if first >= 0 else 128 - first,
                              "reason": self.reasons.get(index, "Completed" if first == 0 else "Error"),
                              "startedAt": self.created_at, "finishedAt": now_rfc3339()}
                policy = pod["spec"]["containers"][0].get("terminationMessagePolicy", "File")
                if first != 0 and policy == "FallbackToLogsOnError":  # nothing writes /dev/termination-log
                    tail = "".join(self.output(index).splitlines(keepends=True)[-FALLBACK_LOG_LINES:])
                    terminated["message"] = tail.encode()[-FALLBACK_LOG_BYTES:].decode(errors="replace")
            restarted = self.runs.get(index, 0) > 1
            if terminated and not restarted:
                container["state"] = {"terminated": terminated}
                status["phase"] = "Succeeded" if first == 0 else "Failed"
            else:
                container["state"] = {"running": {"startedAt": self.created_at}}
                container["ready"] = True
                if terminated:
                    container["lastState"] = {"terminated": terminated}
                status["phase"] = "Running"
            status["containerStatuses"] = [container]
            status["podIP"] = self.pod_ip
        pod["status"] = status
        return pod


def session_on_pods(api: FakeKubernetes, start: Any, log_dir: str, **options: Any) -> tuple[Any, FakeKubelet]:
    """A session on the kubernetes backend whose API is ``api``: ``start()`` (which starts it, and returns only
    once its hosts are up) runs while its pods are played, as the cluster would schedule them once its workload
    exists, with host 0's DNS name resolving to this machine; the session, and the kubelet (the caller closes it).
    ``options`` go to :class:`FakeKubelet`."""
    started: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: started.setdefault("session", start()), name="start-session")
    thread.start()
    # The workload itself: the backend also creates a Service (and the root Job) for the session, in some order.
    wait_for(lambda: any(manifest["kind"] in ("LeaderWorkerSet", "Job") and not is_root(manifest)
                         for manifest in list(api.objects.values())), what="the session's workload")
    owner = workload(list(api.objects.values()))
    name, namespace = owner["metadata"]["name"], owner["metadata"]["namespace"]
    kubelet = FakeKubelet(pods_for([owner]), log_dir, secrets=api.secret_value,
                          dns={f"{name}-0.{name}.{namespace}": "127.0.0.1"}, **options)
    api.pod_source = kubelet.pod_json
    api.on_delete.append(kubelet.collect_with(owner["kind"], name))
    kubelet.start()
    thread.join(timeout=300)
    if "session" not in started:
        kubelet.close()
        raise AssertionError(f"the session did not start; host 0 said: {kubelet.output(0)[-2000:]}")
    return started["session"], kubelet


def wait_for(condition, timeout: float = 60.0, pause: float = 0.05, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(pause)
