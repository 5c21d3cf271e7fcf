"""The ray backend on a real 4-node Ray cluster on this machine (the ``ray_cluster`` fixture).

Hosts are actors placed one per node; each runs the same agent and runner as
every other backend. These tests check what a user relies on: the hosts are
on different nodes, JAX and torch collectives work across them, the seed's
outcome rules hold, an actor or node that dies is that host's end, a session
lives across cells, and nothing of ours is left in the cluster.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import tempfile
import time

import pytest

import kinetic_nb
from kinetic_nb.agent.ray_host import RayHost, StorageNotSharedError
from kinetic_nb.backends import get_backend
from kinetic_nb.backends.ray import backend as ray_backend
from kinetic_nb.backends.ray.backend import RAY_NAMESPACE, actor_name, connect
from kinetic_nb.errors import JobFailedError, KineticError
from kinetic_nb.runner import protocol
from kinetic_nb.runner.protocol import ExitSummary
from kinetic_nb.runner.records import read_exit
from kinetic_nb.state import JobStatus

NODE_IDS = """
import os, numpy as np
node = np.frombuffer(bytes.fromhex(os.environ["KINETIC_RAY_NODE_ID"]), dtype=np.uint8)
"""


def submit(cluster, source: str, hosts: int = 4, **options):
    backend_options = {"address": cluster.address, **options.pop("backend_options", {})}
    return kinetic_nb.submit(source, hosts=hosts, backend="ray", backend_options=backend_options, quiet=True,
                             **options)


def exit_record(handle, index: int) -> ExitSummary:
    return read_exit(handle.storage, handle.key, index)


def test_four_hosts_on_four_nodes_allgather_with_jax(ray_cluster):
    cell = NODE_IDS + """
import jax, jax.numpy as jnp
from jax.experimental import multihost_utils
nodes = multihost_utils.process_allgather(node)
total = multihost_utils.process_allgather(jnp.ones(2) * jax.process_index()).sum()
(float(total), jax.process_count(), [bytes(row).hex() for row in nodes])
"""
    total, processes, nodes = submit(ray_cluster, cell).result(timeout=300)
    assert (total, processes) == (12.0, 4)
    assert len(set(nodes)) == 4 and set(nodes) == {node["NodeID"] for node in ray_cluster.alive_nodes()}


def test_four_hosts_on_four_nodes_all_reduce_with_torch(ray_cluster):
    cell = """
import os, torch, torch.distributed as dist
value = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(value)
nodes = [None] * dist.get_world_size()
dist.all_gather_object(nodes, os.environ["KINETIC_RAY_NODE_ID"])
(value.item(), sorted(nodes))
"""
    total, nodes = submit(ray_cluster, cell).result(timeout=300)
    assert total == 10.0
    assert nodes == sorted(node["NodeID"] for node in ray_cluster.alive_nodes())


def test_each_hosts_actor_starts_its_processes_with_their_ranks_on_its_node(ray_cluster):
    cell = """
import os, torch, torch.distributed as dist
mine = (dist.get_rank(), os.environ["LOCAL_RANK"], os.environ["KINETIC_HOST_INDEX"], os.environ["KINETIC_RAY_NODE_ID"])
everyone = [None] * dist.get_world_size()
dist.all_gather_object(everyone, mine)
everyone
"""
    handle = submit(ray_cluster, cell, hosts=2, procs_per_host=2, framework="torch")
    everyone = handle.result(timeout=300)
    assert [entry[:3] for entry in everyone] == [(0, "0", "0"), (1, "1", "0"), (2, "0", "1"), (3, "1", "1")]
    nodes = [entry[3] for entry in everyone]
    assert nodes[0] == nodes[1] != nodes[2] == nodes[3]  # a host's processes share its node
    assert [host.state for host in handle.hosts()] == ["succeeded"] * 4


def test_a_worker_failing_after_the_leader_succeeded_fails_the_cell(ray_cluster):
    cell = ("import os, time\nif os.environ['KINETIC_HOST_INDEX'] == '2':\n    time.sleep(1)\n"
            "    raise ValueError('shard 2 is corrupt')\n'leader value'")
    handle = submit(ray_cluster, cell)
    with pytest.raises(ValueError, match="shard 2 is corrupt") as raised:
        handle.result(timeout=300)
    assert any("Reported by host 2" in note for note in raised.value.__notes__)
    assert handle.status() is JobStatus.FAILED


def test_two_failing_hosts_raise_the_lower_ones_and_name_the_other(ray_cluster):
    cell = "import os\nindex = int(os.environ['KINETIC_HOST_INDEX'])\nif index in (1, 3):\n    raise KeyError(index)"
    with pytest.raises(KeyError) as raised:
        submit(ray_cluster, cell).result(timeout=300)
    assert raised.value.args == (1,)
    assert any("Reported by host 1" in note and "3" in note.split("Other hosts")[1] for note in raised.value.__notes__)


def test_the_leaders_own_failure_is_raised(ray_cluster):
    cell = "import os\nif os.environ['KINETIC_HOST_INDEX'] == '0':\n    raise RuntimeError('leader broke')\n1"
    with pytest.raises(RuntimeError, match="leader broke"):
        submit(ray_cluster, cell).result(timeout=300)


def test_a_killed_actor_is_its_hosts_end(ray_cluster):
    ray = connect(ray_cluster.address)
    handle = submit(ray_cluster, "import time\ntime.sleep(600)", grace=2)
    _wait_for_running(handle, 4)
    ray.kill(ray.get_actor(actor_name(handle.job_id, 1), namespace=RAY_NAMESPACE), no_restart=True)
    with pytest.raises(JobFailedError, match="host 1"):
        handle.result(timeout=300)
    assert exit_record(handle, 1).reason.startswith("actor died: ")
    assert handle.wait(timeout=300) is JobStatus.FAILED
    # The killed actor's agent died with it (its parent-death signal), its scratch folder left behind: the next
    # job's agents sweep it. The others' agents said they were stopping their hosts: nothing of what they said stays.
    assert submit(ray_cluster, "41 + 1").result(timeout=300) == 42
    assert ray_cluster.wait_until_nothing_is_left() == []
    assert _agents_files(handle.job_id) == []


def test_a_killed_worker_node_names_its_host_lost_and_comes_back(ray_cluster):
    cell = "import os, time\nprint(os.environ['KINETIC_RAY_NODE_ID'], flush=True)\ntime.sleep(600)"
    handle = submit(ray_cluster, cell, grace=2)
    _wait_for_running(handle, 4)
    head = next(node["NodeID"] for node in ray_cluster.alive_nodes() if "node:__internal_head__" in node["Resources"])
    victim = next(index for index in range(1, 4) if _node_of_host(handle, index) != head)
    node_id = _node_of_host(handle, victim)
    ray_cluster.kill_node(node_id)
    try:
        with pytest.raises(JobFailedError, match=f"host {victim}"):
            handle.result(timeout=300)
        assert exit_record(handle, victim).reason.startswith("node lost: ")
    finally:
        ray_cluster.add_node()
        ray_cluster.wait_for_nodes(4)
    assert node_id not in {node["NodeID"] for node in ray_cluster.alive_nodes()}


def test_cancel_stops_every_host(ray_cluster):
    handle = submit(ray_cluster, "import time\ntime.sleep(600)")
    _wait_for_running(handle, 4)
    handle.cancel("enough")
    assert handle.wait(timeout=300) is JobStatus.CANCELLED
    assert [host.state for host in handle.hosts()] == ["stopped"] * 4
    assert ray_cluster.wait_until_nothing_is_left() == []
    assert _agents_files(handle.job_id) == []  # each agent said it was stopping its host: nothing of it stays


def test_a_placement_group_that_cannot_be_placed_waits_with_its_reason_then_fails(ray_cluster):
    handle = submit(ray_cluster, "1", hosts=1, accelerator="gpu-l4x1", backend_options={"pending_timeout_s": 5})
    deadline = time.monotonic() + 120
    while not (waiting := [host.message for host in handle.snapshot().hosts if host.message]):
        assert time.monotonic() < deadline, "no pending reason shown"
        time.sleep(0.2)
    assert "placement group" in waiting[0] and "GPU: 1" in waiting[0]
    with pytest.raises(JobFailedError, match="not placed within 5 s"):
        handle.result(timeout=300)


def test_more_hosts_than_nodes_is_refused_in_one_line(ray_cluster):
    with pytest.raises(ValueError, match=r"5 hosts need 5 Ray nodes .* --ray-pack") as refused:
        submit(ray_cluster, "1", hosts=5)
    assert "\n" not in str(refused.value)


def test_ray_pack_runs_more_hosts_than_the_cluster_has_cpus_spread_over_every_node(ray_cluster):
    cell = "import os\nprint(os.environ['KINETIC_RAY_NODE_ID'], flush=True)\nint(os.environ['KINETIC_HOST_INDEX'])"
    handle = submit(ray_cluster, cell, hosts=8, framework="none", backend_options={"pack": True})
    assert handle.result(timeout=300) == 0  # 8 hosts on 4 nodes of 1 CPU each
    nodes = [handle.logs(index).split()[0] for index in range(8)]
    assert sorted(set(nodes)) == sorted(node["NodeID"] for node in ray_cluster.alive_nodes())


def test_no_cluster_is_one_line_that_says_how_to_start_one(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **options: (_ for _ in ()).throw(ConnectionError("no cluster")))
    with pytest.raises(KineticError, match=r"no Ray cluster at auto: start one with `ray start --head`"):
        get_backend("ray", address="auto").preflight(None)


def test_storage_a_node_does_not_share_is_refused_in_one_line(tmp_path):
    missing = f"file://{tmp_path}/elsewhere/kn-1"
    with pytest.raises(StorageNotSharedError, match="do not share that path; use --storage gs://"):
        _HostOnNode().start(missing, b"{}", 0, "127.0.0.2:1", {})


def test_a_session_keeps_its_hosts_across_cells_and_survives_a_failure_and_an_interrupt(ray_cluster):
    session = kinetic_nb.start(hosts=4, backend="ray", framework="jax", idle_timeout=600, echo=False,
                               backend_options={"address": ray_cluster.address})
    try:
        assert session.run("import os\nkept = os.environ['KINETIC_RAY_NODE_ID']\nlen(kept)").result() == 56
        cell = ("import jax, jax.numpy as jnp\nfrom jax.experimental import multihost_utils\n"
                "float(multihost_utils.process_allgather(jnp.ones(1) * jax.process_index()).sum())")
        assert session.run(cell).result() == 6.0
        assert session.run("len(kept)").result() == 56  # the hosts' namespaces live across cells
        with pytest.raises(ValueError, match="bad"):
            session.run("import os\nif os.environ['KINETIC_HOST_INDEX'] == '3':\n    raise ValueError('bad')").result()
        sleeping = session.run("import time\ntime.sleep(600)")
        time.sleep(1)
        sleeping.interrupt()
        with pytest.raises(KeyboardInterrupt):
            sleeping.result()
        assert session.ended() is None
        assert session.run("len(kept)").result() == 56
    finally:
        session.stop()
    assert session.ended() is not None
    assert ray_cluster.wait_until_nothing_is_left() == []
    assert _agents_files(session.session_id) == []


@pytest.mark.parametrize("route", ["on the cluster's network", "through host 0's actor"])
def test_a_session_on_a_bucket_runs_its_cells_through_the_hub_on_host_0s_node(ray_cluster, gcs_root, route,
                                                                              monkeypatch):
    """On ``gs://`` a Ray session's cells skip the bucket: host 0's agent listens on its node, every other host
    and agent joins it, and the notebook reaches it there, or, where it cannot dial the node (off the cluster's
    network, on Ray Client), through calls to host 0's actor; the outcome rules and the hosts' output hold."""
    if route != "on the cluster's network":  # as from off the cluster's network: the node's address does not answer
        monkeypatch.setattr(ray_backend, "answers", lambda address: False)
    # The cluster's processes were started without the emulator's address: the hosts get it as a -e value.
    session = kinetic_nb.start(hosts=4, backend="ray", framework="none", storage=gcs_root, idle_timeout=600,
                               echo=False, backend_options={"address": ray_cluster.address},
                               env={"STORAGE_EMULATOR_HOST": os.environ["STORAGE_EMULATOR_HOST"]})
    try:
        assert session.run("import os\nx = 1\nprint('on', os.environ['KINETIC_HOST_INDEX'])").result() is None
        assert session.channel is not None and session.channel.broken is None
        announced = session._announced
        if route == "on the cluster's network":  # host 0's node, not this machine's 127.0.0.1
            assert session.channel.link.sock.getpeername() == announced and announced[0] == "127.0.0.2"
        else:  # the local end of the pipe through host 0's actor
            assert session.channel.link.sock.getpeername()[0] == "127.0.0.1"
        # The hosts met at the cell's barrier through the channel (every agent had joined the hub).
        assert session.channel.mirror.get(f"{protocol.cell_dir(1)}/{protocol.cell_ready(3)}") == b""
        failing = session.run("if os.environ['KINETIC_HOST_INDEX'] in ('2', '3'):\n"
                              "    print('about to fail')\n    raise ValueError('bad on ' + os.environ['KINETIC_HOST_INDEX'])")
        with pytest.raises(ValueError, match="bad on 2"):
            failing.result()
        assert "about to fail" in failing.logs(3)  # a worker's output came through its agent's link
        assert session.run("x + 1").result() == 2
        assert session.channel.broken is None
    finally:
        session.stop()
        # The actors themselves cannot reach the emulator (only the hosts got its address), so the last one
        # cannot see every host's end and remove the placement group, as it does on a bucket it can read.
        session.group.backend.cleanup(session.plan)
    assert ray_cluster.wait_until_nothing_is_left() == []


def test_a_cell_imports_a_module_from_the_notebooks_folder_on_the_nodes(ray_cluster, tmp_path, monkeypatch):
    """A Ray node does not see the notebook's folder (its workers run elsewhere): the folder travels with the
    job, and each host runs in its copy."""
    (tmp_path / "mylib.py").write_text("VALUE = 41\n")
    monkeypatch.chdir(tmp_path)
    handle = submit(ray_cluster, "import os, mylib\n(mylib.VALUE + 1, os.getcwd() != " + repr(str(tmp_path)) + ")",
                    hosts=2)
    assert handle.result(timeout=300) == (42, True)


def test_nothing_of_ours_is_left_in_the_cluster(ray_cluster):
    assert submit(ray_cluster, "41 + 1").result(timeout=300) == 42
    assert ray_cluster.wait_until_nothing_is_left() == []


def test_an_agents_last_lines_are_read_as_it_goes_on_writing(tmp_path):
    host = RayHost()
    with tempfile.TemporaryFile(dir=tmp_path) as output:  # as start() gives the agent its output
        host.agent_output = output
        writer = subprocess.Popen([sys.executable, "-c", "import sys\nfor i in range(20):\n    print(f'line {i}')\n"
                                   "sys.stdout.flush()\nsys.stdin.readline()\nprint('after', flush=True)"],
                                  stdin=subprocess.PIPE, stdout=output, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + 30
            while host._agent_tail()[-1:] != ["line 19"]:
                assert time.monotonic() < deadline, host._agent_tail()
                time.sleep(0.01)
            assert host._agent_tail() == [f"line {i}" for i in range(12, 20)]
            writer.stdin.write("\n")
            writer.stdin.close()
            assert writer.wait(timeout=30) == 0
            assert host._agent_tail()[-2:] == ["line 19", "after"]  # written after the reads, after the rest
        finally:
            writer.kill()
            writer.wait()
    assert host._agent_tail() == []  # closed: the actor is being ended


# -- helpers ----------------------------------------------------------------------------------


class _HostOnNode(RayHost):
    def where(self) -> dict[str, str]:
        return {"node_id": "ab" * 28, "address": "127.0.0.2"}


def _agents_files(job_id: str) -> list[str]:
    """What the hosts' actors left in this machine's temporary folder (every node's) of job ``job_id``."""
    return glob.glob(os.path.join(tempfile.gettempdir(), f"kinetic-{job_id}-*"))


def _wait_for_running(handle, hosts: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while sum(host.state == "running" and host.phase == "execute" for host in handle.snapshot().hosts) < hosts:
        assert time.monotonic() < deadline, f"hosts not running: {handle.snapshot().hosts}"
        time.sleep(0.2)


def _node_of_host(handle, index: int) -> str:
    deadline = time.monotonic() + 60
    while not (text := handle.logs(index).strip()):
        assert time.monotonic() < deadline, f"host {index} printed nothing"
        time.sleep(0.2)
    return text.splitlines()[0].strip()


def test_an_address_where_no_cluster_listens_is_one_line_at_once(monkeypatch):
    import socket

    import ray

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.2", 0))
        address = f"127.0.0.2:{probe.getsockname()[1]}"
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **options: pytest.fail("Ray would retry for minutes, then exit"))
    with pytest.raises(KineticError, match=rf"no Ray cluster at {address}: start one with `ray start --head`"):
        get_backend("ray", address=address).preflight(None)
