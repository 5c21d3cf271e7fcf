"""The ``ray_cluster`` fixture: one real 4-node Ray cluster for the whole test session, started on first use.

The tests that use it run one after another (where the first of them would), and the cluster is stopped as
soon as the last of them has run, not at the session's end: its twenty processes take about 5% of this
machine's CPU even idle, which the rest of the suite would pay for. That last test fails (in its teardown)
if any of the cluster's processes survived. Tests that kill a node start it again before they return.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .ray_cluster import RayCluster

#: Nodes in the test cluster: a head and three workers, as a 4-host slice has 4 machines.
RAY_TEST_NODES = 4


#: The cluster while it runs (at most one).
_running: list[RayCluster] = []


def _uses_the_cluster(item: pytest.Item | None) -> bool:
    """Whether ``item`` asks for the cluster (as an argument, or marked ``ray_cluster`` where it gets it later)."""
    return item is not None and ("ray_cluster" in getattr(item, "fixturenames", ())
                                 or item.get_closest_marker("ray_cluster") is not None)


def gather_the_clusters_tests(items: list[pytest.Item]) -> None:
    """Move every test that uses the cluster next to the first of them (``pytest_collection_modifyitems``)."""
    ray = [item for item in items if _uses_the_cluster(item)]
    if ray:
        first = items.index(ray[0])
        others = [item for item in items if not _uses_the_cluster(item)]
        items[:] = others[:first] + ray + others[first:]


def stop_after_the_clusters_last_test(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Stop the cluster once ``item``, the last test to use it, is done (``pytest_runtest_teardown``)."""
    if _running and _uses_the_cluster(item) and not _uses_the_cluster(nextitem):
        survivors = _running.pop().stop()
        assert survivors == [], f"Ray processes survived the cluster's stop: {survivors}"


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[RayCluster]:
    cluster = RayCluster(RAY_TEST_NODES)
    _running.append(cluster)
    try:
        cluster.start()  # inside the try: a start that fails half way leaves its head's processes to stop
        import kinetic_nb.backends.ray.backend as ray_backend

        ray_backend.connect(cluster.address)
        cluster.wait_for_nodes(RAY_TEST_NODES)
        yield cluster
    finally:
        survivors = cluster.stop() if cluster in _running else []  # else stopped after its last test
        if cluster in _running:
            _running.remove(cluster)
    assert survivors == [], f"Ray processes survived the cluster's stop: {survivors}"
