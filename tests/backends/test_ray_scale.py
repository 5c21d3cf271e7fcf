"""A 64-host job on the tests' 4-node Ray cluster, and the calls the client makes to Ray at each look.

A node per host is too heavy here, so the hosts share the nodes as ``--ray-pack`` lets them (``SPREAD``, a
hundredth of a CPU each): the same actors, agents and records as one host per node, no second protocol. A
look is what the client's poller asks the backend at every poll (``Backend.observe``); the test counts,
during each look, the calls into Ray: ``ray.wait``, ``ray.get``, ``ray.nodes``, the placement group's
table, and each actor method called (``.remote()``, one request to that host's actor). What a look asks
must not grow with the hosts: the most of each kind one look made at 64 hosts stays within a small bound that
names no number of hosts, and no look calls an actor.

Each host's actor is asked once, as the job launches, to answer when its agent ends (``RayHost.agent_exit``);
a look then makes one ``ray.wait`` over the starts not yet answered and one over those ends, and one
``ray.get`` for what was answered: before, it asked every started host's actor again at every other look (an
actor call, a ``ray.wait`` and a ``ray.get`` per host: 33 actor calls in one look at 64 hosts, 6 at 8).

Cost here (2 cores, shared): the 64-host job about a minute (Ray starts one worker process at a time per
node). The bound is absolute, so a smaller job beside it would prove nothing more (an 8-host job made the same
calls per look and cost the suite half a minute).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Any

import pytest

import kinetic_nb
from kinetic_nb.backends.ray.backend import RayBackend, connect

#: The slice the issue asks for: a v5e-256's 64 hosts, 16 to a node of the test cluster.
LARGE = 64
JOB_TIMEOUT_S = 600.0

#: The most calls of each kind one look may make, whatever the hosts: a wait and a get over the starts not yet
#: answered and over the agents' ends, the cluster's nodes and the placement group while it is not placed.
CALLS_PER_LOOK = {"ray.wait": 2, "ray.get": 2, "ray.nodes": 1, "ray.util.placement_group_table": 1}

pytestmark = pytest.mark.timeout(1200)

Look = collections.Counter


class LookCountingBackend(RayBackend):
    """The ray backend with hosts sharing nodes, recording the calls into Ray each look (each ``observe``) made."""

    def __init__(self, address: str):
        super().__init__(address, pack=True)
        self.looks: list[Look] = []
        self.counting = threading.local()

    def count(self, kind: str) -> None:
        look = getattr(self.counting, "look", None)
        if look is not None:
            look[kind] += 1

    def observe(self, *args: Any, **kwargs: Any) -> Any:
        self.counting.look = Look()
        try:
            return super().observe(*args, **kwargs)
        finally:
            self.looks.append(self.counting.look)
            self.counting.look = None


@pytest.fixture
def counted_ray(ray_cluster, monkeypatch):
    """``new()``: a counting backend on the test cluster; every call into Ray in a look is counted by it."""
    from ray.actor import ActorMethod

    ray = connect(ray_cluster.address)
    backends: list[LookCountingBackend] = []

    def counted(kind: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def counting(*args: Any, **kwargs: Any) -> Any:
            for backend in backends:
                backend.count(kind)
            return call(*args, **kwargs)
        return counting

    for name in ("wait", "get", "nodes"):
        monkeypatch.setattr(ray, name, counted(f"ray.{name}", getattr(ray, name)))
    monkeypatch.setattr(ray.util, "placement_group_table",
                        counted("ray.util.placement_group_table", ray.util.placement_group_table))
    remote = ActorMethod.remote

    def actor_call(method: Any, *args: Any, **kwargs: Any) -> Any:
        for backend in backends:
            backend.count(f"actor.{method._method_name}.remote")
        return remote(method, *args, **kwargs)

    monkeypatch.setattr(ActorMethod, "remote", actor_call)

    def new() -> LookCountingBackend:
        backends.append(LookCountingBackend(ray_cluster.address))
        return backends[-1]

    yield new
    assert ray_cluster.wait_until_nothing_is_left() == []


def most_per_look(looks: list[Look]) -> dict[str, int]:
    """The most calls of each kind that one look made."""
    most: dict[str, int] = {}
    for look in looks:
        for kind, count in look.items():
            most[kind] = max(most.get(kind, 0), count)
    return most


def run_job(backend: LookCountingBackend, tmp_path, hosts: int) -> dict[str, int]:
    """A one-shot job of ``hosts`` hosts (framework none) through the client's own wait loop; the most calls of
    each kind one of its looks made."""
    handle = kinetic_nb.submit("import os\n(int(os.environ['KINETIC_HOST_INDEX']), int(os.environ['KINETIC_NUM_HOSTS']))",
                               hosts=hosts, framework="none", backend=backend, storage=f"file://{tmp_path}/jobs",
                               quiet=True, timeout=JOB_TIMEOUT_S)
    assert handle.result(timeout=JOB_TIMEOUT_S) == (0, hosts)
    assert backend.looks, "the client never looked at the platform"
    return most_per_look(backend.looks)


def test_a_64_host_jobs_looks_make_a_bounded_number_of_calls_into_ray(counted_ray, tmp_path):
    looks = run_job(counted_ray(), tmp_path, LARGE)
    # whatever the hosts: no call to an actor, at most a wait and a get of each kind
    assert all(count <= CALLS_PER_LOOK.get(kind, 0) for kind, count in looks.items()), \
        f"most calls per look at {LARGE} hosts: {looks}"
