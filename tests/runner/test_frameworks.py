"""``frameworks.initialize`` on the oldest JAX ``setup.cfg`` allows, and on the installed one.

The old JAX is a stand-in module whose ``jax.distributed.initialize`` has
JAX 0.4.30's own parameter list (below, with where it comes from): a real
function, so an argument it does not take is the ``TypeError`` the real one
would raise on every host.
"""

from __future__ import annotations

import dataclasses
import inspect
import socket
import sys
import threading
import types

import pytest

from kinetic_nb.accelerators import resolve_accelerator
from kinetic_nb.client.plan import make_plan
from kinetic_nb.errors import AcceleratorNotSeenError
from kinetic_nb.runner import frameworks

PLAN = make_plan(job_id="kn-20261129-234752-3e8d32", acc=resolve_accelerator("cpu"), hosts=4, framework="jax",
                 coordinator_address="host-0.example:29500", simulated=False)


def jax_0_4_30_initialize(coordinator_address=None, num_processes=None, process_id=None, local_device_ids=None,
                          initialization_timeout=300, coordinator_bind_address=None):
    """JAX 0.4.30's parameter list, copied from ``def initialize`` in ``jax/_src/distributed.py`` of the
    jax-0.4.30-py3-none-any.whl wheel (sha256 289b30ae...f1a55b), which ``jax/distributed.py`` re-exports."""
    jax_0_4_30_initialize.calls.append(dict(locals()))


jax_0_4_30_initialize.calls = []


@pytest.fixture
def old_jax(monkeypatch):
    """``import jax`` gives JAX 0.4.30's ``jax.distributed.initialize``, which records its calls."""
    jax_0_4_30_initialize.calls.clear()
    fake = types.ModuleType("jax")
    fake.__version__ = "0.4.30"
    fake.distributed = types.SimpleNamespace(initialize=jax_0_4_30_initialize)
    monkeypatch.setitem(sys.modules, "jax", fake)
    monkeypatch.setattr(frameworks, "wait_for_coordinator", lambda address, timeout: True)  # host-0.example is not
    return jax_0_4_30_initialize.calls


def test_the_oldest_jax_gets_only_what_it_takes_and_the_host_log_says_what_was_left_out(old_jax, capsys):
    frameworks.initialize(PLAN, 2)
    assert old_jax == [{"coordinator_address": "host-0.example:29500", "num_processes": 4, "process_id": 2,
                        "local_device_ids": None, "initialization_timeout": int(PLAN.barrier_timeout_s),
                        "coordinator_bind_address": None}]
    err = capsys.readouterr().err
    assert err.count("\n") == 1  # one line
    assert err == ("kinetic_nb: jax 0.4.30's jax.distributed.initialize takes no heartbeat_timeout_seconds, "
                   "shutdown_timeout_seconds: left out, JAX's defaults apply\n")


def test_every_argument_would_break_the_oldest_jax_without_the_filter(old_jax):
    """Not vacuous: the full set is what the fixture rejects, as JAX 0.4.30 itself would."""
    with pytest.raises(TypeError, match="heartbeat_timeout_seconds"):
        jax_0_4_30_initialize(**frameworks.jax_arguments(PLAN, 2, "host-0.example:29500"))


def test_the_installed_jax_gets_every_argument_it_takes():
    import jax  # a test dependency: its absence fails the test rather than skipping it

    arguments = frameworks.jax_arguments(PLAN, 1, "host-0.example:29500")
    passed, left_out = frameworks.accepted_arguments(jax.distributed.initialize, arguments)
    parameters = inspect.signature(jax.distributed.initialize).parameters
    assert left_out == [name for name in arguments if name not in parameters]
    assert passed == {name: value for name, value in arguments.items() if name in parameters}
    assert "coordinator_address" in passed and "initialization_timeout" in passed


def test_a_function_that_takes_any_keyword_or_has_no_signature_gets_everything():
    arguments = {"coordinator_address": "a:1", "heartbeat_timeout_seconds": 30}
    assert frameworks.accepted_arguments(lambda **kwargs: None, arguments) == (arguments, [])
    assert frameworks.accepted_arguments(print, {"sep": " "}) == ({"sep": " "}, [])  # a builtin's is readable
    unreadable = types.SimpleNamespace(__call__=None)
    assert frameworks.accepted_arguments(unreadable, arguments) == (arguments, [])


# -- a GPU host whose framework sees no GPU -------------------------------------------------------------------

GPU_PLAN = make_plan(job_id="kn-20261129-234752-3e8d32", acc=resolve_accelerator("gpu-h100x8"), hosts=2,
                     framework="torch", coordinator_address="127.0.0.1:29500", simulated=False)


def test_a_gpu_host_where_torch_sees_no_cuda_fails_in_one_line_naming_what_it_saw():
    """Never a quiet gloo fallback on GPU hosts: the installed (CPU) torch says what it is, before any group is
    joined; a simulated GPU slice (the local backend) runs on gloo as before."""
    import torch

    with pytest.raises(AcceleratorNotSeenError) as caught:
        frameworks.initialize(GPU_PLAN, 0)
    assert str(caught.value) == (f"torch sees no CUDA on this gpu-h100x8 host (torch {torch.__version__}, a CPU-only "
                                 "build, 0 GPU(s) visible); on GKE the driver is mounted at /usr/local/nvidia")
    assert not frameworks.on_real_gpus(dataclasses.replace(GPU_PLAN, simulated=True))
    assert not frameworks.on_real_gpus(PLAN)


@pytest.mark.parametrize("backend", ["cpu", "gpu"])
def test_a_gpu_host_where_jax_sees_no_gpu_fails_in_one_line(old_jax, monkeypatch, backend):
    monkeypatch.setattr(sys.modules["jax"], "default_backend", lambda: backend, raising=False)
    monkeypatch.setattr(sys.modules["jax"], "local_device_count", lambda: 8, raising=False)
    plan = dataclasses.replace(GPU_PLAN, framework="jax")
    if backend == "gpu":
        frameworks.initialize(plan, 0)
        return
    with pytest.raises(AcceleratorNotSeenError, match=r"^JAX sees no GPU on this gpu-h100x8 host \(jax 0\.4\.30, "
                                                      r"backend cpu: .*\); on GKE the driver is mounted at "):
        frameworks.initialize(plan, 0)


@pytest.mark.parametrize(("per_host", "seen", "fails"), [(1, 8, False), (1, 7, True), (8, 1, False), (8, 0, True)])
def test_a_gpu_host_where_jax_sees_fewer_gpus_than_promised_fails_in_one_line(old_jax, monkeypatch, per_host, seen,
                                                                               fails):
    monkeypatch.setattr(sys.modules["jax"], "default_backend", lambda: "gpu", raising=False)
    monkeypatch.setattr(sys.modules["jax"], "local_device_count", lambda: seen, raising=False)
    plan = dataclasses.replace(GPU_PLAN, framework="jax", procs_per_host=per_host)
    if not fails:
        frameworks.initialize(plan, 2)
        return
    with pytest.raises(AcceleratorNotSeenError) as caught:
        frameworks.initialize(plan, 2)
    name = "host 2" if per_host == 1 else "host 0, process 2 (rank 2)"
    assert str(caught.value) == (f"JAX sees {seen} GPU(s) in {name} of this gpu-h100x8 slice, which gives it "
                                 f"{8 // per_host} (8 per host, {per_host} process{'es' if per_host > 1 else ''} "
                                 "per host)")


def test_a_process_of_several_on_a_gpu_host_drives_its_own_gpus():
    plan = dataclasses.replace(GPU_PLAN, framework="jax", procs_per_host=4)
    assert frameworks.jax_arguments(plan, 6, "a:1")["local_device_ids"] == [4, 5]  # host 1, process 2: GPUs 4-5
    assert frameworks.jax_arguments(plan, 6, "a:1")["num_processes"] == 8
    assert "local_device_ids" not in frameworks.jax_arguments(dataclasses.replace(plan, simulated=True), 6, "a:1")
    assert "local_device_ids" not in frameworks.jax_arguments(dataclasses.replace(plan, procs_per_host=1), 1, "a:1")


def test_a_gpu_host_where_torch_sees_fewer_gpus_than_its_accelerator_fails_in_one_line(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(AcceleratorNotSeenError) as caught:
        frameworks.initialize(GPU_PLAN, 0)
    assert str(caught.value) == "torch sees 1 GPU(s) on this gpu-h100x8 host, which has 8 (CUDA_VISIBLE_DEVICES=0)"


def test_a_jax_process_joins_only_once_the_coordinator_listens(monkeypatch):
    """Not into gRPC's reconnect backoff (about a second, which every JAX cell paid while its processes raced the
    leader's coordination service): rank 2 calls jax.distributed.initialize only after the port accepts."""
    joined = threading.Event()
    fake = types.ModuleType("jax")
    fake.distributed = types.SimpleNamespace(initialize=lambda **arguments: joined.set())
    monkeypatch.setitem(sys.modules, "jax", fake)
    with socket.socket() as coordinator:
        coordinator.bind(("127.0.0.1", 0))  # bound, not yet listening: connections are refused
        plan = dataclasses.replace(PLAN, coordinator_address=f"127.0.0.1:{coordinator.getsockname()[1]}")
        joining = threading.Thread(target=frameworks.initialize, args=(plan, 2), daemon=True)
        joining.start()
        assert not joined.wait(0.5)  # it tried, was refused, and waits
        coordinator.listen()
        assert joined.wait(30)
    joining.join(30)


def test_waiting_for_a_coordinator_that_never_listens_ends_at_its_bound():
    with socket.socket() as coordinator:
        coordinator.bind(("127.0.0.1", 0))
        assert not frameworks.wait_for_coordinator(f"127.0.0.1:{coordinator.getsockname()[1]}", 0.2)
        coordinator.listen()
        assert frameworks.wait_for_coordinator(f"127.0.0.1:{coordinator.getsockname()[1]}", 0.2)
