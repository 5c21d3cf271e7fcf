"""A 64-host job and a 64-host session on the Kubernetes double: the API requests each look makes do not grow
with the hosts.

The backend talks over real HTTP, through the official client, to ``RecordingApiServer``
(``k8s_api_server.py``), which records every request; the pods the Indexed Job becomes are played by
``FakeKubelet`` (``k8s_cluster.py``): each pod's own container command (the host agent, which runs the
runner) as a local process, reported in the API's pod listings. A look is what the client's poller asks the
backend at every poll (``Backend.observe``). The backend here lists at every look (no interval: normally
a listing is reused by the looks of the next 2 s), so each look's requests are counted whole. A look may list
the job's pods once, by its label, and the namespace's pod Events once (only while a pod is Pending); a
request per pod would show as one more kind of request (``GET .../pods/{name}``) per pod, and the counts at
8 and at 64 hosts would differ.

Cost here (2 cores, shared): the 64-host job takes about 20 s and its 128 processes (an agent and a runner
per pod) about 3.5 GiB of resident memory at their peak (summed RSS); the 64-host session about 20 s.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import pytest

import kinetic_nb
from kinetic_nb.backends.kubernetes.backend import KubernetesBackend, KubernetesSettings
from kinetic_nb.backends.kubernetes.manifests import job_selector
from kinetic_nb.backends.kubernetes.root import root_name

from .k8s_api_server import RecordingApiServer
from .k8s_cluster import FakeKubelet, is_root, pods_for, wait_for, workload

NAMESPACE = "ml-team"
IMAGE = "registry.example/kinetic:scale"
SMALL = 8
#: The slice the issue asks for: a v5e-256's 64 hosts (each pod here is an agent and a runner process).
LARGE = 64
POD_LIST = ("GET", f"/api/v1/namespaces/{NAMESPACE}/pods")
EVENT_LIST = ("GET", f"/api/v1/namespaces/{NAMESPACE}/events")
#: Generous: 64 pods' processes start on a machine of two cores.
START_TIMEOUT_S = 240.0

pytestmark = [
    pytest.mark.filterwarnings("ignore:job storage file.*is local to this machine:kinetic_nb.errors.KineticWarning"),
    pytest.mark.timeout(900),
]


class LookCountingBackend(KubernetesBackend):
    """The kubernetes backend, listing pods and Events at every look, that records the API requests each look
    (each ``observe``) made, by kind."""

    def __init__(self, server: RecordingApiServer):
        super().__init__(KubernetesSettings(namespace=NAMESPACE, image=IMAGE), api=server.api(),
                         pod_list_interval_s=0.0, event_list_interval_s=0.0)
        self.server = server
        self.looks: list[Counter[tuple[str, str]]] = []
        self._one_look_at_a_time = threading.Lock()  # so that a look's requests are its own

    def observe(self, *args: Any, **kwargs: Any) -> Any:
        with self._one_look_at_a_time:
            start = len(self.server.requests)
            try:
                return super().observe(*args, **kwargs)
            finally:
                self.looks.append(self.server.counts(start))


@pytest.fixture
def cluster():
    """A fresh API server's double for each slice (``new()``), and the kubelets to stop afterwards (every pod's
    process proven gone)."""
    servers: list[RecordingApiServer] = []
    kubelets: list[FakeKubelet] = []

    def new() -> RecordingApiServer:
        servers.append(RecordingApiServer())
        return servers[-1]

    yield new, kubelets
    for kubelet in kubelets:
        kubelet.close()
        assert all(process.poll() is not None for process in kubelet.processes.values())
    for server in servers:
        server.close()


def play_pods(server: RecordingApiServer, kubelets: list[FakeKubelet], log_dir) -> FakeKubelet:
    """Run the pods the job's workload becomes, listed by the API from now on and gone with the job's root."""
    owner = workload(server.objects.values())
    [root] = [body for body in server.objects.values() if body["kind"] == "Job" and is_root(body)]
    log_dir.mkdir(parents=True)
    kubelet = FakeKubelet(pods_for([owner]), str(log_dir), secrets=server.secret_value)
    kubelets.append(kubelet)
    server.pod_source = kubelet.pod_json
    server.on_delete.append(kubelet.collect_with("Job", root["metadata"]["name"]))
    kubelet.start()
    return kubelet


def most_per_look(looks: list[Counter[tuple[str, str]]]) -> dict[tuple[str, str], int]:
    """The most requests of each kind that one look made."""
    most: dict[tuple[str, str], int] = {}
    for look in looks:
        for kind, count in look.items():
            most[kind] = max(most.get(kind, 0), count)
    return most


def assert_one_labelled_list_per_look(server: RecordingApiServer, backend: LookCountingBackend, job_id: str) -> None:
    """Every look made at most one pod listing and one Event listing; every pod listing named the job's label."""
    most = most_per_look(backend.looks)
    assert set(most) <= {POD_LIST, EVENT_LIST} and all(count == 1 for count in most.values()), most
    assert most.get(POD_LIST) == 1, f"no look listed the pods: {backend.looks}"
    listings = [request for request in server.requests if (request.verb, request.path) == POD_LIST]
    assert {request.one("labelSelector") for request in listings} == {job_selector(job_id)}


def run_job(server: RecordingApiServer, kubelets: list[FakeKubelet], tmp_path, hosts: int) -> LookCountingBackend:
    """A one-shot job of ``hosts`` hosts (framework none) through the client's own wait loop; its backend."""
    backend = LookCountingBackend(server)
    handle = kinetic_nb.submit("import os\n(int(os.environ['JOB_COMPLETION_INDEX']), int(os.environ['KINETIC_NUM_HOSTS']))",
                               hosts=hosts, framework="none", backend=backend, storage=f"file://{tmp_path}/jobs",
                               quiet=True, timeout=START_TIMEOUT_S)
    play_pods(server, kubelets, tmp_path / f"pods-{hosts}")
    assert handle.result(timeout=START_TIMEOUT_S) == (0, hosts)
    assert_one_labelled_list_per_look(server, backend, handle.job_id)
    assert not [key for key in server.objects if key[0] == "Job" and key[2] == root_name(handle.job_id)]
    return backend


def test_a_jobs_looks_make_the_same_api_requests_at_8_and_64_hosts(cluster, tmp_path):
    """A one-shot job's every look lists its pods once, by label, at 8 hosts as at 64."""
    new, kubelets = cluster
    small = run_job(new(), kubelets, tmp_path / "small", SMALL)
    large = run_job(new(), kubelets, tmp_path / "large", LARGE)
    assert most_per_look(large.looks).get(POD_LIST) == most_per_look(small.looks).get(POD_LIST) == 1


def start_session(server: RecordingApiServer, kubelets: list[FakeKubelet], tmp_path, hosts: int) -> Any:
    """A session of ``hosts`` hosts (framework none) whose pods are played once its workload exists."""
    backend = LookCountingBackend(server)
    started: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: started.setdefault("session", kinetic_nb.start(
        hosts=hosts, backend=backend, storage=f"file://{tmp_path}/jobs", framework="none", idle_timeout=600,
        echo=False, quiet=True, ready_timeout=START_TIMEOUT_S)), name="start-session")
    thread.start()
    wait_for(lambda: any(not is_root(body) for body in server.objects.values() if body["kind"] == "Job"),
             what="the session's workload")
    kubelet = play_pods(server, kubelets, tmp_path / f"pods-{hosts}")
    thread.join(timeout=START_TIMEOUT_S + 60)
    if "session" not in started:
        raise AssertionError(f"the session did not start; host 0 said: {kubelet.output(0)[-2000:]}")
    return started["session"]


def run_session_cell(server: RecordingApiServer, kubelets: list[FakeKubelet], tmp_path,
                     hosts: int) -> tuple[Counter[tuple[str, str]], LookCountingBackend]:
    """Start a session of ``hosts`` hosts, run a cell on it, stop it: the requests the cell made outside the
    backend's looks, and the backend."""
    session = start_session(server, kubelets, tmp_path, hosts)
    backend = session.group.backend
    try:
        requests_before, looks_before = len(server.requests), len(backend.looks)
        cell = session.run("import os\nint(os.environ['KINETIC_HOST_INDEX']) + int(os.environ['KINETIC_NUM_HOSTS'])")
        assert cell.result(timeout=START_TIMEOUT_S) == hosts
        during_cell = server.counts(requests_before)
        during_cell.subtract(sum(backend.looks[looks_before:], Counter()))
    finally:
        session.stop()
    assert_one_labelled_list_per_look(server, backend, session.plan.job_id)
    return +during_cell, backend


def test_a_session_cells_looks_make_the_same_api_requests_at_8_and_64_hosts(cluster, tmp_path):
    """A session's start looks list its pods once each, by label, and its cell asks the API nothing beyond its
    looks, at 8 hosts as at 64."""
    new, kubelets = cluster
    outside_small, small = run_session_cell(new(), kubelets, tmp_path / "small", SMALL)
    outside_large, large = run_session_cell(new(), kubelets, tmp_path / "large", LARGE)
    assert outside_small == outside_large == Counter()  # the cell's own requests are its looks', if any
    assert most_per_look(large.looks).get(POD_LIST) == most_per_look(small.looks).get(POD_LIST) == 1
