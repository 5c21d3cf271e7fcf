"""Which GPUs a host's processes see, counted without CUDA, and how the local backend chooses real GPUs."""

from __future__ import annotations

import pytest

from kinetic_nb.accelerators import resolve_accelerator
from kinetic_nb.backends import local
from kinetic_nb.backends.local import LocalBackend, gpu_shortfall
from kinetic_nb.client.plan import make_plan
from kinetic_nb.runner import gpus
from kinetic_nb.runner.gpus import host_devices, visible_gpus

H200 = ["NVIDIA H200"]


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, ["0", "1"]),  # every GPU of the machine
        ({"CUDA_VISIBLE_DEVICES": "1"}, ["1"]),
        ({"CUDA_VISIBLE_DEVICES": "GPU-8a1e, GPU-77c2"}, ["GPU-8a1e", "GPU-77c2"]),
        ({"CUDA_VISIBLE_DEVICES": ""}, []),
        ({"CUDA_VISIBLE_DEVICES": "-1"}, []),
    ],
)
def test_the_visible_gpus_are_what_cuda_visible_devices_names_else_the_machines(environ, expected):
    assert visible_gpus(environ, ["NVIDIA H100 80GB HBM3"] * 2) == expected


def test_a_machine_without_a_driver_has_no_gpus():
    assert gpus.machine_gpus() == []  # this machine: no NVML, no /proc/driver/nvidia
    assert visible_gpus({}) == []


def test_each_host_of_a_local_slice_sees_its_own_gpus():
    visible = ["0", "1", "2", "3", "4", "5"]
    assert [host_devices(visible, host, 2) for host in range(3)] == ["0,1", "2,3", "4,5"]


def plan_for(accelerator: str, hosts: int, *, simulated: bool):
    return make_plan(job_id="kn-20261202-000000-000000", acc=resolve_accelerator(accelerator), hosts=hosts,
                     framework="torch", coordinator_address="127.0.0.1:1", simulated=simulated)


def test_a_gpu_slice_runs_on_the_machines_gpus_where_it_has_them(monkeypatch):
    acc = resolve_accelerator("gpu-h100x1")
    monkeypatch.setattr(local, "visible_gpus", lambda environ: [])
    assert LocalBackend().simulates(acc)  # no GPU here: simulated on CPU
    monkeypatch.setattr(local, "visible_gpus", lambda environ: ["0"])
    monkeypatch.setattr(local, "machine_gpus", lambda: H200)
    assert not LocalBackend().simulates(acc)
    assert LocalBackend(simulate=True).simulates(acc)  # --simulate
    assert LocalBackend().simulates(resolve_accelerator("tpu-v5e-16"))  # a TPU slice: always simulated
    assert LocalBackend.from_options(simulate=True).options() == {"simulate": True}
    plan = plan_for("gpu-h100x1", 1, simulated=False)
    LocalBackend().preflight(plan)  # one GPU is enough for one host of one
    assert LocalBackend().launch_notices(plan) == [
        "gpu-h100x1 runs on this machine's GPUs: 1 host x 1 of 1 (NVIDIA H200), 1 process (--simulate runs it on CPU)"]


@pytest.mark.parametrize(("accelerator", "hosts"), [("gpu-h100x2", 1), ("gpu-h100x1", 2)])
def test_a_shape_the_machine_lacks_fails_in_one_line_before_anything_starts(monkeypatch, accelerator, hosts):
    monkeypatch.setattr(local, "visible_gpus", lambda environ: ["0"])
    monkeypatch.setattr(local, "machine_gpus", lambda: H200)
    with pytest.raises(ValueError, match="needs 2 GPUs") as caught:
        LocalBackend().preflight(plan_for(accelerator, hosts, simulated=False))
    assert str(caught.value) == (
        f"{accelerator} x {hosts} host{'s' if hosts > 1 else ''} needs 2 GPUs; this machine shows 1 (NVIDIA H200): "
        "choose a smaller -a or -n, or --simulate to run the slice on CPU")
    LocalBackend().preflight(plan_for(accelerator, hosts, simulated=True))  # simulated: the GPUs are not needed
    assert gpu_shortfall(plan_for(accelerator, hosts, simulated=False), H200 * 2) == ""
