"""Where a job's hosts go on a Ray cluster, as pure functions of the accelerator and the host count (no cluster)."""

from __future__ import annotations

import pytest

from kinetic_nb.accelerators import resolve_accelerator
from kinetic_nb.backends.ray.placement import CPUS_PER_HOST, SHARED_CPUS_PER_HOST, host_bundles


def test_a_host_holds_a_whole_cpu_and_its_accelerators():
    assert host_bundles(resolve_accelerator("cpu"), 2) == [{"CPU": CPUS_PER_HOST}] * 2
    assert host_bundles(resolve_accelerator("gpu-l4x1"), 1) == [{"CPU": CPUS_PER_HOST, "GPU": 1}]


def test_host_0_of_a_tpu_slice_asks_for_the_slice_head():
    bundles = host_bundles(resolve_accelerator("tpu-v5e-16"), 4)
    assert bundles[0] == {"CPU": CPUS_PER_HOST, "TPU": 4, "TPU-v5litepod-16-head": 1}
    assert bundles[1:] == [{"CPU": CPUS_PER_HOST, "TPU": 4}] * 3


@pytest.mark.parametrize(("name", "head"), [
    ("tpu-v5p-16", "TPU-v5p-16-head"),  # Cloud TPU's accelerator type: 16 TensorCores, 8 chips
    ("tpu-v4-32", "TPU-v4-32-head"),
    ("tpu-v6e-2x4", "TPU-v6e-8-head"),  # two hosts of 4 chips are a v6e-8 to Ray, as to Cloud TPU
])
def test_the_slice_head_is_named_by_the_cloud_tpu_accelerator_type(name, head):
    acc = resolve_accelerator(name)
    assert host_bundles(acc, acc.hosts)[0] == {"CPU": CPUS_PER_HOST, "TPU": 4, head: 1}


def test_shared_hosts_ask_for_a_sliver_of_a_cpu_so_a_node_takes_more_hosts_than_cpus():
    bundles = host_bundles(resolve_accelerator("cpu"), 8, shared=True)
    assert bundles == [{"CPU": SHARED_CPUS_PER_HOST}] * 8
    assert SHARED_CPUS_PER_HOST > 0 and 8 * SHARED_CPUS_PER_HOST <= 1  # 8 hosts fit on one 1-CPU node
    assert host_bundles(resolve_accelerator("gpu-l4x1"), 2, shared=True)[0]["GPU"] == 1  # accelerators stay whole
