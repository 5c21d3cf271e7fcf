"""The whole client path on the kubernetes backend, with the pods played by real runner processes.

No real API server, controller or kubelet can run here, so:

- ``kinetic_nb.submit(..., backend="kubernetes")`` runs for real and creates
  its objects through ``FakeKubernetes``, a test double of the Kubernetes API
  (``connect`` is replaced; nothing else is);
- the host pods those objects become (``k8s_cluster.pods_for``: what the
  LeaderWorkerSet and Job controllers make) are played by ``FakeKubelet``: each
  pod's own container command (``sh -c HOST_SCRIPT ... python -m
  kinetic_nb.agent --job URI``: the host agent, which runs the runner) runs as
  a local process with the environment the kubelet would resolve for it,
  against ``file://`` storage; the kubelet restarts a LeaderWorkerSet pod's
  container when it ends, as it would; the pods go when their workload does
  (which the double's garbage collector deletes with the root Job);
- the API's pod listing reports those processes as pod statuses.

The root Job's own pod (the agent's ``--watch`` mode) is not played here.

That proves the manifests' environment, the runner and the outcome path work
together. The kubelet's part runs only when the test steps it: ``settle``
steps it while asking the backend for exit summaries until every host has one,
as the client's poller asks on every poll (``Backend.observe``). Once the
outcome is recorded the client deletes the job's cluster objects itself.
"""

from __future__ import annotations

import json
import socket
import sys
import time

import pytest

import kinetic_nb
from kinetic_nb.backends.kubernetes import backend as k8s
from kinetic_nb.backends.kubernetes.pods import host_states
from kinetic_nb.errors import JobFailedError, KineticWarning
from kinetic_nb.runner import protocol
from kinetic_nb.runner.envelope import read_sealed
from kinetic_nb.runner.records import read_host_status, read_record

from .k8s_cluster import FakeKubelet, FakeKubernetes, is_root, pods_for, wait_for, workload

NAMESPACE = "ml-team"
pytestmark = pytest.mark.filterwarnings("ignore:job storage file.*is local to this machine:kinetic_nb.errors.KineticWarning")


@pytest.fixture
def cluster(monkeypatch, tmp_path):
    """A fake API server, the environment that configures the backend, and the kubelets to stop afterwards."""
    api = FakeKubernetes()
    monkeypatch.setattr(k8s, "connect", lambda settings: api)
    monkeypatch.setenv("KINETIC_IMAGE", "registry.example/kinetic-jax:test")
    monkeypatch.setenv("KINETIC_NAMESPACE", NAMESPACE)
    kubelets: list[FakeKubelet] = []
    yield api, kubelets
    for kubelet in kubelets:
        kubelet.close()


def start_pods(api, kubelets, tmp_path, **options) -> FakeKubelet:
    owner = workload(api.objects.values())
    log_dir = tmp_path / "pods"
    log_dir.mkdir(exist_ok=True)
    kubelet = FakeKubelet(pods_for([owner]), str(log_dir), secrets=api.secret_value, **options)
    kubelets.append(kubelet)
    api.pod_source = kubelet.pod_json
    api.on_delete.append(kubelet.collect_with(owner["kind"], owner["metadata"]["name"]))
    kubelet.start()
    return kubelet


def settle(handle, kubelet: FakeKubelet, timeout: float = 90.0) -> dict:
    """Step the kubelet and ask the backend for exit summaries, as the poller does, until every host has one."""
    deadline = time.monotonic() + timeout
    while True:
        kubelet.step()
        summaries = handle.backend.exit_summaries(handle.storage, handle.plan, handle.storage.list(), handle.key)
        if len(summaries) == handle.plan.world_size:
            return summaries
        if time.monotonic() > deadline:
            logs = {index: kubelet.output(index) for index in range(len(kubelet.pods))}
            raise AssertionError(f"hosts did not all end: {summaries}; logs: {logs}")
        time.sleep(0.05)


def test_a_tpu_slice_runs_as_a_leader_worker_set(cluster, tmp_path):
    api, kubelets = cluster
    source = ("import os\n"
              "print('hello from host', os.environ['TPU_WORKER_ID'])\n"
              "{'host': int(os.environ['TPU_WORKER_ID']), 'hosts': int(os.environ['KINETIC_NUM_HOSTS']),\n"
              " 'coordinator': os.environ['KINETIC_COORDINATOR_ADDRESS'], 'environment': dict(os.environ)}")
    handle = kinetic_nb.submit(source, accelerator="tpu-v5e-16", backend="kubernetes",
                               storage=f"file://{tmp_path}/jobs", quiet=True, keep=True)
    assert handle.backend.name == "kubernetes"
    [lws] = api.created("LeaderWorkerSet")
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 4
    name = lws["metadata"]["name"]
    [root] = [job for job in api.created("Job") if is_root(job)]
    assert lws["metadata"]["ownerReferences"][0]["uid"] == root["metadata"]["uid"]
    kubelet = start_pods(api, kubelets, tmp_path)

    summaries = settle(handle, kubelet)
    assert all(summary.recorded_success and summary.exit_code == 0 for summary in summaries.values())
    # The kubelet restarted every ended container (restartPolicy: Always); none ran the cell twice.
    # (The agents' exit records can come before their containers end: the kubelet restarts each one when it does.)
    def parked(index: int) -> bool:
        kubelet.step()
        return kubelet.runs.get(index, 0) >= 2 and "not running the cell again" in kubelet.output(index, 2)

    wait_for(lambda: all(parked(index) for index in range(4)), what="the restarted containers to park")
    assert all(kubelet.runs[index] == 2 for index in range(4))
    pods = handle.backend.pods(handle.plan, fresh=True)  # not the listing cached before the containers ended
    assert {host.state for host in host_states(pods).values()} == {"succeeded"}

    result = handle.result(timeout=30)
    environment = result.pop("environment")
    assert result == {"host": 0, "hosts": 4, "coordinator": f"{name}-0.{name}.{NAMESPACE}:{k8s.DEFAULT_COORDINATOR_PORT}"}
    # The agents read the key from the mounted Secret: the cell's environment holds neither it nor its file's name.
    assert "KINETIC_JOB_KEY" not in environment and "KINETIC_JOB_KEY_FILE" not in environment
    assert handle.key.hex() not in repr(environment)
    assert [host.state for host in handle.hosts()] == ["succeeded"] * 4
    for index in range(4):  # each host's agent uploaded its runner's output
        assert f"hello from host {index}" in handle.logs(index)
    assert api.objects == {}  # the client deleted the root with the outcome, and with it everything
    assert all(process.poll() is not None for process in kubelet.processes.values())


def test_jax_hosts_meet_at_the_coordinator_the_leader_worker_set_names(cluster, tmp_path, monkeypatch):
    """JAX's own cluster detection does not know LWS: the runner must pass KINETIC_COORDINATOR_ADDRESS on."""
    api, kubelets = cluster  # jax is a test dependency: no skip hides this test
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        monkeypatch.setenv("KINETIC_COORDINATOR_PORT", str(probe.getsockname()[1]))
    source = ("import jax, jax.numpy as jnp\n"
              "from jax.experimental import multihost_utils\n"
              "total = multihost_utils.process_allgather(jnp.ones(2) * jax.process_index()).sum()\n"
              "(jax.process_count(), jax.process_index(), float(total))")
    handle = kinetic_nb.submit(source, accelerator="tpu-v6e-2x4", backend="kubernetes", env={"JAX_PLATFORMS": "cpu"},
                               storage=f"file://{tmp_path}/jobs", quiet=True)
    assert handle.plan.framework == "jax"
    [lws] = api.created("LeaderWorkerSet")
    name = lws["metadata"]["name"]
    # Cluster DNS cannot run here: the leader's name resolves to this machine, as DNS would give its pod's address.
    kubelet = start_pods(api, kubelets, tmp_path, dns={f"{name}-0.{name}.{NAMESPACE}": "127.0.0.1"})
    settle(handle, kubelet, timeout=180)
    assert handle.result(timeout=30) == (2, 0, 2.0)


def test_an_oom_killed_host_fails_the_cell_with_the_pods_reason(cluster, tmp_path):
    api, kubelets = cluster
    source = ("import os, time\n"
              "if os.environ['JOB_COMPLETION_INDEX'] == '1':\n"
              "    time.sleep(300)\n"
              "'done'")
    handle = kinetic_nb.submit(source, hosts=2, backend="kubernetes", storage=f"file://{tmp_path}/jobs", quiet=True)
    assert [kind for kind, _ in api.objects] == ["Job", "Secret", "Service", "Job"]  # the root first
    kubelet = start_pods(api, kubelets, tmp_path)

    def in_cell(index: int) -> bool:
        status = read_host_status(handle.storage, handle.key, index)
        return status is not None and status.phase == "execute"

    wait_for(lambda: in_cell(1), what="host 1 to run the cell")
    kubelet.kill(1, "OOMKilled")  # the node runs out of memory: no payload, no exit record from the host
    summaries = settle(handle, kubelet)
    assert summaries[1].describe() == "was killed by SIGKILL (OOMKilled)"
    with pytest.raises(JobFailedError, match=r"host 1 was killed by SIGKILL \(OOMKilled\)"):
        handle.result(timeout=30)
    assert api.objects == {}  # deleted by the client with the outcome


def test_each_pod_starts_its_hosts_processes_with_their_ranks_and_a_pods_end_is_theirs(cluster, tmp_path):
    """2 pods x 2 processes: each pod's agent starts two processes with their own ranks; when pod 1 is OOM-killed,
    both of its processes end with the pod's reason and the cell names the lower one."""
    api, kubelets = cluster
    source = ("import os, time\n"
              "print('rank', os.environ['RANK'], 'local', os.environ['LOCAL_RANK'], 'of', os.environ['WORLD_SIZE'],\n"
              "      'host', os.environ['KINETIC_HOST_INDEX'], flush=True)\n"
              "if os.environ['KINETIC_HOST_INDEX'] == '1':\n"
              "    time.sleep(300)\n"
              "'done'")
    handle = kinetic_nb.submit(source, hosts=2, procs_per_host=2, framework="none", backend="kubernetes",
                               storage=f"file://{tmp_path}/jobs", quiet=True)
    [job] = [job for job in api.created("Job") if not is_root(job)]
    assert job["spec"]["completions"] == 2  # a pod per host
    kubelet = start_pods(api, kubelets, tmp_path)

    said = [f"rank {rank} local {local} of 4 host {host}" for rank, (host, local) in enumerate([(0, 0), (0, 1),
                                                                                                (1, 0), (1, 1)])]

    def printed(rank: int) -> bool:
        kubelet.step()
        return said[rank] in handle.logs(rank)

    wait_for(lambda: all(printed(rank) for rank in range(4)), what="every process to say its rank")
    kubelet.kill(1, "OOMKilled")
    summaries = settle(handle, kubelet)
    assert sorted(summaries) == [0, 1, 2, 3]
    assert summaries[2].describe() == summaries[3].describe() == "was killed by SIGKILL (OOMKilled)"
    with pytest.raises(JobFailedError, match=r"host 1, process 0 \(rank 2\) was killed by SIGKILL \(OOMKilled\)"):
        handle.result(timeout=30)


def test_a_cell_imports_a_module_from_the_notebooks_folder_on_the_pods(cluster, tmp_path, monkeypatch, capsys):
    """The pods do not see this machine's disk: the notebook's folder travels with the job, and each host runs
    in its copy, with it first on sys.path, as the notebook does here."""
    api, kubelets = cluster
    notebook = tmp_path / "notebook"
    (notebook / "mylib").mkdir(parents=True)
    (notebook / "mylib" / "__init__.py").write_text("VALUE = 41\n")
    (notebook / "settings.txt").write_text("from the notebook's folder\n")
    monkeypatch.chdir(notebook)
    handle = kinetic_nb.submit("import os, mylib\n(mylib.VALUE + 1, open('settings.txt').read().strip(), "
                               "os.environ['JOB_COMPLETION_INDEX'])", hosts=2, backend="kubernetes",
                               storage=f"file://{tmp_path}/jobs")
    assert f"kinetic_nb: the hosts run in a copy of this notebook's folder {notebook} (2 files" in \
        capsys.readouterr().out  # a notice, on stdout: mylib/__init__.py, settings.txt and nothing else
    kubelet = start_pods(api, kubelets, tmp_path)
    settle(handle, kubelet)
    assert handle.result(timeout=30) == (42, "from the notebook's folder", "0")


def test_an_image_without_kinetic_nb_fails_the_cell_with_the_pods_last_lines(cluster, tmp_path):
    """No host ever uploads a log: what the cell shows comes from the pods' termination messages."""
    api, kubelets = cluster
    image_bin = tmp_path / "image-bin"  # the image's python: this interpreter without site-packages or PYTHONPATH
    image_bin.mkdir()
    (image_bin / "python").write_text(f'#!/bin/sh\nexec {sys.executable} -S -E "$@"\n')
    (image_bin / "python").chmod(0o755)
    handle = kinetic_nb.submit("1", hosts=2, backend="kubernetes", storage=f"file://{tmp_path}/jobs", quiet=True)
    kubelet = start_pods(api, kubelets, tmp_path, extra_env={"PATH": f"{image_bin}:/usr/bin:/bin"})
    summaries = settle(handle, kubelet)
    for index in range(2):
        assert summaries[index].exit_code == 1
        assert summaries[index].stderr_tail[-1].endswith("No module named 'kinetic_nb')")
    with pytest.raises(JobFailedError) as caught:
        handle.result(timeout=30)
    assert "ModuleNotFoundError: No module named 'kinetic_nb'" in str(caught.value)


def test_cancel_deletes_the_workload_and_stops_the_hosts(cluster, tmp_path):
    api, kubelets = cluster
    handle = kinetic_nb.submit("import time\ntime.sleep(300)", accelerator="tpu-v6e-2x4", backend="kubernetes",
                               storage=f"file://{tmp_path}/jobs", quiet=True)
    kubelet = start_pods(api, kubelets, tmp_path)
    wait_for(lambda: all(handle.storage.exists(protocol.host_status(index)) for index in range(2)),
             what="both hosts to start")
    # What handle.cancel() calls. handle.cancel() would then wait for the hosts' ends, which here come only
    # as the kubelet is stepped: settle() below steps it while asking the backend, as the poller does.
    handle.backend.cancel(handle.storage, handle.plan, "by the test", handle.key)  # deletes the root: the LWS and pods go too
    assert api.objects == {}
    assert all(process.poll() is not None for process in kubelet.processes.values())
    assert json.loads(read_record(handle.storage, handle.key, protocol.CANCEL))["reason"] == "by the test"
    summaries = settle(handle, kubelet)
    assert all(summary.stopped for summary in summaries.values())
    assert str(handle.status()) == "CANCELLED"


def test_submit_without_an_image_in_the_custom_mode_stores_nothing(cluster, tmp_path, monkeypatch):
    api, _ = cluster
    monkeypatch.delenv("KINETIC_IMAGE")
    monkeypatch.setenv("KINETIC_IMAGE_MODE", "custom")
    with pytest.raises(ValueError, match=r"give image=IMAGE \(--image in %%kinetic\) or set KINETIC_IMAGE"):
        kinetic_nb.submit("1", accelerator="tpu-v5e-16", backend="kubernetes", storage=f"file://{tmp_path}/jobs")
    assert not (tmp_path / "jobs").exists() and api.objects == {}


def test_local_storage_is_warned_about(cluster, tmp_path):
    with pytest.warns(KineticWarning, match="the pods reach it only if the same path is mounted"):
        handle = kinetic_nb.submit("1", backend="kubernetes", storage=f"file://{tmp_path}/jobs", quiet=True)
    handle.backend.cleanup(handle.plan)


def test_attach_from_another_kernel_finds_the_jobs_namespace(cluster, tmp_path, monkeypatch):
    """handle.json records where a cluster job lives; attach() uses it, whatever this kernel's settings."""
    from kinetic_nb.client import catalog

    _api, _kubelets = cluster  # the fake API server the submit creates its objects in
    handle = kinetic_nb.submit("1", accelerator="tpu-v5e-16", backend="kubernetes", storage=f"file://{tmp_path}/jobs",
                               quiet=True, backend_options={"namespace": "team-a"})
    record = json.loads(read_sealed(handle.storage, "handle.json", handle.key))  # signed: it says where to look
    assert record["backend_options"]["namespace"] == "team-a"
    monkeypatch.setenv("KINETIC_NAMESPACE", "somewhere-else")  # another kernel, set up differently
    again = catalog.attach(handle.job_id, storage=f"file://{tmp_path}/jobs")
    assert again.backend.name == "kubernetes" and again.backend.settings.namespace == "team-a"
    handle.backend.cleanup(handle.plan)


@pytest.mark.parametrize("pending", [None, "1800"])
def test_the_start_barrier_and_the_frameworks_init_wait_as_long_as_a_pod_may_be_pending(cluster, tmp_path,
                                                                                        monkeypatch, pending):
    """GPU Indexed Job pods can be scheduled one by one: a host that started first must not give up on the
    others while the backend still waits for their nodes."""
    from kinetic_nb.client.plan import DEFAULT_BARRIER_TIMEOUT_S
    from kinetic_nb.runner.frameworks import jax_arguments

    if pending:
        monkeypatch.setenv("KINETIC_PENDING_TIMEOUT", pending)
    handle = kinetic_nb.submit("1", hosts=2, backend="kubernetes", storage=f"file://{tmp_path}/jobs", quiet=True)
    limit = handle.backend.settings.pending_timeout_s
    assert limit == (float(pending) if pending else 45 * 60)
    assert handle.plan.barrier_timeout_s == DEFAULT_BARRIER_TIMEOUT_S + limit
    assert jax_arguments(handle.plan, 1, "h:1")["initialization_timeout"] >= limit
    stored = read_sealed(handle.storage, protocol.PLAN, handle.key)
    assert json.loads(stored)["barrier_timeout_s"] == handle.plan.barrier_timeout_s  # what every host reads
    handle.cancel()
