"""Pods to host states: pods shaped as the API returns them, as dicts and as the client's V1Pod objects.

``data/pods.json`` holds one pod per case, as ``kubectl get pods -o json``
returns them (written by hand after real API output, names and ids made up;
the ``test.kinetic-nb/case`` annotation names the case). The file itself is
checked against the core/v1 Pod schema, so the cases stay API-shaped.
"""

from __future__ import annotations

import json
import pathlib

import kubernetes_validate
import pytest

from kinetic_nb.backends.kubernetes.pods import (
    PodExitSummary,
    PodHostState,
    host_states,
    message_tail,
    pod_exit_summaries,
    pod_host_state,
    root_failure,
    stuck_pending,
)
from kinetic_nb.runner.protocol import ExitSummary

from .k8s_cluster import to_client_pod_list

PODS = json.loads((pathlib.Path(__file__).parent / "data" / "pods.json").read_text())["items"]
BY_CASE = {pod["metadata"]["annotations"]["test.kinetic-nb/case"]: pod for pod in PODS}
#: 23:47:55Z, when every pod in the file was created, as seconds since the epoch.
CREATED = 1795996075.0

#: case -> (index, state, reason (prefix), exit code, signal)
EXPECTED = {
    "unschedulable": (2, "pending", "Unschedulable: 0/4 nodes are available: 4 Insufficient google.com/tpu.", None,
                      None),
    "image-pull-backoff": (0, "pending", 'ImagePullBackOff: Back-off pulling image "registry.example/kinetic-jax:typo"',
                           None, None),
    "err-image-pull": (1, "pending", 'ErrImagePull: failed to pull and unpack image', None, None),
    "container-creating": (2, "pending", "ContainerCreating", None, None),
    "create-container-config-error": (3, "pending", 'CreateContainerConfigError: secret "kn-20261129-234752-3e8d32-',
                                      None, None),
    "unschedulable-worker-1": (1, "pending", "Unschedulable: 0/4 nodes are available", None, None),
    "running": (0, "running", "", None, None),
    "succeeded": (0, "succeeded", "", 0, None),
    "error-exit-1": (1, "failed", "", 1, None),
    "oomkilled": (2, "failed", "OOMKilled", 137, "SIGKILL"),
    "sigkill": (3, "failed", "", 137, "SIGKILL"),
    "evicted": (4, "failed", "Evicted: The node was low on resource: memory.", 137, "SIGKILL"),
    "parked-after-exit-1": (1, "failed", "", 1, None),
    "crashloop-after-oom": (3, "failed", "OOMKilled", 137, "SIGKILL"),
    "deleted-sigterm": (5, "failed", "", 143, "SIGTERM"),
    "node-lost": (6, "lost", "NodeLost: Node gke-ml-v5e-pool-3a1b2c4d-x9zq which was running pod", None, None),
    # FallbackToLogsOnError: the container's last log lines are its termination message (see below).
    "no-kinetic-nb": (0, "failed", "", 1, None),
    "bucket-403": (1, "failed", "", 1, None),
    # The root Job's pod: no host index; its failure ends the job (see root_failure).
    "root-failed": (None, "failed", "", 1, None),
}


def test_the_fixture_pods_are_api_shaped():
    assert set(BY_CASE) == set(EXPECTED)
    for pod in PODS:
        kubernetes_validate.validate(pod, "1.33", strict=True)


@pytest.mark.parametrize("case", EXPECTED)
def test_pod_to_host_state(case):
    index, state, reason, exit_code, signal = EXPECTED[case]
    found = pod_host_state(BY_CASE[case])
    assert (found.index, found.state, found.exit_code, found.signal) == (index, state, exit_code, signal)
    assert found.reason.startswith(reason) and (reason or found.reason == "")
    assert "\n" not in found.reason
    assert found.pod_name == BY_CASE[case]["metadata"]["name"]
    assert found.created_at == CREATED


def test_client_objects_map_exactly_as_their_json():
    """``V1Pod`` objects from the official client give what their JSON gives."""
    objects = to_client_pod_list(PODS).items
    assert [pod_host_state(pod) for pod in objects] == [pod_host_state(pod) for pod in PODS]


def test_ended_state_and_deletion():
    assert pod_host_state(BY_CASE["deleted-sigterm"]).deleted
    assert not pod_host_state(BY_CASE["sigkill"]).deleted
    assert pod_host_state(BY_CASE["oomkilled"]).ended and not pod_host_state(BY_CASE["running"]).ended
    assert pod_host_state(BY_CASE["oomkilled"]).finished_at == CREATED + 225  # 23:51:40Z


def test_host_states_are_keyed_by_index_and_prefer_the_live_replacement():
    replaced = json.loads(json.dumps(BY_CASE["running"]))
    replaced["metadata"]["deletionTimestamp"] = "2026-11-29T23:50:00Z"
    states = host_states([replaced, BY_CASE["running"], BY_CASE["unschedulable"]])
    assert set(states) == {0, 2}
    assert not states[0].deleted
    no_index = json.loads(json.dumps(BY_CASE["running"]))
    del no_index["metadata"]["labels"]["leaderworkerset.sigs.k8s.io/worker-index"]
    assert host_states([no_index]) == {}


def test_stuck_pending_after_the_bound_with_the_schedulers_reason():
    pods = [BY_CASE[case] for case in ("unschedulable", "image-pull-backoff", "running", "succeeded")]
    assert stuck_pending(pods, now=CREATED + 599, pending_timeout_s=600) == {}
    stuck = stuck_pending(pods, now=CREATED + 601, pending_timeout_s=600)
    assert set(stuck) == {2, 0}
    assert stuck[2].reason.startswith("Unschedulable: 0/4 nodes are available")
    assert stuck[0].reason.startswith("ImagePullBackOff")


# -- exit summaries from pods -------------------------------------------------------------


def summaries(states: dict[int, PodHostState], recorded=None, *, hosts=4, now=CREATED + 60, launched_at=CREATED,
              cancelled=False, successes=()) -> dict[int, PodExitSummary]:
    return pod_exit_summaries(hosts, states, recorded or {}, now=now, launched_at=launched_at, cancelled=cancelled,
                              recorded_success=lambda index: index in successes, pending_timeout_s=600)


def test_ended_pods_give_exit_summaries_that_say_why():
    states = host_states([BY_CASE[case] for case in ("oomkilled", "evicted", "succeeded", "error-exit-1")])
    found = summaries({**states}, hosts=5, successes={0})
    assert set(found) == {0, 1, 2, 3, 4}
    assert found[3].stopped and found[3].describe() == (  # no pod, and others failed: the platform removed it
        "ended without an exit code (its pod was deleted) (stopped after another host failed)")
    assert found[2].signal == "SIGKILL" and found[2].exit_code is None and found[2].failed
    assert found[2].describe() == "was killed by SIGKILL (OOMKilled)"
    assert found[4].describe().startswith("was killed by SIGKILL (Evicted: The node was low on resource: memory.")
    assert found[1].describe() == "exited with code 1" and found[1].failed
    assert found[0].recorded_success and not found[0].failed
    stored = ExitSummary.from_json(found[2].to_json())  # a plain exit.json: every reader can read it
    assert (stored.host_index, stored.signal, stored.exit_code) == (2, "SIGKILL", None)


def test_a_host_stopped_by_the_platform_is_stopped_not_failed():
    found = summaries(host_states([BY_CASE["deleted-sigterm"]]), hosts=6)
    assert found[5].stopped and not found[5].failed
    assert found[5].describe() == "was killed by SIGTERM (stopped after another host failed)"


def test_a_pod_pending_past_the_bound_fails_its_host_with_the_reason():
    states = host_states([BY_CASE["unschedulable"], BY_CASE["running"]])
    assert summaries(states, now=CREATED + 599) == {}
    found = summaries(states, now=CREATED + 601)
    assert set(found) == {1, 2, 3}  # hosts 1 and 3 have no pod: stopped, now that host 2 failed
    assert found[1].stopped and found[3].stopped
    assert found[2].failed and found[2].never_started
    assert found[2].describe().startswith(
        "never started: its pod was Pending for more than 600 s: Unschedulable: 0/4 nodes are available")


# -- termination messages: the last words of a host that never uploaded a log ---------------


def test_a_failed_containers_termination_message_becomes_its_hosts_last_lines_whatever_the_reason():
    missing = pod_host_state(BY_CASE["no-kinetic-nb"])
    assert missing.message_tail == ("/usr/bin/python: Error while finding module specification for "
                                    "'kinetic_nb.agent' (ModuleNotFoundError: No module named 'kinetic_nb')",)
    forbidden = pod_host_state(BY_CASE["bucket-403"])  # restarted: the first run's message, from lastState
    assert forbidden.message_tail[0] == "kinetic agent: job gs://ml-bucket/jobs/kn-20261129-234752-3e8d32, host 1"
    assert forbidden.message_tail[-1].startswith("google.api_core.exceptions.Forbidden: 403 GET")
    assert pod_host_state(BY_CASE["error-exit-1"]).message_tail == ()  # no message: nothing to add
    # A reason of its own (OOMKilled) keeps the message too, as lines, never inside the one-line reason.
    oom = json.loads(json.dumps(BY_CASE["oomkilled"]))
    oom["status"]["containerStatuses"][0]["state"]["terminated"]["message"] = "step 41\nstep 42\n"
    state = pod_host_state(oom)
    assert (state.reason, state.message_tail) == ("OOMKilled", ("step 41", "step 42"))


def test_the_tail_keeps_the_last_lines_each_cut_to_a_length():
    message = "\n".join(f"line {number}" for number in range(50)) + "\n\n" + "x" * 5000 + "\n"
    tail = message_tail(message)
    assert len(tail) == 20 and tail[0] == "line 31" and tail[-2] == "line 49"
    assert len(tail[-1]) == 1000 and tail[-1].endswith("...")
    assert message_tail(None) == message_tail("") == ()


def test_the_pods_last_lines_are_stored_with_the_hosts_exit_record():
    found = summaries(host_states([BY_CASE["no-kinetic-nb"], BY_CASE["bucket-403"]]), hosts=2)
    assert found[0].stderr_tail == pod_host_state(BY_CASE["no-kinetic-nb"]).message_tail
    assert found[0].describe() == "exited with code 1"  # the lines travel apart from the one-line description
    stored = ExitSummary.from_json(found[1].to_json())  # a plain exit.json, which every reader shows
    assert stored.stderr_tail == pod_host_state(BY_CASE["bucket-403"]).message_tail
    assert stored.stderr_tail[-1].startswith("google.api_core.exceptions.Forbidden: 403")


def test_hosts_without_pods():
    running = host_states([BY_CASE["running"]])
    # Just launched: the controllers have not made the pods yet.
    assert summaries(running, now=CREATED + 5) == {}
    # Cancelled, or another host failed: the missing pods were deleted, their hosts stopped.
    found = summaries(running, cancelled=True)
    assert set(found) == {1, 2, 3} and all(summary.stopped for summary in found.values())
    failed = {1: ExitSummary(host_index=1, exit_code=1)}
    assert set(summaries(running, failed)) == {2, 3}
    # No pod long after the launch: never created (a quota, a webhook); unless the host had finished.
    found = summaries(running, now=CREATED + 601, successes={3})
    assert found[1].never_started and "no pod was created" in found[1].describe()
    assert found[3].recorded_success and not found[3].failed
    # Already recorded hosts are left alone.
    recorded = {index: ExitSummary(host_index=index, exit_code=0, recorded_success=True) for index in (1, 2, 3)}
    assert summaries(running, recorded, now=CREATED + 601) == {}


def test_a_failed_root_pod_fails_every_host_without_a_pod_at_once_with_its_last_words():
    """The root failed (a bucket its service account may not read): the cluster deletes the workload with it, so
    hosts still Pending or without a pod would wait out the pending limit for nothing; they fail now, saying
    why. A running host is left to its own record (its pod's deletion stops it)."""
    pods = [BY_CASE["root-failed"], BY_CASE["running"], BY_CASE["unschedulable"]]
    root = root_failure(pods)
    assert root.reason == ("the job's root pod kn-20261129-234752-3e8d32-root-x7k2p failed (exit code 1); it ends "
                           "the job")
    assert "does not have storage.objects.get access" in root.last_lines[-1]
    assert root_failure([BY_CASE["running"], BY_CASE["unschedulable"]]) is None  # host pods are no root
    states = host_states(pods)
    summaries = pod_exit_summaries(4, states, {}, now=CREATED + 60, launched_at=CREATED, cancelled=False,
                                   recorded_success=lambda _: False, root_failed=root)
    assert sorted(summaries) == [1, 2, 3]  # host 0 runs; 2 is Pending; 1 and 3 have no pod yet
    for summary in summaries.values():
        assert summary.failed and summary.never_started and summary.describe() == f"never started: {root.reason}"
        assert summary.stderr_tail == root.last_lines  # shown as the host's last lines
