"""Why a Pending host waits, or fails at once: pods and their Events, as table tests.

``data/events.json`` holds Events as ``kubectl get events -o json`` returns
them (written by hand after the scheduler's, the cluster autoscaler's and the
kubelet's real messages; names and ids made up), each tagged with the
scenario it belongs to (``test.kinetic-nb/scenario``). The pods are
``data/pods.json``'s. Both files are checked against the core/v1 schemas.
"""

from __future__ import annotations

import json
import pathlib

import kubernetes_validate
import pytest

from kinetic_nb.backends.kubernetes.events import pending_verdicts
from kinetic_nb.backends.kubernetes.pods import host_states, pod_exit_summaries

from .k8s_cluster import to_client_object

DATA = pathlib.Path(__file__).parent / "data"
PODS = {pod["metadata"]["annotations"]["test.kinetic-nb/case"]: pod
        for pod in json.loads((DATA / "pods.json").read_text())["items"]}
EVENTS = json.loads((DATA / "events.json").read_text())["items"]
CREATED = 1795996075.0  # when the fixture pods were created

WAIT_TPU = "waiting for TPU nodes: scale-up triggered"
UNSCHEDULABLE = ("Unschedulable: 0/4 nodes are available: 4 Insufficient google.com/tpu. preemption: 0/4 nodes are "
                 "available: 4 No preemption victims found for incoming pod.")

#: scenario -> (pods, accelerator kind, {host: ("wait", text) or ("fail", text the reason starts with)})
SCENARIOS = {
    "scale-up-triggered": (["unschedulable"], "tpu", {2: ("wait", WAIT_TPU)}),
    "not-triggered-no-matching-pool": (["unschedulable"], "tpu", {2: (
        "fail", "no node pool can add TPU nodes for it: pod didn't trigger scale-up: 3 node(s) didn't match "
                "Pod's node affinity/selector")}),
    "not-triggered-pool-at-maximum": (["unschedulable"], "tpu", {2: (
        "wait", "waiting for TPU nodes: the matching node pool is at its maximum size")}),
    "scale-up-failed-quota": (["unschedulable"], "tpu", {2: (
        "fail", "scale-up of TPU nodes failed: Node scale up in zones us-west4-a associated with this pod failed: "
                "GCE quota exceeded.")}),
    # A stockout: the autoscaler keeps trying, the host waits (bounded by the pending limit).
    "scale-up-failed-no-capacity": (["unschedulable"], "tpu", {2: (
        "wait", "waiting for capacity: Node scale up in zones us-west4-a associated with this pod failed: "
                "GCE out of resources.")}),
    "scale-up-failed-no-capacity-and-quota": (["unschedulable"], "tpu", {2: (
        "wait", "waiting for capacity: Node scale up in zones us-west4-a, us-west4-b associated with this pod "
                "failed: GCE out of resources, GCE quota exceeded.")}),
    "scale-up-in-backoff": (["unschedulable"], "tpu", {2: (
        "wait", "waiting for capacity: pod didn't trigger scale-up: 1 in backoff after failed scale-up, 2 node(s) "
                "didn't match Pod's node affinity/selector")}),
    "scale-up-failed-invalid-topology": (["unschedulable"], "tpu", {2: (
        "fail", "scale-up of TPU nodes failed: Node scale up in zones us-west4-a associated with this pod failed: "
                "Invalid TPU topology: 4x4 is not supported for ct5lp-hightpu-8t.")}),
    "scale-up-triggered-by-another-pod-of-the-job": (["unschedulable", "unschedulable-worker-1"], "tpu", {
        1: ("wait", WAIT_TPU), 2: ("wait", WAIT_TPU)}),
    "pulling": (["container-creating"], "cpu", {2: ("wait", "pulling image registry.example/kinetic-jax:1.0")}),
    "pulled-and-creating": (["container-creating"], "cpu", {2: ("wait", "ContainerCreating")}),
    "image-pull-backoff": (["image-pull-backoff"], "tpu", {0: (
        "fail", 'ImagePullBackOff: Back-off pulling image "registry.example/kinetic-jax:typo" '
                '(registry.example/kinetic-jax:typo: not found)')}),
    # A registry that times out is tried again by the kubelet; one that refuses the image is final.
    "image-pull-timeout": (["image-pull-backoff"], "tpu", {0: (
        "wait", "waiting to pull image registry.example/kinetic-jax:typo: dial tcp 10.0.0.7:443: i/o timeout")}),
    "image-pull-forbidden": (["image-pull-backoff"], "tpu", {0: (
        "fail", 'ImagePullBackOff: Back-off pulling image "registry.example/kinetic-jax:typo" (pulling from host '
                'registry.example failed with status code [manifests typo]: 403 Forbidden)')}),
    "stale-events-of-an-earlier-pod-and-of-another-job": (["unschedulable"], "tpu", {2: ("wait", UNSCHEDULABLE)}),
    # No Events at all: the pod's own status decides.
    None: (["unschedulable", "err-image-pull", "create-container-config-error", "running"], "tpu", {
        2: ("wait", UNSCHEDULABLE),
        1: ("fail", 'ErrImagePull: failed to pull and unpack image "registry.example/kinetic-jax:typo"'),
        3: ("fail", 'CreateContainerConfigError: secret "kn-20261129-234752-3e8d32-secrets" not found'),
    }),
}


def events_of(scenario: str | None) -> list[dict]:
    return [event for event in EVENTS if event["metadata"]["annotations"]["test.kinetic-nb/scenario"] == scenario]


#: Another job's pod triggered a scale-up: nothing to do with this job.
OTHER_JOB = [event for event in EVENTS if not event["involvedObject"]["name"].startswith("kn-20261129-234752-3e8d32")]
assert OTHER_JOB


def test_the_fixture_events_are_api_shaped_and_each_belongs_to_a_scenario():
    assert {event["metadata"]["annotations"]["test.kinetic-nb/scenario"] for event in EVENTS} == set(
        SCENARIOS) - {None}
    for event in EVENTS:
        kubernetes_validate.validate(event, "1.33", strict=True)


@pytest.mark.parametrize("scenario", SCENARIOS, ids=str)
def test_pending_verdicts(scenario):
    cases, kind, expected = SCENARIOS[scenario]
    states = host_states(PODS[case] for case in cases)
    # A namespace's listing has other jobs' Events too: only this job's pods count.
    verdicts = pending_verdicts(states, [*events_of(scenario), *OTHER_JOB], accelerator_kind=kind)
    assert set(verdicts) == set(expected)  # only Pending hosts get a verdict
    for index, (outcome, text) in expected.items():
        verdict = verdicts[index]
        if outcome == "wait":
            assert (verdict.waiting, verdict.failure) == (text, ""), verdict.waiting
        else:
            assert verdict.failure.startswith(text), verdict.failure
            assert "\n" not in verdict.failure and len(verdict.failure) <= 300


def test_a_gpu_host_waits_for_gpu_nodes():
    states = host_states([PODS["unschedulable"]])
    [verdict] = pending_verdicts(states, events_of("scale-up-triggered"), accelerator_kind="gpu").values()
    assert verdict.waiting == "waiting for GPU nodes: scale-up triggered"


def test_client_event_objects_give_what_their_json_gives():
    events = to_client_object({"apiVersion": "v1", "kind": "EventList", "metadata": {}, "items": EVENTS},
                              "CoreV1EventList").items
    states = host_states([PODS["unschedulable"], PODS["image-pull-backoff"]])
    assert pending_verdicts(states, events, accelerator_kind="tpu") == pending_verdicts(
        states, EVENTS, accelerator_kind="tpu")


def test_a_wait_that_can_never_end_fails_its_host_at_once_and_the_others_are_stopped():
    states = host_states([PODS["running"], PODS["unschedulable"]])
    verdicts = pending_verdicts(states, events_of("not-triggered-no-matching-pool"), accelerator_kind="tpu")
    summaries = pod_exit_summaries(
        4, states, {}, now=CREATED + 30, launched_at=CREATED, cancelled=False, recorded_success=lambda _: False,
        pending_failures={index: verdict.failure for index, verdict in verdicts.items() if verdict.failure})
    assert summaries[2].failed and summaries[2].never_started
    assert summaries[2].describe().startswith("never started: no node pool can add TPU nodes for it: pod didn't")
    assert summaries[1].stopped and summaries[3].stopped  # no pods yet, and the job has failed
    assert 0 not in summaries  # still running: its agent reports its own end


def test_a_wait_with_progress_fails_only_past_the_pending_limit_and_says_what_it_waited_for():
    states = host_states([PODS["unschedulable"]])
    verdicts = pending_verdicts(states, events_of("scale-up-triggered"), accelerator_kind="tpu")
    waiting = {index: verdict.waiting for index, verdict in verdicts.items()}
    common = dict(launched_at=CREATED, cancelled=False, recorded_success=lambda _: False, pending_timeout_s=2700,
                  waiting=waiting)
    assert 2 not in pod_exit_summaries(4, states, {}, now=CREATED + 2700, **common)
    [late] = [summary for index, summary in pod_exit_summaries(4, states, {}, now=CREATED + 2701, **common).items()
              if index == 2]
    assert late.describe() == f"never started: its pod was Pending for more than 2700 s: {WAIT_TPU}"


def test_a_wait_for_capacity_says_how_long_it_has_lasted_and_ends_at_the_pending_limit():
    """A stockout keeps the host waiting, the panel saying for how long, until the pending limit fails it with
    what it waited for."""
    states = host_states([PODS["unschedulable"]])
    [verdict] = pending_verdicts(states, events_of("scale-up-failed-no-capacity"), accelerator_kind="tpu",
                                 now=CREATED + 12 * 60 + 5).values()
    assert verdict.waiting == ("waiting for capacity (12 min so far): Node scale up in zones us-west4-a associated "
                               "with this pod failed: GCE out of resources.") and not verdict.failure
    common = dict(launched_at=CREATED, cancelled=False, recorded_success=lambda _: False, pending_timeout_s=2700,
                  waiting={2: verdict.waiting})
    assert 2 not in pod_exit_summaries(4, states, {}, now=CREATED + 2700, **common)
    late = pod_exit_summaries(4, states, {}, now=CREATED + 2701, **common)[2]
    assert late.describe().startswith("never started: its pod was Pending for more than 2700 s: waiting for capacity")
