"""A Cloud TPU node of any generation and size plans its real slice: hosts, chips per host and topology computed
from the generation's rules, read from the Cloud TPU API double as a TPU VM describes itself (its
``acceleratorType``, or its ``acceleratorConfig`` alone), and the same sizes by name with ``-a``."""

from __future__ import annotations

import pytest
import requests

from kinetic_nb.accelerators import cloud_tpu_accelerator, resolve_accelerator
from kinetic_nb.backends.ssh import tpu_vm
from kinetic_nb.backends.ssh.tpu_vm import TpuVmBackend
from kinetic_nb.client.plan import backend_slice, resolve_slice
from kinetic_nb.errors import UnknownAcceleratorError

from .backends.tpu_api_double import TpuApiDouble, tpu_node

PROJECT, ZONE = "ml-team", "us-central2-b"

#: Cloud TPU's accelerator type -> (our name, hosts, chips per host, topology), as Cloud TPU's pages list them.
SLICES = {
    "v4-8": ("tpu-v4-8", 1, 4, "2x2x1"),
    "v4-32": ("tpu-v4-32", 4, 4, "2x2x4"),
    "v4-4096": ("tpu-v4-4096", 512, 4, "8x16x16"),
    "v5p-8": ("tpu-v5p-8", 1, 4, "2x2x1"),
    "v5p-128": ("tpu-v5p-128", 16, 4, "4x4x4"),
    "v5p-12288": ("tpu-v5p-12288", 1536, 4, "16x16x24"),
    "v5litepod-8": ("tpu-v5e-8", 1, 8, "2x4"),
    "v5litepod-256": ("tpu-v5e-256", 64, 4, "16x16"),
    "v6e-8": ("tpu-v6e-8", 1, 8, "2x4"),
    "v6e-256": ("tpu-v6e-256", 64, 4, "16x16"),
    "v2-8": ("tpu-v2-8", 1, 4, "2x2"),
    "v2-32": ("tpu-v2-32", 4, 4, "4x4"),
    "v3-2048": ("tpu-v3-2048", 256, 4, "32x32"),
}


def worker_addresses(count: int) -> list[str]:
    """``count`` internal addresses, one a worker, as the API lists a slice's network endpoints."""
    return [f"10.{index // 65536}.{index // 256 % 256}.{index % 256}" for index in range(count)]


@pytest.fixture
def planned(monkeypatch):
    """What a cell on the TPU VM ``node`` (as the API double answers it) plans with ``-a accelerator``: its
    accelerator, hosts, chips per host and topology, read through the backend's real request path."""
    def plan(node: dict, accelerator: str | None = None) -> tuple[str, int, int, str | None]:
        with TpuApiDouble({(PROJECT, ZONE, "slice"): node}) as api:
            monkeypatch.setenv(tpu_vm.API_ENDPOINT_ENV, api.url)
            backend = TpuVmBackend("slice", zone=ZONE, project=PROJECT, addresses="internal",
                                   session=requests.Session())
            acc, hosts = backend_slice(backend, None, accelerator)
        return acc.name, hosts, acc.devices_per_host, acc.topology

    return plan


@pytest.mark.parametrize(("accelerator_type", "expected"), SLICES.items(), ids=list(SLICES))
def test_a_nodes_accelerator_type_plans_its_real_hosts_and_chips(planned, accelerator_type, expected):
    name, hosts, chips, topology = expected
    node = tpu_node(worker_addresses(hosts), accelerator_type=accelerator_type)
    assert planned(node) == (name, hosts, chips, topology)


def test_a_node_made_with_type_and_topology_plans_from_its_accelerator_config_alone(planned):
    node = tpu_node(worker_addresses(32), accelerator_type=None,
                    accelerator_config={"type": "V5P", "topology": "4x4x8"})
    assert "acceleratorType" not in node
    assert planned(node) == ("tpu-v5p-256", 32, 4, "4x4x8")  # 128 chips: 32 hosts of 4


def test_a_topology_other_than_the_types_own_keeps_the_nodes_shape_and_a_name_that_resolves_to_it():
    acc = cloud_tpu_accelerator(config_type="V5P", topology="4x8x4")
    assert (acc.name, acc.hosts, acc.devices_per_host, acc.topology) == ("tpu-v5p-4x8x4", 32, 4, "4x8x4")
    assert resolve_accelerator(acc.name) == acc  # a stored plan's accelerator is read again by its name


def test_a_v6e_config_is_cloud_tpus_one_host_of_8_not_gkes_two_of_4():
    acc = cloud_tpu_accelerator(config_type="V6E", topology="2x4")
    assert (acc.name, acc.hosts, acc.devices_per_host) == ("tpu-v6e-8", 1, 8)


@pytest.mark.parametrize("spelling", ["v4-32", "tpu-v4-32"])
def test_a_nodes_own_spelling_with_a_is_its_slice_even_where_keras_kinetic_reads_it_otherwise(planned,
                                                                                                spelling):
    node = tpu_node(worker_addresses(4), accelerator_type="v4-32")
    assert planned(node, spelling) == ("tpu-v4-32", 4, 4, "2x2x4")


def test_an_a_that_is_another_slice_than_the_nodes_is_one_line(planned):
    node = tpu_node(worker_addresses(4), accelerator_type="v4-32")
    with pytest.raises(ValueError, match=r"^-a v4-64 does not match the slice -b tpu-vm runs on, a tpu-v4-32: "
                                         r"leave -a out$"):
        planned(node, "v4-64")


@pytest.mark.parametrize(("accelerator_type", "message"), [
    ("v4-31", r"^Cloud TPU accelerator type 'v4-31' is not a slice: v4 counts TensorCores \(2 a chip, 4 chips a "
              r"host\): 8, 16, 32, 64 or a multiple of 128 up to 8192$"),
    ("v5litepod-12", r"^Cloud TPU accelerator type 'v5litepod-12' is not a slice: v5litepod counts chips \(one host "
                     r"of 1, 4 or 8; 4 a host above\): 1, 4, 8 or a power of two from 16 to 256$"),
    ("v3-4096", r"^Cloud TPU accelerator type 'v3-4096' is not a slice: v3 counts TensorCores \(2 a chip, 4 chips a "
                r"host\): 8 or a power of two from 32 to 2048$"),
    ("v9x-8", r"^Cloud TPU accelerator type 'v9x-8' is not one kinetic_nb knows: it knows v2, v3, v4, v5litepod, "
              r"v5p, v6e \(e.g. v4-32, v5litepod-16\)$"),
])
def test_a_malformed_node_type_is_one_line_naming_it_before_any_worker_is_reached(planned, accelerator_type,
                                                                                   message):
    with pytest.raises(UnknownAcceleratorError, match=message) as caught:
        planned(tpu_node(worker_addresses(4), accelerator_type=accelerator_type))
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(("config", "message"), [
    ({"type": "V5P", "topology": "4x4x6"}, r"^Cloud TPU topology '4x4x6' is not a slice of accelerator config 'V5P'"),
    ({"type": "V5P"}, r"^Cloud TPU accelerator config 'V5P' has no topology$"),
    ({"type": "V9", "topology": "2x2"}, r"^Cloud TPU accelerator config type 'V9' is not one kinetic_nb knows"),
])
def test_a_malformed_accelerator_config_is_one_line_naming_it(planned, config, message):
    with pytest.raises(UnknownAcceleratorError, match=message) as caught:
        planned(tpu_node(worker_addresses(4), accelerator_type=None, accelerator_config=config))
    assert "\n" not in str(caught.value)


def test_a_node_that_names_no_accelerator_is_one_line(planned):
    with pytest.raises(UnknownAcceleratorError, match=r"^the Cloud TPU node names no accelerator: neither an "
                                                      r"acceleratorType nor an acceleratorConfig$"):
        planned(tpu_node(worker_addresses(4), accelerator_type=None))


@pytest.mark.parametrize(("name", "expected"), [
    ("tpu-v5e-256", ("tpu-v5e-256", 64, 4, "16x16")),
    ("v5litepod-128", ("tpu-v5e-128", 32, 4, "8x16")),
    ("tpu-v6e-64", ("tpu-v6e-64", 16, 4, "8x8")),
    ("v6e-128", ("tpu-v6e-128", 32, 4, "8x16")),
    ("tpu-v4-128", ("tpu-v4-128", 16, 4, "4x4x4")),
    ("v4-4096", ("tpu-v4-4096", 512, 4, "8x16x16")),
    ("tpu-v5p-64", ("tpu-v5p-64", 8, 4, "2x4x4")),
    ("v5p-640", ("tpu-v5p-640", 80, 4, "4x4x20")),
    ("tpu-v5p-12288", ("tpu-v5p-12288", 1536, 4, "16x16x24")),
    ("tpu-v2-32", ("tpu-v2-32", 4, 4, "4x4")),
    ("v3-2048", ("tpu-v3-2048", 256, 4, "32x32")),
    ("tpu-v5p-4x4x8", ("tpu-v5p-256", 32, 4, "4x4x8")),
])
def test_a_with_any_size_that_follows_the_rules_plans_that_slice(name, expected):
    """``-a`` on every backend: sizes beyond the listed ones resolve, and a TPU name plans its own hosts."""
    acc, hosts = resolve_slice(None, name)
    assert (acc.name, hosts, acc.devices_per_host, acc.topology) == expected
    assert resolve_accelerator(acc.name) is acc  # one object per name, as the listed ones are


@pytest.mark.parametrize("name", ["tpu-v5e-12", "tpu-v4-24", "tpu-v5e-512", "tpu-v5p-4x4x6", "tpu-v5e-4x4"])
def test_a_with_a_size_against_the_rules_is_refused(name):
    with pytest.raises(UnknownAcceleratorError, match=rf"^unknown accelerator '{name}'"):
        resolve_accelerator(name)


def test_listed_shapes_are_the_rules_own():
    """The names ``accelerator_names`` lists are computed by the same rules as a node's type."""
    for cloud, ours in [("v4-16", "tpu-v4-16"), ("v5litepod-16", "tpu-v5e-16"), ("v5p-32", "tpu-v5p-32"),
                        ("v6e-32", "tpu-v6e-32"), ("v5litepod-1", "tpu-v5e-1")]:
        assert cloud_tpu_accelerator(cloud) == resolve_accelerator(ours)
