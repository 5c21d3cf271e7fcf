"""One contract, every backend: what the client, the poller and the catalog rely on.

Run over ``local`` (real host processes), ``kubernetes`` (the API test double,
with each pod's real container command, the host agent, run as a local
process), ``ray`` (actors on the real 4-node Ray cluster of the
``ray_cluster`` fixture), ``ssh`` (real sshd's on loopback addresses, the
``ssh_hosts`` fixture) and ``fake`` (scripted hosts). Assertions are on stored state and on
the outcome, never on log text.
"""

from __future__ import annotations

import os
import threading
import time

import psutil
import pytest

import kinetic_nb
from kinetic_nb.backends import Backend, PlatformView, get_backend
from kinetic_nb.backends.kubernetes import backend as k8s
from kinetic_nb.backends.ssh.pool import close_pools
from kinetic_nb.backends.testing import FakeBackend, HostScript
from kinetic_nb.runner import protocol
from kinetic_nb.runner.protocol import CancelRequest
from kinetic_nb.runner.records import read_exit, read_record
from kinetic_nb.state import JobStatus

from .conftest import ssh_options
from .k8s_cluster import FakeKubelet, FakeKubernetes, pods_for, workload

pytestmark = pytest.mark.filterwarnings("ignore:job storage file.*is local to this machine:kinetic_nb.errors.KineticWarning")

TRIVIAL = "41 + 1"
#: How long a local job's agent may take to exit after the outcome is in.
REMAINS_WAIT_S = 10.0
FAILING = "raise KeyError('no such shard')"
LONG = "import time\ntime.sleep(600)"


class LocalHarness:
    name = "local"

    def __init__(self, tmp_path, monkeypatch):
        self.storage = f"file://{tmp_path}/jobs"

    def backend(self) -> Backend:
        return get_backend("local")

    def submit(self, source: str, hosts: int, **options):
        return kinetic_nb.submit(source, hosts=hosts, storage=self.storage, quiet=True, **options)

    def remains(self, handle) -> list[str]:
        """What the platform still holds of the job: here, its agent's and hosts' processes (waited for a while)."""
        deadline = time.monotonic() + REMAINS_WAIT_S
        while True:
            left = [f"{process.pid}: {' '.join(process.info['cmdline'] or ())}"
                    for process in psutil.process_iter(["pid", "cmdline"])
                    if handle.storage.uri in " ".join(process.info["cmdline"] or ())]
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.1)

    def close(self) -> None:
        pass


class KubernetesHarness(LocalHarness):
    """The API double; each pod's own command runs as a local process, stepped by a thread as a kubelet."""

    name = "kubernetes"

    def __init__(self, tmp_path, monkeypatch):
        super().__init__(tmp_path, monkeypatch)
        self.tmp_path = tmp_path
        self.api = FakeKubernetes()
        monkeypatch.setattr(k8s, "connect", lambda settings: self.api)
        monkeypatch.setenv("KINETIC_IMAGE", "registry.example/kinetic:test")
        monkeypatch.setenv("KINETIC_NAMESPACE", "contract")
        self.kubelets: list[FakeKubelet] = []
        self.stop = threading.Event()

    def backend(self) -> Backend:
        return get_backend("kubernetes")

    def submit(self, source: str, hosts: int, **options):
        handle = kinetic_nb.submit(source, hosts=hosts, backend="kubernetes", storage=self.storage, quiet=True,
                                   **options)
        owner = workload(self.api.objects.values())
        log_dir = self.tmp_path / f"pods-{len(self.kubelets)}"
        log_dir.mkdir()
        kubelet = FakeKubelet(pods_for([owner]), str(log_dir), secrets=self.api.secret_value)
        self.kubelets.append(kubelet)
        self.api.pod_source = kubelet.pod_json
        self.api.on_delete.append(kubelet.collect_with(owner["kind"], owner["metadata"]["name"]))
        kubelet.start()
        threading.Thread(target=self._step, args=(kubelet,), daemon=True).start()
        return handle

    def remains(self, handle) -> list[str]:
        """The job's objects the API server still holds (the root, the workload, the Secret, the Service)."""
        return [f"{kind} {name}" for kind, name in self.api.objects if handle.job_id in name]

    def _step(self, kubelet: FakeKubelet) -> None:
        while not self.stop.wait(0.05):
            kubelet.step()

    def close(self) -> None:
        self.stop.set()
        for kubelet in self.kubelets:
            kubelet.close()


class RayHarness(LocalHarness):
    """Actors on the session's real 4-node Ray cluster."""

    name = "ray"

    def __init__(self, tmp_path, monkeypatch, cluster):
        super().__init__(tmp_path, monkeypatch)
        self.cluster = cluster
        self.address = cluster.address

    def remains(self, handle) -> list[str]:
        """The job's placement groups and actors still in the cluster (the backend removes them in a thread)."""
        return self.cluster.wait_until_nothing_is_left()

    def backend(self) -> Backend:
        return get_backend("ray", address=self.address)

    def submit(self, source: str, hosts: int, **options):
        return kinetic_nb.submit(source, hosts=hosts, backend="ray", backend_options={"address": self.address},
                                 storage=self.storage, quiet=True, **options)


class SshHarness(LocalHarness):
    """Two of the session's real sshd's on loopback addresses (their agents run on this machine, so what is
    left of a job is found as the local backend's is)."""

    name = "ssh"

    def __init__(self, tmp_path, monkeypatch, hosts):
        super().__init__(tmp_path, monkeypatch)
        self.options = ssh_options(hosts, 2)

    def backend(self) -> Backend:
        return get_backend("ssh", **self.options)

    def submit(self, source: str, hosts: int, **options):
        return kinetic_nb.submit(source, hosts=hosts, backend=self.backend(), storage=self.storage, quiet=True,
                                 **options)

    def close(self) -> None:
        close_pools()  # the connections and warm agents this notebook keeps for the two hosts


class FakeHarness(LocalHarness):
    name = "fake"

    def remains(self, handle) -> list[str]:
        """The scripted platform holds a job until its cleanup."""
        return [] if handle.job_id in handle.backend.cleaned else [f"{handle.job_id}: not cleaned up"]

    def backend(self) -> Backend:
        return FakeBackend()

    def submit(self, source: str, hosts: int, **options):
        script = {index: HostScript.run() for index in range(hosts)} if source == LONG else None
        return kinetic_nb.submit(source, hosts=hosts, backend=FakeBackend(script), storage=self.storage, quiet=True,
                                 **options)


@pytest.fixture(params=[LocalHarness, KubernetesHarness,
                        pytest.param(RayHarness, marks=pytest.mark.ray_cluster),  # run with the other tests on the cluster
                        SshHarness, FakeHarness],
                ids=lambda harness: harness.name)
def harness(request, tmp_path, monkeypatch):
    if request.param is RayHarness:
        made = RayHarness(tmp_path, monkeypatch, request.getfixturevalue("ray_cluster"))
    elif request.param is SshHarness:
        made = SshHarness(tmp_path, monkeypatch, request.getfixturevalue("ssh_hosts"))
    else:
        made = request.param(tmp_path, monkeypatch)
    yield made
    made.close()


def test_the_coordinator_is_a_host_and_a_port(harness):
    host, port = harness.backend().coordinator_address("kn-20260101-000000-abcdef").rsplit(":", 1)
    assert host and 0 < int(port) < 65536


def test_a_cell_gives_the_leaders_value_and_every_host_an_exit_record(harness):
    handle = harness.submit(TRIVIAL, hosts=2, keep=True)
    assert handle.result(timeout=120) == 42
    assert handle.status() is JobStatus.SUCCEEDED
    for index in range(2):
        assert read_exit(handle.storage, handle.key, index).recorded_success


def test_a_failing_cell_raises_the_hosts_own_exception(harness):
    handle = harness.submit(FAILING, hosts=2)
    with pytest.raises(KeyError, match="no such shard"):
        handle.result(timeout=120)
    assert handle.status() is JobStatus.FAILED


def test_cancel_stops_every_host_and_says_why(harness):
    handle = harness.submit(LONG, hosts=2)
    handle.cancel("by the contract")
    assert handle.wait(timeout=120) is JobStatus.CANCELLED
    assert CancelRequest.from_json(read_record(handle.storage, handle.key, protocol.CANCEL)).reason == "by the contract"
    assert [host.state for host in handle.hosts()] == ["stopped", "stopped"]


def test_observe_adds_nothing_to_a_job_whose_hosts_recorded_their_ends(harness):
    handle = harness.submit(TRIVIAL, hosts=2, keep=True)
    handle.result(timeout=120)
    recorded = handle.poller.exits
    view = handle.backend.observe(handle.storage, handle.plan, handle.storage.list(), recorded, handle.key)
    assert isinstance(view, PlatformView) and dict(view.exits) == {} and view.problem == ""


def test_options_recreate_the_backend_from_any_kernel(harness):
    backend = harness.backend()
    assert isinstance(backend, Backend)
    again = type(backend).from_options(**backend.options())
    assert again.options() == backend.options() and again.name == backend.name


def test_once_the_outcome_is_in_the_platform_holds_nothing_and_cleanup_can_be_called_again(harness):
    handle = harness.submit(TRIVIAL, hosts=2)
    assert handle.result(timeout=120) == 42  # recording the outcome cleans up
    assert harness.remains(handle) == []
    handle.backend.cleanup(handle.plan)  # again, twice: nothing to remove, and it does not raise
    handle.backend.cleanup(handle.plan)
    assert harness.remains(handle) == []


def test_a_session_on_the_kubernetes_double_over_fake_gcs_server(tmp_path, monkeypatch, gcs_root):
    """One long-lived workload whose pods run the agent's session loop; cells travel through gs://."""
    harness = KubernetesHarness(tmp_path, monkeypatch)
    started = threading.Event()

    def kubelet_when_the_workload_exists() -> None:  # the pods start as the cluster would schedule them
        while not any(kind in ("LeaderWorkerSet",) or (kind == "Job" and not name.endswith("-root"))
                      for kind, name in harness.api.objects):
            if harness.stop.wait(0.02):
                return
        owner = workload(harness.api.objects.values())
        log_dir = tmp_path / "session-pods"
        log_dir.mkdir()
        kubelet = FakeKubelet(pods_for([owner]), str(log_dir), secrets=harness.api.secret_value,
                              extra_env={"STORAGE_EMULATOR_HOST": os.environ["STORAGE_EMULATOR_HOST"]})
        harness.kubelets.append(kubelet)
        harness.api.pod_source = kubelet.pod_json
        kubelet.start()
        started.set()
        harness._step(kubelet)

    threading.Thread(target=kubelet_when_the_workload_exists, daemon=True).start()
    try:
        session = kinetic_nb.start(hosts=2, backend="kubernetes", framework="none", storage=gcs_root,
                                   idle_timeout=600, echo=False)
        assert started.is_set() and session.group.backend.name == "kubernetes"
        assert session.run("kept = 'on the pods'\n1").result() == 1
        assert session.run("kept").result() == "on the pods"  # the pods' namespaces live across cells
        with pytest.raises(ValueError, match="broke"):
            session.run("import os\nif os.environ['KINETIC_HOST_INDEX'] == '1':\n    raise ValueError('broke')").result()
        assert session.run("kept").result() == "on the pods"
        session.stop()
        assert session.ended() is not None
    finally:
        harness.close()
