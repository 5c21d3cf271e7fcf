"""A slice of hosts x processes on real local processes: each process's rank, the frameworks across them, the
outcome rules over ranks, and how the default number of processes per host is chosen."""

from __future__ import annotations

import pytest

import kinetic_nb
from kinetic_nb.accelerators import resolve_accelerator
from kinetic_nb.client.plan import choose_procs_per_host
from kinetic_nb.errors import JobFailedError

from .ddp_check import DDP_TRAIN, flat, full_batch_parameters

#: Every process's view of itself, gathered to the leader: its environment's ranks and torch's.
RANKS = (
    "import os, torch.distributed as dist\n"
    "mine = {name: os.environ[name] for name in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'LOCAL_WORLD_SIZE',\n"
    "        'GROUP_RANK', 'KINETIC_HOST_INDEX', 'MASTER_ADDR', 'MASTER_PORT')}\n"
    "mine['torch_rank'] = dist.get_rank()\n"
    "everyone = [None] * dist.get_world_size()\n"
    "dist.all_gather_object(everyone, mine)\n"
    "everyone\n"
)


def test_torch_on_a_simulated_gpu_slice_runs_one_process_per_gpu(capfd):
    handle = kinetic_nb.submit(RANKS, accelerator="gpu-h100x2", hosts=2, framework="torch")
    everyone = handle.result()
    assert handle.plan.procs_per_host == 2 and handle.plan.world_size == 4
    assert "gpu-h100x2 is simulated locally: 2 hosts x 2 processes (4 in all) x 1 CPU device each." in capfd.readouterr().out
    assert [(p["RANK"], p["LOCAL_RANK"], p["GROUP_RANK"], p["KINETIC_HOST_INDEX"], p["torch_rank"]) for p in everyone] \
        == [("0", "0", "0", "0", 0), ("1", "1", "0", "0", 1), ("2", "0", "1", "1", 2), ("3", "1", "1", "1", 3)]
    assert {(p["WORLD_SIZE"], p["LOCAL_WORLD_SIZE"]) for p in everyone} == {("4", "2")}
    assert len({(p["MASTER_ADDR"], p["MASTER_PORT"]) for p in everyone}) == 1
    assert [host.index for host in handle.hosts()] == [0, 1, 2, 3]
    assert "2 hosts x 2 processes" in handle.summary()


def test_torch_ddp_across_two_hosts_of_two_processes_agrees_with_one_process():
    """Data-parallel SGD on 4 shards (2 hosts x 2 processes, gloo) ends where full-batch SGD in one process does."""
    world, distributed = kinetic_nb.submit(DDP_TRAIN, hosts=2, procs_per_host=2, framework="torch").result()
    assert world == 4
    assert flat(distributed) == pytest.approx(flat(full_batch_parameters()), abs=1e-6)


def test_jax_with_two_processes_per_host_counts_four():
    source = (
        "import jax, jax.numpy as jnp\n"
        "from jax.experimental import multihost_utils\n"
        "ids = multihost_utils.process_allgather(jnp.array([jax.process_index()]))\n"
        "(jax.process_count(), jax.device_count(), jax.local_device_count(), ids.ravel().tolist())\n"
    )
    handle = kinetic_nb.submit(source, hosts=2, procs_per_host=2, framework="jax")
    assert handle.result() == (4, 4, 1, [0, 1, 2, 3])


def test_the_lowest_failing_rank_is_raised_and_named_by_host_and_process():
    source = (
        "import os, time\n"
        "rank = int(os.environ['RANK'])\n"
        "if rank == 3:\n"
        "    raise KeyError('rank three')\n"
        "if rank == 2:\n"
        "    raise ValueError('rank two')\n"
        "time.sleep(30)\n"
    )
    handle = kinetic_nb.submit(source, hosts=2, procs_per_host=2, framework="none", grace=1)
    with pytest.raises(ValueError, match="rank two") as info:
        handle.result()
    notes = "\n".join(info.value.__notes__)
    assert f"Reported by host 1, process 0 (rank 2) of job {handle.job_id}." in notes
    assert "Other ranks that also reported a failure: 3." in notes
    handle.wait(timeout=60)
    states = [host.state for host in handle.hosts()]
    assert states[2:] == ["failed", "failed"] and set(states[:2]) == {"stopped"}


def test_a_process_that_dies_without_a_payload_is_named_with_its_host():
    source = "import os, signal, time\nif os.environ['RANK'] == '1':\n    os.kill(os.getpid(), signal.SIGKILL)\ntime.sleep(30)\n"
    handle = kinetic_nb.submit(source, hosts=1, procs_per_host=2, framework="none", grace=1)
    with pytest.raises(JobFailedError, match=r"host 0, process 1 \(rank 1\) .*SIGKILL"):
        handle.result()
    handle.wait(timeout=60)


@pytest.mark.parametrize(
    ("accelerator", "framework", "requested", "expected"),
    [
        ("gpu-h100x8", "torch", None, 8),  # torch: one process per GPU
        ("gpu-h100x8", "jax", None, 1),  # JAX: one process drives every local device
        ("gpu-h100x8", "jax", 8, 8),  # ... or one per GPU when asked
        ("gpu-h100x8", "none", None, 1),
        ("gpu-h100x8", "auto", None, 1),  # a session choosing at its first cell: one unless told
        ("tpu-v5e-16", "torch", None, 1),  # a TPU host's chips are one process's
        ("tpu-v5e-16", "jax", 1, 1),
        ("cpu", "torch", None, 1),
        ("cpu", "torch", 3, 3),
    ],
)
def test_the_framework_decides_the_default_processes_per_host(accelerator, framework, requested, expected):
    assert choose_procs_per_host(resolve_accelerator(accelerator), framework, requested) == expected


@pytest.mark.parametrize(
    ("accelerator", "requested", "message"),
    [
        ("gpu-h100x8", 3, "3 processes per host do not divide the 8 GPUs of a gpu-h100x8 host"),
        ("tpu-v5e-16", 2, "2 processes per host: tpu-v5e-16 hosts run one process each"),
        ("cpu", 0, "procs_per_host must be at least 1, got 0"),
    ],
)
def test_a_shape_that_cannot_be_is_one_line(accelerator, requested, message):
    with pytest.raises(ValueError, match=message) as info:
        choose_procs_per_host(resolve_accelerator(accelerator), "torch", requested)
    assert "\n" not in str(info.value)


def test_a_session_keeps_every_process_namespace_from_cell_to_cell():
    session = kinetic_nb.start(hosts=2, procs_per_host=2, framework="torch", idle_timeout=600, echo=False)
    try:
        assert session.plan.world_size == 4
        session.run("import os\nmine = int(os.environ['RANK']) * 10").result()
        gather = ("import torch.distributed as dist\neveryone = [None] * dist.get_world_size()\n"
                  "dist.all_gather_object(everyone, mine)\neveryone")
        assert session.run(gather).result() == [0, 10, 20, 30]
        with pytest.raises(KeyError, match="rank 3 only"):
            session.run("import os\nif os.environ['RANK'] == '3':\n    raise KeyError('rank 3 only')").result()
        assert session.run("mine + 1").result() == 1  # the failed cell kept the session and its namespaces
    finally:
        session.stop()
