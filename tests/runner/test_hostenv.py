import logging

import pytest

from kinetic_nb.runner.host_variables import resolve_host_index


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, None),
        ({"KINETIC_HOST_INDEX": "3"}, 3),
        ({"TPU_WORKER_ID": "2", "LWS_WORKER_INDEX": "5"}, 2),  # TPU_WORKER_ID first
        ({"LWS_WORKER_INDEX": "5", "JOB_COMPLETION_INDEX": "6"}, 5),
        ({"JOB_COMPLETION_INDEX": "6", "KINETIC_HOST_INDEX": "7"}, 6),
        ({"TPU_WORKER_ID": "", "KINETIC_HOST_INDEX": "1"}, 1),
        ({"TPU_WORKER_ID": " 4 "}, 4),
    ],
)
def test_first_valid_variable_wins(environ, expected):
    assert resolve_host_index(environ) == expected


@pytest.mark.parametrize("bad", ["-1", "abc", "1.5"])
def test_invalid_values_are_logged_and_skipped_never_taken_as_the_leader(bad, caplog):
    with caplog.at_level(logging.WARNING):
        assert resolve_host_index({"TPU_WORKER_ID": bad, "LWS_WORKER_INDEX": "3"}) == 3
        assert resolve_host_index({"TPU_WORKER_ID": bad}) is None
    assert f"TPU_WORKER_ID={bad!r}" in caplog.text


def test_one_environment_for_every_launcher():
    from kinetic_nb.accelerators import resolve_accelerator
    from kinetic_nb.backends.kubernetes.manifests import host_environment as pod_environment
    from kinetic_nb.backends.kubernetes.settings import KubernetesSettings
    from kinetic_nb.runner.host_variables import host_environment, index_variables, job_variables, process_environment
    from kinetic_nb.runner.protocol import JobPlan

    plan = JobPlan(job_id="kn-e", hosts=4, accelerator="cpu", devices_per_host=2, framework="jax",
                   coordinator_address="10.0.0.1:9000", barrier_timeout_s=1,
                   heartbeat_timeout_s=1, shutdown_timeout_s=1, simulated=True, env_names=("RANK",))
    local = host_environment(plan, 2, "file:///j", "/out", {"XLA_FLAGS": "--xla_dump_to=/tmp", "RANK": "user's own"})
    assert {**job_variables(plan, "file:///j", "/out"), **index_variables(plan, 2)}.items() - {("RANK", "2")} \
        <= local.items()
    assert local["RANK"] == "user's own"  # an -e variable (its value from the agent's environment) wins
    assert local["XLA_FLAGS"] == "--xla_dump_to=/tmp --xla_force_host_platform_device_count=2"
    pod_env = pod_environment(plan, resolve_accelerator("cpu"), "gs://b/j", KubernetesSettings(image="img"), lws=False)
    pod = {entry["name"] for entry in pod_env}
    assert set(job_variables(plan, "gs://b/j", "/kinetic/outputs")) <= pod
    # The pod's agent adds each process's rank as it starts it, over the pod's environment.
    started = process_environment(plan, 3, "/kinetic/outputs", {"KINETIC_NUM_HOSTS": "4", "RANK": "user's own"})
    assert index_variables(plan, 3).items() - {("RANK", "3")} <= started.items()
    assert started["RANK"] == "user's own" and started["KINETIC_NUM_HOSTS"] == "4"


@pytest.mark.parametrize(
    ("hosts", "per_host", "rank", "expected"),
    [
        (4, 1, 2, {"RANK": "2", "LOCAL_RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "2",
                   "KINETIC_HOST_INDEX": "2", "JAX_PROCESS_ID": "2", "JAX_NUM_PROCESSES": "4", "NUM_NODES": "4"}),
        (2, 4, 5, {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
                   "NODE_RANK": "1", "KINETIC_HOST_INDEX": "1", "KINETIC_RANK": "5", "JAX_PROCESS_ID": "5",
                   "JAX_NUM_PROCESSES": "8", "KINETIC_NUM_HOSTS": "2", "NUM_NODES": "2"}),
        (2, 8, 15, {"RANK": "15", "LOCAL_RANK": "7", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8",
                    "GROUP_RANK": "1", "KINETIC_HOST_INDEX": "1"}),
    ],
)
def test_every_process_gets_its_rank_as_torchrun_and_jax_name_it(hosts, per_host, rank, expected):
    from kinetic_nb.runner.host_variables import host_environment
    from kinetic_nb.runner.protocol import JobPlan

    plan = JobPlan(job_id="kn-r", hosts=hosts, procs_per_host=per_host, accelerator="gpu-h100x8",
                   devices_per_host=8, framework="torch", coordinator_address="10.0.0.1:9000", barrier_timeout_s=1,
                   heartbeat_timeout_s=1, shutdown_timeout_s=1, simulated=True)
    env = host_environment(plan, rank, "file:///j", "/out", {})
    assert {name: env[name] for name in expected} == expected
    assert env["MASTER_ADDR"] == "10.0.0.1" and env["MASTER_PORT"] == "9000"
    # Simulated: the host's 8 devices shared among its processes.
    assert env["XLA_FLAGS"] == f"--xla_force_host_platform_device_count={8 // per_host}"


def test_the_rank_outranks_the_host_index():
    from kinetic_nb.runner.host_variables import resolve_rank

    assert resolve_rank({"TPU_WORKER_ID": "1", "KINETIC_RANK": "5"}) == 5
    assert resolve_rank({"TPU_WORKER_ID": "1"}) == 1
    assert resolve_rank({"KINETIC_RANK": "x", "LWS_WORKER_INDEX": "2"}) == 2
    assert resolve_rank({}) is None
