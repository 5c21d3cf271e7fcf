"""A kubernetes session on a bucket: its cells travel through the hub beside host 0's agent, reached at host 0's
pod address from inside the cluster's network and through the API server's port-forward from outside it.

The pods are real agents and runners (``FakeKubelet``), storage is fake-gcs-server, the API's objects are
``FakeKubernetes``'s, and the port-forward is the official client's, spoken to a stand-in of the API server's
``pods/portforward`` (``k8s_port_forward``). "Outside the cluster" is a pod address that does not answer here
(192.0.2.1, a documentation address no machine has), as a pod address does not from a laptop.
"""

from __future__ import annotations

import os
import socket
import threading
from types import SimpleNamespace

import pytest

import kinetic_nb
from kinetic_nb.backends.kubernetes import backend as k8s
from kinetic_nb.backends.kubernetes.port_forward import pod_port_forward
from kinetic_nb.backends.kubernetes.settings import DEFAULT_COORDINATOR_PORT
from kinetic_nb.errors import KineticError
from kinetic_nb.runner import protocol
from kinetic_nb.runner.channel import CHANNEL_ENV

from .k8s_cluster import FakeKubelet, FakeKubernetes, session_on_pods, wait_for
from .k8s_port_forward import PortForwardServer

NAMESPACE = "ml-team"
HOSTS = 3
CHANNEL_PORT = DEFAULT_COORDINATOR_PORT + 1
UNREACHABLE = "192.0.2.1"


@pytest.fixture
def cluster(monkeypatch, tmp_path, gcs_root):
    """A session on ``gcs_root`` on the kubernetes backend, started once its pods are played; ``start(pod_ip)``
    gives the session, and the kubelet. The pods' processes are proven gone afterwards."""
    api = FakeKubernetes()
    monkeypatch.setattr(k8s, "connect", lambda settings: api)
    monkeypatch.setenv("KINETIC_IMAGE", "registry.example/kinetic-jax:test")
    monkeypatch.setenv("KINETIC_NAMESPACE", NAMESPACE)
    forward = PortForwardServer(NAMESPACE)
    api.core.connect_get_namespaced_pod_portforward = forward.core().connect_get_namespaced_pod_portforward
    kubelets: list[FakeKubelet] = []

    def start(pod_ip: str, **options):
        (tmp_path / "pods").mkdir(exist_ok=True)
        session, kubelet = session_on_pods(api, lambda: kinetic_nb.start(
            hosts=HOSTS, backend="kubernetes", storage=gcs_root, framework="none", idle_timeout=600, echo=False,
            quiet=True, ready_timeout=120), str(tmp_path / "pods"), pod_ip=pod_ip,
            extra_env={"STORAGE_EMULATOR_HOST": os.environ["STORAGE_EMULATOR_HOST"]}, **options)
        kubelets.append(kubelet)
        forward.pods = {pod["metadata"]["name"]: "127.0.0.1" for pod in kubelet.pods}  # where the kubelet dials
        return session, kubelet

    yield start, forward
    for kubelet in kubelets:
        kubelet.close()
        assert all(process.poll() is not None for process in kubelet.processes.values())
    forward.close()


def test_the_port_forward_carries_bytes_both_ways_and_says_why_it_is_refused():
    """The official client's port-forward, to the API server's stand-in: bytes both ways (more than one frame),
    the forward's end when the pod's port is closed, and a refusal in one line with the API's words."""
    echo = socket.create_server(("127.0.0.1", 0))
    port = echo.getsockname()[1]

    def serve() -> None:
        connection, _ = echo.accept()
        while data := connection.recv(1 << 16):
            connection.sendall(data.upper())
        connection.close()

    threading.Thread(target=serve, daemon=True).start()
    server = PortForwardServer(NAMESPACE, {"kn-x-0": "127.0.0.1"})
    api = SimpleNamespace(core=server.core())
    try:
        with socket.create_connection(pod_port_forward(api, NAMESPACE, "kn-x-0", port)) as local:
            local.sendall(b"a" * 300_000)
            received = b""
            while len(received) < 300_000:
                received += local.recv(1 << 16)
            assert received == b"A" * 300_000
        with pytest.raises(KineticError, match=rf'^no port-forward to pod {NAMESPACE}/kn-y-0:{port} through the '
                                               r'Kubernetes API \(404 pods "kn-y-0" not found\)$'):
            pod_port_forward(api, NAMESPACE, "kn-y-0", port)
        server.forbidden = True
        with pytest.raises(KineticError, match=r'\(403 pods "kn-x-0" is forbidden: .*pods/portforward'):
            pod_port_forward(api, NAMESPACE, "kn-x-0", port)
        server.forbidden = False
        echo.close()  # nothing listens on the pod's port now: the forward ends, and the local end with it
        with socket.create_connection(pod_port_forward(api, NAMESPACE, "kn-x-0", port)) as local:
            local.settimeout(10)
            assert local.recv(10) == b""
    finally:
        server.close()
    wait_for(lambda: not [thread for thread in threading.enumerate() if thread.name.startswith("kinetic-port")],
             timeout=10, what="the forwards' threads to end")


def _run_cells(session) -> None:
    """The outcome rules and the hosts' output hold on the channel: a value, a worker's failure, a value after."""
    assert session.run("import os\nx = 1\nprint('on', os.environ['KINETIC_HOST_INDEX'])").result(timeout=60) is None
    # The hosts met at the cell's barrier through the channel (every pod's agent had joined the hub).
    assert session.channel.mirror.get(f"{protocol.cell_dir(1)}/{protocol.cell_ready(HOSTS - 1)}") == b""
    failing = session.run("if os.environ['KINETIC_HOST_INDEX'] != '0':\n"
                          "    print('about to fail')\n    raise ValueError('bad on ' + os.environ['KINETIC_HOST_INDEX'])")
    with pytest.raises(ValueError, match="bad on 1"):
        failing.result(timeout=60)
    assert "about to fail" in failing.logs(2)  # a worker's output came through its agent's link
    assert session.run("x + 1").result(timeout=60) == 2
    assert session.channel.broken is None


@pytest.mark.parametrize("where", ["in the cluster", "outside it"])
def test_a_session_on_a_bucket_reaches_the_hub_on_host_0s_pod(cluster, where):
    """From the cluster's network the notebook dials host 0's pod address; from outside it, it goes through a
    port-forward by the API server, as ``kubectl port-forward`` does; either way the cells skip the bucket."""
    start, forward = cluster
    session, kubelet = start("127.0.0.1" if where == "in the cluster" else UNREACHABLE)
    try:
        _run_cells(session)
        peer = session.channel.link.sock.getpeername()
        if where == "in the cluster":
            assert peer == ("127.0.0.1", CHANNEL_PORT) and forward.opened == 0
        else:  # the forward's local end, one stream through the API server
            assert peer[1] != CHANNEL_PORT and forward.opened == 1
    finally:
        session.stop()
    wait_for(lambda: (kubelet.step(), all(process.poll() is not None for process in kubelet.processes.values()))[1],
             timeout=60, what="the session's pods to end")


def test_a_refused_port_forward_is_said_once_and_the_cells_go_through_storage(cluster, capsys):
    """Credentials that may not create ``pods/portforward``: the first cell says so in one line, naming the pod
    and the API's own words, and the session's cells travel through storage, by the same rules."""
    start, forward = cluster
    forward.forbidden = True
    session, kubelet = start(UNREACHABLE)
    try:
        assert session.run("x = 41").result(timeout=60) is None
        assert session.run("x + 1").result(timeout=60) == 42
        assert session.channel is None
        said = [line for line in capsys.readouterr().err.splitlines() if "direct channel" in line]
        assert len(said) == 1, said
        assert "pods/portforward" in said[0] and "403" in said[0] and f"{NAMESPACE}/" in said[0]
    finally:
        session.stop()
    wait_for(lambda: (kubelet.step(), all(process.poll() is not None for process in kubelet.processes.values()))[1],
             timeout=60, what="the session's pods to end")


def test_a_host_that_cannot_reach_the_hub_keeps_every_host_on_storage(cluster, capsys):
    """A NetworkPolicy that lets the pods reach host 0's coordinator but not its hub's port: host 2 cannot join,
    so the leader's verdict keeps every host on storage (no barrier waits on a channel a host is not on); the
    notebook says so once, and the cells run by the usual rules, a worker's failure included."""
    start, _ = cluster
    blocked = {2: {CHANNEL_ENV: f"127.0.0.1:{_closed_port()}"}}  # its way to the hub's port goes nowhere
    session, kubelet = start("127.0.0.1", pod_env=blocked)
    try:
        assert session.run("import os\nx = 1").result(timeout=60) is None
        failing = session.run("if os.environ['KINETIC_HOST_INDEX'] == '2':\n    raise ValueError('bad on 2')")
        with pytest.raises(ValueError, match="bad on 2"):
            failing.result(timeout=60)
        assert session.run("x + 1").result(timeout=60) == 2
        assert session.channel is None
        said = [line for line in capsys.readouterr().err.splitlines() if "direct channel" in line]
        assert said == [f"kinetic_nb: session {session.session_id}'s direct channel: not every host of the session "
                        "could join it; its cells travel through storage (tried again after 60 s)"], said
        # The host that could not join says why, in its own log.
        wait_for(lambda: "no channel to the session's hub" in session.group.logs(2), timeout=30,
                 what="host 2's word on the channel in its log")
    finally:
        session.stop()
    wait_for(lambda: (kubelet.step(), all(process.poll() is not None for process in kubelet.processes.values()))[1],
             timeout=60, what="the session's pods to end")


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
