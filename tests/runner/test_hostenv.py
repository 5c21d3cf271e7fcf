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
    from kinetic_nb.runner.host_variables import host_environment, index_variables, job_variables
    from kinetic_nb.runner.protocol import JobPlan

    plan = JobPlan(job_id="kn-e", hosts=4, accelerator="cpu", devices_per_host=2, framework="jax",
                   coordinator_address="10.0.0.1:9000", barrier_timeout_s=1,
                   heartbeat_timeout_s=1, shutdown_timeout_s=1, simulated=True, env_names=("RANK",))
    local = host_environment(plan, 2, "file:///j", "/out", {"XLA_FLAGS": "--xla_dump_to=/tmp", "RANK": "user's own"})
    assert {**job_variables(plan, "file:///j", "/out"), **index_variables(2)}.items() - {("RANK", "2")} <= local.items()
    assert local["RANK"] == "user's own"  # an -e variable (its value from the agent's environment) wins
    assert local["XLA_FLAGS"] == "--xla_dump_to=/tmp --xla_force_host_platform_device_count=2"
    pod = {entry["name"] for entry in pod_environment(plan, resolve_accelerator("cpu"), "gs://b/j",
                                                      KubernetesSettings(image="img"), lws=False)}
    assert set(job_variables(plan, "gs://b/j", "/kinetic/outputs")) | set(index_variables(0)) <= pod
