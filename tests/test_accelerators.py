"""Accelerator names resolve to the real slice shapes."""

from __future__ import annotations

import pytest

from kinetic_nb.accelerators import (
    Accelerator,
    accelerator_names,
    kinetic_spellings,
    local_notice,
    resolve_accelerator,
)
from kinetic_nb.errors import KineticError, UnknownAcceleratorError


@pytest.mark.parametrize(
    ("name", "hosts", "devices_per_host", "topology"),
    [
        ("tpu-v5e-4", 1, 4, "2x2"),
        ("tpu-v5e-8", 1, 8, "2x4"),
        ("tpu-v5e-16", 4, 4, "4x4"),
        ("tpu-v5e-32", 8, 4, "4x8"),
        ("tpu-v5e-64", 16, 4, "8x8"),
        ("tpu-v5e-1", 1, 1, "1x1"),
        ("tpu-v6e-1", 1, 1, "1x1"),
        ("tpu-v6e-4", 1, 4, "2x2"),
        ("tpu-v6e-8", 1, 8, "2x4"),  # Cloud TPU's v6e-8: one VM of 8 chips
        ("tpu-v6e-2x4", 2, 4, "2x4"),  # the same topology as two hosts of 4 (GKE only; keras-kinetic's v6e-8)
        ("tpu-v6e-16", 4, 4, "4x4"),
        ("tpu-v4-8", 1, 4, "2x2x1"),  # v4 counts TensorCores, as v5p does
        ("tpu-v4-16", 2, 4, "2x2x2"),
        ("tpu-v4-64", 8, 4, "2x4x4"),
        ("tpu-v6e-32", 8, 4, "4x8"),
        ("tpu-v5p-8", 1, 4, "2x2x1"),
        ("tpu-v5p-16", 2, 4, "2x2x2"),
        ("tpu-v5p-32", 4, 4, "2x2x4"),
    ],
)
def test_tpu_slices_have_their_real_host_and_chip_counts(name, hosts, devices_per_host, topology):
    acc = resolve_accelerator(name)
    assert (acc.name, acc.kind, acc.hosts, acc.devices_per_host, acc.topology) == (
        name,
        "tpu",
        hosts,
        devices_per_host,
        topology,
    )
    assert acc.devices == hosts * devices_per_host


@pytest.mark.parametrize(("name", "machine_type"), [
    ("tpu-v5e-4", "ct5lp-hightpu-4t"), ("tpu-v5e-8", "ct5lp-hightpu-8t"), ("tpu-v5e-16", "ct5lp-hightpu-4t"),
    ("tpu-v6e-8", "ct6e-standard-8t"), ("tpu-v6e-2x4", "ct6e-standard-4t"), ("tpu-v6e-32", "ct6e-standard-4t"),
    ("tpu-v6e-1", "ct6e-standard-1t"), ("tpu-v5e-1", "ct5lp-hightpu-1t"), ("tpu-v4-32", "ct4p-hightpu-4t"),
    ("tpu-v5p-8", "ct5p-hightpu-4t"), ("tpu-v5p-32", "ct5p-hightpu-4t"),
    ("gpu-h100x8", None), ("cpu", None),
])
def test_each_tpu_host_names_its_machine_type_by_its_chips(name, machine_type):
    """A 2x4 topology is one host of 8 chips or two of 4: only the machine type tells the pools apart."""
    assert resolve_accelerator(name).machine_type == machine_type


def test_devices_counts_the_whole_slice():
    assert resolve_accelerator("tpu-v5e-16").devices == 16
    assert resolve_accelerator("tpu-v5p-32").devices == 16  # 32 TensorCores, 2 per chip


@pytest.mark.parametrize(
    ("name", "gke_value"),
    [
        ("tpu-v5e-16", "tpu-v5-lite-podslice"),
        ("tpu-v6e-8", "tpu-v6e-slice"),
        ("tpu-v5p-8", "tpu-v5p-slice"),
        ("gpu-l4x2", "nvidia-l4"),
        ("gpu-a100x4", "nvidia-tesla-a100"),
        ("gpu-h100x8", "nvidia-h100-80gb"),
        ("gpu-a100-80gbx8", "nvidia-a100-80gb"),
        ("gpu-a100x16", "nvidia-tesla-a100"),
        ("gpu-h100-megax8", "nvidia-h100-mega-80gb"),
        ("tpu-v4-16", "tpu-v4-podslice"),
    ],
)
def test_gke_node_selector_values(name, gke_value):
    assert resolve_accelerator(name).gke_accelerator == gke_value


@pytest.mark.parametrize("model", ["l4", "a100", "h100"])
@pytest.mark.parametrize("count", [1, 2, 4, 8])
def test_gpu_shapes_are_one_host_with_n_gpus(model, count):
    acc = resolve_accelerator(f"gpu-{model}x{count}")
    assert (acc.kind, acc.hosts, acc.devices_per_host, acc.devices, acc.topology) == ("gpu", 1, count, count, None)


def test_cpu_is_one_host_with_one_device_and_not_simulated():
    acc = resolve_accelerator("cpu")
    assert acc == Accelerator("cpu", "cpu", 1, 1, None, None)
    assert not acc.simulated_locally


def test_tpus_and_gpus_are_simulated_locally():
    assert resolve_accelerator("tpu-v5e-16").simulated_locally
    assert resolve_accelerator("gpu-h100x8").simulated_locally


@pytest.mark.parametrize(
    ("alias", "canonical"),
    [
        ("v5litepod-16", "tpu-v5e-16"),
        ("tpu-v5litepod-64", "tpu-v5e-64"),
        ("v5e-4", "tpu-v5e-4"),
        ("v6e-32", "tpu-v6e-32"),
        ("v5p-32", "tpu-v5p-32"),
        # keras-kinetic's spellings of the same slices (it counts chips; its tpu: and gpu: forms are its own)
        ("tpu:v5litepod-16", "tpu-v5e-16"),
        ("tpu:v5e-4", "tpu-v5e-4"),
        ("tpu:v5p-8", "tpu-v5p-16"),
        ("tpu:v4-8", "tpu-v4-16"),
        ("tpu:v6e-8", "tpu-v6e-2x4"),
        ("tpu:v6e-16", "tpu-v6e-16"),
        ("a100x4", "gpu-a100x4"),
        ("gpu:a100-80gbx8", "gpu-a100-80gbx8"),
        ("l4", "gpu-l4x1"),
        ("gpu-l4", "gpu-l4x1"),
        ("gpu:h100", "gpu-h100x1"),
    ],
)
def test_aliases_resolve_to_the_canonical_accelerator(alias, canonical):
    assert resolve_accelerator(alias) is resolve_accelerator(canonical)
    assert resolve_accelerator(alias).name == canonical


@pytest.mark.parametrize("spelling", ["TPU-V5E-16", "  tpu-v5e-16\n", "V5LitePod-16", "\tv5e-16 "])
def test_lookup_ignores_case_and_surrounding_whitespace(spelling):
    assert resolve_accelerator(spelling).name == "tpu-v5e-16"


def test_unknown_name_lists_close_matches_on_one_line():
    with pytest.raises(UnknownAcceleratorError) as caught:
        resolve_accelerator("tpu-v5e-12")
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("unknown accelerator 'tpu-v5e-12'; did you mean: tpu-v5e-1, tpu-v5e-16, tpu-v5e-32")
    assert isinstance(caught.value, ValueError)
    assert isinstance(caught.value, KineticError)


def test_close_matches_through_an_alias_are_named_canonically():
    with pytest.raises(UnknownAcceleratorError, match=r"did you mean: tpu-v5e-1, tpu-v5e-16\b") as caught:
        resolve_accelerator("v5litepod-12")
    suggestions = str(caught.value).split("did you mean: ")[1].rstrip("?").split(", ")
    assert all(suggestion in accelerator_names() for suggestion in suggestions)
    assert len(suggestions) == len(set(suggestions))


def test_unknown_name_without_close_match_says_how_to_list_names():
    with pytest.raises(UnknownAcceleratorError) as caught:
        resolve_accelerator("quantum-9000")
    message = str(caught.value)
    assert "'quantum-9000'" in message
    assert "accelerator_names()" in message
    assert "did you mean" not in message
    assert "\n" not in message


def test_accelerator_names_are_canonical_and_sorted_by_family_then_size():
    names = accelerator_names()
    assert names[0] == "cpu"
    assert names[1:5] == ["tpu-v4-8", "tpu-v4-16", "tpu-v4-32", "tpu-v4-64"]
    assert names[5:11] == ["tpu-v5e-1", "tpu-v5e-4", "tpu-v5e-8", "tpu-v5e-16", "tpu-v5e-32", "tpu-v5e-64"]
    assert names[-5:] == ["gpu-h100x1", "gpu-h100x2", "gpu-h100x4", "gpu-h100x8", "gpu-h100-megax8"]
    assert "v5litepod-16" not in names
    # cpu; v4 4, v5e 6, v5p 3, v6e 5 + the two-host 2x4; l4 4, a100 5 (x16 too), a100-80gb 4, h100 4, mega 1
    assert len(names) == len(set(names)) == 1 + 4 + 6 + 3 + 6 + 4 + 5 + 4 + 4 + 1
    assert all(resolve_accelerator(name).name == name for name in names)


def test_accelerator_names_returns_a_fresh_list():
    accelerator_names().clear()
    assert "cpu" in accelerator_names()


def test_accelerators_are_immutable():
    acc = resolve_accelerator("tpu-v5e-16")
    with pytest.raises(AttributeError):
        acc.hosts = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("name", "notice"),
    [
        ("tpu-v5e-16", "tpu-v5e-16 is simulated locally: 4 host processes x 4 CPU devices each."),
        ("tpu-v6e-2x4", "tpu-v6e-2x4 is simulated locally: 2 host processes x 4 CPU devices each."),
        ("tpu-v5e-8", "tpu-v5e-8 is simulated locally: 1 host process x 8 CPU devices."),
        ("gpu-h100x1", "gpu-h100x1 is simulated locally: 1 host process x 1 CPU device."),
        ("cpu", "cpu runs locally: 1 host process x 1 CPU device."),
    ],
)
def test_local_notice_is_one_line_naming_processes_and_devices(name, notice):
    assert local_notice(resolve_accelerator(name)) == notice


@pytest.mark.parametrize(("spelling", "ours", "theirs"), [
    ("v5p-8", "tpu-v5p-8", "tpu-v5p-16"),
    ("v4-8", "tpu-v4-8", "tpu-v4-16"),
    ("v6e-8", "tpu-v6e-8", "tpu-v6e-2x4"),
])
def test_a_spelling_that_is_one_slice_in_cloud_tpus_naming_and_another_in_keras_kinetics_is_refused(
        spelling, ours, theirs):
    """Cloud TPU counts v4 and v5p in TensorCores and names v6e-8 one VM; keras-kinetic counts chips and makes
    v6e-8 two hosts: the bare spelling is refused in one line naming both, never silently one of them."""
    with pytest.raises(UnknownAcceleratorError) as caught:
        resolve_accelerator(spelling)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"accelerator {spelling!r} is two slices: ")
    assert f"({ours})" in message and f"({theirs} here, or tpu:{spelling})" in message
    assert message.endswith(f"say {ours} or {theirs}")
    assert resolve_accelerator(f"tpu-{spelling}").name == ours  # our own name is never ambiguous
    assert resolve_accelerator(f"tpu:{spelling}").name == theirs  # keras-kinetic's own form is its meaning


def test_keras_kinetics_spellings_are_listed_beside_ours():
    assert kinetic_spellings("tpu-v5e-16") == ["tpu:v5litepod-16", "tpu:v5e-16"]
    assert kinetic_spellings("tpu-v6e-2x4") == ["tpu:v6e-8"]
    assert kinetic_spellings("tpu-v6e-8") == []  # keras-kinetic has no one-host v6e-8
    assert kinetic_spellings("gpu-l4x1") == ["gpu:l4x1", "gpu:l4"]
